"""TP communication overlapped with the GEMMs beside it (``--tp-comm-overlap``).

Under sequence parallelism a TP block opens with an all-gather along the sequence and closes
with a reduce-scatter (:mod:`megatron_het.tensor_parallel.sequence_parallel`); each waits for
the whole transfer before or after its GEMM. Here both are rings of ``tp - 1`` point-to-point
steps, and each step's transfer runs while the GEMM of the sequence block already at hand
computes (Megatron-LM's ``--tp-comm-overlap``, which TransformerEngine does with userbuffers;
Wang et al. 2022, "Overlap communication with dependent computation via decomposition"):

    op                 forward                                  backward
    all_gather_linear  ring all-gather of x blocks, each block   ring reduce-scatter of dx blocks
                       multiplied as it arrives (qkv, gate/up)   with the x ring again (wgrad)
    linear_reduce_     ring reduce-scatter: each block's         ring all-gather of dy blocks,
    scatter            partial product added to the one passing  each block's dx and wgrad as it
                       by                                        arrives (proj, down)

Rank r holds sequence block r (positions ``[r S/tp, (r + 1) S/tp)``). In the all-gather ring the
block at hand at step k is ``(r - k) mod tp``; in the reduce-scatter ring rank r adds its partial
product for block ``(r - 1 - k) mod tp`` to the sum arriving from rank r - 1 and passes it on,
so at the last step it holds the whole sum of its own block. Results equal the
non-overlapped path up to the order of floating-point sums (the weight gradient is summed over
blocks, in float32, and rounded to a low-precision weight's dtype once, or added straight into
its float32 ``main_grad``). With ``fuse`` (gradient accumulation fusion,
:mod:`megatron_het.kernels.wgrad_fusion`) each block's weight-gradient GEMM accumulates straight
into the ``main_grad`` or the existing float32 ``.grad`` instead of a zeroed buffer. The bytes
on the wire are the same as the collectives'; only the waiting is hidden.

Tensors are ``[B, S, H]`` (batch first, the sequence on dim 1). Shape legend: B batch, S
sequence, s = S/tp this rank's block, H input features, O output features.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F

from megatron_het.comm.p2p import P2PHandle, P2POp
from megatron_het.kernels.autocast import autocast_dtype, autocast_off
from megatron_het.kernels.gemm import addmm_fp32_out_
from megatron_het.kernels.graph_break import graph_break
from megatron_het.kernels.main_grad import add_to_main_grad
from megatron_het.kernels.wgrad_fusion import accumulation_target, added_in_place
from megatron_het.tensor_parallel.tp_group import TPGroup

SEQ_DIM = 1
# Tags of the two rings a backward pass runs at once (gloo matches on them; device backends
# match transfers between two ranks in the order they were posted, the same on every rank).
GATHER_TAG = 71
REDUCE_TAG = 72


class _Ring:
    """This rank's place in ``group`` and its neighbours (global ranks) in the ring."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.size, self.rank = group.size, group.rank
        ranks = group.ranks
        self.next = ranks[(self.rank + 1) % self.size]
        self.prev = ranks[(self.rank - 1) % self.size]

    def pass_on(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[P2PHandle]]:
        """Start sending ``send`` to the next rank and receiving its like from the previous;
        the received tensor is valid once every handle is waited."""
        got = torch.empty_like(send)
        handles = self.group.batch_isend_irecv(
            [P2POp("isend", send, self.next, tag), P2POp("irecv", got, self.prev, tag)]
        )
        return got, handles

    def block(self, step: int, behind: int = 0) -> int:
        """The sequence block at hand at ``step``: ``(rank - behind - step) mod size``."""
        return (self.rank - behind - step) % self.size


def _as_autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in the autocast dtype when autocast is on for their device (what F.linear
    would multiply under it), else as they are. The rings multiply into preallocated blocks,
    which autocast does not cover, so they cast once here and run without it: forward,
    backward and the outputs then share one dtype (autograd casts each returned gradient to
    its input's dtype)."""
    dtype = autocast_dtype(tensors[0].device.type)
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) for t in tensors)


def _wait(handles: list[P2PHandle] | None) -> None:
    for handle in handles or ():
        handle.wait()


def _seq_block(x: torch.Tensor, index: int, length: int) -> torch.Tensor:
    return x.narrow(SEQ_DIM, index * length, length)


def _product_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b``, written in place where ``out`` is contiguous (a sequence block of a
    micro-batch of one), else through a temporary."""
    if out.is_contiguous():
        torch.matmul(a, b, out=out)
    else:
        out.copy_(a.matmul(b))


def _arriving_blocks(ring: _Ring, first: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """The all-gather ring: ``(block index, block)`` for every sequence block, this rank's
    (``first``) first; the next block travels while the caller uses the one yielded."""
    here = first.contiguous()
    for step in range(ring.size):
        handles = None
        if step < ring.size - 1:
            arriving, handles = ring.pass_on(here, GATHER_TAG)
        yield ring.block(step), here
        _wait(handles)
        if handles is not None:
            here = arriving


def _gathered_products(
    ring: _Ring, x_local: torch.Tensor, weights: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """``[all_gather(x) @ W.T for W in weights]``, each block multiplied while the next one
    travels."""
    B, s, _ = x_local.shape
    outs = [x_local.new_empty((B, s * ring.size, w.shape[0])) for w in weights]
    for index, block in _arriving_blocks(ring, x_local):
        for out, w in zip(outs, weights):
            _product_into(_seq_block(out, index, s), block, w.t())
    return outs


def _scattered_sum(
    ring: _Ring, partial_of: Callable[[int], torch.Tensor], beside: Callable[[], None] | None = None
) -> torch.Tensor:
    """Ring reduce-scatter of ``partial_of(block)`` (this rank's partial result for sequence
    block ``block``): the sum over the group of this rank's own block. Each step's partial
    product is computed while the sum before it travels; ``beside()``, when given, runs once
    per step while that step's sum travels."""
    arriving: tuple[torch.Tensor, list[P2PHandle]] | None = None  # the sum so far, in transit
    sending = None
    for step in range(ring.size):
        part = partial_of(ring.block(step, behind=1))
        if arriving is not None:
            received, handles = arriving
            _wait(handles)
            part = part + received
        if step < ring.size - 1:
            sending = part.contiguous()  # kept until its send is waited
            arriving = ring.pass_on(sending, REDUCE_TAG)
        if beside is not None:
            beside()
    return part


class _AllGatherLinear(torch.autograd.Function):
    """``[all_gather_seq(x) @ W.T for W in weights]`` with the gather overlapped."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: TPGroup, fuse: bool, *weights: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.params, ctx.fuse = group, weights, fuse
        x, *operands = _as_autocast(x, *weights)
        ctx.save_for_backward(x, *operands)
        with autocast_off(x.device.type):
            return tuple(_gathered_products(_Ring(group), x, operands))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Two rings at once: the input gradient's reduce-scatter and x's all-gather again
        # (only x's own block was kept), each block's weight gradient computed as it arrives.
        x, *weights = ctx.saved_tensors
        ring = _Ring(ctx.group)
        B, s, H = x.shape
        grad_outs = [g.contiguous() for g in grads]
        targets = [_target(ctx, p) for p in ctx.params]
        wgrads = [_accumulator(w, t) for w, t in zip(weights, targets)]
        blocks = _arriving_blocks(ring, x)

        def weight_gradients() -> None:
            index, here = next(blocks)
            rows = here.reshape(B * s, H)
            for wgrad, g in zip(wgrads, grad_outs):
                addmm_fp32_out_(wgrad, _seq_block(g, index, s).reshape(B * s, -1).t(), rows)

        def input_gradient(block: int) -> torch.Tensor:
            products = (_seq_block(g, block, s).matmul(w) for g, w in zip(grad_outs, weights))
            return cast(torch.Tensor, sum(products))  # a tensor: there is at least one weight

        dx = _scattered_sum(ring, input_gradient, beside=weight_gradients)
        grads_w = (_weight_grad(p, g, t) for p, g, t in zip(ctx.params, wgrads, targets))
        return (dx, None, None, *grads_w)


class _LinearReduceScatter(torch.autograd.Function):
    """``reduce_scatter_seq(x @ W.T)`` with the reduce-scatter overlapped."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: TPGroup, fuse: bool
    ) -> torch.Tensor:
        ctx.group, ctx.param, ctx.fuse = group, weight, fuse
        x, weight = _as_autocast(x, weight)
        ctx.save_for_backward(x, weight)
        ring = _Ring(group)
        if x.shape[SEQ_DIM] % ring.size:
            raise ValueError(
                f"sequence length {x.shape[SEQ_DIM]} is not divisible by the TP size {ring.size}"
            )
        s = x.shape[SEQ_DIM] // ring.size
        with autocast_off(x.device.type):
            return _scattered_sum(ring, lambda block: F.linear(_seq_block(x, block, s), weight))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        ring = _Ring(ctx.group)
        B, S, H = x.shape
        s = S // ring.size
        dx = torch.empty_like(x)
        target = _target(ctx, ctx.param)
        wgrad = _accumulator(weight, target)
        for index, here in _arriving_blocks(ring, grad):
            _product_into(_seq_block(dx, index, s), here, weight)
            addmm_fp32_out_(
                wgrad, here.reshape(B * s, -1).t(), _seq_block(x, index, s).reshape(B * s, H)
            )
        return dx, _weight_grad(ctx.param, wgrad, target), None, None


def _target(ctx: Any, param: torch.Tensor) -> torch.Tensor | None:
    """Where ``param``'s gradient accumulates in place (fused), or None."""
    return accumulation_target(param) if ctx.fuse else None


def _accumulator(weight: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """Where the weight gradient's per-block products are summed: the fused ``target``, else a
    zero float32 (float64 stays) buffer, rounded to the weight's dtype once at the end, as a
    single GEMM makes, not once per block."""
    if target is not None:
        return target
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    return torch.zeros(weight.shape, dtype=dtype, device=weight.device)


def _weight_grad(
    param: torch.Tensor, total: torch.Tensor, target: torch.Tensor | None
) -> torch.Tensor | None:
    """The gradient autograd gets for ``param``: None when ``total`` is the fused ``target`` or
    went into its float32 ``main_grad`` (:func:`~megatron_het.kernels.main_grad.
    add_to_main_grad`), else ``total`` in ``param``'s dtype."""
    if target is not None:
        added_in_place(param, target)
        return None
    return None if add_to_main_grad(param, total) else total.to(param.dtype)


@graph_break  # a compiled layer breaks its graph here: dynamo cannot trace groups
def all_gather_linear(
    x: torch.Tensor, weights: Sequence[torch.Tensor], group: TPGroup, fuse: bool = True
) -> tuple[torch.Tensor, ...]:
    """``[B, s, H]`` sequence block -> ``[all_gather_seq(x) @ W.T for W in weights]`` (each
    ``[B, S, O_W]``), the all-gather overlapped with the GEMMs; backward reduce-scatters the
    input gradient the same way (and, with ``fuse``, accumulates the weight gradients in
    place)."""
    return _AllGatherLinear.apply(x, group, fuse, *weights)


@graph_break  # a compiled layer breaks its graph here: dynamo cannot trace groups
def linear_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, group: TPGroup, fuse: bool = True
) -> torch.Tensor:
    """``[B, S, H]`` -> this rank's ``[B, s, O]`` block of ``sum over ranks (x @ W.T)``, the
    reduce-scatter overlapped with the GEMM; backward all-gathers the output gradient the
    same way (and, with ``fuse``, accumulates the weight gradient in place)."""
    return _LinearReduceScatter.apply(x, weight, group, fuse)
