"""The closing summary a run prints on its logging rank: what it reached, how fast, where it is.

Throughput figures use the median iteration time of the run, without its first iteration (the
warm-up: allocation, first communicator use) when there was more than one. TFLOP/s per kind
divides the model FLOPs its stages compute by the number of devices of that kind; MFU divides
the model's FLOP/s by the summed peak FLOP/s of every device in the run.
"""

from __future__ import annotations

import statistics

from megatron_het.training.trainer import Trainer


def measured_iteration_s(times: list[float]) -> float | None:
    """The median of ``times`` without the first (warm-up) one where there are several."""
    if not times:
        return None
    return statistics.median(times[1:] if len(times) > 1 else times)


def _outputs(trainer: Trainer) -> list[str]:
    setup = trainer.setup
    train, data = setup.train, setup.run.data
    lines = []
    if train.save:
        lines.append(f"  checkpoint:   {train.save} (iteration {trainer.progress.iteration})")
    if data.tokenizer_model:
        lines.append(f"  tokenizer:    {data.tokenizer_model}")
    if train.metrics_file:
        lines.append(f"  metrics:      {train.metrics_file} (one JSON line per iteration)")
    if train.tensorboard_dir:
        lines.append(f"  tensorboard:  tensorboard --logdir {train.tensorboard_dir}")
    if train.save:
        tokenizer = f" --tokenizer-model {data.tokenizer_model}" if data.tokenizer_model else ""
        lines.append(
            f"  export to Hugging Face: python tools/convert_checkpoint.py "
            f"--source-format megatron_het --target-format hf --load-dir {train.save} "
            f"--save-dir HF_DIR{tokenizer}"
        )
        lines.append(
            "  load it: transformers.AutoModelForCausalLM.from_pretrained('HF_DIR') "
            "(and AutoTokenizer), or megatron_het.load_pretrained("
            f"'{train.save}')"
        )
    return lines


def closing_summary(trainer: Trainer, wall_s: float, predicted: float | None = None) -> str:
    """The summary block: final losses, wall time, throughput per kind, predicted vs measured
    iteration time (``predicted``, None: not shown), and where the outputs are (with the
    export and load commands)."""
    setup = trainer.setup
    lines = ["> summary"]
    losses = [
        f"final training loss {trainer.last_loss:.4f}"
        if trainer.last_loss is not None
        else "no training iteration ran"
    ]
    if trainer.last_eval_loss is not None:
        losses.append(f"validation loss {trainer.last_eval_loss:.4f}")
    lines.append(
        f"  {', '.join(losses)} at iteration {trainer.progress.iteration}; wall time {wall_s:.1f} s"
    )
    measured = measured_iteration_s(trainer.iteration_times)
    if measured is not None:
        tokens = setup.train.global_batch_size * setup.run.data.seq_length
        kinds = ", ".join(
            f"{label} {value:.4g}"
            for label, value in trainer.metrics.tflops_per_accelerator(measured).items()
        )
        lines.append(
            f"  median iteration {measured:.3f} s: {tokens / measured:.1f} tokens/s, "
            f"MFU {100 * trainer.metrics.mfu(measured):.2f}% (of the summed peak of "
            f"all {setup.plan.world_size} devices); TFLOP/s per device of each kind: "
            f"{kinds}"
        )
        if predicted is not None:
            lines.append(
                f"  predicted iteration {predicted:.3f} s vs measured {measured:.3f} s "
                f"({100 * (predicted - measured) / measured:+.1f}%)"
            )
    return "\n".join(lines + _outputs(trainer))
