"""Tokenise a JSONL corpus into Megatron ``.bin``/``.idx`` files.

Example::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod \
        --workers 4

writes ``data/corpus_text_document.bin`` and ``.idx`` (one pair per ``--json-keys`` key).
"""

from __future__ import annotations

import sys

from megatron_het.arguments.parser import ArgParser
from megatron_het.data.preprocess import PreprocessConfig, preprocess_jsonl
from megatron_het.data.tokenizer import TOKENIZER_TYPES
from megatron_het.errors import UserError, run_cli


def parse_args(argv: list[str] | None = None) -> PreprocessConfig:
    parser = ArgParser(prog="tools/preprocess_data.py", description=__doc__.splitlines()[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="fields to tokenise; each gives its own output dataset",
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece .model file")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary")
    group.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document token to every document",
    )
    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx"
    )
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument(
        "--log-interval",
        type=int,
        default=1000,
        help="refresh the document and token counts every this many lines",
    )
    group.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    if args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")
    return PreprocessConfig(
        input_path=args.input,
        output_prefix=args.output_prefix,
        json_keys=tuple(args.json_keys),
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        append_eod=args.append_eod,
        workers=args.workers,
        log_interval=args.log_interval,
        progress=not args.no_progress,
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    stats = preprocess_jsonl(config)
    for key, prefix in (stats.outputs or {}).items():
        print(f"wrote {prefix}.bin/.idx ({key})", file=sys.stderr)
    print(
        f"{stats.lines} lines, {stats.documents} documents, {stats.tokens} tokens"
        + (f", {stats.empty_documents} empty documents skipped" if stats.empty_documents else ""),
        file=sys.stderr,
    )


if __name__ == "__main__":
    run_cli(main)
