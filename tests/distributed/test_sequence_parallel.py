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
from megatron_het.tensor_parallel.comm_overlap import all_gather_linear, linear_reduce_scatter
from megatron_het.tensor_parallel.sequence_parallel import gather_from_sp, reduce_scatter_to_sp
from tests.distributed.harness import run_ranks
from tests.distributed.test_tensor_parallel import (
    SEED,
    TIED,
    UNTIED,
    WORLD,
    _batch,
    _close,
    _groups,
    _randn,
    _relative_error,
)

# (config, layer range, has_embedding, has_head, recompute)
CASES = [
    (UNTIED, None, True, True, False),
    (TIED, (0, 1), False, False, True),
    (TIED, (1, 2), False, True, False),
]


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
        _close(
            out,
            sum(_randn(20 + r, 2, 8, 3) for r in range(tp))[:, start:stop],
            "reduce-scatter forward",
        )
        grad = _randn(30, 2, stop - start, 3)
        out.backward(grad)
        expected = torch.zeros(2, 8, 3)
        for r in range(tp):  # every rank's gradient, gathered at its positions
            a, b = sequence_range(8, tp, r)
            expected[:, a:b] = _randn(30, 2, b - a, 3)
        _close(partial.grad, expected, "reduce-scatter backward: all-gather")


def test_sequence_parallel_mappings() -> None:
    run_ranks(_mappings, WORLD, timeout=60)


def _overlapped(rank: int, world_size: int) -> None:
    # The rings against the plain collectives, forward and backward, with batch 1 (blocks
    # written in place) and 2 (blocks that are not contiguous in memory), two weights sharing
    # one gather.
    for tp, group in _groups(world_size).items():
        start, stop = sequence_range(8, tp, group.rank)
        for batch in (1, 2):
            full = _randn(0, batch, 8, 6)
            weights = [_randn(40 + i + group.rank, 5 + i, 6) for i in range(2)]
            outs, plain = [], []
            for fn in (all_gather_linear, None):
                shard = full[:, start:stop].clone().requires_grad_()
                ws = [w.clone().requires_grad_() for w in weights]
                if fn is None:
                    gathered = gather_from_sp(shard, group)
                    ys = [torch.nn.functional.linear(gathered, w) for w in ws]
                else:
                    ys = list(fn(shard, ws, group))
                sum(
                    (y * _randn(50 + i + group.rank, *y.shape)).sum() for i, y in enumerate(ys)
                ).backward()
                (outs if fn else plain).append([*ys, shard.grad, *(w.grad for w in ws)])
            for got, want in zip(outs[0], plain[0]):
                _close(got, want, "all_gather_linear")
            x = _randn(60 + group.rank, batch, 8, 6)
            weight = _randn(70 + group.rank, 4, 6)
            results = []
            for overlapped in (True, False):
                xx, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
                y = (
                    linear_reduce_scatter(xx, w, group)
                    if overlapped
                    else reduce_scatter_to_sp(torch.nn.functional.linear(xx, w), group)
                )
                (y * _randn(80 + group.rank, *y.shape)).sum().backward()
                results.append((y, xx.grad, w.grad))
            for got, want in zip(*results):
                _close(got, want, "linear_reduce_scatter")


def test_overlapped_rings_match_the_collectives() -> None:
    run_ranks(_overlapped, WORLD, timeout=60)


def _stage(model, x: torch.Tensor, labels: torch.Tensor, positions: slice) -> dict:
    hidden_input = x.is_floating_point()
    if hidden_input:
        x = x[:, positions].clone().requires_grad_()
    out = model(x, labels) if model.has_head else model(x)
    out.backward(None if out.dim() == 0 else _randn(9, 2, 8, out.shape[-1])[:, positions])
    result = {
        "out": out.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }
    if hidden_input:
        result["x_grad"] = x.grad.clone()
    return result


def _sequence_parallel(rank: int, world_size: int, tp: int, overlap: bool) -> list[dict]:
    group = _groups(world_size)[tp]
    start, stop = sequence_range(8, tp, group.rank)
    results = []
    for config, layers, has_embedding, has_head, recompute in CASES:
        model = apply_tp(
            build_model(config, SEED, layers, has_embedding, has_head, recompute),
            group,
            config,
            sequence_parallel=True,
            tp_comm_overlap=overlap,
        )
        results.append(_stage(model, *_batch(config, has_embedding), slice(start, stop)))
    return results


@pytest.mark.parametrize("tp,overlap", [(2, False), (4, False), (2, True), (4, True)])
def test_sequence_parallel_stages_match_single_process(tp: int, overlap: bool) -> None:
    # overlap: --tp-comm-overlap's rings in place of the all-gathers and reduce-scatters.
    per_rank = run_ranks(_sequence_parallel, WORLD, tp, overlap, timeout=90)
    for case, (config, layers, has_embedding, has_head, recompute) in enumerate(CASES):
        reference = _stage(
            build_model(config, SEED, layers, has_embedding, has_head, recompute),
            *_batch(config, has_embedding),
            slice(0, 8),
        )
        for first in range(0, WORLD, tp):
            ranks = [per_rank[r][case] for r in range(first, first + tp)]
            for t, result in enumerate(ranks):
                start, stop = sequence_range(8, tp, t)
                want = reference["out"] if has_head else reference["out"][:, start:stop]
                assert _relative_error(result["out"], want) <= 1e-5, (case, "out", t)
                if "x_grad" in reference:
                    assert (
                        _relative_error(result["x_grad"], reference["x_grad"][:, start:stop])
                        <= 1e-5
                    ), case
            for name, expected in reference["grads"].items():
                shards = [r["grads"][name] for r in ranks]
                assert _relative_error(unshard(name, shards, config, tp), expected) <= 1e-5, (
                    case,
                    name,
                )
                if shard_spec(name, config, tp).replicated:  # norms: summed on every rank
                    assert all(_relative_error(s, expected) <= 1e-5 for s in shards), name
