"""The start-up agreement over the rendezvous store (launcher.world.join_world), on forked
ranks whose store rank 0 serves (a launch without torchrun) or this process serves (as
torchrun's agent does): a rank that cannot take part stops every rank with one line naming
it, at once rather than after the timeout, and a rank that never starts is named when the
others give up."""

from __future__ import annotations

import contextlib
import datetime
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from megatron_het.launcher.launch_env import LaunchEnv
from tests.distributed.harness import free_port, run_ranks

# The agent: a store served by a process of its own, as torchrun's agent serves one (served
# from this process instead, a worker forked while the store's thread held a lock could hang).
_AGENT = """
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
print("ready", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _agent_store() -> Iterator[int]:
    """A store served by another process, as torchrun's agent serves one; its port."""
    port = free_port()
    agent = subprocess.Popen(
        [sys.executable, "-c", _AGENT, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stdout is not None and agent.stdout.readline().strip() == "ready"
        yield port
    finally:
        agent.kill()
        agent.wait(10)


def _ranks(fn, world_size: int, *args, agent: bool):  # type: ignore[no-untyped-def]
    """``run_ranks`` without a group; with ``agent``, every rank is a client of a store this
    process serves (``LaunchEnv.agent_store``, as under torchrun)."""
    if not agent:
        return run_ranks(fn, world_size, *args, backend=None, timeout=60)
    with _agent_store() as port:
        return run_ranks(_as_agent_client, world_size, fn, port, args, backend=None, timeout=60)


def _as_agent_client(
    rank: int,
    world_size: int,
    fn,
    agent_port: int,
    args: tuple,  # type: ignore[no-untyped-def]
    port: int,
):
    return fn(rank, world_size, *args, port=agent_port, agent=True)


def _join(
    rank: int,
    world_size: int,
    problems: dict[int, str],
    timeout_s: float,
    delays: dict[int, float] | None = None,
    launch: int = 0,
    libuv: bool = True,
    *,
    port: int,
    agent: bool = False,
) -> tuple[str, float]:
    """Join a world of ``world_size`` ranks (rank r after ``delays[r]`` seconds, at restart
    ``launch``); "ok" with an all-reduce's result, or the error's class and text; and the
    seconds it took."""
    import torch
    import torch.distributed as dist

    from megatron_het.errors import UserError
    from megatron_het.launcher.start_agreement import StartupError
    from megatron_het.launcher.world import join_world

    time.sleep((delays or {}).get(rank, 0.0))
    env = LaunchEnv(
        rank,
        world_size,
        rank,
        "127.0.0.1",
        port,
        restart_count=launch,
        local_world_size=world_size,
        agent_store=agent,
        use_libuv=libuv,
    )
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


def _absent(
    rank: int,
    world_size: int,
    absent: int,
    timeout_s: float,
    problems: dict[int, str] | None = None,
    delays: dict[int, float] | None = None,
    *,
    port: int,
    agent: bool = False,
) -> tuple[str, float] | None:
    if rank == absent:
        return None
    return _join(rank, world_size, problems or {}, timeout_s, delays, port=port, agent=agent)


def _two_launches(rank: int, world_size: int, *, port: int, agent: bool = False) -> list[str]:
    """Launch 0 with a problem on rank 1, then launch 1 without, on the same store."""
    first, _ = _join(rank, world_size, {1: "a problem"}, 30.0, port=port, agent=agent)
    second, _ = _join(rank, world_size, {}, 30.0, launch=1, port=port, agent=agent)
    return [first, second]


AGENT = pytest.mark.parametrize("agent", [False, True], ids=["rank0-store", "agent-store"])


@AGENT
def test_ranks_without_problems_build_the_world(agent: bool) -> None:
    results = _ranks(_join, 3, {}, 30.0, agent=agent)
    assert [text for text, _ in results] == ["ok 3"] * 3


@AGENT
def test_a_rank_with_a_problem_stops_every_rank_with_the_same_line_at_once(agent: bool) -> None:
    problems = {
        1: "this host's name 'gpu-07' resolves to the loopback address 127.0.1.1",
        2: "this host's name 'gpu-07' resolves to the loopback address 127.0.1.1",
    }
    results = _ranks(_join, 4, problems, 120.0, agent=agent)
    line = (
        "RanksError: ranks 1-2: this host's name 'gpu-07' resolves to the "
        "loopback address 127.0.1.1"
    )
    assert [text for text, _ in results] == [line] * 4
    assert max(seconds for _, seconds in results) < 60  # not the 120 s timeout


def test_distinct_problems_are_each_named_with_their_ranks() -> None:
    problems = {0: "first problem", 2: "second problem\nits details"}
    results = _ranks(_join, 3, problems, 30.0, agent=False)
    line = "RanksError: rank 0: first problem; rank 2: second problem"
    assert [text for text, _ in results] == [line] * 3


@pytest.mark.parametrize(
    "agent,absent", [(False, 1), (True, 0)], ids=["rank0-store", "agent-store"]
)
def test_a_rank_that_never_starts_is_named(agent: bool, absent: int) -> None:
    """One rank of 3 never joins: the others stop after the timeout naming it."""
    results = _ranks(_absent, 3, absent, 3.0, agent=agent)
    assert results[absent] is None
    for rank in {0, 1, 2} - {absent}:
        text = results[rank][0]
        assert text.startswith(
            f"StartupError: start-up: rank {rank} could not join the "
            "3-rank rendezvous at 127.0.0.1:"
        ), text
        assert f"(rank(s) {absent} had not arrived at the timeout)" in text


def test_a_rank_that_arrives_late_hears_who_was_missing_from_the_first_to_give_up() -> None:
    """Rank 1 never joins and rank 2 joins 2.5 s after rank 0, which serves the store: rank 0
    gives up at its timeout (3 s) and rank 2 hears of it then, not at its own timeout."""
    results = _ranks(_absent, 3, 1, 3.0, {}, {2: 2.5}, agent=False)
    for rank in (0, 2):
        assert "(rank(s) 1 had not arrived at the timeout)" in results[rank][0], results[rank]
    assert results[2][1] < 2.5  # its own timeout would end at 3 s


def test_problems_and_a_missing_rank_are_named_together() -> None:
    results = _ranks(_absent, 3, 2, 3.0, {1: "a problem"}, agent=True)
    line = "RanksError: rank 1: a problem; rank(s) 2 had not arrived at the timeout"
    assert [results[0][0], results[1][0]] == [line, line]


def test_a_later_launch_on_the_same_agent_store_agrees_afresh() -> None:
    results = _ranks(_two_launches, 2, agent=True)
    assert results == [["RanksError: rank 1: a problem", "ok 2"]] * 2


@pytest.mark.parametrize("problems", [{}, {1: "a problem"}], ids=["none", "one"])
def test_the_store_server_without_libuv_wakes_the_ranks_at_once(problems: dict[int, str]) -> None:
    """USE_LIBUV=0: rank 0 serves the older store, which does not wake a waiting rank at a
    compare_set; the ranks still agree at once, not at the 30 s timeout."""
    results = _ranks(_join, 3, problems, 30.0, None, 0, False, agent=False)
    expected = "ok 3" if not problems else "RanksError: rank 1: a problem"
    assert [text for text, _ in results] == [expected] * 3
    assert max(seconds for _, seconds in results) < 15


def test_a_rank_that_cannot_reach_the_store_stops_with_its_own_problem() -> None:
    from megatron_het.launcher.start_agreement import stop_together

    env = LaunchEnv(1, 2, 1, "127.0.0.1", free_port(), local_world_size=2)
    error = stop_together(env, datetime.timedelta(seconds=1), "data file /d.idx does not exist")
    assert str(error) == "rank 1: data file /d.idx does not exist" and error.ranks == (1,)
