"""The multi-process test harness itself: results, failures, hangs, and its start method on a
GPU host (fork, or spawn once CUDA is initialised in the parent; faked here)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import RankFailure, run_ranks


def gather_ranks(rank: int, world_size: int, scale: int, offset: int = 0) -> tuple:
    t = torch.tensor([rank * scale + offset])
    out = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(out, t)
    return rank, torch.get_num_threads(), torch.cat(out)


def test_results_come_back_in_rank_order() -> None:
    results = run_ranks(gather_ranks, 3, 10, offset=1)
    assert [r[0] for r in results] == [0, 1, 2]
    assert all(r[1] == 1 for r in results)  # one intra-op thread per worker
    assert all(torch.equal(r[2], torch.tensor([1, 11, 21])) for r in results)


def fails_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise KeyError("boom on purpose")


def hangs_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(60)


def test_worker_exception_names_rank_and_traceback() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(fails_on_rank_one, 2, timeout=20)
    text = str(info.value)
    assert "rank 1 failed" in text and "KeyError: 'boom on purpose'" in text
    assert "fails_on_rank_one" in text  # the worker's traceback, not the parent's
    assert "rank 0 failed" not in text


def test_hang_is_killed_at_the_timeout() -> None:
    with pytest.raises(RankFailure, match=r"rank\(s\) \[0\] did not finish within 3 s"):
        run_ranks(hangs_on_rank_zero, 2, timeout=3)


# Read by the workers: a forked worker sees the parent's value of the moment, a spawned one the
# value its fresh import of this module sets.
START_MARK = "as imported"


def report_start_mark(rank: int, world_size: int) -> str:
    return START_MARK


def cuda_untouchable(monkeypatch: pytest.MonkeyPatch, initialised: bool) -> None:
    """``torch.cuda.is_initialized`` answers ``initialised``; any call that could initialise
    CUDA (is_available, device_count, init) fails the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the harness touched CUDA before starting its workers")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)
    for name in ("is_available", "device_count", "init", "current_device"):
        monkeypatch.setattr(torch.cuda, name, forbidden)


def test_workers_are_forked_while_cuda_is_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_untouchable(monkeypatch, initialised=False)
    monkeypatch.setattr(f"{__name__}.START_MARK", "set by the parent")
    assert run_ranks(report_start_mark, 2, timeout=20) == ["set by the parent"] * 2


@pytest.mark.slow  # a spawned worker imports torch and this module afresh
def test_workers_are_spawned_once_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_untouchable(monkeypatch, initialised=True)
    monkeypatch.setattr(f"{__name__}.START_MARK", "set by the parent")
    assert run_ranks(report_start_mark, 1, timeout=60) == ["as imported"]


def test_a_closure_is_refused_once_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_untouchable(monkeypatch, initialised=True)

    def closure(rank: int, world_size: int) -> int:
        return rank

    with pytest.raises(RuntimeError, match=r"could not run torch code .* module-level function"):
        run_ranks(closure, 2, timeout=20)
