"""Saving and loading a trainer: sharded checkpoints of any plan, one process included.

Every rank writes its pieces and one rank commits (:mod:`megatron_het.checkpoint.sharded`); a
load reads this rank's slices from a checkpoint of any plan, or of a single process in the
format written before every run became a plan (full tensors, the optimizer state by name in the
training state), and continues at its iteration, data position and RNG state.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import TYPE_CHECKING, Optional

from megatron_het.checkpoint.sharded import load_sharded, save_sharded
from megatron_het.training.state import Progress, rng_state, set_rng_state

if TYPE_CHECKING:  # pragma: no cover
    from megatron_het.training.trainer import Trainer


def save(trainer: "Trainer") -> Optional[pathlib.Path]:
    """Sharded checkpoint of the current iteration (collective; None without ``--save``)."""
    setup, progress = trainer.setup, trainer.progress
    run = setup.run
    if run.train.save is None:
        return None
    start = time.perf_counter()
    train_state = {"iteration": progress.iteration, "consumed_samples": progress.consumed_samples,
                   "lr_schedule": trainer.schedule.state_dict(),
                   "rng": rng_state(trainer.device.type)}
    scaler = trainer.optimizer.loss_scaler
    if scaler is not None:
        train_state["loss_scaler"] = scaler.state_dict()
        train_state["skipped_iterations"] = trainer.optimizer.skipped_iterations
    metadata = {"argv": list(run.argv), "consumed_samples": progress.consumed_samples,
                "run_config": dataclasses.asdict(run), "plan": setup.plan.to_dict(),
                "cluster": setup.cluster.name}
    path = save_sharded(run.train.save, progress.iteration, setup.model_config, setup.plan,
                        trainer.groups, trainer.stage, trainer.optimizer.state_dict(),
                        train_state, metadata, weights=trainer.optimizer.master_weights())
    trainer.print(f" saved checkpoint at iteration {progress.iteration} to {path} "
                  f"({time.perf_counter() - start:.2f} s)")
    return path


def load(trainer: "Trainer") -> None:
    """Load this rank's slices of ``setup.load_dir`` (any plan's checkpoint) and its training
    state; a model-only checkpoint (e.g. converted weights) starts a fresh optimizer at 0."""
    setup = trainer.setup
    assert setup.load_dir is not None
    # Under mixed precision the parameters take the rounded values, the masters the exact
    # ones; in fp32 the parameters are the masters and nothing more is kept.
    weights: Optional[dict] = {} if trainer.optimizer.flat.low_precision else None
    optimizer_state, train_state = load_sharded(
        setup.load_dir, setup.model_config, setup.plan, trainer.groups, trainer.stage,
        map_location=trainer.device, weights=weights)
    if weights is not None:
        trainer.optimizer.load_master_weights(weights)
    if train_state is None:
        return
    if optimizer_state is not None:
        trainer.optimizer.load_state_dict(optimizer_state)
    scaler = trainer.optimizer.loss_scaler
    if scaler is not None and train_state.get("loss_scaler") is not None:
        scaler.load_state_dict(train_state["loss_scaler"])
        trainer.optimizer.skipped_iterations = int(train_state.get("skipped_iterations", 0))
    if train_state.get("rng") is not None:
        set_rng_state(train_state["rng"], trainer.device.type)
    trainer.progress = Progress(iteration=int(train_state["iteration"]),
                                consumed_samples=int(train_state["consumed_samples"]))
