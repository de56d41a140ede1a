"""Compute time and saved activations of one pipeline stage per micro-batch, from a profile or
from roofline estimates.

Profile selection for an accelerator kind: the profile under the kind's own name is used as
measured; an emulated kind without one uses the host's profile (:data:`HOST_PROFILE`) times its
slowdown; otherwise, and for any entry a profile lacks, roofline estimates
(:mod:`megatron_het.perf.cost.roofline`) at the kind's calibrated efficiencies
(:mod:`megatron_het.perf.cost.calibration`) unless the caller gives its own. Profiled times are
compute only: TP communication is always added by the caller from the communication model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from megatron_het.cluster import AcceleratorSpec
from megatron_het.config import ModelConfig
from megatron_het.parallel.stage_plan import LAYER_PARTS, StagePlan
from megatron_het.perf.cost.calibration import layer_efficiency, resolve_efficiency
from megatron_het.perf.cost.roofline import (
    OPTIMIZER_BYTES_PER_PARAM,
    Efficiency,
    LayerShape,
    Op,
    block_forward_ops,
    embedding_forward_ops,
    head_activation_bytes,
    head_chunk_bytes,
    head_forward_ops,
    layer_activation_bytes,
    layer_forward_ops,
    layer_input_bytes,
    op_time,
    ops_time,
)
from megatron_het.perf.cost.tp_collectives import recomputed_count
from megatron_het.perf.measure.profile_format import Measured, Profile

HOST_PROFILE = "cpu"  # the profile of the host CPU, which emulated kinds run on


@dataclass(frozen=True)
class StageCompute:
    """Per micro-batch on one TP rank, without TP communication.

    ``forward_s`` / ``backward_s``: compute (backward includes the recomputed forward);
    ``activation_bytes``: kept per micro-batch in flight; ``transient_bytes``: the largest
    extra a single pass needs on top (a recomputed layer while its backward runs, the fused
    head's chunk of logits); ``source``: where the figures came from.
    """

    forward_s: float
    backward_s: float
    activation_bytes: float
    transient_bytes: float
    source: str


@dataclass(frozen=True)
class LayerBlocks:
    """The decoder blocks of a stage whose bound splits a layer
    (:mod:`megatron_het.parallel.plan`): ``attention`` and ``mlp`` blocks, and ``layers``, the
    layers of which it holds a block or both (a recomputing stage checkpoints each)."""

    attention: int
    mlp: int
    layers: int

    @classmethod
    def of(cls, stage: StagePlan) -> LayerBlocks | None:
        """The blocks of ``stage``; None for a stage of whole layers."""
        if not stage.splits_layers:
            return None
        return cls(*stage.block_counts, len(stage.layer_indices))


@dataclass(frozen=True)
class ProfileChoice:
    """The profile to use for a kind and the factor to scale its times by (None: roofline)."""

    profile: Profile | None
    time_factor: float = 1.0


def choose_profile(spec: AcceleratorSpec, profiles: Mapping[str, Profile] | None) -> ProfileChoice:
    if not profiles:
        return ProfileChoice(None)
    if spec.name in profiles:
        return ProfileChoice(profiles[spec.name])
    if spec.emulated and HOST_PROFILE in profiles:
        return ProfileChoice(profiles[HOST_PROFILE], spec.slowdown)
    return ProfileChoice(None)


def _scaled(m: Measured | None, factor: float) -> Measured | None:
    if m is None or factor == 1.0:
        return m
    return Measured(
        m.forward_s * factor,
        m.backward_s * factor,
        m.activation_bytes,
        f"{m.source} x{factor:g} (emulated slowdown)",
    )


def mode_ratio(
    shape: LayerShape,
    spec: AcceleratorSpec,
    dtype: str,
    compiled: bool,
    efficiency: Efficiency | None = None,
) -> tuple[float, float] | None:
    """(forward, backward) roofline time of a layer of ``shape`` run ``compiled`` (else eager)
    over its time in the other mode, each mode priced by
    :func:`~megatron_het.perf.cost.calibration.layer_efficiency` (``efficiency``: an explicit
    override, as :func:`stage_compute` takes it); None where both modes are priced alike (CPU
    and emulated kinds, fp32)."""
    mine, other = (
        resolve_efficiency(spec, layer_efficiency(spec, dtype, mode, efficiency))
        for mode in (compiled, not compiled)
    )
    if mine == other:
        return None
    ops = layer_forward_ops(shape, mine.attention_kernel)
    (fwd, bwd), (fwd_other, bwd_other) = (ops_time(ops, spec, dtype, e) for e in (mine, other))
    return fwd / fwd_other, bwd / bwd_other


def _profiled_layer(
    profile: Profile,
    shape: LayerShape,
    dtype: str,
    compiled: bool,
    spec: AcceleratorSpec,
    efficiency: Efficiency | None,
) -> Measured | None:
    """A layer of ``profile`` run ``compiled`` (or eager): from its entries of that mode where
    one has the layer's widths, else from the other mode's where one has (times
    :func:`mode_ratio`, with the analytic activation bytes: compilation changes what a layer
    saves), else from the nearest shape of that mode, then of the other; None without an
    entry of ``dtype``."""
    if profile.has_layer_shape(shape, dtype, compiled) or not profile.has_layer_shape(
        shape, dtype, not compiled
    ):
        found = profile.layer(shape, dtype, compiled)
        if found is not None:
            return found
    found = profile.layer(shape, dtype, not compiled)
    if found is None:
        return None
    ratio = mode_ratio(shape, spec, dtype, compiled, efficiency)
    if ratio is None:
        return found
    mode = "compiled" if compiled else "eager"
    return Measured(
        found.forward_s * ratio[0],
        found.backward_s * ratio[1],
        None,
        f"{found.source} x{ratio[0]:.3g}/{ratio[1]:.3g} ({mode} by the roofline's ratio)",
    )


def stage_compute(
    model: ModelConfig,
    spec: AcceleratorSpec,
    shape: LayerShape,
    num_layers: float,
    has_embedding: bool,
    has_head: bool,
    recompute_layers: float,
    dtype: str,
    choice: ProfileChoice,
    efficiency: Efficiency | None = None,
    sequence_parallel: bool = False,
    tp_comm_overlap: bool = False,
    blocks: LayerBlocks | None = None,
    fused_elementwise: bool = True,
) -> StageCompute:
    """The compute of a stage with ``num_layers`` layers of ``shape`` on one device of ``spec``,
    the first ``recompute_layers`` of them recomputing their forward in backward (keeping only
    their input).

    ``efficiency`` prices the roofline estimates (what a profile lacks); None: the calibrated
    figures of ``spec``'s kind (:func:`~megatron_het.perf.cost.calibration.efficiency_for`; the
    cost model's defaults for emulated kinds and ``cpu``). ``sequence_parallel`` shrinks the
    activations saved between the TP blocks
    (:func:`~megatron_het.perf.cost.roofline.layer_activation_bytes`) and the roofline work
    there (the norms and residual adds on ``1/tp`` of the positions); a profile's measured
    figure, taken without it, loses the same bytes and keeps its measured times;
    ``tp_comm_overlap`` (with it) shrinks the GEMMs' saved inputs as well.
    ``efficiency.attention_kernel`` picks the attention the roofline layers are costed with
    and the activations they save; a profile measures our runtime's (flash) attention.

    ``blocks`` (a stage with a half-layer bound; ``num_layers`` is then its ``end - start``):
    each block costs its share of a layer's time and of its saved activations, the shares
    those of the block's kernels and tensors in the roofline model (also when a profile gives
    the whole layer's figures); recompute is all or none there, keeping each touched layer's
    input.

    ``fused_elementwise`` False prices the runtime's eager layers (no ``--compile``): the
    roofline with :func:`~megatron_het.perf.cost.calibration.layer_efficiency`'s figures, and a
    profile's eager entries; True, compiled ones. Where a profile has only the other mode's
    entries for the shape, they are scaled by the roofline's ratio of the two modes (1 where
    the predictor prices both alike: CPU and emulated kinds, fp32; :func:`mode_ratio`)."""
    raw = efficiency
    efficiency = resolve_efficiency(spec, layer_efficiency(spec, dtype, fused_elementwise, raw))
    kernel = efficiency.attention_kernel
    profile, factor = choice.profile, choice.time_factor
    sources = []
    sp = sequence_parallel and shape.tp > 1
    overlap = sp and tp_comm_overlap
    layer = None
    if profile is not None:
        layer = _scaled(
            _profiled_layer(profile, shape, dtype, fused_elementwise, spec, raw), factor
        )
    if layer is None:
        fwd, bwd = ops_time(layer_forward_ops(shape, kernel, sp), spec, dtype, efficiency)
        layer = Measured(
            fwd,
            bwd,
            layer_activation_bytes(shape, dtype, sp, kernel, overlap),
            f"roofline {spec.label}",
        )
    elif sp and layer.activation_bytes is not None:
        saved = layer_activation_bytes(shape, dtype) - layer_activation_bytes(
            shape, dtype, sp, tp_comm_overlap=overlap
        )
        layer = Measured(
            layer.forward_s,
            layer.backward_s,
            layer.activation_bytes - saved,
            f"{layer.source} less the sequence-parallel shards",
        )
    sources.append(f"layers: {layer.source}")
    act = layer.activation_bytes
    if act is None:
        act = layer_activation_bytes(shape, dtype, sp, tp_comm_overlap=overlap)
    recomputed = recomputed_count(recompute_layers, num_layers)
    if blocks is None:
        forward = num_layers * layer.forward_s
        backward = num_layers * layer.backward_s + recomputed * layer.forward_s
        kept = recomputed * layer_input_bytes(shape, dtype, sp) + (num_layers - recomputed) * act
    else:
        fwd_w, bwd_w, act_w = _block_weights(blocks, shape, spec, dtype, efficiency, sp, overlap)
        forward = fwd_w * layer.forward_s
        backward = bwd_w * layer.backward_s + (fwd_w * layer.forward_s if recomputed else 0.0)
        kept = blocks.layers * layer_input_bytes(shape, dtype, sp) if recomputed else act_w * act
    transient = act if recomputed else 0.0
    for part, present, ops in (
        ("embedding", has_embedding, embedding_forward_ops(shape)),
        ("head", has_head, head_forward_ops(shape, model.vocab_size, sp)),
    ):
        if not present:
            continue
        m = _scaled(profile.end(part, shape, model.vocab_size, dtype), factor) if profile else None
        if m is None:
            fwd, bwd = ops_time(ops, spec, dtype, efficiency)
            m = Measured(fwd, bwd, None, f"roofline {spec.label}")
        sources.append(f"{part}: {m.source}")
        forward += m.forward_s
        backward += m.backward_s
    if has_head:
        kept += head_activation_bytes(shape, model.vocab_size, dtype, sp)
        transient = max(transient, head_chunk_bytes(shape, model.vocab_size, spec.device_type))
    return StageCompute(forward, backward, kept, transient, "; ".join(sources))


def optimizer_time(
    spec: AcceleratorSpec,
    params: float,
    dtype: str,
    choice: ProfileChoice,
    efficiency: Efficiency | None = None,
) -> float:
    """Adam step over ``params`` parameters on one device: measured per-parameter time if the
    profile has it, else memory-bound roofline (OPTIMIZER_BYTES_PER_PARAM per parameter) at
    ``efficiency`` (None: the calibrated figures of ``spec``'s kind, as :func:`stage_compute`)."""
    profile = choice.profile
    if profile is not None and profile.optimizer_step_s_per_param is not None:
        return profile.optimizer_step_s_per_param * params * choice.time_factor
    op = Op("adam", "memory", 0.0, 0.0, extra_bytes=params * OPTIMIZER_BYTES_PER_PARAM[dtype])
    return op_time(op, spec, dtype, resolve_efficiency(spec, efficiency))


def _block_weights(
    blocks: LayerBlocks,
    shape: LayerShape,
    spec: AcceleratorSpec,
    dtype: str,
    efficiency: Efficiency,
    sequence_parallel: bool,
    tp_comm_overlap: bool,
) -> tuple[float, float, float]:
    """``blocks`` in whole layers by forward time, backward time and saved activations."""
    kernel = efficiency.attention_kernel
    attention, mlp = (
        ops_time(ops, spec, dtype, efficiency)
        for ops in block_forward_ops(shape, kernel, sequence_parallel)
    )
    saved = [
        layer_activation_bytes(shape, dtype, sequence_parallel, kernel, tp_comm_overlap, part)
        for part in LAYER_PARTS
    ]

    def weight(a: float, m: float) -> float:
        return (blocks.attention * a + blocks.mlp * m) / (a + m)

    return (weight(attention[0], mlp[0]), weight(attention[1], mlp[1]), weight(*saved))


__all__ = [
    "HOST_PROFILE",
    "LayerBlocks",
    "ProfileChoice",
    "StageCompute",
    "choose_profile",
    "mode_ratio",
    "optimizer_time",
    "stage_compute",
]
