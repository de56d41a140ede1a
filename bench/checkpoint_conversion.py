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
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import time
from typing import Any

import torch

from megatron_het.checkpoint.megatron_lm import write_megatron_checkpoint
from megatron_het.checkpoint.megatron_lm_dist import write_dist_checkpoint
from megatron_het.checkpoint.reader import load_model_state
from megatron_het.checkpoint.reshard import rank_writes
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


def random_state(config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every parameter of ``config`` at its global shape, random, in ``dtype``."""
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


def measure_conversion(args: argparse.Namespace, root: pathlib.Path) -> dict[str, Any]:
    """The ``megatron_conversion`` section: per format, seconds and GB/s of making the
    Megatron-LM checkpoint, converting it to ours and converting ours back (TP 2 x PP 2)."""
    config = conversion_model(args.conversion_hidden_size, args.conversion_layers)
    dtype = DTYPES[args.conversion_dtype]
    state = random_state(config, dtype)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    directory = root / "conversion"
    rounds = [_round(state, config, directory, check=i == 0) for i in range(args.rounds)]
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
    return out
