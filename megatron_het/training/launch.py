"""torchrun's environment (or a single process) -> the world process group.

The entry point hands :func:`read_launch_env` ``os.environ`` and gets a :class:`LaunchEnv` back;
library code reads no environment variable. A single process gets a world of one rank in this
process (:func:`init_world` without an env), so it runs the same trainer as a launched job.
Everything after the world group is built goes through the unified communicator.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from megatron_het.comm.faults import first_line
from megatron_het.errors import PeerFailure, UserError

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the launched job (torchrun's variables)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    restart_count: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT: which launch of the job
    local_world_size: int = 0  # torchrun's LOCAL_WORLD_SIZE: ranks on this node (0: unknown)
    run_id: str = ""  # torchrun's TORCHELASTIC_RUN_ID (--rdzv-id): which job ("": none given)

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def launched_by_torchrun(environ: Mapping[str, str]) -> bool:
    """True when ``environ`` carries a launcher's rank variables (RANK and WORLD_SIZE)."""
    return "RANK" in environ and "WORLD_SIZE" in environ


def read_launch_env(environ: Mapping[str, str]) -> LaunchEnv:
    """Parse RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (UserError if absent),
    and torchrun's TORCHELASTIC_RESTART_COUNT, LOCAL_WORLD_SIZE and TORCHELASTIC_RUN_ID where
    set."""
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
                     values["MASTER_PORT"], _optional_int(environ, "TORCHELASTIC_RESTART_COUNT"),
                     _optional_int(environ, "LOCAL_WORLD_SIZE"),
                     environ.get("TORCHELASTIC_RUN_ID", ""))


def _optional_int(environ: Mapping[str, str], name: str) -> int:
    """``environ[name]`` as a non-negative integer; 0 where it is absent or not one."""
    try:
        return max(int(environ.get(name, "0") or 0), 0)
    except ValueError:
        return 0


def init_world(env: Optional[LaunchEnv], timeout: datetime.timedelta = DEFAULT_TIMEOUT,
               device_type: Optional[str] = None) -> None:
    """Initialise torch.distributed's default (world) group with gloo: over
    ``env.init_method``, or, without an env, a world of this one process (an in-memory store).

    The world group only bootstraps the unified communicator, which builds each kind's native
    groups itself; gloo works for every kind. The rank's local device is selected first (see
    :func:`select_local_device`; a "cpu" rank leaves torch.cuda alone). Side effect: global
    torch.distributed state; raises RuntimeError when a world is already initialised.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised; train on that world with "
                           "megatron_het.training.pretrain_on_world")
    select_local_device(device_type, env.local_rank if env is not None else 0)
    if env is None:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    try:
        dist.init_process_group("gloo", init_method=env.init_method, rank=env.rank,
                                world_size=env.world_size, timeout=timeout)
    except RuntimeError as exc:
        raise StartupError(
            f"start-up: rank {env.rank} could not join the {env.world_size}-rank rendezvous at "
            f"{env.master_addr}:{env.master_port} within {timeout.total_seconds() / 60:g} "
            f"min ({first_line(exc)}); start every rank (torchrun on every node) or raise "
            "--distributed-timeout-minutes") from None


class StartupError(PeerFailure):
    """Not every rank joined the job's rendezvous within the timeout."""


def connect_store(env: LaunchEnv, timeout: datetime.timedelta) -> Any:
    """A client of the job's rendezvous store (torchrun's agent serves it, or rank 0 without
    torchrun), for the ranks' heartbeats (:mod:`megatron_het.training.peer_watch`)."""
    import torch.distributed as dist

    return dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                         timeout=timeout, wait_for_workers=False)


def npu_module() -> Optional[Any]:
    """``torch.npu`` when Ascend's torch_npu is importable (importing it registers the module),
    else None."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return None
    import torch

    return getattr(torch, "npu", None)


def select_local_device(device_type: Optional[str], local_rank: int) -> None:
    """Make device ``local_rank`` (modulo the visible devices) this process's current one: on a
    "cuda" rank (CUDA and ROCm) through ``torch.cuda.set_device``, on an "npu" rank (Ascend)
    through ``torch.npu.set_device`` when torch_npu is importable. Nothing where no device is
    visible, and for any other device type ("cpu" included), which never touches torch.cuda:
    a CPU rank on a GPU host creates no CUDA context."""
    if device_type == "cuda":
        import torch

        module: Optional[Any] = torch.cuda
    elif device_type == "npu":
        module = npu_module()
    else:
        return
    count = module.device_count() if module is not None else 0
    if count > 0:
        module.set_device(local_rank % count)


def device_problem(spec: Any) -> Optional[str]:
    """Why this process cannot be a rank of kind ``spec`` (an AcceleratorSpec), or None.

    Checks what would otherwise hang or fail deep inside a backend: a GPU kind with no GPU
    visible, an AMD kind on a CUDA build of torch or an NVIDIA kind on a ROCm build (NCCL and
    RCCL ranks in one kind's group never connect), an Ascend kind without torch_npu. CPU and
    emulated kinds always fit. Reads only this process's torch build and visible devices."""
    if spec.device_type == "cpu" or spec.emulated:
        return None
    if spec.device_type == "npu":
        module = npu_module()
        if module is None:
            return "torch_npu is not importable here"
        return None if module.device_count() > 0 else "no Ascend device is visible"
    if spec.device_type != "cuda":
        return None
    import torch

    rocm = torch.version.hip is not None
    if spec.vendor == "amd" and not rocm:
        return "an AMD kind on a torch built without ROCm"
    if spec.vendor == "nvidia" and rocm:
        return "an NVIDIA kind on a torch built for ROCm"
    if not torch.cuda.is_available():
        return "no GPU is visible"
    return None


def local_accelerator() -> str:
    """The accelerator kind of this machine's devices for a run without ``--cluster``: the
    built-in kind whose name the first CUDA/ROCm device's name contains, else "cpu". UserError
    for a GPU the accelerator table does not know (describe it in a cluster file)."""
    import torch

    from megatron_het.cluster.accelerators import AcceleratorRegistry

    if not torch.cuda.is_available():
        return "cpu"
    device_name = torch.cuda.get_device_name(0)
    memory_gib = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    flat = device_name.upper().replace(" ", "").replace("-", "")
    matches = [spec for spec in AcceleratorRegistry.builtin()
               if spec.device_type == "cuda" and spec.name.upper().split("-")[0] in flat]
    if matches:  # A100-40G or A100-80G: the nearest memory size
        return min(matches, key=lambda spec: abs(spec.memory_gib - memory_gib)).name
    raise UserError(f"this machine's GPU {device_name!r} is not in the accelerator table; pass "
                    "--cluster with a node group of its kind (see scripts/clusters/)")


def shutdown_world() -> None:
    """Destroy the world group if one is initialised."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
