"""Run each check in its own process under its own time budget, so that one that fails, crashes
the interpreter or hangs (a CUDA or collective deadlock) cannot stop the others.

A check is a command line; the runner appends ``--rows FILE --work DIR --budget SECONDS`` to it,
gives it a fresh process session and waits at most its budget (and never past the whole run's
deadline).
At the budget the session and every descendant process (torchrun's workers run in sessions of
their own) get SIGTERM, then SIGKILL after a grace period. Whatever rows the check had written
are kept, and the runner adds a FAIL row for a timeout, a non-zero exit or a check that reported
nothing. Sub-runs inside a check (training runs, torchrun jobs) go through :func:`run_command`
the same way.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TextIO

from tools.gpu_check.report import FAIL, SKIP, Row, read_rows

GRACE_S = 8.0  # SIGTERM -> SIGKILL; torchrun needs a few seconds to stop its workers
MIN_START_S = 10.0  # a check is not started with less time than this left in the deadline
_TAIL_CHARS = 1500


@dataclass(frozen=True)
class Check:
    """A check: its name, time budget (seconds) and the command line that runs it."""

    name: str
    budget_s: float
    argv: tuple[str, ...]


@dataclass(frozen=True)
class CommandResult:
    """How a command ended: ``returncode`` (None if it could not be started), whether it hit
    its timeout, its wall seconds, and the log file holding its stdout and stderr."""

    returncode: int | None
    timed_out: bool
    seconds: float
    log_path: pathlib.Path

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def tail(self, chars: int = _TAIL_CHARS) -> str:
        """The end of the command's log."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return text[-chars:]

    def why(self) -> str:
        """One phrase for a failed command: timed out, exit status or not started."""
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        if self.returncode is None:
            return "could not be started"
        return f"exited with status {self.returncode}"


def run_command(
    argv: Sequence[str],
    timeout_s: float,
    log_path: str | os.PathLike,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    grace_s: float = GRACE_S,
) -> CommandResult:
    """Run ``argv`` in a new process session with stdout+stderr appended to ``log_path``.

    At ``timeout_s`` the session is sent SIGTERM, and SIGKILL ``grace_s`` later; processes the
    command left behind in its session are killed when it returns.
    """
    log_path = pathlib.Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(("$ " + " ".join(argv) + "\n").encode())
        log.flush()
        try:
            proc = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                env=None if env is None else dict(env),
                start_new_session=True,
            )
        except OSError as exc:
            log.write(f"could not start: {exc}\n".encode())
            return CommandResult(None, False, 0.0, log_path)
        timed_out, family = False, set()
        try:
            proc.wait(timeout=max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            timed_out = True
            family = descendants(proc.pid)  # before the tree comes apart
            _signal(proc.pid, family, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal(proc.pid, family, signal.SIGKILL)  # whatever is left of the command
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:  # stuck in the kernel (a GPU driver): leave it
            log.write(
                f"process {proc.pid} did not die on SIGKILL within {grace_s:.0f} s; "
                "left behind\n".encode()
            )
            timed_out = True
    return CommandResult(proc.returncode, timed_out, time.monotonic() - start, log_path)


def _signal(session: int, pids: set[int], sig: signal.Signals) -> None:
    """Send ``sig`` to the process session led by ``session`` and to each of ``pids``."""
    for target, kill in [(session, os.killpg)] + [(pid, os.kill) for pid in sorted(pids)]:
        try:
            kill(target, sig)
        except (ProcessLookupError, PermissionError):
            pass


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid``, found through /proc (empty where there is none).

    torchrun starts each worker in a session of its own, out of reach of a signal to the
    launcher's session; a hung worker is found this way instead."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return set()
    for entry in entries:
        try:
            stat = pathlib.Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def run_parallel(
    jobs: Sequence[Callable[[], CommandResult]], max_workers: int
) -> list[CommandResult]:
    """Run independent command jobs (each a call of :func:`run_command`) at most
    ``max_workers`` at a time; results in the jobs' order."""
    with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
        return list(pool.map(lambda job: job(), jobs))


@dataclass(frozen=True)
class CheckRun:
    """What the runner saw of one check (for the JSON summary)."""

    name: str
    budget_s: float
    timeout_s: float
    seconds: float
    returncode: int | None
    timed_out: bool
    log_path: str


def run_checks(
    checks: Sequence[Check],
    work_dir: str | os.PathLike,
    deadline_s: float,
    echo: TextIO | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    after_each: Callable[[list[Row], list[CheckRun]], None] | None = None,
) -> tuple[list[Row], list[CheckRun]]:
    """Run ``checks`` one after another, each in its own process (see the module docstring),
    all within ``deadline_s`` seconds from now; returns every row and one CheckRun per check
    that was started. ``after_each(rows, runs)`` sees the results so far after every check
    (to keep a summary that a run killed from outside still leaves)."""
    work = pathlib.Path(work_dir)
    end = time.monotonic() + deadline_s
    rows: list[Row] = []
    runs: list[CheckRun] = []
    for check in checks:
        left = end - time.monotonic()
        if left < MIN_START_S:
            rows.append(
                Row(
                    check.name,
                    SKIP,
                    "not started: the run's time budget is spent",
                    f"budget {check.budget_s:.0f} s",
                )
            )
            continue
        timeout = min(check.budget_s, left)
        if echo is not None:
            print(f"== {check.name} (budget {timeout:.0f} s)", file=echo, flush=True)
        check_dir = work / check.name
        check_dir.mkdir(parents=True, exist_ok=True)
        rows_path = check_dir / "rows.jsonl"
        rows_path.unlink(missing_ok=True)
        argv = [
            *check.argv,
            "--rows",
            str(rows_path),
            "--work",
            str(check_dir),
            "--budget",
            f"{timeout:.1f}",
        ]
        result = run_command(argv, timeout, check_dir / "log.txt", env=env, cwd=cwd)
        found = read_rows(rows_path)
        failure = _check_failure(check, result, found, timeout)
        found += [failure] if failure is not None else []
        rows.extend(found)
        if echo is not None:
            for row in found:
                print(f"  [{row.status}] {row.check}: {row.value}", file=echo, flush=True)
            print(f"   ({result.seconds:.1f} s)", file=echo, flush=True)
        runs.append(
            CheckRun(
                check.name,
                check.budget_s,
                timeout,
                result.seconds,
                result.returncode,
                result.timed_out,
                str(result.log_path),
            )
        )
        if after_each is not None:
            after_each(rows, runs)
    return rows, runs


def _check_failure(
    check: Check, result: CommandResult, found: list[Row], timeout: float
) -> Row | None:
    """The runner's own FAIL row for a check that did not end well, or None."""
    if result.timed_out:
        value = f"timed out after {timeout:.0f} s; {len(found)} rows were reported before"
    elif result.returncode != 0:
        value = f"{result.why()}; {len(found)} rows were reported before"
    elif not found:
        value = "reported no result"
    else:
        return None
    return Row(
        check.name,
        FAIL,
        value,
        f"budget {check.budget_s:.0f} s",
        {"log_tail": result.tail(), "log": str(result.log_path)},
    )
