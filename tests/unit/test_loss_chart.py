"""The loss curve PNG of a --metrics-file, and its one-line errors."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest

from megatron_het.errors import UserError
from megatron_het.loss_chart import read_losses, save_loss_chart

TRAIN, VALID = (31, 119, 180), (214, 39, 40)  # the curve's and the points' colours


def write_metrics(path: pathlib.Path, iterations: int, every_valid: int = 10) -> pathlib.Path:
    """Records as TrainingLogger writes them, and a last line cut short by a crash."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(1, iterations + 1):
            f.write(
                json.dumps(
                    {
                        "split": "train",
                        "iteration": i,
                        "consumed_samples": 16 * i,
                        "loss": 8 * math.exp(-i / 40) + 2,
                        "lr": 1e-3,
                    }
                )
                + "\n"
            )
            if i % every_valid == 0:
                f.write(
                    json.dumps(
                        {
                            "split": "valid",
                            "iteration": i,
                            "loss": 8 * math.exp(-i / 40) + 2.2,
                            "ppl": 9.0,
                        }
                    )
                    + "\n"
                )
        f.write('{"split": "train", "itera')
    return path


def image(path: pathlib.Path) -> np.ndarray:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and b"Matplotlib" in path.read_bytes()
    return (imread(path)[..., :3] * 255).round().astype(np.uint8)


def has(pixels: np.ndarray, rgb: tuple[int, int, int]) -> bool:
    return bool((pixels == np.array(rgb, dtype=np.uint8)).all(axis=-1).any())


@pytest.mark.parametrize("iterations", [30, 150])  # without and with the running mean
def test_chart_draws_train_curve_and_validation_points(tmp_path, iterations) -> None:
    metrics = write_metrics(tmp_path / "metrics.jsonl", iterations)
    out = save_loss_chart(metrics, tmp_path / "loss.png", title="demo loss")
    assert out == tmp_path / "loss.png"
    pixels = image(out)
    assert pixels.shape[:2] == (450, 800) and has(pixels, TRAIN) and has(pixels, VALID)
    losses = read_losses(metrics)
    assert len(losses["train"]) == iterations and len(losses["valid"]) == iterations // 10


def test_train_records_alone_are_enough(tmp_path) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"split": "train", "iteration": 1, "loss": 5.0}) + "\n")
    assert not has(image(save_loss_chart(metrics, tmp_path / "l.png")), VALID)


@pytest.mark.parametrize(
    "content, fragment",
    [
        (None, "not found"),
        ("", "has no train records"),
        (
            json.dumps({"split": "valid", "iteration": 5, "loss": 3.0}) + "\n",
            "has no train records",
        ),
    ],
)
def test_missing_or_empty_metrics_are_one_line_errors(tmp_path, content, fragment) -> None:
    metrics = tmp_path / "metrics.jsonl"
    if content is not None:
        metrics.write_text(content)
    with pytest.raises(UserError) as info:
        save_loss_chart(metrics, tmp_path / "loss.png")
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert str(metrics) in str(info.value) and not (tmp_path / "loss.png").exists()
