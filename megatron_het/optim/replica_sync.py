"""Gradient sum across data-parallel replicas whose layouts differ (heterogeneous DP).

When pipelines split the model differently (other stage boundaries, TP degrees or
interleaving), no two ranks of different replicas hold the same shards, so the rank-by-rank DP
sum of :mod:`megatron_het.optim.data_parallel` does not apply. Instead every parameter unit of
:func:`~megatron_het.parallel.process_groups.replica_units` (the embedding, runs of decoder layers
with the same holders, the head) is summed over the group of every rank that holds part of it, in
the FULL parameter shapes: each rank adds its float32 main gradient into its TP box of a zeroed
full-size buffer, the buffer is all-reduced over the unit's group, and each rank reads its box back.
Slices line up by global name and offset whatever TP sharding a replica uses.

Each element is contributed once per replica: a TP-replicated tensor (a norm weight) by tp
rank 0 only, a tied embedding by its first-stage copy only (the last stage's copy already holds
the same gradient, from the pipeline's first/last-stage sum), exactly the pieces a checkpoint
writes (:func:`~megatron_het.checkpoint.reshard.is_written_by`). Every holder reads the sum.

Cost: every holder all-reduces the full unit (``tp`` times its shard's bytes on a TP stage),
one collective per unit, all started before any is waited for. The reduction dtype is the DP
one (float32, or bf16 with ``--grad-reduce-in-bf16``).

ZeRO-1 across such replicas (:meth:`ReplicaSync.owned_rows`): every element has exactly one
owner, which keeps its master weight and Adam moments. A parameter's rows (dim 0; elements of
a vector) are split evenly over the pipelines, block k to pipeline k, whose contributing rank
holding a row owns that row of its box (a contiguous range of its local shard). After the step
:meth:`ReplicaSync.share_owned` spreads the updated pieces: owners write them into zeroed
full-size buffers, one all-reduce per unit, every holder reads its box (exact: each element
has one non-zero term). The same exchange completes optimizer state for a checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_het.checkpoint.reshard import is_written_by, target_slice
from megatron_het.config import ModelConfig
from megatron_het.parallel.replicas import ReplicaUnit, owned_rows
from megatron_het.parallel.stage_plan import StagePlan
from megatron_het.tensor_parallel.sharding import parameter_shape


@dataclass(frozen=True)
class _Entry:
    """One local parameter in a unit's full buffer: elements ``[offset, offset + numel)``
    shaped ``full_shape``; this rank's box ``index`` of it; whether it contributes; the local
    rows ``[rows[0], rows[1])`` of its box it owns under ZeRO-1."""

    name: str
    offset: int
    full_shape: tuple[int, ...]
    index: tuple[slice, ...]
    contributes: bool
    rows: tuple[int, int]

    def box(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's box of the parameter inside a unit's full ``buffer`` (a view)."""
        return buffer[self.offset : self.offset + math.prod(self.full_shape)].view(self.full_shape)[
            self.index
        ]


class ReplicaSync:
    """The cross-replica sums of one rank's parameters (see the module docstring).

    ``names``: this rank's trainable parameter names; ``units``: its
    :attr:`~megatron_het.parallel.process_groups.ProcessGroups.replica_units`; ``stage`` and
    ``tp_rank`` say which pieces it contributes; ``pipeline`` of ``num_pipelines`` which rows
    it owns. Every method that communicates is collective over each unit's group.
    """

    def __init__(
        self,
        names: Sequence[str],
        units: Sequence[tuple[ReplicaUnit, Any]],
        config: ModelConfig,
        stage: StagePlan,
        tp_rank: int,
        pipeline: int,
        num_pipelines: int,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.reduce_dtype = reduce_dtype
        self.units: list[tuple[Any, int, list[_Entry]]] = []
        self.entry: dict[str, _Entry] = {}
        for unit, group in units:
            entries, offset = [], 0
            for name in sorted(n for n in names if unit.holds(n)):  # one order on every rank
                full = tuple(parameter_shape(name, config))
                offsets, shape = target_slice(name, config, stage.tp, tp_rank)
                contributes = is_written_by(name, config, stage, tp_rank)
                rows = (
                    owned_rows(full[0], offsets[0], shape[0], pipeline, num_pipelines)
                    if contributes
                    else (0, 0)
                )
                entries.append(
                    _Entry(
                        name,
                        offset,
                        full,
                        tuple(slice(o, o + n) for o, n in zip(offsets, shape)),
                        contributes,
                        rows,
                    )
                )
                offset += math.prod(full)
            if not entries:  # every holder of a unit holds all of its parameters
                raise ValueError(f"this rank is in the group of {unit} but holds none of it")
            self.units.append((group, offset, entries))
            self.entry.update((e.name, e) for e in entries)

    def owned_rows(self, name: str) -> tuple[int, int]:
        """The rows ``[a, b)`` of this rank's shard of ``name`` that it owns under ZeRO-1."""
        return self.entry[name].rows

    @torch.no_grad()
    def sum_(self, grad_of: Callable[[str], torch.Tensor], device: torch.device) -> None:
        """Replace every ``grad_of(name)`` (float32, this rank's TP shape) by its sum over the
        replicas."""
        self._exchange(grad_of, self.reduce_dtype, device, owned_only=False)

    @torch.no_grad()
    def share_owned(
        self, value_of: Callable[[str], torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> None:
        """Fill every ``value_of(name)`` (this rank's TP shape) with the owners' rows: each
        rank contributes only the rows it owns (in ``dtype``), every holder reads its box."""
        self._exchange(value_of, dtype, device, owned_only=True)

    def _exchange(
        self,
        value_of: Callable[[str], torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        owned_only: bool,
    ) -> None:
        """Sum per unit, over its group, what each rank writes into zeroed full-size buffers
        (its owned rows, or its whole box where it contributes); read every box back."""
        pending = []
        for group, size, entries in self.units:
            buffer = torch.zeros(size, dtype=dtype, device=device)
            for e in entries:
                if owned_only:
                    a, b = e.rows
                    if a < b:
                        e.box(buffer)[a:b].copy_(value_of(e.name)[a:b])
                elif e.contributes:
                    e.box(buffer).copy_(value_of(e.name))
            pending.append((group.all_reduce(buffer, "sum", async_op=True), buffer, entries))
        for handle, buffer, entries in pending:
            handle.wait()
            for e in entries:
                value_of(e.name).copy_(e.box(buffer))
