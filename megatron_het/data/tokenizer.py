"""Tokenizers selected by Megatron's ``--tokenizer-type`` names.

Every tokenizer offers the same small surface: ``vocab_size``, ``tokenize(text) -> list[int]``,
``detokenize(ids) -> str`` and the special ids ``eod``, ``bos`` and ``pad`` (``bos`` and ``pad``
may be ``None`` when the vocabulary has no such token).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from megatron_het.errors import UserError


class Tokenizer(Protocol):
    """What the data path and the training loop need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    @property
    def bos(self) -> int | None: ...

    @property
    def pad(self) -> int | None: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...


class SentencePieceTokenizer:
    """A SentencePiece model, as Megatron's GPT SentencePiece tokenizer uses it.

    ``tokenize`` adds no BOS/EOS of its own (preprocessing appends ``eod`` with
    ``--append-eod``); ``eod`` is the model's EOS id. ``bos``/``pad`` are ``None`` when the model
    defines no such piece.
    """

    def __init__(self, model_path: str) -> None:
        import sentencepiece

        if not os.path.isfile(model_path):
            raise UserError(
                f"tokenizer model {model_path} does not exist; "
                "pass an existing SentencePiece .model file to --tokenizer-model"
            )
        self._processor = sentencepiece.SentencePieceProcessor()
        try:
            self._processor.Load(model_path)
        except (OSError, RuntimeError) as exc:
            raise UserError(
                f"cannot read tokenizer model {model_path} as a SentencePiece model "
                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                "pass a valid .model file to --tokenizer-model"
            ) from None
        self.model_path = model_path
        if self._processor.eos_id() < 0:
            raise UserError(
                f"tokenizer model {model_path} has no end-of-sequence piece; "
                "train it with an eos id (eos_id >= 0)"
            )

    def model_proto(self) -> bytes:
        """The loaded model, serialised (a ``sentencepiece_model_pb2.ModelProto``)."""
        return bytes(self._processor.serialized_model_proto())

    @property
    def vocab_size(self) -> int:
        return int(self._processor.GetPieceSize())

    @property
    def eod(self) -> int:
        return int(self._processor.eos_id())

    @property
    def bos(self) -> int | None:
        return _optional_id(self._processor.bos_id())

    @property
    def pad(self) -> int | None:
        return _optional_id(self._processor.pad_id())

    def tokenize(self, text: str) -> list[int]:
        return list(self._processor.EncodeAsIds(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return str(self._processor.DecodeIds([int(i) for i in ids]))


class NullTokenizer:
    """Megatron's NullTokenizer: the text already is whitespace-separated integer token ids.

    ``vocab_size`` passed in counts the ids the text may use; the tokenizer appends one more id,
    ``eod == vocab_size``, so its own ``vocab_size`` is one larger.
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or int(vocab_size) <= 0:
            raise UserError("--tokenizer-type NullTokenizer needs a positive --vocab-size")
        self._text_vocab_size = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._text_vocab_size + 1

    @property
    def eod(self) -> int:
        return self._text_vocab_size

    @property
    def bos(self) -> int | None:
        return None

    @property
    def pad(self) -> int | None:
        return None

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            try:
                token = int(word)
            except ValueError:
                raise UserError(
                    f"NullTokenizer expects whitespace-separated integer ids, got {word[:40]!r}"
                ) from None
            if not 0 <= token < self.vocab_size:
                raise UserError(
                    f"NullTokenizer: token id {token} is outside [0, "
                    f"{self.vocab_size}); raise --vocab-size"
                )
            ids.append(token)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def _optional_id(token_id: int) -> int | None:
    return int(token_id) if token_id >= 0 else None


TOKENIZER_TYPES = ("NullTokenizer", "SentencePieceTokenizer")


def build_tokenizer(
    tokenizer_type: str, tokenizer_model: str | None = None, vocab_size: int | None = None
) -> Tokenizer:
    """The tokenizer named by ``--tokenizer-type``.

    ``SentencePieceTokenizer`` reads ``tokenizer_model``; ``NullTokenizer`` needs
    ``vocab_size``. Raises UserError for an unknown type or a missing/unreadable model.
    """
    if tokenizer_type == "SentencePieceTokenizer":
        if not tokenizer_model:
            raise UserError(
                "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model "
                "PATH to a SentencePiece .model file"
            )
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise UserError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise UserError(
        f"unknown --tokenizer-type {tokenizer_type!r}; known types: {', '.join(TOKENIZER_TYPES)}"
    )
