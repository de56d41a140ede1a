"""Megatron-LM checkpoint conversion timed, for ``bench.checkpoint_io``'s ``megatron_conversion``.

A random state of a model shaped like TinyLlama-1.1B's layers (hidden 2048, FFN 5632, 32
heads, 4 KV groups, vocabulary 32000; fewer layers, so that it stays near 1 GB) is written as
Megatron-LM would have saved it, by our own writers: the legacy ``--ckpt-format torch`` layout
at TP 2 x PP 2 (:func:`~megatron_het.checkpoint.megatron_lm.write_megatron_checkpoint`) and
``torch_dist`` (:func:`~megatron_het.checkpoint.megatron_lm_dist.write_dist_checkpoint`).
Each is then converted to ours and back with ``tools/convert_checkpoint.py``'s functions, as
its command line does. GB/s = the state's tensor bytes / seconds of one conversion (a read of
one format and a write of the other, from and to the page cache); medians over the rounds.
The first round checks that what came in equals the random state bitwise.

``torch_dist_optimizer``: the same weights as a torch_dist save WITH Adam's state (float32
moments and main weights, the non-distributed optimizer's layout: the checkpoint is about 7x the
bf16 weights), converted to ours with ``--with-optimizer`` (GB/s over the whole checkpoint's
tensor bytes), and what ``pretrain_llama.py --load`` reads of it on each rank of a TP 2 x PP 2
plan (:func:`~megatron_het.checkpoint.megatron_load.load_megatron_slices`'s box reads:
``rank_read_s`` and ``rank_read_gb``, the slowest rank's) against a whole read of the same
checkpoint (``whole_read_s``, what every rank read before).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import time
from typing import Any

import torch

from megatron_het.checkpoint.megatron_lm import read_megatron_checkpoint, write_megatron_checkpoint
from megatron_het.checkpoint.megatron_lm_dist import write_dist_checkpoint
from megatron_het.checkpoint.megatron_lm_files import load_pickled, read_dcp_metadata
from megatron_het.checkpoint.megatron_lm_names import padded_vocab_size, stage_slices
from megatron_het.checkpoint.megatron_lm_optim import (
    MegatronOptimizerState,
    TrainingRun,
    dist_optimizer_extras,
    read_optimizer_boxes,
)
from megatron_het.checkpoint.reader import load_model_state
from megatron_het.checkpoint.reshard import rank_writes, target_slice
from megatron_het.config import ModelConfig
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.tensor_parallel.sharding import parameter_shape

GB = 1e9
TP, PP = 2, 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CKPT_FORMATS = ("torch", "torch_dist")


def conversion_model(hidden_size: int, num_layers: int) -> ModelConfig:
    """TinyLlama-1.1B's proportions at ``hidden_size`` (2048 is its own) and ``num_layers``."""
    return ModelConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=hidden_size * 11 // 4,
        num_attention_heads=max(1, hidden_size // 64),
        num_query_groups=max(TP, hidden_size // 512),
        vocab_size=32000,
        name="bench-conversion",
    )


def random_state(
    config: ModelConfig, dtype: torch.dtype, shapes_only: bool = False
) -> dict[str, torch.Tensor]:
    """Every parameter of ``config`` at its global shape, random, in ``dtype`` (empty tensors
    on the meta device with ``shapes_only``)."""
    plan = ParallelPlan.from_dict(
        {
            "format": "megatron_het.plan/1",
            "micro_batch_size": 1,
            "pipelines": [
                {
                    "micro_batches": 1,
                    "stages": [
                        {
                            "accelerator": "cpu",
                            "tp": 1,
                            "ranks": [0],
                            "layers": [0, config.num_layers],
                        }
                    ],
                }
            ],
        }
    )
    if shapes_only:
        names = rank_writes(config, plan, 0)
        return {n: torch.empty(parameter_shape(n, config), device="meta") for n in names}
    generator = torch.Generator().manual_seed(7)
    return {
        name: torch.randn(parameter_shape(name, config), generator=generator).to(dtype)
        for name in rank_writes(config, plan, 0)
    }


def _tree_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _timed(action: Any) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _same(state: dict[str, torch.Tensor], load_dir: pathlib.Path) -> None:
    """RuntimeError unless our checkpoint at ``load_dir`` holds ``state`` bitwise."""
    _, loaded = load_model_state(load_dir)
    if sorted(loaded) != sorted(state) or any(not torch.equal(loaded[n], state[n]) for n in state):
        raise RuntimeError(f"the checkpoint converted into {load_dir} differs from the source")


def _round(
    state: dict[str, torch.Tensor], config: ModelConfig, root: pathlib.Path, check: bool
) -> dict[str, dict[str, float]]:
    """Seconds of making each Megatron-LM checkpoint and of converting it to ours and back."""
    from tools import convert_checkpoint

    parser = convert_checkpoint.build_parser()
    out: dict[str, dict[str, float]] = {}
    for ckpt_format in CKPT_FORMATS:
        source, ours, back = (root / f"{ckpt_format}-{s}" for s in ("mlm", "ours", "back"))
        write = write_dist_checkpoint if ckpt_format == "torch_dist" else write_megatron_checkpoint
        row = {"make_s": _timed(lambda: write(source, config, state, 100, tp_size=TP, pp_size=PP))}
        into = parser.parse_args(
            ["--source-format", "megatron", "--target-format", "megatron_het"]
            + ["--load-dir", str(source), "--save-dir", str(ours)]
        )
        row["to_ours_s"] = _timed(lambda: convert_checkpoint.megatron_to_megatron_het(into))
        back_flags = ["--target-tensor-parallel-size", str(TP)]
        back_flags += ["--target-pipeline-parallel-size", str(PP), "--ckpt-format", ckpt_format]
        out_of = parser.parse_args(
            ["--source-format", "megatron_het", "--target-format", "megatron", *back_flags]
            + ["--load-dir", str(ours), "--save-dir", str(back)]
        )
        row["from_ours_s"] = _timed(lambda: convert_checkpoint.megatron_het_to_megatron(out_of))
        row["megatron_gb"] = _tree_bytes(source) / GB
        row["ours_gb"] = _tree_bytes(ours) / GB
        if check:
            _same(state, ours)
        for path in (source, ours, back):
            shutil.rmtree(path, ignore_errors=True)
        out[ckpt_format] = row
    return out


def _optimizer_save(
    state: dict[str, torch.Tensor], config: ModelConfig, directory: pathlib.Path
) -> pathlib.Path:
    """``state`` as a torch_dist save with random Adam state (float32), iteration 100."""
    generator = torch.Generator().manual_seed(8)
    moments = {
        n: {m: torch.rand(t.shape, generator=generator) for m in ("exp_avg", "exp_avg_sq")}
        for n, t in state.items()
    }
    main = {n: t.float() for n, t in state.items()}
    run = TrainingRun(100, 800, 8, 1000, 3e-4, 3e-5, 10, None, "cosine", 0.1, (0.9, 0.95), 1e-8)
    saved = MegatronOptimizerState(100, moments, None, None, None, "bench")
    padded = padded_vocab_size(config.vocab_size, 128, TP)
    extras = dist_optimizer_extras(saved, main, config, padded, torch.bfloat16, run, 3e-4, False)
    return write_dist_checkpoint(directory, config, state, 100, TP, PP, extras=extras)


def _rank_read_s(directory: pathlib.Path, config: ModelConfig) -> tuple[float, float]:
    """(seconds, GB) of the slowest rank's box reads (weights' main copy and both moments) of a
    TP 2 x PP 2 plan, as ``--load`` reads them."""
    metadata = read_dcp_metadata(directory)
    common = load_pickled(directory / "common.pt", "bench")
    slowest = (0.0, 0.0)
    for stage in stage_slices(config.num_layers, PP):
        names = [
            n
            for n in random_state_names(config)
            if _in_stage(n, stage.layer_start, stage.layer_stop, stage.first, stage.last)
        ]
        for tp_rank in range(TP):
            boxes = {n: target_slice(n, config, TP, tp_rank) for n in names}
            start = time.perf_counter()
            _, nbytes = read_optimizer_boxes(directory, config, boxes, common, metadata, 100)
            slowest = max(slowest, (time.perf_counter() - start, nbytes / GB))
    return slowest


def random_state_names(config: ModelConfig) -> list[str]:
    return list(random_state(config, torch.bfloat16, shapes_only=True))


def _in_stage(name: str, start: int, stop: int, first: bool, last: bool) -> bool:
    if name.startswith("layers."):
        return start <= int(name.split(".")[1]) < stop
    if name == "embedding.weight":
        return first
    return last


def _optimizer_round(
    state: dict[str, torch.Tensor], config: ModelConfig, root: pathlib.Path
) -> dict[str, float]:
    from tools import convert_checkpoint

    source, ours = root / "optim-mlm", root / "optim-ours"
    row = {"make_s": _timed(lambda: _optimizer_save(state, config, source))}
    into = convert_checkpoint.build_parser().parse_args(
        ["--source-format", "megatron", "--target-format", "megatron_het", "--with-optimizer"]
        + ["--load-dir", str(source), "--save-dir", str(ours)]
    )
    row["to_ours_s"] = _timed(lambda: convert_checkpoint.megatron_to_megatron_het(into))
    directory = source / "iter_0000100"
    row["whole_read_s"] = _timed(lambda: read_megatron_checkpoint(directory, with_optimizer=True))
    row["rank_read_s"], row["rank_read_gb"] = _rank_read_s(directory, config)
    row["megatron_gb"] = _tree_bytes(source) / GB
    row["ours_gb"] = _tree_bytes(ours) / GB
    for path in (source, ours):
        shutil.rmtree(path, ignore_errors=True)
    return row


def measure_conversion(args: argparse.Namespace, root: pathlib.Path) -> dict[str, Any]:
    """The ``megatron_conversion`` section: per format, seconds and GB/s of making the
    Megatron-LM checkpoint, converting it to ours and converting ours back (TP 2 x PP 2)."""
    config = conversion_model(args.conversion_hidden_size, args.conversion_layers)
    dtype = DTYPES[args.conversion_dtype]
    state = random_state(config, dtype)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    directory = root / "conversion"
    rounds = [_round(state, config, directory, check=i == 0) for i in range(args.rounds)]
    optimizer_rounds = [_optimizer_round(state, config, directory) for _ in range(args.rounds)]
    shutil.rmtree(directory, ignore_errors=True)
    out: dict[str, Any] = {
        "model": {
            "hidden_size": config.hidden_size,
            "num_layers": config.num_layers,
            "vocab_size": config.vocab_size,
            "parameters": config.num_parameters(),
            "dtype": args.conversion_dtype,
        },
        "state_gb": round(nbytes / GB, 3),
        "megatron_layout": f"tp {TP} x pp {PP}",
        "rounds": args.rounds,
        "checked_bitwise": True,
    }
    for ckpt_format in CKPT_FORMATS:
        rows = [r[ckpt_format] for r in rounds]
        figures: dict[str, Any] = {
            "megatron_gb": round(rows[-1]["megatron_gb"], 3),
            "ours_gb": round(rows[-1]["ours_gb"], 3),
        }
        for step in ("make", "to_ours", "from_ours"):
            seconds = statistics.median(r[f"{step}_s"] for r in rows)
            figures[f"{step}_s"] = round(seconds, 2)
            figures[f"{step}_gbps"] = round(nbytes / GB / seconds, 3)
            figures[f"{step}_s_rounds"] = [round(r[f"{step}_s"], 2) for r in rows]
        out[ckpt_format] = figures
    rows = optimizer_rounds
    gb = statistics.median(r["megatron_gb"] for r in rows)
    optimizer: dict[str, Any] = {
        "megatron_gb": round(gb, 3),
        "ours_gb": round(rows[-1]["ours_gb"], 3),
    }
    for step in ("make", "to_ours", "whole_read", "rank_read"):
        seconds = statistics.median(r[f"{step}_s"] for r in rows)
        optimizer[f"{step}_s"] = round(seconds, 2)
        optimizer[f"{step}_s_rounds"] = [round(r[f"{step}_s"], 2) for r in rows]
    optimizer["to_ours_gbps"] = round(gb / optimizer["to_ours_s"], 3)
    optimizer["rank_read_gb"] = round(rows[-1]["rank_read_gb"], 3)
    out["torch_dist_optimizer"] = optimizer
    return out
