"""Opt-in ``torch.compile`` of a model's decoder layers, one compiled region per layer.

Each :class:`~megatron_het.model.llama.DecoderLayer` is compiled in place with
``nn.Module.compile`` (the module keeps its identity, so parameter names, state-dict keys, the
optimizer's parameter list and ``LlamaModel.layers``' keys do not change). Compiling per layer
rather than the whole model keeps compile time independent of depth (every layer shares one
code object and the inductor cache) and leaves the embedding, the fused loss and activation
recompute (``torch.utils.checkpoint`` around each layer) in eager mode, where they already are
what they should be. Inductor's gain is the fusion of each layer's pointwise work: the two
RMSNorms, RoPE, the SwiGLU gate and the residual adds, forward and backward.

Layers are compiled with ``fullgraph=True, dynamic=False``: a new micro-batch or sequence
shape compiles anew (training uses one shape; dynamo keeps at most
``torch._dynamo.config.recompile_limit`` variants per layer before falling back to eager).
Compilation happens lazily, on a layer's first forward and backward. Tensor-parallel stages are
refused for now: dynamo cannot trace the communicator's collectives inside the TP linears.
"""

from __future__ import annotations

import functools
import platform

import torch

from megatron_het.errors import UserError
from megatron_het.kernels.attention import device_runs_flash
from megatron_het.kernels.autocast import autocast_available
from megatron_het.kernels.graph_break import apply_graph_breaks
from megatron_het.model import rope
from megatron_het.model.llama import LlamaModel


def _traceable_apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """What ``rope.apply_rope`` computes, in plain ops inductor can fuse (used only inside a
    compiled graph; eager code keeps the hand-fused autograd function).

    The eager version writes into strided ``out=`` views, which dynamo cannot trace; here
    autograd derives the backward (the rotation by the opposite angle) itself.
    """
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@functools.cache
def _register_traceable_rope() -> None:
    """Tell dynamo to trace :func:`_traceable_apply_rope` wherever it meets ``apply_rope``
    (once per process; eager calls are unaffected)."""
    torch.compiler.substitute_in_graph(rope.apply_rope)(_traceable_apply_rope)


def _probe(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x) * x + 1.0


@functools.cache
def compile_available(device_type: str = "cpu") -> tuple[bool, str]:
    """Whether ``torch.compile`` (inductor) works for tensors of ``device_type`` here.

    Returns ``(True, "")`` or ``(False, reason)``. Compiles and runs one tiny function (a few
    seconds the first time in a process, cached afterwards; inductor's on-disk cache makes later
    processes faster). On CPU inductor needs a C++ compiler; on CUDA/ROCm it needs Triton.
    """
    try:
        from torch import _dynamo

        if not _dynamo.is_dynamo_supported():
            return False, (
                f"torch {torch.__version__}'s torch.compile does not support "
                f"Python {platform.python_version()}"
            )
        x = torch.linspace(-2.0, 2.0, 16, device=device_type)
        got = torch.compile(_probe, backend="inductor", fullgraph=True, dynamic=False)(x)
        if not torch.allclose(got, _probe(x)):
            return False, f"inductor's result on {device_type} differs from eager"
    except Exception as exc:  # any failure means: not usable here, and why
        lines = str(exc).strip().splitlines()
        return False, f"{type(exc).__name__}: {lines[0] if lines else 'no message'}"
    return True, ""


def _check_mode(mode: str | None) -> None:
    if mode is None:
        return
    from torch import _inductor

    options = _inductor.list_mode_options()
    usable = [name for name, opts in options.items() if not opts.get("triton.cudagraphs")]
    if mode not in options:
        raise UserError(f"unknown torch.compile mode {mode!r}; use one of {', '.join(usable)}")
    if options[mode].get("triton.cudagraphs"):
        # A CUDA graph's outputs live in its pool until the next replay overwrites them, while
        # a pipeline schedule still holds earlier micro-batches' layer outputs for backward.
        raise UserError(
            f"torch.compile mode {mode!r} captures CUDA graphs per layer, whose "
            "outputs the next micro-batch's replay overwrites while the schedule "
            f"still holds them; use one of {', '.join(usable)}"
        )


def _layers_device_type(model: LlamaModel) -> str | None:
    for param in model.layers.parameters():
        return param.device.type
    return None


def _tp_size(model: LlamaModel) -> int:
    group = getattr(model, "tp_group", None)  # set by tensor_parallel.apply_tp
    return 1 if group is None else group.size


def compile_layers(model: LlamaModel, mode: str | None = None) -> None:
    """Compile each of ``model.layers`` in place with ``torch.compile(dynamic=False)``
    (``fullgraph=True`` without TP).

    Args:
        model: a :class:`LlamaModel` or pipeline stage (under TP the layers compile into the
            graphs between their collectives, which stay eager), on the device it will train
            on, with parameters of any dtype (float32, bf16; autocast also works).
        mode: a ``torch.compile`` mode (``None`` is inductor's default).

    Names and parameters are unchanged; numerics match the eager layer up to the reordering of
    floating-point operations that fusion brings. Nothing communicates; compilation happens on
    each layer's first call. Raises a one-line :class:`UserError` when inductor cannot compile
    for the parameters' device here or for an unknown ``mode``.
    """
    _check_mode(mode)
    # Under TP each layer's collectives (tensor_parallel.mappings) stay eager: the layer
    # compiles into the graphs between them, so it cannot be one full graph.
    fullgraph = _tp_size(model) == 1
    device_type = _layers_device_type(model)
    if device_type is None:  # a stage without decoder layers
        return
    if device_type != "meta":
        ok, reason = compile_available(device_type)
        if not ok:
            raise UserError(
                f"--compile: torch.compile cannot compile for {device_type} here "
                f"({reason}); drop --compile"
            )
    if device_type == "cuda":  # decided eagerly: a compiled graph cannot ask torch
        for _, layer in model.decoder_layers():
            if hasattr(layer, "attention"):  # a stage may hold a layer's MLP block only
                device_runs_flash(layer.attention.proj.weight.device, layer.attention.head_dim)
                break
    _register_traceable_rope()
    autocast_available(device_type)  # asked now: the compiled graph reads the kept answer
    apply_graph_breaks()  # the TP collectives stay eager
    for _, layer in model.decoder_layers():
        layer.compile(mode=mode, fullgraph=fullgraph, dynamic=False)


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` was compiled in place by ``nn.Module.compile``."""
    return getattr(module, "_compiled_call_impl", None) is not None
