"""Where training stands and the random generators' state, as a checkpoint carries them.

Stored with ``torch.save`` and read with ``weights_only=True``, so it holds only tensors and plain
Python values: numpy's RNG key is kept as a tensor.

The accelerator's generator is that of the rank's own device (the current one, under the key
"cuda" or "npu"), restored onto the device the rank runs on at load: a relaunch that moved the
rank to another device index (fewer devices, an elastic restart) restores it there. A "cpu" rank
never calls torch.cuda (a CPU rank on a GPU host must not create a CUDA context); without a device
type, only an accelerator this process has already initialised is asked, so the call never
initialises one either.
"""

from __future__ import annotations

import random
import sys
import warnings
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
    """Seed Python's, numpy's and torch's global generators (all devices; torch defers the
    accelerators' seeds until they are initialised, so this creates no device context)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _accelerator_generators(device_type: str | None) -> tuple[str, Any] | None:
    """(state key, torch module) of the accelerator generators a rank of ``device_type``
    keeps, or None (a "cpu" rank, an "npu" rank without torch_npu, or, with ``device_type``
    None, no accelerator initialised in this process)."""
    from megatron_het.launcher.rank_device import npu_module

    if device_type == "cuda":
        return "cuda", torch.cuda
    if device_type == "npu":
        npu = npu_module()
        return ("npu", npu) if npu is not None else None
    if device_type is not None:
        return None
    if torch.cuda.is_initialized():
        return "cuda", torch.cuda
    npu = npu_module() if "torch_npu" in sys.modules else None  # never imported here first
    if npu is not None and npu.is_initialized():
        return "npu", npu
    return None


def rng_state(device_type: str | None = None) -> dict[str, Any]:
    """Python, numpy and torch CPU generator states, and that of the rank's own device of its
    accelerator (``device_type`` "cuda" or "npu"; see the module docstring for "cpu" and
    None)."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np.asarray(np_state["state"]["key"], dtype=np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    generators = _accelerator_generators(device_type)
    if generators is not None:
        key, module = generators
        state[key] = module.get_rng_state(module.current_device())
    return state


def set_rng_state(state: dict[str, Any], device_type: str | None = None) -> None:
    """Restore generator states saved by :func:`rng_state`. The accelerator's goes to the
    rank's current device, wherever it saved from (a state saved as one per visible device
    restores the entry of the current device's index, if it has one); a state without this
    rank's accelerator, or a "cpu" rank, restores none."""
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_state["bit_generator"],
            "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    generators = _accelerator_generators(device_type)
    if generators is None or generators[0] not in state:
        return
    key, module = generators
    saved, current = state[key], module.current_device()
    if isinstance(saved, (list, tuple)):  # one state per visible device
        if current < len(saved):
            module.set_rng_state(saved[current], current)
        else:
            warnings.warn(
                f"the checkpoint holds {key} generator states of {len(saved)} "
                f"devices, none for device {current}: its generator keeps its "
                "state",
                stacklevel=2,
            )
        return
    module.set_rng_state(saved, current)
