"""What the planner tells the user: a markdown report, a short text summary and a JSON line.

All three read a :class:`~megatron_het.planner.result.SearchResult` (a searched plan, or a given
plan predicted by ``--evaluate``) and do no prediction of their own except the per-stage idle
share, which re-runs the 1F1B simulation of the slowest pipeline with the predicted times. The
stage tables show pipeline 0, or every pipeline when their layouts differ (heterogeneous data
parallelism); a device's memory and idle share appear once, on its first chunk's row. The
JSON line stays short on any cluster: it gives the plan as stage groups, not rank lists.
"""
from __future__ import annotations

from typing import Any, Optional

from megatron_het.cluster import ClusterSpec
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf import Prediction, StagePrediction, fits, simulate_1f1b
from megatron_het.parallel.replicas import uniform_layouts
from megatron_het.perf.memory import GIB
from megatron_het.planner.result import SearchResult


def _group_of(rows: list[StagePrediction]) -> list[int]:
    """Per row of one pipeline, its device group (rows of one group share their ranks: the
    chunks of an interleaved pipeline), numbered in order of first appearance."""
    groups: dict[tuple[int, ...], int] = {}
    return [groups.setdefault(r.ranks, len(groups)) for r in rows]


def stage_idle_fractions(prediction: Prediction, pipeline: Optional[int] = None) -> list[float]:
    """Per stage of ``pipeline`` (default: the slowest), the share of its 1F1B time its device
    group spends idle (its bubble; the chunks of an interleaved group share one figure)."""
    if pipeline is None:
        pipeline = max(prediction.pipelines, key=lambda p: p.time_s).pipeline
    timing = next(p for p in prediction.pipelines if p.pipeline == pipeline)
    rows = [s for s in prediction.stages if s.pipeline == pipeline]
    group_of = _group_of(rows)
    sim = simulate_1f1b([r.forward_s for r in rows], [r.backward_s for r in rows],
                        timing.micro_batches, [r.p2p_forward_s for r in rows[:-1]],
                        [r.p2p_backward_s for r in rows[:-1]], record_timeline=False,
                        num_chunks=len(rows) // (max(group_of) + 1))
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
    many pipelines and ranks it covers. The ranks themselves are in the plan file."""
    groups: dict[tuple, dict[str, Any]] = {}
    for pipeline in plan.pipelines:
        for s, st in enumerate(pipeline.stages):
            key = (s, st.accelerator, st.tp, st.layers, st.recompute, pipeline.micro_batches)
            group = groups.setdefault(key, {
                "stage": s, "accelerator": st.accelerator, "tp": st.tp,
                "layers": list(st.layers), "recompute": st.recompute,
                "micro_batches": pipeline.micro_batches, "pipelines": 0, "ranks": 0})
            group["pipelines"] += 1
            group["ranks"] += len(st.ranks)
    return {"dp": plan.dp_size, "pp": sorted({p.pp_size for p in plan.pipelines}),
            "world_size": plan.world_size, "micro_batch_size": plan.micro_batch_size,
            "global_batch_size": plan.global_batch_size, "dtype": plan.dtype,
            "use_distributed_optimizer": plan.use_distributed_optimizer,
            "stage_groups": sorted(groups.values(), key=lambda g: (g["stage"], -g["pipelines"]))}


def summary_dict(result: SearchResult, cluster: ClusterSpec) -> dict[str, Any]:
    """The JSON summary: throughput, bound, efficiency, timing, memory per device group of
    pipeline 0 and the plan in short (:func:`plan_summary`; the full plan is what ``--out``
    writes)."""
    p = result.prediction
    bound = result.upper_bound
    memory = fits(p, cluster)
    return {
        "efficiency": result.efficiency,
        "upper_bound_tokens_per_s": None if bound is None else bound.tokens_per_s,
        "tokens_per_s": p.tokens_per_s,
        "iteration_time_s": p.iteration_time_s,
        "pipeline_time_s": p.pipeline_time_s,
        "dp_sync_s": p.dp_sync_s,
        "optimizer_s": p.optimizer_s,
        "bubble_fraction": p.bubble_fraction,
        "mfu": p.mfu,
        "search_time_s": result.search_time_s,
        "upper_bound_search_time_s": None if bound is None else bound.search_time_s,
        "layouts_evaluated": result.layouts_evaluated,
        "peak_memory_gib": peak_memory_gib(p),
        "fits": memory.ok,
        "memory_message": memory.message,
        "upper_bound": None if bound is None else bound.to_dict(),
        "plan": plan_summary(result.plan),
    }


def _shown_pipelines(result: SearchResult) -> list[int]:
    """The pipelines the stage tables show: pipeline 0 when every pipeline splits the model
    alike, else each of them."""
    return [0] if uniform_layouts(result.plan) else list(range(result.plan.dp_size))


def text_summary(result: SearchResult, cluster: ClusterSpec) -> str:
    """A few lines for the terminal: the plan, the per-stage table and the headline figures."""
    p = result.prediction
    header = ["stage", "accelerator", "tp", "layers", "fwd ms", "bwd ms", "tp ms", "p2p ms",
              "dp ms", "opt ms", "idle", "mem GiB"]
    lines = [_short_describe(result.plan)]
    shown = _shown_pipelines(result)
    for pipeline in shown:
        rows = [header] + _stage_rows(p, pipeline, len(shown) == 1)
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines += ["", f"pipeline {pipeline}" + (" (DP replicas are the same):"
                                                 if len(shown) == 1 else ":")]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(_headline(result))
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
    return "\n".join(lines[:cut] + [f"  pipelines 1-{plan.dp_size - 1}: the same stages on "
                                    f"their own ranks"])


def _headline(result: SearchResult) -> str:
    p = result.prediction
    text = f"predicted {p.tokens_per_s:,.0f} tokens/s, iteration {p.iteration_time_s:.3f} s"
    if result.upper_bound is not None:
        text += (f"; upper bound {result.upper_bound.tokens_per_s:,.0f} tokens/s, efficiency "
                 f"{result.efficiency:.4f}")
    if result.layouts_evaluated:
        text += (f"; searched {result.layouts_evaluated} layouts in "
                 f"{result.search_time_s:.2f} s")
    if result.upper_bound is not None:
        text += f" (+ {result.upper_bound.search_time_s:.2f} s for the bound)"
    return text


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _stage_rows(prediction: Prediction, pipeline: int = 0,
                slowest_idle: bool = True) -> list[list[str]]:
    """The rows of ``pipeline``'s stages. A device's figures (idle share, memory) appear on its
    first stage's row; the other chunks of an interleaved device group point to it. The idle
    shares are the slowest pipeline's (``slowest_idle``, for identical replicas) or the
    pipeline's own."""
    idle = stage_idle_fractions(prediction, None if slowest_idle else pipeline)
    rows, first_of = [], {}
    for s in (s for s in prediction.stages if s.pipeline == pipeline):
        ms = [f"{1e3 * v:.2f}" for v in (s.forward_s, s.backward_s, s.tp_comm_s,
                                           s.p2p_forward_s, s.dp_sync_s, s.optimizer_s)]
        first = first_of.setdefault(s.ranks, s.stage)
        device = ([f"{100 * idle[s.stage]:.1f}%",
                   f"{s.memory.total_bytes / GIB:.1f} / {s.capacity_bytes / GIB:.0f}"]
                  if first == s.stage else [f"(stage {first})"] * 2)
        rows.append([str(s.stage), s.accelerator, str(s.tp), f"[{s.layers[0]}, {s.layers[1]})",
                     *ms, *device])
    return rows


def markdown_report(result: SearchResult, cluster: ClusterSpec, title: Optional[str] = None
                    ) -> str:
    """The report: headline figures, upper bound and efficiency, the per-stage table (times,
    idle share, memory), the plan, and the runner-up candidates of a search."""
    p = result.prediction
    lines = [f"# {title or 'Parallel plan'}: {p.model} on {cluster.name}", ""]
    figures = [["tokens/s", f"{p.tokens_per_s:,.0f}"],
               ["iteration time", f"{p.iteration_time_s:.3f} s (pipeline "
                f"{p.pipeline_time_s:.3f} + DP sync {p.dp_sync_s:.3f} + optimizer "
                f"{p.optimizer_s:.3f})"],
               ["pipeline bubble", f"{100 * p.bubble_fraction:.1f}%"],
               ["MFU (heterogeneity-aware)", f"{100 * p.mfu:.1f}%"],
               ["devices", str(p.num_devices)],
               ["batch", f"{p.global_batch_size} x {p.seq_length} tokens, micro-batch "
                f"{p.micro_batch_size}, dtype {p.dtype}"]]
    if result.upper_bound is not None:
        figures += [["upper bound", f"{result.upper_bound.tokens_per_s:,.0f} tokens/s"],
                     ["efficiency", f"{result.efficiency:.4f}"]]
    if result.layouts_evaluated:
        figures.append(["search", f"{result.layouts_evaluated} layouts in "
                        f"{result.search_time_s:.2f} s"])
    if result.upper_bound is not None:
        figures.append(["upper bound searches", f"{result.upper_bound.search_time_s:.2f} s"])
    lines += _table(["figure", "value"], figures)
    shown = _shown_pipelines(result)
    for pipeline in shown:
        lines += ["", f"## Stages (pipeline {pipeline})", ""]
        lines += _table(["stage", "accelerator", "tp", "layers", "fwd ms", "bwd ms",
                         "tp comm ms", "p2p ms", "dp sync ms", "optimizer ms", "idle",
                         "memory GiB"], _stage_rows(p, pipeline, len(shown) == 1))
    if any(pp.interleaved for pp in result.plan.pipelines):
        lines += ["", "An interleaved device group's idle share and memory (all its chunks) "
                  "are on its first chunk's row."]
    lines += ["", f"Memory: {fits(p, cluster).message}.", ""]
    if result.upper_bound is not None:
        lines += ["## Upper bound", "", "Sum over accelerator kinds of devices x per-device "
                  "tokens/s of the best plan for that kind alone.", ""]
        lines += _table(["kind", "devices", "tokens/s per device", "best homogeneous plan"],
                        [[k.kind, str(k.devices), f"{k.tokens_per_s_per_device:,.1f}",
                          k.plan_summary + (" (memory ignored: the kind cannot hold the model "
                                            "alone)" if k.memory_ignored else "")]
                         for k in result.upper_bound.kinds])
        lines.append("")
    lines += ["## Plan", "", "```", result.plan.describe(), "```", ""]
    if len(result.candidates) > 1:
        lines += ["## Candidates (simulated)", ""]
        lines += _table(["rank", "layout", "layers", "iteration s", "tokens/s"],
                        [[str(i), c.layout.describe(), " ".join(map(str, c.layers)),
                          f"{c.prediction.iteration_time_s:.4f}",
                          f"{c.prediction.tokens_per_s:,.0f}"]
                         for i, c in enumerate(result.candidates)])
        lines.append("")
    return "\n".join(lines)


__all__ = ["markdown_report", "peak_memory_gib", "plan_summary", "stage_idle_fractions",
           "summary_dict", "text_summary"]
