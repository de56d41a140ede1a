"""Fail fast when a peer dies or hangs: heartbeats in the launcher's store, one report line.

Every rank of a launched run keeps a heartbeat in the rendezvous store (the key-value store
torchrun's agent, or rank 0, serves): a background thread bumps a counter every
:func:`heartbeat_interval` seconds, together with the iteration the rank is in and where its
main thread is (the pipeline's compute or p2p region, or outside them) for how long. A stopped
(SIGSTOP) or killed rank's counter stands still; a rank waiting on a peer, or computing, keeps
beating. Counters are compared by one observer over a window, so clocks of different hosts never
meet.

When an operation fails on a rank (its communicator raised after ``--distributed-timeout-minutes``,
or a peer's connection broke), :meth:`PeerWatch.report` records the failure in the store, raises
the run's abort flag, watches the counters for one window and returns one line: the ranks that
stopped answering (no failure of their own, no heartbeat in the window), the ranks that still
answer but have been inside one compute region for half the timeout or more (a rank stuck in
compute, which the others' operations waited on), the ranks that failed before this one, and
this rank's own failed operation (group, op, backend ranks). An operation that never fails on
the main thread -- a device backend's (NCCL) wait returns at once, and the host then blocks
where it reads a result -- is found by the beating thread instead (``stuck_operation``, e.g.
:meth:`megatron_het.comm.pending.PendingOps.stuck`): once one has run past the timeout it
calls ``on_stuck`` with that operation's error, which reports it the same way and ends the
process. Every beating
thread that sees the abort flag gives its main thread ``grace_s`` to fail on its own and then
ends the process itself (a rank stuck in a kernel or a wait that will never time out), so no rank
of the run waits forever.

The store is served on rank 0's node (by torchrun's agent there, or by rank 0), so it dies with
that node. Every store call is bounded (:class:`~megatron_het.launcher.bounded_store.
BoundedStore`): a store whose host stopped answering fails the calls instead of blocking them.
A failing rank that finds the store gone reports from what it knows: rank 0 published the
number of ranks on its node at start-up, and torchrun numbers a node's ranks consecutively, so
ranks ``0 .. n-1`` are taken as lost with the store, and the first rank of :meth:`reporters`
(then the lowest rank) outside that node prints the line.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_het.comm.faults import CommError, first_line
from megatron_het.errors import EXIT_PEER_FAILURE
from megatron_het.launcher.bounded_store import BoundedStore

PREFIX = "megatron_het/peer_watch/"
FALLBACK_REPORTERS = 3  # ranks after the logging rank that report when it is lost


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between heartbeats for an operation timeout of ``timeout_s``: a twentieth of
    it, between 0.5 and 5 s."""
    return min(max(timeout_s / 20.0, 0.5), 5.0)


def _abort_process(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_FAILURE)


class PeerWatch:
    """One rank's heartbeat and its view of the others (see module doc).

    ``store`` has ``set``, ``get``, ``check`` (torch.distributed's TCPStore / HashStore).
    ``progress`` returns the rank's current iteration; ``activity`` where its main thread is
    and for how many seconds (:meth:`~megatron_het.pipeline.timing.RegionClock.activity`;
    one word, then seconds); ``describe`` names a rank in a report
    (its kind and stage); ``on_abort`` ends the process when the run was aborted elsewhere and
    this rank's main thread did not fail within ``grace_s`` (default: print and ``os._exit``).
    ``generation`` separates the keys of successive launches sharing one store (torchrun's
    restart count). ``logging_rank`` prints the full report (see :meth:`reporters`).
    ``node_size`` is the number of ranks on this rank's node (torchrun's LOCAL_WORLD_SIZE; 0:
    unknown); rank 0's tells the others which ranks are lost with the store's node. Every call
    on ``store`` is bounded by ``store_deadline_s`` (default: two windows, at least 5 s; see
    module doc). ``stuck_operation(timeout_s)`` returns the error of an operation of this
    rank's still running after ``timeout_s`` (None: none); once :attr:`on_stuck` is set, the
    beating thread calls it with that error (it reports and ends the process).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        progress: Callable[[], int] = lambda: 0,
        activity: Callable[[], tuple[str, float]] = lambda: ("outside", 0.0),
        describe: Callable[[int], str] = lambda r: f"rank {r}",
        on_abort: Callable[[str], None] = _abort_process,
        grace_s: float | None = None,
        generation: int = 0,
        logging_rank: int = 0,
        node_size: int = 0,
        store_deadline_s: float | None = None,
        stuck_operation: Callable[[float], CommError | None] = lambda _s: None,
        run_id: str = "",
    ) -> None:
        self.prefix = f"{PREFIX}{generation}/"
        self.run_id = run_id  # the launcher's job id, for the failure record
        self.logging_rank = logging_rank
        self.rank, self.world_size = rank, world_size
        self.interval_s = heartbeat_interval(timeout_s)
        self.window_s = 1.5 * self.interval_s + 0.2  # a live rank beats at least once in it
        self.grace_s = 3.0 * self.window_s if grace_s is None else grace_s
        self.store_deadline_s = (
            max(2.0 * self.window_s, 5.0) if store_deadline_s is None else store_deadline_s
        )
        self.store: Any = BoundedStore(store, self.store_deadline_s)
        self.node_size = node_size
        # ranks on rank 0's node (which serves the store): rank 0 knows, the others read it
        self._store_node_size: int | None = (node_size or None) if rank == 0 else None
        self._store_error: BaseException | None = None  # why the store is taken as gone
        self.progress, self.describe, self.on_abort = progress, describe, on_abort
        self.activity = activity
        self.timeout_s = timeout_s
        self.stuck_operation = stuck_operation
        self.on_stuck: Callable[[CommError], None] | None = None
        self._beats = 0
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._abort_seen_at: float | None = None
        # (when, every other rank's heartbeat) read once the abort was first seen
        self._snapshot: tuple[float, dict[int, str]] | None = None

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}{kind}/{rank}"

    # ---- beating ---------------------------------------------------------------------------
    def start(self) -> None:
        """Write the first heartbeat (synchronously; rank 0 also the size of its node) and
        start the beating thread."""
        if self.rank == 0 and self.node_size:
            self.store.set(self._key("node-size", 0), str(self.node_size))
        self._beat()
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating (the end of a run that did not fail)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1.0)
        if isinstance(self.store, BoundedStore):
            self.store.close()

    def _beat(self) -> None:
        self._beats += 1
        place, seconds = self.activity()
        self.store.set(
            self._key("beat", self.rank),
            f"{self._beats} {self.progress()} {place or '-'} {seconds:.1f}",
        )
        if self._store_node_size is None:
            key = self._key("node-size", 0)
            if self.store.check([key]):
                self._store_node_size = int(self.store.get(key).decode())

    def store_node_ranks(self) -> tuple[int, ...]:
        """The ranks on rank 0's node, which serves the store (empty: not known yet)."""
        return tuple(range(min(self._store_node_size or 0, self.world_size)))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                self._check_abort()
            except Exception:
                pass
            self._check_stuck()

    def _check_stuck(self) -> None:
        """Call :attr:`on_stuck` for an operation past the timeout that did not fail on the
        main thread (see the module doc)."""
        if self._failing or self.on_stuck is None:
            return
        error = self.stuck_operation(self.timeout_s)
        if error is not None:
            self.on_stuck(error)

    def _check_abort(self) -> None:
        if self._failing or not self.store.check([self._key("abort", 0)]):
            return
        now = time.monotonic()
        if self._abort_seen_at is None:
            self._abort_seen_at = now
            if self.rank in self.reporters():  # only a possible reporter reads them all
                self._snapshot = (now, self._read("beat", self._others()))
        elif now - self._abort_seen_at >= self.grace_s and not self._failing:
            origin = self.store.get(self._key("abort", 0)).decode()
            self.on_abort(
                f"rank {self.rank}: stopping at iteration {self.progress()}: the run "
                f"was aborted after a failure on {origin}"
            )

    def _others(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    # ---- reading the others ----------------------------------------------------------------
    def _read(self, kind: str, ranks: Sequence[int]) -> dict[int, str]:
        found = {}
        for rank in ranks:
            key = self._key(kind, rank)
            if self.store.check([key]):
                found[rank] = self.store.get(key).decode()
        return found

    def record(self, error: BaseException, iteration: int) -> None:
        """Record this rank's failure (any exception) and raise the abort flag, so the peers'
        reports name it and their processes end; never raises (a store that does not answer
        is remembered for :meth:`report`)."""
        self._failing = True
        what = (
            f"{error.op} on unified group '{error.group}'"
            if isinstance(error, CommError)
            else type(error).__name__
        )
        try:
            self.store.set(self._key("failed", self.rank), f"{iteration} {what}")
            if not self.store.check([self._key("abort", 0)]):
                self.store.set(self._key("abort", 0), self.describe(self.rank))
        except Exception as exc:
            self._store_error = exc

    def reporters(self) -> list[int]:
        """The ranks that may print the full report, in order: the logging rank, then the
        lowest others (a report needs one rank that answers; each reads only those before it)."""
        rest = [
            r for r in range(min(self.world_size, FALLBACK_REPORTERS + 1)) if r != self.logging_rank
        ]
        return [self.logging_rank, *rest[:FALLBACK_REPORTERS]]

    def _beats_between(
        self, ranks: Sequence[int], sleep: Callable[[float], None]
    ) -> tuple[dict[int, str], dict[int, str]]:
        """Heartbeats of ``ranks`` one window apart: from the snapshot taken when the abort
        was first seen where there is one, else read now and after a window."""
        snapshot = self._snapshot
        if snapshot is None:
            before = self._read("beat", ranks)
            sleep(self.window_s)
        else:
            taken, before = snapshot
            left = self.window_s - (time.monotonic() - taken)
            if left > 0:
                sleep(left)
        return before, self._read("beat", ranks)

    def report(
        self, error: BaseException, iteration: int, sleep: Callable[[float], None] = time.sleep
    ) -> PeerReport:
        """Record this rank's failure, abort the run and return the report (see module doc):
        the full line where this rank is the first of :meth:`reporters` that still answers
        (it reads every heartbeat one window apart), else a short line naming the failed
        operation and the rank with the report. Never raises: where the store is gone (its
        node died), the ranks of that node are named from what this rank knows."""
        mine = first_line(error)
        self.record(error, iteration)
        if self._store_error is None:
            try:
                return self._report_from_store(mine, iteration, sleep)
            except Exception as exc:
                self._store_error = exc
        return self._report_without_store(mine, iteration, first_line(self._store_error))

    def _short(self, mine: str, where: str) -> PeerReport:
        return PeerReport(
            f"rank {self.rank}: {mine} (the report is on {where})", (), (), full=False
        )

    def _report_without_store(self, mine: str, iteration: int, why: str) -> PeerReport:
        lost = self.store_node_ranks()
        if not lost or self.rank in lost:  # no node to name (or this rank's own is gone)
            return PeerReport(
                f"iteration {iteration}: {mine}; the rendezvous store did not answer ({why}): "
                "the node serving it (rank 0's) is gone",
                (),
                (),
            )
        reporter = next(r for r in [*self.reporters(), *range(self.world_size)] if r not in lost)
        if reporter != self.rank:
            return self._short(mine, f"rank {reporter}")
        return PeerReport(
            f"iteration {iteration}: {_names(self, lost)} stopped answering "
            f"(the rendezvous store on their node did not answer: {why}); "
            f"on rank {self.rank}: {mine}",
            lost,
            (),
        )

    def _report_from_store(
        self, mine: str, iteration: int, sleep: Callable[[float], None]
    ) -> PeerReport:
        order = self.reporters()
        if self.rank not in order:  # reads nothing: thousands of ranks may fail at once
            return self._short(
                mine, f"the first of ranks {', '.join(map(str, order))} that answers"
            )
        earlier = order[: order.index(self.rank)]
        if earlier:
            before, after = self._beats_between(earlier, sleep)
            failed = self._read("failed", earlier)
            answering = [r for r in earlier if r in failed or before.get(r) != after.get(r)]
            if answering:
                return self._short(mine, f"rank {answering[0]}")
        others = self._others()
        before, after = self._beats_between(others, sleep)
        failed = self._read("failed", others)
        silent = tuple(r for r in others if r not in failed and before.get(r) == after.get(r))
        parts = [f"iteration {iteration}:"]
        if silent:
            parts.append(
                f"{_names(self, silent)} stopped answering (no heartbeat in "
                f"{self.window_s:.1f} s; the last one came after iteration "
                f"{_last_iterations(after, silent)});"
            )
        else:
            parts.append("every other rank still answers;")
        answering = [r for r in others if r not in silent and r not in failed]
        stuck = _stuck_in_compute(after, answering, self.timeout_s / 2)
        if stuck:
            parts.append(
                ", ".join(f"{self.describe(r)} has been computing for {s:.0f} s" for r, s in stuck)
                + " (stuck in compute: the others' operations waited on it);"
            )
        parts.append(f"on rank {self.rank}: {mine}")
        if failed:
            earlier_failures = "; ".join(
                f"rank {r} at iteration {_iteration_and_what(v)}" for r, v in sorted(failed.items())
            )
            parts[-1] += f"; failed before: {earlier_failures}"
        return PeerReport(
            " ".join(parts), silent, tuple(sorted(failed)), stuck=tuple(r for r, _ in stuck)
        )


@dataclass(frozen=True)
class PeerReport:
    """A failure as one rank saw it: the line, the ranks that stopped answering, those that
    had failed already and those stuck in compute (known to the full report only), and
    whether the line is the full report."""

    line: str
    silent: tuple[int, ...]
    failed: tuple[int, ...]
    full: bool = True
    stuck: tuple[int, ...] = ()


def _names(watch: PeerWatch, ranks: Sequence[int]) -> str:
    return ", ".join(watch.describe(r) for r in ranks)


def _iteration_and_what(value: str) -> str:
    iteration, _, what = value.partition(" ")
    return f"{iteration} ({what})" if what else iteration


def _stuck_in_compute(
    beats: dict[int, str], ranks: Sequence[int], least_s: float
) -> list[tuple[int, float]]:
    """(rank, seconds) of the ``ranks`` whose latest heartbeat says they have been inside one
    compute region for ``least_s`` seconds or more, longest first."""
    stuck = []
    for rank in ranks:
        fields = beats.get(rank, "").split()
        if len(fields) >= 4 and fields[2] == "compute" and float(fields[3]) >= least_s:
            stuck.append((rank, float(fields[3])))
    return sorted(stuck, key=lambda item: -item[1])


def _last_iterations(beats: dict[int, str], ranks: Sequence[int]) -> str:
    seen = sorted({beats[r].split()[1] for r in ranks if r in beats})
    return "/".join(seen) if seen else "start-up"
