"""The trainer: one rank's share of every iteration of a run over (plan, groups).

Every run is a plan: a single process is the one-stage, one-rank plan and runs exactly this code
(the pipeline executor, the parallel optimizer, sharded checkpoints, the same metrics), with
groups of one rank.

Numerics (what makes every plan equal the single-device computation): iteration ``k`` reads
samples ``consumed_samples + i`` (:mod:`megatron_het.training.batches`); its micro-batch ``j``
(0 .. total-1, ``total`` = micro-batches of all pipelines) goes to pipeline ``p`` in consecutive
blocks. Every micro-batch's mean loss is scaled by ``1 / total`` before backward and the
data-parallel gradient sync sums, so the summed gradient is the gradient of the global-batch
mean loss. The reported loss is the sum over all micro-batches of their mean loss over ``total``:
tp_rank 0 of each last stage contributes its pipeline's sum to a world all-gather that every rank
reads the same way. The stop request (SIGTERM) rides in the same all-gather: the run stops when
any rank was asked to, so every rank saves the same iteration and exits together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatron_het.comm import UnifiedCommunicator
from megatron_het.data.mock_dataset import SampleDataset
from megatron_het.errors import UserError
from megatron_het.kernels.selection import KernelChoice
from megatron_het.model.compile import compile_layers
from megatron_het.model.llama import use_kernels
from megatron_het.optim.loss_scaler import LossScaler
from megatron_het.optim.lr_schedule import LRSchedule
from megatron_het.optim.parallel_optimizer import ParallelOptimizer, build_parallel_optimizer
from megatron_het.parallel.buckets import bucket_size_mb
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.process_groups import ProcessGroups, build_process_groups
from megatron_het.pipeline.executor import PipelineExecutor
from megatron_het.pipeline.stage import build_stage
from megatron_het.pipeline.timing import synchronize_stream
from megatron_het.trace.recorder import Recorder
from megatron_het.training.batches import pipeline_micro_batches
from megatron_het.training.metrics import TrainingLogger
from megatron_het.training.setup import RunSetup
from megatron_het.training.state import Progress, seed_everything
from megatron_het.training.straggler import (
    StragglerMonitor,
    build_monitor,
    report_fields,
    report_scalars,
)
from megatron_het.training.throughput import ThroughputMetrics, column, gather_rows, scalars_of


@dataclass
class Trainer:
    """The live objects of one rank of a run.

    ``groups`` is this rank's ProcessGroups, ``stage`` its slice of the model (TP applied),
    ``optimizer`` its ParallelOptimizer and ``executor`` its PipelineExecutor. ``logger`` is set
    on the logging rank only (:func:`logging_rank`), and ``stragglers`` there with
    ``--log-straggler`` (built by the first :func:`train_step`). ``last_eval_loss`` and
    ``iteration_times`` feed the closing summary; ``skipped_nonfinite`` counts the iterations
    ``--skip-nonfinite-steps`` did not step.
    """

    setup: RunSetup
    groups: ProcessGroups
    stage: nn.Module
    optimizer: ParallelOptimizer
    executor: PipelineExecutor
    schedule: LRSchedule
    metrics: ThroughputMetrics
    progress: Progress = field(default_factory=Progress)
    logger: TrainingLogger | None = None
    last_loss: float | None = None
    last_eval_loss: float | None = None
    iteration_times: list[float] = field(default_factory=list)
    stragglers: StragglerMonitor | None = None
    skipped_nonfinite: int = 0
    # The iteration after which the LR schedule counts its steps from 0: a load that keeps the
    # iteration but not the optimizer (--no-load-optim) restarts the schedule, as Megatron-LM.
    lr_schedule_start: int = 0

    @property
    def device(self) -> torch.device:
        return self.groups.comm.device

    @property
    def recorder(self) -> Recorder:
        """This rank's timeline recorder (the communicator's; off outside a profile)."""
        return self.groups.comm.recorder

    def print(self, message: str) -> None:
        """A log line, printed by the logging rank only."""
        if self.logger is not None:
            self.logger.print(message)


def logging_rank(plan: ParallelPlan) -> int:
    """The rank that logs: the first rank of the last stage of pipeline 0 (it has the loss)."""
    return plan.pipelines[0].stages[-1].ranks[0]


def check_ranks_agree(setup: RunSetup, comm: UnifiedCommunicator) -> None:
    """UserError on every rank unless all ranks resolved the same plan, model and training
    settings (e.g. nodes launched with different flags or files). Collective over the world."""
    settings = json.dumps(
        {
            "plan": setup.plan.to_dict(),
            "model": setup.model_config.to_dict(),
            "train": dataclasses.asdict(setup.train),
            "optimizer": dataclasses.asdict(setup.run.optimizer),
            "skip_nonfinite_steps": setup.run.faults.skip_nonfinite_steps,
        },
        sort_keys=True,
        default=str,
    )
    digest = int(hashlib.sha256(settings.encode()).hexdigest()[:12], 16)  # exact in float64
    mine = torch.tensor([float(digest)], dtype=torch.float64, device=comm.device)
    every = torch.zeros(comm.world_size, dtype=torch.float64, device=comm.device)
    comm.world.all_gather_into_tensor(every, mine)
    differing = [rank for rank, value in enumerate(every.tolist()) if value != float(digest)]
    if differing:
        raise UserError(
            f"ranks {differing} resolved a different plan, model or training setup "
            f"than rank {comm.rank}; launch every rank with the same flags and files"
        )


def build_trainer(setup: RunSetup, comm: UnifiedCommunicator, region_timer: Any = None) -> Trainer:
    """Groups, stage, optimizer and executor of this rank (collective over the world).

    Every rank must call it with the same ``setup``. ``region_timer`` times the executor's
    compute regions (an emulated kind's, see :mod:`megatron_het.emulation`; None: wall clock).
    """
    run, plan, config, options = setup.run, setup.plan, setup.model_config, setup.options
    check_ranks_agree(setup, comm)
    groups = build_process_groups(
        comm, plan, tie_embeddings=config.tie_embeddings, num_layers=config.num_layers
    )
    seed_everything(run.train.seed)
    stage = build_stage(config, plan, groups, run.train.seed, comm.device)
    use_kernels(stage, kernel_choice(setup))
    # Built in float32; the optimizer keeps those values as masters and casts the parameters.
    optimizer = build_parallel_optimizer(
        stage,
        groups,
        run.optimizer,
        options.use_distributed_optimizer,
        overlap_grad_reduce=options.overlap_grad_reduce,
        bucket_size_mb=bucket_size_mb(options.ddp_bucket_size),
        param_dtype=TRAINING_DTYPES[options.dtype],
        grad_reduce_dtype=grad_reduce_dtype(setup),
        loss_scaler=loss_scaler(setup),
        overlap_param_gather=options.overlap_param_gather,
    )
    if options.fused_elementwise:
        compile_layers(stage)
    executor = PipelineExecutor(
        stage,
        groups,
        config,
        run.data.seq_length,
        plan.micro_batch_size,
        region_timer=region_timer,
        overlap_p2p=options.overlap_p2p_comm,
    )
    metrics = ThroughputMetrics(config, plan, setup.cluster, run.data.seq_length, options.dtype)
    schedule = LRSchedule.from_config(run.optimizer, setup.train.train_iters)
    return Trainer(setup, groups, stage, optimizer, executor, schedule, metrics)


def kernel_choice(setup: RunSetup) -> KernelChoice:
    """The fused kernels the run's flags allow."""
    train = setup.train
    return KernelChoice.from_flags(
        rope=train.rope_fusion,
        rms_norm=train.rms_norm_fusion,
        cross_entropy=train.cross_entropy_loss_fusion,
        swiglu=train.bias_swiglu_fusion,
        reference=train.reference_kernels,
        gradient_accumulation_fusion=train.gradient_accumulation_fusion,
    )


TRAINING_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def loss_scaler(setup: RunSetup) -> LossScaler | None:
    """fp16's loss scaler from the run's flags (None for bf16 and fp32)."""
    if setup.options.dtype != "fp16":
        return None
    train = setup.run.train
    if train.loss_scale is not None:
        return LossScaler(scale=train.loss_scale, dynamic=False)
    return LossScaler(
        scale=train.initial_loss_scale,
        min_scale=train.min_loss_scale,
        growth_interval=train.loss_scale_window,
        hysteresis=train.hysteresis,
    )


def grad_reduce_dtype(setup: RunSetup) -> torch.dtype:
    """The dtype of the data-parallel gradient reduction: bf16 with --grad-reduce-in-bf16."""
    return torch.bfloat16 if setup.options.grad_reduce_in_bf16 else torch.float32


def _run_global_batch(
    trainer: Trainer, dataset: SampleDataset, first_sample: int, forward_only: bool, stop: bool
) -> tuple[float, bool, torch.Tensor]:
    """Run this rank's pipeline over its block; gather loss, stop flag and timings.

    Returns (global-batch mean loss, whether any rank asked to stop, the gathered table).
    """
    plan, role = trainer.setup.plan, trainer.groups.role
    total = sum(p.micro_batches for p in plan.pipelines)
    batches = pipeline_micro_batches(dataset, first_sample, plan, role.pipeline, trainer.device)
    scaler = trainer.optimizer.loss_scaler
    scale = 1.0 if scaler is None or forward_only else scaler.scale
    # train_step zeroed the gradients just before: no copy of the tied embedding's is kept
    stats = trainer.executor.run(
        batches, loss_scale=scale / total, forward_only=forward_only, grads_zeroed=not forward_only
    )
    contributes = role.is_last_stage and role.tp_rank == 0
    # Every rank meets every other here: a fast rank waits for the slowest in this gather.
    with trainer.recorder.span("metrics gather", "step"):
        table = gather_rows(
            trainer.groups.world,
            {
                "loss_sum": stats.loss_sum if contributes else 0.0,
                "stop": float(stop),
                "compute_s": stats.compute_s,
                "p2p_wait_s": stats.p2p_wait_s,
                "bubble_s": stats.bubble_s,
            },
            trainer.device,
        )
    loss = float(column(table, "loss_sum").sum()) / total
    return loss, bool(column(table, "stop").max() > 0), table


def train_step(trainer: Trainer, stop_requested: bool) -> bool:
    """One iteration on this rank: pipeline forward/backward, DP sync, clip, step, log.

    Returns True when some rank has asked the run to stop. A loss or gradient norm that is not
    finite (the same on every rank: the loss comes from the world gather, the norm from a world
    all-reduce) raises UserError on every rank, before stepping and naming the iteration. With
    ``--skip-nonfinite-steps`` such an iteration steps nothing instead (its gradients are
    dropped; parameters and optimizer state stay as they were) but still advances the
    iteration and the consumed samples, as an fp16 overflow does, and is counted.
    """
    setup, progress = trainer.setup, trainer.progress
    faults = setup.run.faults
    if trainer.logger is not None and faults.log_straggler and trainer.stragglers is None:
        trainer.stragglers = build_monitor(setup, faults.straggler_threshold)
    start = time.perf_counter()
    iteration = progress.iteration + 1
    # With --overlap-grad-reduce the optimizer counts this pipeline's backward passes to start
    # each bucket's DP reduction as soon as its gradients are final.
    pipeline = setup.plan.pipelines[trainer.groups.role.pipeline]
    with trainer.recorder.span(f"iteration {iteration}", "iteration", iteration=iteration):
        trainer.optimizer.zero_grad(
            num_micro_batches=pipeline.micro_batches if setup.options.overlap_grad_reduce else None
        )
        loss, stopping, table = _run_global_batch(
            trainer, setup.train_data, progress.consumed_samples, False, stop_requested
        )
        lr = trainer.schedule.lr_at(iteration - trainer.lr_schedule_start)
        grad_norm, skipped = _sync_and_step(trainer, iteration, loss, lr)
        progress.iteration = iteration
        progress.consumed_samples += setup.train.global_batch_size
        synchronize_stream(trainer.device)  # the optimizer's kernels, before reading the clock
    elapsed = time.perf_counter() - start
    if not skipped:
        trainer.last_loss = loss
    trainer.iteration_times.append(elapsed)
    if trainer.logger is not None:
        _log_train(trainer, iteration, table, loss, lr, grad_norm, elapsed, skipped)
    return stopping


def _sync_and_step(trainer: Trainer, iteration: int, loss: float, lr: float) -> tuple[float, bool]:
    """DP gradient sync, clip and optimizer step of ``iteration``: (the gradient norm, whether
    the step was skipped as non-finite). Every rank decides alike (see :func:`train_step`)."""
    skip = trainer.setup.run.faults.skip_nonfinite_steps
    if not math.isfinite(loss) and not skip:
        raise UserError(
            f"iteration {iteration}: the loss is {loss}; lower --lr (or use "
            "--clip-grad) and resume from the last checkpoint"
        )
    # Also when skipping: it completes the reductions --overlap-grad-reduce has started.
    with trainer.recorder.span("DP gradient sync", "step"):
        trainer.optimizer.sync_grads()
    if math.isfinite(loss):
        try:
            with trainer.recorder.span("optimizer step", "step"):
                grad_norm = trainer.optimizer.clip_and_step(
                    lr, trainer.setup.run.optimizer.clip_grad, skip_nonfinite=skip
                )
        except UserError as error:
            raise UserError(f"iteration {iteration}: {error}") from None
        # Under fp16 a non-finite norm is an overflow the loss scaler has already skipped.
        if math.isfinite(grad_norm) or trainer.optimizer.loss_scaler is not None:
            return grad_norm, False
        what = f"the gradient norm is {grad_norm}"
    else:
        grad_norm, what = math.nan, f"the loss is {loss}"
    trainer.skipped_nonfinite += 1
    trainer.print(
        f" iteration {iteration}: {what}; skipped its step (--skip-nonfinite-steps; "
        f"{trainer.skipped_nonfinite} skipped so far)"
    )
    return grad_norm, True


def _log_train(
    trainer: Trainer,
    iteration: int,
    table: torch.Tensor,
    loss: float,
    lr: float,
    grad_norm: float,
    elapsed: float,
    skipped: bool,
) -> None:
    """The logging rank's record of one iteration, with the straggler report of an interval's
    last iteration under ``--log-straggler`` (printed after the interval's line)."""
    logger = trainer.logger
    assert logger is not None
    fields = trainer.metrics.fields(table, elapsed)
    if trainer.optimizer.loss_scaler is not None:
        fields.update(
            loss_scale=trainer.optimizer.loss_scaler.scale,
            skipped_iterations=trainer.optimizer.skipped_iterations,
        )
    if trainer.setup.run.faults.skip_nonfinite_steps:
        fields.update(skipped_step=skipped, nonfinite_skipped_iterations=trainer.skipped_nonfinite)
    scalars = scalars_of(fields)
    if trainer.setup.run.faults.skip_nonfinite_steps:
        scalars["skipped-nonfinite-iterations"] = float(trainer.skipped_nonfinite)
    lines: list[str] = []
    monitor = trainer.stragglers
    if monitor is not None:
        fields["rank_compute_s"] = column(table, "compute_s").tolist()
        monitor.add(iteration, fields["rank_compute_s"])
        report = monitor.close() if logger.closes_interval(iteration) else None
        if report is not None:
            fields["straggler"] = report_fields(report)
            scalars.update(report_scalars(report))
            lines = monitor.lines(report)
    logger.log_train(
        iteration,
        trainer.progress.consumed_samples,
        loss,
        lr,
        grad_norm,
        elapsed,
        extra=fields,
        extra_scalars=scalars,
    )
    if lines:
        trainer.print("\n".join(lines))


@torch.no_grad()
def evaluate(trainer: Trainer) -> float | None:
    """Mean loss over the first ``eval_iters`` global batches of the valid split, through the
    pipeline (forward only); None when there is no validation data. Collective."""
    setup = trainer.setup
    train = setup.train
    if setup.valid_data is None or train.eval_iters == 0:
        return None
    trainer.stage.eval()
    losses = [
        _run_global_batch(trainer, setup.valid_data, step * train.global_batch_size, True, False)[0]
        for step in range(train.eval_iters)
    ]
    trainer.stage.train()
    loss = sum(losses) / len(losses)
    trainer.last_eval_loss = loss
    if trainer.logger is not None:
        trainer.logger.log_eval(trainer.progress.iteration, trainer.progress.consumed_samples, loss)
    return loss
