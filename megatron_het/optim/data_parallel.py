"""Data-parallel gradient sync: float32 main gradients in buckets, one collective per bucket.

A :class:`GradBuckets` lays a stage's trainable parameters out in flat float32 buffers
("buckets") of about ``bucket_size_mb`` each, in REVERSE registration order (roughly the order in
which backward produces the gradients, as Megatron-LM does). Each bucket is padded to a multiple
of the data-parallel size so it splits into ``dp`` equal contiguous ranges; DP rank ``r`` owns
range ``r`` (used by the distributed optimizer, ZeRO-1).

Main gradients (Megatron's mixed precision): every parameter's gradient is accumulated over the
micro-batches of an iteration in float32, in its slice of a bucket:

* a float32 parameter's ``.grad`` IS that slice, so autograd adds into it in place;
* a low-precision (bf16/fp16) parameter carries ``param.main_grad``, a float32 view of the slice
  (:mod:`megatron_het.kernels.main_grad`). A post-accumulate-grad hook adds each backward pass's
  low-precision ``.grad`` into it and frees ``.grad``; kernels that compute a weight gradient in
  float32 add it into ``main_grad`` directly.

Gradients of float32 parameters that arrive another way (``.grad`` set to None and recreated)
are copied in at sync time, so the sync is correct either way.

Sync over the DP group (``groups.dp`` of :mod:`megatron_het.parallel.process_groups`), SUM
reduction, in float32 or (``reduce_dtype=torch.bfloat16``, Megatron's ``--grad-reduce-in-bf16``) on
a bf16 copy of the bucket:

* :meth:`all_reduce`: one ``all_reduce`` per bucket; afterwards every gradient holds the DP sum.
* :meth:`reduce_scatter`: one ``reduce_scatter_tensor`` per bucket; afterwards only THIS rank's
  owned range of each bucket holds the DP sum (the rest of the buffer is stale local data).

Both are skipped when the DP group has one rank. Every collective is issued asynchronously
(``async_op=True``) from the thread running backward, in bucket order, and waited for at the
sync, so bucket transfers overlap each other and, with overlap, the backward pass.

Overlap with backward (:meth:`GradBuckets.enable_overlap`, opt-in): the hooks count the gradient
events each parameter has received; once every parameter of a bucket has its last expected one
(the count per iteration is given to :meth:`GradBuckets.start_iteration`), the bucket's
collective is started right there, so it runs while backward continues. Every DP rank has the
same stage layout and backward graph, so every rank starts the same collectives in the same
order on the one thread that runs backward. Buckets held back (a tied embedding whose
cross-stage sum happens after the pipeline's last backward) are reduced at sync time.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatron_het.kernels.main_grad import MAIN_GRAD, ON_MAIN_GRAD_ADDED
from megatron_het.parallel.buckets import DEFAULT_BUCKET_SIZE_MB, bucket_ranges, padded_elements


@dataclass
class ParamSlot:
    """Where parameter ``name`` lives in bucket ``bucket``: elements ``[start, start+numel)``."""

    name: str
    param: nn.Parameter
    bucket: int
    start: int
    numel: int

    @property
    def stop(self) -> int:
        return self.start + self.numel


@dataclass
class Bucket:
    """A flat float32 gradient buffer ``grad`` of ``numel`` elements (``numel % dp == 0``)."""

    index: int
    numel: int
    slots: list[ParamSlot] = field(default_factory=list)
    grad: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def shard_range(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """``(start, stop)`` of the elements DP rank ``dp_rank`` owns."""
        size = self.numel // dp_size
        return dp_rank * size, (dp_rank + 1) * size


def plan_buckets(
    named_params: Sequence[tuple[str, nn.Parameter]], bucket_size_mb: float, dp_size: int
) -> list[Bucket]:
    """Assign parameters (reverse order) to buckets of about ``bucket_size_mb`` MiB of fp32.

    A bucket closes once it holds at least that much; a parameter is never split across
    buckets (:func:`~megatron_het.parallel.buckets.bucket_ranges`). Buffers are not allocated
    here.
    """
    ordered = list(reversed(list(named_params)))
    buckets: list[Bucket] = []
    for start, stop in bucket_ranges([p.numel() for _, p in ordered], bucket_size_mb):
        slots, filled = [], 0
        for name, param in ordered[start:stop]:
            slots.append(ParamSlot(name, param, len(buckets), filled, param.numel()))
            filled += param.numel()
        buckets.append(Bucket(len(buckets), padded_elements(filled, dp_size), slots))
    return buckets


@dataclass
class _Pending:
    """A started bucket collective: its handle and what to do once it is done."""

    handle: Any
    finish: Callable[[], object]  # what it returns is ignored


class GradBuckets:
    """The bucketed float32 gradients of ``named_params`` (trainable, distinct) on one rank.

    ``dp_group`` is the data-parallel group (a ``UnifiedGroup``: ``size``, ``rank``,
    ``all_reduce`` and ``reduce_scatter_tensor`` with ``async_op``); every member must build its
    ``GradBuckets`` from parameters of the same names, shapes and order (validated plans share
    stage layouts), so the buckets line up element for element. ``reduce_dtype`` is the dtype
    the collectives carry (float32, or bfloat16 for half the bytes).

    Side effect: registers a post-accumulate-grad hook on every parameter (removed by
    :meth:`close`); low-precision parameters get ``main_grad`` at :meth:`zero_grad`.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        dp_group: Any,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.dp_group = dp_group
        self.dp_size, self.dp_rank = dp_group.size, dp_group.rank
        self.reduce_dtype = reduce_dtype
        self.buckets = plan_buckets(named_params, bucket_size_mb, self.dp_size)
        device = named_params[0][1].device if named_params else torch.device("cpu")
        for bucket in self.buckets:
            bucket.grad = torch.zeros(bucket.numel, dtype=torch.float32, device=device)
        self.slots = [slot for bucket in self.buckets for slot in bucket.slots]
        self._pending: dict[int, _Pending] = {}
        self._overlap: _Overlap | None = None
        self._hooks = [
            slot.param.register_post_accumulate_grad_hook(
                lambda _param, slot=slot: self._on_accumulated(slot)
            )
            for slot in self.slots
        ]

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        """The slice of the bucket buffer holding ``slot``'s gradient, shaped like the param."""
        flat = self.buckets[slot.bucket].grad[slot.start : slot.stop]
        return flat.view(slot.param.shape)

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        """This rank's ``(start, stop)`` in ``bucket``."""
        return bucket.shard_range(self.dp_rank, self.dp_size)

    # -- backward ----------------------------------------------------------------------------
    def _on_accumulated(self, slot: ParamSlot) -> None:
        param = slot.param
        if param.dtype != torch.float32:
            if param.grad is None:
                # autograd runs the hook even when every path returned None: the gradient went
                # into main_grad directly and its kernel has reported the event already.
                return
            main_grad: torch.Tensor = getattr(param, MAIN_GRAD)  # set by zero_grad
            main_grad.add_(param.grad)
            param.grad = None
        self._gradient_event(slot)

    def _gradient_event(self, slot: ParamSlot) -> None:
        if self._overlap is not None:
            ready = self._overlap.count(slot)
            if ready:
                self._launch(self.buckets[slot.bucket], self._overlap.mode)

    # -- overlap -----------------------------------------------------------------------------
    def enable_overlap(
        self, held_back: Collection[str] = (), events_per_backward: Mapping[str, int] | None = None
    ) -> None:
        """Start a bucket's reduction from the backward hooks once its gradients of the
        iteration's last backward pass are in.

        Buckets holding a parameter named in ``held_back`` (e.g. a tied embedding whose copies
        are summed across stages after the pipeline has run) are reduced only at sync time.
        ``events_per_backward[name]``: how many gradient events parameter ``name`` sees per
        backward pass (default 1; 2 for a low-precision tied embedding whose head adds its
        float32 gradient into ``main_grad`` directly besides the lookup's ``.grad``). A no-op
        when the DP group has one rank.
        """
        if self.dp_size > 1 and self._overlap is None:
            self._overlap = _Overlap(self, set(held_back), dict(events_per_backward or {}))

    def start_iteration(self, num_backward: int | None, mode: str) -> None:
        """Expect ``num_backward`` backward passes (micro-batches) before the next sync, whose
        kind is ``mode`` ("all_reduce" or "reduce_scatter"). None: no early launches."""
        if self._pending:
            raise RuntimeError("start_iteration called before the previous sync finished")
        if self._overlap is not None:
            self._overlap.start(num_backward, mode)

    @property
    def launched_early(self) -> int:
        """How many buckets the last sync found already started by the backward hooks."""
        return self._overlap.launched_early if self._overlap is not None else 0

    def close(self, wait: bool = True) -> None:
        """Wait for started collectives (``wait=False``: abandon them, as a run that lost a
        peer must, since they would only time out), remove the hooks and the parameters'
        main-gradient attributes (which would keep this object, and its group, alive through
        them)."""
        if wait:
            for pending in self._pending.values():
                pending.handle.wait()
        self._pending = {}
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._overlap = None
        for slot in self.slots:
            for name in (MAIN_GRAD, ON_MAIN_GRAD_ADDED):
                if hasattr(slot.param, name):
                    delattr(slot.param, name)

    # -- sync --------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero every bucket; float32 parameters' ``.grad`` become views of it, low-precision
        ones get ``.grad = None`` and ``main_grad`` (a float32 view)."""
        for bucket in self.buckets:
            bucket.grad.zero_()
        for slot in self.slots:
            param = slot.param
            if param.dtype == torch.float32:
                param.grad = self.grad_view(slot)
            else:
                param.grad = None
                setattr(param, MAIN_GRAD, self.grad_view(slot))
                setattr(param, ON_MAIN_GRAD_ADDED, lambda slot=slot: self._gradient_event(slot))

    def _is_view(self, slot: ParamSlot) -> bool:
        grad = slot.param.grad
        return grad is not None and grad.data_ptr() == self.grad_view(slot).data_ptr()

    def pack(self, bucket: Bucket) -> None:
        """Copy float32 gradients of ``bucket`` that do not already live in it into it (None:
        zeros); add a low-precision ``.grad`` still pending (no hook ran) into main_grad."""
        for slot in bucket.slots:
            param = slot.param
            if param.dtype != torch.float32:
                if param.grad is not None:
                    self.grad_view(slot).add_(param.grad)
                    param.grad = None
                continue
            if self._is_view(slot):
                continue
            view = self.grad_view(slot)
            if param.grad is None:
                view.zero_()
            else:
                view.copy_(param.grad)

    def _unpack(self) -> None:
        for slot in self.slots:
            if slot.param.dtype == torch.float32 and not self._is_view(slot):
                slot.param.grad = self.grad_view(slot)

    def _launch(self, bucket: Bucket, mode: str) -> None:
        """Pack ``bucket`` and start its collective (nothing to start with one DP rank)."""
        self.pack(bucket)
        if self.dp_size == 1:
            return
        low = self.reduce_dtype != torch.float32
        send = bucket.grad.to(self.reduce_dtype) if low else bucket.grad
        if mode == "all_reduce":
            handle = self.dp_group.all_reduce(send, "sum", async_op=True)
            finish = (lambda: bucket.grad.copy_(send)) if low else (lambda: None)
        else:
            start, stop = self.owned_range(bucket)
            # The output must not alias the input the collective is still reading.
            out = torch.empty(stop - start, dtype=send.dtype, device=send.device)
            handle = self.dp_group.reduce_scatter_tensor(out, send, "sum", async_op=True)
            finish = lambda: bucket.grad[start:stop].copy_(out)  # noqa: E731
        self._pending[bucket.index] = _Pending(handle, finish)

    def _sync(self, mode: str) -> None:
        early = set(self._pending)
        if self._overlap is not None:
            self._overlap.finish(len(early))
        for bucket in self.buckets:
            if bucket.index not in early:
                self._launch(bucket, mode)
        pending, self._pending = self._pending, {}
        for index in sorted(pending):
            pending[index].handle.wait()
            pending[index].finish()

    def all_reduce(self) -> None:
        """Sum every gradient over the DP group (one collective per bucket); every rank's
        gradients then hold the sum. No communication when the group has one rank."""
        self._sync("all_reduce")
        self._unpack()

    def reduce_scatter(self) -> None:
        """Sum the gradients over the DP group into this rank's owned range of every bucket
        (one ``reduce_scatter_tensor`` per bucket). Outside the owned ranges the buffers keep
        this rank's unreduced gradients; ``.grad`` of parameters is not meaningful afterwards."""
        self._sync("reduce_scatter")


class _Overlap:
    """Counts gradient events per bucket; says when a bucket's last expected one is in."""

    def __init__(
        self, buckets: GradBuckets, held_back: set[str], events_per_backward: dict[str, int]
    ) -> None:
        self.eligible = [not any(s.name in held_back for s in b.slots) for b in buckets.buckets]
        self.per_backward = [
            sum(events_per_backward.get(s.name, 1) for s in b.slots) for b in buckets.buckets
        ]
        self.expected: int | None = None
        self.mode = "all_reduce"
        self.counts = [0] * len(buckets.buckets)
        self.launched_early = 0
        self.error = ""

    def start(self, num_backward: int | None, mode: str) -> None:
        self.expected, self.mode = num_backward, mode
        self.counts = [0] * len(self.counts)
        self.error = ""

    def count(self, slot: ParamSlot) -> bool:
        """Record one gradient event of ``slot``; True when its bucket is now complete."""
        if self.expected is None or not self.eligible[slot.bucket]:
            return False
        self.counts[slot.bucket] += 1
        needed = self.expected * self.per_backward[slot.bucket]
        if self.counts[slot.bucket] > needed:
            self.error = (
                f"{slot.name} received more backward passes than the "
                f"{self.expected} announced to start_iteration"
            )
        return self.counts[slot.bucket] == needed

    def finish(self, launched: int) -> None:
        """End the iteration's counting (raising what went wrong during it)."""
        self.expected = None
        self.launched_early = launched
        if self.error:
            raise RuntimeError(self.error)
