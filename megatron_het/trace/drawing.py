"""A trace as a picture (matplotlib, Agg, imported only when drawn): per profiled rank, its
measured row and under it the predicted one, on one time axis in seconds.

Forwards are light and backwards dark in the rank's kind colour; transfer posts and waits grey;
the DP sync, the optimizer step and the other trainer phases black; a rank's TP and DP
collectives as a thin strip along the bottom of its row. Iteration starts are dotted lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_het.trace.chrome import tracks_of

# Kinds' colours as the planner's charts have them (their forwards lighter), so a kind keeps
# its colour from the plan's chart to the run's trace.
KIND_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
P2P, STEP, COLLECTIVE = "#9e9e9e", "#333333", "#f2b233"


def lighter(color: str, amount: float = 0.55) -> tuple[float, float, float]:
    """``color`` mixed with white (``amount`` of white)."""
    from matplotlib.colors import to_rgb

    red, green, blue = (c + (1.0 - c) * amount for c in to_rgb(color))
    return red, green, blue


def _bars(events: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """(start, length) seconds of a track's events by what they draw as."""
    out: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        kind = e["cat"]
        if kind == "compute":
            kind = "backward" if e["name"].split()[0] == "backward" else "forward"
        out.setdefault(kind, []).append((e["ts"] / 1e6, e["dur"] / 1e6))
    return out


def save_trace_picture(trace: dict[str, Any], path: str | Path, title: str | None = None) -> Path:
    """Draw ``trace`` (see the module docstring) into the PNG ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ours = trace["otherData"]["megatron_het"]
    infos = sorted(ours["tracks"], key=lambda t: t["rank"])
    tracks = tracks_of(trace)
    kinds = list(dict.fromkeys(i["kind"] for i in infos))
    colors = {k: KIND_COLORS[n % len(KIND_COLORS)] for n, k in enumerate(kinds)}
    rows = len(infos) * 2
    fig = Figure(figsize=(12.0, 1.2 + 0.42 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    labels, end = [], 0.0
    for n, info in enumerate(infos):
        sides = tracks.get(info["rank"], {"measured": [], "predicted": []})
        base = colors[info["kind"]]
        for side, y in (("measured", 2 * n), ("predicted", 2 * n + 1)):
            bars = _bars(sides[side])
            alpha = 1.0 if side == "measured" else 0.6
            ax.broken_barh(
                bars.get("forward", []), (y - 0.4, 0.8), facecolors=lighter(base), alpha=alpha
            )
            ax.broken_barh(bars.get("backward", []), (y - 0.4, 0.8), facecolors=base, alpha=alpha)
            ax.broken_barh(bars.get("p2p", []), (y - 0.4, 0.8), facecolors=P2P, alpha=alpha)
            ax.broken_barh(bars.get("step", []), (y - 0.4, 0.8), facecolors=STEP, alpha=alpha)
            ax.broken_barh(bars.get("collective", []), (y + 0.25, 0.15), facecolors=COLLECTIVE)
            for start, width in (b for spans in bars.values() for b in spans):
                end = max(end, start + width)
            labels.append(info["name"] if side == "measured" else f"rank {info['rank']} predicted")
        for start, _ in _bars(sides["measured"]).get("iteration", []):
            ax.axvline(start, color="#bbbbbb", linestyle=":", linewidth=0.8)
    ax.set_yticks(range(rows), labels, fontsize=7)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xlim(0, end * 1.01 if end else 1.0)
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", alpha=0.3)
    iterations = ours["iterations"]
    ax.set_title(
        title or f"measured and predicted timeline, iterations {iterations[0]}-{iterations[-1]}",
        fontsize=10,
    )
    handles = [Patch(color=lighter(c), label=f"forward {k}") for k, c in colors.items()]
    handles += [Patch(color=c, label=f"backward {k}") for k, c in colors.items()]
    handles += [
        Patch(color=P2P, label="transfer post / wait"),
        Patch(color=STEP, label="DP sync, optimizer, gather"),
        Patch(color=COLLECTIVE, label="collectives"),
    ]
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False
    )
    out = Path(path)
    fig.savefig(out, format="png")
    return out
