"""Sequence parallelism against the single-process model (gloo, 4 forked ranks, TP 2 and 4).

A sequence-parallel stage takes and returns hidden states ``[B, S/tp, H]`` (rank r holding
positions r*S/tp ..): its outputs and input gradients must equal the matching positions of the
single-process ones, its loss the single-process loss, and every parameter gradient (the norm
weights' included, summed over TP) the single-process gradient's shard. Norm-wise relative
error <= 1e-5 in float32.
"""
from __future__ import annotations

import pytest
import torch

from megatron_het.model.llama import build_model
from megatron_het.parallel.sequence import sequence_range
from megatron_het.tensor_parallel import apply_tp, shard_spec, unshard
from megatron_het.tensor_parallel.sequence_parallel import gather_from_sp, reduce_scatter_to_sp
from tests.distributed.harness import run_ranks
from tests.distributed.test_tensor_parallel import (SEED, TIED, UNTIED, WORLD, _batch, _close,
                                                    _groups, _randn, _relative_error)

# (config, layer range, has_embedding, has_head, recompute)
CASES = [(UNTIED, None, True, True, False), (TIED, (0, 1), False, False, True),
         (TIED, (1, 2), False, True, False)]


def _mappings(rank: int, world_size: int) -> None:
    for tp, group in _groups(world_size).items():
        start, stop = sequence_range(8, tp, group.rank)
        full = _randn(0, 2, 8, 3)
        shard = full[:, start:stop].clone().requires_grad_()
        gathered = gather_from_sp(shard, group)
        _close(gathered, full, "gather forward")
        grads = [_randn(10 + r, 2, 8, 3) for r in range(tp)]
        gathered.backward(grads[group.rank])
        _close(shard.grad, sum(grads)[:, start:stop], "gather backward: reduce-scatter")
        partial = _randn(20 + group.rank, 2, 8, 3).requires_grad_()
        out = reduce_scatter_to_sp(partial, group)
        _close(out, sum(_randn(20 + r, 2, 8, 3) for r in range(tp))[:, start:stop],
               "reduce-scatter forward")
        grad = _randn(30, 2, stop - start, 3)
        out.backward(grad)
        expected = torch.zeros(2, 8, 3)
        for r in range(tp):  # every rank's gradient, gathered at its positions
            a, b = sequence_range(8, tp, r)
            expected[:, a:b] = _randn(30, 2, b - a, 3)
        _close(partial.grad, expected, "reduce-scatter backward: all-gather")


def test_sequence_parallel_mappings() -> None:
    run_ranks(_mappings, WORLD, timeout=60)


def _stage(model, x: torch.Tensor, labels: torch.Tensor, positions: slice) -> dict:
    hidden_input = x.is_floating_point()
    if hidden_input:
        x = x[:, positions].clone().requires_grad_()
    out = model(x, labels) if model.has_head else model(x)
    out.backward(None if out.dim() == 0 else _randn(9, 2, 8, out.shape[-1])[:, positions])
    result = {"out": out.detach(), "grads": {n: p.grad.clone()
                                             for n, p in model.named_parameters()}}
    if hidden_input:
        result["x_grad"] = x.grad.clone()
    return result


def _sequence_parallel(rank: int, world_size: int, tp: int) -> list[dict]:
    group = _groups(world_size)[tp]
    start, stop = sequence_range(8, tp, group.rank)
    results = []
    for config, layers, has_embedding, has_head, recompute in CASES:
        model = apply_tp(build_model(config, SEED, layers, has_embedding, has_head, recompute),
                         group, config, sequence_parallel=True)
        results.append(_stage(model, *_batch(config, has_embedding), slice(start, stop)))
    return results


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_stages_match_single_process(tp: int) -> None:
    per_rank = run_ranks(_sequence_parallel, WORLD, tp, timeout=90)
    for case, (config, layers, has_embedding, has_head, recompute) in enumerate(CASES):
        reference = _stage(build_model(config, SEED, layers, has_embedding, has_head, recompute),
                           *_batch(config, has_embedding), slice(0, 8))
        for first in range(0, WORLD, tp):
            ranks = [per_rank[r][case] for r in range(first, first + tp)]
            for t, result in enumerate(ranks):
                start, stop = sequence_range(8, tp, t)
                want = reference["out"] if has_head else reference["out"][:, start:stop]
                assert _relative_error(result["out"], want) <= 1e-5, (case, "out", t)
                if "x_grad" in reference:
                    assert _relative_error(result["x_grad"],
                                           reference["x_grad"][:, start:stop]) <= 1e-5, case
            for name, expected in reference["grads"].items():
                shards = [r["grads"][name] for r in ranks]
                assert _relative_error(unshard(name, shards, config, tp), expected) <= 1e-5, (
                    case, name)
                if shard_spec(name, config, tp).replicated:  # norms: summed on every rank
                    assert all(_relative_error(s, expected) <= 1e-5 for s in shards), name
