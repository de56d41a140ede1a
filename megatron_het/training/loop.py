"""The run's cadence: iterate, evaluate, save and stop, identically on every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_het.training.checkpointing import CheckpointSaver
from megatron_het.training.profiling import IterationProfiler
from megatron_het.training.stop import StopRequest
from megatron_het.training.timeline import TimelineProfiler
from megatron_het.training.trainer import Trainer, evaluate, train_step


def train(
    trainer: Trainer,
    stop: StopRequest,
    saver: CheckpointSaver | None = None,
    predict: Callable[[], Any] | None = None,
) -> str:
    """Iterate to ``--train-iters`` on every rank; returns why it stopped ("done",
    "exit-interval", the signal's name or "stop requested by another rank").

    Evaluates every ``--eval-interval`` and at the end; saves every ``--save-interval``, on
    ``--exit-interval``, on a stop request and at the end (each iteration at most once). Every
    decision is identical on every rank (the stop request is agreed in the iteration's gather).
    With ``--async-save`` each iteration ends with the saver's check (one all-reduce while a
    background save is pending, which commits it once every rank has written it), and a pending
    save is committed before this returns. ``saver`` defaults to the run's
    :class:`CheckpointSaver`; it is closed on the way out (an uncommitted save is abandoned).
    ``--profile``'s window is recorded by torch.profiler (``--use-pytorch-profiler``) or by the
    run's own timeline, whose trace carries ``predict()``'s schedule beside the measured one.
    """
    saver = saver or CheckpointSaver(trainer)
    profiler = _profiler(trainer)
    timeline = TimelineProfiler(trainer, predict, _say(trainer))
    try:
        reason = _iterate(trainer, stop, saver, (profiler, timeline))
        timeline.finish()  # a window the run left early (every rank stops alike)
        trainer.optimizer.params_ready()  # the last step's --overlap-param-gather
        saver.finish()
        if reason != "done":
            trainer.print(f" stopping after iteration {trainer.progress.iteration} ({reason})")
        return reason
    finally:
        profiler.close(trainer.progress.iteration)
        timeline.stop()
        saver.close()


def _say(trainer: Trainer) -> Callable[[str], None]:
    """Where a profiler's lines go: the log, or standard output on a rank that does not log."""

    def say(line: str) -> None:
        if trainer.logger is not None:
            trainer.print(line)
        else:
            print(line, flush=True)

    return say


def _profiler(trainer: Trainer) -> IterationProfiler:
    """``--profile --use-pytorch-profiler``'s torch.profiler on this rank."""
    train = trainer.setup.train
    return IterationProfiler(
        train.profile, trainer.groups.rank, trainer.device, train.tensorboard_dir, _say(trainer)
    )


def _iterate(
    trainer: Trainer,
    stop: StopRequest,
    saver: CheckpointSaver,
    profilers: tuple[IterationProfiler, TimelineProfiler],
) -> str:
    train_config = trainer.setup.train
    evaluated = saved = -1
    while trainer.progress.iteration < train_config.train_iters:
        for profiler in profilers:
            profiler.begin(trainer.progress.iteration + 1)
        stopping = train_step(trainer, stop.requested)
        for profiler in profilers:
            profiler.end(trainer.progress.iteration)
        saver.poll()
        current = trainer.progress.iteration
        if current % train_config.eval_interval == 0:
            evaluate(trainer)
            evaluated = current
        if train_config.save_interval and current % train_config.save_interval == 0:
            saver.save()
            saved = current
        reason = (
            "exit-interval"
            if train_config.exit_interval and current % train_config.exit_interval == 0
            else (stop.reason or "stop requested by another rank")
            if stopping
            else ""
        )
        if reason:
            if saved != current and saver.save() is None:
                trainer.print(" no --save directory: stopping without a checkpoint")
            return reason
    if evaluated != trainer.progress.iteration:
        evaluate(trainer)
    if saved != trainer.progress.iteration:
        saver.save()
    return "done"
