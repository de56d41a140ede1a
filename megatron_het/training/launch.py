"""torchrun's environment -> the world process group.

The only library module that reads environment variables: the entry point hands it
``os.environ`` and gets a :class:`LaunchEnv` back. Everything after the world group is built
goes through the unified communicator.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Mapping, Optional

from megatron_het.errors import UserError

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the launched job (torchrun's variables)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def launched_by_torchrun(environ: Mapping[str, str]) -> bool:
    """True when ``environ`` carries a launcher's rank variables (RANK and WORLD_SIZE)."""
    return "RANK" in environ and "WORLD_SIZE" in environ


def read_launch_env(environ: Mapping[str, str]) -> LaunchEnv:
    """Parse RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; UserError if absent."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [name for name in names if not environ.get(name)]
    if missing:
        raise UserError(f"{', '.join(missing)} not set; launch the parallel run with torchrun "
                        "(python -m torch.distributed.run --nproc_per_node N pretrain_llama.py "
                        "...) or use --dry-run")
    try:
        values = {name: int(environ[name]) for name in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        local_rank = int(environ.get("LOCAL_RANK", values["RANK"]))
    except ValueError:
        raise UserError("RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers; launch "
                        "with torchrun") from None
    if not 0 <= values["RANK"] < values["WORLD_SIZE"]:
        raise UserError(f"RANK {values['RANK']} is outside WORLD_SIZE {values['WORLD_SIZE']}; "
                        "launch with torchrun")
    return LaunchEnv(values["RANK"], values["WORLD_SIZE"], local_rank, environ["MASTER_ADDR"],
                     values["MASTER_PORT"])


def init_world(env: LaunchEnv, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
               device_type: Optional[str] = None) -> None:
    """Initialise torch.distributed's default (world) group: gloo, over ``env.init_method``.

    The world group only bootstraps the unified communicator, which builds each kind's native
    groups itself; gloo works for every kind. On a CUDA/ROCm rank (``device_type == "cuda"``)
    the local device is selected first. Side effect: global torch.distributed state.
    """
    import torch
    import torch.distributed as dist

    if device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=env.init_method, rank=env.rank,
                            world_size=env.world_size, timeout=timeout)


def shutdown_world() -> None:
    """Destroy the world group if one is initialised."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
