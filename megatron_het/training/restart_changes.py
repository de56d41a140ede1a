"""What changed since the loaded checkpoint was written: devices and plan, for the start-up log.

A run that lost devices restarts on a cluster file without them, with ``--plan auto`` or a new
plan, and ``--load`` of the same checkpoint: loading reshards every tensor to the new plan
(:mod:`megatron_het.checkpoint.sharded`) and the run continues at the checkpoint's iteration,
global batch and data position. :func:`describe_restart` says so in a few lines: the devices
(by kind) and plan that wrote the checkpoint, those of now, and the predictor's iteration time
for the new plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from megatron_het.cluster.accelerators import AcceleratorRegistry
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.stage_plan import format_bound
from megatron_het.training.setup import RunSetup


def devices_by_kind(plan: ParallelPlan) -> dict[str, int]:
    """Ranks of ``plan`` per accelerator name, in order of first appearance."""
    counts: Counter[str] = Counter()
    for rank in plan.ranks():
        counts[plan.rank_role(rank).stage_plan.accelerator] += 1
    return dict(counts)


def short_plan(plan: ParallelPlan) -> str:
    """``dp=2 mbs=2: [emu-fast tp1 L0-2 -> emu-slow tp1 L3] mb2 x2``: the distinct pipelines
    (stages with kind, TP and layers; micro-batches), with counts."""
    layouts: Counter[str] = Counter()
    for pipeline in plan.pipelines:
        stages = " -> ".join(
            f"{s.accelerator} tp{s.tp} {_layers(s.layers)}" for s in pipeline.stages
        )
        layouts[f"[{stages}] mb{pipeline.micro_batches}"] += 1
    body = ", ".join(
        f"{layout} x{count}" if count > 1 else layout for layout, count in layouts.items()
    )
    return f"dp={plan.dp_size} mbs={plan.micro_batch_size}: {body}"


def _layers(layers: tuple[float, float]) -> str:
    """``L0-2`` for layers [0, 3); a half-layer bound prints as itself: ``L[0, 1.5)``."""
    if any(bound != int(bound) for bound in layers):
        return f"L[{format_bound(layers[0])}, {format_bound(layers[1])})"
    first, last = layers[0], layers[1] - 1
    return f"L{first}" if first == last else f"L{first}-{last}"


def _label(name: str, setup: RunSetup) -> str:
    for rank in range(setup.cluster.world_size):
        spec = setup.cluster.accelerator_of(rank)
        if spec.name == name:
            return spec.label
    builtin = {spec.name: spec for spec in AcceleratorRegistry.builtin()}
    return builtin[name].label if name in builtin else name


def _devices(counts: Mapping[str, int], setup: RunSetup) -> str:
    total = sum(counts.values())
    kinds = ", ".join(f"{n} x {_label(name, setup)}" for name, n in counts.items())
    return f"{total} rank{'s' if total != 1 else ''} ({kinds})"


def describe_restart(
    setup: RunSetup, metadata: Mapping[str, Any], predicted_s: Callable[[], float | None]
) -> str | None:
    """Lines for the start-up log when the checkpoint's plan differs from the run's, else None.

    ``metadata`` is the loaded checkpoint's metadata.json (its ``plan``, written by every
    parallel save; a checkpoint without one, e.g. converted weights, gives None);
    ``predicted_s`` prices the new plan (called only when something changed).
    """
    saved = metadata.get("plan") or (metadata.get("sharded") or {}).get("plan")
    if not saved:
        return None
    before = ParallelPlan.from_dict(saved)
    now = setup.plan
    if before.to_dict() == now.to_dict():
        return None
    old_devices, new_devices = devices_by_kind(before), devices_by_kind(now)
    lines = [
        f"> elastic restart from iteration {metadata.get('iteration')}: the checkpoint "
        f"was written by {_devices(old_devices, setup)} under plan {short_plan(before)}",
        f"  now {_devices(new_devices, setup)} under plan {short_plan(now)}",
    ]
    lost = {
        k: n - new_devices.get(k, 0) for k, n in old_devices.items() if n > new_devices.get(k, 0)
    }
    if lost:
        lines.append(
            "  devices lost: " + ", ".join(f"{n} x {_label(k, setup)}" for k, n in lost.items())
        )
    batch = (
        f"  global batch {before.global_batch_size} -> {now.global_batch_size}"
        if before.global_batch_size != now.global_batch_size
        else f"  global batch {now.global_batch_size} kept"
    )
    lines.append(f"{batch}; data continues at sample {metadata.get('consumed_samples')}")
    seconds = predicted_s()
    if seconds is not None:
        tokens = now.global_batch_size * setup.run.data.seq_length / seconds
        lines.append(f"  predicted iteration time now {seconds:.3f} s ({tokens:,.0f} tokens/s)")
    return "\n".join(lines)
