"""What the planner tells the user: a markdown report, a short text summary and a JSON line.

All three read a :class:`~megatron_het.planner.result.SearchResult` (a searched plan, or a given
plan predicted by ``--evaluate``) and do no prediction of their own except the per-stage idle
share, which re-runs the 1F1B simulation of the slowest pipeline with the predicted times. The
stage tables show pipeline 0, or every pipeline when their layouts differ (heterogeneous data
parallelism); a device's memory and idle share appear once, on its first chunk's row. The
JSON line stays short on any cluster: it gives the plan as stage groups, not rank lists.

Two references, each where it is attached to the result: the homogeneous baseline (each kind's
best plan alone; ``efficiency`` may exceed 1, and then a line says why) and the compute ceiling
(every device computing at its best rate, memory ignored; ``ceiling_efficiency`` is below 1).
Where the pipelines share one layout, what its layer bounds cost the busiest device group
(:mod:`megatron_het.planner.layer_split`) is given too.
"""

from __future__ import annotations

from typing import Any

from megatron_het.cluster import ClusterSpec
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.replicas import uniform_layouts
from megatron_het.perf import Prediction, StagePrediction, fits, simulate_1f1b
from megatron_het.perf.cost.memory import GIB
from megatron_het.planner.baseline import why_above_baseline
from megatron_het.planner.layer_split import layer_split
from megatron_het.planner.result import Candidate, SearchResult

BASELINE_MEANS = "each kind's best plan alone, summed over its devices"
CEILING_MEANS = (
    "every device computing at its best rate, no communication, bubble or recompute; memory ignored"
)


def _group_of(rows: list[StagePrediction]) -> list[int]:
    """Per row of one pipeline, its device group (rows of one group share their ranks: the
    chunks of an interleaved pipeline), numbered in order of first appearance."""
    groups: dict[tuple[int, ...], int] = {}
    return [groups.setdefault(r.ranks, len(groups)) for r in rows]


def stage_idle_fractions(prediction: Prediction, pipeline: int | None = None) -> list[float]:
    """Per stage of ``pipeline`` (default: the slowest), the share of its 1F1B time its device
    group spends idle (its bubble; the chunks of an interleaved group share one figure)."""
    if pipeline is None:
        pipeline = max(prediction.pipelines, key=lambda p: p.time_s).pipeline
    timing = next(p for p in prediction.pipelines if p.pipeline == pipeline)
    rows = [s for s in prediction.stages if s.pipeline == pipeline]
    group_of = _group_of(rows)
    sim = simulate_1f1b(
        [r.forward_s for r in rows],
        [r.backward_s for r in rows],
        timing.micro_batches,
        [r.p2p_forward_s for r in rows[:-1]],
        [r.p2p_backward_s for r in rows[:-1]],
        record_timeline=False,
        num_chunks=len(rows) // (max(group_of) + 1),
        overlap_p2p=prediction.overlap_p2p_comm,
    )
    return [1.0 - sim.busy_s[g] / sim.makespan_s for g in group_of]


def peak_memory_gib(prediction: Prediction) -> list[float]:
    """Peak memory per device of each device group of pipeline 0 (a stage, or the chunks of an
    interleaved group together; with uniform layouts the DP replicas are the same)."""
    rows = [s for s in prediction.stages if s.pipeline == 0]
    seen: set[tuple[int, ...]] = set()
    out = []
    for row in rows:
        if row.ranks not in seen:
            seen.add(row.ranks)
            out.append(row.memory.total_bytes / GIB)
    return out


def plan_summary(plan: ParallelPlan) -> dict[str, Any]:
    """The plan in a few lines: DP, batch and one entry per stage group (the same stage,
    accelerator, TP, layers, recompute and micro-batch count in several pipelines), with how
    many pipelines and ranks it covers (an interleaved device group's ranks count on its first
    chunk's entry, so the entries' ranks sum to the plan's). The ranks themselves are in the
    plan file."""
    groups: dict[tuple, dict[str, Any]] = {}
    for pipeline in plan.pipelines:
        seen: set[tuple[int, ...]] = set()
        for s, st in enumerate(pipeline.stages):
            key = (
                s,
                st.accelerator,
                st.tp,
                st.layers,
                st.recomputed_layers,
                pipeline.micro_batches,
            )
            group = groups.setdefault(
                key,
                {
                    "stage": s,
                    "accelerator": st.accelerator,
                    "tp": st.tp,
                    "layers": list(st.layers),
                    "recompute": st.recompute,
                    "micro_batches": pipeline.micro_batches,
                    "pipelines": 0,
                    "ranks": 0,
                },
            )
            if st.recompute_num_layers is not None:
                group["recompute_num_layers"] = st.recomputed_layers
            group["pipelines"] += 1
            group["ranks"] += 0 if st.ranks in seen else len(st.ranks)
            seen.add(st.ranks)
    return {
        "dp": plan.dp_size,
        "pp": sorted({p.pp_size for p in plan.pipelines}),
        "world_size": plan.world_size,
        "micro_batch_size": plan.micro_batch_size,
        "global_batch_size": plan.global_batch_size,
        "dtype": plan.dtype,
        "use_distributed_optimizer": plan.use_distributed_optimizer,
        "sequence_parallel": bool(plan.sequence_parallel),
        "tp_comm_overlap": bool(plan.tp_comm_overlap),
        "overlap_grad_reduce": bool(plan.overlap_grad_reduce),
        "overlap_param_gather": bool(plan.overlap_param_gather),
        "stage_groups": sorted(groups.values(), key=lambda g: (g["stage"], -g["pipelines"])),
    }


def summary_dict(result: SearchResult, cluster: ClusterSpec) -> dict[str, Any]:
    """The JSON summary: throughput, the efficiency against the homogeneous baseline (and why
    it exceeds 1) and against the compute ceiling, timing, memory per device group of pipeline
    0 and the plan in short (:func:`plan_summary`; the full plan is what ``--out`` writes)."""
    p = result.prediction
    baseline, ceiling = result.baseline, result.ceiling
    baseline_tps = None if baseline is None else baseline.tokens_per_s
    baseline_dict = None if baseline is None else baseline.to_dict()
    memory = fits(p, cluster)
    split = layer_split(p, result.plan)
    return {
        "efficiency": result.efficiency,
        "baseline_tokens_per_s": baseline_tps,
        "above_baseline_reason": why_above_baseline(result),
        "ceiling_efficiency": result.ceiling_efficiency,
        "ceiling_tokens_per_s": None if ceiling is None else ceiling.tokens_per_s,
        "tokens_per_s": p.tokens_per_s,
        "iteration_time_s": p.iteration_time_s,
        "pipeline_time_s": p.pipeline_time_s,
        "dp_sync_s": p.dp_sync_s,
        "optimizer_s": p.optimizer_s,
        "bubble_fraction": p.bubble_fraction,
        "layer_split_loss": None if split is None else split.loss,
        "mfu": p.mfu,
        "search_time_s": result.search_time_s,
        "baseline_search_time_s": None if baseline is None else baseline.search_time_s,
        "layouts_evaluated": result.layouts_evaluated,
        "peak_memory_gib": peak_memory_gib(p),
        "fits": memory.ok,
        "memory_message": memory.message,
        "baseline": baseline_dict,
        "ceiling": None if ceiling is None else ceiling.to_dict(),
        "plan": plan_summary(result.plan),
    }


def _shown_pipelines(result: SearchResult) -> list[int]:
    """The pipelines the stage tables show: pipeline 0 when every pipeline splits the model
    alike, else each of them."""
    return [0] if uniform_layouts(result.plan) else list(range(result.plan.dp_size))


def text_summary(result: SearchResult, cluster: ClusterSpec) -> str:
    """A few lines for the terminal: the plan, the per-stage table and the headline figures."""
    p = result.prediction
    header = [
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
        "idle",
        "mem GiB",
    ]
    lines = [_short_describe(result.plan)]
    shown = _shown_pipelines(result)
    for pipeline in shown:
        rows = [header] + _stage_rows(p, pipeline, len(shown) == 1)
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines += [
            "",
            f"pipeline {pipeline}" + (" (DP replicas are the same):" if len(shown) == 1 else ":"),
        ]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(_headline(result))
    split = layer_split(p, result.plan)
    lines += [
        line
        for line in (
            efficiency_line(result),
            why_above_baseline(result),
            split and f"layer split: {split.describe()}",
        )
        if line
    ]
    memory = fits(p, cluster)
    if not memory.ok:
        lines.append(f"warning: {memory.message}")
    return "\n".join(lines)


def _short_describe(plan: ParallelPlan) -> str:
    """:meth:`ParallelPlan.describe` up to the first pipeline; the others differ only in ranks
    (the full plan is in the report and the plan file). Pipelines of different layouts are
    all described."""
    lines = plan.describe().splitlines()
    cut = next((i for i, line in enumerate(lines) if line.startswith("  pipeline 1:")), None)
    if cut is None or not uniform_layouts(plan):
        return "\n".join(lines)
    return "\n".join(
        lines[:cut] + [f"  pipelines 1-{plan.dp_size - 1}: the same stages on their own ranks"]
    )


def _headline(result: SearchResult) -> str:
    p = result.prediction
    text = f"predicted {p.tokens_per_s:,.0f} tokens/s, iteration {p.iteration_time_s:.3f} s"
    if result.layouts_evaluated:
        text += f"; searched {result.layouts_evaluated} layouts in {result.search_time_s:.2f} s"
    if result.baseline is not None:
        text += f" (+ {result.baseline.search_time_s:.2f} s for the baseline)"
    return text


def efficiency_line(result: SearchResult, explain: bool = True) -> str | None:
    """The efficiency against the homogeneous baseline and against the compute ceiling, as
    far as they are attached (None with neither); ``explain`` adds what each one means."""
    parts = []
    if result.baseline is not None:
        means = f": {BASELINE_MEANS}" if explain else ""
        parts.append(
            f"efficiency {result.efficiency:.4f} of the homogeneous baseline "
            f"({result.baseline.tokens_per_s:,.0f} tokens/s{means})"
        )
    if result.ceiling is not None:
        means = f": {CEILING_MEANS}" if explain else ""
        parts.append(
            f"ceiling efficiency {result.ceiling_efficiency:.4f} of the compute "
            f"ceiling ({result.ceiling.tokens_per_s:,.0f} tokens/s{means})"
        )
    return "; ".join(parts) or None


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _candidate_row(rank: int, c: Candidate) -> list[str]:
    assert c.prediction is not None  # a search result's candidates are simulated
    return [
        str(rank),
        c.layout.describe()
        + (" overlap_grad_reduce" if c.plan.overlap_grad_reduce else "")
        + (" overlap_param_gather" if c.plan.overlap_param_gather else ""),
        " ".join(map(str, c.layers)),
        f"{c.prediction.iteration_time_s:.4f}",
        f"{c.prediction.tokens_per_s:,.0f}",
    ]


def _stage_rows(
    prediction: Prediction, pipeline: int = 0, slowest_idle: bool = True
) -> list[list[str]]:
    """The rows of ``pipeline``'s stages. A device's figures (idle share, memory) appear on its
    first stage's row; the other chunks of an interleaved device group point to it. The idle
    shares are the slowest pipeline's (``slowest_idle``, for identical replicas) or the
    pipeline's own."""
    idle = stage_idle_fractions(prediction, None if slowest_idle else pipeline)
    rows: list[list[str]] = []
    first_of: dict[tuple[int, ...], int] = {}  # a device group's ranks -> its first stage
    for s in (s for s in prediction.stages if s.pipeline == pipeline):
        ms = [
            f"{1e3 * v:.2f}"
            for v in (
                s.forward_s,
                s.backward_s,
                s.tp_comm_s,
                s.p2p_forward_s,
                s.dp_sync_s,
                s.optimizer_s,
            )
        ]
        first = first_of.setdefault(s.ranks, s.stage)
        device = (
            [
                f"{100 * idle[s.stage]:.1f}%",
                f"{s.memory.total_bytes / GIB:.1f} / {s.capacity_bytes / GIB:.0f}",
            ]
            if first == s.stage
            else [f"(stage {first})"] * 2
        )
        rows.append(
            [
                str(s.stage),
                s.accelerator,
                str(s.tp),
                f"[{s.layers[0]}, {s.layers[1]})",
                *ms,
                *device,
            ]
        )
    return rows


def _figure_rows(result: SearchResult) -> list[list[str]]:
    """The headline table: throughput, time split, both efficiencies and the search times."""
    p = result.prediction
    figures = [
        ["tokens/s", f"{p.tokens_per_s:,.0f}"],
        [
            "iteration time",
            f"{p.iteration_time_s:.3f} s (pipeline "
            f"{p.pipeline_time_s:.3f} + DP sync {p.dp_sync_s:.3f} + optimizer "
            f"{p.optimizer_s:.3f})",
        ],
        ["pipeline bubble", f"{100 * p.bubble_fraction:.1f}%"],
        *([["layer split", split.describe()]] if (split := layer_split(p, result.plan)) else []),
        ["MFU (heterogeneity-aware)", f"{100 * p.mfu:.1f}%"],
        ["devices", str(p.num_devices)],
        [
            "batch",
            f"{p.global_batch_size} x {p.seq_length} tokens, micro-batch "
            f"{p.micro_batch_size}, dtype {p.dtype}",
        ],
    ]
    if result.baseline is not None:
        figures += [
            [
                "homogeneous baseline",
                f"{result.baseline.tokens_per_s:,.0f} tokens/s ({BASELINE_MEANS})",
            ],
            ["efficiency", f"{result.efficiency:.4f}"],
        ]
    if result.ceiling is not None:
        figures += [
            ["compute ceiling", f"{result.ceiling.tokens_per_s:,.0f} tokens/s ({CEILING_MEANS})"],
            ["ceiling efficiency", f"{result.ceiling_efficiency:.4f}"],
        ]
    if result.layouts_evaluated:
        figures.append(
            ["search", f"{result.layouts_evaluated} layouts in {result.search_time_s:.2f} s"]
        )
    if result.baseline is not None:
        figures.append(["baseline searches", f"{result.baseline.search_time_s:.2f} s"])
    return figures


def _reference_sections(result: SearchResult) -> list[str]:
    """The per-kind terms of the baseline and of the ceiling, where attached."""
    lines: list[str] = []
    if result.baseline is not None:
        lines += [
            "## Homogeneous baseline",
            "",
            "Sum over accelerator kinds of devices x "
            "per-device tokens/s of the best plan for that kind alone (the HETHUB "
            "paper's reference; a mixed plan can pass it).",
            "",
        ]
        lines += _table(
            ["kind", "devices", "tokens/s per device", "best homogeneous plan"],
            [
                [
                    k.kind,
                    str(k.devices),
                    f"{k.tokens_per_s_per_device:,.1f}",
                    k.plan_summary
                    + (
                        " (memory ignored: the kind cannot hold the model alone)"
                        if k.memory_ignored
                        else ""
                    ),
                ]
                for k in result.baseline.kinds
            ],
        )
        lines.append("")
    if result.ceiling is not None:
        lines += [
            "## Compute ceiling",
            "",
            "Sum over devices of 1 / (least compute seconds "
            "per token of the whole model's forward and backward on one device: tp=1, no "
            "recompute, the best micro-batch size). No communication, bubble or "
            "duplicated work, and memory is ignored: no plan passes it under the cost "
            "model.",
            "",
        ]
        lines += _table(
            [
                "kind",
                "devices",
                "compute µs per token",
                "tokens/s per device",
                "micro-batch",
                "source",
            ],
            [
                [
                    k.kind,
                    str(k.devices),
                    f"{1e6 * k.seconds_per_token:,.2f}",
                    f"{k.tokens_per_s_per_device:,.1f}",
                    str(k.micro_batch_size),
                    k.source,
                ]
                for k in result.ceiling.kinds
            ],
        )
        lines.append("")
    return lines


def markdown_report(result: SearchResult, cluster: ClusterSpec, title: str | None = None) -> str:
    """The report: headline figures, both efficiencies (and why the one against the baseline
    exceeds 1), the per-stage table (times, idle share, memory), the baseline's and the
    ceiling's per-kind terms, the plan, and the runner-up candidates of a search."""
    p = result.prediction
    lines = [f"# {title or 'Parallel plan'}: {p.model} on {cluster.name}", ""]
    lines += _table(["figure", "value"], _figure_rows(result))
    reason = why_above_baseline(result)
    if reason:
        lines += ["", f"Efficiency {reason}."]
    shown = _shown_pipelines(result)
    for pipeline in shown:
        lines += ["", f"## Stages (pipeline {pipeline})", ""]
        lines += _table(
            [
                "stage",
                "accelerator",
                "tp",
                "layers",
                "fwd ms",
                "bwd ms",
                "tp comm ms",
                "p2p ms",
                "dp sync ms",
                "optimizer ms",
                "idle",
                "memory GiB",
            ],
            _stage_rows(p, pipeline, len(shown) == 1),
        )
    if any(pp.interleaved for pp in result.plan.pipelines):
        lines += [
            "",
            "An interleaved device group's idle share and memory (all its chunks) "
            "are on its first chunk's row.",
        ]
    lines += ["", f"Memory: {fits(p, cluster).message}.", ""]
    lines += _reference_sections(result)
    lines += ["## Plan", "", "```", result.plan.describe(), "```", ""]
    if len(result.candidates) > 1:
        lines += ["## Candidates (simulated)", ""]
        lines += _table(
            ["rank", "layout", "layers", "iteration s", "tokens/s"],
            [_candidate_row(i, c) for i, c in enumerate(result.candidates)],
        )
        lines.append("")
    return "\n".join(lines)


__all__ = [
    "BASELINE_MEANS",
    "CEILING_MEANS",
    "efficiency_line",
    "markdown_report",
    "peak_memory_gib",
    "plan_summary",
    "stage_idle_fractions",
    "summary_dict",
    "text_summary",
]
