"""JSONL text -> Megatron ``.bin``/``.idx`` token files (the library side of
``tools/preprocess_data.py``).

Each input line is one JSON object; each ``--json-keys`` field becomes one document of the
output ``{output_prefix}_{key}_document``. Tokenisation runs on a pool of worker processes (in
order); outputs are written under temporary names and renamed only when every line succeeded, so
a failed run leaves no partial dataset behind.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass

from megatron_het.data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from megatron_het.data.tokenizer import Tokenizer, build_tokenizer
from megatron_het.errors import UserError


@dataclass(frozen=True)
class PreprocessConfig:
    """What to read, how to tokenise it and where to write it."""

    input_path: str
    output_prefix: str
    json_keys: tuple[str, ...] = ("text",)
    tokenizer_type: str = "SentencePieceTokenizer"
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    append_eod: bool = False
    workers: int = 1
    log_interval: int = 1000
    progress: bool = True


@dataclass
class PreprocessStats:
    """Counts of a finished run; ``outputs`` maps each JSON key to its dataset prefix."""

    lines: int = 0
    documents: int = 0
    empty_documents: int = 0
    tokens: int = 0
    outputs: dict[str, str] | None = None


class _Encoder:
    """Turns one raw JSONL line into token lists, one per JSON key."""

    def __init__(self, config: PreprocessConfig) -> None:
        self.config = config
        self.tokenizer: Tokenizer = build_tokenizer(
            config.tokenizer_type, config.tokenizer_model, config.vocab_size
        )

    def encode(self, numbered_line: tuple[int, bytes]) -> tuple[int, list[list[int]] | None]:
        """``(line_number, tokens per key)``; tokens is None for a blank line."""
        line_number, raw = numbered_line
        where = f"{self.config.input_path} line {line_number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(
                f"{where} is not valid UTF-8 ({exc.reason} at byte {exc.start})"
            ) from None
        if not text.strip():
            return line_number, None
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"{where} is not valid JSON ({exc.msg} at column {exc.colno}); "
                "the input must hold one JSON object per line"
            ) from None
        if not isinstance(record, dict):
            raise UserError(f"{where} is a JSON {type(record).__name__}, not an object")
        tokens = []
        for key in self.config.json_keys:
            if key not in record:
                keys = ", ".join(sorted(record))[:200]
                raise UserError(
                    f"{where} has no key {key!r} (keys: {keys}); choose the field with --json-keys"
                )
            if not isinstance(record[key], str):
                raise UserError(
                    f"{where}: key {key!r} holds a {type(record[key]).__name__}, not a string"
                )
            ids = self.tokenizer.tokenize(record[key])
            if ids and self.config.append_eod:
                ids.append(self.tokenizer.eod)
            tokens.append(ids)
        return line_number, tokens


# Set only inside pool worker processes, by _init_worker: each worker loads the tokenizer once.
_worker_encoder: _Encoder | None = None


def _init_worker(config: PreprocessConfig) -> None:
    global _worker_encoder
    _worker_encoder = _Encoder(config)


def _encode_in_worker(numbered_line: tuple[int, bytes]) -> tuple[int, list[list[int]] | None]:
    assert _worker_encoder is not None, "worker used before _init_worker"
    return _worker_encoder.encode(numbered_line)


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's naming: ``{prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def _numbered_lines(path: str, on_bytes) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            on_bytes(len(raw))
            yield number, raw


def _encoded(
    config: PreprocessConfig, lines: Iterable[tuple[int, bytes]], encoder: _Encoder
) -> Generator[tuple[int, list[list[int]] | None], None, None]:
    if config.workers <= 1:
        yield from map(encoder.encode, lines)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(config.workers, initializer=_init_worker, initargs=(config,)) as pool:
        yield from pool.imap(_encode_in_worker, lines, chunksize=64)


def preprocess_jsonl(config: PreprocessConfig) -> PreprocessStats:
    """Tokenise ``config.input_path`` into one ``.bin``/``.idx`` pair per JSON key.

    Side effects: writes ``{output_prefix}_{key}_document.{bin,idx}`` (creating the output
    directory); a progress bar goes to stderr when ``config.progress``. Raises UserError for a
    missing input, a line that is not a JSON object, or a missing key, leaving no outputs.
    """
    from tqdm import tqdm

    if not os.path.isfile(config.input_path):
        raise UserError(
            f"input file {config.input_path} does not exist; pass a JSONL file to --input"
        )
    if not config.json_keys:
        raise UserError("--json-keys needs at least one key")
    encoder = _Encoder(config)  # also checks the tokenizer before any worker starts
    directory = os.path.dirname(config.output_prefix)
    if directory:
        os.makedirs(directory, exist_ok=True)
    dtype = optimal_dtype(encoder.tokenizer.vocab_size)
    prefixes = {key: output_prefix_for(config.output_prefix, key) for key in config.json_keys}
    temporary = {key: (f"{p}.bin.tmp", f"{p}.idx.tmp") for key, p in prefixes.items()}
    builders = {key: IndexedDatasetBuilder(temporary[key][0], dtype) for key in config.json_keys}
    stats = PreprocessStats(outputs=dict(prefixes))
    bar = tqdm(
        total=os.path.getsize(config.input_path),
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        disable=not config.progress,
        desc="tokenizing",
    )
    encoded = _encoded(config, _numbered_lines(config.input_path, bar.update), encoder)
    try:
        for _, per_key in encoded:
            stats.lines += 1
            for key, ids in zip(config.json_keys, per_key or ()):
                if not ids:
                    stats.empty_documents += 1
                    continue
                builders[key].add_document(ids)
                stats.documents += 1
                stats.tokens += len(ids)
            if config.log_interval > 0 and stats.lines % config.log_interval == 0:
                bar.set_postfix_str(
                    f"{stats.documents} documents, {stats.tokens} tokens", refresh=False
                )
        # The final counts (drawn when the bar closes) agree with the summary line.
        bar.set_postfix_str(f"{stats.documents} documents, {stats.tokens} tokens", refresh=False)
        for key, builder in builders.items():
            builder.finalize(temporary[key][1])
    except BaseException:
        for key, builder in builders.items():
            builder.close()
            for path in temporary[key]:
                if os.path.exists(path):
                    os.remove(path)
        raise
    finally:
        encoded.close()  # stops the worker pool at once on failure
        bar.close()
    for key, prefix in prefixes.items():
        os.replace(temporary[key][0], f"{prefix}.bin")
        os.replace(temporary[key][1], f"{prefix}.idx")
    return stats
