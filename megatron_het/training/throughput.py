"""Figures of a parallel iteration: per-stage times, TFLOP/s per accelerator kind, MFU.

Every rank contributes one row of :data:`ROW_FIELDS` per iteration; :func:`gather_rows`
all-gathers them over the world group so that every rank sees the same table (the loss, the stop
request and the timings then agree everywhere without further collectives).

FLOPs follow :meth:`ModelConfig.flops_per_token` (Megatron's formula): the output layer's share
is ``6 * hidden * vocab`` per token and the rest splits evenly over the decoder layers, so the
stages' shares add up to the model's FLOPs. A stage's share divides evenly over its TP ranks.
Heterogeneity-aware MFU = model FLOP/s / the sum of the peak FLOP/s (run dtype) of every device
in use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megatron_het.cluster import ClusterSpec
from megatron_het.comm.groups import UnifiedGroup
from megatron_het.config import ModelConfig
from megatron_het.parallel.plan import ParallelPlan

# One row per rank: its loss contribution (sum of micro-batch mean losses; only tp_rank 0 of a
# last stage contributes), its stop flag, and its timings of the iteration in seconds.
ROW_FIELDS = ("loss_sum", "stop", "compute_s", "p2p_wait_s", "bubble_s")


def gather_rows(
    world: UnifiedGroup, row: Mapping[str, float], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """All-gather ``row`` (keys :data:`ROW_FIELDS`) from every rank: float64 ``[world, fields]``
    on the CPU. ``device`` is where this rank's collectives run (its accelerator).

    Collective over ``world`` (every rank must call it in the same iteration).
    """
    mine = torch.tensor(
        [float(row[name]) for name in ROW_FIELDS], dtype=torch.float64, device=device
    )
    table = torch.zeros(world.size * len(ROW_FIELDS), dtype=torch.float64, device=device)
    world.all_gather_into_tensor(table, mine)
    return table.view(world.size, len(ROW_FIELDS)).cpu()


def column(table: torch.Tensor, name: str) -> torch.Tensor:
    """One field of a gathered table, indexed by rank."""
    return table[:, ROW_FIELDS.index(name)]


def devices_per_label(cluster: ClusterSpec) -> dict[str, int]:
    """Number of devices of each accelerator label (emulated kinds say so), in rank order."""
    counts: dict[str, int] = {}
    for rank in range(cluster.world_size):
        label = cluster.accelerator_of(rank).label
        counts[label] = counts.get(label, 0) + 1
    return counts


@dataclass(frozen=True)
class StageShare:
    """One stage's place in the FLOP accounting."""

    pipeline: int
    stage: int
    label: str  # accelerator label, "(emulated)" for emulated kinds
    ranks: tuple[int, ...]
    flops_per_iteration: float  # the whole stage (all its TP ranks)


class ThroughputMetrics:
    """Turns gathered per-rank rows into the throughput fields of a metrics line."""

    def __init__(
        self,
        model: ModelConfig,
        plan: ParallelPlan,
        cluster: ClusterSpec,
        seq_length: int,
        dtype: str,
    ) -> None:
        tokens_per_micro_batch = plan.micro_batch_size * seq_length
        head_per_token = 6.0 * model.hidden_size * model.vocab_size
        layer_per_token = (model.flops_per_token(seq_length) - head_per_token) / model.num_layers
        self.flops_per_iteration = (
            model.flops_per_token(seq_length) * seq_length * plan.global_batch_size
        )
        self.stages: list[StageShare] = []
        for p, pipeline in enumerate(plan.pipelines):
            tokens = pipeline.micro_batches * tokens_per_micro_batch
            for s, stage in enumerate(pipeline.stages):
                per_token = layer_per_token * stage.num_layers + (
                    head_per_token if stage.has_head else 0.0
                )
                label = cluster.accelerator_of(stage.ranks[0]).label
                self.stages.append(StageShare(p, s, label, stage.ranks, per_token * tokens))
        self.devices_per_label = devices_per_label(cluster)
        self.peak_flops_sum = sum(
            cluster.accelerator_of(rank).peak_tflops(dtype) * 1e12
            for rank in range(cluster.world_size)
        )
        self.num_devices = cluster.world_size

    def tflops_per_accelerator(self, iteration_time_s: float) -> dict[str, float]:
        """Achieved model TFLOP/s per device, by accelerator label."""
        flops: dict[str, float] = {}
        for share in self.stages:
            flops[share.label] = flops.get(share.label, 0.0) + share.flops_per_iteration
        return {
            label: value / iteration_time_s / self.devices_per_label[label] / 1e12
            for label, value in sorted(flops.items())
        }

    def mfu(self, iteration_time_s: float) -> float:
        """Model FLOP/s over the summed peak FLOP/s of every device in use."""
        return self.flops_per_iteration / iteration_time_s / self.peak_flops_sum

    def stage_times(self, table: torch.Tensor) -> list[dict[str, Any]]:
        """Per stage: the slowest TP rank's compute, p2p wait and bubble seconds (per device
        group in an interleaved pipeline: its ranks time all its chunks together)."""
        out = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for share in self.stages:
            if (share.pipeline, share.ranks) in seen:
                continue
            seen.add((share.pipeline, share.ranks))
            ranks = list(share.ranks)
            row = {"pipeline": share.pipeline, "stage": share.stage, "accelerator": share.label}
            for name in ("compute_s", "p2p_wait_s", "bubble_s"):
                row[name] = float(column(table, name)[ranks].max())
            out.append(row)
        return out

    def fields(self, table: torch.Tensor, iteration_time_s: float) -> dict[str, Any]:
        """The parallel fields of one metrics line (JSON-able)."""
        iteration_time_s = max(iteration_time_s, 1e-9)
        return {
            "world_size": self.num_devices,
            "mfu": self.mfu(iteration_time_s),
            "tflops_per_accelerator": self.tflops_per_accelerator(iteration_time_s),
            "stages": self.stage_times(table),
        }


def scalars_of(fields: Mapping[str, Any]) -> dict[str, float]:
    """Tensorboard scalars for the parallel fields (tags name stages and accelerators)."""
    out = {"mfu": float(fields["mfu"])}
    for label, value in fields["tflops_per_accelerator"].items():
        out[f"tflops/{label}"] = float(value)
    for row in fields["stages"]:
        where = f"pipeline{row['pipeline']}-stage{row['stage']}"
        for name in ("compute_s", "p2p_wait_s", "bubble_s"):
            out[f"{name}/{where}"] = float(row[name])
    return out
