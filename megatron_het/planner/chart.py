"""Charts of a predicted plan, drawn with matplotlib (Agg, imported only when a chart is drawn).

- Timeline: one row per stage of the slowest pipeline, its forward (light) and backward (dark) steps
  as simulated by :func:`megatron_het.perf.schedule.simulator.simulate` (1F1B, interleaved where the
  plan interleaves: one bar per device group) with the predicted per-stage times, p2p transfers as a
  thin grey strip, then the DP gradient sync and the optimizer step; the gaps are the bubble. The x
  axis is time in seconds. Given the search result, the title's second line is its efficiency
  against the homogeneous baseline and the compute ceiling.
- Allocation: every node of the cluster as a block of device cells, labelled with its index and
  accelerator kinds; a cell's colour and number are the stage its device runs (the same in every
  DP replica), the strip under it is the device's kind.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_het.cluster import ClusterSpec
from megatron_het.perf import Prediction, StagePrediction
from megatron_het.perf.predicted_timeline import slowest_pipeline
from megatron_het.planner.report import efficiency_line
from megatron_het.planner.result import SearchResult
from megatron_het.trace.drawing import KIND_COLORS, P2P, lighter

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Accelerator kinds (timeline bars, allocation strips) and stages (allocation cells).
STAGE_COLORS = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#b07aa1",
    "#76b7b2",
    "#edc948",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
    "#86bcb6",
    "#d4a6c8",
)
SYNC, OPT, IDLE = "#555555", "#000000", "#dddddd"
WIDTH_IN = 12.0
CELLS_PER_LINE = 64  # allocation: device cells per line of nodes before wrapping
MICRO_BATCH_LABELS = 400  # number the forward bars (wide enough ones) up to this many


def _figure(height_in: float) -> Figure:
    """A figure on the Agg canvas, outside pyplot (no global figure or backend state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, height_in), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    fig.savefig(out, format="png")
    return out


def _slowest_rows(prediction: Prediction) -> tuple[list[StagePrediction], int]:
    """The stages of the slowest pipeline and its micro-batch count."""
    slowest = max(prediction.pipelines, key=lambda p: p.time_s)
    return [s for s in prediction.stages if s.pipeline == slowest.pipeline], slowest.micro_batches


def _kind_colors(prediction: Prediction, more: tuple[str, ...] = ()) -> dict[str, str]:
    """A colour per accelerator label, in the order the plan's stages name them (so the
    timeline and the allocation agree), then ``more`` (devices the plan leaves idle)."""
    kinds = dict.fromkeys([s.accelerator for s in prediction.stages] + list(more))
    return {k: KIND_COLORS[i % len(KIND_COLORS)] for i, k in enumerate(kinds)}


def timeline_title(prediction: Prediction, result: SearchResult | None = None) -> str:
    """The timeline's default title; with ``result``, a second line of its efficiencies."""
    interleaved = len({(r.pipeline, r.ranks) for r in prediction.stages}) < len(
        prediction.stages
    )  # a device group runs several stages
    schedule = "interleaved 1F1B" if interleaved else "1F1B"
    title = (
        f"predicted {schedule} timeline of {prediction.model}: iteration "
        f"{prediction.iteration_time_s:.3f} s, bubble {100 * prediction.bubble_fraction:.1f}%,"
        f" {prediction.tokens_per_s:,.0f} tokens/s"
    )
    line = None if result is None else efficiency_line(result, explain=False)
    return title if line is None else f"{title}\n{line}"


def draw_timeline(
    ax: Axes, prediction: Prediction, title: str | None = None, result: SearchResult | None = None
) -> None:
    """Draw the 1F1B timeline of the slowest pipeline on ``ax`` (see the module docstring);
    ``title`` replaces :func:`timeline_title` (of ``result``'s figures where given)."""
    from matplotlib.patches import Patch

    slowest = slowest_pipeline(prediction)
    rows, micro_batches, sim = list(slowest.rows), slowest.micro_batches, slowest.simulation
    colors = _kind_colors(prediction)
    colors = {k: c for k, c in colors.items() if any(r.accelerator == k for r in rows)}
    # One bar per device group: an interleaved group runs several rows' chunks.
    num_groups, chunks = slowest.num_groups, slowest.chunks
    total_s = sim.makespan_s + prediction.dp_sync_s + prediction.optimizer_s
    numbered = len(rows) * micro_batches <= MICRO_BATCH_LABELS
    labels = [
        f"S{r.stage} {r.accelerator} TP{r.tp} L{r.layers[0]}-{r.layers[1]}"
        + (f" +{chunks - 1} chunks" if chunks > 1 else "")
        for r in rows[:num_groups]
    ]
    rows = rows[:num_groups]  # stage g < num_groups is device group g's first chunk
    for s, row in enumerate(rows):
        spans: dict[str, list[tuple[float, float]]] = {"forward": [], "backward": [], "p2p": []}
        for e in sim.timeline[s]:
            spans[e.kind if e.kind in spans else "p2p"].append((e.start_s, e.end_s - e.start_s))
            if numbered and e.kind == "forward" and e.end_s - e.start_s > 0.015 * total_s:
                ax.text(
                    e.start_s + (e.end_s - e.start_s) / 2,
                    s,
                    str(e.micro_batch),
                    ha="center",
                    va="center",
                    fontsize=6,
                    clip_on=True,
                )
        base = colors[row.accelerator]
        ax.broken_barh(spans["forward"], (s - 0.4, 0.8), facecolors=lighter(base))
        ax.broken_barh(spans["backward"], (s - 0.4, 0.8), facecolors=base)
        ax.broken_barh(spans["p2p"], (s + 0.25, 0.15), facecolors=P2P)
        ax.broken_barh(
            [
                (sim.makespan_s, row.dp_sync_s),
                (sim.makespan_s + prediction.dp_sync_s, row.optimizer_s),
            ],
            (s - 0.4, 0.8),
            facecolors=(SYNC, OPT),
        )
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, total_s)
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or timeline_title(prediction, result), fontsize=10)
    handles = [Patch(color=lighter(c), label=f"forward {k}") for k, c in colors.items()]
    handles += [Patch(color=c, label=f"backward {k}") for k, c in colors.items()]
    handles += [
        Patch(color=P2P, label="p2p"),
        Patch(color=SYNC, label=f"DP sync {prediction.dp_sync_s:.3f} s"),
        Patch(color=OPT, label=f"optimizer {prediction.optimizer_s:.3f} s"),
    ]
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False
    )


def _allocation_grid(cluster: ClusterSpec) -> tuple[int, int, float, float]:
    """(nodes per line, lines, width, height) of the allocation grid, in cell units."""
    widest = max(n.nproc for n in cluster.nodes())
    per_line = max(1, min(len(cluster.nodes()), CELLS_PER_LINE // (widest + 1)))
    lines = -(-len(cluster.nodes()) // per_line)
    return per_line, lines, max(per_line * (widest + 1), 16), lines * 2.2 + 0.8


def draw_allocation(
    ax: Axes,
    prediction: Prediction,
    cluster: ClusterSpec,
    title: str = "allocation: devices by node",
) -> None:
    """Draw every node's devices on ``ax``: cell colour and number = stage, strip = kind."""
    from matplotlib.collections import PatchCollection
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch, Rectangle

    stage_of: dict[int, int] = {}
    for row in prediction.stages:  # an interleaved device group: its first stage
        for rank in row.ranks:
            stage_of.setdefault(rank, row.stage)
    kinds = {info.rank: info.accelerator.label for info in cluster.rank_map()}
    colors = _kind_colors(prediction, tuple(kinds.values()))
    nodes = cluster.nodes()
    widest = max(n.nproc for n in nodes)
    per_line, _, width, height = _allocation_grid(cluster)
    cells, strips = [], []
    cell_colors, strip_colors = [], []
    for i, node in enumerate(nodes):
        x0, y0 = (i % per_line) * (widest + 1), (i // per_line) * 2.2
        node_kinds = " + ".join(
            dict.fromkeys(kinds[r] for r in range(node.first_rank, node.first_rank + node.nproc))
        )
        ax.text(x0, y0 - 0.15, f"node {node.node}: {node_kinds}", fontsize=6, va="bottom")
        for j in range(node.nproc):
            rank = node.first_rank + j
            stage = stage_of.get(rank)
            face = IDLE if stage is None else STAGE_COLORS[stage % len(STAGE_COLORS)]
            cells.append(Rectangle((x0 + j, y0), 0.92, 1.0))
            cell_colors.append(face)
            strips.append(Rectangle((x0 + j, y0 + 1.05), 0.92, 0.3))
            strip_colors.append(colors[kinds[rank]])
            dark = sum(to_rgb(face)) < 1.5
            ax.text(
                x0 + j + 0.46,
                y0 + 0.5,
                "-" if stage is None else str(stage),
                ha="center",
                va="center",
                fontsize=6,
                color="white" if dark else "black",
            )
    ax.add_collection(PatchCollection(cells, facecolors=cell_colors, edgecolors="none"))
    ax.add_collection(PatchCollection(strips, facecolors=strip_colors, edgecolors="none"))
    ax.set_xlim(-0.2, width - 0.2)
    ax.set_ylim(height - 0.8, -0.8)
    ax.set_aspect("equal")
    ax.set_anchor("W")
    ax.axis("off")
    ax.set_title(
        f"{title} (cell: stage it runs, in every DP replica; strip: accelerator kind)",
        fontsize=10,
        loc="left",
    )
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in colors.items()],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
        title="kind",
        title_fontsize=8,
    )


def _timeline_height(prediction: Prediction, result: SearchResult | None = None) -> float:
    title_lines = timeline_title(prediction, result).count("\n") + 1
    return 1.6 + 0.2 * title_lines + 0.32 * len(_slowest_rows(prediction)[0])


def _allocation_height(cluster: ClusterSpec) -> float:
    """Inches for the grid at the width the axes get (the figure less labels and legend)."""
    _, _, width, height = _allocation_grid(cluster)
    return 0.9 + (WIDTH_IN - 3.6) * height / width


def save_timeline_chart(
    prediction: Prediction,
    path: str | Path,
    title: str | None = None,
    result: SearchResult | None = None,
) -> Path:
    """Write the 1F1B timeline of ``prediction`` alone as a PNG at ``path`` (overwrites);
    ``result``: the search result whose efficiencies the title gives."""
    fig = _figure(_timeline_height(prediction, None if title else result))
    draw_timeline(fig.add_subplot(), prediction, title, result)
    return _save(fig, path)


def save_allocation_chart(prediction: Prediction, cluster: ClusterSpec, path: str | Path) -> Path:
    """Write the allocation of ``prediction``'s plan on ``cluster`` alone as a PNG at ``path``."""
    fig = _figure(_allocation_height(cluster))
    draw_allocation(fig.add_subplot(), prediction, cluster)
    return _save(fig, path)


def save_chart(
    prediction: Prediction,
    cluster: ClusterSpec,
    path: str | Path,
    result: SearchResult | None = None,
) -> Path:
    """Write the timeline above the allocation as one PNG at ``path`` (``tools/plan.py
    --chart``; overwrites); ``result``: the search result whose efficiencies the timeline's
    title gives."""
    top, bottom = _timeline_height(prediction, result), _allocation_height(cluster)
    fig = _figure(top + bottom)
    grid: Any = fig.add_gridspec(2, 1, height_ratios=(top, bottom))
    draw_timeline(fig.add_subplot(grid[0]), prediction, result=result)
    draw_allocation(fig.add_subplot(grid[1]), prediction, cluster)
    return _save(fig, path)


__all__ = [
    "KIND_COLORS",
    "STAGE_COLORS",
    "draw_allocation",
    "draw_timeline",
    "save_allocation_chart",
    "save_chart",
    "save_timeline_chart",
    "timeline_title",
]
