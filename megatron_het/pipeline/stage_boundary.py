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
``max(tp_k, tp_(k+1))`` messages.

Sequence parallelism: a rank of a stage with tp > 1 holds positions ``[t S/tp, (t+1) S/tp)``
only (a tp = 1 stage all of them), so a boundary reshards by positions: every pair of ranks
whose blocks overlap exchanges the overlap, one message each way (equal degrees: rank t with
rank t, ``1/tp`` of the bytes of the replicated case). Transfers go over the pipeline's group, so
ranks of different accelerator kinds meet on the communicator's bridge.

Wire dtype: the parameters' dtype, which is the activations' (bf16 under mixed precision, half
the bytes of fp32, as the predictor models).

Also here: :func:`sync_tied_embedding_grads`, the first/last-stage gradient sum of tied
embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_het.comm.p2p import P2POp
from megatron_het.kernels.main_grad import accumulated_grad
from megatron_het.model.llama import LlamaModel
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.process_groups import ProcessGroups
from megatron_het.parallel.sequence import local_positions, position_overlaps
from megatron_het.parallel.stage_plan import StagePlan
from megatron_het.pipeline.schedules import Action, ActionKind
from megatron_het.tensor_parallel.sharding import vocab_range

# Distinct tags keep the two directions apart even where a backend matches messages by tag only.
TAG_ACTIVATION = 1
TAG_GRADIENT = 2


@dataclass(frozen=True)
class Piece:
    """One message of a boundary transfer: with ``peer``, positions ``[start, stop)`` of this
    rank's local sequence (``start`` None: the whole local tensor)."""

    peer: int
    start: int | None = None
    stop: int | None = None

    def of(self, x_BsH: torch.Tensor) -> torch.Tensor:
        """This piece's positions of ``x[B, s, H]`` (the tensor itself when whole)."""
        return x_BsH if self.start is None else x_BsH[:, self.start : self.stop]


@dataclass(frozen=True)
class BoundaryPeers:
    """The messages of this rank per transfer kind (see the module docstring).

    ``recv_*`` is empty on a stage without that neighbour; ``send_*`` may be empty. Without
    sequence parallelism every message is a whole tensor and a rank receives one per transfer.
    """

    send_forward: tuple[Piece, ...] = ()
    recv_forward: tuple[Piece, ...] = ()
    send_backward: tuple[Piece, ...] = ()
    recv_backward: tuple[Piece, ...] = ()

    def for_action(self, action: Action) -> tuple[Piece, ...]:
        """The messages of one transfer action of this rank's schedule."""
        pieces = {
            ActionKind.SEND_FORWARD: self.send_forward,
            ActionKind.RECV_FORWARD: self.recv_forward,
            ActionKind.SEND_BACKWARD: self.send_backward,
            ActionKind.RECV_BACKWARD: self.recv_backward,
        }.get(action.kind)
        if pieces is None or (
            action.kind in (ActionKind.RECV_FORWARD, ActionKind.RECV_BACKWARD) and not pieces
        ):
            raise ValueError(f"{action} is not a transfer this rank takes part in")
        return pieces


def _pieces(
    plan: ParallelPlan, me: StagePlan, t: int, other: StagePlan, seq_length: int | None
) -> list[tuple[Piece, Piece]]:
    """(my piece, the peer's piece) of every message between tp_rank ``t`` of ``me`` and the
    ranks of the adjacent stage ``other`` that hold positions it needs or has, for the
    direction where ``me`` receives (the sender side is the mirror image)."""
    if seq_length is None or not plan.sequence_parallel:
        # Replicated tensors: one source per receiver (rank t % tp of the other stage).
        return [(Piece(other.ranks[t % other.tp]), Piece(-1))]
    start = local_positions(plan, me, t, seq_length)[0]
    out = []
    for i, j, lo, hi in position_overlaps(plan, other, me, seq_length):
        if j == t:
            theirs = local_positions(plan, other, i, seq_length)[0]
            out.append(
                (Piece(other.ranks[i], lo - start, hi - start), Piece(-1, lo - theirs, hi - theirs))
            )
    return out


def boundary_peers(plan: ParallelPlan, rank: int, seq_length: int | None = None) -> BoundaryPeers:
    """The transfer messages of ``rank`` in its pipeline (pure function of the plan).

    Interleaved pipelines: every stage of a device group has the same neighbouring groups (the
    previous stage of any of its chunks runs on group ``g - 1 mod pp``, the next on ``g + 1``),
    so one set of messages serves all its chunks' boundaries. ``seq_length`` is needed for a
    sequence-parallel plan (its messages carry blocks of positions).
    """
    role = plan.rank_role(rank)
    stages = plan.pipelines[role.pipeline].stages
    me, t = role.stage_plan, role.tp_rank
    if plan.sequence_parallel and seq_length is None:
        raise ValueError("a sequence-parallel plan's boundary messages need seq_length")

    def sends_to(other: StagePlan) -> tuple[Piece, ...]:
        """Mirror of the receives: my piece in every message a rank of ``other`` takes."""
        out = []
        for j, rank_j in enumerate(other.ranks):
            for theirs, mine in _pieces(plan, other, j, me, seq_length):
                if theirs.peer == rank:
                    out.append(Piece(rank_j, mine.start, mine.stop))
        return tuple(out)

    peers: dict[str, tuple[Piece, ...]] = {}
    with_prev = [s for s in role.chunks if s > 0]
    if with_prev:
        prev = stages[with_prev[0] - 1]
        peers["recv_forward"] = tuple(p for p, _ in _pieces(plan, me, t, prev, seq_length))
        peers["send_backward"] = sends_to(prev)
    with_next = [s for s in role.chunks if s < len(stages) - 1]
    if with_next:
        nxt = stages[with_next[0] + 1]
        peers["send_forward"] = sends_to(nxt)
        peers["recv_backward"] = tuple(p for p, _ in _pieces(plan, me, t, nxt, seq_length))
    return BoundaryPeers(**peers)


@dataclass
class BufferPool:
    """Receive buffers reused across micro-batches and iterations, keyed by (shape, dtype).

    A buffer is taken with :meth:`acquire` and handed back with :meth:`release` once its
    contents are no longer needed; the pool only allocates when every buffer of that key is in
    use, so after the first iteration no receive allocates.
    """

    device: torch.device
    _free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = field(
        default_factory=dict
    )
    allocated: int = 0

    def acquire(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        free = self._free.setdefault((tuple(shape), dtype), [])
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def release(self, buffer: torch.Tensor) -> None:
        self._free.setdefault((tuple(buffer.shape), buffer.dtype), []).append(buffer)


def transfer_ops(
    action: Action, peers: BoundaryPeers, payload: torch.Tensor | None, buffer: torch.Tensor | None
) -> tuple[list[P2POp], list[tuple]]:
    """The point-to-point ops of one transfer action, and the receives to place afterwards.

    Sends carry ``payload`` (contiguous, wire dtype; its pieces for sequence blocks) to each
    peer; a receive fills ``buffer``, directly when it is one whole message, else through one
    staging tensor per piece: the second list holds ``(piece tensor, buffer view)`` pairs to
    copy once the ops have completed (:func:`place_received`).
    """
    forward = action.kind in (ActionKind.SEND_FORWARD, ActionKind.RECV_FORWARD)
    tag = TAG_ACTIVATION if forward else TAG_GRADIENT
    pieces = peers.for_action(action)
    if action.kind in (ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD):
        assert payload is not None
        return [
            P2POp("isend", piece.of(payload).contiguous(), piece.peer, tag) for piece in pieces
        ], []
    assert buffer is not None
    if (
        len(pieces) == 1
        and pieces[0].start in (None, 0)
        and (pieces[0].stop in (None, buffer.shape[1]))
    ):
        return [P2POp("irecv", buffer, pieces[0].peer, tag)], []
    ops, places = [], []
    for piece in pieces:
        view = piece.of(buffer)
        staging = torch.empty(view.shape, dtype=buffer.dtype, device=buffer.device)
        ops.append(P2POp("irecv", staging, piece.peer, tag))
        places.append((staging, view))
    return ops, places


def place_received(places: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy received pieces into their buffer positions (after the receives completed)."""
    for staging, view in places:
        view.copy_(staging)


def tied_embedding_weight(stage: LlamaModel, groups: ProcessGroups) -> torch.Tensor | None:
    """This rank's copy of the tied ``embedding.weight`` when its gradient must be summed with
    the other end stage's (tied embeddings, rank in ``groups.embedding``), else None."""
    if not stage.config.tie_embeddings or groups.embedding is None:
        return None
    assert stage.embedding is not None  # each end stage of a tied model holds a copy
    return stage.embedding.weight


@torch.no_grad()
def sync_tied_embedding_grads(
    stage: LlamaModel, groups: ProcessGroups, baseline: torch.Tensor | None = None
) -> None:
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
    group = groups.embedding
    if weight is None or group is None:  # a weight to sum comes with its group
        return
    grad = accumulated_grad(weight)
    if grad is None:
        weight.grad = grad = torch.zeros_like(weight)
    delta = grad if baseline is None else grad - baseline
    if groups.embedding_pairs:
        group.all_reduce(delta, "sum")
    else:
        vocab = stage.config.vocab_size
        start, stop = vocab_range(vocab, groups.tp.size, groups.tp.rank)
        full = torch.zeros((vocab, grad.shape[1]), dtype=grad.dtype, device=grad.device)
        full[start:stop] = delta
        group.all_reduce(full, "sum")
        delta = full[start:stop]
    if delta is not grad:
        grad.copy_(delta if baseline is None else baseline + delta)
