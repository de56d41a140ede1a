"""Which accelerator this process runs on: the device's own name, and the registry kind that
name stands for (the profile's ``accelerator`` by default)."""

from __future__ import annotations

import contextlib
import platform
import re

import torch

from megatron_het.cluster.accelerators import AcceleratorRegistry


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def accelerator_for_device(
    name: str, memory_gib: float | None = None, registry: AcceleratorRegistry | None = None
) -> str | None:
    """The registry kind a device name stands for ("NVIDIA H100 80GB HBM3" -> "H100"), or None.

    A kind matches when a word of the name starts with the kind's model ("A100" of
    "A100-80G"); between several, the one whose memory is closest to ``memory_gib`` (else to
    the name's "<N>GB"), else the first.
    """
    registry = registry or AcceleratorRegistry.builtin()
    words = re.findall(r"[A-Z0-9]+", name.upper())
    matches = [
        spec
        for spec in registry
        if spec.vendor != "cpu"
        and not spec.emulated
        and any(w.startswith(spec.name.split("-")[0].upper()) for w in words)
    ]
    if not matches:
        return None
    if memory_gib is None:
        sizes = [int(w[:-2]) for w in words if re.fullmatch(r"\d+GB", w)]
        memory_gib = float(sizes[0]) if sizes else None
    if memory_gib is None:
        return matches[0].name
    return min(matches, key=lambda spec: abs(spec.memory_gib - memory_gib)).name


def default_accelerator(device: torch.device) -> str:
    """ "cpu" on a CPU; on a GPU its registry kind, else its name with non-word characters
    replaced by "_"."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    memory = torch.cuda.get_device_properties(device).total_memory / 2**30
    return accelerator_for_device(name, memory) or re.sub(r"\W+", "_", name).strip("_")


__all__ = ["accelerator_for_device", "default_accelerator", "device_name"]
