"""The training state a checkpoint carries besides the weights, and restoring it.

Stored with ``torch.save`` and read with ``weights_only=True``, so it holds only tensors and plain
Python values: numpy's RNG key is kept as a tensor.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_het.optim.lr_schedule import LRSchedule
from megatron_het.optim.optimizer import load_optimizer_state_by_name, optimizer_state_by_name

TRAIN_STATE_VERSION = 1


@dataclass
class Progress:
    """Where training stands: optimizer steps taken and training samples consumed.

    The next iteration is ``iteration + 1`` and reads train samples from
    ``consumed_samples`` on.
    """

    iteration: int = 0
    consumed_samples: int = 0


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (all devices)."""
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (when present) CUDA generator states."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np.asarray(np_state["state"]["key"], dtype=np.int64)),
                  "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore generator states saved by :func:`rng_state` (CUDA only where present both times)."""
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state({"bit_generator": np_state["bit_generator"],
                         "state": {"key": np_state["key"].numpy().astype(np.uint32),
                                   "pos": np_state["pos"]},
                         "has_gauss": np_state["has_gauss"], "gauss": np_state["gauss"]})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def capture_train_state(optimizer: torch.optim.Optimizer, schedule: LRSchedule,
                        progress: Progress) -> dict[str, Any]:
    """Everything but the weights needed to continue exactly where training stands."""
    return {"version": TRAIN_STATE_VERSION, "iteration": progress.iteration,
            "consumed_samples": progress.consumed_samples,
            "optimizer": optimizer_state_by_name(optimizer),
            "lr_schedule": schedule.state_dict(), "rng": rng_state()}


def restore_train_state(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> Progress:
    """Load optimizer and RNG state in place; returns the saved progress.

    The LR schedule is not restored: it is a pure function of the iteration and the command
    line's schedule flags apply.
    """
    load_optimizer_state_by_name(optimizer, state["optimizer"])
    set_rng_state(state["rng"])
    return Progress(iteration=int(state["iteration"]),
                    consumed_samples=int(state["consumed_samples"]))
