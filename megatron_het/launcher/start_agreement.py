"""The job's rendezvous store and the start-up agreement: every rank starts, or stops, together.

Before the world group exists, every launched rank posts to the rendezvous store (torchrun's
agent serves it, or rank 0 without torchrun) whether it can take part (:func:`agree_at_start`);
where any rank cannot, every rank stops with the same one-line error naming the ranks, instead
of the others waiting out the timeout for a rank that left.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from megatron_het.comm.faults import first_line
from megatron_het.errors import PeerFailure, RanksError
from megatron_het.launcher.launch_env import LaunchEnv


class StartupError(PeerFailure):
    """Not every rank joined the job's rendezvous within the timeout."""


def stop_together(env: LaunchEnv, timeout: datetime.timedelta, problem: str) -> RanksError:
    """For a rank that cannot start (``problem``, e.g. a file its node lacks), before the
    world exists: the error every rank stops with (:func:`agree_at_start`), once the others
    have heard of it; the ranks that can start stop with the same one. Where the store cannot
    be reached, this rank's own problem alone."""
    try:
        store = rendezvous_store(env, timeout)
    except StartupError:
        return _own(env, problem)
    error = agree_at_start(store, env, problem, timeout)
    return error if error is not None else _own(env, problem)


def rendezvous_store(env: LaunchEnv, timeout: datetime.timedelta) -> Any:
    """The job's rendezvous store: a client of torchrun's agent's store, or, without torchrun,
    one that rank 0 serves. Rank 0 does not wait for the others to connect: they are counted
    at the agreement (:func:`agree_at_start`), which can name the ones missing."""
    import torch.distributed as dist

    serve = env.rank == 0 and not env.agent_store
    try:
        return dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=serve,
            timeout=timeout,
            wait_for_workers=False,
            multi_tenant=serve,
            use_libuv=env.use_libuv,
        )
    except RuntimeError as exc:
        raise _startup_error(env, timeout, first_line(exc)) from None


def _startup_error(env: LaunchEnv, timeout: datetime.timedelta, why: str) -> StartupError:
    return StartupError(
        f"start-up: rank {env.rank} could not join the {env.world_size}-rank rendezvous at "
        f"{env.master_addr}:{env.master_port} within {timeout.total_seconds() / 60:g} min "
        f"({why}); start every rank (torchrun on every node) or raise "
        "--distributed-timeout-minutes"
    )


# How long a rank that is about to stop waits for the others to read the store first: it may
# be served by a rank that stops, or by the agent of a node whose ranks all stop.
_READ_GRACE_S = 10.0
# How long the rank that serves the store (rank 0 without torchrun) stays after the last read.
_SERVER_GRACE_S = 0.5


def agree_at_start(
    store: Any, env: LaunchEnv, problem: str | None, timeout: datetime.timedelta
) -> RanksError | None:
    """Post this rank's start-up ``problem`` (None: none) to ``store`` and wait for every
    rank's; returns None when no rank has one, else the error every rank raises: one line of
    each problem with the ranks that have it ("ranks 8-15: ..."; a problem of every rank
    alone), and those ranks.

    The last rank to arrive, or the first to wait ``timeout`` since it arrived, settles the
    outcome for all (one key, set once): every rank then stops, or goes on, together. Ranks
    missing at the timeout are named in a :class:`StartupError` (in the RanksError, after the
    problems, where there are any). Keys are per job and launch (``env.run_id``,
    ``env.restart_count``, as the launcher's static rendezvous and the elastic
    supervisors keep them distinct): torchrun's agent store outlives a launch."""
    own = None if problem is None else first_line(problem)
    try:
        problems, ranks, missing = _agree(store, env, own, timeout)
    except RuntimeError as exc:  # the store went away: its rank or agent stopped
        if own is not None:
            return _own(env, own)
        raise StartupError(
            f"start-up: rank {env.rank} lost the rendezvous store at {env.master_addr}:"
            f"{env.master_port} ({first_line(exc)}); a rank on the store's node stopped, see "
            "its output"
        ) from None
    if problems and missing:
        return RanksError(f"{problems}; rank(s) {missing} had not arrived at the timeout", ranks)
    if missing:
        raise _startup_error(env, timeout, f"rank(s) {missing} had not arrived at the timeout")
    return RanksError(problems, ranks) if problems else None


def _own(env: LaunchEnv, problem: str) -> RanksError:
    """This rank's ``problem`` alone, where the other ranks could not be told."""
    return RanksError(f"rank {env.rank}: {first_line(problem)}", (env.rank,))


def _agree(
    store: Any, env: LaunchEnv, own: str | None, timeout: datetime.timedelta
) -> tuple[str, tuple[int, ...], str]:
    """(the problems line, the ranks with problems, the ranks missing at the timeout) of
    :func:`agree_at_start`; "", (), "" when every rank arrived without a problem."""
    import torch.distributed as dist

    from megatron_het.cluster.cluster import format_ranks

    prefix = f"megatron_het/start/{env.run_id}/{env.restart_count}/"
    if own is not None:
        store.append(prefix + "problems", f"{env.rank}\t{own}\n")
    store.append(prefix + "arrived", f"{env.rank},")
    # The outcome, set once: "all", or "missing:<ranks>" from the first rank to give up; then
    # "settled", whose plain set wakes the waiting ranks on either kind of store server (the
    # one without libuv does not wake them at a compare_set).
    outcome, settled_key = prefix + "outcome", prefix + "settled"
    if store.add(prefix + "count", 1) == env.world_size:
        store.compare_set(outcome, "", "all")
        store.set(settled_key, "1")
    try:
        store.wait([settled_key], timeout)
    except dist.DistStoreError:  # this rank's timeout: give up, unless another settled it
        arrived = {int(r) for r in store.get(prefix + "arrived").decode().split(",") if r}
        missing = [r for r in range(env.world_size) if r not in arrived]
        store.compare_set(outcome, "", f"missing:{format_ranks(missing)}")
        store.set(settled_key, "1")
    settled = store.get(outcome).decode()
    missing_ranks = settled.removeprefix("missing:") if settled != "all" else ""
    problems, with_problems = "", tuple[int, ...]()
    if store.check([prefix + "problems"]):
        by_line: dict[str, list[int]] = {}
        for entry in store.get(prefix + "problems").decode().splitlines():
            rank, line = entry.split("\t", 1)
            by_line.setdefault(line, []).append(int(rank))
        with_problems = tuple(sorted(r for ranks in by_line.values() for r in ranks))
        if len(by_line) == 1 and len(next(iter(by_line.values()))) == env.world_size:
            problems = next(iter(by_line))  # every rank's: the line alone
        else:
            problems = "; ".join(
                f"{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(sorted(ranks))}: {line}"
                for line, ranks in sorted(by_line.items(), key=lambda item: min(item[1]))
            )
    if problems or missing_ranks:
        arrived_count = int(store.add(prefix + "count", 0))
        _linger(store, prefix + "read", arrived_count, env.rank == 0 and not env.agent_store)
    return problems, with_problems, missing_ranks


def _linger(store: Any, key: str, ranks: int, serves: bool) -> None:
    """Count this rank at ``key`` and wait until ``ranks`` ranks are counted there, at most
    :data:`_READ_GRACE_S` (see there): the rank that completes the count wakes the others. The
    rank that ``serves`` the store then gives their wake-ups time to leave before it exits."""
    try:
        if store.add(key, 1) >= ranks:
            store.set(key + "/done", "1")
        else:
            store.wait([key + "/done"], datetime.timedelta(seconds=_READ_GRACE_S))
    except RuntimeError:
        pass  # the store left with the rank or agent that served it; this rank has read it
    if serves:
        time.sleep(_SERVER_GRACE_S)


def connect_store(env: LaunchEnv, timeout: datetime.timedelta) -> Any:
    """A client of the job's rendezvous store (torchrun's agent serves it, or rank 0 without
    torchrun), for the ranks' heartbeats (:mod:`megatron_het.launcher.peer_watch`)."""
    import torch.distributed as dist

    return dist.TCPStore(
        env.master_addr, env.master_port, is_master=False, timeout=timeout, wait_for_workers=False
    )
