"""Stage-boundary transfers: who sends what to whom when stages differ in TP degree.

Activations between stages are ``[b, s, H]`` hidden states, REPLICATED over a stage's TP group
(every TP rank of a stage holds the same tensor, and the same input gradient in backward). So a
boundary reshards by choosing one source per receiver, never by splitting tensors:

* forward: rank j (tp_rank) of stage k+1 receives the activations from rank ``j % tp_k`` of
  stage k; a stage-k rank i therefore sends to every stage-(k+1) rank j with ``j % tp_k == i``
  (none when ``i >= tp_(k+1)``, one when the degrees match, several when the next stage is
  wider);
* backward, the mirror image: rank i of stage k receives its output gradient from rank
  ``i % tp_(k+1)`` of stage k+1, which sends to every stage-k rank i with
  ``i % tp_(k+1) == j``.

Every rank thus receives exactly one message per transfer and the traffic per boundary is
``max(tp_k, tp_(k+1))`` messages. Transfers go over the pipeline's group, so ranks of different
accelerator kinds meet on the communicator's bridge.

Wire dtype: the parameters' dtype, which is the activations' (bf16 under mixed precision, half
the bytes of fp32, as the predictor models).

Also here: :func:`sync_tied_embedding_grads`, the first/last-stage gradient sum of tied
embeddings.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megatron_het.comm.p2p import P2POp
from megatron_het.kernels.main_grad import accumulated_grad
from megatron_het.parallel.groups import ProcessGroups
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.pipeline.schedules import Action, ActionKind
from megatron_het.tensor_parallel.sharding import vocab_range

# Distinct tags keep the two directions apart even where a backend matches messages by tag only.
TAG_ACTIVATION = 1
TAG_GRADIENT = 2


@dataclass(frozen=True)
class BoundaryPeers:
    """Global ranks this rank exchanges with, per transfer kind (see the module docstring).

    ``recv_*`` is None on a stage without that neighbour; ``send_*`` may be empty.
    """

    send_forward: tuple[int, ...] = ()
    recv_forward: Optional[int] = None
    send_backward: tuple[int, ...] = ()
    recv_backward: Optional[int] = None

    def for_action(self, action: Action) -> tuple[int, ...]:
        """The peers of one transfer action of this rank's schedule."""
        kind = action.kind
        if kind is ActionKind.SEND_FORWARD:
            return self.send_forward
        if kind is ActionKind.SEND_BACKWARD:
            return self.send_backward
        peer = self.recv_forward if kind is ActionKind.RECV_FORWARD else self.recv_backward
        if kind not in (ActionKind.RECV_FORWARD, ActionKind.RECV_BACKWARD) or peer is None:
            raise ValueError(f"{action} is not a transfer this rank takes part in")
        return (peer,)


def boundary_peers(plan: ParallelPlan, rank: int) -> BoundaryPeers:
    """The transfer peers of ``rank`` in its pipeline (pure function of the plan)."""
    role = plan.rank_role(rank)
    stages = plan.pipelines[role.pipeline].stages
    me, t = stages[role.stage], role.tp_rank
    peers: dict[str, object] = {}
    if role.stage > 0:
        prev = stages[role.stage - 1]
        peers["recv_forward"] = prev.ranks[t % prev.tp]
        peers["send_backward"] = tuple(r for i, r in enumerate(prev.ranks) if i % me.tp == t)
    if role.stage < len(stages) - 1:
        nxt = stages[role.stage + 1]
        peers["send_forward"] = tuple(r for j, r in enumerate(nxt.ranks) if j % me.tp == t)
        peers["recv_backward"] = nxt.ranks[t % nxt.tp]
    return BoundaryPeers(**peers)  # type: ignore[arg-type]


@dataclass
class BufferPool:
    """Receive buffers reused across micro-batches and iterations, keyed by (shape, dtype).

    A buffer is taken with :meth:`acquire` and handed back with :meth:`release` once its
    contents are no longer needed; the pool only allocates when every buffer of that key is in
    use, so after the first iteration no receive allocates.
    """

    device: torch.device
    _free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = field(
        default_factory=dict)
    allocated: int = 0

    def acquire(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        free = self._free.setdefault((tuple(shape), dtype), [])
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def release(self, buffer: torch.Tensor) -> None:
        self._free.setdefault((tuple(buffer.shape), buffer.dtype), []).append(buffer)


def transfer_ops(action: Action, peers: BoundaryPeers, payload: Optional[torch.Tensor],
                 buffer: Optional[torch.Tensor]) -> list[P2POp]:
    """The point-to-point ops of one transfer action.

    Sends carry ``payload`` (contiguous, wire dtype) to each peer; a receive fills ``buffer``.
    """
    forward = action.kind in (ActionKind.SEND_FORWARD, ActionKind.RECV_FORWARD)
    tag = TAG_ACTIVATION if forward else TAG_GRADIENT
    if action.kind in (ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD):
        assert payload is not None
        return [P2POp("isend", payload, peer, tag) for peer in peers.for_action(action)]
    assert buffer is not None
    return [P2POp("irecv", buffer, peers.for_action(action)[0], tag)]


def tied_embedding_weight(stage: torch.nn.Module, groups: ProcessGroups
                          ) -> Optional[torch.Tensor]:
    """This rank's copy of the tied ``embedding.weight`` when its gradient must be summed with
    the other end stage's (tied embeddings, rank in ``groups.embedding``), else None."""
    if not stage.config.tie_embeddings or groups.embedding is None:  # type: ignore[attr-defined]
        return None
    return stage.embedding.weight  # type: ignore[attr-defined]


@torch.no_grad()
def sync_tied_embedding_grads(stage: torch.nn.Module, groups: ProcessGroups,
                              baseline: Optional[torch.Tensor] = None) -> None:
    """Sum the gradients of the two ``embedding.weight`` copies of a tied-embedding pipeline.

    A no-op unless the model ties its embeddings and this rank is in ``groups.embedding``
    (first- or last-stage rank of a pipeline with pp > 1). Collective over that group: all its
    members must call it. Afterwards both copies hold the gradient of the single-process
    (shared) weight, restricted to each rank's vocabulary rows. ``baseline``: the part of
    ``.grad`` that was already summed (equal on both copies, e.g. from an earlier call during
    gradient accumulation); only the rest is exchanged, so nothing is counted twice. The
    gradient is the float32 ``main_grad`` of a low-precision weight, else ``.grad``.

    Equal TP degrees on both ends: one all-reduce of the ``[V/tp, H]`` shard between the two
    ranks holding the same rows. Different degrees: each member places its rows into a zero
    ``[V, H]`` buffer, the buffer is summed over both end stages (each stage contributes its
    full gradient once) and each member keeps its rows. A missing ``.grad`` counts as zeros.
    """
    weight = tied_embedding_weight(stage, groups)
    if weight is None:
        return
    grad = accumulated_grad(weight)
    if grad is None:
        weight.grad = grad = torch.zeros_like(weight)
    delta = grad if baseline is None else grad - baseline
    if groups.embedding_pairs:
        groups.embedding.all_reduce(delta, "sum")
    else:
        vocab = stage.config.vocab_size  # type: ignore[attr-defined]
        start, stop = vocab_range(vocab, groups.tp.size, groups.tp.rank)
        full = torch.zeros((vocab, grad.shape[1]), dtype=grad.dtype, device=grad.device)
        full[start:stop] = delta
        groups.embedding.all_reduce(full, "sum")
        delta = full[start:stop]
    if delta is not grad:
        grad.copy_(delta if baseline is None else baseline + delta)
