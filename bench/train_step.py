"""Training-step throughput: megatron_het's LlamaModel vs transformers' LlamaForCausalLM.

Both models get the same config, weights (ours exported to Hugging Face names), batch, dtype
and thread count. One step is forward, cross-entropy, backward and an AdamW step; ``--loss``
picks each library's own loss path (default) or one shared cross-entropy on both models'
logits. The two are timed alternately over several rounds. The last line printed is one JSON
object with both tokens/s figures (medians), ``ratio_vs_hf`` (ours / theirs, the median of the
per-round ratios, see :func:`measure`) and the conditions.

    .venv/bin/python bench/train_step.py --model small --micro-batch-size 8 --seq-length 256
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_het.checkpoint.hf import (megatron_het_to_hf_state,  # noqa: E402
                                        model_config_to_hf_config)
from megatron_het.config import model_preset  # noqa: E402
from megatron_het.model.llama import build_model  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="a ModelConfig preset name")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=9, help="alternating timing rounds")
    p.add_argument("--iters", type=int, default=2, help="timed steps per model per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    p.add_argument("--hf-attn", default="sdpa", help="transformers attn_implementation")
    p.add_argument("--loss", choices=("native", "logits"), default="native",
                   help="native: each library's own loss path; logits: one shared "
                        "cross-entropy on both models' logits")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def make_step(model: torch.nn.Module,
              loss_of: Callable[[], torch.Tensor]) -> Callable[[], float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step() -> float:
        loss = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def loss_functions(ours: torch.nn.Module, theirs: torch.nn.Module, tokens: torch.Tensor,
                   labels: torch.Tensor, mode: str) -> tuple[Callable[[], torch.Tensor], ...]:
    """(our loss, their loss) closures for one micro-batch.

    "native": each library's own training loss: ours the fused chunked output + cross-entropy
    (``model(tokens, labels)``), theirs ``LlamaForCausalLM(input_ids, labels).loss`` (which
    shifts the labels itself, so it gets the unshifted tokens). "logits": both return logits
    and the same ``F.cross_entropy`` call computes the loss.
    """
    if mode == "native":
        return (lambda: ours(tokens, labels),
                lambda: theirs(input_ids=tokens, labels=tokens, use_cache=False).loss)

    def on_logits(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.view(-1))

    return (lambda: on_logits(ours(tokens)),
            lambda: on_logits(theirs(input_ids=tokens, use_cache=False).logits))


def timed(step: Callable[[], float], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - start) / iters


def build_pair(args: argparse.Namespace) -> tuple[dict[str, Callable[[], float]], str]:
    """Both models with identical weights and one batch; ``({name: step}, model name)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = DTYPES[args.dtype]
    cfg = model_preset(args.model)
    ours = build_model(cfg, seed=args.seed).to(dtype).train()
    hf_config = LlamaConfig.from_dict(model_config_to_hf_config(cfg),
                                      attn_implementation=args.hf_attn)
    theirs = LlamaForCausalLM(hf_config).to(dtype).train()
    theirs.load_state_dict(megatron_het_to_hf_state(ours.state_dict(), cfg),
                           strict=not cfg.tie_embeddings)
    generator = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, cfg.vocab_size, (args.micro_batch_size, args.seq_length + 1),
                         generator=generator)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    ours_loss, hf_loss = loss_functions(ours, theirs, tokens, labels, args.loss)
    return {"ours": make_step(ours, ours_loss), "hf": make_step(theirs, hf_loss)}, cfg.name


def measure(steps: dict[str, Callable[[], float]], args: argparse.Namespace
            ) -> tuple[dict[str, list[float]], list[float]]:
    """Seconds per step per round for each model, and each round's paired ratio hf / ours.

    The two run back to back in every round (order alternating), so a ratio of one round sees
    nearly the same machine load on both sides; the median over rounds resists noise from
    other processes better than a ratio of separate medians.
    """
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    ratios = []
    for round_index in range(args.rounds):
        order = list(steps) if round_index % 2 == 0 else list(reversed(list(steps)))
        for name in order:
            seconds[name].append(timed(steps[name], args.iters))
        ratios.append(seconds["hf"][-1] / seconds["ours"][-1])
    return seconds, ratios


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    steps, model_name = build_pair(args)
    first_loss = {name: step() for name, step in steps.items()}
    seconds, ratios = measure(steps, args)
    tokens_per_step = args.micro_batch_size * args.seq_length
    tps = {name: tokens_per_step / statistics.median(s) for name, s in seconds.items()}
    print(json.dumps({
        "benchmark": "train_step", "model": model_name,
        "params": model_preset(args.model).num_parameters(),
        "micro_batch_size": args.micro_batch_size, "seq_length": args.seq_length,
        "dtype": args.dtype, "threads": torch.get_num_threads(), "rounds": args.rounds,
        "iters_per_round": args.iters, "hf_attn_implementation": args.hf_attn,
        "loss": args.loss, "step": "forward + cross-entropy + backward + AdamW",
        "ours_tokens_per_s": round(tps["ours"], 1), "hf_tokens_per_s": round(tps["hf"], 1),
        "ratio_vs_hf": round(statistics.median(ratios), 3),
        "ratio_of_medians": round(tps["ours"] / tps["hf"], 3),
        "round_ratios": [round(r, 3) for r in ratios],
        "first_step_loss": {k: round(v, 5) for k, v in first_loss.items()},
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
    }))


if __name__ == "__main__":
    main()
