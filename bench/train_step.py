"""Training-step throughput: megatron_het's LlamaModel vs transformers' LlamaForCausalLM.

Both models get the same config, weights (ours exported to Hugging Face names), batch, dtype
and thread count. One step is forward, cross-entropy, backward and an AdamW step; ``--loss``
picks each library's own loss path (default) or one shared cross-entropy on both models'
logits. The two are timed alternately over several rounds. The last line printed is one JSON
object with both tokens/s figures (medians), ``ratio_vs_hf`` (ours / theirs, the median of the
per-round ratios, see :func:`measure`) and the conditions.

``--breakdown`` profiles two more steps of each model (torch.profiler, CPU) and splits a step
into its matrix products, its attention kernels and the rest; ``ratio_bound`` is Hugging Face's
median step over our matrix products and attention alone: the ratio our step would reach if
everything else (norms, RoPE, SwiGLU, the loss, the optimizer, framework overhead) cost nothing.
The two models call the same kernels for both, so no fusion can take ``ratio_vs_hf`` past it.
Each side's ``gemm_tflops`` (its matrix products' flops, from their shapes, over their time)
stands beside ``matmul_peak_tflops``, one large square matrix product of the run's dtype on the
run's device: how far faster matrix products could still move the bound.

``--kernels`` picks which fused kernels our model runs: ``auto`` (default) those the package
picks (our compiled ``csrc/`` kernels where built, :mod:`megatron_het.kernels.selection`),
``reference`` every op's torch reference (``KernelChoice.references()``, as
``--reference-kernels`` trains), ``both`` two copies of our model, one each way, timed
alternately with Hugging Face's: ``reference_tokens_per_s`` and ``ratio_kernels_vs_reference``
(the median of the per-round ratios, reference step over kernels step) join the record, whose
``ours_*`` fields and ``ratio_vs_hf`` stay those of our model with its kernels.

``--device cuda`` runs both on the GPU (CUDA or ROCm): every step ends in its loss's
``.item()``, queued after the optimizer's kernels, so the host clock around the steps times the
device's work, one synchronisation per step on both sides; ``--breakdown`` then reads the
matrix products' and attention's device time.

``--compile`` compiles our decoder layers with :func:`megatron_het.model.compile.compile_layers`
(Hugging Face's model stays eager). Compilation happens in the first step, which is timed on its
own and reported as ``first_step_s`` and ``compile_s`` (first step minus the median step); it
never enters the medians, nor do the ``--warmup`` steps.

    .venv/bin/python -m bench.train_step --model small --micro-batch-size 8 --seq-length 256
    .venv/bin/python -m bench.train_step --model small --micro-batch-size 8 --seq-length 256 \
        --compile --breakdown
    .venv/bin/python -m bench.train_step --kernels both  # compiled kernels against references
    python3 bench/train_step.py --device cuda --dtype bf16 --compile --num-layers 4 \
        --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 \
        --num-query-groups 4 --vocab-size 32000 --micro-batch-size 4 --seq-length 2048  # GPU

The model is a preset (``--model``) and/or the shape flags (Megatron's names), as
``tools/plan.py`` takes them; with neither, the ``small`` preset.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from megatron_het.arguments.model_flags import add_model_shape_args, model_config_from_args
from megatron_het.arguments.parser import shape_overrides
from megatron_het.checkpoint.hf import megatron_het_to_hf_state, model_config_to_hf_config
from megatron_het.errors import UserError
from megatron_het.kernels.selection import KernelChoice
from megatron_het.launcher.host_memory import THP_VARIABLE
from megatron_het.model.compile import compile_layers
from megatron_het.model.llama import build_model, use_kernels
from megatron_het.optim.optimizer import adamw_implementation
from megatron_het.perf.measure.timed_cases import self_time_us
from megatron_het.pipeline.timing import synchronize

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_MODEL = "small"
KERNEL_MODES = ("auto", "reference", "both")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_shape_args(p)  # neither a preset nor a shape flag: the "small" preset
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where both models run (cuda: CUDA or ROCm)",
    )
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=9, help="alternating timing rounds")
    p.add_argument("--iters", type=int, default=2, help="timed steps per model per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    p.add_argument("--hf-attn", default="sdpa", help="transformers attn_implementation")
    p.add_argument(
        "--loss",
        choices=("native", "logits"),
        default="native",
        help="native: each library's own loss path; logits: one shared "
        "cross-entropy on both models' logits",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile our decoder layers (compile_layers); HF stays eager",
    )
    p.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode with --compile (default: inductor's default)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="profile two more steps per model: matrix products, attention, the "
        "rest, and ratio_bound",
    )
    p.add_argument(
        "--kernels",
        choices=KERNEL_MODES,
        default="auto",
        help="auto: our model with the fused kernels it picks; reference: with every op's "
        "torch reference; both: one model each way, timed alternately with HF's",
    )
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.compile_mode is not None and not args.compile:
        p.error("--compile-mode needs --compile")
    for name in ("micro_batch_size", "seq_length", "threads", "rounds", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA/ROCm device here")
    if args.model is None and not shape_overrides(args):
        args.model = DEFAULT_MODEL
    try:
        args.config = model_config_from_args(args, seq_length=args.seq_length)
    except UserError as exc:
        p.error(str(exc))
    return args


def make_step(model: torch.nn.Module, loss_of: Callable[[], torch.Tensor]) -> Callable[[], float]:
    """One training step of ``model``: forward, backward, AdamW, zero the gradients. Both
    models step with the AdamW each library trains with by default: ours picks torch's fused
    kernel where torch has one for the device (:func:`megatron_het.optim.optimizer.
    adamw_implementation`), as transformers' Trainer does on torch >= 2.8
    (``adamw_torch_fused``)."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, weight_decay=0.01, **adamw_implementation(device)
    )

    def step() -> float:
        loss = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def loss_functions(
    ours: torch.nn.Module,
    theirs: torch.nn.Module,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    mode: str,
) -> tuple[Callable[[], torch.Tensor], ...]:
    """(our loss, their loss) closures for one micro-batch.

    "native": each library's own training loss: ours the fused chunked output + cross-entropy
    (``model(tokens, labels)``), theirs ``LlamaForCausalLM(input_ids, labels).loss`` (which
    shifts the labels itself, so it gets the unshifted tokens). "logits": both return logits
    and the same ``F.cross_entropy`` call computes the loss.
    """
    if mode == "native":
        return (
            lambda: ours(tokens, labels),
            lambda: theirs(input_ids=tokens, labels=tokens, use_cache=False).loss,
        )

    def on_logits(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.view(-1))

    return (
        lambda: on_logits(ours(tokens)),
        lambda: on_logits(theirs(input_ids=tokens, use_cache=False).logits),
    )


def timed(step: Callable[[], float], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - start) / iters


def build_ours(args: argparse.Namespace, choice: KernelChoice | None) -> torch.nn.Module:
    """Our model in training mode (weights from ``args.seed``), running the fused kernels
    ``choice`` allows (None: the package's default); with ``args.compile`` its layers are
    compiled (lazily: the first step compiles)."""
    model = build_model(args.config, seed=args.seed, device=torch.device(args.device))
    model = model.to(dtype=DTYPES[args.dtype]).train()
    if choice is not None:
        use_kernels(model, choice)
    if args.compile:
        compile_layers(model, mode=args.compile_mode)
    return model


def build_pair(args: argparse.Namespace) -> dict[str, Callable[[], float]]:
    """The models with identical weights and one batch: ``{"ours": step, "hf": step}``, and
    with ``--kernels both`` ``"reference"``: a second copy of ours on the torch references.
    With ``--kernels reference`` "ours" itself runs the references."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    cfg = args.config
    references = KernelChoice.references()
    ours = build_ours(args, references if args.kernels == "reference" else None)
    hf_config = LlamaConfig.from_dict(
        model_config_to_hf_config(cfg), attn_implementation=args.hf_attn
    )
    with device:  # initialised where it runs
        theirs = LlamaForCausalLM(hf_config)
    rope_buffers = {
        name: buffer.clone() for name, buffer in theirs.named_buffers() if name.endswith("inv_freq")
    }
    theirs = theirs.to(dtype=dtype).train()
    for name, buffer in rope_buffers.items():  # RoPE's frequencies stay fp32, as ours do
        theirs.get_submodule(name.rpartition(".")[0]).register_buffer(
            name.rpartition(".")[2], buffer, persistent=False
        )
    theirs.load_state_dict(
        megatron_het_to_hf_state(ours.state_dict(), cfg), strict=not cfg.tie_embeddings
    )
    generator = torch.Generator().manual_seed(args.seed)
    data = torch.randint(
        0, cfg.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=generator
    )
    data = data.to(device)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    ours_loss, hf_loss = loss_functions(ours, theirs, tokens, labels, args.loss)
    steps = {"ours": make_step(ours, ours_loss), "hf": make_step(theirs, hf_loss)}
    if args.kernels == "both":
        reference = build_ours(args, references)
        reference_loss, _ = loss_functions(reference, theirs, tokens, labels, args.loss)
        steps["reference"] = make_step(reference, reference_loss)
    return steps


def measure(
    steps: dict[str, Callable[[], float]], args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per step per round for each model, and each round's paired ratio
    ``other / ours`` for every other model (keyed by its name: "hf", and "reference").

    The models run back to back in every round (two alternate; more rotate, each taking each
    place in turn), so a ratio of one round sees nearly the same machine load on both sides;
    the median over rounds resists noise from other processes better than a ratio of
    separate medians.
    """
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    names = list(steps)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names if name != "ours"}
    for round_index in range(args.rounds):
        if len(names) == 2:
            order = names if round_index % 2 == 0 else names[::-1]
        else:
            shift = round_index % len(names)
            order = names[shift:] + names[:shift]
        for name in order:
            seconds[name].append(timed(steps[name], args.iters))
        for name, per_round in ratios.items():
            per_round.append(seconds[name][-1] / seconds["ours"][-1])
    return seconds, ratios


def first_steps(steps: dict[str, Callable[[], float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Run each model's first step (where compilation happens): ``(loss, seconds)`` by name."""
    losses, seconds = {}, {}
    for name, step in steps.items():
        start = time.perf_counter()
        losses[name] = step()
        seconds[name] = time.perf_counter() - start
    return losses, seconds


GEMM_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::addmm_",
        "aten::bmm",
        "aten::baddbmm",
        "aten::_addmm_activation",
    }
)
ATTENTION_PREFIXES = (
    "aten::scaled_dot_product",
    "aten::_scaled_dot_product",
    "aten::_flash_attention",
    "aten::_efficient_attention",
)


def kernel_seconds(
    step: Callable[[], float], steps: int = 2, device: str = "cpu"
) -> dict[str, float]:
    """Seconds per step in matrix products and in attention kernels: the self time of those
    aten ops under torch.profiler over ``steps`` steps, on the CPU or, on a GPU, the device
    time of the kernels they launch (compiled graphs call the same aten kernels for both, so
    they are counted too); and the matrix products' rate, ``gemm_tflops``, their flops
    (:func:`gemm_flop_count` of the recorded shapes) over their time."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
    gemm = attention = 0.0
    for event in prof.key_averages():
        own = self_time_us(event, on_gpu)
        if event.key in GEMM_OPS:
            gemm += own
        elif event.key.startswith(ATTENTION_PREFIXES):
            attention += own
    # Flops of the outermost products only: a product may run as others (CPU bf16 baddbmm
    # calls one addmm_ per batch entry), whose own times the self times above already split.
    gemm_flops = sum(
        gemm_flop_count(event.name, event.input_shapes)
        for event in prof.events()
        if event.name in GEMM_OPS
        and not (event.cpu_parent is not None and event.cpu_parent.name in GEMM_OPS)
    )
    return {
        "gemm_s": gemm / 1e6 / steps,
        "attention_s": attention / 1e6 / steps,
        "gemm_tflops": gemm_flops / (gemm * 1e6) if gemm else 0.0,
    }


def gemm_flop_count(op: str, input_shapes: Sequence[Sequence[int]]) -> int:
    """Flops of one call of the matrix-product ``op`` (one of :data:`GEMM_OPS`) on inputs of
    ``input_shapes``: 2 x batch x M x K x N. ``mm``/``bmm`` multiply their first two inputs,
    the ``addmm`` family its second and third (after the tensor it adds to or into; the
    profiler's own flop count leaves out the in-place ``addmm_``)."""
    first = 0 if op in ("aten::mm", "aten::bmm") else 1
    a, b = input_shapes[first], input_shapes[first + 1]
    batch = a[0] if len(a) == 3 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


def matmul_peak_tflops(device: str, dtype: torch.dtype, repeats: int = 10) -> float:
    """The rate of one large square matrix product (n = 8192 on a GPU; on the CPU 2048, or 512
    in the 16-bit types, which CPUs without their instructions run at a few GFLOP/s) in
    ``dtype`` on ``device``: the fastest of ``repeats`` timed products after two untimed (a
    peak, so the least disturbed one)."""
    n = 8192 if device != "cpu" else 2048 if dtype == torch.float32 else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for index in range(repeats + 2):
        synchronize(a.device)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(a.device)
        if index >= 2:
            times.append(time.perf_counter() - start)
    return 2 * n**3 / min(times) / 1e12


def breakdown(
    steps: dict[str, Callable[[], float]], median_s: dict[str, float], device: str = "cpu"
) -> dict[str, Any]:
    """Each model's median step split into matrix products (with their rate), attention and
    the rest, and ``ratio_bound``: Hugging Face's median step over our matrix products and
    attention."""
    parts = {}
    for name, step in steps.items():
        kernels = kernel_seconds(step, device=device)
        rest = median_s[name] - kernels["gemm_s"] - kernels["attention_s"]
        parts[name] = {
            key: round(value, 5)
            for key, value in {**kernels, "rest_s": rest, "step_s": median_s[name]}.items()
        }
    ours_kernels = parts["ours"]["gemm_s"] + parts["ours"]["attention_s"]
    return {"breakdown": parts, "ratio_bound": round(median_s["hf"] / ours_kernels, 3)}


def report(
    args: argparse.Namespace,
    seconds: dict[str, list[float]],
    ratios: list[float],
    first_loss: dict[str, float],
    first_seconds: dict[str, float],
    reference_ratios: list[float] | None = None,
) -> dict[str, Any]:
    """The JSON record: figures (medians over rounds; first step and warm-up excluded) and the
    conditions they were measured under. ``ratios`` are the per-round hf / ours ratios,
    ``reference_ratios`` (``--kernels both``) the per-round reference / ours ones."""
    cfg = args.config
    tokens_per_step = args.micro_batch_size * args.seq_length
    median_s = {name: statistics.median(s) for name, s in seconds.items()}
    tps = {name: tokens_per_step / s for name, s in median_s.items()}
    compile_s = round(first_seconds["ours"] - median_s["ours"], 3) if args.compile else None
    return {
        "benchmark": "train_step",
        "model": cfg.name,
        "params": cfg.num_parameters(),
        "config": cfg.to_dict(),
        "micro_batch_size": args.micro_batch_size,
        "seq_length": args.seq_length,
        "dtype": args.dtype,
        "device": args.device,
        "device_name": (torch.cuda.get_device_name() if args.device == "cuda" else None),
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "iters_per_round": args.iters,
        "warmup_steps": args.warmup,
        "hf_attn_implementation": args.hf_attn,
        "loss": args.loss,
        "compile": args.compile,
        "compile_mode": args.compile_mode,
        "step": "forward + cross-entropy + backward + AdamW",
        "ours_tokens_per_s": round(tps["ours"], 1),
        "hf_tokens_per_s": round(tps["hf"], 1),
        "ratio_vs_hf": round(statistics.median(ratios), 3),
        "ratio_of_medians": round(tps["ours"] / tps["hf"], 3),
        "kernels": args.kernels,
        "reference_tokens_per_s": (round(tps["reference"], 1) if "reference" in tps else None),
        "ratio_kernels_vs_reference": (
            round(statistics.median(reference_ratios), 3) if reference_ratios else None
        ),
        "reference_round_ratios": [round(r, 3) for r in reference_ratios or []],
        "round_ratios": [round(r, 3) for r in ratios],
        "median_step_s": {k: round(v, 5) for k, v in median_s.items()},
        "first_step_s": {k: round(v, 3) for k, v in first_seconds.items()},
        "compile_s": compile_s,
        "first_step_loss": {k: round(v, 5) for k, v in first_loss.items()},
        "torch": torch.__version__,
        "transformers": _transformers_version(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "thp_mem_alloc_enable": os.environ.get(THP_VARIABLE, ""),
    }


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # Measured first, before either model runs, so that nothing of theirs shares the device.
    peak = matmul_peak_tflops(args.device, DTYPES[args.dtype]) if args.breakdown else None
    steps = build_pair(args)
    first_loss, first_seconds = first_steps(steps)
    seconds, ratios = measure(steps, args)
    record = report(args, seconds, ratios["hf"], first_loss, first_seconds, ratios.get("reference"))
    if args.breakdown:
        record.update(
            breakdown(
                steps, {name: statistics.median(s) for name, s in seconds.items()}, args.device
            )
        )
    if peak is not None:
        record["matmul_peak_tflops"] = round(peak, 5)
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    from megatron_het.errors import run_cli
    from megatron_het.launcher.host_memory import prefer_huge_pages

    prefer_huge_pages(os.environ)  # as training runs allocate (before torch does)
    run_cli(main)
