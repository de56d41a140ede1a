"""Megatron-LM's ``--profile`` without ``--use-pytorch-profiler``: the run's own timeline of
the window's iterations, every profiled rank on one Chrome trace, the predicted schedule beside.

Each rank in ``--profile-ranks`` switches its :class:`~megatron_het.trace.recorder.Recorder`
on for iterations ``--profile-step-start`` to ``--profile-step-end - 1``: the iteration, each
forward and backward (micro-batch, chunk), each transfer step's post and wait (with the peers),
each collective of a process group (TP, DP, the world; across kinds through the bridge), the
DP gradient sync, the optimizer step, the tied-embedding sum and the metrics gather (where a
fast rank waits for the slowest). After the window's last iteration every rank meets in
:meth:`TimelineProfiler.finish` (collective over the world):

1. a world barrier, then each rank reads its host clock: ranks of one host share the clock
   (``perf_counter``); another host's spans are shifted by the difference of its first rank's
   reading and the merging rank's (as close as the barrier's exit, well under a millisecond
   on a LAN);
2. each profiled rank sends its spans to the logging rank (point to point, as JSON bytes),
   which merges them, so the line naming the file is in the run's log;
3. the merging rank adds the predictor's schedule of the plan (the iteration simulated at
   the predicted stage times) beside each rank, placed at each measured iteration's start,
   and writes ``timeline_iters<A>-<B>.json`` into ``--tensorboard-dir``
   (:mod:`megatron_het.trace.chrome`).
"""

from __future__ import annotations

import json
import pathlib
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from megatron_het.errors import UserError
from megatron_het.pipeline.timing import synchronize_stream
from megatron_het.trace.chrome import RankTrack, TraceInfo, chrome_trace, write_trace
from megatron_het.trace.recorder import Span
from megatron_het.training.trainer import logging_rank

_TAG = 7301  # the spans' point-to-point messages to the merging rank
CLOCK = (
    "host perf_counter per host; hosts aligned at a world barrier after the window"
    " (ranks of one host share the clock)"
)


def host_id() -> str:
    """This host's identity for clock sharing: its name and boot id (one monotonic clock)."""
    try:
        boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class TimelineProfiler:
    """The window's recorder on this rank and its merge into one trace (see the module
    docstring). ``trainer``: this rank's :class:`~megatron_het.training.trainer.Trainer`;
    ``predict``: the predictor's figures for the run's plan (None, or a UserError from it:
    the trace has no predicted tracks and says why); ``say`` takes the line naming the file.

    :meth:`begin` before iteration ``i``, :meth:`end` after it; every rank runs the same
    calls, so :meth:`finish` (collective) runs on all of them at the same iteration."""

    def __init__(self, trainer: Any, predict: Callable[[], Any] | None, say: Any = print) -> None:
        profile = trainer.setup.train.profile
        self.trainer, self.predict, self.say = trainer, predict, say
        self.enabled = profile.enabled and not profile.use_pytorch_profiler
        self.window = range(profile.step_start, profile.step_end)
        self.ranks = profile.ranks
        self.rank = trainer.groups.rank
        self.merger = logging_rank(trainer.setup.plan)
        self.recording = self.enabled and self.rank in self.ranks
        self.directory = trainer.setup.train.tensorboard_dir
        self.iterations: list[int] = []
        self.finished = False
        self.written: pathlib.Path | None = None  # on the merging rank

    def begin(self, iteration: int) -> None:
        """Start the window at its first iteration (or at a resumed run's first inside it)."""
        if not self.enabled or self.iterations or iteration not in self.window:
            return
        self.iterations.append(iteration)
        if self.recording:
            device = self.trainer.device
            sync = None if device.type == "cpu" else (lambda: synchronize_stream(device))
            self.trainer.recorder.start(sync)

    def end(self, iteration: int) -> None:
        """Count ``iteration``; after the window's last, :meth:`finish`."""
        if not self.iterations or self.finished:
            return
        if iteration != self.iterations[-1]:
            self.iterations.append(iteration)
        if iteration >= self.window[-1]:
            self.finish()

    def finish(self) -> None:
        """Merge and write the window's trace (collective over the world; a no-op when the
        window never started or is written)."""
        if not self.iterations or self.finished:
            return
        self.finished = True
        spans = self.trainer.recorder.stop() if self.recording else []
        world = self.trainer.groups.world
        world.barrier()
        reading = time.perf_counter()
        mine = {"rank": self.rank, "host": host_id(), "clock": reading}
        mine["spans"] = [s.to_dict() for s in spans]
        parts = self._gather(mine)
        if self.rank == self.merger:
            self.written = self._write(parts)
            ranks = ", ".join(map(str, sorted(self.ranks)))
            self.say(
                f" timeline of iterations {self.iterations[0]}-{self.iterations[-1]} "
                f"(rank{'s' if len(self.ranks) > 1 else ''} {ranks}) written to {self.written}"
            )

    def stop(self) -> None:
        """Stop recording without merging (a run leaving on a failure: no collective)."""
        if self.recording and self.trainer.recorder.active:
            self.trainer.recorder.stop()

    # -- merge ------------------------------------------------------------------------------
    def _gather(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """The merging rank: every profiled rank's part (its own included); others send."""
        world, device = self.trainer.groups.world, self.trainer.device
        if self.rank != self.merger:
            if self.recording:
                data = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8)
                size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
                world.send(size, self.merger, tag=_TAG)
                world.send(data.to(device), self.merger, tag=_TAG)
            return []
        parts = [mine] if self.recording else []
        for rank in sorted(r for r in self.ranks if r != self.merger):
            size = torch.zeros(1, dtype=torch.int64, device=device)
            world.recv(size, rank, tag=_TAG)
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
            world.recv(data, rank, tag=_TAG)
            parts.append(json.loads(bytes(data.cpu().numpy()).decode()))
        if not self.recording:  # the merger's clock reading still anchors the hosts
            parts.append({**mine, "spans": None})
        return parts

    def _write(self, parts: list[dict[str, Any]]) -> pathlib.Path:
        reference = next(p for p in parts if p["rank"] == self.merger)["clock"]
        first_reading: dict[str, float] = {}
        for part in sorted(parts, key=lambda p: p["rank"]):
            first_reading.setdefault(part["host"], part["clock"])
        setup = self.trainer.setup
        tracks = []
        for part in parts:
            if part["spans"] is None:
                continue
            shift = reference - first_reading[part["host"]]
            spans = [_shifted(Span.from_dict(d), shift) for d in part["spans"]]
            tracks.append(_track(setup, part["rank"], spans))
        prediction, notes = self._prediction()
        if prediction is not None:
            tracks = _with_predicted(tracks, prediction)
        info = TraceInfo(
            iterations=tuple(self.iterations),
            clock=CLOCK,
            prediction=None if prediction is None else prediction.to_dict(),
            notes=tuple(notes),
        )
        assert self.directory is not None  # profile_config requires --tensorboard-dir
        first, last = self.iterations[0], self.iterations[-1]
        path = pathlib.Path(self.directory) / f"timeline_iters{first}-{last}.json"
        return write_trace(chrome_trace(tracks, info), path)

    def _prediction(self) -> tuple[Any, list[str]]:
        if self.predict is None:
            return None, ["no prediction was asked for"]
        try:
            return self.predict(), []
        except UserError as error:
            return None, [f"no predicted tracks: {error}"]


def _shifted(span: Span, shift: float) -> Span:
    if not shift:
        return span
    return Span(span.name, span.category, span.start_s + shift, span.end_s + shift, span.args)


def _track(setup: Any, rank: int, spans: list[Span]) -> RankTrack:
    info = setup.cluster.rank_info(rank)
    node = setup.cluster.nodes()[info.node]
    role = setup.plan.rank_role(rank)
    groups = ", ".join(node.groups)
    return RankTrack(
        rank=rank,
        node=info.node,
        node_label=f"node {info.node} ({groups})",
        kind=info.accelerator.label,
        pipeline=role.pipeline,
        stages=tuple(role.chunks),
        tp_rank=role.tp_rank,
        tp=role.stage_plan.tp,
        spans=tuple(spans),
    )


def _with_predicted(tracks: list[RankTrack], prediction: Any) -> list[RankTrack]:
    """Each track with the predicted iteration placed at each measured iteration's start (the
    earliest rank's)."""
    from megatron_het.perf.predicted_timeline import predicted_spans

    predicted = predicted_spans(prediction)
    starts: dict[int, float] = {}
    for track in tracks:
        for span in track.spans:
            if span.category == "iteration":
                number = int(span.args["iteration"])
                starts[number] = min(starts.get(number, span.start_s), span.start_s)
    out = []
    for track in tracks:
        placed = [
            Span(s.name, s.category, base + s.start_s, base + s.end_s, {**s.args, "iteration": n})
            for n, base in sorted(starts.items())
            for s in predicted.get(track.rank, [])
        ]
        out.append(replace(track, predicted=tuple(placed)))
    return out
