"""Megatron-LM's ``--wandb-project``: the run's scalars in Weights & Biases, beside tensorboard.

wandb is optional: it is imported only when a run asks for it, and a run that asks without it
installed stops before training with one line. The logging rank starts one wandb run (project
``--wandb-project``, name ``--wandb-exp-name``, files under ``--wandb-save-dir`` or
``<--save>/wandb``, the run's configuration as its config) and logs every scalar the
tensorboard writer gets, at the same iteration: losses, LR, throughput and TFLOP/s per kind
(emulated kinds labelled as such), per-stage times and the straggler figures. wandb's own
settings apply as usual (``WANDB_MODE=offline`` keeps the run on disk for ``wandb sync``).
"""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Mapping
from typing import Any

from megatron_het.config import TrainConfig, WandbConfig
from megatron_het.errors import UserError


def check_wandb(config: WandbConfig) -> None:
    """Before training: UserError (one line) when a project is asked for and wandb is not
    installed."""
    if config.project is not None and importlib.util.find_spec("wandb") is None:
        raise UserError(
            "--wandb-project needs the wandb package, which is not installed: "
            "pip install wandb, or drop the --wandb-* flags"
        )


def wandb_directory(train: TrainConfig) -> pathlib.Path | None:
    """Where the wandb run's files go: ``--wandb-save-dir``, else ``<--save>/wandb``, else
    wandb's own default (None)."""
    if train.wandb.save_dir is not None:
        return pathlib.Path(train.wandb.save_dir)
    if train.save is not None:
        return pathlib.Path(train.save) / "wandb"
    return None


class WandbLog:
    """One wandb run of the logging rank. ``config`` is recorded as the run's config."""

    def __init__(self, train: TrainConfig, config: Mapping[str, Any]) -> None:
        import wandb

        directory = wandb_directory(train)
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=train.wandb.project,
            name=train.wandb.exp_name,
            entity=train.wandb.entity,
            dir=None if directory is None else str(directory),
            config=dict(config),
        )

    def log(self, iteration: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=iteration)

    def finish(self) -> None:
        self.run.finish()
