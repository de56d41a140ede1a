"""Tokenizers: SentencePiece (a tiny model trained here) and Megatron's NullTokenizer."""

import io
import random

import pytest
import sentencepiece

from megatron_het.data import build_tokenizer
from megatron_het.errors import UserError

WORDS = (
    "the quick brown fox jumps over a lazy dog while data flows through every stage "
    "of the pipeline and tokens become samples"
).split()


def corpus_lines(n: int, seed: int = 0, words_per_line: int = 12) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words_per_line)) for _ in range(n)]


def train_sentencepiece(path: str, vocab_size: int = 120) -> str:
    """Train a tiny BPE SentencePiece model on synthetic text; write it to ``path``."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines(300)),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        minloglevel=2,
    )
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


@pytest.fixture
def spm_path(tmp_path):
    return train_sentencepiece(str(tmp_path / "tok.model"))


def test_sentencepiece_matches_the_model(spm_path):
    tok = build_tokenizer("SentencePieceTokenizer", spm_path)
    reference = sentencepiece.SentencePieceProcessor(model_file=spm_path)
    assert tok.vocab_size == reference.vocab_size() == 120
    assert tok.eod == reference.eos_id() == 2
    assert tok.bos == reference.bos_id() == 1
    assert tok.pad is None  # the model defines no pad piece
    text = "the lazy fox flows through the pipeline"
    ids = tok.tokenize(text)
    assert ids == reference.encode(text)
    assert tok.eod not in ids and tok.bos not in ids  # no specials added by tokenize
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.detokenize(ids) == text


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.vocab_size == 101 and tok.eod == 100
    assert tok.bos is None and tok.pad is None
    assert tok.tokenize("5 17\t 99\n0") == [5, 17, 99, 0]
    assert tok.tokenize("") == []
    assert tok.detokenize([5, 17, 100]) == "5 17 100"
    with pytest.raises(UserError, match="integer ids"):
        tok.tokenize("5 seven")
    with pytest.raises(UserError, match="outside"):
        tok.tokenize("101")


def test_unknown_type_lists_known():
    with pytest.raises(UserError) as info:
        build_tokenizer("GPT2BPETokenizer")
    message = str(info.value)
    assert "GPT2BPETokenizer" in message
    assert "NullTokenizer" in message and "SentencePieceTokenizer" in message
    assert "\n" not in message


def test_missing_or_bad_model(tmp_path):
    missing = str(tmp_path / "nope.model")
    with pytest.raises(UserError, match="nope.model"):
        build_tokenizer("SentencePieceTokenizer", missing)
    corrupt = tmp_path / "corrupt.model"
    corrupt.write_bytes(b"not a sentencepiece model")
    with pytest.raises(UserError, match="corrupt.model") as info:
        build_tokenizer("SentencePieceTokenizer", str(corrupt))
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="--tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(UserError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
