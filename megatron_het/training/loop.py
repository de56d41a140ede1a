"""The run's cadence: iterate, evaluate, save and stop, identically on every rank."""

from __future__ import annotations

from megatron_het.training.checkpointing import CheckpointSaver
from megatron_het.training.profiling import IterationProfiler
from megatron_het.training.stop import StopRequest
from megatron_het.training.trainer import Trainer, evaluate, train_step


def train(trainer: Trainer, stop: StopRequest, saver: CheckpointSaver | None = None) -> str:
    """Iterate to ``--train-iters`` on every rank; returns why it stopped ("done",
    "exit-interval", the signal's name or "stop requested by another rank").

    Evaluates every ``--eval-interval`` and at the end; saves every ``--save-interval``, on
    ``--exit-interval``, on a stop request and at the end (each iteration at most once). Every
    decision is identical on every rank (the stop request is agreed in the iteration's gather).
    With ``--async-save`` each iteration ends with the saver's check (one all-reduce while a
    background save is pending, which commits it once every rank has written it), and a pending
    save is committed before this returns. ``saver`` defaults to the run's
    :class:`CheckpointSaver`; it is closed on the way out (an uncommitted save is abandoned).
    """
    saver = saver or CheckpointSaver(trainer)
    profiler = _profiler(trainer)
    try:
        reason = _iterate(trainer, stop, saver, profiler)
        trainer.optimizer.params_ready()  # the last step's --overlap-param-gather
        saver.finish()
        if reason != "done":
            trainer.print(f" stopping after iteration {trainer.progress.iteration} ({reason})")
        return reason
    finally:
        profiler.close(trainer.progress.iteration)
        saver.close()


def _profiler(trainer: Trainer) -> IterationProfiler:
    """``--profile``'s recorder on this rank; its lines go to the log (or, on a rank that
    does not log, to standard output)."""
    train = trainer.setup.train

    def say(line: str) -> None:
        if trainer.logger is not None:
            trainer.print(line)
        else:
            print(line, flush=True)

    return IterationProfiler(
        train.profile, trainer.groups.rank, trainer.device, train.tensorboard_dir, say
    )


def _iterate(
    trainer: Trainer, stop: StopRequest, saver: CheckpointSaver, profiler: IterationProfiler
) -> str:
    train_config = trainer.setup.train
    evaluated = saved = -1
    while trainer.progress.iteration < train_config.train_iters:
        profiler.begin(trainer.progress.iteration + 1)
        stopping = train_step(trainer, stop.requested)
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
