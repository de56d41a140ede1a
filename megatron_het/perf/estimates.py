"""What :func:`~megatron_het.perf.predictor.predict` returns: per-stage rows, per-pipeline times
and the iteration's figures, with their JSON form and a text table."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from megatron_het.perf.cost.memory import MemoryBreakdown


@dataclass(frozen=True)
class StagePrediction:
    """One stage of one pipeline; times per micro-batch unless named otherwise.

    ``forward_s`` / ``backward_s`` include TP communication (``tp_comm_s`` is its forward +
    backward share) and recompute; ``p2p_*_s`` is the boundary to the next stage (0 on the
    last); ``parameters`` are the stage's on one TP rank. The rest is its device's: ``dp_sync_s``
    and ``optimizer_s`` per iteration, ``memory`` the peak of one device, ``in_flight`` the
    most (stage, micro-batch) pairs whose activations it holds at once. In an interleaved
    pipeline a device runs several stages (chunks of its device group), and every row of the
    group carries the same device figures, over all its chunks. Pipelines of different layouts
    (heterogeneous data parallelism) each have rows of their own.
    """

    pipeline: int
    stage: int
    accelerator: str
    tp: int
    layers: tuple[float, float]  # a bound may be a half-layer bound x.5
    ranks: tuple[int, ...]
    forward_s: float
    backward_s: float
    tp_comm_s: float
    p2p_forward_s: float
    p2p_backward_s: float
    dp_sync_s: float
    dp_algorithm: str
    optimizer_s: float
    parameters: int
    in_flight: int
    memory: MemoryBreakdown
    capacity_bytes: float
    source: str

    @property
    def headroom_bytes(self) -> float:
        return self.capacity_bytes - self.memory.total_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"], d["ranks"] = list(self.layers), list(self.ranks)
        d["memory"] = self.memory.to_dict()
        return d


@dataclass(frozen=True)
class PipelinePrediction:
    """One DP replica: its 1F1B time (simulated or closed form, interleaved where the plan
    interleaves) and the analytic checks; ``bubble_fraction`` is the busiest device group's
    idle share of ``time_s``."""

    pipeline: int
    micro_batches: int
    time_s: float
    closed_form_s: float
    lower_bound_s: float
    bubble_fraction: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Prediction:
    """Everything :func:`~megatron_het.perf.predictor.predict` estimates for one iteration;
    ``stages`` is the per-stage table.

    ``dp_sync_s`` is the whole DP sync of the slowest device group (what it takes after the
    last backward without overlap); ``dp_exposed_s`` is what the iteration pays of it past the
    slowest pipeline: all of it without ``overlap_grad_reduce`` and ``overlap_param_gather``,
    less with them (the latter's share is the delay it adds to the next forward). ``iteration_time_s
    = pipeline_time_s + dp_exposed_s + optimizer_s + overhead_s``.
    """

    model: str
    seq_length: int
    dtype: str
    use_distributed_optimizer: bool
    overlap_grad_reduce: bool
    grad_reduce_in_bf16: bool
    overlap_p2p_comm: bool  # an interleaved pipeline's transfers overlapped with its compute
    micro_batch_size: int
    global_batch_size: int
    pipeline_model: str
    stages: tuple[StagePrediction, ...]
    pipelines: tuple[PipelinePrediction, ...]
    pipeline_time_s: float
    dp_sync_s: float
    dp_exposed_s: float
    optimizer_s: float
    iteration_time_s: float
    tokens_per_s: float
    model_flops_per_iteration: float
    num_devices: int
    peak_flops_sum: float
    bubble_fraction: float
    overhead_s: float = 0.0  # per-iteration work outside pipeline, sync and step (shared host)
    overlap_param_gather: bool = False

    @property
    def achieved_tflops_per_device(self) -> float:
        """Model FLOP/s per device in use, in TFLOP/s."""
        return self.model_flops_per_iteration / self.iteration_time_s / self.num_devices / 1e12

    @property
    def mfu(self) -> float:
        """Heterogeneity-aware MFU: model FLOP/s over the sum of the devices' peak FLOP/s."""
        return self.model_flops_per_iteration / self.iteration_time_s / self.peak_flops_sum

    @property
    def peak_memory_bytes(self) -> float:
        return max(s.memory.total_bytes for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: scalars, the derived figures and the per-stage and per-pipeline tables."""
        d = {k: v for k, v in asdict(self).items() if k not in ("stages", "pipelines")}
        d.update(
            achieved_tflops_per_device=self.achieved_tflops_per_device,
            mfu=self.mfu,
            peak_memory_bytes=self.peak_memory_bytes,
            stages=[s.to_dict() for s in self.stages],
            pipelines=[p.to_dict() for p in self.pipelines],
        )
        return d

    def table(self) -> str:
        """The per-stage table as text, one row per stage of every pipeline (the memory of an
        interleaved device group on each of its chunks' rows)."""
        rows: list[tuple[str, ...]] = [
            (
                "pipe",
                "stage",
                "accelerator",
                "tp",
                "layers",
                "fwd ms",
                "bwd ms",
                "tp ms",
                "p2p ms",
                "dp ms",
                "opt ms",
                "mem GiB",
                "cap GiB",
            )
        ]
        for s in self.stages:
            rows.append(
                (
                    str(s.pipeline),
                    str(s.stage),
                    s.accelerator,
                    str(s.tp),
                    f"{s.layers[0]}-{s.layers[1]}",
                    *(
                        f"{1e3 * v:.2f}"
                        for v in (
                            s.forward_s,
                            s.backward_s,
                            s.tp_comm_s,
                            s.p2p_forward_s,
                            s.dp_sync_s,
                            s.optimizer_s,
                        )
                    ),
                    f"{s.memory.total_bytes / 2**30:.1f}",
                    f"{s.capacity_bytes / 2**30:.0f}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        hidden = [
            what
            for what, on in (
                ("backward", self.overlap_grad_reduce),
                ("the next forward", self.overlap_param_gather),
            )
            if on
        ]
        overlapped = (
            f" (of {self.dp_sync_s:.3f}, overlapped with {' and '.join(hidden)})" if hidden else ""
        )
        lines.append(
            f"iteration {self.iteration_time_s:.3f} s = pipeline "
            f"{self.pipeline_time_s:.3f} + dp sync {self.dp_exposed_s:.3f}{overlapped}"
            f" + optimizer "
            f"{self.optimizer_s:.3f} + other {self.overhead_s:.3f}; "
            f"{self.tokens_per_s:,.0f} tokens/s, "
            f"{self.achieved_tflops_per_device:.1f} TFLOP/s per device, MFU "
            f"{100 * self.mfu:.1f}%, bubble {100 * self.bubble_fraction:.1f}%"
        )
        return "\n".join(lines)


__all__ = ["PipelinePrediction", "Prediction", "StagePrediction"]
