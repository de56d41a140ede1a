"""What a ``--save`` directory holds, verified: ``tools/checkpoint_info.py``'s logic.

:func:`inspect_checkpoints` lists every iteration of a save directory (or the one iteration
directory given): committed ``iter_*`` directories, ``iter_*`` directories without metadata
(incomplete) and staging directories of saves that never committed, with the tracker's latest
marked. For each: the plan that wrote it (one short line per pipeline), the consumed samples,
every file with its size and its verification (size and whole-file sha256 against
metadata.json's record, which covers every byte, the tensor pieces a load checks one by one
included; an uncommitted save's files against the per-rank indexes written so far).
:func:`format_text` and :func:`verdict` say it in words; ``tools/checkpoint_info.py`` prints it
as text or JSON and exits non-zero when the latest committed iteration does not verify.
"""

from __future__ import annotations

import json
import pathlib
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_het.checkpoint.integrity import FILES_KEY, file_problem
from megatron_het.checkpoint.io import (
    METADATA_FILE,
    STAGING_PREFIX,
    TRACKER_FILE,
    model_shard_name,
    optimizer_shard_name,
    parse_iteration_dir,
    read_latest_iteration,
    train_state_name,
)
from megatron_het.checkpoint.rank_files import INDEX_PREFIX
from megatron_het.checkpoint.verify import read_metadata_file
from megatron_het.errors import UserError

OK = "OK"
NOT_CHECKSUMMED = "present (written without a checksum)"
_STAGING = re.compile(re.escape(STAGING_PREFIX) + r"(\d+)_.*")


@dataclass
class FileStatus:
    """One file of an iteration: its size on disk (None: missing) and "OK" or the problem."""

    name: str
    bytes: int | None
    status: str


@dataclass
class IterationInfo:
    """One iteration found in a save directory. ``state`` is "committed", "incomplete" (an
    ``iter_*`` directory without readable metadata) or "uncommitted" (a staging directory)."""

    iteration: int
    directory: str
    state: str
    latest: bool = False
    plan: list[str] = field(default_factory=list)
    consumed_samples: int | None = None
    files: list[FileStatus] = field(default_factory=list)
    problem: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes or 0 for f in self.files)

    @property
    def verified(self) -> bool:
        """Committed, and every file present and matching its record."""
        return (
            self.state == "committed"
            and self.problem is None
            and all(f.status in (OK, NOT_CHECKSUMMED) for f in self.files)
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(total_bytes=self.total_bytes, verified=self.verified)
        return out


def plan_lines(metadata: dict[str, Any]) -> list[str]:
    """The plan that wrote a checkpoint: a summary line, then one short line per pipeline."""
    sharded = metadata.get("sharded")
    if not sharded:
        return ["single process (one shard of full tensors)"]
    plan = sharded["plan"]
    pipelines = plan.get("pipelines", [])
    lines = [
        f"{sharded.get('world_size', '?')} rank(s), dp={len(pipelines)}, micro batch "
        f"size {plan.get('micro_batch_size', '?')}"
    ]
    for index, pipeline in enumerate(pipelines):
        stages = " | ".join(
            f"{s.get('accelerator', '?')} tp{s.get('tp', '?')} layers "
            f"{s['layers'][0]}-{s['layers'][1] - 1} ranks {','.join(map(str, s.get('ranks', [])))}"
            for s in pipeline.get("stages", [])
        )
        lines.append(
            f"pipeline {index}: {len(pipeline.get('stages', []))} stage(s), "
            f"{pipeline.get('micro_batches', '?')} micro-batches: {stages}"
        )
    return lines


def _size(path: pathlib.Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _recorded_files(directory: pathlib.Path, metadata: dict[str, Any]) -> list[FileStatus]:
    records = metadata.get(FILES_KEY)
    if records is not None:
        return [
            FileStatus(name, _size(directory / name), file_problem(directory / name, entry) or OK)
            for name, entry in sorted(records.items())
        ]
    # Written before files were recorded: the shard counts say which files must be there.
    names = [model_shard_name(i) for i in range(int(metadata.get("num_model_shards", 0)))]
    names += [optimizer_shard_name(i) for i in range(int(metadata.get("num_optimizer_shards", 0)))]
    names += [train_state_name(i) for i in range(int(metadata.get("num_train_state_shards", 0)))]
    return [
        FileStatus(
            name,
            _size(directory / name),
            NOT_CHECKSUMMED if _size(directory / name) is not None else "missing",
        )
        for name in names
    ]


def _committed(directory: pathlib.Path, iteration: int) -> IterationInfo:
    metadata = read_metadata_file(directory)
    if metadata is None:
        problem = (
            f"no {METADATA_FILE}"
            if not (directory / METADATA_FILE).exists()
            else f"{METADATA_FILE} is unreadable"
        )
        return IterationInfo(
            iteration,
            str(directory),
            "incomplete",
            files=_present_files(directory, {}),
            problem=problem,
        )
    info = IterationInfo(
        iteration,
        str(directory),
        "committed",
        plan=plan_lines(metadata),
        consumed_samples=metadata.get("consumed_samples"),
        files=_recorded_files(directory, metadata),
    )
    if metadata.get("iteration") != iteration:
        info.problem = f"{METADATA_FILE} says iteration {metadata.get('iteration')}"
    return info


def _present_files(directory: pathlib.Path, records: dict[str, Any]) -> list[FileStatus]:
    """Every ``.pt`` file of ``directory``, verified where ``records`` has it."""
    out = []
    for path in sorted(directory.glob("*.pt")):
        entry = records.get(path.name)
        status = (
            "not recorded (its write did not finish)"
            if entry is None
            else file_problem(path, entry) or OK
        )
        out.append(FileStatus(path.name, _size(path), status))
    return out


def _uncommitted(directory: pathlib.Path, iteration: int) -> IterationInfo:
    records: dict[str, Any] = {}
    for index in sorted(directory.glob(f"{INDEX_PREFIX}*.json")):
        try:
            records.update(json.loads(index.read_text(encoding="utf-8")).get(FILES_KEY, {}))
        except (OSError, ValueError):
            continue
    return IterationInfo(
        iteration,
        str(directory),
        "uncommitted",
        files=_present_files(directory, records),
        problem="never committed: a save that was interrupted (the next save removes it)",
    )


@dataclass
class Listing:
    """What :func:`inspect_checkpoints` found under ``path``: the tracker's iteration (None
    without a tracker) and every iteration, oldest first; ``single`` when ``path`` is one
    iteration directory."""

    path: pathlib.Path
    tracker: int | None
    iterations: list[IterationInfo]
    single: bool = False

    def latest_committed(self) -> IterationInfo | None:
        """The iteration that loads: the one given, or the tracker's (a "missing" placeholder
        when its directory is gone), or without a tracker the newest committed one."""
        if self.single:
            return self.iterations[0]
        if self.tracker is not None:
            named = [
                i
                for i in self.iterations
                if i.iteration == self.tracker and i.state != "uncommitted"
            ]
            return (
                named[0]
                if named
                else IterationInfo(
                    self.tracker,
                    "",
                    "missing",
                    problem="the tracker names an iteration whose directory is missing",
                )
            )
        committed = [i for i in self.iterations if i.state == "committed"]
        return committed[-1] if committed else None


def inspect_checkpoints(path: pathlib.Path) -> Listing:
    """Every iteration of a save directory, or the one iteration directory ``path``, each
    verified (reads every file once). UserError if there is none."""
    if not path.is_dir():
        raise UserError(
            f"{path} is not a directory; pass a --save directory or one of its "
            "iter_XXXXXXX directories"
        )
    single = (path / METADATA_FILE).is_file() or parse_iteration_dir(path.name) is not None
    if single:
        tracker = read_latest_iteration(path.parent)
        number = parse_iteration_dir(path.name)
        if number is None:
            number = int((read_metadata_file(path) or {}).get("iteration", -1))
        found = [_committed(path, number)]
    else:
        tracker = read_latest_iteration(path)
        found = []
        for entry in path.iterdir():
            number, staging = parse_iteration_dir(entry.name), _STAGING.fullmatch(entry.name)
            if entry.is_dir() and number is not None:
                found.append(_committed(entry, number))
            elif entry.is_dir() and staging:
                found.append(_uncommitted(entry, int(staging.group(1))))
    if not found:
        raise UserError(f"no checkpoint in {path}: no iter_XXXXXXX directories, no {TRACKER_FILE}")
    for info in found:
        info.latest = info.state == "committed" and info.iteration == tracker
    found.sort(key=lambda i: (i.iteration, i.state != "committed"))
    return Listing(path, tracker, found, single)


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3f} GB" if nbytes >= 1e7 else f"{nbytes / 1e6:.3f} MB"


def format_text(listing: Listing) -> str:
    """The human-readable listing."""
    tracker = "none" if listing.tracker is None else f"iteration {listing.tracker}"
    lines = [f"{listing.path}: {len(listing.iterations)} iteration(s); tracker: {tracker}"]
    for info in listing.iterations:
        mark = " [latest]" if info.latest else ""
        lines.append(f"iteration {info.iteration} ({info.state}){mark}: {info.directory}")
        lines.extend(
            f"  plan: {line}" if i == 0 else f"        {line}" for i, line in enumerate(info.plan)
        )
        if info.state == "committed":
            samples = "unknown" if info.consumed_samples is None else info.consumed_samples
            lines.append(f"  consumed samples: {samples}")
        lines.append(f"  files: {len(info.files)}, {_gb(info.total_bytes)}")
        for item in info.files:
            size = "-" if item.bytes is None else f"{item.bytes} B"
            lines.append(f"    {item.name}  {size}  {item.status}")
        if info.problem:
            lines.append(f"  problem: {info.problem}")
        if info.state == "committed":
            lines.append(f"  verified: {'yes' if info.verified else 'NO'}")
    return "\n".join(lines)


def verdict(target: IterationInfo | None) -> str:
    if target is None:
        return "nothing is committed"
    if target.verified:
        return f"latest committed iteration {target.iteration} verifies"
    bad = [f"{f.name}: {f.status}" for f in target.files if f.status not in (OK, NOT_CHECKSUMMED)]
    reasons = "; ".join(([target.problem] if target.problem else []) + bad[:3])
    return f"latest committed iteration {target.iteration} does NOT verify ({reasons})"
