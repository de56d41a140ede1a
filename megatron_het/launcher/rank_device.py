"""A launched rank's device: which visible device it drives, whether it is its kind, and the
kind of this machine's devices for a run without a cluster file.

Reads only this process's torch build and visible devices (a "cpu" rank hides the host's GPUs
from itself: :func:`select_local_device`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

from megatron_het.errors import UserError
from megatron_het.perf.measure.worker_processes import HIDING_VARIABLES


def npu_module() -> Any | None:
    """``torch.npu`` when Ascend's torch_npu is importable (importing it registers the module),
    else None."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return None
    import torch

    return getattr(torch, "npu", None)


def local_device_index(device_types: Sequence[str], local_rank: int) -> int:
    """Which of this node's visible devices local rank ``local_rank`` drives: its place among
    the node's ranks of its own device type. ``device_types`` holds the device type of each
    local rank of the node up to this one, in order. The launcher exposes the node's
    first devices (CUDA_VISIBLE_DEVICES=0,...), so on a node of GPU and CPU ranks the i-th GPU
    rank drives GPU i whichever local ranks the CPU ranks take."""
    mine = device_types[local_rank]
    return sum(1 for kind in device_types[:local_rank] if kind == mine)


def rank_device_index(device_type_of: Callable[[int], str], rank: int, local_rank: int) -> int:
    """:func:`local_device_index` of global ``rank``, ``local_rank`` on its node, where
    ``device_type_of(r)`` is global rank r's device type (its node's ranks are the
    ``local_rank`` before it)."""
    first = max(0, rank - local_rank)
    return local_device_index([device_type_of(r) for r in range(first, rank + 1)], rank - first)


def select_local_device(
    device_type: str | None,
    index: int,
    environ: MutableMapping[str, str] | None = None,
    hide_gpus: bool = True,
) -> None:
    """Make visible device ``index`` (:func:`local_device_index`) this process's current one:
    on a "cuda" rank (CUDA and ROCm) through ``torch.cuda.set_device``, on an "npu" rank
    (Ascend) through ``torch.npu.set_device`` when torch_npu is importable. Nothing when that
    device is not visible (:func:`device_problem` reports it on every rank; two ranks must
    never share a device).

    A "cpu" rank never touches torch.cuda and, with ``hide_gpus`` (a launched rank: the
    process is the rank's for its whole life), hides the host's GPUs from itself: the
    variables of :data:`~megatron_het.perf.measure.worker_processes.HIDING_VARIABLES` set empty in
    ``environ`` (default this process's environment, which the driver reads when first asked,
    so before that; it is then for the rest of the process and its children). So torch's own
    calls on such a rank (``torch.optim``'s step asks the current CUDA stream whether it is
    being captured; autograd starts per-device threads) create no CUDA context on GPU 0 beside
    the GPU ranks'. Nothing for any other device type (None: a run that chose no kind)."""
    if device_type == "cpu":
        if not hide_gpus:
            return
        env = os.environ if environ is None else environ
        for name in HIDING_VARIABLES:
            env[name] = ""
        return
    module = _device_module(device_type)
    if module is not None and index < module.device_count():
        module.set_device(index)


def _device_module(device_type: str | None) -> Any | None:
    if device_type == "cuda":
        import torch

        return torch.cuda
    return npu_module() if device_type == "npu" else None


# A device with less memory than this share of its kind's nominal memory is not that kind (a
# GPU reports a little less than its nominal size: an H200 139.8 of 141, an A100-80G 79.2).
_MEMORY_SHARE = 0.9


def device_problem(spec: Any, index: int = 0, identity: bool = True) -> str | None:
    """Why this process cannot be a rank of kind ``spec`` (an AcceleratorSpec) driving visible
    device ``index`` (:func:`local_device_index`), or None. ``identity=False`` leaves out the
    device's model and memory (a run without a cluster file, whose kind was taken from this
    device by its name: :func:`local_accelerator`).

    Checks what would otherwise hang or fail deep inside a backend, or run a plan made for
    other hardware: a GPU kind with no GPU visible, an AMD kind on a CUDA build of torch or an
    NVIDIA kind on a ROCm build (NCCL and RCCL ranks in one kind's group never connect), an
    Ascend kind without torch_npu, fewer devices visible than the node's ranks of the kind
    (ranks would share one), and a device that is not the kind: one of the built-in GPU
    models other than the kind's, or less memory than the kind has (nodes started in another
    order than the cluster file's). CPU and emulated kinds always fit. Reads only this
    process's torch build and visible devices."""
    if spec.device_type == "cpu" or spec.emulated:
        return None
    if spec.device_type == "npu":
        module = npu_module()
        if module is None:
            return "torch_npu is not importable here"
        count = module.device_count()
        if count == 0:
            return "no Ascend device is visible"
        return _too_few(index, count, "Ascend devices", "ASCEND_RT_VISIBLE_DEVICES")
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
    too_few = _too_few(
        index,
        torch.cuda.device_count(),
        "GPUs",
        "HIP_VISIBLE_DEVICES" if rocm else "CUDA_VISIBLE_DEVICES",
    )
    if too_few is not None or not identity:
        return too_few
    name = torch.cuda.get_device_name(index)
    memory_gib = torch.cuda.get_device_properties(index).total_memory / 2**30
    models = gpu_models(name)
    own = gpu_models(spec.name)
    if models and own and not models & own:
        return f"GPU {index} is {name!r}, not kind {spec.name}"
    if memory_gib < _MEMORY_SHARE * spec.memory_gib:
        return (
            f"GPU {index} ({name or 'unnamed'}) has {memory_gib:.1f} GiB, kind {spec.name} "
            f"{spec.memory_gib:g} GiB"
        )
    return None


def _too_few(index: int, count: int, what: str, variable: str) -> str | None:
    if index < count:
        return None
    return (
        f"it is the node's rank {index + 1} of its kind but only {count} {what} are "
        f"visible (set {variable}; under Slurm request the node's devices, e.g. "
        "sbatch --gpus-per-node)"
    )


def gpu_models(name: str) -> set[str]:
    """The built-in GPU models (the accelerator table's kind names without a memory suffix:
    H100, A100, MI300X ...) that a device or kind name names."""
    from megatron_het.cluster.accelerators import AcceleratorRegistry

    flat = name.upper().replace(" ", "").replace("-", "")
    return {
        _model(spec.name)
        for spec in AcceleratorRegistry.builtin()
        if spec.device_type == "cuda" and not spec.emulated and _model(spec.name) in flat
    }


def _model(kind: str) -> str:
    return kind.upper().split("-")[0]


def local_accelerator() -> str:
    """The accelerator kind of this machine's devices for a run without ``--cluster``: the
    built-in kind whose name the first CUDA/ROCm device's name contains, else "cpu". UserError
    for a GPU the accelerator table does not know (describe it in a cluster file)."""
    import torch

    from megatron_het.cluster.accelerators import AcceleratorRegistry

    if not torch.cuda.is_available():
        return "cpu"
    device_name = torch.cuda.get_device_name(0)
    memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    models = gpu_models(device_name)
    matches = [
        spec
        for spec in AcceleratorRegistry.builtin()
        if spec.device_type == "cuda" and _model(spec.name) in models
    ]
    if matches:  # A100-40G or A100-80G: the nearest memory size
        return min(matches, key=lambda spec: abs(spec.memory_gib - memory_gib)).name
    raise UserError(
        f"this machine's GPU {device_name!r} is not in the accelerator table; pass "
        "--cluster with a node group of its kind (see scripts/clusters/)"
    )
