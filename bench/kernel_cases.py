"""The cases that ``bench/kernels.py`` times: one fused op, at one model's shapes, in one dtype
and one pass, with every implementation it compares.

Implementations (``Variant.name``):

* ``ours``: the package's public function with the default :class:`KernelChoice` (our compiled
  kernel where built; the optimizer: :func:`megatron_het.optim.optimizer.build_optimizer`);
* ``eager``: the same function with ``KernelChoice.references()`` (the torch reference; the
  reference every other output is checked against);
* ``formula``: the plain torch a user would write, where it differs from ``eager``:
  ``F.rms_norm``, the rotate-half RoPE, ``logsumexp`` and ``softmax - onehot``;
* ``compiled``: ``torch.compile`` (``fullgraph``, static shapes) of the ``eager`` function;
* ``fused`` (AdamW only): ``torch.optim.AdamW(fused=True)``.

Shapes: ``N`` tokens (micro-batch x sequence), ``H`` hidden, ``F`` FFN width, ``B S G R D`` RoPE's
q as ``[batch, sequence, groups, heads per group, head dim]`` (k has ``R = 1``), both views of a
fused qkv output as the model makes them; cross-entropy runs on one chunk ``[Nc, V]`` of float32
logits, ``Nc`` as :func:`~megatron_het.model.loss.default_chunk_tokens` picks (the logits are
float32 whatever the model's dtype, so that op has one dtype); AdamW steps one decoder layer's
parameters (``P`` of them), in float32, as the master weights are.

Bytes (for GB/s): what any implementation must read and write at least, with ``e`` bytes per
element of the dtype; a fwd+bwd case counts both passes:

=============  ==========================  ==============================================
op             forward                     backward
=============  ==========================  ==============================================
rms_norm       x, weight in; out           grad_out, x, weight in; grad_x, grad_weight
add_rms_norm   x, residual, weight in;     grad_out, grad_sum, sum, weight in; grad_x,
               out, sum                    grad_weight (grad_residual is grad_x)
rope           q, k, float32 cos/sin       grad_q, grad_k, cos/sin in; grad_q, grad_k out
               [S, D/2] in; q, k out
swiglu         gate, up in; out            grad_out, gate, up in; grad_gate, grad_up out
cross_entropy  logits, labels in; loss     (one pass with forward) logits written as grad
adamw          (one step) param, grad, exp_avg, exp_avg_sq in; param and both moments out
=============  ==========================  ==============================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron_het.config import ModelConfig, OptimizerConfig, model_preset
from megatron_het.kernels.csrc_ops import cross_entropy_fused_, cross_entropy_stats
from megatron_het.kernels.norms import add_rms_norm, rms_norm
from megatron_het.kernels.selection import KernelChoice, implementation
from megatron_het.kernels.swiglu import swiglu
from megatron_het.model.compile import _register_traceable_rope
from megatron_het.model.llama import DecoderLayer
from megatron_het.model.loss import default_chunk_tokens, use_csrc_cross_entropy
from megatron_het.model.rope import RotaryEmbedding, apply_rope_qk
from megatron_het.optim.optimizer import adamw_implementation, build_optimizer, param_groups

Tensors = tuple[torch.Tensor, ...]
Call = Callable[[], Tensors]
REFERENCE = KernelChoice.references()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPS = ("rms_norm", "add_rms_norm", "rope", "cross_entropy", "swiglu", "adamw")
FWD, FWD_BWD, STEP = "fwd", "fwd+bwd", "step"
# Largest error of an output, relative to its largest magnitude, that still matches.
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}


@dataclasses.dataclass(frozen=True)
class BenchShape:
    """A model preset at ``micro_batch`` x ``seq`` tokens."""

    preset: str
    micro_batch: int
    seq: int

    @property
    def config(self) -> ModelConfig:
        return model_preset(self.preset)

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq


FULL_SHAPES = (BenchShape("small", 8, 256), BenchShape("llama2-7b", 1, 4096))
QUICK_SHAPES = (BenchShape("tiny", 2, 16),)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One implementation: ``prepare(inputs)`` binds it to a case's inputs and returns one
    call, which returns the outputs (then the input gradients, for fwd+bwd)."""

    name: str
    label: str
    prepare: Callable[[Tensors], Call]


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed comparison; ``make_inputs()`` gives fresh, seeded inputs each time."""

    op: str
    shape: str
    dtype: str
    passes: str
    dims: dict[str, int]
    bytes_moved: int
    make_inputs: Callable[[], Tensors]
    variants: tuple[Variant, ...]
    reference: str = "eager"

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]


def _as_tuple(out: Any) -> Tensors:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def autograd_variant(
    name: str, label: str, forward: Callable[..., Any], passes: str, seed: int = 7
) -> Variant:
    """A variant of a differentiable op ``forward(*inputs)``: under ``no_grad`` for "fwd"; for
    "fwd+bwd", forward then ``autograd.grad`` of the inputs that require grad, with seeded
    random output gradients (the same in every variant of a case)."""

    def prepare(inputs: Tensors) -> Call:
        if passes == FWD:

            def forward_only() -> Tensors:
                with torch.no_grad():
                    return _as_tuple(forward(*inputs))

            return forward_only
        leaves = [t for t in inputs if t.requires_grad]
        grads_out: list[Tensors] = []

        def forward_backward() -> Tensors:
            outs = _as_tuple(forward(*inputs))
            if not grads_out:
                generator = torch.Generator().manual_seed(seed)
                grads_out.append(
                    tuple(
                        torch.randn(o.shape, generator=generator).to(o.device, o.dtype)
                        for o in outs
                    )
                )
            return outs + torch.autograd.grad(outs, leaves, grads_out[0])

        return forward_backward

    return Variant(name, label, prepare)


def compiled(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` of a reference function: one graph, static shapes."""
    return torch.compile(forward, fullgraph=True, dynamic=False)


def _randn(shape: Sequence[int], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator).to(device=device, dtype=dtype)


def _ours_label(family: str, device: str) -> str:
    impl = implementation(family, device)
    return impl.name + (f" ({impl.why})" if impl.why else "")


def _differentiable_case(
    op: str,
    family: str,
    shape: BenchShape,
    dtype: str,
    passes: str,
    dims: dict[str, int],
    bytes_fwd_bwd: tuple[int, int],
    make_inputs: Callable[[], Tensors],
    forwards: dict[str, tuple[str, Callable[..., Any]]],
    device: str,
    with_compile: bool,
) -> Case:
    """A case from ``forwards`` (variant name -> (label, forward)): ours, eager, formula; the
    compiled variant of eager is added here."""
    variants = [autograd_variant("ours", _ours_label(family, device), forwards["ours"][1], passes)]
    variants += [
        autograd_variant(name, label, forward, passes)
        for name, (label, forward) in forwards.items()
        if name != "ours"
    ]
    if with_compile:
        variants.append(
            autograd_variant(
                "compiled", "torch.compile(eager)", compiled(forwards["eager"][1]), passes
            )
        )
    moved = bytes_fwd_bwd[0] + (bytes_fwd_bwd[1] if passes == FWD_BWD else 0)
    return Case(op, shape.preset, dtype, passes, dims, moved, make_inputs, tuple(variants))


def norm_case(
    op: str, shape: BenchShape, dtype: str, passes: str, device: str, with_compile: bool
) -> Case:
    """``rms_norm`` of ``x[N, H]``, or (``op="add_rms_norm"``) of ``x + residual``."""
    cfg, torch_dtype = shape.config, DTYPES[dtype]
    n, h, eps, e = shape.tokens, cfg.hidden_size, cfg.norm_eps, torch_dtype.itemsize
    grad = passes == FWD_BWD
    residual = op == "add_rms_norm"

    def make_inputs() -> Tensors:
        x = _randn((n, h), torch_dtype, device, 1)
        w = (torch.rand(h, generator=torch.Generator().manual_seed(2)) + 0.5).to(
            device, torch_dtype
        )
        inputs = (x, _randn((n, h), torch_dtype, device, 3), w) if residual else (x, w)
        return tuple(t.requires_grad_(grad) for t in inputs)

    forwards: dict[str, tuple[str, Callable[..., Any]]]
    if residual:
        forwards = {
            "ours": ("", lambda x, r, w: add_rms_norm(x, r, w, eps)),
            "eager": ("add_rms_norm(references)", lambda x, r, w: _add_norm_ref(x, r, w, eps)),
            "formula": ("x + r, F.rms_norm", lambda x, r, w: _add_norm_formula(x, r, w, eps)),
        }
        bytes_pair = (4 * n * h * e + h * e, 4 * n * h * e + 2 * h * e)
    else:
        forwards = {
            "ours": ("", lambda x, w: rms_norm(x, w, eps)),
            "eager": ("rms_norm(references)", lambda x, w: rms_norm(x, w, eps, choice=REFERENCE)),
            "formula": ("F.rms_norm", lambda x, w: F.rms_norm(x, (h,), w, eps)),
        }
        bytes_pair = (2 * n * h * e + h * e, 3 * n * h * e + 2 * h * e)
    dims = {"N": n, "H": h}
    return _differentiable_case(
        op, "rms_norm", shape, dtype, passes, dims, bytes_pair, make_inputs, forwards, device,
        with_compile,
    )  # fmt: skip


def _add_norm_ref(
    x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm(x, r, w, eps, choice=REFERENCE)


def _add_norm_formula(
    x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + r
    return F.rms_norm(total, (x.shape[-1],), w, eps), total


def _rotate_half_formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_case(shape: BenchShape, dtype: str, passes: str, device: str, with_compile: bool) -> Case:
    """RoPE of q and k, strided views of one ``[B, S, G, R + 2, D]`` qkv output."""
    cfg, torch_dtype = shape.config, DTYPES[dtype]
    b, s, g, d = shape.micro_batch, shape.seq, cfg.num_query_groups, cfg.kv_channels
    r = cfg.num_attention_heads // g
    grad = passes == FWD_BWD
    rotary = RotaryEmbedding(cfg)
    cos32, sin32 = rotary.cos_sin(s, torch.device(device), torch.float32)  # [S, 1, D/2]
    cos_x, sin_x = rotary.cos_sin(s, torch.device(device), torch_dtype)
    cos_full = torch.cat((cos_x, cos_x), dim=-1)[:, None]  # [S, 1, 1, D]
    sin_full = torch.cat((sin_x, sin_x), dim=-1)[:, None]

    def make_inputs() -> Tensors:
        qkv = _randn((b, s, g, r + 2, d), torch_dtype, device, 1)
        q, k, _ = qkv.split((r, 1, 1), dim=3)
        return q.requires_grad_(grad), k.requires_grad_(grad)

    def formula(q: torch.Tensor, k: torch.Tensor) -> Tensors:
        return tuple(_rotate_half_formula(t, cos_full, sin_full) for t in (q, k))

    forwards = {
        "ours": ("", lambda q, k: apply_rope_qk(q, k, cos32, sin32)),
        "eager": (
            "apply_rope_qk(references)",
            lambda q, k: apply_rope_qk(q, k, cos_x, sin_x, choice=REFERENCE),
        ),
        "formula": ("q * cos + rotate_half(q) * sin", formula),
    }
    if with_compile:
        _register_traceable_rope()  # the reference's out= writes, as plain ops dynamo traces
    elements = b * s * g * (r + 1) * d
    one_pass = 2 * elements * torch_dtype.itemsize + 4 * s * d
    dims = {"B": b, "S": s, "G": g, "R": r, "D": d}
    return _differentiable_case(
        "rope", "rope", shape, dtype, passes, dims, (one_pass, one_pass), make_inputs, forwards,
        device, with_compile,
    )  # fmt: skip


def swiglu_case(
    shape: BenchShape, dtype: str, passes: str, device: str, with_compile: bool
) -> Case:
    """``silu(gate) * up`` of ``gate, up [N, F]``: ours is :func:`megatron_het.kernels.swiglu`
    (our compiled kernel where built), eager its torch reference (``F.silu(gate) * up``, whose
    backward also runs torch's ops)."""
    cfg, torch_dtype = shape.config, DTYPES[dtype]
    n, f, e = shape.tokens, cfg.ffn_hidden_size, torch_dtype.itemsize
    grad = passes == FWD_BWD

    def make_inputs() -> Tensors:
        gate = _randn((n, f), torch_dtype, device, 1).requires_grad_(grad)
        return gate, _randn((n, f), torch_dtype, device, 2).requires_grad_(grad)

    forwards = {
        "ours": ("", lambda gate, up: swiglu(gate, up)),
        "eager": ("F.silu(gate) * up", lambda gate, up: swiglu(gate, up, choice=REFERENCE)),
    }
    return _differentiable_case(
        "swiglu", "swiglu", shape, dtype, passes, {"N": n, "F": f},
        (3 * n * f * e, 5 * n * f * e), make_inputs, forwards, device, with_compile,
    )  # fmt: skip


def cross_entropy_case(shape: BenchShape, passes: str, device: str, with_compile: bool) -> Case:
    """One chunk of the head's float32 logits ``[Nc, V]``: the per-token loss ("fwd"), or the
    loss and ``softmax - onehot`` in the same pass ("fwd+bwd", in place where the
    implementation writes in place). ``eager`` is the torch arithmetic of the head's reference
    path per chunk (:func:`megatron_het.model.loss.linear_cross_entropy` with the references)."""
    v = shape.config.vocab_size
    nc = min(shape.tokens, default_chunk_tokens(v, device))
    grads = passes == FWD_BWD
    minus_one = torch.full((nc, 1), -1.0, device=device)

    def make_inputs() -> Tensors:
        generator = torch.Generator().manual_seed(2)
        labels = torch.randint(0, v, (nc,), generator=generator).to(device)
        return 2 * _randn((nc, v), torch.float32, device, 1), labels

    def ours(logits: torch.Tensor, labels: torch.Tensor) -> Tensors:
        if grads:
            return cross_entropy_fused_(logits, labels), logits
        top, sum_exp, target = cross_entropy_stats(logits, labels, 0)
        return (sum_exp.log() + top - target,)

    def eager(logits: torch.Tensor, labels: torch.Tensor) -> Tensors:
        y = labels[:, None]
        target = logits.gather(1, y)
        top = logits.amax(dim=-1, keepdim=True)
        exps = logits.sub_(top).exp_()
        sum_exp = exps.sum(dim=-1, keepdim=True)
        loss = (sum_exp.log() + (top - target)).squeeze(1)
        if not grads:
            return (loss,)
        probs = exps.div_(sum_exp)
        return loss, probs.scatter_add_(1, y, minus_one)

    def formula(logits: torch.Tensor, labels: torch.Tensor) -> Tensors:
        loss = logits.logsumexp(-1) - logits.gather(1, labels[:, None]).squeeze(1)
        if not grads:
            return (loss,)
        return loss, logits.softmax(-1) - F.one_hot(labels, v).to(logits.dtype)

    csrc = use_csrc_cross_entropy(device)
    functions = {
        "ours": (_ours_label("cross_entropy", device), ours if csrc else eager),
        "eager": ("the head's torch chunk path", eager),
        "formula": ("logsumexp - target, softmax - onehot", formula),
    }
    if with_compile:
        functions["compiled"] = ("torch.compile(eager)", compiled(eager))
    variants = tuple(
        Variant(name, label, _plain_prepare(function))
        for name, (label, function) in functions.items()
    )
    moved = nc * v * 4 * (2 if grads else 1) + nc * 12
    dims = {"Nc": nc, "V": v}
    return Case("cross_entropy", shape.preset, "fp32", passes, dims, moved, make_inputs, variants)


def _plain_prepare(function: Callable[..., Tensors]) -> Callable[[Tensors], Call]:
    def prepare(inputs: Tensors) -> Call:
        def call() -> Tensors:
            with torch.no_grad():
                return function(*inputs)

        return call

    return prepare


def adamw_case(shape: BenchShape, device: str) -> Case:
    """One AdamW step over one decoder layer's float32 parameters (the master weights of a
    bf16 run are float32 too): ours (:func:`~megatron_het.optim.optimizer.build_optimizer`,
    torch's AdamW as :func:`~megatron_het.optim.optimizer.adamw_implementation` picks it for
    the device; the distributed optimizer steps the same AdamW over its float32 masters)
    against ``fused=True``. Repeated steps update the same tensors (the cost does not depend on the
    values)."""
    with torch.device("meta"):
        layer = DecoderLayer(shape.config)
    shapes = [p.shape for p in layer.parameters()]
    count = sum(s.numel() for s in shapes)

    def make_inputs() -> Tensors:
        params = [0.02 * _randn(s, torch.float32, device, i) for i, s in enumerate(shapes)]
        grads = [1e-3 * _randn(s, torch.float32, device, 99 + i) for i, s in enumerate(shapes)]
        return tuple(params + grads)

    def holder(inputs: Tensors) -> nn.ParameterList:
        params = nn.ParameterList(nn.Parameter(p) for p in inputs[: len(shapes)])
        for param, grad in zip(params, inputs[len(shapes) :], strict=True):
            param.grad = grad
        return params

    def stepper(make: Callable[[nn.ParameterList], torch.optim.Optimizer]) -> Callable:
        def prepare(inputs: Tensors) -> Call:
            params = holder(inputs)
            optimizer = make(params)

            def step() -> Tensors:
                optimizer.step()
                return tuple(p.detach() for p in params)

            return step

        return prepare

    config = OptimizerConfig()

    def fused(params: nn.ParameterList) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            param_groups(params, config.weight_decay),
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            fused=True,
        )

    kind = next(iter(adamw_implementation(torch.device(device))))
    variants = (
        Variant(
            "ours", f"build_optimizer: AdamW {kind}", stepper(lambda p: build_optimizer(p, config))
        ),
        Variant("fused", "torch.optim.AdamW(fused=True)", stepper(fused)),
    )
    dims = {"P": count, "tensors": len(shapes)}
    return Case(
        "adamw", shape.preset, "fp32", STEP, dims, 28 * count, make_inputs, variants, "ours"
    )


def build_cases(
    shapes: Sequence[BenchShape],
    ops: Sequence[str],
    dtypes: Sequence[str],
    device: str = "cpu",
    with_compile: bool = True,
) -> list[Case]:
    """Every case of ``ops`` at every shape: each dtype and both passes; cross-entropy (float32
    logits) and AdamW (float32 masters) once per shape."""
    cases: list[Case] = []
    for shape in shapes:
        for op in ops:
            if op == "adamw":
                cases.append(adamw_case(shape, device))
                continue
            for passes in (FWD, FWD_BWD):
                if op == "cross_entropy":
                    cases.append(cross_entropy_case(shape, passes, device, with_compile))
                    continue
                for dtype in dtypes:
                    if op == "rope":
                        cases.append(rope_case(shape, dtype, passes, device, with_compile))
                    elif op == "swiglu":
                        cases.append(swiglu_case(shape, dtype, passes, device, with_compile))
                    else:
                        cases.append(norm_case(op, shape, dtype, passes, device, with_compile))
    return cases
