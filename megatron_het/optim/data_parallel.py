"""Data-parallel gradient sync: gradients flattened into fp32 buckets, one collective per bucket.

A :class:`GradBuckets` lays a stage's trainable parameters out in flat float32 buffers
("buckets") of about ``bucket_size_mb`` each, in REVERSE registration order (roughly the order in
which backward produces the gradients, as Megatron-LM does). Each bucket is padded to a multiple
of the data-parallel size so it splits into ``dp`` equal contiguous ranges; DP rank ``r`` owns
range ``r`` (used by the distributed optimizer, ZeRO-1).

Between :meth:`GradBuckets.zero_grad` and the sync, every float32 parameter's ``.grad`` IS a view
of its bucket, so autograd accumulates micro-batch gradients straight into the buffer (autograd
adds in place into an existing ``.grad``). Gradients that arrive another way (``.grad`` set to
None and recreated, or non-float32 parameters) are copied in at sync time, so the sync is correct
either way.

Sync over the DP group (``groups.dp`` of :mod:`megatron_het.parallel.groups`), SUM reduction:

* :meth:`all_reduce`: one ``all_reduce`` per bucket; afterwards every ``.grad`` holds the DP sum.
* :meth:`reduce_scatter`: one ``reduce_scatter_tensor`` per bucket; afterwards only THIS rank's
  owned range of each bucket holds the DP sum (the rest of the buffer is stale local data).

Both are skipped when the DP group has one rank.

Overlap with backward (:meth:`GradBuckets.enable_overlap`, opt-in): the unified communicator's
collectives are synchronous, so a reduction called from a backward hook would stall the backward
pass for the whole transfer and overlap nothing. Instead, post-accumulate-grad hooks count the
backward passes each parameter has received; once every parameter of a bucket has its last
expected one (the count is given per iteration, :meth:`GradBuckets.start_iteration`), the
bucket's collective is queued on ONE background thread, which blocks in the collective while the
main thread continues backward. The sync then waits for those and reduces the remaining buckets
in order. Without a count, or for buckets held back (a tied embedding whose cross-stage sum
happens after the pipeline's last backward), everything is reduced at sync time.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Collection, Sequence

import torch
from torch import nn

_FP32_BYTES = 4


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


def plan_buckets(named_params: Sequence[tuple[str, nn.Parameter]], bucket_size_mb: float,
                 dp_size: int) -> list[Bucket]:
    """Assign parameters (reverse order) to buckets of about ``bucket_size_mb`` MiB of fp32.

    A bucket closes once it holds at least that much; a parameter is never split across
    buckets. Buffers are not allocated here.
    """
    if bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
    limit = max(1, int(bucket_size_mb * 1024 * 1024 / _FP32_BYTES))
    buckets: list[Bucket] = []
    current: list[ParamSlot] = []
    filled = 0

    def close() -> None:
        nonlocal current, filled
        padded = -(-filled // dp_size) * dp_size
        buckets.append(Bucket(len(buckets), padded, current))
        current, filled = [], 0

    for name, param in reversed(list(named_params)):
        current.append(ParamSlot(name, param, len(buckets), filled, param.numel()))
        filled += param.numel()
        if filled >= limit:
            close()
    if current:
        close()
    return buckets


class GradBuckets:
    """The bucketed gradients of ``named_params`` (trainable, distinct) on one rank.

    ``dp_group`` is the data-parallel group (a ``UnifiedGroup``: ``size``, ``rank``,
    ``all_reduce``, ``reduce_scatter_tensor``); every member must build its ``GradBuckets`` from
    parameters of the same names, shapes and order (validated plans share stage layouts), so
    the buckets line up element for element.

    With :meth:`enable_overlap`, a bucket's reduction starts on a background thread as soon as
    the last expected backward pass has accumulated every gradient in it (see the module
    docstring); :meth:`all_reduce` / :meth:`reduce_scatter` then wait for those and reduce the
    remaining buckets.
    """

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], dp_group: Any,
                 bucket_size_mb: float = 25.0) -> None:
        self.dp_group = dp_group
        self.dp_size, self.dp_rank = dp_group.size, dp_group.rank
        self.buckets = plan_buckets(named_params, bucket_size_mb, self.dp_size)
        device = named_params[0][1].device if named_params else torch.device("cpu")
        for bucket in self.buckets:
            bucket.grad = torch.zeros(bucket.numel, dtype=torch.float32, device=device)
        self.slots = [slot for bucket in self.buckets for slot in bucket.slots]
        self._overlap: _Overlap | None = None

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        """The slice of the bucket buffer holding ``slot``'s gradient, shaped like the param."""
        flat = self.buckets[slot.bucket].grad[slot.start:slot.stop]
        return flat.view(slot.param.shape)

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        """This rank's ``(start, stop)`` in ``bucket``."""
        return bucket.shard_range(self.dp_rank, self.dp_size)

    # -- overlap -----------------------------------------------------------------------------
    def enable_overlap(self, held_back: Collection[str] = ()) -> None:
        """Register post-accumulate-grad hooks that start a bucket's reduction on a background
        thread once its gradients of the iteration's last backward pass are in.

        Buckets holding a parameter named in ``held_back`` (e.g. a tied embedding whose copies
        are summed across stages after the pipeline has run) are reduced only at sync time. A
        no-op when the DP group has one rank. Side effect: one worker thread per instance.
        """
        if self.dp_size > 1 and self._overlap is None:
            self._overlap = _Overlap(self, set(held_back))

    def start_iteration(self, num_backward: int | None, mode: str) -> None:
        """Expect ``num_backward`` backward passes (micro-batches) before the next sync, whose
        kind is ``mode`` ("all_reduce" or "reduce_scatter"). None: no early launches."""
        if self._overlap is not None:
            self._overlap.start(num_backward, mode)

    @property
    def launched_early(self) -> int:
        """How many buckets the last sync found already started by the backward hooks."""
        return self._overlap.launched_early if self._overlap is not None else 0

    def close(self) -> None:
        """Remove the hooks and stop the worker thread (if overlap was enabled)."""
        if self._overlap is not None:
            self._overlap.close()
            self._overlap = None

    # -- sync --------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero every bucket and point each float32 parameter's ``.grad`` at its slice (others
        get ``.grad = None``)."""
        for bucket in self.buckets:
            bucket.grad.zero_()
        for slot in self.slots:
            if slot.param.dtype == torch.float32:
                slot.param.grad = self.grad_view(slot)
            else:
                slot.param.grad = None

    def _is_view(self, slot: ParamSlot) -> bool:
        grad = slot.param.grad
        return grad is not None and grad.data_ptr() == self.grad_view(slot).data_ptr()

    def pack(self, bucket: Bucket) -> None:
        """Copy gradients of ``bucket`` that do not already live in it into it (None: zeros)."""
        for slot in bucket.slots:
            if self._is_view(slot):
                continue
            view = self.grad_view(slot)
            if slot.param.grad is None:
                view.zero_()
            else:
                view.copy_(slot.param.grad)

    def _unpack(self) -> None:
        for slot in self.slots:
            if self._is_view(slot):
                continue
            if slot.param.dtype == torch.float32:
                slot.param.grad = self.grad_view(slot)
            elif slot.param.grad is None:
                slot.param.grad = self.grad_view(slot).to(slot.param.dtype)
            else:
                slot.param.grad.copy_(self.grad_view(slot))

    def reduce_bucket(self, bucket: Bucket, mode: str) -> None:
        """Pack ``bucket`` and run its collective over the DP group (``mode``: "all_reduce" or
        "reduce_scatter"; see :meth:`all_reduce` / :meth:`reduce_scatter`)."""
        self.pack(bucket)
        if self.dp_size == 1:
            return
        if mode == "all_reduce":
            self.dp_group.all_reduce(bucket.grad, "sum")
            return
        start, stop = self.owned_range(bucket)
        # The output must not alias the input the collective is still reading.
        out = torch.empty(stop - start, dtype=bucket.grad.dtype, device=bucket.grad.device)
        self.dp_group.reduce_scatter_tensor(out, bucket.grad, "sum")
        bucket.grad[start:stop].copy_(out)

    def _sync(self, mode: str) -> None:
        done = self._overlap.finish() if self._overlap is not None else set()
        for bucket in self.buckets:
            if bucket.index not in done:
                self.reduce_bucket(bucket, mode)

    def all_reduce(self) -> None:
        """Sum every gradient over the DP group (one collective per bucket); every rank's
        ``.grad`` then holds the sum. No communication when the group has one rank."""
        self._sync("all_reduce")
        self._unpack()

    def reduce_scatter(self) -> None:
        """Sum the gradients over the DP group into this rank's owned range of every bucket
        (one ``reduce_scatter_tensor`` per bucket). Outside the owned ranges the buffers keep
        this rank's unreduced gradients; ``.grad`` of parameters is not meaningful afterwards."""
        self._sync("reduce_scatter")


class _Overlap:
    """Backward hooks + one worker thread that reduce buckets while backward continues.

    The worker runs buckets in the order they became ready, which is the same on every DP rank
    (same stage layout, same backward graph), so the collectives line up across the group.
    """

    def __init__(self, buckets: GradBuckets, held_back: set[str]) -> None:
        self.buckets = buckets
        self.eligible = [not any(s.name in held_back for s in b.slots) for b in buckets.buckets]
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dp-grad-sync")
        self.handles = [slot.param.register_post_accumulate_grad_hook(
            lambda _param, slot=slot: self.on_grad_ready(slot)) for slot in buckets.slots]
        self.expected: int | None = None
        self.mode = "all_reduce"
        self.counts = [0] * len(buckets.buckets)
        self.futures: dict[int, Future] = {}
        self.launched_early = 0
        self.error = ""

    def start(self, num_backward: int | None, mode: str) -> None:
        if self.futures:
            raise RuntimeError("start_iteration called before the previous sync finished")
        self.expected, self.mode = num_backward, mode
        self.counts = [0] * len(self.counts)
        self.error = ""

    def on_grad_ready(self, slot: ParamSlot) -> None:
        if self.expected is None or not self.eligible[slot.bucket]:
            return
        bucket = self.buckets.buckets[slot.bucket]
        self.counts[slot.bucket] += 1
        needed = self.expected * len(bucket.slots)
        if self.counts[slot.bucket] == needed:
            self.futures[bucket.index] = self.pool.submit(self.buckets.reduce_bucket, bucket,
                                                          self.mode)
        elif self.counts[slot.bucket] > needed:
            self.error = (f"{slot.name} received more backward passes than the "
                          f"{self.expected} announced to start_iteration")

    def finish(self) -> set[int]:
        """Wait for the early reductions (re-raising their errors); their bucket indices."""
        futures, self.futures, self.expected = self.futures, {}, None
        for future in futures.values():
            future.result()
        if self.error:
            raise RuntimeError(self.error)
        self.launched_early = len(futures)
        return set(futures)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.pool.shutdown(wait=True)
