"""``bench/train_step.py`` on the GPU: our training step, decoder layers compiled, against
transformers' ``LlamaForCausalLM`` (eager, SDPA attention) on the same weights and batch.

The shape has TinyLlama's widths (the MFU model's) with 4 layers and a tied 32000-token
embedding, bf16 weights, seq 2048, micro-batch 4, each library's own loss; one step is forward,
loss, backward and AdamW. The row gives ``ratio_vs_hf`` (the median of the per-round ratios
of step times, HF / ours) with both tokens/s figures and the compile time; it fails below 1.0
(our compiled step slower than Hugging Face's eager one). The whole JSON record is in the row's
details.
"""

from __future__ import annotations

import json

import torch

from tools.gpu_check.context import CheckContext
from tools.gpu_check.device_checks import skip_all
from tools.gpu_check.report import FAIL, PASS

RUN_S = 50.0  # transformers' import, both models, one layer compiled cold, 5 rounds
RATIO_MIN = 1.0
BENCH_FLAGS = [
    "--num-layers",
    "4",
    "--hidden-size",
    "2048",
    "--ffn-hidden-size",
    "5632",
    "--num-attention-heads",
    "16",
    "--num-query-groups",
    "4",
    "--vocab-size",
    "32000",
    "--micro-batch-size",
    "4",
    "--seq-length",
    "2048",
    "--dtype",
    "bf16",
    "--device",
    "cuda",
    "--compile",
    "--rounds",
    "5",
    "--iters",
    "2",
    "--warmup",
    "1",
]


def check_bench(ctx: CheckContext) -> None:
    """Row ``bench.train_step``."""
    if not torch.cuda.is_available():
        skip_all(ctx, ("bench.train_step",))
        return
    threshold = f">= {RATIO_MIN:g} (HF step / ours)"
    run = ctx.run(
        [ctx.python, "-m", "bench.train_step", *BENCH_FLAGS],
        RUN_S,
        "bench_train_step.log",
    )
    record = last_json_line(
        run.log_path.read_text(encoding="utf-8", errors="replace") if run.log_path.exists() else ""
    )
    if not run.ok or record is None:
        ctx.rows.add(
            "bench.train_step",
            FAIL,
            f"bench/train_step.py {run.why()}"
            if not run.ok
            else "bench/train_step.py printed no JSON record",
            threshold,
            log_tail=run.tail(),
        )
        return
    ctx.rows.add(
        "bench.train_step",
        PASS if record["ratio_vs_hf"] >= RATIO_MIN else FAIL,
        bench_value(record),
        threshold,
        record=record,
    )


def bench_value(record: dict) -> str:
    """The table text of a train_step record."""
    compiled = f", compile {record['compile_s']:.0f} s" if record.get("compile_s") else ""
    return (
        f"ratio_vs_hf {record['ratio_vs_hf']:.2f}: ours {record['ours_tokens_per_s']:,.0f} "
        f"tokens/s, HF {record['hf_tokens_per_s']:,.0f} ({record['dtype']}, "
        f"{record['config']['num_layers']} layers, mb {record['micro_batch_size']} x "
        f"seq {record['seq_length']}{compiled})"
    )


def last_json_line(text: str) -> dict | None:
    """The last line of ``text`` that parses as a JSON object, else None."""
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


__all__ = ["BENCH_FLAGS", "check_bench", "bench_value", "last_json_line"]
