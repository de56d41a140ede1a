"""Result rows of the GPU check: how a check reports them, the printed table and the JSON summary.

A check process appends one JSON line per result to its rows file as soon as it has it
(:class:`RowWriter`), so a check that is killed at its time budget still leaves the rows it had
finished. The runner reads them back with :func:`read_rows` (a line cut short by the kill is
dropped), prints :func:`format_table` and writes :func:`write_summary`.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
STATUSES = (PASS, FAIL, SKIP)
SUMMARY_NAME = "gpu_check.json"
TABLE_NAME = "gpu_check_table.txt"
LOGS_NAME = "gpu_check_logs.txt"
COLUMNS = ("check", "status", "value", "threshold")
_MAX_CELL = 110  # characters of a value or threshold shown in the table (the JSON has them all)


@dataclass(frozen=True)
class Row:
    """One result: ``check`` names it ("mixed.losses"), ``status`` is PASS/FAIL/SKIP, ``value``
    and ``threshold`` are the text shown in the table; ``details`` carries the figures."""

    check: str
    status: str
    value: str = ""
    threshold: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(
                f"row {self.check!r}: status must be one of {STATUSES}, got {self.status!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Row:
        return cls(
            str(d["check"]),
            str(d["status"]),
            str(d.get("value", "")),
            str(d.get("threshold", "")),
            dict(d.get("details") or {}),
        )


def status_of(ok: bool) -> str:
    return PASS if ok else FAIL


class RowWriter:
    """Appends rows to a JSON-lines file, one flushed line per row (see the module docstring).

    ``echo`` (a text stream) also gets one line per row, for the live log."""

    def __init__(self, path: str | os.PathLike, echo: Any = None) -> None:
        self.path = pathlib.Path(path)
        self.echo = echo
        self.rows: list[Row] = []

    def add(
        self, check: str, status: str, value: Any = "", threshold: Any = "", **details: Any
    ) -> Row:
        row = Row(check, status, _text(value), _text(threshold), _jsonable(details))
        self.rows.append(row)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row.to_dict()) + "\n")
        if self.echo is not None:
            print(
                f"  [{row.status}] {row.check}: {row.value} ({row.threshold})",
                file=self.echo,
                flush=True,
            )
        return row


def read_rows(path: str | os.PathLike) -> list[Row]:
    """The rows of a rows file; missing file: none; a malformed line (cut by a kill) is skipped."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(Row.from_dict(json.loads(line)))
        except (ValueError, KeyError, TypeError):
            continue
    return rows


def all_passed(rows: Iterable[Row]) -> bool:
    """True when no row failed (SKIP counts as not failed)."""
    return all(row.status != FAIL for row in rows)


def format_table(rows: Iterable[Row]) -> str:
    """The rows as an aligned text table with the columns :data:`COLUMNS`."""
    cells = [COLUMNS] + [(r.check, r.status, _clip(r.value), _clip(r.threshold)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(rows: Iterable[Row], meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON summary: ``meta`` (conditions), counts per status, ``all_passed`` and the rows."""
    rows = list(rows)
    counts = {status: sum(r.status == status for r in rows) for status in STATUSES}
    return {
        **_jsonable(dict(meta or {})),
        "all_passed": all_passed(rows),
        "counts": counts,
        "rows": [r.to_dict() for r in rows],
    }


def write_summary(
    out_dir: str | os.PathLike, rows: Iterable[Row], meta: Mapping[str, Any] | None = None
) -> pathlib.Path:
    """Write ``out_dir``/gpu_check.json and the table beside it; returns the JSON's path."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    path = out / SUMMARY_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary(rows, meta), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    (out / TABLE_NAME).write_text(format_table(rows) + "\n", encoding="utf-8")
    return path


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_CELL else text[: _MAX_CELL - 3] + "..."


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _jsonable(value: Any) -> Any:
    """``value`` with everything JSON cannot hold turned into text (paths, dtypes, ...)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    return str(value)
