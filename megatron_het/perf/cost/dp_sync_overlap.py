"""The DP gradient reduction overlapped with backward (``--overlap-grad-reduce``) and ZeRO-1's
parameter all-gather overlapped with the next forward (``--overlap-param-gather``): what of
them an iteration still pays.

What the runtime does (:mod:`megatron_het.optim.data_parallel`,
:mod:`megatron_het.optim.parallel_optimizer`, :func:`megatron_het.training.trainer.train_step`):

* a rank's trainable parameters fill float32 gradient buckets in REVERSE registration order
  (output, final norm, the layers from the last down, the embedding: the order backward
  produces their gradients); a bucket closes once it holds at least ``bucket_size_mb`` MiB
  (:data:`BUCKET_SIZE_MB`, the optimizer's default), a parameter is never split, and each
  bucket is padded to a multiple of dp (:func:`bucket_layout` repeats that rule);
* only the iteration's LAST backward pass completes a bucket: the hooks count every
  parameter's gradient events and start the bucket's collective (all-reduce; reduce-scatter
  under ZeRO-1) once all of them have their last one; the collectives start in bucket order
  and run one after another;
* with tied embeddings over pp > 1, the bucket holding ``embedding.weight`` (first and last
  stage) is held back: the pipeline sums the two copies after its last backward, then
  ``sync_grads`` reduces it;
* ``sync_grads`` waits for every bucket before the step; ZeRO-1's all-gather of the updated
  parameters follows the step and is waited for at its end, unless ``--overlap-param-gather``
  leaves it running: then the buckets' all-gathers start right after the step in forward order
  (the last bucket first) and each module of the next forward waits for its own buckets;
* pipelines of different layouts (heterogeneous DP) have no rank-by-rank DP group (a group of
  one rank): overlap is a no-op there and their unit sums run in ``sync_grads``
  (:mod:`megatron_het.optim.replica_sync`), so the predictor keeps their whole sync exposed.

The model, per DP group g (device group g of every pipeline; times from the iteration's start,
``T`` the slowest pipeline's time). ``R`` is the group's un-overlapped gradient reduction
(:meth:`~megatron_het.perf.cost.dp_sync.DPSync.split`) and ``A`` ZeRO-1's parameter all-gather.
Bucket k carries the share ``n_k / N`` of the gradient bytes, so its collective takes
``r_k = R n_k / N`` (the buckets' times add up to ``R``). The last backward of the bucket's
chunk runs ``[c - w, c]`` (``w`` its duration); gradients come out in bucket order at the
pace of the compute behind them: bucket k is complete once that backward has done the share
``F_k`` of its chunk's parameters up to and including the bucket's last one (the embedding
lookup's gradient is cheap: it counts 0 and comes last, so the last bucket is complete only
at ``c``)::

    t_k = max_p (c_p - w_p (1 - F_k))            latest member of the DP group (pipelines p)
    t_k = max(t_k, max_p T_p)                    a held-back bucket
    d_k = max(t_k, d_{k-1}) + r_k                one collective after the other
    finish_g = d_K + A_g
    exposed = max_g finish_g - T                 (>= r_K of the group that ends at T)

With ``--overlap-param-gather`` ``A_g`` leaves ``finish_g``; instead the group's all-gathers
run from the iteration's start, one after another in forward order, and bucket k is first read
once the group's first forward (starting at ``s_g``, the pipeline's fill before it, lasting
``f_g``) has done the share ``1 - F_k`` of its compute that precedes the bucket's first
parameter. Everything after waits for the latest bucket, so the forward is pushed back by::

    G_k = A_g (n_K + ... + n_k) / N                    gathers done, last bucket first
    delay_g = max(0, max_k (G_k - (s_g + f_g (1 - F_k))))
    exposed += max_g delay_g                           (<= A_g: overlap never costs time)

taking ``s_g`` and ``f_g`` of the member pipeline that reads the bucket first. With
interleaving, ``s`` and ``f`` are those of the bucket's chunk's first forward; ``s`` is taken
as the pipeline's fill before that chunk (the earliest the first micro-batch can reach it: a
lower bound on the overlap).

Without overlap every sync starts at ``T``: ``exposed = max_g (R_g + A_g)``, the full sync
(the predictor's figure since before overlap was modelled; a group that ends before ``T``
could start its sync earlier, which it does not credit).
With it ``finish_g <= T + R_g + A_g``, so overlap never costs time. With interleaving each
chunk has its own last backward: in the cool-down a group runs its chunks' last backwards
from the last chunk to chunk 0, so the later chunks' buckets (launched first: reverse
registration order) are complete well before the group's end; ``c`` and ``w`` above are those
of the chunk holding the bucket's last-completed parameter (the lowest chunk among them).
The world all-reduce of the gradient norm
between the sync and the step is left out, as without overlap.

Each chunk's ``c`` comes from the simulated timeline (its last backward) or, for
``pipeline_model="closed_form"``, from
:func:`~megatron_het.perf.schedule.closed_forms.last_backward_ends` (the last micro-batch's gradient
crossing every stage, chunk by chunk).
Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_het.config import ModelConfig
from megatron_het.parallel.buckets import DEFAULT_BUCKET_SIZE_MB, bucket_ranges, padded_elements
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.stage_plan import PipelinePlan, held_parameters

# The runtime's bucket size (build_parallel_optimizer's default; --ddp-bucket-size sets another).
BUCKET_SIZE_MB = DEFAULT_BUCKET_SIZE_MB


@dataclass(frozen=True)
class DeviceParameter:
    """One trainable parameter of tp_rank 0 of a device group, in registration order:
    ``elements`` on that rank, ``weight`` the backward compute it stands for in its chunk's
    last backward (its element count; 0 for the embedding), ``held_back`` for a tied
    embedding over stages, ``chunk`` the index of the group's chunk that holds it."""

    name: str
    elements: int
    weight: int
    held_back: bool
    chunk: int = 0


@dataclass(frozen=True)
class BucketTiming:
    """One gradient bucket, in launch order: its padded ``elements``, the share ``done`` of
    chunk ``chunk``'s last backward after which its last gradient is in (``F_k``; the chunk is
    the group's lowest one among the bucket's parameters: its backward comes last),
    ``held_back``."""

    elements: int
    done: float
    held_back: bool
    chunk: int = 0


def _layer_elements(model: ModelConfig, tp: int) -> dict[str, int]:
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.kv_channels
    nh, ng = model.num_attention_heads, model.num_query_groups
    return {
        "input_norm.weight": h,
        "attention.qkv.weight": (nh + 2 * ng) * d // tp * h,
        "attention.proj.weight": h * (nh * d // tp),
        "post_attention_norm.weight": h,
        "mlp.gate.weight": f // tp * h,
        "mlp.up.weight": f // tp * h,
        "mlp.down.weight": h * (f // tp),
    }


def device_parameters(
    model: ModelConfig, pipeline: PipelinePlan, group: int
) -> list[DeviceParameter]:
    """The parameters tp_rank 0 of device group ``group`` holds, as the runtime's stage
    (:class:`~megatron_het.model.llama.LlamaModel` over all the group's chunks) registers
    them: the embedding (first stage, or a last stage's copy of a tied one), every chunk's
    layers in ascending order, the final norm and the untied output (last stage)."""
    chunks = pipeline.group_stages(group)
    stages = [pipeline.stages[s] for s in chunks]
    first, last, tp = stages[0], stages[-1], stages[0].tp
    vocab_rows = math.ceil(model.vocab_size / tp)  # tp_rank 0 holds the extra row
    tied_over_stages = model.tie_embeddings and pipeline.pp_size > 1
    out = []
    if first.has_embedding or (last.has_head and model.tie_embeddings):
        out.append(
            DeviceParameter(
                "embedding.weight", vocab_rows * model.hidden_size, 0, tied_over_stages, 0
            )
        )
    per_layer = _layer_elements(model, tp)
    for chunk, stage in enumerate(stages):
        for layer in stage.layer_indices:
            for local in held_parameters(stage.layers, layer):
                n = per_layer[local]
                out.append(DeviceParameter(f"layers.{layer}.{local}", n, n, False, chunk))
    if last.has_head:
        h, chunk = model.hidden_size, len(stages) - 1
        out.append(DeviceParameter("final_norm.weight", h, h, False, chunk))
        if not model.tie_embeddings:
            n = vocab_rows * h
            out.append(DeviceParameter("output.weight", n, n, False, chunk))
    return out


def bucket_layout(
    parameters: Sequence[DeviceParameter], dp_size: int, bucket_size_mb: float = BUCKET_SIZE_MB
) -> list[BucketTiming]:
    """The runtime's buckets of ``parameters`` (registration order), in launch order, with
    when each is complete in its chunk's last backward (see the module docstring)."""
    ordered = list(reversed(parameters))
    total: dict[int, int] = {}
    for p in parameters:
        total[p.chunk] = total.get(p.chunk, 0) + p.weight
    buckets: list[BucketTiming] = []
    seen: dict[int, int] = {}
    for start, stop in bucket_ranges([p.elements for p in ordered], bucket_size_mb):
        mine = ordered[start:stop]
        for p in mine:
            seen[p.chunk] = seen.get(p.chunk, 0) + p.weight
        chunk = min(p.chunk for p in mine)
        buckets.append(
            BucketTiming(
                padded_elements(sum(p.elements for p in mine), dp_size),
                seen[chunk] / total[chunk] if total[chunk] else 1.0,
                any(p.held_back for p in mine),
                chunk,
            )
        )
    return buckets


def reduction_end(
    buckets: Sequence[BucketTiming],
    reduce_s: float,
    last_backwards: Sequence[Sequence[tuple[float, float]]],
    held_start_s: float,
) -> float:
    """When the overlapped gradient reduction of one DP group ends: ``d_K`` of the module
    docstring. ``last_backwards``: per member pipeline's device group, ``(c, w)`` of each of
    its chunks in order (end and duration of the chunk's last backward); ``held_start_s``:
    when held-back buckets may start (the members' pipelines' end); ``reduce_s``: the
    un-overlapped reduction ``R``."""
    total = sum(b.elements for b in buckets)
    done = max(chunks[0][0] for chunks in last_backwards)
    if not total:
        return done
    done = -math.inf
    for bucket in buckets:
        ready = max(
            chunks[bucket.chunk][0] - chunks[bucket.chunk][1] * (1.0 - bucket.done)
            for chunks in last_backwards
        )
        if bucket.held_back:
            ready = max(ready, held_start_s)
        done = max(ready, done) + reduce_s * bucket.elements / total
    return done


def gather_delay(
    buckets: Sequence[BucketTiming],
    gather_s: float,
    first_forwards: Sequence[Sequence[tuple[float, float]]],
) -> float:
    """How far the overlapped parameter all-gathers of one DP group push its first forward
    back: ``delay_g`` of the module docstring. ``first_forwards``: per member pipeline's
    device group, ``(s, f)`` of each of its chunks in order (start and duration of the
    chunk's first forward)."""
    total = sum(b.elements for b in buckets)
    if not total or gather_s <= 0:
        return 0.0
    delay, gathered = 0.0, 0.0
    for bucket in reversed(buckets):  # launch order of the gathers: forward order
        gathered += gather_s * bucket.elements / total
        needed = min(
            chunks[bucket.chunk][0] + chunks[bucket.chunk][1] * (1.0 - bucket.done)
            for chunks in first_forwards
        )
        delay = max(delay, gathered - needed)
    return delay


def exposed_sync(
    model: ModelConfig,
    plan: ParallelPlan,
    split: Callable[[int], tuple[float, float]],
    pipeline_times: Sequence[float],
    last_backwards: Sequence[Sequence[Sequence[tuple[float, float]]]] | None,
    bucket_size_mb: float = BUCKET_SIZE_MB,
    first_forwards: Sequence[Sequence[Sequence[tuple[float, float]]]] | None = None,
) -> float:
    """``max_g finish_g - T``, plus ``max_g delay_g`` with the all-gathers overlapped (module
    docstring), of a plan of uniform layouts.

    ``split(g)``: DP group g's (gradient reduction, ZeRO-1 all-gather) seconds;
    ``pipeline_times[p]``: pipeline p's time; ``last_backwards[p][g]``: ``(c, w)`` of each
    chunk of device group g of pipeline p, None when the reduction waits for the step (no
    ``--overlap-grad-reduce``). Held-back buckets start once every pipeline has ended (its
    stage 0's backward ends it, then the embedding copies are summed). ``first_forwards[p][g]``
    (``(s, f)`` of each chunk's first forward) overlaps the all-gathers with the next forward;
    None keeps them after the step."""
    first = plan.pipelines[0]
    pipeline_end = max(pipeline_times)
    finish, delay = pipeline_end, 0.0
    for g in range(first.pp_size):
        reduce_s, gather_s = split(g)
        buckets = bucket_layout(device_parameters(model, first, g), plan.dp_size, bucket_size_mb)
        if last_backwards is None:
            reduced = pipeline_end + reduce_s
        else:
            members = [ends[g] for ends in last_backwards]
            reduced = reduction_end(buckets, reduce_s, members, pipeline_end)
        if first_forwards is None:
            finish = max(finish, reduced + gather_s)
        else:
            finish = max(finish, reduced)
            delay = max(
                delay, gather_delay(buckets, gather_s, [starts[g] for starts in first_forwards])
            )
    return finish - pipeline_end + delay


__all__ = [
    "BUCKET_SIZE_MB",
    "BucketTiming",
    "DeviceParameter",
    "bucket_layout",
    "device_parameters",
    "exposed_sync",
    "gather_delay",
    "reduction_end",
]
