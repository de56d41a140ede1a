"""An emulated cluster with its kinds' slowdowns scaled, for hosts with fewer cores than ranks.

Scaling every emulated kind's slowdown by a factor F keeps their speed ratios and makes each
emulated device need 1 / F of a host core per unit of its own time, so a host with fewer cores
than emulated devices does not decide the figures (see :mod:`megatron_het.emulation.emulator`).
Everything here is EMULATION.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from megatron_het.cluster import ClusterSpec


def dilated_cluster(path: Path, dilation: float) -> dict[str, Any]:
    """The cluster file at ``path`` as a mapping, every group's kind with its slowdown x
    ``dilation`` (an ``accelerators:`` override; the name gets an ``_x<F>`` suffix)."""
    if dilation < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation}")
    data = yaml.safe_load(Path(path).read_text())
    if dilation == 1.0:
        return data
    spec = ClusterSpec.load(path)
    overrides = dict(data.get("accelerators") or {})
    for group in data["node_groups"]:
        kind = spec.accelerator_of(spec.ranks_of_accelerator(group["accelerator"])[0])
        overrides[kind.name] = {
            **overrides.get(kind.name, {}),
            "slowdown": kind.slowdown * dilation,
        }
    return {**data, "accelerators": overrides, "name": f"{data['name']}_x{dilation:g}"}
