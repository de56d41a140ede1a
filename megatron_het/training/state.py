"""Where training stands and the random generators' state, as a checkpoint carries them.

Stored with ``torch.save`` and read with ``weights_only=True``, so it holds only tensors and plain
Python values: numpy's RNG key is kept as a tensor.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


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
