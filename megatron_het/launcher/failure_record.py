"""A launch's failure record: what the elastic supervisors read after a run ended.

When a run ends because a peer was lost, its reporting rank writes ``DIR/last_failure.json``
(``DIR``: the run's ``--save``; :func:`write_failure`: the ranks that stopped answering or were
stuck in compute). A launch has one record: the first rank to write one for its job id wins
(:func:`write_failure` claims ``DIR/elastic/records/<job id>`` first), so every supervisor
reads the same. Under a supervisor (:data:`RECORD_ERRORS_VAR` set in the ranks' environment) a
rank that ends with an error of its own (a bad flag, a bug, no lost peer) records that too
(:func:`record_own_error`), so the supervisors of a multi-node job stop at once instead of
waiting out the timeout for a lost peer's record that never comes.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from megatron_het.errors import RanksError
from megatron_het.fileio import write_text_atomically

FAILURE_FILE = "last_failure.json"
# Set by the supervisors in their ranks' environment: a rank's own error is recorded too.
RECORD_ERRORS_VAR = "MEGATRON_HET_RECORD_ERRORS"


def write_failure(
    save_dir: str | Path,
    iteration: int,
    world_size: int,
    silent: Sequence[int],
    stuck: Sequence[int],
    failed: Sequence[int],
    line: str,
    run_id: str = "",
) -> bool:
    """Record a lost peer for a supervisor (atomically, in ``save_dir``): the ranks lost
    (``silent`` ones stopped answering, ``stuck`` ones stayed in compute), those that failed
    with an error of their own, the world size, the report line and the launcher's job id
    (``run_id``: torchrun's ``--rdzv-id``, which tells the supervisors of a multi-node job
    their own launch's record from an older one). With a ``run_id`` the first record of that
    launch stands: it is linked into place whole as ``elastic/records/<run_id>``, which fails
    for every later one (False: nothing written)."""
    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    record = {
        "iteration": iteration,
        "world_size": world_size,
        "lost_ranks": sorted(set(silent) | set(stuck)),
        "silent": list(silent),
        "stuck": list(stuck),
        "failed": list(failed),
        "line": line,
        "run_id": run_id,
    }
    text = json.dumps(record, indent=1)
    if run_id and not _claim_record(root, run_id, text):
        return False
    write_text_atomically(root / FAILURE_FILE, text)
    return True


def _claim_path(root: Path, run_id: str) -> Path:
    return (
        root
        / "elastic"
        / "records"
        / "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
    )


def _claim_record(root: Path, run_id: str, text: str) -> bool:
    """Put launch ``run_id``'s record in place with its content at once (a hard link of a
    written file, which fails where one exists); False when another came first."""
    path = _claim_path(root, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".claim-")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


def forget_record(save: str, run_id: str) -> None:
    """Remove an older job's record and claim for ``run_id`` (a job id used again) before
    launching it: no rank of this launch has started yet."""
    stale = read_failure(save)
    if stale is not None and stale.get("run_id") == run_id:
        (Path(save) / FAILURE_FILE).unlink(missing_ok=True)
    _claim_path(Path(save), run_id).unlink(missing_ok=True)


def record_own_error(save: str | None, environ: Mapping[str, str], error: BaseException) -> bool:
    """Under a supervisor (:data:`RECORD_ERRORS_VAR` set in ``environ``, this rank's
    environment), record in ``save`` (the run's ``--save``; None: none, nothing recorded) that
    this rank of the launch ended with an error of its own: no lost rank, this one failed, its
    first line (a :class:`~megatron_het.errors.RanksError`, which every rank raises alike: the
    ranks and the line it names). Never raises; True if written."""
    from megatron_het.comm.faults import first_line

    if environ.get(RECORD_ERRORS_VAR) != "1" or not save:
        return False
    try:
        rank, world_size = int(environ.get("RANK", "0")), int(environ.get("WORLD_SIZE", "1"))
        if isinstance(error, RanksError):  # every rank's, naming the ranks it concerns
            failed, line = list(error.ranks) or list(range(world_size)), first_line(error)
        else:
            what = (
                f"exited with status {error.code}"
                if isinstance(error, SystemExit)
                else first_line(error)
            )
            failed, line = [rank], f"rank {rank}: {what}"
        return write_failure(
            save,
            -1,
            world_size,
            [],
            [],
            failed,
            line,
            run_id=environ.get("TORCHELASTIC_RUN_ID", ""),
        )
    except (OSError, ValueError):
        return False


def read_failure(save_dir: str | Path, run_id: str = "") -> dict | None:
    """The record :func:`write_failure` left in ``save_dir`` (None: none); with ``run_id``,
    that launch's own record only."""
    if run_id:
        claim = _claim_path(Path(save_dir), run_id)
        if claim.is_file():
            return json.loads(claim.read_text())
    path = Path(save_dir) / FAILURE_FILE
    record = json.loads(path.read_text()) if path.is_file() else None
    if run_id and record is not None and record.get("run_id") != run_id:
        return None
    return record


def wait_for_record(
    save: str,
    run_id: str,
    wait_s: float,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> dict | None:
    """The failure record of launch ``run_id``, waiting up to ``wait_s`` for it (another
    node's rank may report it after this node's run ended); None if none comes."""
    deadline = clock() + wait_s
    while True:
        record = read_failure(save, run_id)
        if record is not None:
            return record
        if clock() >= deadline:
            return None
        sleep(0.5)
