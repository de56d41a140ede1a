"""tools/preprocess_data.py: JSONL -> .bin/.idx, compared with tokenizing the text directly."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_het.data import IndexedDataset, build_tokenizer
from megatron_het.errors import run_cli
from tests.unit.test_tokenizer import corpus_lines, train_sentencepiece

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "preprocess_data.py")


def load_tool():
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_jsonl(path, records):
    with open(path, "w") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


@pytest.fixture
def corpus(tmp_path):
    texts = corpus_lines(40, seed=4, words_per_line=20)
    texts[5] = ""  # an empty document is skipped
    records = [
        {"text": t, "title": t.split(" ")[0] if t else "x", "id": i} for i, t in enumerate(texts)
    ]
    return write_jsonl(tmp_path / "corpus.jsonl", records), texts


def run_tool(*args):
    return subprocess.run(
        [sys.executable, TOOL, *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_cli_sentencepiece_with_workers(tmp_path, corpus):
    path, texts = corpus
    model = train_sentencepiece(str(tmp_path / "tok.model"))
    out = str(tmp_path / "out" / "corpus")
    result = run_tool(
        "--input",
        path,
        "--output-prefix",
        out,
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        model,
        "--append-eod",
        "--workers",
        "2",
        "--log-interval",
        "10",
    )
    assert result.returncode == 0, result.stderr
    assert "tokenizing" in result.stderr  # the progress bar goes to stderr
    ds = IndexedDataset(out + "_text_document")
    tok = build_tokenizer("SentencePieceTokenizer", model)
    expected = [tok.tokenize(t) + [tok.eod] for t in texts if t]
    assert ds.dtype == np.uint16 and len(ds) == len(expected) == 39
    for got, want in zip(ds[:], expected):
        assert got.tolist() == want
    # One process gives the same bytes as a pool of workers.
    single = str(tmp_path / "single")
    load_tool().main(
        [
            "--input",
            path,
            "--output-prefix",
            single,
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            model,
            "--append-eod",
            "--no-progress",
        ]
    )
    for ext in (".bin", ".idx"):
        with (
            open(out + "_text_document" + ext, "rb") as a,
            open(single + "_text_document" + ext, "rb") as b,
        ):
            assert a.read() == b.read()


def test_null_tokenizer_and_several_keys(tmp_path):
    records = [{"text": "1 2 3", "other": "7"}, {"text": "4 5", "other": "8 9 999"}]
    path = write_jsonl(tmp_path / "ids.jsonl", records)
    out = str(tmp_path / "ids")
    load_tool().main(
        [
            "--input",
            path,
            "--output-prefix",
            out,
            "--json-keys",
            "text",
            "other",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "1000",
            "--no-progress",
        ]
    )
    text, other = IndexedDataset(out + "_text_document"), IndexedDataset(out + "_other_document")
    assert [a.tolist() for a in text[:]] == [[1, 2, 3], [4, 5]]
    assert [a.tolist() for a in other[:]] == [[7], [8, 9, 999]]


def _fails(capsys, tmp_path, argv, *needles):
    with pytest.raises(SystemExit) as info:
        run_cli(lambda: load_tool().main(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, err
    leftovers = [name for name in os.listdir(tmp_path) if name.startswith("out")]
    assert leftovers == [], leftovers


def test_errors_leave_nothing_behind(tmp_path, capsys):
    null = [
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
        "--no-progress",
        "--output-prefix",
        str(tmp_path / "out"),
    ]
    _fails(capsys, tmp_path, ["--input", str(tmp_path / "missing.jsonl"), *null], "missing.jsonl")
    bad_json = write_jsonl(tmp_path / "bad.jsonl", [{"text": "1"}, {"text": "2"}, '{"text": 3'])
    _fails(capsys, tmp_path, ["--input", bad_json, *null], "bad.jsonl line 3", "JSON")
    no_key = write_jsonl(tmp_path / "nokey.jsonl", [{"text": "1"}, {"body": "2"}])
    _fails(capsys, tmp_path, ["--input", no_key, *null], "line 2", "'text'", "--json-keys")
    not_text = write_jsonl(tmp_path / "nottext.jsonl", [{"text": 5}])
    _fails(capsys, tmp_path, ["--input", not_text, *null], "line 1", "int")
    _fails(
        capsys,
        tmp_path,
        [
            "--input",
            no_key,
            "--output-prefix",
            str(tmp_path / "out"),
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            str(tmp_path / "none.model"),
        ],
        "none.model",
    )


def test_worker_error_exits_2_and_cleans_up(tmp_path):
    lines = [{"text": str(i)} for i in range(300)] + ["not json"]
    path = write_jsonl(tmp_path / "late.jsonl", lines)
    result = run_tool(
        "--input",
        path,
        "--output-prefix",
        str(tmp_path / "out"),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "1000",
        "--workers",
        "2",
        "--no-progress",
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "late.jsonl line 301" in result.stderr
    assert "Traceback" not in result.stderr
    assert not [n for n in os.listdir(tmp_path) if n.startswith("out")]
