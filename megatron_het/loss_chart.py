"""A PNG of a run's loss curve from its ``--metrics-file`` (JSON lines, one record per iteration).

Reads the records written by :class:`megatron_het.training.metrics.TrainingLogger`:
``{"split": "train", "iteration": i, "loss": x, ...}`` per iteration and
``{"split": "valid", "iteration": i, "loss": x, ...}`` per evaluation. The train loss is drawn
per iteration (with a running mean over long runs), the validation losses as points. Drawn with
matplotlib on the Agg canvas, imported only when a chart is drawn.
"""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path

from megatron_het.errors import UserError
from megatron_het.fileio import read_text_file

# Runs with at least this many train records also get a running mean of the train loss.
SMOOTH_FROM = 100


def read_losses(metrics_file: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{"train": [(iteration, loss), ...], "valid": [...]}`` in file order; lines cut short by
    a crash and records without a loss are skipped. Missing file: UserError."""
    text = read_text_file(
        metrics_file,
        f"metrics file {metrics_file}",
        "pass the --metrics-file that pretrain_llama.py wrote",
    )
    out: dict[str, list[tuple[int, float]]] = {"train": [], "valid": []}
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or record.get("split") not in out:
            continue
        try:
            point = (int(record["iteration"]), float(record["loss"]))
        except (KeyError, TypeError, ValueError):
            continue
        out[record["split"]].append(point)
    return out


def _running_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` finite values at each point (a NaN loss does not spread)."""
    recent: deque[float] = deque()
    total, out = 0.0, []
    for v in values:
        if math.isfinite(v):
            recent.append(v)
            total += v
            if len(recent) > window:
                total -= recent.popleft()
        out.append(total / len(recent) if recent else math.nan)
    return out


def save_loss_chart(
    metrics_file: str | Path, out_png: str | Path, title: str = "training loss"
) -> Path:
    """Draw the train loss per iteration and the validation loss points of ``metrics_file`` into
    ``out_png`` (overwrites) and return its path. Raises UserError when the file is missing or
    holds no train records."""
    losses = read_losses(metrics_file)
    train, valid = losses["train"], losses["valid"]
    if not train:
        raise UserError(
            f"metrics file {metrics_file} has no train records (lines with "
            f'"split": "train", "iteration" and "loss"); pass the --metrics-file '
            f"of a run that trained at least one iteration"
        )
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    iterations, values = [i for i, _ in train], [v for _, v in train]
    smooth = len(train) >= SMOOTH_FROM
    ax.plot(
        iterations,
        values,
        color="#1f77b4",
        linewidth=1.0,
        alpha=0.35 if smooth else 1.0,
        label="train loss",
    )
    if smooth:
        window = max(2, len(train) // 50)
        ax.plot(
            iterations,
            _running_mean(values, window),
            color="#1f77b4",
            linewidth=1.8,
            label=f"train loss, mean of {window} iterations",
        )
    if valid:
        ax.plot(
            [i for i, _ in valid],
            [v for _, v in valid],
            "o",
            color="#d62728",
            markersize=5,
            label="validation loss",
        )
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(out_png)
    fig.savefig(out, format="png")
    return out


__all__ = ["read_losses", "save_loss_chart"]
