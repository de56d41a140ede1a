"""tools/convert_checkpoint.py --target-format hf writes the run's tokenizer for transformers."""

from __future__ import annotations

import io
import json
import pathlib
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
import sentencepiece  # noqa: E402

from megatron_het.checkpoint.hf import (  # noqa: E402
    hf_config_to_model_config,
    hf_to_megatron_het_state,
)
from megatron_het.checkpoint.io import save_checkpoint  # noqa: E402
from megatron_het.errors import UserError  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
from tools import convert_checkpoint  # noqa: E402

WORDS = (
    "the quick brown fox jumps over a lazy dog while data flows through every stage of "
    "the pipeline; Zürich 42!"
).split()
TEXTS = [
    "the quick brown fox",
    "  two  spaces and\na newline",
    "Zürich 42! unseen XYZ words",
    "pipeline stage",
]
VOCAB = 64


def train_tokenizer(path: pathlib.Path, model_type: str, **options) -> pathlib.Path:
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(300)]
    model = io.BytesIO()
    settings = dict(
        vocab_size=50,
        character_coverage=1.0,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
    )
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type=model_type,
        **{**settings, **options},
    )
    path.write_bytes(model.getvalue())
    return path


def tiny_checkpoint(
    save_dir: pathlib.Path, metadata: dict, vocab_size: int = VOCAB
) -> transformers.LlamaForCausalLM:
    """A tiny Llama saved as a megatron_het checkpoint with ``metadata``; returns the HF twin."""
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    cfg = hf_config_to_model_config(json.loads(config.to_json_string()))
    save_checkpoint(
        save_dir, 5, cfg, hf_to_megatron_het_state(hf.state_dict(), cfg), metadata=metadata
    )
    return hf


def run_metadata(tokenizer_model: pathlib.Path) -> dict:
    """What a training run records: its argv and run_config (data part)."""
    return {
        "argv": [
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            str(tokenizer_model),
        ],
        "run_config": {
            "data": {
                "tokenizer_type": "SentencePieceTokenizer",
                "tokenizer_model": str(tokenizer_model),
            }
        },
    }


def to_hf(load_dir: pathlib.Path, save_dir: pathlib.Path, *extra: str) -> None:
    convert_checkpoint.main(
        [
            "--source-format",
            "megatron_het",
            "--target-format",
            "hf",
            "--load-dir",
            str(load_dir),
            "--save-dir",
            str(save_dir),
            *extra,
        ]
    )


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_recorded_tokenizer_loads_with_auto_classes(tmp_path, model_type) -> None:
    spm = train_tokenizer(tmp_path / "tok.model", model_type)
    hf = tiny_checkpoint(tmp_path / "ckpt", run_metadata(spm))
    to_hf(tmp_path / "ckpt", tmp_path / "out")

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    processor = sentencepiece.SentencePieceProcessor(model_file=str(spm))
    for text in TEXTS:  # the ids the training data was tokenized to: no BOS/EOS added
        assert tokenizer(text)["input_ids"] == processor.encode(text), text
    assert tokenizer.eos_token_id == processor.eos_id() == model.config.eos_token_id
    assert tokenizer.decode(processor.encode(TEXTS[0])) == TEXTS[0]
    ids = tokenizer(TEXTS[2], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == spm.read_bytes()


@pytest.mark.parametrize(
    "options",
    [
        {"add_dummy_prefix": False},
        {"remove_extra_whitespaces": False},
        {"add_dummy_prefix": False, "remove_extra_whitespaces": False},
        {"byte_fallback": True, "vocab_size": 300},
    ],
    ids=["no-dummy-prefix", "keep-spaces", "neither", "byte-fallback"],
)
def test_the_model_files_own_text_options_are_followed(tmp_path, options) -> None:
    """The normalizer, pre-tokenizer and decoder come from the model's NormalizerSpec, not
    from what the installed transformers version's conversion happens to build."""
    model_type = "unigram" if options.get("byte_fallback") else "bpe"
    spm = train_tokenizer(tmp_path / "tok.model", model_type, **options)
    tiny_checkpoint(tmp_path / "ckpt", run_metadata(spm), 512)
    to_hf(tmp_path / "ckpt", tmp_path / "out")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(spm))
    for text in TEXTS + [" leading space", "trailing  ", "\u4e2d\u6587 bytes \u00e9"]:
        ids = processor.encode(text)
        assert tokenizer(text)["input_ids"] == ids, text
        if processor.unk_id() not in ids:  # the two render an unknown piece differently
            assert tokenizer.decode(ids) == processor.decode(ids), text
    # Ids no encoding gives but a model may generate: leading whitespace pieces.
    space, word = processor.piece_to_id("\u2581"), processor.piece_to_id("t")
    the = processor.piece_to_id("\u2581the")
    for ids in ([space, the], [space, space, word], [the], [word, space, the], [space]):
        assert tokenizer.decode(ids) == processor.decode(ids), ids


def test_a_conversion_that_tokenizes_differently_is_refused(tmp_path, monkeypatch) -> None:
    """What transformers 5.17's conversion wrote (no dummy prefix, no whitespace clean-up)
    fails the round trip with one clear error; nothing is written."""
    from tokenizers import normalizers

    from megatron_het.checkpoint import hf as hf_module

    def as_517_wrote(backend, source):
        pieces = real(backend, source)
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = None
        return pieces

    real = hf_module._set_spm_text_pipeline
    monkeypatch.setattr(hf_module, "_set_spm_text_pipeline", as_517_wrote)
    spm = train_tokenizer(tmp_path / "tok.model", "bpe")
    tiny_checkpoint(tmp_path / "ckpt", run_metadata(spm))
    with pytest.raises(
        UserError,
        match=r"tokenizes 'the quick brown fox' to \[.*but the "
        r"SentencePiece model to",
    ):
        hf_module.write_hf_tokenizer(spm, tmp_path / "out")
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_control_symbols_do_not_fail_the_round_trip(tmp_path) -> None:
    """A control piece ("[CTL]") is never matched in text by SentencePiece but always by
    transformers; the probe texts hold ordinary pieces only, so a correct tokenizer passes."""
    spm = train_tokenizer(tmp_path / "tok.model", "bpe", control_symbols=["[CTL]"])
    tiny_checkpoint(tmp_path / "ckpt", run_metadata(spm))
    to_hf(tmp_path / "ckpt", tmp_path / "out")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(spm))
    assert tokenizer(TEXTS[0])["input_ids"] == processor.encode(TEXTS[0])


@pytest.mark.parametrize("option", ["treat_whitespace_as_suffix", "escape_whitespaces=false"])
def test_options_the_hf_tokenizer_cannot_express_are_refused(tmp_path, option) -> None:
    if option == "treat_whitespace_as_suffix":
        spm = train_tokenizer(tmp_path / "tok.model", "bpe", treat_whitespace_as_suffix=True)
    else:  # the trainers refuse it; a model file may still carry it
        from sentencepiece import sentencepiece_model_pb2

        spm = train_tokenizer(tmp_path / "tok.model", "bpe")
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(spm.read_bytes())
        proto.normalizer_spec.escape_whitespaces = False
        spm.write_bytes(proto.SerializeToString())
    tiny_checkpoint(tmp_path / "ckpt", run_metadata(spm))
    with pytest.raises(UserError, match=f"trained with {option}.*--no-tokenizer"):
        to_hf(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    to_hf(tmp_path / "ckpt", tmp_path / "out", "--no-tokenizer")  # the weights alone
    assert (tmp_path / "out" / "config.json").is_file()
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_no_tokenizer_flag_conflicts_and_formats(tmp_path) -> None:
    spm = train_tokenizer(tmp_path / "tok.model", "bpe")
    tiny_checkpoint(tmp_path / "ckpt", run_metadata(tmp_path / "gone.model"))
    with pytest.raises(UserError, match="contradict"):
        to_hf(tmp_path / "ckpt", tmp_path / "out", "--tokenizer-model", str(spm), "--no-tokenizer")
    with pytest.raises(UserError, match="--no-tokenizer applies to --target-format hf only"):
        convert_checkpoint.main(
            [
                "--source-format",
                "hf",
                "--target-format",
                "megatron_het",
                "--load-dir",
                str(tmp_path),
                "--save-dir",
                str(tmp_path / "x"),
                "--no-tokenizer",
            ]
        )
    to_hf(tmp_path / "ckpt", tmp_path / "out", "--no-tokenizer")  # the recorded model is gone
    assert (tmp_path / "out" / "config.json").is_file()


def test_flag_supplies_a_tokenizer_the_metadata_lacks(tmp_path, capsys) -> None:
    tiny_checkpoint(tmp_path / "ckpt", {"converted_from": "hf"})
    to_hf(tmp_path / "ckpt", tmp_path / "bare")
    assert "no tokenizer written" in capsys.readouterr().err
    assert not (tmp_path / "bare" / "tokenizer.json").exists()
    assert (tmp_path / "bare" / "config.json").is_file()

    spm = train_tokenizer(tmp_path / "tok.model", "bpe")
    to_hf(tmp_path / "ckpt", tmp_path / "out", "--tokenizer-model", str(spm))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer("the lazy dog")["input_ids"] == sentencepiece.SentencePieceProcessor(
        model_file=str(spm)
    ).encode("the lazy dog")


def test_flag_overrides_a_recorded_tokenizer_that_is_gone(tmp_path) -> None:
    tiny_checkpoint(tmp_path / "ckpt", run_metadata(tmp_path / "moved.model"))
    with pytest.raises(UserError, match="moved.model.*--tokenizer-model"):
        to_hf(tmp_path / "ckpt", tmp_path / "out")
    spm = train_tokenizer(tmp_path / "tok.model", "bpe")
    to_hf(tmp_path / "ckpt", tmp_path / "out", "--tokenizer-model", str(spm))
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").eos_token == "</s>"


def test_null_tokenizer_runs_record_no_tokenizer() -> None:
    assert (
        convert_checkpoint.recorded_tokenizer_model(
            {
                "run_config": {
                    "data": {"tokenizer_type": "NullTokenizer", "tokenizer_model": None}
                },
                "argv": ["--tokenizer-type", "NullTokenizer"],
            }
        )
        is None
    )
    assert (
        convert_checkpoint.recorded_tokenizer_model({"argv": ["--tokenizer-model=/t/tok.model"]})
        == "/t/tok.model"
    )


@pytest.mark.parametrize(
    "setup, message",
    [
        ("not_spm", "cannot read tokenizer model"),
        ("too_big", "has 50 pieces but the checkpoint's vocabulary is 40"),
    ],
)
def test_bad_tokenizer_models_are_user_errors(tmp_path, setup, message) -> None:
    spm = train_tokenizer(tmp_path / "tok.model", "bpe")
    if setup == "not_spm":
        spm.write_bytes(b"not a sentencepiece model")
    tiny_checkpoint(tmp_path / "ckpt", run_metadata(spm), 40 if setup == "too_big" else VOCAB)
    with pytest.raises(UserError, match=message):
        to_hf(tmp_path / "ckpt", tmp_path / "out")
