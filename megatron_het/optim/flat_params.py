"""A stage's parameters in flat buffers laid out like its gradient buckets, with fp32 masters.

Megatron's mixed precision: the model computes with parameters in the training dtype (bf16,
or fp32), while the optimizer steps float32 MASTER weights and copies them back. Here every
bucket of :class:`~megatron_het.optim.data_parallel.GradBuckets` gets a parameter buffer of the
same layout in the training dtype; each parameter's ``.data`` becomes a view of it. This rank
owns a range of every bucket (all of it without the distributed optimizer; range ``dp_rank`` of
``dp`` with it, ZeRO-1) and keeps master weights only for that range:

* float32 training: the master IS the parameter buffer (no copy);
* low-precision training: a float32 copy of the owned range, taken from the float32 values the
  stage was built with, so ``param == round(master)`` always holds.

A :class:`Shard` is the part of one parameter inside this rank's owned range: its master (an
``nn.Parameter`` view for the optimizer) and its float32 gradient (a view of the bucket).

Owned pieces instead of ranges (ZeRO-1 across replicas of different layouts): ``pieces(slot)``
names the flat ranges of each parameter this rank owns; each gets a shard (low precision: its
own float32 master) and the optimizer shares the updated pieces across the replicas itself
(:mod:`megatron_het.optim.replica_sync`), so :meth:`all_gather_params` does nothing and
:meth:`gather` returns this rank's pieces in place, zeros elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_het.optim.data_parallel import Bucket, GradBuckets, ParamSlot


@dataclass
class Shard:
    """The elements ``[lo, hi)`` (flat, within the parameter) of ``slot`` that this rank owns."""

    slot: ParamSlot
    lo: int
    hi: int
    master: nn.Parameter  # float32, the optimizer's parameter
    grad: torch.Tensor  # float32 view of the bucket's gradient


class FlatParams:
    """Parameter buffers, owned ranges and master weights of one stage on one rank.

    ``buckets``: the stage's gradient buckets (their slots name the parameters, which must be
    float32 when this is built). ``sharded``: own range ``dp_rank`` of each bucket (ZeRO-1)
    instead of all of it. ``param_dtype``: the training dtype the parameters are cast to.
    ``pieces``: the flat ranges of each parameter this rank owns instead (see the module
    docstring; ``sharded`` is then False).
    Building moves every parameter's storage into the buffers (``param.data`` becomes a view):
    build it before anything else keeps references to ``param.data``. No communication except
    in :meth:`all_gather_params` (and the waits on the gathers it leaves in flight) and
    :meth:`gather`.
    """

    def __init__(
        self,
        buckets: GradBuckets,
        sharded: bool,
        param_dtype: torch.dtype,
        pieces: Callable[[ParamSlot], list[tuple[int, int]]] | None = None,
    ) -> None:
        self.buckets, self.sharded, self.param_dtype = buckets, sharded, param_dtype
        self.pieces = pieces
        self.low_precision = param_dtype != torch.float32
        self.param_buffers: list[torch.Tensor] = []
        self._gathers: dict[int, Any] = {}  # bucket index -> all-gather handle in flight
        self.master_buffers: list[torch.Tensor | None] = []
        all_values = []
        for bucket in buckets.buckets:
            values = self._float32_values(bucket)
            start, stop = self.owned_range(bucket)
            buffer = values.to(param_dtype) if self.low_precision else values
            self.master_buffers.append(
                values[start:stop].clone() if self.low_precision and pieces is None else None
            )
            for slot in bucket.slots:
                slot.param.data = buffer[slot.start : slot.stop].view(slot.param.shape)
            self.param_buffers.append(buffer)
            all_values.append(values)
        self.shards = self._owned_shards() if pieces is None else self._piece_shards(all_values)

    @staticmethod
    def _float32_values(bucket: Bucket) -> torch.Tensor:
        values = torch.zeros(bucket.numel, dtype=torch.float32, device=bucket.grad.device)
        for slot in bucket.slots:
            if slot.param.dtype != torch.float32:
                raise ValueError(
                    f"{slot.name}: build the stage in float32 (the optimizer keeps "
                    f"the float32 values as master weights), got {slot.param.dtype}"
                )
            values[slot.start : slot.stop].copy_(slot.param.detach().reshape(-1))
        return values

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        """This rank's ``(start, stop)`` in ``bucket``: all of it unless sharded."""
        return self.buckets.owned_range(bucket) if self.sharded else (0, bucket.numel)

    def _owned_shards(self) -> list[Shard]:
        shards = []
        for bucket, buffer, master in zip(
            self.buckets.buckets, self.param_buffers, self.master_buffers
        ):
            start, stop = self.owned_range(bucket)
            source, offset = (buffer, 0) if master is None else (master, start)
            for slot in bucket.slots:
                a, b = max(slot.start, start), min(slot.stop, stop)
                if a < b:
                    view = nn.Parameter(source[a - offset : b - offset])
                    shards.append(
                        Shard(slot, a - slot.start, b - slot.start, view, bucket.grad[a:b])
                    )
        for shard in shards:
            shard.master.grad = shard.grad
        return shards

    def _piece_shards(self, values: list[torch.Tensor]) -> list[Shard]:
        assert self.pieces is not None
        shards = []
        for bucket, buffer in zip(self.buckets.buckets, self.param_buffers):
            for slot in bucket.slots:
                for lo, hi in self.pieces(slot):
                    a, b = slot.start + lo, slot.start + hi
                    master = (
                        values[bucket.index][a:b].clone() if self.low_precision else buffer[a:b]
                    )
                    shards.append(Shard(slot, lo, hi, nn.Parameter(master), bucket.grad[a:b]))
        for shard in shards:
            shard.master.grad = shard.grad
        return shards

    # -- after a step ----------------------------------------------------------------------
    @torch.no_grad()
    def copy_masters_to_params(self) -> None:
        """Round the owned masters into the parameter buffers (low precision; else a no-op)."""
        if not self.low_precision:
            return
        if self.pieces is not None:
            for shard in self.shards:
                start = shard.slot.start
                self.param_buffers[shard.slot.bucket][start + shard.lo : start + shard.hi].copy_(
                    shard.master
                )
            return
        for bucket, buffer, master in zip(
            self.buckets.buckets, self.param_buffers, self.master_buffers
        ):
            start, stop = self.owned_range(bucket)
            assert master is not None  # low precision without pieces keeps master buffers
            buffer[start:stop].copy_(master)

    def all_gather_params(self, overlap: bool = False) -> None:
        """Every DP rank's owned ranges into every rank's parameter buffers (collective over
        the DP group, one all-gather per bucket in the training dtype; sharded only).

        ``overlap`` (``--overlap-param-gather``): start the all-gathers in forward order (the
        last bucket, holding the first layers, first) and return at once; the forward's
        pre-hooks wait for the buckets each module reads (:meth:`wait_param_gather`), and
        :meth:`finish_param_gather` for all of them before anything else reads the parameters.
        A gather still in flight is finished first."""
        self.finish_param_gather()
        if not self.sharded or self.buckets.dp_size == 1 or self.pieces is not None:
            return
        group = self.buckets.dp_group
        order = reversed(self.buckets.buckets) if overlap else self.buckets.buckets
        for bucket in order:
            buffer = self.param_buffers[bucket.index]
            start, stop = self.owned_range(bucket)
            # The input must not alias the output the collective writes.
            self._gathers[bucket.index] = group.all_gather_into_tensor(
                buffer, buffer[start:stop].clone(), async_op=True
            )
        if not overlap:
            self.finish_param_gather()

    @property
    def gathering(self) -> tuple[int, ...]:
        """Indices of the buckets whose parameter all-gather is still in flight."""
        return tuple(self._gathers)

    def wait_param_gather(self, buckets: Sequence[int]) -> None:
        """Wait for the parameter all-gathers of ``buckets`` still in flight (bucket indices)."""
        for index in buckets:
            handle = self._gathers.pop(index, None)
            if handle is not None:
                handle.wait()

    def finish_param_gather(self, wait: bool = True) -> None:
        """Wait for every parameter all-gather in flight (``wait=False``: drop them, after a
        failure where a peer may never answer)."""
        if wait:
            self.wait_param_gather(list(self._gathers))
        self._gathers.clear()

    # -- by name -----------------------------------------------------------------------------
    def gather(
        self, value_of: Callable[[Shard], torch.Tensor | None], keep: bool = True
    ) -> dict[str, torch.Tensor]:
        """``{name: float32 CPU tensor shaped like the parameter}`` assembled from
        ``value_of(shard)`` (the shard's ``hi - lo`` elements; None: zeros) of every owned
        shard; sharded, the owned ranges are all-gathered over the DP group (collective).
        ``keep=False`` takes part in the collective but copies nothing to the host and returns
        ``{}`` (a DP rank that writes none of it); this rank's own pieces are always returned."""
        if self.pieces is not None:  # this rank's pieces; the caller shares them
            out: dict[str, torch.Tensor] = {
                slot.name: torch.zeros(slot.param.shape, dtype=torch.float32)
                for slot in self.buckets.slots
            }
            for shard in self.shards:
                value = value_of(shard)
                if value is not None:
                    out[shard.slot.name].view(-1)[shard.lo : shard.hi].copy_(value.reshape(-1))
            return out
        device = self.buckets.buckets[0].grad.device if self.buckets.buckets else None
        out = {}
        by_bucket: dict[int, list[Shard]] = {}
        for shard in self.shards:
            by_bucket.setdefault(shard.slot.bucket, []).append(shard)
        for bucket in self.buckets.buckets:
            start, stop = self.owned_range(bucket)
            local = torch.zeros(stop - start, dtype=torch.float32, device=device)
            for shard in by_bucket.get(bucket.index, []):
                value = value_of(shard)
                if value is not None:
                    offset = shard.slot.start + shard.lo - start
                    local[offset : offset + shard.hi - shard.lo].copy_(value.reshape(-1))
            full = local
            if self.sharded and self.buckets.dp_size > 1:
                full = torch.empty(bucket.numel, dtype=torch.float32, device=device)
                self.buckets.dp_group.all_gather_into_tensor(full, local)
            if not keep:
                continue
            for slot in bucket.slots:
                out[slot.name] = full[slot.start : slot.stop].view(slot.param.shape).cpu().clone()
        return out

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Set every parameter (rounded to the training dtype) and the owned masters (exact)
        from full-precision ``weights`` by name (this rank's TP-slice shapes). No
        communication: every rank passes the weights of all its parameters."""
        for slot in self.buckets.slots:
            slot.param.copy_(weights[slot.name].reshape(slot.param.shape))
        if self.low_precision:
            for shard in self.shards:
                value = weights[shard.slot.name].reshape(-1)[shard.lo : shard.hi]
                shard.master.copy_(value.to(shard.master.device, torch.float32))

    def master_bytes(self) -> int:
        """Bytes of float32 master weights this rank holds beyond the parameters (0 in fp32)."""
        if self.pieces is not None:
            return sum(s.master.numel() * 4 for s in self.shards) if self.low_precision else 0
        return sum(m.numel() * m.element_size() for m in self.master_buffers if m is not None)
