"""Timing one forward + backward "case" the way the profiler does, and what autograd keeps.

A :class:`Case` is something to time: a ``forward()``, a ``backward(its output)``, and how to
make the record. :func:`run_cases` times several together; timing follows the work
(:func:`megatron_het.pipeline.timing.pass_timer`): on an accelerator, whose kernels the host
only enqueues, device events are recorded around each pass's forward and backward and read
after a single synchronisation at the end of the timed passes; on the CPU, the host clock.

Activation bytes (:func:`activation_bytes`) are what autograd keeps for the backward of one
forward: the distinct storages of the tensors it saves (counted through
``torch.autograd.graph.saved_tensors_hooks``, :class:`SavedActivations`), leaving out the
parameters and the tensors a stage's layers share (the RoPE tables). On CUDA the caching
allocator is asked instead: the bytes still allocated after the forward (its output included,
which stands for the layer's own saved input).

:func:`kernel_breakdown` says where one pass of a case spends its device time
(``torch.profiler``), for ``tools/profile_device.py --kernels``.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_het.pipeline.timing import EventTimer, HostTimer, pass_timer, synchronize


class SavedActivations:
    """Context manager counting the bytes autograd saves for backward inside the block.

    Distinct storages are counted once (a saved view keeps its whole storage alive). Left out:
    the storages of ``parameters`` and of ``shared`` tensors. The parameters are used as they
    are (no autocast, so no low-precision weight copies are saved). The graph must stay alive
    until the count is read.
    """

    def __init__(
        self, parameters: Iterable[torch.Tensor], shared: Iterable[torch.Tensor] = ()
    ) -> None:
        self._skip = {_storage_key(t) for t in (*parameters, *shared)}
        self._activations: dict[tuple, int] = {}
        self._hooks: contextlib.AbstractContextManager | None = None

    @property
    def nbytes(self) -> int:
        return sum(self._activations.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._skip:
            self._activations[key] = tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None, "exited before entering"
        self._hooks.__exit__(*exc)


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.untyped_storage().data_ptr())


@dataclass
class Case:
    """One thing to time: ``forward()`` and ``backward(its output)``; ``saved`` (optional)
    measures its activation bytes; ``entry(forward_s, backward_s, saved)`` makes the record."""

    forward: Callable[[], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    entry: Callable[[float, float, float], Any]
    saved: Callable[[], float] | None = None


def _one_pass(case: Case, timer: HostTimer | EventTimer) -> tuple[Any, Any, Any]:
    """Marks before the forward, between forward and backward, and after the backward."""
    start = timer.mark()
    out = case.forward()
    middle = timer.mark()
    case.backward(out)
    return start, middle, timer.mark()


def run_cases(
    cases: list[Case],
    device: torch.device,
    warmup: int,
    iters: int,
    timer: HostTimer | EventTimer | None = None,
) -> list[Any]:
    """Each case's entry from the medians of ``iters`` timed passes after ``warmup`` untimed
    ones, timed by ``timer`` (default :func:`pass_timer` of ``device``: on an accelerator, read
    after one synchronisation once every timed pass is enqueued). The timed passes go round the
    cases (one pass of each per round), so a burst of load from elsewhere falls on all of
    them."""
    for case in cases:
        for _ in range(warmup):
            case.backward(case.forward())
    saved = [case.saved() if case.saved else 0.0 for case in cases]
    timer = timer or pass_timer(device)
    marks: list[list[tuple[Any, Any, Any]]] = [[] for _ in cases]
    for _ in range(iters):
        for case, out in zip(cases, marks):
            out.append(_one_pass(case, timer))
    timer.finish()
    times = [[(timer.elapsed_s(a, b), timer.elapsed_s(b, c)) for a, b, c in m] for m in marks]
    return [
        case.entry(statistics.median(f for f, _ in t), statistics.median(b for _, b in t), s)
        for case, t, s in zip(cases, times, saved)
    ]


def activation_bytes(
    forward: Callable[[], torch.Tensor],
    parameters: list[torch.Tensor],
    shared: Iterable[torch.Tensor],
    device: torch.device,
) -> int:
    """Bytes one ``forward()`` keeps for its backward (see the module docstring)."""
    counter = SavedActivations(parameters, shared)
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
    with counter:
        out = forward()
    if device.type == "cuda":
        synchronize(device)
        kept = torch.cuda.memory_allocated(device) - before
        del out
        return max(0, kept)
    del out
    return counter.nbytes


@dataclass(frozen=True)
class KernelRow:
    """One kernel (or, on the CPU, one operator) of a breakdown: its name, launches per pass
    and device seconds per pass (self time: its own work, not its children's)."""

    name: str
    calls: float
    seconds: float


def self_time_us(event: Any, on_device: bool) -> float:
    """A ``torch.profiler`` average's own time in microseconds: on the device (its kernels'
    time; ``self_cuda_time_total`` in releases before torch 2.4) or on the CPU."""
    if not on_device:
        return event.self_cpu_time_total
    own = getattr(event, "self_device_time_total", None)
    return own if own is not None else getattr(event, "self_cuda_time_total", 0.0)


def kernel_breakdown(
    case: Case, device: torch.device, iters: int = 3, warmup: int = 1
) -> tuple[list[KernelRow], float]:
    """Where one forward + backward pass of ``case`` spends its device time, from
    ``torch.profiler`` over ``iters`` passes after ``warmup`` untimed ones: every kernel that
    ran on ``device`` (operators on the CPU), most time first, and the pass's time between
    timing marks (:func:`pass_timer`). The kernels' sum below the pass time is time the
    device sat idle (launch latency, host synchronisation)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        case.backward(case.forward())
    on_cpu = device.type == "cpu"
    activities = [ProfilerActivity.CPU] + ([] if on_cpu else [ProfilerActivity.CUDA])
    timer = pass_timer(device)
    with profile(activities=activities) as prof:
        marks = [_one_pass(case, timer) for _ in range(iters)]
        timer.finish()
    pass_s = statistics.median(timer.elapsed_s(a, c) for a, _, c in marks)
    rows = []
    for event in prof.key_averages():
        own_us = self_time_us(event, not on_cpu)
        kernel = (
            not event.key.startswith("[")
            if on_cpu
            else str(getattr(event, "device_type", "")).endswith(("CUDA", "PrivateUse1"))
        )
        if kernel and own_us > 0:
            rows.append(KernelRow(event.key, event.count / iters, own_us / 1e6 / iters))
    rows.sort(key=lambda row: row.seconds, reverse=True)
    return rows, pass_s


__all__ = [
    "Case",
    "KernelRow",
    "SavedActivations",
    "activation_bytes",
    "kernel_breakdown",
    "run_cases",
    "self_time_us",
]
