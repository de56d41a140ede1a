"""Tensor-parallel all-reduces without the defensive copy (``inplace`` opt-ins of mappings.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_het.comm.communicator import UnifiedCommunicator
from megatron_het.tensor_parallel.mappings import copy_to_tp, reduce_from_tp
from tests.distributed.harness import run_ranks


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def in_place(rank: int, world_size: int, kinds: list[str]) -> dict:
    comm = UnifiedCommunicator(kinds, {k: "gloo" for k in kinds}, {k: "cpu" for k in kinds})
    group, r = comm.world, comm.rank
    out: dict = {"mixed": group.is_mixed}
    w = _randn(1, 6, 4).requires_grad_()
    # reduce_from_tp(inplace=True) sums the partial product itself: same memory, same values.
    partial = F.linear(_randn(10 + r, 3, 4), w)
    y = reduce_from_tp(partial, group, inplace=True)
    out["forward_shares_memory"] = y.data_ptr() == partial.data_ptr()
    want = sum(F.linear(_randn(10 + i, 3, 4), w.detach()) for i in range(world_size))
    out["forward_close"] = torch.allclose(y.detach(), want, atol=1e-5)
    y.backward(_randn(20, 3, 6))
    ref_w = w.detach().clone().requires_grad_()
    F.linear(_randn(10 + r, 3, 4), ref_w).backward(_randn(20, 3, 6))
    out["weight_grad_equal"] = torch.equal(w.grad, ref_w.grad)
    # a view (non-contiguous here) is copied as before; the input stays the partial value
    x = _randn(30 + r, 4, 3).t()
    y = reduce_from_tp(x, group, inplace=True)
    out["view_untouched"] = torch.equal(x, _randn(30 + r, 4, 3).t())
    out["view_close"] = torch.allclose(y, sum(_randn(30 + i, 4, 3).t() for i in range(world_size)))
    # copy_to_tp(inplace_grad=True): the incoming gradient itself is summed over the group
    for inplace_grad in (False, True):
        x = _randn(40, 3, 4).requires_grad_()
        seen: list[int] = []  # the gradient entering and leaving copy_to_tp's backward
        x.register_hook(lambda g: seen.append(g.data_ptr()))
        h = copy_to_tp(x, group, inplace_grad=inplace_grad)
        h.register_hook(lambda g: seen.insert(0, g.data_ptr()))
        F.linear(h, _randn(50 + r, 5, 4)).sum().backward()
        want = sum(torch.ones(3, 5) @ _randn(50 + i, 5, 4) for i in range(world_size))
        out[f"grad_close_{inplace_grad}"] = torch.allclose(x.grad, want, atol=1e-5)
        out[f"grad_shares_memory_{inplace_grad}"] = seen[0] == seen[1]
    return out


def test_in_place_tp_all_reduces_skip_the_copy_and_keep_the_numerics() -> None:
    for kinds in (["a", "a"], ["a", "b"]):  # one kind (native) and two kinds (hierarchical)
        for r in run_ranks(in_place, 2, kinds, timeout=60):
            assert r.pop("mixed") == (kinds[0] != kinds[1])
            assert r.pop("grad_shares_memory_False") is False
            assert all(r.values()), r
