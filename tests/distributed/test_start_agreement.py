"""The start-up agreement over the rendezvous store (training.launch.join_world), on forked
ranks whose store rank 0 serves (a launch without torchrun) or this process serves (as
torchrun's agent does): a rank that cannot take part stops every rank with one line naming
it, at once rather than after the timeout, and a rank that never starts is named when the
others give up."""
from __future__ import annotations

import contextlib
import datetime
import time
from typing import Iterator, Optional

import pytest
import torch.distributed as dist

from megatron_het.training.launch import LaunchEnv
from tests.distributed.harness import free_port, run_ranks


@contextlib.contextmanager
def _agent_store() -> Iterator[int]:
    """A store served by this process, as torchrun's agent serves one; its port."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    try:
        yield port
    finally:
        del store


def _ranks(fn, world_size: int, *args, agent: bool):  # type: ignore[no-untyped-def]
    """``run_ranks`` without a group; with ``agent``, every rank is a client of a store this
    process serves (``LaunchEnv.agent_store``, as under torchrun)."""
    if not agent:
        return run_ranks(fn, world_size, *args, backend=None, timeout=60)
    with _agent_store() as port:
        return run_ranks(_as_agent_client, world_size, fn, port, args, backend=None,
                         timeout=60)


def _as_agent_client(rank: int, world_size: int, fn, agent_port: int, args: tuple,  # type: ignore[no-untyped-def]
                     port: int):
    return fn(rank, world_size, *args, port=agent_port, agent=True)


def _join(rank: int, world_size: int, problems: dict[int, str], timeout_s: float,
          port: int, agent: bool = False) -> tuple[str, float]:
    """Join a world of ``world_size`` ranks; "ok" with an all-reduce's result, or the error's
    class and text; and the seconds it took."""
    import torch
    import torch.distributed as dist

    from megatron_het.errors import UserError
    from megatron_het.training.launch import StartupError, join_world

    env = LaunchEnv(rank, world_size, rank, "127.0.0.1", port, local_world_size=world_size,
                    agent_store=agent)
    started = time.monotonic()
    try:
        join_world(env, datetime.timedelta(seconds=timeout_s), problems.get(rank))
    except (UserError, StartupError) as error:
        return f"{type(error).__name__}: {error}", time.monotonic() - started
    try:
        total = torch.ones(1)
        dist.all_reduce(total)
        return f"ok {int(total.item())}", time.monotonic() - started
    finally:
        dist.destroy_process_group()


def _absent(rank: int, world_size: int, absent: int, timeout_s: float,
            port: int, agent: bool = False) -> Optional[tuple[str, float]]:
    if rank == absent:
        return None
    return _join(rank, world_size, {}, timeout_s, port, agent)


AGENT = pytest.mark.parametrize("agent", [False, True], ids=["rank0-store", "agent-store"])


@AGENT
def test_ranks_without_problems_build_the_world(agent: bool) -> None:
    results = _ranks(_join, 3, {}, 30.0, agent=agent)
    assert [text for text, _ in results] == ["ok 3"] * 3


@AGENT
def test_a_rank_with_a_problem_stops_every_rank_with_the_same_line_at_once(agent: bool) -> None:
    problems = {1: "this host's name 'gpu-07' resolves to the loopback address 127.0.1.1",
                2: "this host's name 'gpu-07' resolves to the loopback address 127.0.1.1"}
    results = _ranks(_join, 4, problems, 120.0, agent=agent)
    line = ("UserError: start-up: ranks 1-2: this host's name 'gpu-07' resolves to the "
            "loopback address 127.0.1.1")
    assert [text for text, _ in results] == [line] * 4
    assert max(seconds for _, seconds in results) < 60  # not the 120 s timeout


def test_distinct_problems_are_each_named_with_their_ranks() -> None:
    problems = {0: "first problem", 2: "second problem\nits details"}
    results = _ranks(_join, 3, problems, 30.0, agent=False)
    line = "UserError: start-up: rank 0: first problem; rank 2: second problem"
    assert [text for text, _ in results] == [line] * 3


@pytest.mark.parametrize("agent,absent", [(False, 1), (True, 0)],
                         ids=["rank0-store", "agent-store"])
def test_a_rank_that_never_starts_is_named(agent: bool, absent: int) -> None:
    """One rank of 3 never joins: the others stop after the timeout naming it."""
    results = _ranks(_absent, 3, absent, 3.0, agent=agent)
    assert results[absent] is None
    for rank in {0, 1, 2} - {absent}:
        text = results[rank][0]
        assert text.startswith(f"StartupError: start-up: rank {rank} could not join the "
                               "3-rank rendezvous at 127.0.0.1:"), text
        assert f"(rank(s) {absent} never arrived)" in text
