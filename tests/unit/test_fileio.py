"""Reading user-named files: each problem is one UserError line naming the file and the fix."""

import pytest

from megatron_het.errors import UserError
from megatron_het.fileio import read_json_file, read_text_file, read_yaml_mapping


def _message(fn, *args):
    with pytest.raises(UserError) as exc:
        fn(*args)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_missing_and_unreadable_files(tmp_path):
    assert _message(read_text_file, tmp_path / "x", "plan file x", "pass one") == (
        "plan file x not found; pass one"
    )
    assert _message(read_json_file, tmp_path, "profile p", "write it") == (
        "cannot read profile p: Is a directory"
    )


def test_parsed_content_and_syntax_errors(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text('{"a": [1, 2]}')
    bad.write_text('{\n  "a": }')
    assert read_json_file(good, "f", "h") == {"a": [1, 2]}
    assert _message(read_json_file, bad, "plan file b", "h") == (
        "plan file b is not valid JSON: Expecting value at line 2 column 8"
    )


def test_yaml_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("a: 1\n")
    assert read_yaml_mapping(path, "cluster file") == {"a": 1}
    path.write_text("- 1\n")
    assert _message(read_yaml_mapping, path, "cluster file") == (
        f"cluster file {str(path)!r} must hold a mapping at the top level"
    )
    path.write_text("a: [1\n")
    assert "is not valid YAML at line" in _message(read_yaml_mapping, path, "cluster file")
