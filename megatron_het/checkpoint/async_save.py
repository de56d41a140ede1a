"""Checkpoints written by a background thread while training goes on.

At a save point every rank takes CPU copies of its pieces (:func:`~megatron_het.checkpoint.
sharded.snapshot_sharded`, collective, in the training thread) and hands them to its
:class:`BackgroundWriter`, whose thread writes the files and never communicates. The save is
committed only when every rank's files are complete: :meth:`AsyncCheckpointSaver.poll`, called
by the training loop after each iteration while a save is pending, is one all-reduce (max) over
the world of ``[still writing, failed rank + 1, write seconds]``; when nobody is writing and
nobody failed, world rank 0 commits (merge the indexes into metadata.json, rename, tracker) in
the training thread. A writer's exception fails every rank with one UserError line at that check,
and the previous checkpoint stays the latest; a process killed mid-write leaves only a staging
directory, which the next save removes. One save is in flight at a time: a new one first
finishes (waits for and commits) the previous one.
"""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_het.checkpoint.integrity import FileRecord, files_total_bytes
from megatron_het.checkpoint.io import read_latest_iteration
from megatron_het.checkpoint.rank_files import RankFiles
from megatron_het.checkpoint.sharded import commit_sharded
from megatron_het.checkpoint.verify import read_metadata_file
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan

BeforeFile = Callable[[int, str], None]  # (iteration, file name) before each file is written


@dataclass(frozen=True)
class WriteOutcome:
    """How one background write ended: its duration, the files written, or the error."""

    seconds: float
    records: tuple[FileRecord, ...] = ()
    error: BaseException | None = None


class BackgroundWriter:
    """Writes one rank's :class:`RankFiles` at a time on a daemon thread (no communication).

    ``before_file(iteration, name)`` runs in the writer thread before each file (tests slow,
    block or break a save with it).
    """

    def __init__(self, before_file: BeforeFile | None = None) -> None:
        self._before_file = before_file
        self._thread: threading.Thread | None = None
        self._outcome: WriteOutcome | None = None
        self._given_up: WriteOutcome | None = None

    def start(self, files: RankFiles, iteration: int) -> None:
        """Start writing ``files``; RuntimeError if the previous write was not collected."""
        if self._thread is not None:
            raise RuntimeError("a background checkpoint write is still pending")
        self._outcome = self._given_up = None
        hook = self._before_file
        before = None if hook is None else (lambda name: hook(iteration, name))

        def run() -> None:
            start = time.perf_counter()
            try:
                records = tuple(files.write(before))
                self._outcome = WriteOutcome(time.perf_counter() - start, records)
            except BaseException as error:
                self._outcome = WriteOutcome(time.perf_counter() - start, error=error)

        self._thread = threading.Thread(
            target=run, name=f"checkpoint-writer-{iteration}", daemon=True
        )
        self._thread.start()

    @property
    def pending(self) -> bool:
        """Whether a write was started and not collected."""
        return self._thread is not None

    def outcome(self) -> WriteOutcome | None:
        """The finished write's outcome, or None while it runs (or when none was started)."""
        if self._given_up is not None:
            return self._given_up
        if self._thread is None or self._thread.is_alive():
            return None
        return self._outcome

    def wait(self, timeout_s: float | None = None) -> WriteOutcome | None:
        """Wait up to ``timeout_s`` for the write; its outcome, None if it still runs."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.outcome()

    def give_up(self, error: BaseException) -> None:
        """Report the running write as failed with ``error``; its thread ends on its own."""
        self._given_up = WriteOutcome(0.0, error=error)

    def collect(self) -> None:
        """Forget the finished (or abandoned) write, so another can start."""
        self._thread, self._outcome, self._given_up = None, None, None


@dataclass(frozen=True)
class PendingCommit:
    """What the commit of a background save needs (rank 0's ``metadata`` is written)."""

    save_dir: pathlib.Path
    iteration: int
    model_config: ModelConfig
    plan: ParallelPlan
    has_optimizer: bool
    has_train_state: bool
    metadata: dict | None


@dataclass(frozen=True)
class CommitReport:
    """A committed background save: the slowest rank's write time, the checkpoint's size
    (None if unrecorded) and the time from the save point to the commit."""

    iteration: int
    path: pathlib.Path
    write_s: float
    bytes: int | None
    since_save_point_s: float


class AsyncCheckpointSaver:
    """One rank's background saves, committed collectively over ``world``.

    ``device`` holds the all-reduce's flags (the communicator's device); ``timeout_s`` bounds
    how long :meth:`finish` waits for this rank's writer.
    """

    def __init__(
        self,
        world: Any,
        device: torch.device,
        before_file: BeforeFile | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.world, self.device, self.timeout_s = world, device, timeout_s
        self.writer = BackgroundWriter(before_file)
        self._pending: PendingCommit | None = None
        self._started = 0.0

    @property
    def pending(self) -> PendingCommit | None:
        """The save in flight (started, not committed), or None."""
        return self._pending

    def start(self, files: RankFiles, commit: PendingCommit) -> None:
        """Hand this rank's snapshot to the writer (no communication). Call :meth:`finish`
        first if a save may be pending."""
        if self._pending is not None:
            raise RuntimeError(
                f"checkpoint iteration {self._pending.iteration} is still "
                "pending; finish it before starting another"
            )
        self.writer.start(files, commit.iteration)
        self._pending, self._started = commit, time.perf_counter()

    def poll(self) -> CommitReport | None:
        """Collective over ``world`` while a save is pending (identical calls on every rank):
        commit it if every rank's files are complete. Returns the commit's report, None when
        nothing was committed; UserError on every rank if some rank's writer failed."""
        pending = self._pending
        if pending is None:
            return None
        outcome = self.writer.outcome()
        failed = outcome is not None and outcome.error is not None
        # int64 (the write time in microseconds): HCCL has no float64 all-reduce.
        flags = torch.tensor(
            [
                1 if outcome is None else 0,
                self.world.rank + 1 if failed else 0,
                0 if outcome is None else round(outcome.seconds * 1e6),
            ],
            dtype=torch.int64,
            device=self.device,
        )
        self.world.all_reduce(flags, "max")
        writing, failed_rank, write_us = flags.cpu().tolist()
        write_s = write_us / 1e6
        if failed_rank:
            self._pending = None
            self._raise_failure(pending, int(failed_rank) - 1, outcome)
        if writing:
            return None
        self.writer.collect()
        self._pending = None
        path = commit_sharded(
            pending.save_dir,
            pending.iteration,
            pending.model_config,
            pending.plan,
            self.world,
            pending.has_optimizer,
            pending.has_train_state,
            pending.metadata,
            self.device,
        )
        metadata = read_metadata_file(path)
        return CommitReport(
            pending.iteration,
            path,
            write_s,
            None if metadata is None else files_total_bytes(metadata),
            time.perf_counter() - self._started,
        )

    def finish(self) -> CommitReport | None:
        """Collective: wait for this rank's writer, then commit as :meth:`poll` does (every
        rank calls it at the same point, so every rank is done)."""
        if self._pending is None:
            return None
        if self.writer.wait(self.timeout_s) is None:
            self.writer.give_up(
                TimeoutError(f"the writer did not finish within {self.timeout_s:g} s")
            )
        return self.poll()

    def close(self, timeout_s: float = 60.0) -> None:
        """Abandon a pending save (no communication): wait up to ``timeout_s`` for the writer
        thread; the uncommitted staging directory is removed by the next save."""
        self.writer.wait(timeout_s)
        self.writer.collect()
        self._pending = None

    def _raise_failure(
        self, pending: PendingCommit, rank: int, outcome: WriteOutcome | None
    ) -> None:
        latest = read_latest_iteration(pending.save_dir)
        kept = (
            "there is no committed checkpoint yet"
            if latest is None
            else f"the latest checkpoint is still iteration {latest}"
        )
        if outcome is not None and outcome.error is not None and rank == self.world.rank:
            error = outcome.error
            text = str(error).splitlines()[0] if str(error) else ""
            cause = f"{type(error).__name__}: {text}" if text else type(error).__name__
            raise UserError(
                f"writing checkpoint iteration {pending.iteration} in the "
                f"background failed on rank {rank} ({cause}); {kept}"
            ) from error
        raise UserError(
            f"writing checkpoint iteration {pending.iteration} in the background "
            f"failed on rank {rank} (see its error); {kept}"
        )
