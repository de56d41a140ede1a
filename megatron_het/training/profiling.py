"""Megatron-LM's ``--profile`` with ``--use-pytorch-profiler``: torch.profiler over a window of
iterations on chosen ranks.

The window is iterations ``--profile-step-start`` to ``--profile-step-end - 1`` as the log
numbers them; each rank in ``--profile-ranks`` runs ``torch.profiler.profile`` over exactly
those iterations (CPU operators, and the CUDA kernels on a GPU, one ``ProfilerStep#N`` span per
iteration) and writes its trace with ``tensorboard_trace_handler`` into ``--tensorboard-dir``
as ``rank<R>.<pid>.<time>.pt.trace.json``, the Chrome trace that TensorBoard's profiler plugin,
``chrome://tracing`` and Perfetto open. Ranks outside the window's list record nothing. The
directory is checked before training (created and written to on every rank), so a bad path is
one line, not a lost trace at the end.
"""

from __future__ import annotations

import os
import pathlib
import warnings
from typing import Any

import torch

from megatron_het.config import ProfileConfig
from megatron_het.errors import UserError


def check_profile(profile: ProfileConfig, world_size: int | None, directory: str | None) -> None:
    """Before training: UserError (one line) naming ``--profile-ranks`` entries outside a world
    of ``world_size`` ranks, or a trace ``directory`` (``--tensorboard-dir``) that cannot be
    created and written (``world_size`` None: a dry run, nothing checked or created)."""
    if not profile.enabled or world_size is None:
        return
    outside = [rank for rank in profile.ranks if rank >= world_size]
    if outside:
        raise UserError(
            f"--profile-ranks {' '.join(map(str, outside))} outside the world of "
            f"{world_size} rank(s); profile ranks 0 to {world_size - 1}"
        )
    if directory is not None:
        _writable(pathlib.Path(directory))


def _writable(directory: pathlib.Path) -> None:
    """Create ``directory`` and write a probe into it; UserError (one line) when it cannot."""
    probe = directory / f".profile-probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(
            f"--tensorboard-dir {directory}: cannot write the profiler's trace there "
            f"({exc.strerror or type(exc).__name__}); pass a writable directory"
        ) from None


class IterationProfiler:
    """torch.profiler over the configured window on this rank (see the module doc).

    :meth:`begin` before running iteration ``i``, :meth:`end` after it; :meth:`close` stops a
    profile the run left early (its trace is still written). ``say`` receives one line per
    trace written."""

    def __init__(
        self,
        profile: ProfileConfig,
        rank: int,
        device: torch.device,
        directory: str | None,
        say: Any = print,
    ) -> None:
        self.profile, self.rank, self.device, self.say = profile, rank, device, say
        self.active = profile.enabled and profile.use_pytorch_profiler and rank in profile.ranks
        self.directory = pathlib.Path(directory) if directory is not None else None
        self._profiler: Any = None
        self._first = 0
        if self.active:
            assert self.directory is not None  # profile_config requires --tensorboard-dir

    def begin(self, iteration: int) -> None:
        """Start recording if ``iteration`` is the window's first (or the run resumed inside
        the window)."""
        window = range(self.profile.step_start, self.profile.step_end)
        if not self.active or self._profiler is not None or iteration not in window:
            return
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._first = iteration
        # A schedule of the window's iterations, all recorded: each gets its ProfilerStep#N
        # span, and the trace is written after the last (or by close()).
        active = self.profile.step_end - iteration
        self._profiler = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=0, active=active, repeat=1),
            on_trace_ready=tensorboard_trace_handler(
                str(self.directory), worker_name=f"rank{self.rank}.{os.getpid()}"
            ),
            record_shapes=True,
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*warmup.*")
            self._profiler.start()

    def end(self, iteration: int) -> None:
        """Mark ``iteration``'s end; after the window's last, write the trace."""
        if self._profiler is None:
            return
        self._profiler.step()
        if iteration >= self.profile.step_end - 1:
            self._stop(iteration)

    def close(self, iteration: int) -> None:
        """Write the trace of a window the run left before its end (at ``iteration``)."""
        if self._profiler is not None:
            self._stop(iteration)

    def _stop(self, iteration: int) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self.say(
            f" rank {self.rank}: torch.profiler trace of iterations {self._first}-{iteration} "
            f"written to {self.directory}"
        )
