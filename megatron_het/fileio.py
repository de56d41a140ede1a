"""Reading the files a user names (plans, profiles, accelerator and cluster YAML): a missing,
unreadable or malformed file is a :class:`~megatron_het.errors.UserError` of one line that names
the file and says how to fix it. What the parsed content means is checked by the caller.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from megatron_het.errors import UserError


def read_text_file(path: str | Path, name: str, missing_hint: str) -> str:
    """The text of ``path``. ``name`` is how the messages call the file ("plan file x.json");
    a missing file raises ``"{name} not found; {missing_hint}"``, another OS error
    ``"cannot read {name}: {reason}"``."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise UserError(f"{name} not found; {missing_hint}") from None
    except OSError as exc:
        raise UserError(f"cannot read {name}: {exc.strerror}") from None


def read_json_file(path: str | Path, name: str, missing_hint: str) -> Any:
    """The parsed JSON of ``path`` (errors as :func:`read_text_file`; malformed JSON raises
    ``"{name} is not valid JSON: {problem} at line L column C"``)."""
    text = read_text_file(path, name, missing_hint)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{name} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None


def read_yaml_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """Parse a YAML file whose top level is a mapping; ``what`` names the kind of file ("cluster
    file"). Missing, unreadable or malformed files and other top levels are UserErrors."""
    name = f"{what} {str(Path(path))!r}"
    text = read_text_file(path, name, "check the path")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{name} is not valid YAML{line}; fix the syntax") from None
    if not isinstance(data, dict):
        raise UserError(f"{name} must hold a mapping at the top level")
    return data


def write_text_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its directory (named for this
    process, so several processes may write the same file) renamed over it: a reader sees the
    old content or the new, never part of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


__all__ = ["read_json_file", "read_text_file", "read_yaml_mapping", "write_text_atomically"]
