"""Whether a prediction's peak memory fits the devices of a cluster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_het.cluster import ClusterSpec
from megatron_het.errors import UserError
from megatron_het.perf.cost.memory import GIB, RESERVED_FRACTION, device_capacity_bytes
from megatron_het.perf.estimates import Prediction, StagePrediction


@dataclass(frozen=True)
class MemoryFit:
    """The result of :func:`fits`: ``headroom_bytes`` is the smallest headroom of any device
    (negative: it does not fit), ``worst`` the stage with it, ``message`` one line."""

    ok: bool
    headroom_bytes: float
    worst: StagePrediction | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "headroom_bytes": self.headroom_bytes, "message": self.message}


def fits(
    prediction: Prediction, cluster: ClusterSpec, reserved_fraction: float = RESERVED_FRACTION
) -> MemoryFit:
    """Compare every stage's predicted peak with its devices' usable memory.

    Usable memory is the capacity (:func:`device_capacity_bytes`) less ``reserved_fraction``.
    The message names the tightest device: its stage, or for an interleaved device group (whose
    rows all carry the whole device's bytes) its ranks and all its chunks.
    """
    worst, worst_room = None, float("inf")
    for stage in prediction.stages:
        usable = device_capacity_bytes(cluster.accelerator_of(stage.ranks[0])) * (
            1.0 - reserved_fraction
        )
        room = usable - stage.memory.total_bytes
        if room < worst_room:
            worst, worst_room = stage, room
    if worst is None:
        return MemoryFit(True, float("inf"), None, "no stages")
    spec = cluster.accelerator_of(worst.ranks[0])
    where = _where(prediction, worst, spec.label)
    need = worst.memory.total_bytes / GIB
    have = device_capacity_bytes(spec) * (1.0 - reserved_fraction) / GIB
    if worst_room >= 0:
        return MemoryFit(
            True,
            worst_room,
            worst,
            f"fits: the tightest device is {where} at {need:.1f} of {have:.1f} GiB usable",
        )
    return MemoryFit(
        False,
        worst_room,
        worst,
        (
            f"{where} needs {need:.1f} GiB per device but {have:.1f} GiB is usable; give it fewer "
            f"layers, a larger tp, recompute, ZeRO-1 or fewer micro-batches in flight"
        ),
    )


def _where(prediction: Prediction, worst: StagePrediction, label: str) -> str:
    """The device the figure is for: a stage, or an interleaved device group with its ranks and
    every chunk's layers (its memory holds all of them)."""
    chunks = [
        s for s in prediction.stages if s.pipeline == worst.pipeline and s.ranks == worst.ranks
    ]
    if len(chunks) == 1:
        return (
            f"stage {worst.stage} of pipeline {worst.pipeline} ({label}, tp={worst.tp}, "
            f"layers [{worst.layers[0]}, {worst.layers[1]}))"
        )
    layers = ", ".join(f"[{s.layers[0]}, {s.layers[1]})" for s in chunks)
    ranks = ", ".join(map(str, worst.ranks))
    return (
        f"the device group of ranks {ranks} in pipeline {worst.pipeline} ({label}, "
        f"tp={worst.tp}, stages {', '.join(str(s.stage) for s in chunks)} with layers "
        f"{layers})"
    )


def check_fits(prediction: Prediction, cluster: ClusterSpec) -> None:
    """Raise a UserError with :func:`fits`'s message if any device would run out of memory."""
    result = fits(prediction, cluster)
    if not result.ok:
        raise UserError(result.message)


__all__ = ["MemoryFit", "check_fits", "fits"]
