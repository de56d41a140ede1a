"""The distributed run driver: one Llama trained over ranks of mixed accelerator kinds.

Per rank, in order: check the run (:func:`prepare_parallel_run`: plan, cluster, model, batch,
world size), build the unified communicator over the cluster, every process group of the plan,
this rank's stage (its layers, TP applied), the parallel optimizer and the pipeline executor;
load a checkpoint (any plan's, resharded) when asked; then :func:`train_loop_parallel`.

Only the logging rank (the first rank of the last stage of pipeline 0) writes the log, the
metrics file and tensorboard. Checkpoints are sharded: every rank writes its pieces and one rank
commits. Library code: the caller has initialised torch.distributed's world group (see
:mod:`megatron_het.training.launch` for torchrun).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from typing import TYPE_CHECKING, Any, Optional, TextIO

import torch

from megatron_het.arguments import RunConfig
from megatron_het.emulation import Emulator
from megatron_het.errors import UserError
from megatron_het.optim.lr_schedule import LRSchedule
from megatron_het.training.loop import StopRequest
from megatron_het.training.metrics import TrainingLogger
from megatron_het.training.parallel_loop import (ParallelTrainer, logging_rank,
                                                 train_loop_parallel)
from megatron_het.training.parallel_metrics import ParallelMetrics
from megatron_het.training.parallel_setup import (ParallelSetup, describe_device_times,
                                                  describe_plan, prepare_parallel_run)
from megatron_het.training.state import Progress, rng_state, seed_everything, set_rng_state

if TYPE_CHECKING:
    from megatron_het.training.launch import LaunchEnv


def build_parallel_trainer(psetup: ParallelSetup, out: TextIO) -> ParallelTrainer:
    """Communicator, groups, stage, optimizer and executor of this rank (collective).

    Every rank must call it with the same ``psetup``. Loads ``psetup.setup.load_dir`` when set.
    """
    from megatron_het.comm import UnifiedCommunicator
    from megatron_het.optim.parallel_optimizer import build_parallel_optimizer
    from megatron_het.parallel.groups import build_process_groups
    from megatron_het.pipeline.executor import PipelineExecutor
    from megatron_het.pipeline.stage import build_stage

    run, plan, config = psetup.run, psetup.plan, psetup.setup.model_config
    comm = UnifiedCommunicator.from_cluster(psetup.cluster, bridge=run.parallel.bridge)
    _check_ranks_agree(psetup, comm)
    groups = build_process_groups(comm, plan)
    seed_everything(run.train.seed)
    device = comm.device
    stage = build_stage(config, plan, groups, run.train.seed, device)
    optimizer = build_parallel_optimizer(stage, groups, run.optimizer,
                                         psetup.use_distributed_optimizer,
                                         overlap_grad_reduce=run.parallel.overlap_grad_reduce)
    emulator = Emulator.from_spec(psetup.accelerator(comm.rank),
                                  fixed_reference_s=_device_times(psetup, comm.rank))
    executor = PipelineExecutor(stage, groups, config, run.data.seq_length,
                                plan.micro_batch_size, bf16=psetup.dtype == "bf16",
                                emulator=emulator)
    metrics = ParallelMetrics(config, plan, psetup.cluster, run.data.seq_length, psetup.dtype)
    trainer = ParallelTrainer(psetup, groups, stage, optimizer, executor,
                              LRSchedule.from_config(run.optimizer, run.train.train_iters),
                              Progress(), device, metrics, save=save_parallel)
    if psetup.setup.load_dir is not None:
        _load(trainer)
    if comm.rank == logging_rank(plan):
        trainer.logger = TrainingLogger(run.train, config, run.data.seq_length,
                                        start_iteration=trainer.progress.iteration,
                                        num_devices=plan.world_size, out=out)
    return trainer


def _device_times(psetup: ParallelSetup, rank: int) -> Optional[dict[tuple[str, bool], float]]:
    """The emulator's fixed reference CPU times of this rank's stage regions (None: measured)."""
    from megatron_het.pipeline.executor import compute_region_key

    times = psetup.emulated_device_s.get(rank)
    if times is None:
        return None
    forward, backward = times
    return {compute_region_key("forward", False): forward,
            compute_region_key("forward", True): forward,
            compute_region_key("backward", False): backward}


def _check_ranks_agree(psetup: ParallelSetup, comm: Any) -> None:
    """UserError on every rank unless all ranks resolved the same plan, model and training
    settings (e.g. nodes launched with different flags or files). Collective over the world."""
    settings = json.dumps({"plan": psetup.plan.to_dict(),
                           "model": psetup.setup.model_config.to_dict(),
                           "train": dataclasses.asdict(psetup.run.train),
                           "optimizer": dataclasses.asdict(psetup.run.optimizer)},
                          sort_keys=True, default=str)
    digest = int(hashlib.sha256(settings.encode()).hexdigest()[:12], 16)  # exact in float64
    mine = torch.tensor([float(digest)], dtype=torch.float64, device=comm.device)
    every = torch.zeros(comm.world_size, dtype=torch.float64, device=comm.device)
    comm.world.all_gather_into_tensor(every, mine)
    differing = [rank for rank, value in enumerate(every.tolist()) if value != float(digest)]
    if differing:
        raise UserError(f"ranks {differing} resolved a different plan, model or training setup "
                        f"than rank {comm.rank}; launch every rank with the same flags and files")


def _load(trainer: ParallelTrainer) -> None:
    """Load this rank's slices (from any plan's checkpoint) and the training state."""
    from megatron_het.checkpoint.sharded import load_sharded

    psetup = trainer.psetup
    optimizer_state, train_state = load_sharded(
        psetup.setup.load_dir, psetup.setup.model_config, psetup.plan, trainer.groups,
        trainer.stage, map_location=trainer.device)
    if train_state is None:  # model-only (e.g. converted weights): fresh optimizer at 0
        return
    if optimizer_state is not None:
        trainer.optimizer.load_state_dict(optimizer_state)
    if train_state.get("rng") is not None:
        set_rng_state(train_state["rng"])
    trainer.progress = Progress(iteration=int(train_state["iteration"]),
                                consumed_samples=int(train_state["consumed_samples"]))


def save_parallel(trainer: ParallelTrainer) -> Optional[object]:
    """Sharded checkpoint of the current iteration (collective; None without ``--save``)."""
    from megatron_het.checkpoint.sharded import save_sharded

    psetup, progress = trainer.psetup, trainer.progress
    run = psetup.run
    if run.train.save is None:
        return None
    start = time.perf_counter()
    train_state = {"iteration": progress.iteration, "consumed_samples": progress.consumed_samples,
                   "lr_schedule": trainer.schedule.state_dict(), "rng": rng_state()}
    metadata = {"argv": list(run.argv), "consumed_samples": progress.consumed_samples,
                "run_config": dataclasses.asdict(run), "plan": psetup.plan.to_dict(),
                "cluster": psetup.cluster.name}
    path = save_sharded(run.train.save, progress.iteration, psetup.setup.model_config,
                        psetup.plan, trainer.groups, trainer.stage, trainer.optimizer.state_dict(),
                        train_state, metadata)
    trainer.print(f" saved checkpoint at iteration {progress.iteration} to {path} "
                  f"({time.perf_counter() - start:.2f} s)")
    return path


def _describe(trainer: ParallelTrainer) -> str:
    psetup = trainer.psetup
    config, train, plan = psetup.setup.model_config, psetup.run.train, psetup.plan
    kinds = ", ".join(f"{count} x {label}"
                      for label, count in trainer.metrics.devices_per_label.items())
    lines = [f"> model {config.name}: {config.num_layers} layers, hidden {config.hidden_size}, "
             f"heads {config.num_attention_heads}/{config.num_query_groups} kv, vocab "
             f"{config.vocab_size}, {config.num_parameters() / 1e6:.2f}M parameters",
             f"> parallel run on cluster {psetup.cluster.name}: {plan.world_size} ranks "
             f"({kinds}), {psetup.dtype}, dp={plan.dp_size}, distributed optimizer "
             f"{'on' if psetup.use_distributed_optimizer else 'off'}, bridge "
             f"{psetup.run.parallel.bridge}",
             describe_plan(psetup)]
    if psetup.emulated_device_s:
        lines.append(describe_device_times(psetup))
    lines.append(f"> iterations {trainer.progress.iteration + 1}..{train.train_iters}, global "
                 f"batch {train.global_batch_size} = {train.micro_batch_size} x "
                 f"{train.global_batch_size // train.micro_batch_size} micro-batches, seq "
                 f"{psetup.run.data.seq_length}, from sample "
                 f"{trainer.progress.consumed_samples}")
    return "\n".join(lines)


def _warn_late_regions(trainer: Any) -> None:
    """An emulated rank whose compute regions outran its kind's time (the host's cores were
    too shared to emulate it there) says so on stderr: its figures are slower than the kind."""
    emulator = trainer.executor.emulator
    stats = emulator.stats() if emulator is not None else None
    if stats is None or not stats.late:
        return
    basis = "profiled" if emulator.fixed_reference_s else "CPU"
    print(f"warning: rank {trainer.groups.comm.rank} ({emulator.name}): {stats.late} of "
          f"{stats.regions} compute regions took longer than {emulator.slowdown:g} x their "
          f"{basis} time (EMULATION: the host's cores are shared by too many ranks); its times "
          f"are slower than the emulated kind", file=sys.stderr, flush=True)


def pretrain_distributed(run: RunConfig, world_size: int, stop: Optional[StopRequest] = None,
                         out: TextIO = sys.stdout) -> Progress:
    """Run ``run`` on this rank of an initialised ``world_size``-rank world; returns progress.

    Collective: every rank calls it with the same ``run``. Raises UserError (on every rank,
    before anything is written) for a plan, cluster, model, batch or world-size mismatch.
    """
    stop = stop or StopRequest()
    psetup = prepare_parallel_run(run, world_size)
    trainer = build_parallel_trainer(psetup, out)
    try:
        if psetup.setup.load_dir is not None:
            trainer.print(f"> loaded {psetup.setup.load_dir} (iteration "
                          f"{trainer.progress.iteration}, consumed samples "
                          f"{trainer.progress.consumed_samples})")
        elif run.train.load is not None:
            trainer.print(f"> no checkpoint in {run.train.load} yet; starting from scratch")
        if run.parallel.plan == "auto":
            trainer.print("> plan chosen by the planner (--plan auto)")
        trainer.print(_describe(trainer))
        if trainer.progress.iteration >= psetup.run.train.train_iters:
            trainer.print(f" already at iteration {trainer.progress.iteration}; raise "
                          "--train-iters to train further")
            return trainer.progress
        train_loop_parallel(trainer, stop)
        _warn_late_regions(trainer)
    finally:
        if trainer.logger is not None:
            trainer.logger.close()
    return trainer.progress


def launch_and_train(run: RunConfig, env: "LaunchEnv", stop: Optional[StopRequest] = None,
                     out: TextIO = sys.stdout) -> Progress:
    """Initialise the world group from torchrun's ``env``, train, and tear the group down."""
    from megatron_het.training.launch import init_world, shutdown_world

    device_type = None
    if run.parallel.cluster is not None:
        from megatron_het.cluster import ClusterSpec

        cluster = ClusterSpec.load(run.parallel.cluster)
        if env.rank < cluster.world_size:
            device_type = cluster.accelerator_of(env.rank).device_type
    init_world(env, device_type=device_type)
    try:
        return pretrain_distributed(run, env.world_size, stop, out)
    finally:
        shutdown_world()
