"""What ``--async-save`` and ``dcp.async_save`` cost training, for ``bench.checkpoint_io``'s
``async_overhead`` section (its module doc says what is measured and how): one training
process per run, with synchronous saves, our background saves, DCP's and none, alternating.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import time

from bench import checkpoint_dcp
from megatron_het.config import ModelConfig

# The demo's model and batch; NullTokenizer adds an end-of-document token: 4095 + 1 = 4096.
DEMO_RUN = [
    "--model",
    "small",
    "--vocab-size",
    "4095",
    "--seq-length",
    "256",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--lr",
    "1e-3",
    "--seed",
    "1234",
    "--eval-interval",
    "100000",
    "--eval-iters",
    "0",
    "--log-interval",
    "100000",
]


def overhead_modes(args: argparse.Namespace) -> tuple[str, ...]:
    """The overhead runs' modes for ``--format``: our synchronous and background saves, DCP's
    ``dcp.async_save`` (``dcp_async``) and no saves."""
    ours, dcp = ("sync", "async"), ("dcp_async",)
    return {"ours": ours, "dcp": dcp, "both": ours + dcp}[args.format] + ("none",)


def _overhead_run(
    mode: str, args: argparse.Namespace, root: pathlib.Path, io_model: ModelConfig
) -> tuple[float, list[float]]:
    """Seconds per iteration of one run (see the module doc) and the seconds each save held
    the training thread, in this process."""
    from megatron_het.arguments import parse_run_config
    from megatron_het.comm import UnifiedCommunicator
    from megatron_het.launcher.world import init_world, shutdown_world
    from megatron_het.training.checkpointing import CheckpointSaver
    from megatron_het.training.loop import train
    from megatron_het.training.setup import prepare_run
    from megatron_het.training.stop import StopRequest
    from megatron_het.training.trainer import build_trainer

    class TimedSaver(CheckpointSaver):
        """The run's saver, timed; in ``dcp_async`` mode DCP's background saves instead."""

        first_poll: float | None = None  # the end of iteration 1 (the process warms up)
        last_save_point = 0.0
        dcp_saves: checkpoint_dcp.DcpAsyncSaves | None = None

        def poll(self) -> None:
            if self.first_poll is None:
                self.first_poll = time.perf_counter()
            self.dcp_saves.poll() if self.dcp_saves else super().poll()

        def save(self) -> pathlib.Path | None:
            self.last_save_point = time.perf_counter()
            if self.dcp_saves is None:
                path = super().save()
            else:
                state = checkpoint_dcp.trainer_state(self.trainer)
                path = self.dcp_saves.start(state, self.trainer.progress.iteration)
            stalls.append(time.perf_counter() - self.last_save_point)
            return path

        def finish(self) -> None:
            self.dcp_saves.finish() if self.dcp_saves else super().finish()

        def close(self) -> None:
            self.dcp_saves.close() if self.dcp_saves else super().close()

    iterations, save = 2 * args.save_interval, root / f"overhead-{mode}"
    argv = [*DEMO_RUN, "--train-iters", str(iterations), *_overhead_model(args, io_model)]
    if mode != "none":
        argv += ["--save", str(save), "--save-interval", str(args.save_interval)]
    if mode == "async":
        argv.append("--async-save")
    setup = prepare_run(parse_run_config(argv), 1)
    init_world(None, device_type="cpu")
    stalls: list[float] = []
    try:
        trainer = build_trainer(setup, UnifiedCommunicator.from_cluster(setup.cluster))
        saver = TimedSaver(trainer)
        if mode == "dcp_async":
            saver.dcp_saves = checkpoint_dcp.DcpAsyncSaves(save)
        try:
            train(trainer, StopRequest(), saver=saver)
        finally:
            trainer.optimizer.close()
        assert saver.first_poll is not None  # the loop polls after every iteration
        return (saver.last_save_point - saver.first_poll) / (iterations - 1), stalls
    finally:
        shutdown_world()
        shutil.rmtree(save, ignore_errors=True)


def _overhead_model(args: argparse.Namespace, config: ModelConfig) -> list[str]:
    """Shape flags for the overhead runs: none (the demo's preset) or the io model's
    (``config``)."""
    if not args.overhead_io_model:
        return []
    return [
        "--num-layers",
        str(config.num_layers),
        "--hidden-size",
        str(config.hidden_size),
        "--ffn-hidden-size",
        str(config.ffn_hidden_size),
        "--num-attention-heads",
        str(config.num_attention_heads),
        "--num-query-groups",
        str(config.num_query_groups),
    ]  # the demo's vocabulary


def measure_overhead(args: argparse.Namespace, root: pathlib.Path, io_model: ModelConfig) -> dict:
    """The ``async_overhead`` section of :mod:`bench.checkpoint_io` (see its doc): medians
    over ``--runs`` alternating runs of each mode; ``io_model``: the io part's model, trained
    with ``--overhead-io-model``."""
    modes = overhead_modes(args)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    stalls: dict[str, list[float]] = {mode: [] for mode in modes if mode != "none"}
    for _ in range(args.runs):
        for mode in modes:  # alternating, so drift of the host hits every mode alike
            seconds, held = _overhead_run(mode, args, root, io_model)
            times[mode].append(seconds)
            stalls.get(mode, []).extend(held)
    median = {mode: statistics.median(values) for mode, values in times.items()}
    ratios = {
        f"ratio_{a}_vs_{b}": round(median[a] / median[b], 4)
        for a, b in (
            ("async", "sync"),
            ("sync", "none"),
            ("async", "none"),
            ("dcp_async", "none"),
            ("dcp_async", "async"),
        )
        if a in median and b in median
    }
    return {
        "model": "io model" if args.overhead_io_model else "small",
        "save_interval": args.save_interval,
        "iterations_per_run": 2 * args.save_interval,
        "runs": args.runs,
        "iteration_s": {m: round(v, 5) for m, v in median.items()},
        "iteration_s_runs": {m: [round(v, 5) for v in vs] for m, vs in times.items()},
        "stall_s_per_save": {m: round(statistics.median(v), 4) for m, v in stalls.items()},
        "stall_s_saves": {m: [round(x, 4) for x in v] for m, v in stalls.items()},
        **ratios,
    }
