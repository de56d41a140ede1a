"""Training logs: Megatron-style lines on stdout, tensorboard scalars and a JSON-lines file.

Every iteration goes to the metrics file and tensorboard (and wandb with ``--wandb-project``);
stdout gets one line per ``--log-interval`` iterations with the interval's mean loss and time
per iteration, and a compact second line with each stage's mean compute, p2p wait and bubble
seconds (the trainer prints the ``--log-straggler`` lines after it). Iterations
``--skip-nonfinite-steps`` skipped are left out of the interval's mean loss and counted on its
line. A run has one logger, on its logging rank. Every throughput figure of a printed line
divides by the same mean iteration time: "throughput per device" is the model's FLOPs over all
devices of the run, the figure per kind is the FLOPs of that kind's stages over the devices of
that kind (so the device-weighted mean of the kinds' figures is the per-device figure), and MFU
is the model's FLOP/s over the summed peak of all devices.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from megatron_het.config import ModelConfig, TrainConfig
from megatron_het.training.throughput import ThroughputMetrics
from megatron_het.training.wandb_log import WandbLog


def _rewrite_metrics_upto(path: pathlib.Path, last_iteration: int) -> None:
    """Keep only the lines of iterations ``<= last_iteration`` (those of the loaded checkpoint)."""
    if not path.exists():
        return
    kept = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if int(record.get("iteration", 0)) <= last_iteration:
                kept.append(json.dumps(record))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


class TrainingLogger:
    """Writes the per-iteration and evaluation metrics of one run.

    Side effects on construction: truncates ``--metrics-file`` at a fresh start
    (``start_iteration == 0``) or drops its lines past ``start_iteration`` on resume, and opens a
    tensorboard writer in ``--tensorboard-dir``. ``num_devices`` divides the TFLOP/s.
    """

    def __init__(
        self,
        train: TrainConfig,
        model_config: ModelConfig,
        seq_length: int,
        start_iteration: int,
        num_devices: int = 1,
        out: TextIO | None = None,
        throughput: ThroughputMetrics | None = None,
        run_record: dict[str, Any] | None = None,
    ) -> None:
        self.train = train
        self.out = out or sys.stdout
        self.throughput = throughput
        self._stage_rows: list[list[dict[str, Any]]] = []  # per iteration of the interval
        self.tokens_per_iteration = train.global_batch_size * seq_length
        self.flops_per_iteration = model_config.flops_per_token(seq_length) * (
            self.tokens_per_iteration
        )
        self.num_devices = num_devices
        # (loss, seconds, skipped as non-finite) of each iteration since the last line
        self._interval: list[tuple[float, float, bool]] = []
        self._skipped_total: int | None = None  # with --skip-nonfinite-steps
        self._metrics: TextIO | None = None
        if train.metrics_file:
            path = pathlib.Path(train.metrics_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            if start_iteration > 0:
                _rewrite_metrics_upto(path, start_iteration)
            self._metrics = open(path, "a" if start_iteration > 0 else "w", encoding="utf-8")
        self._writer = None
        if train.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=train.tensorboard_dir)
        self._wandb: WandbLog | None = None
        if train.wandb.project is not None:
            self._wandb = WandbLog(train, run_record or {})

    def print(self, message: str) -> None:
        """One line (or block) of the run's log on ``out``, flushed at once."""
        print(message, file=self.out, flush=True)

    def _write_record(self, record: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()

    def _scalars(self, iteration: int, values: dict[str, float]) -> None:
        if self._writer is not None:
            for tag, value in values.items():
                self._writer.add_scalar(tag, value, iteration)
        if self._wandb is not None:
            self._wandb.log(iteration, values)

    def closes_interval(self, iteration: int) -> bool:
        """Whether ``iteration`` closes a log interval (its line is printed)."""
        return iteration % self.train.log_interval == 0 or iteration == self.train.train_iters

    def log_train(
        self,
        iteration: int,
        consumed_samples: int,
        loss: float,
        lr: float,
        grad_norm: float,
        iteration_time_s: float,
        extra: Mapping[str, Any] | None = None,
        extra_scalars: Mapping[str, float] | None = None,
    ) -> None:
        """Record one iteration; prints the interval summary when ``iteration`` closes one.

        ``extra`` fields go to the metrics line (after the common keys; its ``stages`` rows
        feed the printed stage line; ``skipped_step`` true marks an iteration skipped as
        non-finite, left out of the interval's mean loss, and ``nonfinite_skipped_iterations``
        the run's count of those, printed with the interval) and ``extra_scalars`` to
        tensorboard.
        """
        iteration_time_s = max(iteration_time_s, 1e-9)
        tokens_per_s = self.tokens_per_iteration / iteration_time_s
        tflops = self.flops_per_iteration / iteration_time_s / self.num_devices / 1e12
        self._write_record(
            {
                "split": "train",
                "iteration": iteration,
                "consumed_samples": consumed_samples,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "iteration_time_s": iteration_time_s,
                "tokens_per_s": tokens_per_s,
                "tflops_per_device": tflops,
                "global_batch_size": self.train.global_batch_size,
                **(extra or {}),
            }
        )
        self._scalars(
            iteration,
            {
                "lm loss": loss,
                "learning-rate": lr,
                "grad-norm": grad_norm,
                "iteration-time": iteration_time_s,
                "tokens-per-second": tokens_per_s,
                "tflops-per-device": tflops,
                **(extra_scalars or {}),
            },
        )
        extra = extra or {}
        self._interval.append((loss, iteration_time_s, bool(extra.get("skipped_step"))))
        if "nonfinite_skipped_iterations" in extra:
            self._skipped_total = int(extra["nonfinite_skipped_iterations"])
        if "stages" in extra:
            self._stage_rows.append(list(extra["stages"]))
        if self.closes_interval(iteration):
            self._print_interval(iteration, consumed_samples, lr, grad_norm)

    def _kinds_note(self, mean_time: float) -> str:
        if self.throughput is None:
            return ""
        kinds = ", ".join(
            f"{label} {value:.4g}"
            for label, value in self.throughput.tflops_per_accelerator(mean_time).items()
        )
        return (
            f" MFU: {100 * self.throughput.mfu(mean_time):.2f}% | TFLOP/s per device of "
            f"each kind: {kinds} |"
        )

    def _stage_line(self) -> str:
        """Each stage's compute / p2p wait / bubble seconds, averaged over the interval."""
        if not self._stage_rows:
            return ""
        count = len(self._stage_rows)
        parts = []
        for i, row in enumerate(self._stage_rows[-1]):
            mean = {
                name: sum(rows[i][name] for rows in self._stage_rows) / count
                for name in ("compute_s", "p2p_wait_s", "bubble_s")
            }
            parts.append(
                f"p{row['pipeline']}s{row['stage']} {row['accelerator']} "
                f"{mean['compute_s']:.3f}/{mean['p2p_wait_s']:.3f}/"
                f"{mean['bubble_s']:.3f}"
            )
        self._stage_rows.clear()
        return "   stages, compute/p2p wait/bubble s: " + " | ".join(parts)

    def _print_interval(
        self, iteration: int, consumed_samples: int, lr: float, grad_norm: float
    ) -> None:
        count = len(self._interval)
        losses = [loss for loss, _, skipped in self._interval if not skipped]
        mean_loss = sum(losses) / len(losses) if losses else math.nan
        mean_time = sum(seconds for _, seconds, _ in self._interval) / count
        skipped = count - len(losses)
        self._interval.clear()
        skipped_note = (
            ""
            if self._skipped_total is None
            else f" skipped non-finite iterations: {skipped} (run total {self._skipped_total}) |"
        )
        tflops = self.flops_per_iteration / mean_time / self.num_devices / 1e12
        note = self._kinds_note(mean_time)
        stages = self._stage_line()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self.print(
            f" [{stamp}] iteration {iteration:8d}/{self.train.train_iters:8d} |"
            f" consumed samples: {consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {mean_time * 1000:.1f} |"
            f" learning rate: {lr:.6E} | global batch size: {self.train.global_batch_size:5d} |"
            f" lm loss: {mean_loss:.6E} | grad norm: {grad_norm:.3f} |"
            f" tokens per second: {self.tokens_per_iteration / mean_time:.1f} |"
            f" throughput per device (TFLOP/s/device): {tflops:.4g} |{note}{skipped_note}"
            + (f"\n{stages}" if stages else "")
        )

    def log_eval(self, iteration: int, consumed_samples: int, loss: float) -> None:
        """Record one evaluation of the valid split."""
        ppl = math.exp(min(loss, 20.0))
        self._write_record(
            {
                "split": "valid",
                "iteration": iteration,
                "consumed_samples": consumed_samples,
                "loss": loss,
                "ppl": ppl,
            }
        )
        self._scalars(iteration, {"lm loss validation": loss, "lm loss validation ppl": ppl})
        text = (
            f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} |"
            f" lm loss PPL: {ppl:.6E} |"
        )
        rule = "-" * (len(text) + 1)
        self.print(f"{rule}\n{text}\n{rule}")

    def close(self) -> None:
        """Flush and close the metrics file and the tensorboard writer."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
