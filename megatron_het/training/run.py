"""A whole pretraining run: check, initialise the world, build, resume, train, summarise.

The composition root of a run: the only training module that wires emulation (an emulated
kind's compute timer and link delays) into the product's hooks. Per rank, in order: check the
run (:func:`~megatron_het.training.setup.prepare_run`: tokenizer, model, plan, cluster, data,
checkpoint; nothing is written if it fails), build the unified communicator over the cluster,
the trainer (groups, stage, optimizer, executor), load a checkpoint (any plan's, resharded) when
asked, train, and print the closing summary. Only the logging rank writes the log, the metrics
file and tensorboard; every rank writes its checkpoint pieces.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pathlib
import sys
import time
from typing import TYPE_CHECKING, TextIO

from megatron_het.arguments import RunConfig
from megatron_het.checkpoint.io import remove_stale_staging
from megatron_het.cluster.cluster import format_ranks
from megatron_het.comm.faults import CommError, line_from_bytes, line_to_bytes
from megatron_het.comm.pending import PENDING
from megatron_het.errors import EXIT_PEER_FAILURE, PeerFailure, UserError
from megatron_het.kernels.selection import FAMILIES, describe, implementation
from megatron_het.launcher.failure_record import write_failure
from megatron_het.launcher.launch_env import LaunchEnv
from megatron_het.launcher.peer_watch import PeerWatch
from megatron_het.launcher.rank_device import device_problem, rank_device_index
from megatron_het.launcher.start_agreement import connect_store, stop_together
from megatron_het.launcher.world import init_world, shutdown_world
from megatron_het.training.checkpointing import check_save_is_shared, load, resumed_metadata
from megatron_het.training.describe import (
    describe_cluster,
    describe_iterations,
    describe_model,
    describe_plan,
    describe_rank,
)
from megatron_het.training.loop import train
from megatron_het.training.metrics import TrainingLogger
from megatron_het.training.restart_changes import describe_restart
from megatron_het.training.setup import RunSetup, predict_plan, prepare_run
from megatron_het.training.state import Progress
from megatron_het.training.stop import StopRequest
from megatron_het.training.summary import closing_summary
from megatron_het.training.trainer import Trainer, build_trainer, kernel_choice, logging_rank

if TYPE_CHECKING:  # pragma: no cover
    from megatron_het.emulation import RankEmulation
    from megatron_het.perf import Prediction


def pretrain(
    run: RunConfig,
    env: LaunchEnv | None = None,
    stop: StopRequest | None = None,
    out: TextIO | None = None,
    accelerator: str = "cpu",
) -> Progress:
    """Train ``run`` on torchrun's world ``env``, or on a one-rank world in this process
    without one; returns this rank's progress.

    ``accelerator`` is every rank's kind when the run has no ``--cluster``. Every input is
    checked before the world is built, so a bad command line fails with one UserError and
    leaves ``--save``, the metrics file and tensorboard untouched; on a launched rank that
    error goes through the start-up agreement first, so that every rank stops with it
    (:func:`~megatron_het.launcher.start_agreement.stop_together`).
    """
    try:
        setup = prepare_run(run, env.world_size if env is not None else 1, accelerator)
    except UserError as error:
        if env is None or env.world_size == 1:
            raise
        # A file that some node lacks (data, tokenizer, checkpoint): stop every rank with it,
        # rather than leave the other nodes waiting out the timeout for this one.
        raise stop_together(env, distributed_timeout(run), str(error)) from None
    rank = env.rank if env is not None else 0
    timeout = distributed_timeout(setup.run)
    index = device_index(setup, rank, env.local_rank if env is not None else 0)
    init_world(
        env, timeout=timeout, device_type=setup.accelerator(rank).device_type, device_index=index
    )
    watch = None
    if env is not None and env.world_size > 1:
        watch = PeerWatch(
            connect_store(env, timeout),
            env.rank,
            env.world_size,
            timeout.total_seconds(),
            describe=lambda r: describe_rank(setup, r),
            generation=env.restart_count,
            logging_rank=logging_rank(setup.plan),
            node_size=env.local_world_size,
            stuck_operation=PENDING.stuck,
            run_id=env.run_id,
        )
    lost_peer = False
    try:
        return train_prepared(setup, stop, out, watch, index)
    except PeerFailure:
        lost_peer = True  # tearing the world down could wait on the lost peer: exit instead
        raise
    finally:
        if not lost_peer:
            shutdown_world()


def _peer_failure_line(setup: RunSetup, watch: PeerWatch, error: CommError) -> str:
    """Report a failed operation (:meth:`PeerWatch.report`), clear the save directory's
    uncommitted staging (rank 0) and record the failure for a supervisor; the report line."""
    iteration = watch.progress() + 1
    report = watch.report(error, iteration)
    if watch.rank == 0 and setup.train.save is not None:  # rank 0 alone commits saves
        remove_stale_staging(setup.train.save)
    if report.full and setup.train.save is not None:  # for a supervisor's restart
        write_failure(
            setup.train.save,
            iteration,
            watch.world_size,
            report.silent,
            report.stuck,
            report.failed,
            report.line,
            run_id=watch.run_id,
        )
    return report.line


def _end_stuck(setup: RunSetup, watch: PeerWatch, error: CommError) -> None:
    """From the heartbeat thread: the main thread's operation ran past the timeout without
    failing (a device backend's); report it as a failed one and end the process."""
    line = _peer_failure_line(setup, watch, error)
    print(f"error: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PEER_FAILURE)


def distributed_timeout(run: RunConfig) -> datetime.timedelta:
    """``--distributed-timeout-minutes`` as the timeout of the world and every group."""
    return datetime.timedelta(minutes=run.faults.distributed_timeout_minutes)


def pretrain_on_world(
    run: RunConfig,
    world_size: int,
    stop: StopRequest | None = None,
    out: TextIO | None = None,
    local_rank: int | None = None,
) -> Progress:
    """Train ``run`` on an initialised ``world_size``-rank world (collective: every rank calls
    it with the same ``run``); returns this rank's progress. ``local_rank`` is this rank's
    place on its node (None: every rank of the world on one node)."""
    setup = prepare_run(run, world_size)
    device = None
    if local_rank is not None:
        import torch.distributed as dist

        device = device_index(setup, dist.get_rank(), local_rank)
    return train_prepared(setup, stop, out, device=device)


def rank_emulation(setup: RunSetup, rank: int, threads: int | None = None) -> RankEmulation:
    """EMULATION: the emulation of ``rank`` (its compute-region timer, the communicator's wire
    hooks, the start-up line and the end-of-run warning), after checking every emulated kind's
    memory cap against the plan's stages (one UserError line naming the stage and the GiB).
    Ranks named by ``--emulation-extra-slowdown`` compute that many times slower than their
    kind (UserError on every rank when one is outside the world or not emulated)."""
    from megatron_het.emulation import build_emulation, check_memory_caps

    check_memory_caps(
        setup.model_config,
        setup.plan,
        setup.cluster,
        setup.run.data.seq_length,
        setup.options,
        profiles=setup.host_profiles,
    )
    parallel = setup.run.parallel
    return build_emulation(
        setup.cluster,
        setup.plan,
        rank,
        setup.model_config,
        setup.run.data.seq_length,
        setup.options.dtype,
        setup.host_profiles,
        parallel.emulation_profile,
        threads=threads,
        extra_slowdown=parallel.emulation_extra_slowdown,
        fused_elementwise=setup.options.fused_elementwise,
    )


def predict_run(setup: RunSetup) -> Prediction:
    """:func:`~megatron_het.training.setup.predict_plan` with the host-sharing model where the
    ranks are emulated on a shared host whose profile has the figures: the dry run's, the
    summary's and the demo's chart's prediction. UserError if the predictor cannot price the
    plan."""
    from megatron_het.emulation import SharedHostModel

    return predict_plan(setup, rate_model=SharedHostModel())


def predicted_iteration_s(setup: RunSetup) -> float | None:
    """:func:`predict_run`'s iteration time; None if the predictor cannot price the plan."""
    from megatron_het.errors import UserError

    try:
        return predict_run(setup).iteration_time_s
    except UserError:
        return None


def train_prepared(
    setup: RunSetup,
    stop: StopRequest | None = None,
    out: TextIO | None = None,
    watch: PeerWatch | None = None,
    device: int | None = None,
) -> Progress:
    """Build this rank's trainer from a checked ``setup`` and train it (collective).
    ``device`` is the visible device the rank drives (:func:`device_index`; None: every rank
    of the world on one node).

    With a ``watch`` (a launched multi-rank run) the rank keeps a heartbeat, and a failure of
    the run's communication (a peer dead, hung or unreachable past the timeout) raises
    PeerFailure with one line naming the ranks that stopped answering and the failed operation
    (:mod:`megatron_het.launcher.peer_watch`); any other failure is recorded for the peers'
    reports and re-raised."""
    if watch is None:
        return _train(setup, stop or StopRequest(), out or sys.stdout, None, device)
    watch.on_stuck = lambda error: _end_stuck(setup, watch, error)
    watch.start()
    try:
        progress = _train(setup, stop or StopRequest(), out or sys.stdout, watch, device)
    except CommError as error:
        raise PeerFailure(_peer_failure_line(setup, watch, error)) from None
    except BaseException as error:
        watch.record(error, watch.progress() + 1)
        raise
    watch.stop()
    return progress


# Bytes of each rank's device problem that every rank receives.
_PROBLEM_BYTES = 240


def device_index(setup: RunSetup, rank: int, local_rank: int) -> int:
    """The visible device that ``rank`` (``local_rank`` on its node) drives: its place among
    its node's ranks of its device type
    (:func:`~megatron_het.launcher.rank_device.local_device_index`)."""
    return rank_device_index(lambda r: setup.accelerator(r).device_type, rank, local_rank)


def check_devices(setup: RunSetup, rank: int, device: int) -> None:
    """UserError on every rank when some rank's process cannot be the kind the cluster file
    gives it driving visible device ``device``
    (:func:`~megatron_het.launcher.rank_device.device_problem`), naming those ranks.

    Collective over the world (gloo, host tensors), before any device group is built: a GPU
    rank placed in another vendor's kind (nodes started in another order than the cluster
    file's) would otherwise hang in that kind's NCCL group, and a rank failing alone there
    would leave the others waiting until the timeout."""
    import torch
    import torch.distributed as dist

    problem = device_problem(
        setup.accelerator(rank), device, identity=setup.run.parallel.cluster is not None
    )
    mine = line_to_bytes(problem or "", _PROBLEM_BYTES)
    size = dist.get_world_size() if dist.is_initialized() else 1
    every = [mine] if size == 1 else [torch.zeros_like(mine) for _ in range(size)]
    if size > 1:
        dist.all_gather(every, mine)
    problems = [(r, text) for r, text in enumerate(map(line_from_bytes, every)) if text]
    if not problems:
        return
    shown = "; ".join(f"{describe_rank(setup, r)}: {text}" for r, text in problems[:3])
    more = f" (and {len(problems) - 3} more ranks)" if len(problems) > 3 else ""
    raise UserError(
        f"ranks do not match the kinds the cluster file gives them: {shown}{more}; "
        "start each node group on its own hardware and torch build, nodes in the "
        "cluster file's order (torchrun --node_rank)"
    )


def _train(
    setup: RunSetup, stop: StopRequest, out: TextIO, watch: PeerWatch | None, device: int | None
) -> Progress:
    from megatron_het.comm import UnifiedCommunicator

    run = setup.run
    world_rank = _world_rank()
    check_devices(
        setup, world_rank, device_index(setup, world_rank, world_rank) if device is None else device
    )
    if setup.train.save is not None:
        check_save_is_shared(
            pathlib.Path(setup.train.save),
            lambda ranks: f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}",
        )
    emulation = rank_emulation(setup, world_rank)
    comm = UnifiedCommunicator.from_cluster(
        setup.cluster,
        bridge=run.parallel.bridge,
        wire_hooks=emulation.wire_hooks,
        timeout=distributed_timeout(setup.run),
    )
    trainer = build_trainer(setup, comm, region_timer=emulation.region_timer)
    if watch is not None:
        watch.progress = lambda: trainer.progress.iteration
        watch.activity = trainer.executor.clock.activity
    loaded = load(trainer) if setup.load_dir is not None else None
    if comm.rank == logging_rank(setup.plan):
        trainer.logger = TrainingLogger(
            setup.train,
            setup.model_config,
            run.data.seq_length,
            start_iteration=trainer.progress.iteration,
            num_devices=setup.plan.world_size,
            out=out,
            throughput=trainer.metrics,
            run_record=run_record(setup),
        )
    finished = False
    try:
        _print_start(trainer, emulation, loaded)
        if trainer.progress.iteration >= setup.train.train_iters:
            trainer.print(
                f" already at iteration {trainer.progress.iteration}; raise "
                "--train-iters to train further"
            )
        else:
            start = time.perf_counter()
            train(trainer, stop, predict=lambda: predict_run(setup))
            warning = emulation.late_warning()
            if warning:
                print(warning, file=sys.stderr, flush=True)
            if trainer.logger is not None:
                trainer.print(
                    closing_summary(
                        trainer, time.perf_counter() - start, predicted_iteration_s(setup)
                    )
                )
        finished = True
    finally:
        # After a failure, reductions still in flight would only wait on a lost peer.
        trainer.optimizer.close(wait=finished)
        if trainer.logger is not None:
            trainer.logger.close()
    return trainer.progress


def run_record(setup: RunSetup) -> dict:
    """The run's configuration as the experiment trackers record it: the flags as parsed,
    the plan and the cluster."""
    record = dataclasses.asdict(setup.run)
    record["plan"] = setup.plan.to_dict()
    record["cluster"] = setup.cluster.to_dict()
    return record


def _world_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _describe_kernels(trainer: Trainer) -> str:
    """Which implementation each fused op runs on the logging rank's device."""
    device_type = next(trainer.stage.parameters()).device.type
    choice = kernel_choice(trainer.setup)
    found = [implementation(family, device_type, choice) for family in FAMILIES]
    return f"> kernels on {device_type}: {describe(found)}"


def _print_start(trainer: Trainer, emulation: RankEmulation, loaded: str | None) -> None:
    setup = trainer.setup
    if setup.load_dir is not None:
        trainer.print(
            f"> loaded {setup.load_dir} (iteration {trainer.progress.iteration}, "
            f"consumed samples {trainer.progress.consumed_samples})"
        )
        if loaded:
            trainer.print(loaded)
        if trainer.logger is not None:
            restart = describe_restart(
                setup,
                resumed_metadata(setup.load_dir, setup.run.train),
                lambda: predicted_iteration_s(setup),
            )
            if restart:
                trainer.print(restart)
    elif setup.train.load is not None:
        trainer.print(f"> no checkpoint in {setup.train.load} yet; starting from scratch")
    if setup.run.parallel.plan == "auto":
        trainer.print("> plan chosen by the planner (--plan auto)")
    lines = [describe_model(setup.model_config), describe_cluster(setup), describe_plan(setup)]
    lines.append(_describe_kernels(trainer))
    if emulation.description:
        lines.append(emulation.description)
    lines.append(describe_iterations(setup, trainer.progress))
    trainer.print("\n".join(lines))
