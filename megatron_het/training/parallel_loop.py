"""The parallel training loop: one rank's share of every iteration.

Numerics (what makes a parallel run equal the single-process run): iteration ``k`` reads the
same samples ``consumed_samples + i`` as single-process; its micro-batch ``j`` (0 .. total-1,
``total`` = micro-batches of all pipelines) goes to pipeline ``p`` in consecutive blocks in
pipeline order. Every micro-batch's mean loss is scaled by ``1 / total`` before backward and the
data-parallel gradient sync sums, so the summed gradient is the single-process one. The reported
loss is the sum over all micro-batches of their mean loss over ``total``: tp_rank 0 of each last
stage contributes its pipeline's sum to a world all-gather that every rank reads the same way.

The stop request (SIGTERM) rides in the same all-gather: the run stops when any rank was asked
to, so every rank saves the same iteration and exits together.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megatron_het.errors import UserError
from megatron_het.optim.lr_schedule import LRSchedule
from megatron_het.training.loop import (MicroBatch, StopRequest, get_micro_batches,
                                        run_iterations)
from megatron_het.training.metrics import TrainingLogger
from megatron_het.training.parallel_metrics import (ParallelMetrics, column, gather_rows,
                                                    scalars_of, summary_of)
from megatron_het.training.parallel_setup import ParallelSetup
from megatron_het.training.setup import SampleDataset
from megatron_het.training.state import Progress


@dataclass
class ParallelTrainer:
    """The live objects of one rank of a parallel run.

    ``groups`` is this rank's ProcessGroups, ``stage`` its slice of the model (TP applied),
    ``optimizer`` its ParallelOptimizer and ``executor`` its PipelineExecutor. ``logger`` is set
    on the logging rank only (the first rank of the last stage of pipeline 0). ``save`` writes a
    checkpoint of the current iteration (collective; None without ``--save``).
    """

    psetup: ParallelSetup
    groups: Any
    stage: torch.nn.Module
    optimizer: Any
    executor: Any
    schedule: LRSchedule
    progress: Progress
    device: torch.device
    metrics: ParallelMetrics
    logger: Optional[TrainingLogger] = None
    save: Optional[Callable[["ParallelTrainer"], Any]] = None

    def print(self, message: str) -> None:
        """A log line, printed by the logging rank only."""
        if self.logger is not None:
            self.logger.print(message)


def logging_rank(plan: Any) -> int:
    """The rank that logs: the first rank of the last stage of pipeline 0 (it has the loss)."""
    return plan.pipelines[0].stages[-1].ranks[0]


def pipeline_micro_batches(dataset: SampleDataset, first_sample: int, plan: Any, pipeline: int,
                           device: torch.device) -> list[MicroBatch]:
    """Pipeline ``pipeline``'s micro-batches of the global batch starting at ``first_sample``:
    its consecutive block, after the blocks of the pipelines before it."""
    mbs = plan.micro_batch_size
    before = sum(p.micro_batches for p in plan.pipelines[:pipeline]) * mbs
    count = plan.pipelines[pipeline].micro_batches * mbs
    return get_micro_batches(dataset, first_sample + before, count, mbs, device)


def _run_global_batch(trainer: ParallelTrainer, dataset: SampleDataset, first_sample: int,
                      forward_only: bool, stop: bool) -> tuple[float, bool, torch.Tensor]:
    """Run this rank's pipeline over its block; gather loss, stop flag and timings.

    Returns (global-batch mean loss, whether any rank asked to stop, the gathered table).
    """
    plan, role = trainer.psetup.plan, trainer.groups.role
    total = sum(p.micro_batches for p in plan.pipelines)
    batches = pipeline_micro_batches(dataset, first_sample, plan, role.pipeline, trainer.device)
    stats = trainer.executor.run(batches, loss_scale=1.0 / total, forward_only=forward_only)
    contributes = role.is_last_stage and role.tp_rank == 0
    table = gather_rows(trainer.groups.world, {
        "loss_sum": stats.loss_sum if contributes else 0.0, "stop": float(stop),
        "compute_s": stats.compute_s, "p2p_wait_s": stats.p2p_wait_s,
        "bubble_s": stats.bubble_s}, trainer.device)
    loss = float(column(table, "loss_sum").sum()) / total
    return loss, bool(column(table, "stop").max() > 0), table


def train_iteration(trainer: ParallelTrainer, stop: StopRequest) -> bool:
    """One iteration on this rank: pipeline forward/backward, DP sync, clip, step, log.

    Returns True when some rank has asked the run to stop. Raises UserError on every rank
    (before stepping) when the loss or the gradient norm is not finite.
    """
    run, progress = trainer.psetup.run, trainer.progress
    start = time.perf_counter()
    iteration = progress.iteration + 1
    # With --overlap-grad-reduce the optimizer counts this pipeline's backward passes to start
    # each bucket's DP reduction as soon as its gradients are final.
    pipeline = trainer.psetup.plan.pipelines[trainer.groups.role.pipeline]
    trainer.optimizer.zero_grad(num_micro_batches=pipeline.micro_batches
                                if run.parallel.overlap_grad_reduce else None)
    loss, stopping, table = _run_global_batch(trainer, trainer.psetup.setup.train_data,
                                              progress.consumed_samples, False, stop.requested)
    if not math.isfinite(loss):
        raise UserError(f"iteration {iteration}: the loss is {loss}; lower --lr (or use "
                        "--clip-grad) and resume from the last checkpoint")
    trainer.optimizer.sync_grads()
    lr = trainer.schedule.lr_at(iteration)
    grad_norm = trainer.optimizer.clip_and_step(lr, run.optimizer.clip_grad)
    progress.iteration = iteration
    progress.consumed_samples += run.train.global_batch_size
    elapsed = time.perf_counter() - start
    if trainer.logger is not None:
        fields = trainer.metrics.fields(table, elapsed)
        trainer.logger.log_train(iteration, progress.consumed_samples, loss, lr, grad_norm,
                                 elapsed, extra=fields, extra_scalars=scalars_of(fields),
                                 note=summary_of(fields))
    return stopping


@torch.no_grad()
def evaluate_parallel(trainer: ParallelTrainer) -> Optional[float]:
    """Mean loss over the first ``eval_iters`` global batches of the valid split, through the
    pipeline (forward only); None when there is no validation data. Collective."""
    setup, train = trainer.psetup.setup, trainer.psetup.run.train
    if setup.valid_data is None or train.eval_iters == 0:
        return None
    trainer.stage.eval()
    losses = [_run_global_batch(trainer, setup.valid_data, step * train.global_batch_size,
                                True, False)[0] for step in range(train.eval_iters)]
    trainer.stage.train()
    loss = sum(losses) / len(losses)
    if trainer.logger is not None:
        trainer.logger.log_eval(trainer.progress.iteration, trainer.progress.consumed_samples,
                                loss)
    return loss


def _save(trainer: ParallelTrainer) -> bool:
    return trainer.save is not None and trainer.save(trainer) is not None


def train_loop_parallel(trainer: ParallelTrainer, stop: StopRequest) -> str:
    """Iterate to ``--train-iters`` on every rank; returns why it stopped.

    Same cadence as the single-process loop (:func:`run_iterations`), with the stop request
    agreed across ranks, so every decision is identical on every rank.
    """
    def step() -> str:
        stopping = train_iteration(trainer, stop)
        return (stop.reason or "stop requested by another rank") if stopping else ""

    return run_iterations(trainer.psetup.run.train, lambda: trainer.progress.iteration, step,
                          lambda: evaluate_parallel(trainer), lambda: _save(trainer),
                          trainer.print)
