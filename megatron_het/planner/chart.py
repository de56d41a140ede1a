"""A PNG of a predicted plan: the 1F1B timeline per stage and the cluster's allocation.

Top: one row per stage of the slowest pipeline, its forward (light) and backward (dark) steps
as simulated by :func:`megatron_het.perf.simulate_1f1b` with the predicted per-stage times, p2p
transfers as a thin grey strip, then the DP gradient sync and the optimizer step; the white gaps
are the bubble. Bottom: every node of the cluster as a row of device cells, coloured by the
stage the device runs (the same colour for that stage in every DP replica).
"""
from __future__ import annotations

from pathlib import Path

from megatron_het.cluster import ClusterSpec
from megatron_het.perf import Prediction, simulate_1f1b
from megatron_het.planner.png import Canvas, Color, text_width

WIDTH = 1200
MARGIN = 10
ROW = 14
CELL = 7
KIND_COLORS: tuple[Color, ...] = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189),
                                  (255, 127, 14), (140, 86, 75))
STAGE_COLORS: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40),
                                   (148, 103, 189), (140, 86, 75), (227, 119, 194),
                                   (127, 127, 127), (188, 189, 34), (23, 190, 207))
GREY, DARK, SYNC, OPT = (170, 170, 170), (40, 40, 40), (90, 90, 90), (0, 0, 0)


def _lighter(color: Color) -> Color:
    return tuple(c + (255 - c) * 55 // 100 for c in color)  # type: ignore[return-value]


def _slowest_rows(prediction: Prediction) -> list:
    slowest = max(prediction.pipelines, key=lambda p: p.time_s).pipeline
    return [s for s in prediction.stages if s.pipeline == slowest]


def _node_rows(cluster: ClusterSpec) -> list[list[int]]:
    nodes: dict[int, list[int]] = {}
    for info in cluster.rank_map():
        nodes.setdefault(info.node, []).append(info.rank)
    return [nodes[n] for n in sorted(nodes)]


def render_chart(prediction: Prediction, cluster: ClusterSpec, title: str = "") -> Canvas:
    """Draw the timeline and the allocation (see the module docstring)."""
    rows = _slowest_rows(prediction)
    kinds = list(dict.fromkeys(r.accelerator for r in rows))
    labels = [f"S{r.stage} {r.accelerator} TP{r.tp} L{r.layers[0]}-{r.layers[1]}" for r in rows]
    label_w = max(text_width(s) for s in labels) + 2 * MARGIN
    nodes = _node_rows(cluster)
    per_line = max(1, (WIDTH - 2 * MARGIN) // (max(len(n) for n in nodes) * CELL + 2 * CELL))
    node_lines = -(-len(nodes) // per_line)
    timeline_top = 3 * ROW
    alloc_top = timeline_top + ROW * len(rows) + 3 * ROW
    height = alloc_top + node_lines * (CELL + 3) + 2 * ROW + ROW * (-(-len(rows) // 6))
    canvas = Canvas(WIDTH, height)
    canvas.text(MARGIN, MARGIN, title or (
        f"predicted 1F1B timeline: iteration {prediction.iteration_time_s:.3f} s, "
        f"bubble {100 * prediction.bubble_fraction:.1f}%, {prediction.tokens_per_s:,.0f} tokens/s"
    ).replace(",", " "))
    _draw_timeline(canvas, prediction, rows, kinds, labels, label_w, timeline_top)
    canvas.text(MARGIN, alloc_top - 2 * ROW + 3, "allocation: one row per node, one cell per "
                "device, colour = stage")
    _draw_allocation(canvas, prediction, nodes, per_line, alloc_top)
    legend_top = alloc_top + node_lines * (CELL + 3) + ROW
    for i, r in enumerate(rows):
        x, y = MARGIN + (i % 6) * 195, legend_top + (i // 6) * ROW
        canvas.rect(x, y, x + CELL, y + CELL, STAGE_COLORS[r.stage % len(STAGE_COLORS)])
        canvas.text(x + CELL + 4, y, f"S{r.stage} {r.accelerator}")
    return canvas


def _draw_timeline(canvas: Canvas, prediction: Prediction, rows: list, kinds: list[str],
                   labels: list[str], label_w: int, top: int) -> None:
    sim = simulate_1f1b([r.forward_s for r in rows], [r.backward_s for r in rows],
                        prediction.pipelines[0].micro_batches,
                        [r.p2p_forward_s for r in rows[:-1]],
                        [r.p2p_backward_s for r in rows[:-1]])
    total = sim.makespan_s + prediction.dp_sync_s + prediction.optimizer_s
    scale = (WIDTH - label_w - MARGIN) / total
    for s, (r, label) in enumerate(zip(rows, labels)):
        y = top + s * ROW
        base = KIND_COLORS[kinds.index(r.accelerator) % len(KIND_COLORS)]
        canvas.text(MARGIN, y + 2, label)
        for e in sim.timeline[s]:
            x0, x1 = label_w + e.start_s * scale, label_w + e.end_s * scale
            if e.kind == "forward":
                canvas.rect(x0, y, x1, y + ROW - 2, _lighter(base))
            elif e.kind == "backward":
                canvas.rect(x0, y, x1, y + ROW - 2, base)
            else:
                canvas.rect(x0, y + ROW - 5, x1, y + ROW - 2, GREY)
        end = label_w + sim.makespan_s * scale
        canvas.rect(end, y, end + r.dp_sync_s * scale, y + ROW - 2, SYNC)
        start = end + prediction.dp_sync_s * scale
        canvas.rect(start, y, start + r.optimizer_s * scale, y + ROW - 2, OPT)
    y = top + len(rows) * ROW + 3
    x = canvas.text(label_w, y, "light: forward  dark: backward  grey: p2p  ", DARK)
    canvas.text(x, y, f"then dp sync {prediction.dp_sync_s:.3f} s and optimizer "
                f"{prediction.optimizer_s:.3f} s; white: bubble", DARK)


def _draw_allocation(canvas: Canvas, prediction: Prediction, nodes: list[list[int]],
                     per_line: int, top: int) -> None:
    stage_of = {rank: s.stage for s in prediction.stages for rank in s.ranks}
    width = max(len(n) for n in nodes) * CELL + 2 * CELL
    for i, ranks in enumerate(nodes):
        x0 = MARGIN + (i % per_line) * width
        y0 = top + (i // per_line) * (CELL + 3)
        for j, rank in enumerate(ranks):
            stage = stage_of.get(rank)
            color = GREY if stage is None else STAGE_COLORS[stage % len(STAGE_COLORS)]
            canvas.rect(x0 + j * CELL, y0, x0 + (j + 1) * CELL - 1, y0 + CELL, color)


def save_chart(prediction: Prediction, cluster: ClusterSpec, path: str | Path) -> None:
    """Render and write the PNG to ``path`` (overwrites)."""
    render_chart(prediction, cluster).save(path)


__all__ = ["render_chart", "save_chart"]
