"""Saving and loading a trainer: sharded checkpoints of any plan, one process included.

Every rank writes its pieces and one rank commits (:mod:`megatron_het.checkpoint.sharded`); a
load reads this rank's slices from a checkpoint of any plan, or of a single process in the
format written before every run became a plan (full tensors, the optimizer state by name in the
training state), or a Megatron-LM save (:mod:`megatron_het.checkpoint.megatron_load`),
and continues at its iteration, data position and RNG state, or restores less as Megatron-LM's
``--finetune``, ``--no-load-optim`` and ``--no-load-rng`` say (:func:`load_choice`).

:class:`CheckpointSaver` is the run's saver: synchronous saves (:func:`save`), or with
``--async-save`` a snapshot at the save point, a background write and a collective commit once
every rank's files are complete (:mod:`megatron_het.checkpoint.async_save`). Each save logs its
time and GB/s; an asynchronous one logs how long training was blocked and, at the commit, the
background write's time. Each load logs its time and the GB it read.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import time
from typing import TYPE_CHECKING, Any

import torch

from megatron_het.checkpoint.async_save import (
    AsyncCheckpointSaver,
    BeforeFile,
    CommitReport,
    PendingCommit,
)
from megatron_het.checkpoint.integrity import files_total_bytes
from megatron_het.checkpoint.io import iteration_dir_name, load_checkpoint_metadata
from megatron_het.checkpoint.megatron_lm_optim import loss_scaler_state
from megatron_het.checkpoint.megatron_load import (
    MegatronHeader,
    find_megatron_checkpoint,
    load_megatron_slices,
    read_megatron_header,
)
from megatron_het.checkpoint.reader import ReadStats
from megatron_het.checkpoint.sharded import load_sharded, save_sharded, snapshot_sharded
from megatron_het.checkpoint.verify import read_metadata_file
from megatron_het.comm.faults import line_from_bytes, line_to_bytes
from megatron_het.config import TrainConfig
from megatron_het.errors import UserError
from megatron_het.training.state import Progress, rng_state, set_rng_state

if TYPE_CHECKING:  # pragma: no cover
    from megatron_het.training.trainer import Trainer

_GB = 1e9


def _rate(nbytes: int | None, seconds: float) -> str:
    if nbytes is None:
        return ""
    return f", {nbytes / _GB:.3f} GB, {nbytes / _GB / max(seconds, 1e-9):.2f} GB/s"


def _train_state(trainer: Trainer) -> dict[str, Any]:
    progress = trainer.progress
    state = {
        "iteration": progress.iteration,
        "consumed_samples": progress.consumed_samples,
        "lr_schedule": trainer.schedule.state_dict(),
        "rng": rng_state(trainer.device.type),
        "nonfinite_skipped_iterations": trainer.skipped_nonfinite,
        "lr_schedule_start": trainer.lr_schedule_start,
    }
    scaler = trainer.optimizer.loss_scaler
    if scaler is not None:
        state["loss_scaler"] = scaler.state_dict()
        state["skipped_iterations"] = trainer.optimizer.skipped_iterations
    return state


def _metadata(trainer: Trainer) -> dict[str, Any]:
    setup = trainer.setup
    return {
        "argv": list(setup.run.argv),
        "consumed_samples": trainer.progress.consumed_samples,
        "run_config": dataclasses.asdict(setup.run),
        "plan": setup.plan.to_dict(),
        "cluster": setup.cluster.name,
    }


def _writes_state(trainer: Trainer) -> bool:
    """Whether this rank writes model or optimizer pieces of a checkpoint: pipeline 0's ranks
    do (every DP replica holds the whole, gathered, state; the first one writes it), so the
    other replicas need no host copy of it."""
    return trainer.groups.role.pipeline == 0


def save(trainer: Trainer) -> pathlib.Path | None:
    """Sharded checkpoint of the current iteration, written now (collective; None without
    ``--save``). Logs its time and the checkpoint's size and GB/s."""
    setup, progress = trainer.setup, trainer.progress
    if setup.run.train.save is None:
        return None
    start = time.perf_counter()
    trainer.optimizer.params_ready()
    keep = _writes_state(trainer)
    path = save_sharded(
        setup.run.train.save,
        progress.iteration,
        setup.model_config,
        setup.plan,
        trainer.groups,
        trainer.stage,
        trainer.optimizer.state_dict(keep),
        _train_state(trainer),
        _metadata(trainer),
        weights=trainer.optimizer.master_weights(keep),
    )
    elapsed = time.perf_counter() - start
    metadata = read_metadata_file(path)
    size = None if metadata is None else files_total_bytes(metadata)
    trainer.print(
        f" saved checkpoint at iteration {progress.iteration} to {path} "
        f"({elapsed:.2f} s{_rate(size, elapsed)})"
    )
    return path


class CheckpointSaver:
    """The saves of one run on this rank: synchronous, or background writes with
    ``--async-save`` (``setup.run.faults.async_save``).

    Call :meth:`save` at save points, :meth:`poll` after every iteration (collective while a
    background save is pending), :meth:`finish` before the run returns (collective: commits
    the pending save) and :meth:`close` on the way out (abandons an unfinished save).
    ``before_file(iteration, name)`` runs in the writer thread before each file (tests).
    """

    def __init__(self, trainer: Trainer, before_file: BeforeFile | None = None) -> None:
        self.trainer = trainer
        run = trainer.setup.run
        self.background: AsyncCheckpointSaver | None = None
        if run.faults.async_save and run.train.save is not None:
            self.background = AsyncCheckpointSaver(
                trainer.groups.world,
                trainer.device,
                before_file,
                timeout_s=run.faults.distributed_timeout_minutes * 60,
            )

    def save(self) -> pathlib.Path | None:
        """Checkpoint the current iteration (collective); the iteration directory it is (or
        will be, once committed) written to, None without ``--save``."""
        if self.background is None:
            return save(self.trainer)
        self._report(self.background.finish())  # one save in flight: commit the previous
        trainer, setup = self.trainer, self.trainer.setup
        assert setup.run.train.save is not None  # a background saver is made only with --save
        iteration, save_dir = trainer.progress.iteration, pathlib.Path(setup.run.train.save)
        start = time.perf_counter()
        trainer.optimizer.params_ready()
        keep = _writes_state(trainer)
        optimizer_state = trainer.optimizer.state_dict(keep)  # fresh CPU copies
        train_state = copy.deepcopy(_train_state(trainer))
        files = snapshot_sharded(
            save_dir,
            iteration,
            setup.model_config,
            trainer.groups,
            trainer.stage,
            optimizer_state,
            train_state,
            weights=trainer.optimizer.master_weights(keep),
        )
        blocked = time.perf_counter() - start
        self.background.start(
            files,
            PendingCommit(
                save_dir,
                iteration,
                setup.model_config,
                setup.plan,
                optimizer_state is not None,
                True,
                _metadata(trainer),
            ),
        )
        trainer.print(
            f" checkpoint at iteration {iteration}: training blocked {blocked:.2f} s "
            f"for the snapshot ({files.tensor_bytes / _GB:.3f} GB on this rank); "
            "writing it in the background"
        )
        return save_dir / iteration_dir_name(iteration)

    def poll(self) -> None:
        """After each iteration: commit the background save once every rank has written it
        (collective while one is pending; UserError on every rank if a writer failed)."""
        if self.background is not None:
            self._report(self.background.poll())

    def finish(self) -> None:
        """Wait for and commit the pending background save (collective)."""
        if self.background is not None:
            self._report(self.background.finish())

    def close(self) -> None:
        """Abandon an uncommitted background save (no communication); the previous
        checkpoint stays the latest."""
        if self.background is not None:
            self.background.close()

    def _report(self, report: CommitReport | None) -> None:
        if report is None:
            return
        self.trainer.print(
            f" saved checkpoint at iteration {report.iteration} to {report.path} "
            f"(background write {report.write_s:.2f} s"
            f"{_rate(report.bytes, report.write_s)}; committed "
            f"{report.since_save_point_s:.2f} s after the save point)"
        )


# Bytes of a failed rank's error line that every other rank receives to raise it too.
_ERROR_LINE_BYTES = 2048


def _agree_loaded(
    trainer: Trainer, error: BaseException | None, stats: ReadStats, seconds: float
) -> tuple[int, float]:
    """Collective over the world: raise on every rank if a rank failed to load (a failing rank
    its own error, every other rank the highest failing rank's line, so the logging rank names
    the damaged file wherever it is); else the bytes every rank read together and the slowest
    rank's time."""
    world = trainer.groups.world
    # int64 (seconds in microseconds): HCCL has no float64 all-reduce.
    flags = torch.tensor(
        [0 if error is None else world.rank + 1, round(seconds * 1e6)],
        dtype=torch.int64,
        device=trainer.device,
    )
    world.all_reduce(flags, "max")
    total = torch.tensor([stats.bytes], dtype=torch.int64, device=trainer.device)
    world.all_reduce(total, "sum")
    failed_plus_one, slowest_us = flags.cpu().tolist()
    failed = failed_plus_one - 1
    if failed < 0:
        return int(total.item()), slowest_us / 1e6
    # Every rank takes this branch: the failing rank's line, summed in (the others add zeros).
    line = line_to_bytes(str(error) if world.rank == failed else "", _ERROR_LINE_BYTES)
    wire = line.to(device=trainer.device, dtype=torch.int32)
    world.all_reduce(wire, "sum")
    if error is not None:
        raise error
    raise UserError(f"{line_from_bytes(wire)} (on rank {failed})")


@dataclasses.dataclass(frozen=True)
class LoadChoice:
    """What a load restores besides the model weights, as Megatron-LM's load flags decide.

    ``progress``: the iteration, consumed samples and skip counters (else all 0, as
    ``--finetune``); ``optimizer``: Adam's moments, the loss scale and the LR schedule's
    position (else a fresh optimizer, whose LR schedule starts over at the loaded iteration);
    ``rng``: the random generators (else those ``--seed`` set)."""

    progress: bool
    optimizer: bool
    rng: bool


def load_choice(train: TrainConfig, megatron: MegatronHeader | None) -> LoadChoice:
    """Megatron-LM's meanings: ``--finetune`` restores nothing but the weights,
    ``--no-load-optim`` keeps the optimizer (and LR schedule) fresh, ``--no-load-rng`` the
    generators. A Megatron-LM checkpoint's RNG state is never carried (its generators are not
    ours); its optimizer state is when it can be (``optimizer_problem`` None), else it loads
    as ``--finetune`` unless ``--no-load-optim`` says to go on without it (and a ``release``
    directory always does, as Megatron-LM loads one)."""
    if train.finetune or (megatron is not None and megatron.release):
        return LoadChoice(False, False, False)
    if megatron is not None:
        if megatron.optimizer_problem is None:
            return LoadChoice(True, not train.no_load_optim, False)
        return LoadChoice(train.no_load_optim, False, False)
    return LoadChoice(True, not train.no_load_optim, not train.no_load_rng)


def resumed_metadata(load_dir: pathlib.Path, train: TrainConfig) -> dict[str, Any]:
    """metadata.json of the checkpoint at ``load_dir`` when the run resumes it; empty when the
    run only takes its weights (``--finetune``) or it is Megatron-LM's."""
    if train.finetune or find_megatron_checkpoint(load_dir) is not None:
        return {}
    return load_checkpoint_metadata(load_dir)


def load(trainer: Trainer) -> str:
    """Load this rank's slices of ``setup.load_dir`` (any plan's checkpoint, or Megatron-LM's)
    and what :func:`load_choice` keeps of its training state; a model-only checkpoint (e.g.
    converted weights) starts a fresh optimizer at 0.

    The size of every file opened is checked and every piece read is sha256-verified; if any
    rank fails, every rank raises (one all-reduce over the world, plus one summing the bytes
    read). Returns the log line naming the source format, the iteration and what was loaded,
    with the load's time and GB/s (also printed when the logger is already set).
    """
    setup = trainer.setup
    assert setup.load_dir is not None
    start, stats = time.perf_counter(), ReadStats()
    try:
        loaded = _load_into(trainer, stats)
        error = None
    except Exception as exc:
        loaded, error = None, exc
    total, elapsed = _agree_loaded(trainer, error, stats, time.perf_counter() - start)
    assert loaded is not None  # else _agree_loaded raised
    if loaded.train_state is not None:
        _restore_progress(trainer, loaded.train_state, loaded.choice)
    line = (
        f" loaded checkpoint {setup.load_dir} {loaded.description} ({elapsed:.2f} s, "
        f"{total / _GB:.3f} GB read by {setup.plan.world_size} rank(s), "
        f"{total / _GB / max(elapsed, 1e-9):.2f} GB/s)"
    )
    trainer.print(line)
    return line


@dataclasses.dataclass(frozen=True)
class _Loaded:
    """A load's outcome on this rank: the training state to restore (None: nothing), what of
    it to restore (``choice``, narrowed to what the checkpoint has) and its log words."""

    train_state: dict | None
    choice: LoadChoice
    description: str


def _load_into(trainer: Trainer, stats: ReadStats) -> _Loaded:
    setup = trainer.setup
    assert setup.load_dir is not None  # as load() checks
    # Under mixed precision the parameters take the rounded values, the masters the exact
    # ones; in fp32 the parameters are the masters and nothing more is kept.
    weights: dict | None = {} if trainer.optimizer.flat.low_precision else None
    header = None
    if find_megatron_checkpoint(setup.load_dir) is not None:
        header = read_megatron_header(setup.load_dir, setup.model_config.vocab_size)
    choice = load_choice(setup.run.train, header)
    if header is not None:
        role = trainer.groups.role
        optimizer_state: dict | None = {} if choice.optimizer else None
        saved = load_megatron_slices(
            header.directory,
            setup.model_config,
            trainer.stage,
            role.stage_plan.tp,
            role.tp_rank,
            weights,
            stats,
            optimizer_state,
        )
        progress: dict[str, Any] = {
            "iteration": header.iteration,
            "consumed_samples": header.consumed_samples,
        }
        if saved is not None and saved.grad_scaler is not None:
            progress["loss_scaler"] = loss_scaler_state(saved.grad_scaler)
        train_state: dict | None = progress
        saved_iteration, source = header.iteration, header.source_format
    else:
        # The optimizer state stays on the host: the optimizer moves only the ranges this
        # rank owns (ZeRO-1) to its masters' device, so the stage's whole moments never sit
        # there.
        optimizer_state, train_state = load_sharded(
            setup.load_dir,
            setup.model_config,
            setup.plan,
            trainer.groups,
            trainer.stage,
            map_location="cpu",
            weights=weights,
            stats=stats,
            with_optimizer=choice.optimizer,
        )
        saved_iteration = int(load_checkpoint_metadata(setup.load_dir)["iteration"])
        source = "megatron_het"
    if weights is not None:
        trainer.optimizer.load_master_weights(weights)
    choice = LoadChoice(
        choice.progress and train_state is not None,
        choice.optimizer and train_state is not None and optimizer_state is not None,
        choice.rng and train_state is not None and train_state.get("rng") is not None,
    )
    if choice.optimizer:
        assert optimizer_state is not None  # as choice.optimizer says
        trainer.optimizer.load_state_dict(optimizer_state)
    description = _describe_load(source, saved_iteration, choice, setup.run.train, header)
    return _Loaded(train_state, choice, description)


def _describe_load(
    source: str,
    saved_iteration: int,
    choice: LoadChoice,
    train: TrainConfig,
    header: MegatronHeader | None,
) -> str:
    """``(SOURCE, iteration N): loaded model weights, ...; starts at iteration 0 ...``."""
    kept = ["model weights"]
    kept += ["optimizer state"] if choice.optimizer else []
    kept += ["RNG state"] if choice.rng else []
    kept += ["iteration and data position"] if choice.progress else []
    text = f"({source}, iteration {saved_iteration}): loaded {', '.join(kept)}"
    if not choice.progress:
        text += "; starts at iteration 0 with a fresh optimizer"
    elif not choice.optimizer:
        text += f"; a fresh optimizer, its LR schedule starting over at {saved_iteration}"
    if header is None:
        return text
    if choice.progress:
        text += "; the generators of --seed (Megatron-LM's RNG state is not carried)"
    elif not train.finetune and not header.release:
        text += (
            f" (as --finetune: {header.optimizer_problem}; pass --no-load-optim to continue "
            "at its iteration with a fresh optimizer)"
        )
    return text


def _restore_progress(trainer: Trainer, train_state: dict, choice: LoadChoice) -> None:
    """Restore what ``choice`` keeps of ``train_state``; the rest stays as a fresh run has
    it (iteration 0, a fresh loss scale, the generators of --seed)."""
    scaler = trainer.optimizer.loss_scaler
    if choice.optimizer and scaler is not None and train_state.get("loss_scaler") is not None:
        scaler.load_state_dict(train_state["loss_scaler"])
        trainer.optimizer.skipped_iterations = int(train_state.get("skipped_iterations", 0))
    if choice.rng:
        set_rng_state(train_state["rng"], trainer.device.type)
    if not choice.progress:
        return
    trainer.skipped_nonfinite = int(train_state.get("nonfinite_skipped_iterations", 0))
    trainer.progress = Progress(
        iteration=int(train_state["iteration"]),
        consumed_samples=int(train_state["consumed_samples"]),
    )
    # The LR schedule counts steps from where the (loaded) optimizer's schedule did; a fresh
    # optimizer's starts over here, as Megatron-LM's scheduler does under --no-load-optim.
    trainer.lr_schedule_start = (
        int(train_state.get("lr_schedule_start", 0))
        if choice.optimizer
        else trainer.progress.iteration
    )


# How long a rank looks for rank 0's marker before calling --save unshared (a network
# filesystem may show another client's new file a moment late).
_SHARED_LOOK_S = 10.0


def check_save_is_shared(save_dir: pathlib.Path, describe: Any) -> None:
    """Collective over the world (gloo, host tensors), at start-up: UserError on every rank when
    ``save_dir`` (``--save``) is not one directory for every rank, naming the ranks that do not
    see what rank 0 writes there. Every rank writes into rank 0's staging directory at each
    save, so a directory local to each node would otherwise fail only at the first save, and
    the elastic supervisors read their failure records there. ``describe(ranks)`` names ranks.
    Rank 0 creates ``save_dir`` if needed and removes its marker afterwards."""
    import secrets

    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    if size == 1:
        return
    token = torch.zeros(16, dtype=torch.uint8)
    marker_error = ""
    if rank == 0:
        token = torch.frombuffer(bytearray(secrets.token_bytes(16)), dtype=torch.uint8)
        marker = _marker(save_dir, token)
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            marker.write_text(marker.name)
        except OSError as exc:
            marker_error = f"rank 0 cannot write to --save {save_dir} ({exc})"
    failed = line_to_bytes(marker_error, 200)
    dist.broadcast(failed, 0)
    dist.broadcast(token, 0)
    if line_from_bytes(failed):
        raise UserError(line_from_bytes(failed))
    marker = _marker(save_dir, token)
    # A network filesystem's client that found no directory there before (the --load lookup
    # of a first run) may go on believing so for a while; creating it asks the server.
    if rank != 0:
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # then the marker is not seen, and that is reported
    deadline = time.monotonic() + _SHARED_LOOK_S
    while not (seen := _reads(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    flags = [torch.zeros(1, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(flags, torch.tensor([int(seen)], dtype=torch.uint8))
    if rank == 0:
        marker.unlink(missing_ok=True)
    blind = [r for r, flag in enumerate(flags) if not int(flag)]
    if blind:
        raise UserError(
            f"--save {save_dir} is not shared by every rank: {describe(blind)} do "
            "not see the file rank 0 wrote there; put --save (CHECKPOINT_DIR) on a "
            "filesystem every node mounts at the same path"
        )


def _marker(save_dir: pathlib.Path, token: torch.Tensor) -> pathlib.Path:
    return save_dir / f".shared-{bytes(token.tolist()).hex()}"


def _reads(marker: pathlib.Path) -> bool:
    try:
        return marker.read_text() == marker.name
    except OSError:
        return False
