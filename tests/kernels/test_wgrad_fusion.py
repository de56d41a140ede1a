"""Gradient accumulation fusion (kernels/wgrad_fusion.py): the linear layers' backward adds the
weight gradient into ``main_grad`` or the existing ``.grad`` in place, with the same values as
F.linear's gradient summed by autograd and the optimizer's hook, the same gradient events for
the data-parallel buckets, and nothing accumulated where a backward pass does not ask for it."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_het.arguments import parse_run_config
from megatron_het.config import model_preset
from megatron_het.kernels.main_grad import MAIN_GRAD, ON_MAIN_GRAD_ADDED
from megatron_het.kernels.selection import KernelChoice
from megatron_het.kernels.wgrad_fusion import FusedWgradLinear, linear
from megatron_het.model.llama import build_model, use_kernels
from megatron_het.optim.data_parallel import GradBuckets
from megatron_het.perf.measure.shard_cases import ComputeOnlyGroup
from megatron_het.tensor_parallel import apply_tp
from megatron_het.tensor_parallel.comm_overlap import all_gather_linear, linear_reduce_scatter
from megatron_het.tensor_parallel.layers import ColumnParallelLinear, ParallelMLP, RowParallelLinear
from tests.distributed.test_parallel_training import BASE, records, run_single
from tools.gpu_check.tp_rings import ThreadRing

B, S, IN, OUT = 2, 6, 16, 12  # batch, sequence, input and output features


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x[B, S, IN], grad_out[B, S, OUT])`` in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x, grad_out = torch.randn(B, S, IN, generator=g), torch.randn(B, S, OUT, generator=g)
    return x.to(dtype), grad_out.to(dtype)


def _weight(dtype: torch.dtype) -> nn.Parameter:
    g = torch.Generator().manual_seed(99)
    return nn.Parameter(torch.randn(OUT, IN, generator=g).to(dtype))


def _with_main_grad(param: nn.Parameter) -> tuple[torch.Tensor, list[int]]:
    """Give ``param`` a zero float32 main_grad as the optimizer does: (that main_grad, a list
    counting the optimizer's notifications)."""
    main, events = torch.zeros(param.shape), []
    setattr(param, MAIN_GRAD, main)
    setattr(param, ON_MAIN_GRAD_ADDED, lambda: events.append(1))
    return main, events


def _reference_wgrad(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """dW of the values given, in float64: the exact sum their float32 GEMM rounds once."""
    return grad_out.double().reshape(-1, OUT).t() @ x.double().reshape(-1, IN)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("existing_grad", [False, True], ids=["first", "accumulating"])
def test_fp32_forward_and_backward_equal_f_linear(existing_grad: bool) -> None:
    x, grad_out = _inputs(torch.float32)
    weight, plain_weight = _weight(torch.float32), _weight(torch.float32)
    if existing_grad:
        start = torch.randn(OUT, IN)
        weight.grad, plain_weight.grad = start.clone(), start.clone()
    grad_storage, handed = weight.grad, []
    weight.register_hook(lambda grad: handed.append(grad is not None))
    xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, plain = linear(xs[0], weight), F.linear(xs[1], plain_weight)
    assert torch.equal(out, plain)
    out.backward(grad_out)
    plain.backward(grad_out)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(weight.grad, plain_weight.grad, rtol=1e-6, atol=1e-6)
    # An existing .grad (a bucket view) gets it in place; autograd gets no gradient for it.
    assert handed == [not existing_grad]
    if existing_grad:
        assert weight.grad is grad_storage


def test_bf16_weight_gradient_goes_into_main_grad_in_float32() -> None:
    x, grad_out = _inputs(torch.bfloat16)
    weight = _weight(torch.bfloat16)
    main, events = _with_main_grad(weight)
    xg = x.clone().requires_grad_()
    out = linear(xg, weight)
    assert torch.equal(out, F.linear(x, weight.detach()))
    out.backward(grad_out)
    assert weight.grad is None and events == [1]
    want = _reference_wgrad(x, grad_out)
    assert _relative(main, want) <= 1e-6
    # unfused, the bf16 gradient is rounded before the hook adds it: further from the values
    assert _relative(torch.mm(grad_out.reshape(-1, OUT).t(), x.reshape(-1, IN)), want) > 1e-4
    torch.testing.assert_close(xg.grad, grad_out.matmul(weight.detach()), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_three_micro_batches_accumulate_as_the_unfused_sum(dtype: torch.dtype) -> None:
    weight = _weight(dtype)
    if dtype == torch.float32:
        weight.grad = torch.zeros(OUT, IN)  # a bucket view, as the optimizer leaves it
        accumulated = weight.grad
    else:
        accumulated, events = _with_main_grad(weight)
    total = torch.zeros(OUT, IN, dtype=torch.float64)
    for micro_batch in range(3):
        x, grad_out = _inputs(dtype, seed=micro_batch)
        linear(x.requires_grad_(), weight).backward(grad_out)
        total += _reference_wgrad(x.detach(), grad_out)
    assert _relative(accumulated, total) <= 1e-6
    if dtype == torch.bfloat16:
        assert weight.grad is None and events == [1, 1, 1]
    else:
        assert weight.grad is accumulated


def test_off_or_without_grad_is_f_linear() -> None:
    x, grad_out = _inputs(torch.float32)
    weight = _weight(torch.float32)
    weight.grad, handed = torch.zeros(OUT, IN), []
    weight.register_hook(lambda grad: handed.append(grad is not None))
    linear(x, weight, fuse=False).backward(grad_out)
    assert handed == [True] and weight.grad.abs().sum() > 0  # autograd got it and added it
    with torch.no_grad():
        assert torch.equal(linear(x, weight), F.linear(x, weight))
        assert linear(x, weight).grad_fn is None


def test_a_backward_pass_not_accumulating_into_the_weight_leaves_it_alone() -> None:
    x, grad_out = _inputs(torch.bfloat16)
    weight = _weight(torch.bfloat16)
    main, events = _with_main_grad(weight)
    xg = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(linear(xg, weight), [xg], grad_out)
    torch.testing.assert_close(dx, grad_out.matmul(weight.detach()), rtol=0, atol=0)
    (dw,) = torch.autograd.grad(linear(xg, weight), [weight], grad_out)
    torch.testing.assert_close(dw.double(), _reference_wgrad(x, grad_out), rtol=1e-2, atol=1e-2)
    linear(xg, weight).backward(grad_out, inputs=[xg])
    assert not main.any() and events == [] and weight.grad is None


def test_autocast_multiplies_in_its_dtype_and_accumulates_in_float32() -> None:
    x, grad_out = _inputs(torch.float32)
    weight = _weight(torch.float32)
    weight.grad = torch.zeros(OUT, IN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(x.requires_grad_(), weight)
        want = F.linear(x.detach(), weight.detach())
    assert out.dtype == want.dtype == torch.bfloat16 and torch.equal(out, want)
    out.backward(grad_out.bfloat16())
    assert weight.grad.dtype == torch.float32
    exact = _reference_wgrad(x.detach().bfloat16(), grad_out.bfloat16())
    assert _relative(weight.grad, exact) <= 1e-6


class _TwoRankGroup:
    """A DP group of two as GradBuckets sees it (so its overlap is on); each bucket's
    collective keeps a copy of what it would send, and nothing arrives."""

    size, rank = 2, 0

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def all_reduce(self, tensor: torch.Tensor, op: str, async_op: bool = False) -> Any:
        self.sent.append(tensor.clone())
        return _Done()


class _Done:
    def wait(self) -> None:
        pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_data_parallel_hooks_count_the_same_events_fused_or_not(dtype: torch.dtype) -> None:
    """GradBuckets starts a bucket's reduction from the hooks at its last expected event: the
    fused layers must give exactly one per backward pass (fewer never launch, more raise)."""
    results = {}
    for fuse in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(FusedWgradLinear(IN, OUT), nn.SiLU(), FusedWgradLinear(OUT, IN))
        use_kernels(model, KernelChoice(gradient_accumulation_fusion=fuse))
        model.to(dtype)
        group = _TwoRankGroup()
        buckets = GradBuckets(
            list(model.named_parameters()), group, bucket_size_mb=IN * OUT * 4 / 2**20
        )
        assert len(buckets.buckets) == 2
        buckets.enable_overlap()
        buckets.zero_grad()
        buckets.start_iteration(3, "all_reduce")
        for micro_batch in range(3):
            x, _ = _inputs(dtype, seed=micro_batch)
            model(x).float().square().sum().backward()
            assert len(group.sent) == (2 if micro_batch == 2 else 0)  # all in at the last
        buckets.all_reduce()  # raises if a parameter had more events than announced
        assert buckets.launched_early == 2
        for sent, bucket in zip(group.sent, [b.grad for b in buckets.buckets]):
            assert torch.equal(sent, bucket)  # launched with every gradient in
        results[fuse] = torch.cat([b.grad for b in buckets.buckets])
        buckets.close()
    rtol = 1e-6 if dtype == torch.float32 else 2e-2  # unfused bf16 rounds each micro-batch's
    assert _relative(results[True], results[False]) <= rtol


def test_the_tp_rings_accumulate_in_place() -> None:
    """all_gather_linear and linear_reduce_scatter (--tp-comm-overlap), two ranks as threads:
    fused, the float32 weight's existing .grad and the bf16 weight's main_grad receive the
    same sums as the unfused rings produce."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, IN, generator=g)
    column, row = torch.randn(2, OUT, IN, generator=g), torch.randn(2, IN, OUT, generator=g)
    act = torch.randn(2, 1, 8, OUT, generator=g)

    def work(member: Any, fuse: bool) -> tuple[torch.Tensor | None, ...]:
        r = member.rank
        xs = x[:, r * 4 : (r + 1) * 4].clone().requires_grad_()
        w = nn.Parameter(column[r].clone())
        w.grad = torch.ones(OUT, IN)  # an earlier micro-batch's
        wd = nn.Parameter(row[r].bfloat16())
        main, events = _with_main_grad(wd)
        grad_storage, handed = w.grad, []
        w.register_hook(lambda grad: handed.append(grad is not None))
        (out,) = all_gather_linear(xs, [w], member, fuse)
        y = linear_reduce_scatter(act[r].bfloat16(), wd, member, fuse)
        (out.square().sum() + y.float().square().sum()).backward()
        assert w.grad is grad_storage and handed == [not fuse]  # fused: autograd got none
        assert wd.grad is None and events == [1]
        return w.grad, main, xs.grad

    fused = ThreadRing(2).run(lambda member: work(member, True))
    unfused = ThreadRing(2).run(lambda member: work(member, False))
    for got, want in zip(fused, unfused):
        for a, b in zip(got, want):
            assert _relative(a, b) <= 1e-6


def test_the_flag_parses_and_reaches_every_linear_layer() -> None:
    from megatron_het.training.trainer import kernel_choice

    base = ["--model", "tiny", *BASE]
    assert parse_run_config(base).train.gradient_accumulation_fusion is True
    train = parse_run_config([*base, "--no-gradient-accumulation-fusion"]).train
    assert train.gradient_accumulation_fusion is False

    class Setup:
        pass

    Setup.train = train  # type: ignore[attr-defined]
    choice = kernel_choice(Setup())  # type: ignore[arg-type]
    assert not choice.gradient_accumulation_fusion and choice.rope
    assert not KernelChoice.references().gradient_accumulation_fusion
    config = model_preset("tiny")
    single, sharded = build_model(config, seed=1), build_model(config, seed=1)
    keys = set(single.state_dict())
    apply_tp(sharded, ComputeOnlyGroup(2), config)
    linears = []
    for model in (single, sharded):
        use_kernels(model, choice)
        kinds = (FusedWgradLinear, ColumnParallelLinear, RowParallelLinear, ParallelMLP)
        linears += [m for m in model.modules() if isinstance(m, kinds)]
    assert {type(m) for m in linears} == {
        FusedWgradLinear,
        ColumnParallelLinear,
        RowParallelLinear,
        ParallelMLP,
    }
    assert all(not m.kernels.gradient_accumulation_fusion for m in linears)
    assert "layers.0.mlp.gate.weight" in keys and not any(k.endswith(".bias") for k in keys)


@pytest.mark.slow
def test_bf16_training_with_and_without_the_fusion(tmp_path: pathlib.Path) -> None:
    """8 bf16 iterations (float32 main gradients): the fused run adds float32 products where
    the unfused one adds bf16-rounded ones, so the runs agree to bf16's precision, not bitwise:
    the first step (same weights) closely, the later ones as two roundings of a run do."""
    runs = {}
    for name, extra in (("fused", []), ("unfused", ["--no-gradient-accumulation-fusion"])):
        path = tmp_path / f"{name}.jsonl"
        run_single(["--model", "tiny", *BASE, "--bf16", *extra, "--metrics-file", str(path)])
        runs[name] = records(path, "train")
    fused, unfused = runs["fused"], runs["unfused"]
    assert len(fused) == len(unfused) == 8
    assert fused[0]["loss"] == unfused[0]["loss"]
    assert fused[0]["grad_norm"] == pytest.approx(unfused[0]["grad_norm"], rel=1e-4)
    assert [r["loss"] for r in fused] == pytest.approx([r["loss"] for r in unfused], rel=1e-3)
    norms = [r["grad_norm"] for r in fused], [r["grad_norm"] for r in unfused]
    assert norms[0] == pytest.approx(norms[1], rel=5e-2)
    assert fused != unfused  # the flag changed what ran
