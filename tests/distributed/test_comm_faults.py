"""Faults: a hung or dead peer raises a CommError naming group and op; debug mode mismatches."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch

from megatron_het.comm.communicator import UnifiedCommunicator
from megatron_het.comm.faults import CollectiveMismatchError, CommError
from tests.distributed.harness import RankFailure, run_ranks

KINDS = ["fast", "fast", "slow", "slow"]
OP_TIMEOUT_S = 2


def make_comm(debug: bool = False) -> UnifiedCommunicator:
    return UnifiedCommunicator(
        KINDS,
        {k: "gloo" for k in KINDS},
        {k: "cpu" for k in KINDS},
        timeout=datetime.timedelta(seconds=OP_TIMEOUT_S),
        debug=debug,
    )


def hung_peer(rank: int, world_size: int) -> str | None:
    comm = make_comm()
    group = comm.new_group([0, 1, 2, 3], name="dp")
    comm.barrier()
    if rank == 3:  # stays away from the collective for longer than the timeout
        time.sleep(3 * OP_TIMEOUT_S)
        return None
    try:
        group.all_reduce(torch.ones(1000))
    except CommError as exc:
        return str(exc)
    return "no error"


def dead_peer(rank: int, world_size: int) -> None:
    comm = make_comm()
    group = comm.new_group([0, 1, 2, 3], name="tp-mixed")
    comm.barrier()
    if rank == 3:
        os._exit(1)
    time.sleep(0.5)
    group.broadcast(torch.ones(100), src=3)


@pytest.mark.slow
def test_hung_peer_raises_naming_group_and_op() -> None:
    results = run_ranks(hung_peer, 4, timeout=60)
    for rank in range(3):
        assert results[rank].startswith("unified group 'dp': all_reduce"), results[rank]
        assert "failed" in results[rank] and "Timed out" in results[rank], results[rank]
        assert "ranks [" in results[rank]  # names the backend link it was waiting on


def test_dead_peer_raises_instead_of_hanging() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(dead_peer, 4, timeout=60)
    text = str(info.value)
    assert "rank 3 failed" in text and "exited with code 1" in text
    assert "did not finish" not in text  # nobody hung until the harness timeout
    # every survivor that touched the broadcast reports the group and the op
    survivors = [r for r in range(3) if f"rank {r} failed" in text]
    assert survivors, text
    assert text.count("CommError: unified group 'tp-mixed': broadcast") == len(survivors), text


def mismatch(rank: int, world_size: int) -> list[str]:
    comm = make_comm(debug=True)
    group = comm.new_group([0, 1, 2, 3], name="dp")
    messages = []
    shape = (4, 9) if rank == 3 else (4, 8)
    try:
        group.all_reduce(torch.ones(shape))
    except CollectiveMismatchError as exc:
        messages.append(str(exc))
    dtype = torch.float16 if rank == 1 else torch.float32
    try:
        group.all_gather(
            [torch.empty(3, dtype=dtype) for _ in range(4)], torch.ones(3, dtype=dtype)
        )
    except CollectiveMismatchError as exc:
        messages.append(str(exc))
    try:
        group.broadcast(torch.ones(2), src=0 if rank < 2 else 2)
    except CollectiveMismatchError as exc:
        messages.append(str(exc))
    t = torch.full((5,), float(rank))  # the group still works after a reported mismatch
    group.all_reduce(t)
    messages.append(str(t[0].item()))
    return messages


def test_debug_mode_reports_mismatched_shapes_dtypes_and_roots() -> None:
    results = run_ranks(mismatch, 4, timeout=60)
    assert all(r == results[0] for r in results)  # every rank reports the same thing
    shape_msg, dtype_msg, root_msg, after = results[0]
    assert shape_msg == (
        "unified group 'dp': all_reduce failed: ranks disagree: ranks [0, 1, 2] "
        "called all_reduce with float32[4, 8] op=sum; rank 3 called all_reduce "
        "with float32[4, 9] op=sum"
    )
    assert "ranks [0, 2, 3] called all_gather with float32[3]" in dtype_msg
    assert "rank 1 called all_gather with float16[3]" in dtype_msg
    assert "ranks [0, 1] called broadcast with float32[2] src=0" in root_msg
    assert "ranks [2, 3] called broadcast with float32[2] src=2" in root_msg
    assert after == "6.0"
