"""Run one rank's pipeline schedule: forwards, backwards and stage-boundary transfers.

The schedule (:mod:`megatron_het.pipeline.schedules`, 1F1B by default) is a list of steps per
stage; every TP rank of a stage runs its stage's list, so their TP collectives line up. A
compute step runs the stage's forward or backward for one micro-batch; a transfer step (a single
transfer or a :class:`~megatron_het.pipeline.schedules.P2PBatch`) posts all its point-to-point
ops in ONE ``batch_isend_irecv`` over the pipeline's group and waits for all of them before the
next step. Who exchanges with whom across a TP change, the wire dtype and the receive-buffer pool
are described in :mod:`megatron_het.pipeline.stage_boundary`.

Interleaved pipelines: a rank of a device group runs several model chunks (its stage holds
all their layers, :class:`~megatron_het.model.llama.LlamaModel` ``chunks``) with the
interleaved 1F1B schedule, whose actions name the chunk (global stage) they belong to; the
in-flight tensors are kept per (stage, micro-batch). With ``overlap_p2p`` (the default, as
Megatron-LM's ``--overlap-p2p-communication``) its exchanges are posted without waiting
(:func:`~megatron_het.pipeline.schedules.overlap_transfers`): a ``P2PPost`` issues the batch
and keeps its handles, the matching ``P2PWait`` waits for them just before the compute that
reads what they receive, so the transfers run while the other direction's compute does.
Evaluation (forward only) runs the micro-batches one after the other through all chunks.

Numerics: the last stage scales each micro-batch's token-mean loss by ``loss_scale`` (1/total
micro-batches over all pipelines, per the numerics contract) before backward, so gradients
accumulate into ``.grad`` exactly as in single-process accumulation. After the last backward,
:meth:`PipelineExecutor.run` sums the tied-embedding gradient copies of the first and last stage
(:func:`sync_tied_embedding_grads`, exchanging only the gradient this call added, so several
calls may accumulate into ``.grad``); the data-parallel gradient sum is left to the optimizer.

Timing (per rank, per call): ``compute_s`` covers the forward and backward regions (including
whatever the optional region timer adds: the executor enters ``region_timer.timed_region(key)``
around every compute region, with the region's :func:`compute_region_key`; see
:class:`RegionTimer`),
``p2p_wait_s`` the transfer steps (posting and waiting), ``bubble_s = wall - compute - p2p``
(bookkeeping between steps). A rank cannot tell a slow link from a peer stage that has not
reached the matching step yet, so the pipeline's fill/drain idle time (the classic "bubble")
is spent blocked in transfers and lands in ``p2p_wait_s``; compare ``p2p_wait_s + bubble_s``
with a model's p2p + bubble time. On GPUs the regions are timed by CUDA events read once per
call (:mod:`megatron_het.pipeline.timing`), so no region waits for the device; a region timer
(CPU emulation) gets a synchronised device instead.

Precision: the stage computes in its parameters' dtype (bf16 under mixed precision: the
optimizer holds the float32 masters and main gradients), and boundary tensors travel in it.

Shape legend: b micro-batch size, s sequence length, H hidden size.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Hashable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatron_het.config import ModelConfig
from megatron_het.kernels.main_grad import accumulated_grad
from megatron_het.model.llama import LlamaModel
from megatron_het.parallel.process_groups import ProcessGroups
from megatron_het.parallel.sequence import local_positions
from megatron_het.pipeline.actions import _actions_of
from megatron_het.pipeline.schedules import (
    SCHEDULES,
    Action,
    ActionKind,
    P2PPost,
    P2PWait,
    Step,
    gpipe,
    interleaved_one_f_one_b,
    sequential_forward,
)
from megatron_het.pipeline.stage_boundary import (
    BufferPool,
    boundary_peers,
    place_received,
    sync_tied_embedding_grads,
    tied_embedding_weight,
    transfer_ops,
)
from megatron_het.pipeline.timing import RegionClock, synchronize_stream

__all__ = [
    "PipelineExecutor",
    "RegionTimer",
    "StageStats",
    "compute_region_key",
    "sync_tied_embedding_grads",
]

_FORWARD_KINDS = (ActionKind.RECV_FORWARD, ActionKind.FORWARD, ActionKind.SEND_FORWARD)
MicroBatch = tuple[torch.Tensor, torch.Tensor]


def compute_region_key(kind: str, forward_only: bool, chunk: int = 0) -> tuple[str, bool, int]:
    """The region timer's key of a stage's ``kind`` ("forward" or "backward") region of local
    model ``chunk``: every micro-batch's forward (backward) of a chunk is the same work, and so
    is every evaluation forward (``forward_only``)."""
    return (kind, forward_only, chunk)


class RegionTimer(Protocol):
    """A hook around every compute region of the executor (CPU emulation pads regions to an
    emulated kind's time with one). The region's work runs inside the returned context and the
    device is synchronised before it exits; the time the context takes counts as compute."""

    def timed_region(self, key: Hashable) -> AbstractContextManager[None]:
        """A context around one compute region; ``key`` (:func:`compute_region_key`) is the
        same for regions that do the same work."""


@dataclass(frozen=True)
class StageStats:
    """What one :meth:`PipelineExecutor.run` did on this rank.

    ``loss_sum``: sum over micro-batches of their token-mean loss (unscaled), on every TP rank
    of the last stage; 0.0 on other stages. Times in seconds (see the module docstring);
    ``wall_s`` is the schedule's wall time (= compute + p2p + bubble), ``embedding_sync_s`` the
    tied-embedding gradient sum after it (not part of ``wall_s``).
    """

    loss_sum: float
    compute_s: float
    p2p_wait_s: float
    bubble_s: float
    num_micro_batches: int
    wall_s: float = 0.0
    embedding_sync_s: float = 0.0


Key = tuple[int, int]  # (global stage, micro-batch)


@dataclass
class _Run:
    """Per-call state: tensors of (stage, micro-batch) in flight and accumulated times."""

    micro_batches: Sequence[MicroBatch]
    loss_scale: float
    forward_only: bool
    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # stage inputs
    input_buffers: dict[Key, torch.Tensor] = field(default_factory=dict)  # their storage
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # hidden or loss
    output_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # received buffers
    input_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # to send back
    posted: dict[tuple[Action, ...], _Posted] = field(default_factory=dict)  # not waited on
    loss_sum: torch.Tensor | None = None


@dataclass
class _Posted:
    """A transfer step in flight: its handles (which keep the sent tensors alive), the receive
    buffers to file by (kind, key) once done, and the received pieces to place."""

    handles: list
    received: list[tuple[ActionKind, Key, torch.Tensor]]
    places: list[tuple[torch.Tensor, torch.Tensor]]
    transfers: str = ""  # what the step moves, for the recorded spans' names


class PipelineExecutor:
    """Runs the schedule of one rank's stage over the micro-batches of its pipeline.

    Args:
        stage: this rank's stage (:func:`~megatron_het.pipeline.stage.build_stage`).
        groups: this rank's process groups (transfers use ``groups.pipeline``).
        model_config: the model's shape (for the hidden size of the transfers).
        seq_length, micro_batch_size: every micro-batch is ``[micro_batch_size, seq_length]``;
            boundary tensors are ``[b, s, H]`` in the parameters' dtype (``[b, s/tp, H]`` on a
            sequence-parallel stage).
        region_timer: entered around every compute region (:class:`RegionTimer`; None: none).
        schedule: a name of :data:`~megatron_het.pipeline.schedules.SCHEDULES` ("1f1b",
            "gpipe").
        overlap_p2p: an interleaved pipeline overlaps its transfers with compute (see the
            module docstring); plain pipelines always wait for each exchange, as Megatron-LM.
    """

    def __init__(
        self,
        stage: LlamaModel,
        groups: ProcessGroups,
        model_config: ModelConfig,
        seq_length: int,
        micro_batch_size: int,
        region_timer: RegionTimer | None = None,
        schedule: str = "1f1b",
        overlap_p2p: bool = True,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(
                f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}"
            )
        self.stage, self.groups, self.config = stage, groups, model_config
        self.region_timer, self.schedule, self.overlap_p2p = region_timer, schedule, overlap_p2p
        role = groups.role
        pipeline = groups.plan.pipelines[role.pipeline]
        self.stage_index = role.stage  # the device group (= its first stage)
        self.chunks = role.chunks  # the global stages this rank runs
        self.num_stages = pipeline.num_stages
        self.num_groups, self.num_chunks = pipeline.pp_size, pipeline.num_chunks
        self.is_first, self.is_last = role.is_first_stage, role.is_last_stage
        self.peers = boundary_peers(groups.plan, groups.rank, seq_length)
        first_param = next(stage.parameters())
        self.device = first_param.device
        self.micro_batch_shape = (micro_batch_size, seq_length)
        start, stop = local_positions(groups.plan, role.stage_plan, role.tp_rank, seq_length)
        self.boundary_shape = (micro_batch_size, stop - start, model_config.hidden_size)
        self.pool = BufferPool(self.device)
        self.clock = RegionClock(self.device)
        self.recorder = groups.comm.recorder  # records the steps while a profile records

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype of boundary tensors: the stage's parameters' (read per call, since the
        optimizer moves the parameters into its training-dtype buffers)."""
        return next(self.stage.parameters()).dtype

    # -- public -----------------------------------------------------------------------------
    def steps(self, num_micro_batches: int, forward_only: bool = False) -> list[Step]:
        """This rank's steps: the named schedule (interleaved 1F1B for an interleaved
        pipeline), or for ``forward_only`` the forward half of GPipe (interleaved: each
        micro-batch through every chunk in turn)."""
        if self.num_chunks > 1:
            if forward_only:
                return sequential_forward(
                    self.num_groups, self.num_chunks, num_micro_batches, self.stage_index
                )
            if self.schedule != "1f1b":
                raise ValueError(
                    f"an interleaved pipeline runs the 1f1b schedule, not {self.schedule!r}"
                )
            return interleaved_one_f_one_b(
                self.num_groups,
                self.num_chunks,
                num_micro_batches,
                self.stage_index,
                self.overlap_p2p,
            )
        if forward_only:
            return [
                s
                for s in gpipe(self.num_stages, num_micro_batches, self.stage_index)
                if isinstance(s, Action) and s.kind in _FORWARD_KINDS
            ]
        return SCHEDULES[self.schedule](self.num_stages, num_micro_batches, self.stage_index)

    def run(
        self,
        micro_batches: Sequence[MicroBatch],
        loss_scale: float,
        forward_only: bool = False,
        grads_zeroed: bool = False,
    ) -> StageStats:
        """Run every micro-batch of this pipeline through this stage.

        ``micro_batches``: ``(tokens[b, s], labels[b, s])`` pairs, the same list on every rank
        of the pipeline (the first stage reads tokens, the last labels). Side effects: adds
        into the parameters' ``.grad`` (unless ``forward_only``; never zeroes them) and, with
        tied embeddings, sums the two embedding copies' gradients over ``groups.embedding``.
        ``grads_zeroed``: the gradients were zeroed after the last run (the trainer does so
        every iteration), so all of the tied embedding's gradient is this run's; otherwise a
        copy of what an earlier run summed is kept, to exchange only the rest.
        Collective over the pipeline (and the embedding group): all its ranks must call it.
        """
        if not micro_batches:
            raise ValueError("run needs at least one micro-batch")
        self._check_shapes(micro_batches)
        run = _Run(micro_batches, loss_scale, forward_only)
        tied = tied_embedding_weight(self.stage, self.groups)
        # Gradient already in .grad was summed by an earlier run: exchange only this run's part.
        grad = None if tied is None or forward_only or grads_zeroed else accumulated_grad(tied)
        baseline = None if grad is None else grad.clone()
        self.clock.start()
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            for step in self.steps(len(micro_batches), forward_only):
                if isinstance(step, Action) and step.kind is ActionKind.FORWARD:
                    self._forward(run, self._key(step))
                elif isinstance(step, Action) and step.kind is ActionKind.BACKWARD:
                    self._backward(run, self._key(step))
                elif isinstance(step, P2PPost):
                    run.posted[step.actions] = self._post(run, step.actions)
                elif isinstance(step, P2PWait):
                    self._wait(run, run.posted.pop(step.actions))
                else:
                    self._wait(run, self._post(run, _actions_of(step)))
        times, wall = self.clock.totals()
        compute_s, p2p_s = times.get("compute", 0.0), times.get("p2p", 0.0)
        sync_s = 0.0
        if not forward_only:
            sync_start = time.perf_counter()
            with self.recorder.span("tied-embedding sync", "step"):
                sync_tied_embedding_grads(self.stage, self.groups, baseline)
                # A device backend's wait only queues the reduction; the loss read below
                # waits for the stream anyway, so waiting here costs nothing and times it.
                synchronize_stream(self.device)
            sync_s = time.perf_counter() - sync_start
        loss = 0.0 if run.loss_sum is None else float(run.loss_sum)
        return StageStats(
            loss_sum=loss,
            compute_s=compute_s,
            p2p_wait_s=p2p_s,
            bubble_s=max(0.0, wall - compute_s - p2p_s),
            num_micro_batches=len(micro_batches),
            wall_s=wall,
            embedding_sync_s=sync_s,
        )

    # -- steps ------------------------------------------------------------------------------
    def _check_shapes(self, micro_batches: Sequence[MicroBatch]) -> None:
        want = self.micro_batch_shape
        for i, (tokens, labels) in enumerate(micro_batches):
            used = ([tokens] if self.is_first else []) + ([labels] if self.is_last else [])
            for tensor in used:
                if tuple(tensor.shape) != want:
                    raise ValueError(
                        f"micro-batch {i} has shape {tuple(tensor.shape)}; this "
                        f"executor expects [micro_batch_size, seq_length] = "
                        f"{list(want)}"
                    )

    def _key(self, action: Action) -> Key:
        """(global stage, micro-batch) of an action (stage None: this rank's only stage)."""
        stage = self.stage_index if action.stage is None else action.stage
        return stage, action.micro_batch

    @contextlib.contextmanager
    def _compute_region(self, run: _Run, kind: str, key: Key) -> Iterator[None]:
        stage, mb = key
        chunk = self.chunks.index(stage)
        name = ("eval " if run.forward_only else "") + f"{kind} mb{mb}"
        name += f" c{chunk}" if self.num_chunks > 1 else ""
        span = self.recorder.span(name, "compute", stage=stage, micro_batch=mb, chunk=chunk)
        if self.region_timer is None:
            with span, self.clock.region("compute"):
                yield
            return
        timed = self.region_timer.timed_region(compute_region_key(kind, run.forward_only, chunk))
        with span, self.clock.region("compute"), timed:
            yield
            synchronize_stream(self.device)  # the timer reads the host clock

    def _forward(self, run: _Run, key: Key) -> None:
        stage, mb = key
        first, last = stage == 0, stage == self.num_stages - 1
        chunk = self.chunks.index(stage)
        tokens, labels = run.micro_batches[mb]
        with self._compute_region(run, "forward", key):
            x = tokens.to(self.device) if first else self._stage_input(run, key)
            if last:
                out = self.stage(x, labels=labels.to(self.device), chunk=chunk)
                loss = out.detach().float()
                run.loss_sum = loss if run.loss_sum is None else run.loss_sum + loss
                out = out * run.loss_scale
            else:
                out = self.stage(x, chunk=chunk)
            run.outputs[key] = out
        if run.forward_only and not first:  # no backward will need the input
            del run.inputs[key]
            if key in run.input_buffers:
                self.pool.release(run.input_buffers.pop(key))

    def _stage_input(self, run: _Run, key: Key) -> torch.Tensor:
        """The received activations of ``key`` as a leaf (sharing the buffer's storage until
        backward)."""
        buffer = run.input_buffers[key]
        x = buffer.detach()
        x.requires_grad_(not run.forward_only)
        run.inputs[key] = x
        return x

    def _backward(self, run: _Run, key: Key) -> None:
        stage = key[0]
        with self._compute_region(run, "backward", key):
            out = run.outputs.pop(key)
            if stage == self.num_stages - 1:
                torch.autograd.backward(out)
            else:
                grad_buffer = run.output_grads.pop(key)
                torch.autograd.backward(out, grad_buffer.to(out.dtype))
                self.pool.release(grad_buffer)
            if stage > 0:
                x = run.inputs.pop(key)
                assert x.grad is not None  # the stage's output depends on its input
                run.input_grads[key] = x.grad
                if key in run.input_buffers:
                    self.pool.release(run.input_buffers.pop(key))

    def _post(self, run: _Run, actions: Sequence[Action]) -> _Posted:
        """Issue the point-to-point ops of ``actions`` (one batch) without waiting for them."""
        ops, places = [], []
        received: list[tuple[ActionKind, Key, torch.Tensor]] = []
        for action in actions:
            key, payload, buffer = self._key(action), None, None
            if action.kind is ActionKind.SEND_FORWARD:
                payload = run.outputs[key].detach().to(self.wire_dtype).contiguous()
                if run.forward_only:
                    del run.outputs[key]
            elif action.kind is ActionKind.SEND_BACKWARD:
                payload = run.input_grads.pop(key).to(self.wire_dtype).contiguous()
            else:
                buffer = self.pool.acquire(self.boundary_shape, self.wire_dtype)
                received.append((action.kind, key, buffer))
            action_ops, action_places = transfer_ops(action, self.peers, payload, buffer)
            ops += action_ops
            places += action_places
        recording = self.recorder.active
        transfers = self._describe(actions) if recording else ""
        details = self._details(actions) if recording else []
        with self.recorder.span(f"post {transfers}", "p2p", transfers=details):
            with self.clock.region("p2p"):
                handles = self.groups.pipeline.batch_isend_irecv(ops) if ops else []
        return _Posted(handles, received, places, transfers)

    def _wait(self, run: _Run, posted: _Posted) -> None:
        """Wait for a posted batch and file what it received."""
        with self.recorder.span(f"wait {posted.transfers}", "p2p"), self.clock.region("p2p"):
            for handle in posted.handles:
                handle.wait()
            place_received(posted.places)
        for kind, key, buffer in posted.received:
            if kind is ActionKind.RECV_FORWARD:
                run.input_buffers[key] = buffer
            else:
                run.output_grads[key] = buffer

    def _describe(self, actions: Sequence[Action]) -> str:
        """A transfer step's short name: "send fwd mb3 + recv bwd mb1" (chunks named)."""
        words = []
        for action in actions:
            stage, mb = self._key(action)
            chunk = f" c{self.chunks.index(stage)}" if self.num_chunks > 1 else ""
            words.append(f"{_SHORT[action.kind]} mb{mb}{chunk}")
        return " + ".join(words)

    def _details(self, actions: Sequence[Action]) -> list[dict]:
        """A transfer step's actions for its recorded span: kind, global stage, micro-batch
        and the peer ranks of its messages."""
        return [
            {
                "kind": action.kind.value,
                "stage": self._key(action)[0],
                "micro_batch": action.micro_batch,
                "peers": [piece.peer for piece in self.peers.for_action(action)],
            }
            for action in actions
        ]


_SHORT = {
    ActionKind.SEND_FORWARD: "send fwd",
    ActionKind.RECV_FORWARD: "recv fwd",
    ActionKind.SEND_BACKWARD: "send bwd",
    ActionKind.RECV_BACKWARD: "recv bwd",
}
