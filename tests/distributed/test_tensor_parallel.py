"""Tensor parallelism against single-process references (gloo, 4 forked ranks).

Ranks 0-1 are accelerator kind "fast" and 2-3 kind "slow": the TP-2 groups {0, 1} and {2, 3} run
on their native link, the TP-4 group spans both kinds and runs the hierarchical algorithms.
Model comparisons use the norm-wise relative error ||tp - ref|| / ||ref|| <= 1e-5 (float32).
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.nn.functional as F

from megatron_het.comm import UnifiedCommunicator
from megatron_het.config import ModelConfig
from megatron_het.model.llama import LlamaModel, build_model
from megatron_het.model.loss import linear_cross_entropy
from megatron_het.tensor_parallel import (
    apply_tp,
    copy_to_tp,
    gather_from_tp,
    gather_vocab_parallel_logits,
    reduce_from_tp,
    scatter_to_tp,
    shard_spec,
    unshard,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
    vocab_range,
    vocab_sizes,
)
from tests.distributed.harness import run_ranks

WORLD = 4
SEED = 1234
# GQA (2 query heads per kv group); vocabularies not divisible by 4, so shards are uneven.
UNTIED = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=8,
    num_query_groups=4,
    vocab_size=250,
    name="tp-untied",
)
TIED = UNTIED.replace(tie_embeddings=True, vocab_size=251, name="tp-tied")


def _groups(world_size: int) -> dict[int, object]:
    """{tp size: this rank's TP group}: TP-2 groups {0,1}, {2,3} and the TP-4 group of all."""
    comm = UnifiedCommunicator(
        ["fast", "fast", "slow", "slow"][:world_size],
        {"fast": "gloo", "slow": "gloo"},
        {"fast": "cpu", "slow": "cpu"},
        timeout=datetime.timedelta(seconds=60),
    )
    pairs = [comm.new_group([0, 1], name="tp2-a"), comm.new_group([2, 3], name="tp2-b")]
    return {2: pairs[comm.rank // 2], 4: comm.world}


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


# -- mappings -----------------------------------------------------------------------------------
def _mappings(rank: int, world_size: int) -> None:
    for tp, group in _groups(world_size).items():
        r = group.rank
        # copy_to_tp: identity forward; backward sums the ranks' gradients.
        x = _randn(0, 3, 4).requires_grad_()
        y = copy_to_tp(x, group)
        _close(y, x.detach(), "copy forward")
        (y * _randn(10 + r, 3, 4)).sum().backward()
        _close(x.grad, sum(_randn(10 + i, 3, 4) for i in range(tp)), "copy backward")
        # reduce_from_tp: forward sums; backward is the identity.
        x = _randn(20 + r, 3, 4).requires_grad_()
        y = reduce_from_tp(x, group)
        _close(y, sum(_randn(20 + i, 3, 4) for i in range(tp)), "reduce forward")
        assert torch.equal(x.detach(), _randn(20 + r, 3, 4)), "reduce changed its input"
        y.backward(_randn(30, 3, 4))
        _close(x.grad, _randn(30, 3, 4), "reduce backward")
        # gather_from_tp: last-dim concatenation in rank order; backward keeps own columns.
        x = _randn(40 + r, 2, 3, 2).requires_grad_()
        y = gather_from_tp(x, group)
        _close(y, torch.cat([_randn(40 + i, 2, 3, 2) for i in range(tp)], dim=-1), "gather fwd")
        y.backward(_randn(50, 2, 3, 2 * tp))
        _close(x.grad, _randn(50, 2, 3, 2 * tp)[..., 2 * r : 2 * r + 2], "gather backward")
        # scatter_to_tp: keep own columns; backward all-gathers the gradients.
        x = _randn(60, 3, 2 * tp).requires_grad_()
        y = scatter_to_tp(x, group)
        _close(y, x.detach()[:, 2 * r : 2 * r + 2], "scatter forward")
        y.backward(_randn(70 + r, 3, 2))
        _close(
            x.grad, torch.cat([_randn(70 + i, 3, 2) for i in range(tp)], dim=-1), "scatter backward"
        )


def test_mappings_forward_and_backward() -> None:
    run_ranks(_mappings, WORLD, timeout=60)


# -- vocabulary-parallel cross-entropy ------------------------------------------------------------
def _cross_entropy(rank: int, world_size: int) -> None:
    V, N, H = 251, 12, 16
    labels = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1))
    labels[[2, 7]] = -100
    for tp, group in _groups(world_size).items():
        start, stop = vocab_range(V, tp, group.rank)
        # Per-token loss from sharded logits vs F.cross_entropy on the full logits.
        full = (_randn(2, N, V) * 3).requires_grad_()
        ref = F.cross_entropy(full, labels, reduction="none")
        scale = _randn(3, N)
        (ref * scale).sum().backward()
        local = full.detach()[:, start:stop].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, labels, group, start)
        _close(loss, ref.detach(), f"tp{tp} CE loss")
        (loss * scale).sum().backward()
        _close(local.grad, full.grad[:, start:stop], f"tp{tp} CE logits grad")
        # Fused head (chunked, several chunks) vs the single-process fused head.
        for loss_weights in (None, _randn(4, N).abs()):
            hidden = _randn(5, N, H).requires_grad_()
            weight = (_randn(6, V, H) * 0.5).requires_grad_()
            ref = linear_cross_entropy(hidden, weight, labels, loss_weights)
            ref.backward()
            h = hidden.detach().clone().requires_grad_()
            w = weight.detach()[start:stop].clone().requires_grad_()
            loss = vocab_parallel_linear_cross_entropy(
                h, w, labels, group, start, loss_weights, chunk_tokens=5
            )
            _close(loss, ref.detach(), f"tp{tp} fused loss")
            loss.backward()
            _close(h.grad, hidden.grad, f"tp{tp} fused hidden grad")
            _close(w.grad, weight.grad[start:stop], f"tp{tp} fused weight grad")
            with torch.no_grad():
                _close(
                    vocab_parallel_linear_cross_entropy(h, w, labels, group, start, loss_weights),
                    ref.detach(),
                    f"tp{tp} fused loss without grad",
                )
        # Gathering uneven vocabulary shards back to full logits, and its backward.
        local = full.detach()[:, start:stop].clone().requires_grad_()
        gathered = gather_vocab_parallel_logits(local, group, vocab_sizes(V, tp))
        _close(gathered, full.detach(), f"tp{tp} gathered logits")
        gathered.backward(_randn(8, N, V))
        _close(local.grad, _randn(8, N, V)[:, start:stop], f"tp{tp} gather grad")


def test_vocab_parallel_cross_entropy_matches_single_process() -> None:
    run_ranks(_cross_entropy, WORLD, timeout=60)


# -- whole model / stages -----------------------------------------------------------------------
# (config, layer_range, has_embedding, has_head, recompute)
CASES = [
    (UNTIED, None, True, True, False),
    (TIED, None, True, True, False),
    (TIED, (1, 2), False, True, True),
    (UNTIED, (0, 1), True, False, False),
]


def _batch(config: ModelConfig, has_embedding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    labels = torch.randint(0, config.vocab_size, (2, 8), generator=g)
    labels[0, :3] = -100
    if has_embedding:
        return torch.randint(0, config.vocab_size, (2, 8), generator=g), labels
    return torch.randn(2, 8, config.hidden_size, generator=g), labels


def _run_stage(model: LlamaModel, x: torch.Tensor, labels: torch.Tensor) -> dict:
    """Loss or output, logits, the gradient of every parameter (and of a hidden input)."""
    x = x.clone().requires_grad_() if x.is_floating_point() else x
    out = model(x, labels) if model.has_head else model(x)
    grad_out = _randn(9, *out.shape) if out.dim() else None
    out.backward(grad_out)
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    result = {"out": out.detach(), "grads": grads}
    if x.is_floating_point():
        result["x_grad"] = x.grad.clone()
    if model.has_head:
        with torch.no_grad():
            result["logits"] = model(x)
    return result


def _model(rank: int, world_size: int, tp: int) -> list[dict]:
    group = _groups(world_size)[tp]
    results = []
    for config, layers, has_embedding, has_head, recompute in CASES:
        model = build_model(config, SEED, layers, has_embedding, has_head, recompute)
        apply_tp(model, group, config)
        x, labels = _batch(config, has_embedding)
        results.append(_run_stage(model, x, labels))
        # Drawing the shards from the seed onto a meta-built model gives the same parameters.
        with torch.device("meta"):
            lazy = LlamaModel(config, layers, has_embedding, has_head)
        apply_tp(lazy, group, config, seed=SEED)
        for (name, a), (_, b) in zip(model.named_parameters(), lazy.named_parameters()):
            assert torch.equal(a, b), f"{name} differs when drawn from the seed"
        with torch.no_grad():
            assert torch.equal(lazy(x), model(x)), "the seed-drawn model computes differently"
    config = CASES[0][0]
    results[0]["autocast_loss"] = _autocast_loss(apply_tp(build_model(config, SEED), group, config))
    return results


def _autocast_loss(model: LlamaModel) -> float:
    """Loss of the first batch under bfloat16 autocast (a smoke check of the dtype handling)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(*_batch(model.config, True)).item()


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_model_matches_single_process(tp: int) -> None:
    per_rank = run_ranks(_model, WORLD, tp, timeout=90)
    bf16_reference = _autocast_loss(build_model(CASES[0][0], SEED))
    for r in range(WORLD):
        assert abs(per_rank[r][0]["autocast_loss"] - bf16_reference) <= 1e-3 * bf16_reference
    for case, (config, layers, has_embedding, has_head, recompute) in enumerate(CASES):
        reference = _run_stage(
            build_model(config, SEED, layers, has_embedding, has_head, recompute),
            *_batch(config, has_embedding),
        )
        for first in range(0, WORLD, tp):  # every TP group separately
            ranks = [per_rank[r][case] for r in range(first, first + tp)]
            assert all(r["grads"].keys() == reference["grads"].keys() for r in ranks)
            for key in ("out", "logits", "x_grad"):
                if key in reference:
                    for r in ranks:
                        assert _relative_error(r[key], reference[key]) <= 1e-5, (case, key)
            for name, expected in reference["grads"].items():
                shards = [r["grads"][name] for r in ranks]
                full = unshard(name, shards, config, tp)
                assert _relative_error(full, expected) <= 1e-5, (case, name)
                if shard_spec(name, config, tp).replicated:  # every rank, not just the first
                    assert all(_relative_error(s, expected) <= 1e-5 for s in shards), name


def _compiled_tp(rank: int, world_size: int) -> dict:
    from megatron_het.model.compile import compile_layers

    comm = UnifiedCommunicator(
        ["fast"] * world_size,
        {"fast": "gloo"},
        {"fast": "cpu"},
        timeout=datetime.timedelta(seconds=60),
    )
    group = comm.world  # one TP-2 group: two ranks compile on the host's two cores
    config = UNTIED
    out = {}
    for compiled in (False, True):
        model = apply_tp(build_model(config, SEED), group, config)
        if compiled:
            compile_layers(model)
        x, labels = _batch(config, True)
        loss = model(x, labels=labels)
        loss.backward()
        out[compiled] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    return out


@pytest.mark.slow
def test_compiled_tensor_parallel_layers_match_eager() -> None:
    for result in run_ranks(_compiled_tp, 2, timeout=240):
        (eager_loss, eager), (loss, grads) = result[False], result[True]
        assert loss == pytest.approx(eager_loss, rel=1e-5)
        for name, grad in grads.items():
            assert _relative_error(grad, eager[name]) <= 1e-4, name
