"""AdamW groups and state by name, and gradient clipping, against references."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from megatron_het.config import OptimizerConfig
from megatron_het.errors import UserError
from megatron_het.optim.clip_grad import clip_grad_norm
from megatron_het.optim.optimizer import (
    adamw_implementation,
    build_optimizer,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    param_groups,
)

CPU = torch.device("cpu")
CONFIG = OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)


class Toy(nn.Module):
    """Names like the Llama model's: an embedding, a 2-D weight and a 1-D norm weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 6, bias=False)
        self.final_norm = nn.Module()
        self.final_norm.weight = nn.Parameter(torch.ones(6) + 0.1 * torch.randn(6))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        return (self.proj(x) * self.final_norm.weight).square().mean()


def batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 11, (3, 5), generator=generator) for _ in range(count)]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor]) -> None:
    for tokens in data:
        optimizer.zero_grad()
        model(tokens).backward()
        optimizer.step()


def reference_adamw(model: nn.Module, data: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """AdamW written out (decoupled decay, bias correction), decay only on >= 2-D params."""
    params = dict(model.named_parameters())
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    b1, b2 = CONFIG.adam_beta1, CONFIG.adam_beta2
    for step, tokens in enumerate(data, start=1):
        model.zero_grad()
        model(tokens).backward()
        with torch.no_grad():
            for name, p in params.items():
                decay = CONFIG.weight_decay if p.ndim >= 2 else 0.0
                p.mul_(1 - CONFIG.lr * decay)
                m[name].mul_(b1).add_(p.grad, alpha=1 - b1)
                v[name].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = m[name] / (1 - b1**step)
                v_hat = v[name] / (1 - b2**step)
                p.sub_(CONFIG.lr * m_hat / (v_hat.sqrt() + CONFIG.adam_eps))
    return {n: p.detach().clone() for n, p in params.items()}


def test_groups_exclude_1d_params_from_decay() -> None:
    groups = param_groups(Toy(), weight_decay=0.1)
    by_decay = {g["weight_decay"]: g["param_names"] for g in groups}
    assert by_decay == {0.1: ["embedding.weight", "proj.weight"], 0.0: ["final_norm.weight"]}


def test_adamw_matches_written_out_reference() -> None:
    model, reference = Toy(), Toy()
    optimizer = build_optimizer(model, CONFIG)
    train(model, optimizer, batches(4))
    expected = reference_adamw(reference, batches(4))
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name], rtol=1e-5, atol=1e-7)


def test_state_by_name_survives_a_different_parameter_order() -> None:
    model = Toy()
    optimizer = build_optimizer(model, CONFIG)
    data = batches(5)
    train(model, optimizer, data[:3])
    saved = optimizer_state_by_name(optimizer)
    assert set(saved["state"]) == {"embedding.weight", "proj.weight", "final_norm.weight"}
    clone = copy.deepcopy(model)
    # The clone's optimizer lists its groups (and so its positions) in the opposite order.
    groups = list(reversed(param_groups(clone, CONFIG.weight_decay)))
    clone_optimizer = torch.optim.AdamW(
        groups, lr=CONFIG.lr, betas=(0.9, 0.95), eps=1e-8, **adamw_implementation(CPU)
    )
    load_optimizer_state_by_name(clone_optimizer, saved)
    train(model, optimizer, data[3:])
    train(clone, clone_optimizer, data[3:])
    for (name, a), (_, b) in zip(model.named_parameters(), clone.named_parameters()):
        assert torch.equal(a, b), name


def test_state_of_another_model_is_refused() -> None:
    model = Toy()
    optimizer = build_optimizer(model, CONFIG)
    train(model, optimizer, batches(1))
    saved = optimizer_state_by_name(optimizer)
    saved["state"]["extra.weight"] = saved["state"].pop("proj.weight")
    with pytest.raises(UserError, match="missing: proj.weight; unexpected: extra.weight"):
        load_optimizer_state_by_name(build_optimizer(Toy(), CONFIG), saved)


def _with_grads(scale: float) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(3)
    params = [nn.Parameter(torch.zeros(shape)) for shape in ((4, 5), (7,), (2, 3, 2))]
    for p in params:
        p.grad = scale * torch.randn(p.shape, generator=generator)
    return params


@pytest.mark.parametrize("scale, max_norm", [(10.0, 1.0), (0.01, 1.0), (3.0, 0.5)])
def test_clip_matches_torch(scale: float, max_norm: float) -> None:
    ours, theirs = _with_grads(scale), _with_grads(scale)
    norm = clip_grad_norm(ours, max_norm)
    expected = float(torch.nn.utils.clip_grad_norm_(theirs, max_norm))
    assert norm == pytest.approx(expected, rel=1e-6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)


def test_clip_zero_only_measures_and_reduction_hook_applies() -> None:
    params = _with_grads(10.0)
    before = [p.grad.clone() for p in params]
    local = clip_grad_norm(params, 0.0)
    assert local == pytest.approx(math.sqrt(sum(float(g.square().sum()) for g in before)))
    assert all(torch.equal(p.grad, g) for p, g in zip(params, before))
    # A reduction that doubles the squared norm (two ranks holding equal shards).
    assert clip_grad_norm(params, 0.0, reduce_squared=lambda s: 2 * s) == pytest.approx(
        local * math.sqrt(2)
    )


def test_non_finite_norm_leaves_grads_alone() -> None:
    params = _with_grads(1.0)
    params[0].grad[0, 0] = float("nan")
    before = [p.grad.clone() for p in params]
    assert math.isnan(clip_grad_norm(params, 1.0))
    assert all(torch.equal(p.grad, g) for p, g in zip(params[1:], before[1:]))
