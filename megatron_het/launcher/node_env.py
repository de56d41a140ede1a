"""A node's environment for its ranks: per-vendor settings, the site's network, its own file.

Every node gets :data:`COMMON`, then the settings of each vendor its ranks drive (the cluster
files' vendor names), then the file named by HET_EXTRA_ENV, sourced last. A setting is a
default: a site's own value (already exported, non-empty) is kept. Values in the tables are
literal, except :data:`DEVICES` (the node's first devices of that vendor, ``0,1,...,n-1``) and
``$NAME`` (the site's variable NAME: its value, or no setting where it is unset).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from megatron_het.errors import UserError
from megatron_het.launcher.node_facts import NodeFacts
from megatron_het.launcher.shell_env import source_shell_file

DEVICES = "<devices>"
# The variable that lists a vendor's visible devices (the supervisor leaves a lost one out).
VISIBLE_DEVICES = {
    "nvidia": "CUDA_VISIBLE_DEVICES",
    "amd": "HIP_VISIBLE_DEVICES",
    "huawei": "ASCEND_RT_VISIBLE_DEVICES",
}

Settings = tuple[tuple[str, str], ...]

# Every node, whatever its vendor.
COMMON: Settings = (
    # The relay bridge between kinds stages through host memory and gloo over TCP: pin gloo to
    # the fast host interface when the site names one.
    ("GLOO_SOCKET_IFNAME", "$HET_SOCKET_IFNAME"),
    # One OpenMP thread per rank for host-side work (data loading, relay copies): the
    # accelerator does the math, and oversubscribed host threads only add jitter.
    ("OMP_NUM_THREADS", "1"),
)

# NCCL's (and RCCL's, which reads the same names) site network: bootstrap interface, IB adapters.
_NCCL_NETWORK: Settings = (
    ("NCCL_SOCKET_IFNAME", "$HET_SOCKET_IFNAME"),
    ("NCCL_IB_HCA", "$HET_IB_HCA"),
)

VENDORS: dict[str, Settings] = {
    # NVIDIA GPUs: torch's nccl backend runs NCCL.
    "nvidia": (
        # One hardware work queue, so a tensor-parallel collective is issued before the
        # compute that follows it (Megatron's ordering assumption for overlapping TP comm).
        ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
        # Expose exactly this node's GPUs for its ranks; its i-th GPU rank drives GPU i.
        ("CUDA_VISIBLE_DEVICES", DEVICES),
        # A failed or hung collective aborts the process (and the job) instead of hanging.
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        # Longer InfiniBand retry timeout (4.096 us * 2^22): large fabrics see transient stalls.
        ("NCCL_IB_TIMEOUT", "22"),
        # Warnings only; set NCCL_DEBUG=INFO to see the rings/trees NCCL builds.
        ("NCCL_DEBUG", "WARN"),
        *_NCCL_NETWORK,
    ),
    # AMD Instinct GPUs (ROCm): torch's nccl backend runs RCCL.
    "amd": (
        # Expose exactly this node's GPUs (GCDs on MI250X); its i-th GPU rank drives device i.
        ("HIP_VISIBLE_DEVICES", DEVICES),
        # Same ordering assumption as on NVIDIA (ROCm's torch honours the CUDA name).
        ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
        # Fine-grained host memory over PCIe, which RCCL's peer-to-peer and network paths need.
        ("HSA_FORCE_FINE_GRAIN_PCIE", "1"),
        # Keep scratch memory allocated between kernels: reclaiming it stalls long runs.
        ("HSA_NO_SCRATCH_RECLAIM", "1"),
        # RoCE v2 fabrics usually expose the routable (IPv4-mapped) GID at index 3.
        ("NCCL_IB_GID_INDEX", "3"),
        # Abort on a failed collective instead of hanging (RCCL through torch's nccl backend).
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        ("NCCL_DEBUG", "WARN"),
        *_NCCL_NETWORK,
    ),
    # Huawei Ascend NPUs: torch_npu's hccl backend runs HCCL (after CANN's own set_env.sh).
    "huawei": (
        # Expose exactly this node's NPUs for its ranks; its i-th NPU rank drives NPU i.
        ("ASCEND_RT_VISIBLE_DEVICES", DEVICES),
        # Seconds HCCL waits for every rank to join a communicator: hundreds of ranks need
        # minutes.
        ("HCCL_CONNECT_TIMEOUT", "1200"),
        # Seconds a collective may block before HCCL reports it as hung.
        ("HCCL_EXEC_TIMEOUT", "1800"),
        # Per-communicator buffer in MB: room for the large DP gradient buckets.
        ("HCCL_BUFFSIZE", "200"),
        # CANN logs errors only (0 debug .. 3 error); plog files otherwise grow quickly.
        ("ASCEND_GLOBAL_LOG_LEVEL", "3"),
        # torch_npu's asynchronous task queue: launches overlap host-side operator dispatch.
        ("TASK_QUEUE_ENABLE", "1"),
        # Expandable allocator segments: less fragmentation with changing activation sizes.
        ("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True"),
        ("HCCL_SOCKET_IFNAME", "$HET_SOCKET_IFNAME"),
    ),
    # Another vendor's accelerators get nothing beyond the abort-on-failure setting: put the
    # vendor's own variables in the file named by HET_EXTRA_ENV.
    "other": (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),),
    # CPU ranks (plain or emulated kinds) run gloo only.
    "cpu": (),
}

# The CANN toolkit's environment (library paths, ASCEND_HOME_PATH, ...), sourced on an Ascend
# node before its settings, beside the toolkit ASCEND_TOOLKIT_HOME names (or the default one).
_CANN_HOME = "/usr/local/Ascend/ascend-toolkit/latest"

Source = Callable[[str, Mapping[str, str]], dict[str, str]]


def node_environment(
    node: NodeFacts, environ: Mapping[str, str], source: Source = source_shell_file
) -> dict[str, str]:
    """The environment of ``node``'s ranks: ``environ`` (the site's) with the settings of the
    module docstring applied in order. ``source`` sources a shell file in an environment
    (Ascend's CANN file where it exists, then HET_EXTRA_ENV's). UserError for a vendor the
    tables do not know."""
    env = dict(environ)
    _apply(env, COMMON, 0)
    for vendor in node.vendors:
        if vendor not in VENDORS:
            raise UserError(
                f"unknown vendor '{vendor}' in the cluster file; use nvidia, amd, huawei, cpu "
                "or other"
            )
        if vendor == "huawei":
            cann = Path(env.get("ASCEND_TOOLKIT_HOME") or _CANN_HOME) / ".." / "set_env.sh"
            if cann.is_file():
                env = source(str(cann), env)
        _apply(env, VENDORS[vendor], node.npus if vendor == "huawei" else node.gpus)
    extra = env.get("HET_EXTRA_ENV")
    if extra:
        env = source(extra, env)
    return env


def changed(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, str]:
    """The variables ``after`` sets that ``before`` lacks or holds another value of, sorted by
    name (what print-only lists)."""
    return {name: after[name] for name in sorted(after) if before.get(name) != after[name]}


def _apply(env: dict[str, str], settings: Settings, devices: int) -> None:
    for name, value in settings:
        if env.get(name):  # the site's own value
            continue
        if value == DEVICES:
            value = ",".join(str(i) for i in range(devices))
        elif value.startswith("$"):
            value = env.get(value[1:], "")
            if not value:
                continue
        env[name] = value
