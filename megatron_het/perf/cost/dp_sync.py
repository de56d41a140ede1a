"""The data-parallel sync of one device group: its gradient sum over the replicas (and ZeRO-1's
parameter exchange), and what that sync makes it hold.

Uniform layouts (every pipeline splits the model alike:
:func:`~megatron_het.parallel.replicas.uniform_layouts`): stage s's DP group is the stage's ranks
of every pipeline, tp_rank by tp_rank. A device all-reduces its float32 gradients (all its
chunks' parameters), or under ZeRO-1 reduce-scatters them and all-gathers the updated
parameters in the training dtype (:meth:`~megatron_het.perf.cost.comm_time.CommCost.dp_sync`); its
optimizer state is ``1/dp`` of its parameters' under ZeRO-1. :meth:`DPSync.split` parts that
time into the gradient reduction and the parameter all-gather (the overlap of the former with
backward: :mod:`megatron_het.perf.cost.dp_sync_overlap`).

``grad_reduce_in_bf16`` (``--grad-reduce-in-bf16``, bf16 training only): the reductions carry
a bf16 copy of the gradients, 2 bytes per parameter instead of 4, in both layouts (the replica
sums' full-size buffers are bf16 too); accumulation stays float32 and the ZeRO-1 parameter
exchange stays in the training dtype.

Different layouts (heterogeneous DP, :mod:`megatron_het.optim.replica_sync`): the model splits
into units (:func:`~megatron_het.parallel.replicas.replica_units`: the embedding, runs of layers
with the same holders, the head), and each unit is summed with one all-reduce of its
FULL-SIZE float32 buffer over every rank that holds part of it (a rank of a tp stage moves tp
times its shard's bytes). A device pays the sum over the units it holds::

    sync = sum_u allreduce(g P_u, holders_u)  [+ allreduce(d P_u, holders_u) under ZeRO-1]

``P_u`` the unit's full parameter count, ``g`` the reduction's bytes per element (4; 2 in
bf16), ``d`` the training dtype's bytes (ZeRO-1's second
all-reduce shares the owners' updated rows after the step). All of a device's full buffers are
allocated at once, after its last backward (:meth:`DPSync.buffer_bytes`). Under ZeRO-1 each
parameter's rows (dim 0; elements of a vector) are split evenly over the pipelines, block k to
pipeline k, and each row is owned by the contributing rank whose TP box holds it (a norm by
tp_rank 0 only, a tied embedding by the first stage only): :meth:`DPSync.owned_parameters`
counts a device's rows exactly as the runtime assigns them.

The units come from :mod:`megatron_het.parallel.replicas` (torch-free); the ownership reads
the runtime's sharding rules, whose modules import torch, only for such plans, so uniform
predictions stay torch-free.
"""

from __future__ import annotations

import math

from megatron_het.config import ModelConfig
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.replicas import ReplicaUnit, owned_rows, replica_units, uniform_layouts
from megatron_het.perf.cost.comm_time import CommCost, SyncCost
from megatron_het.perf.cost.memory import span_parameters, stage_parameters
from megatron_het.perf.cost.roofline import DTYPE_BYTES, FP32_BYTES


def unit_parameters(model: ModelConfig, unit: ReplicaUnit) -> int:
    """The full (unsharded) parameter count of a replica unit: the embedding table, its layers
    (norms included), or the head's final norm and untied output projection."""
    h, v = model.hidden_size, model.vocab_size
    if unit.part == "embedding":
        return v * h
    if unit.part == "head":
        return h + (0 if model.tie_embeddings else v * h)
    assert unit.layers is not None  # a "layers" unit always has its span
    return span_parameters(model, 1, unit.layers)


class DPSync:
    """The DP sync of every device group of one prediction (see the module docstring)."""

    def __init__(
        self,
        model: ModelConfig,
        plan: ParallelPlan,
        dtype: str,
        zero1: bool,
        grad_reduce_in_bf16: bool = False,
    ) -> None:
        self.model, self.plan, self.dtype, self.zero1 = model, plan, dtype, zero1
        # bytes per gradient element on the wire (and in the replica sums' buffers)
        self.grad_bytes = DTYPE_BYTES["bf16"] if grad_reduce_in_bf16 else FP32_BYTES
        self.uniform = uniform_layouts(plan)
        self._units: list[tuple[int, tuple[int, ...]]] = []
        if not self.uniform:
            self._units = [
                (unit_parameters(model, unit), holders)
                for unit, holders in replica_units(plan, model.num_layers, model.tie_embeddings)
            ]

    def over(self, comm: CommCost, pipeline: int, stage_index: int) -> SyncCost:
        """The sync of the device group running stage ``stage_index`` of pipeline ``pipeline``
        (all its chunks at once), costed by ``comm``."""
        if self.uniform:
            return self._uniform(comm, stage_index)
        ranks = self.plan.pipelines[pipeline].stages[stage_index].ranks
        held = self._held(ranks[0])
        element = DTYPE_BYTES[self.dtype]  # of a parameter, as ZeRO-1 shares them
        time, algorithms = 0.0, set()
        for params, holders in held:
            grads = comm.dp_sync(holders, params * self.grad_bytes)
            time += grads.time_s
            algorithms.add(grads.algorithm)
            if self.zero1:
                time += comm.dp_sync(holders, params * element).time_s
        what = "full-unit all-reduces" + (" + parameter shares" if self.zero1 else "")
        return SyncCost(time, f"{len(held)} {what} ({', '.join(sorted(algorithms))})")

    def split(self, comm: CommCost, pipeline: int, stage_index: int) -> tuple[float, float]:
        """(gradient reduction, ZeRO-1 parameter all-gather) seconds of :meth:`over`, adding
        up to its time. Uniform layouts: the all-reduce, or ZeRO-1's reduce-scatter (half a
        ring all-reduce within one kind; across kinds the hierarchical all-reduce, as
        :meth:`~megatron_het.perf.cost.comm_time.CommCost.dp_sync` prices it) and the rest. Other
        layouts: all of it is the units' sums (their parameter shares come after the step but
        are counted with them, as :meth:`over` does)."""
        full = self.over(comm, pipeline, stage_index).time_s
        if not self.uniform or not self.zero1:
            return full, 0.0
        group, params = self._group(stage_index)
        reduce = comm.dp_sync(group, params * self.grad_bytes).time_s
        if len({comm.kind_of(r) for r in group}) == 1:
            reduce /= 2  # a ring reduce-scatter is half the ring all-reduce
        return reduce, full - reduce

    def _group(self, stage_index: int) -> tuple[list[int], int]:
        """The DP group (tp_rank 0 of the stage in every pipeline) and a device's parameters."""
        first = self.plan.pipelines[0]
        group = [p.stages[stage_index].ranks[0] for p in self.plan.pipelines]
        params = sum(
            stage_parameters(self.model, first.stages[s])
            for s in first.group_stages(stage_index % first.pp_size)
        )
        return group, params

    def _uniform(self, comm: CommCost, stage_index: int) -> SyncCost:
        group, params = self._group(stage_index)
        param_bytes = params * DTYPE_BYTES[self.dtype] if self.zero1 else None
        return comm.dp_sync(group, params * self.grad_bytes, param_bytes)

    def _held(self, rank: int) -> list[tuple[int, tuple[int, ...]]]:
        return [(params, holders) for params, holders in self._units if rank in holders]

    def buffer_bytes(self, ranks: tuple[int, ...]) -> float:
        """The full-size buffers (of the reduction dtype) a rank of the device group ``ranks``
        allocates for the sync (0 with uniform layouts: the buckets are reduced in place)."""
        return float(sum(params for params, _ in self._held(ranks[0])) * self.grad_bytes)

    def owned_parameters(self, pipeline: int, group: int) -> int | None:
        """Under ZeRO-1 with different layouts, the most parameters any rank of device group
        ``group`` of pipeline ``pipeline`` owns (the rows it keeps master weights and Adam
        moments for); None otherwise (ZeRO-1 over a uniform DP group divides by dp)."""
        if self.uniform or not self.zero1:
            return None
        return max(
            _owned(self.model, self.plan, pipeline, group, t)
            for t in range(self.plan.pipelines[pipeline].stages[group].tp)
        )


def _owned(model: ModelConfig, plan: ParallelPlan, pipeline: int, group: int, tp_rank: int) -> int:
    """Parameters tp_rank ``tp_rank`` of the device group owns (its rows of every parameter of
    its chunks inside pipeline ``pipeline``'s block), as
    :class:`~megatron_het.optim.replica_sync.ReplicaSync` assigns them."""
    from megatron_het.checkpoint.reshard import is_written_by, stage_parameter_names, target_slice
    from megatron_het.tensor_parallel.sharding import parameter_shape

    pp = plan.pipelines[pipeline]
    chunks = [pp.stages[s] for s in pp.group_stages(group)]
    first = chunks[0]  # the runtime's stage_plan: tp and the embedding's writer
    names = dict.fromkeys(n for chunk in chunks for n in stage_parameter_names(model, chunk))
    owned = 0
    for name in names:
        if not is_written_by(name, model, first, tp_rank):
            continue
        offsets, shape = target_slice(name, model, first.tp, tp_rank)
        a, b = owned_rows(
            parameter_shape(name, model)[0], offsets[0], shape[0], pipeline, plan.dp_size
        )
        owned += (b - a) * math.prod(shape[1:])
    return owned


__all__ = ["DPSync", "unit_parameters"]
