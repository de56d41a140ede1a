"""Peak memory of one device of a pipeline stage (or of an interleaved device group).

Terms, per TP rank of a stage: Megatron's mixed-precision layout, which is what the runtime
holds (``tests/unit/test_mixed_precision.py`` and ``tests/unit/test_perf_memory.py`` compare
them with the runtime's tensors byte for byte):

- weights: the stage's parameters in the training dtype (the optimizer's flat parameter
  buffers, :mod:`megatron_het.optim.flat_params`);
- gradients: float32 main gradients, one per parameter (the gradient buckets; micro-batches
  accumulate into them and the DP reduction reads them);
- optimizer: Adam's exp_avg and exp_avg_sq in float32, plus a float32 master copy of the
  weights unless they are float32 already; ZeRO-1 (distributed optimizer) divides it by the
  DP size, or across pipelines of different layouts keeps it for the rows the rank owns
  (:class:`~megatron_het.perf.cost.dp_sync.DPSync`);
- activations: one micro-batch's saved tensors (:func:`~megatron_het.perf.cost.roofline.
  layer_activation_bytes`, the fused head's gradients) times the micro-batches in flight under
  1F1B, ``min(pp - stage, micro_batches)``; with recompute only each layer's input is kept, and
  one layer's full activations exist again while its backward runs; the transient term is the
  largest such extra (that layer, or the fused head's chunk of logits).

Interleaved pipelines (several model chunks per device group): a device holds the weights,
gradients and optimizer state of all its chunks, and its activations peak where the group's
schedule holds the most bytes of (chunk, micro-batch) pairs forwarded and not yet backwarded
(:func:`group_activations`, with each chunk's bytes per micro-batch: chunks may differ); one
backward runs at a time, so the transient term is the largest of its chunks'.

Heterogeneous data parallelism (pipelines of different layouts) sums gradients in full-size
float32 buffers of every parameter unit the rank holds, all allocated at once after its last
backward, when the activations are gone (``replica_sync_bytes``): the peak is the larger of the
pipeline's activations and those buffers, on top of the weights, gradients and optimizer state.

Not counted: the CUDA/ROCm context, allocator fragmentation, communication buffers, the buckets'
padding to a multiple of the DP size (under ``dp`` elements per bucket) and the cached RoPE tables
(``seq x head_dim`` elements per stage); :func:`~megatron_het.perf.cost.memory_fit.fits` keeps
:data:`RESERVED_FRACTION` of the device free for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from megatron_het.cluster import AcceleratorSpec
from megatron_het.config import ModelConfig
from megatron_het.parallel.stage_plan import StagePlan, block_counts
from megatron_het.perf.cost.roofline import FP32_BYTES, dtype_bytes
from megatron_het.pipeline.schedule_check import held_counts
from megatron_het.pipeline.schedules import Step

GIB = 1024**3
# Kept free of the predicted peak: runtime context (~0.5-1 GiB on GPUs), fragmentation and
# NCCL buffers, which the terms above leave out.
RESERVED_FRACTION = 0.05
ADAM_STATES = 2


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device of a stage; ``total_bytes`` is the predicted peak: the weights,
    gradients and optimizer state, plus the larger of the pipeline's activations (with the
    transient extra) and the replica sync's buffers (after the last backward)."""

    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    transient_bytes: float = 0.0
    replica_sync_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        if self.replica_sync_bytes <= self.activation_bytes + self.transient_bytes:
            return (
                self.weights_bytes
                + self.grads_bytes
                + self.optimizer_bytes
                + self.activation_bytes
                + self.transient_bytes
            )
        return (
            self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.replica_sync_bytes
        )

    def to_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        return d


def layer_parameters(model: ModelConfig, tp: int) -> int:
    """Parameters of one decoder layer held by one TP rank (norms are replicated)."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.kv_channels
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    return (h * (q + 2 * kv) + q * h + 3 * h * f) // tp + 2 * h


def block_parameters(model: ModelConfig, tp: int) -> tuple[int, int]:
    """Parameters of one decoder layer's attention block (input norm, qkv, proj) and of its
    MLP block (post-attention norm, gate, up, down) held by one TP rank; they add up to
    :func:`layer_parameters`."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.kv_channels
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    return (h * (q + 2 * kv) + q * h) // tp + h, 3 * h * f // tp + h


def span_parameters(model: ModelConfig, tp: int, layers: tuple[float, float]) -> int:
    """Parameters of the decoder layers ``[start, end)`` held by one TP rank; a half-layer
    bound counts the blocks it holds (:func:`block_parameters`)."""
    start, end = layers
    if start == int(start) and end == int(end):
        return int(end - start) * layer_parameters(model, tp)
    attention, mlp = block_counts(layers)
    per_attention, per_mlp = block_parameters(model, tp)
    return attention * per_attention + mlp * per_mlp


def stage_parameters(model: ModelConfig, stage: StagePlan) -> int:
    """Parameters one TP rank of ``stage`` holds: its layers, the vocab-parallel embedding on
    the first stage, the final norm and output layer on the last (with tied embeddings a last
    stage without the embedding holds its own copy of it)."""
    tp, h, v = stage.tp, model.hidden_size, model.vocab_size
    params = span_parameters(model, tp, stage.layers)
    if stage.has_embedding:
        params += v * h // tp
    if stage.has_head:
        params += h
        if not (model.tie_embeddings and stage.has_embedding):
            params += v * h // tp
    return params


def in_flight_micro_batches(pp_size: int, stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B."""
    return min(pp_size - stage, micro_batches)


def group_activations(
    steps: Sequence[Step], activation_of_stage: Callable[[int], float], group: int = 0
) -> tuple[float, int]:
    """(peak bytes, peak pairs) of the activations device group ``group``'s step list holds:
    the most bytes at once of the (stage, micro-batch) pairs it has forwarded and not yet
    backwarded, ``activation_of_stage(s)`` bytes per micro-batch of stage ``s``, and the most
    such pairs (:func:`~megatron_het.pipeline.schedules.check_schedule`'s
    ``peak_in_flight``)."""
    return held_activations(held_counts(steps, group), activation_of_stage)


def held_activations(
    counts: Sequence[Sequence[tuple[int, int]]], activation_of_stage: Callable[[int], float]
) -> tuple[float, int]:
    """:func:`group_activations` from the list's candidate peaks
    (:func:`~megatron_het.pipeline.schedule_check.held_counts`, ``(stage, pairs)`` vectors)."""
    peak = max(sum(n * activation_of_stage(s) for s, n in vec) for vec in counts)
    return peak, max(sum(n for _, n in vec) for vec in counts)


def device_memory(
    params: int,
    dtype: str,
    zero1_dp: int,
    activation_bytes: float,
    transient_bytes: float = 0.0,
    optimizer_params: float | None = None,
    replica_sync_bytes: float = 0.0,
) -> MemoryBreakdown:
    """The breakdown for a rank holding ``params`` parameters (all its chunks) and, at its
    peak, ``activation_bytes`` of saved activations; ``zero1_dp`` is the DP size the
    optimizer state is sharded over (1 without ZeRO-1). ``optimizer_params`` given: the
    parameters whose optimizer state the rank keeps instead (ZeRO-1 across pipelines of
    different layouts); ``replica_sync_bytes``: that sync's buffers."""
    master = 0 if dtype == "fp32" else FP32_BYTES
    per_param = ADAM_STATES * FP32_BYTES + master
    optimizer = (
        params * per_param / max(1, zero1_dp)
        if optimizer_params is None
        else optimizer_params * per_param
    )
    return MemoryBreakdown(
        weights_bytes=float(params * dtype_bytes(dtype)),
        grads_bytes=float(params * FP32_BYTES),
        optimizer_bytes=optimizer,
        activation_bytes=activation_bytes,
        transient_bytes=transient_bytes,
        replica_sync_bytes=replica_sync_bytes,
    )


def stage_memory(
    params: int,
    dtype: str,
    zero1_dp: int,
    activation_per_micro_batch: float,
    in_flight: int,
    transient_bytes: float = 0.0,
) -> MemoryBreakdown:
    """:func:`device_memory` of a rank holding ``in_flight`` micro-batches of one stage."""
    return device_memory(
        params, dtype, zero1_dp, activation_per_micro_batch * in_flight, transient_bytes
    )


def device_capacity_bytes(spec: AcceleratorSpec) -> float:
    """What one device of ``spec`` holds: the memory cap of an emulated kind, else memory_gib."""
    if spec.emulated and spec.memory_cap_gib is not None:
        return spec.memory_cap_gib * GIB
    return spec.memory_gib * GIB
