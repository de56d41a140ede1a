"""Measure the local accelerator for the performance predictor and write DIR/<accelerator>.json.

    python tools/profile_device.py --model small --seq-lengths 128,256 \\
        --micro-batch-sizes 1,2,4 --tp 1,2 --dtype fp32 --out profiles/ --comm

Then ``tools/plan.py --profile-dir profiles/`` predicts with the measured figures. See
:mod:`megatron_het.perf.measure.profiler` for what is measured and how. The closing table (and, with
``--json``, a JSON line) sets every layer entry's measured times next to the cost model's
roofline times for the kind's datasheet figures, with their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_het.arguments.model_flags import add_model_shape_args, model_config_from_args
from megatron_het.arguments.parser import ArgParser
from megatron_het.cluster.accelerators import AcceleratorRegistry
from megatron_het.config import ModelConfig
from megatron_het.emulation.host_measure import measure_host_collective, measure_host_sharing
from megatron_het.errors import UserError, run_cli
from megatron_het.launcher.host_memory import prefer_huge_pages
from megatron_het.model.llama import LlamaModel
from megatron_het.parallel.plan_validation import valid_tp_sizes
from megatron_het.perf.cost.calibration import layer_efficiency, resolve_efficiency
from megatron_het.perf.cost.roofline import LayerShape, layer_forward_ops, ops_time
from megatron_het.perf.measure.device_kind import default_accelerator
from megatron_het.perf.measure.profile_format import Profile, merge_profiles
from megatron_het.perf.measure.profiler import Sweep, profile_device, shapes_compiled
from megatron_het.perf.measure.shard_cases import PROFILE_DTYPES, layer_case
from megatron_het.perf.measure.timed_cases import KernelRow, kernel_breakdown

PROG = "tools/profile_device.py"
DESCRIPTION = """\
Measure per-layer forward/backward time and activation memory, the embedding and the head, the
optimizer step per parameter and (--comm) the communicator's p2p and all-reduce figures on this
machine's accelerator, for one TP rank's shard of every --tp size (TP communication is left
out; the predictor adds it). Writes OUT/<accelerator>.json, merged into an existing file of that
kind (entries of the same shape are replaced).

CPU-emulated kinds (emu-fast, emu-slow, ...) are not profiled themselves: profile the host as
"cpu" and the predictor multiplies the host's times by each emulated kind's slowdown.

The closing table compares each layer entry with the roofline of the kind's figures in the
accelerator table (measured / roofline: how far from the datasheet the layer runs; none for a
kind the table does not know)."""


def int_list(text: str) -> tuple[int, ...]:
    """ "128,256" -> (128, 256); anything else is a one-line error."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers (e.g. 1,2,4)"
        ) from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = ArgParser(
        prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_shape_args(p)
    p.add_argument("--seq-lengths", type=int_list, default=(128, 256), metavar="S,S")
    p.add_argument("--micro-batch-sizes", type=int_list, default=(1, 2, 4), metavar="B,B")
    p.add_argument(
        "--tp",
        type=int_list,
        default=(1, 2),
        metavar="T,T",
        help="tensor-parallel sizes; one rank's shard of each is measured",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(PROFILE_DTYPES),
        default="fp32",
        help="bf16: bf16 weights and activations without autocast, as training runs it",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="measure the decoder layer compiled with torch.compile, as training's "
        "--compile runs it (entries marked compiled; the predictor prices "
        "--compile runs from them and eager runs from eager entries)",
    )
    p.add_argument(
        "--accelerator",
        metavar="NAME",
        help='the kind the profile is for (default: "cpu" on a CPU; on a GPU the '
        "registry kind of its name, else the name itself)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where to measure (auto: the GPU when there is one)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="writes DIR/<accelerator>.json")
    p.add_argument("--warmup", type=int, default=2, help="untimed passes (default 2)")
    p.add_argument("--iters", type=int, default=5, help="timed passes; the median counts")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's)")
    p.add_argument(
        "--comm",
        action="store_true",
        help="also measure the communicator between 2 local gloo ranks (CPU runs "
        "only; recorded as the intra_node link of the kind)",
    )
    p.add_argument(
        "--host-sharing",
        type=int,
        default=0,
        metavar="N",
        help="also measure how a pass slows with 1..N single-threaded processes "
        "computing at once on this host, and one TP collective's wall and CPU "
        "time between two computing processes (CPU runs only; for "
        "CPU-emulated clusters, where ranks share the host)",
    )
    p.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="also print the N kernels taking the most device time in one forward "
        "+ backward pass of each layer case (torch.profiler), and how much of "
        "the pass the device sat idle (an upper bound: the profiler's own "
        "overhead widens the gaps between launches)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--json",
        action="store_true",
        help="print a JSON summary line last (conditions, measured and roofline "
        "times of every layer entry)",
    )
    return p


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError("--device cuda but torch sees no GPU; use --device cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_accelerator(name: str, device: torch.device) -> None:
    """Emulated kinds and kinds of another device type are refused (custom names pass)."""
    registry = AcceleratorRegistry.builtin()
    if name not in registry:
        return
    spec = registry.get(name)
    if spec.emulated:
        raise UserError(
            f"{name} is a CPU-emulated kind; profile the host with --accelerator "
            "cpu, the predictor scales its times by the kind's slowdown"
        )
    if spec.device_type != device.type:
        raise UserError(
            f"--accelerator {name} is a {spec.device_type} kind but this run "
            f"measures the {device.type}; run it on that device or name the kind "
            "you measure"
        )


def roofline_rows(
    profile: Profile, registry: AcceleratorRegistry | None = None
) -> list[dict[str, Any]]:
    """The profile's layer entries (sorted by shape), each with its cost-model roofline times
    (:func:`~megatron_het.perf.cost.roofline.ops_time` of the layer's kernels on the profile's
    kind, with the kind's efficiency factors, calibrated where it has them, for the entry's
    mode, eager or compiled: the predictor's estimate of such a run without a profile,
    :func:`~megatron_het.perf.cost.calibration.layer_efficiency`) and measured / roofline ratios;
    None for a kind ``registry`` does not know."""
    registry = registry or AcceleratorRegistry.builtin()
    spec = registry.get(profile.accelerator) if profile.accelerator in registry else None
    rows = []
    for e in sorted(
        profile.layers, key=lambda e: (e.hidden, e.dtype, e.compiled, e.tp, e.micro_batch, e.seq)
    ):
        row: dict[str, Any] = {
            **dataclasses.asdict(e),
            "roofline_forward_s": None,
            "roofline_backward_s": None,
            "forward_ratio": None,
            "backward_ratio": None,
        }
        if spec is not None:
            efficiency = resolve_efficiency(spec, layer_efficiency(spec, e.dtype, e.compiled))
            forward, backward = ops_time(layer_forward_ops(e.shape()), spec, e.dtype, efficiency)
            row.update(
                roofline_forward_s=forward,
                roofline_backward_s=backward,
                forward_ratio=e.forward_s / forward,
                backward_ratio=e.backward_s / backward,
            )
        rows.append(row)
    return rows


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"x{value:.2f}"


def layer_table(rows: list[dict[str, Any]]) -> str:
    """:func:`roofline_rows` as text: times in ms, measured / roofline, activations in MiB."""
    lines = [
        "hidden  dtype     mode  tp   mb   seq    fwd ms  roof ms    ratio    bwd ms  roof ms"
        "    ratio   act MiB"
    ]
    for r in rows:
        mode = "compiled" if r["compiled"] else "eager"
        lines.append(
            f"{r['hidden']:>6} {r['dtype']:>6} {mode:>8} {r['tp']:>3} "
            f"{r['micro_batch']:>4} {r['seq']:>5} {_ms(r['forward_s']):>9} "
            f"{_ms(r['roofline_forward_s']):>8} "
            f"{_ratio(r['forward_ratio']):>8} {_ms(r['backward_s']):>9} "
            f"{_ms(r['roofline_backward_s']):>8} {_ratio(r['backward_ratio']):>8} "
            f"{r['activation_bytes'] / 2**20:>9.2f}"
        )
    return "\n".join(lines)


def with_host_figures(profile: Profile, model: ModelConfig, args: argparse.Namespace) -> Profile:
    """``profile`` with the host-sharing figures (1..--host-sharing processes, one TP=1 layer
    at the sweep's first sequence length and micro-batch size, against the profile's own time
    of that layer) and, when model's heads split in two, one TP=2 collective's (wall, CPU)."""
    seq, micro_batch = args.seq_lengths[0], args.micro_batch_sizes[0]
    entry = profile.layer(LayerShape.of(model, seq, micro_batch, 1), args.dtype)
    reference = None if entry is None else entry.forward_s + entry.backward_s
    print(
        f"host sharing: 1..{args.host_sharing} processes, seq {seq}, micro-batch {micro_batch}",
        flush=True,
    )
    sharing = measure_host_sharing(
        model,
        seq,
        micro_batch,
        tp=1,
        max_processes=args.host_sharing,
        passes=max(2, args.iters),
        warmup=args.warmup,
        reference_s=reference,
    )
    print(
        "host sharing: " + ", ".join(f"{n + 1}: x{v:.2f}" for n, v in enumerate(sharing)),
        flush=True,
    )
    collective = profile.host_collective_s
    if 2 in valid_tp_sizes(model):
        collective = measure_host_collective(model, seq, micro_batch, passes=max(2, args.iters))
        print(
            f"host TP collective: wall {collective[0] * 1e3:.3f} ms, CPU "
            f"{collective[1] * 1e3:.3f} ms",
            flush=True,
        )
    return dataclasses.replace(profile, host_sharing=sharing, host_collective_s=collective)


def kernel_table(rows: Sequence[KernelRow], pass_s: float, top: int) -> str:
    """The ``top`` rows of a :func:`kernel_breakdown` with their share of the pass, then the
    rest summed and the idle time."""
    busy = sum(row.seconds for row in rows)
    lines = [f"{'ms/pass':>8}  {'share':>6}  {'calls':>6}  kernel"]
    for row in rows[:top]:
        lines.append(
            f"{row.seconds * 1e3:8.3f}  {row.seconds / pass_s:6.1%}  {row.calls:6.1f}  "
            f"{row.name[:110]}"
        )
    rest = sum(row.seconds for row in rows[top:])
    lines.append(
        f"{rest * 1e3:8.3f}  {rest / pass_s:6.1%}  {'':6}  ({max(0, len(rows) - top)} "
        "other kernels)"
    )
    idle = max(0.0, pass_s - busy)
    lines.append(
        f"{idle * 1e3:8.3f}  {idle / pass_s:6.1%}"
        f"  {'':6}  (device idle: pass {pass_s * 1e3:.3f} ms, kernels "
        f"{busy * 1e3:.3f} ms)"
    )
    return "\n".join(lines)


def print_kernel_breakdowns(
    layer_stages: dict[int, LlamaModel], sweep: Sweep, device: torch.device, top: int
) -> None:
    """:func:`kernel_breakdown` of the first layer at every (seq, micro-batch, tp) of the
    sweep, as :func:`kernel_table`; ``layer_stages`` are the sweep's one-layer stages by TP
    size (filled by :func:`profile_device`, compiled under ``--compile``)."""
    for tp, stage in layer_stages.items():
        for seq in sweep.seq_lengths:
            for micro_batch in sweep.micro_batch_sizes:
                case = layer_case(stage, seq, micro_batch, tp, sweep.dtype, device, sweep.compile)
                with shapes_compiled(sweep):
                    rows, pass_s = kernel_breakdown(case, device)
                mode = "compiled" if sweep.compile else "eager"
                print(
                    f"\nkernels of one layer forward + backward: tp={tp} mb={micro_batch} "
                    f"seq={seq} {sweep.dtype} {mode}",
                    flush=True,
                )
                if not rows:
                    print(
                        f"torch.profiler recorded no kernel on {device.type} (only CUDA and "
                        "ROCm kernels and CPU operators are read)",
                        flush=True,
                    )
                    continue
                print(kernel_table(rows, pass_s, top), flush=True)


def main(argv: Sequence[str]) -> Path:
    args = build_parser().parse_args(list(argv))
    for flag, value, low in (
        ("--warmup", args.warmup, 0),
        ("--iters", args.iters, 1),
        ("--kernels", args.kernels, 0),
        ("--threads", args.threads or 1, 1),
    ):
        if value < low:
            raise UserError(f"{flag} must be at least {low}, got {value}")
    # Without a preset the model gets as many positions as the longest sequence swept.
    model = model_config_from_args(args, seq_length=max(args.seq_lengths))
    sweep = Sweep(
        args.seq_lengths,
        args.micro_batch_sizes,
        args.tp,
        args.dtype,
        args.warmup,
        args.iters,
        args.seed,
        args.compile,
    )
    sweep.check_model(model)
    if args.host_sharing < 0:
        raise UserError(f"--host-sharing must be at least 0, got {args.host_sharing}")
    device = pick_device(args.device)
    if args.host_sharing and device.type != "cpu":
        raise UserError(
            "--host-sharing measures processes sharing this host's CPUs, which "
            "describes the cpu kind only; run it with --device cpu"
        )
    if args.comm and device.type != "cpu":
        raise UserError(
            "--comm measures gloo between two CPU ranks, which describes the cpu "
            "kind only; run it with --device cpu --accelerator cpu"
        )
    accelerator = args.accelerator or default_accelerator(device)
    check_accelerator(accelerator, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pass a directory")
    path = out / f"{accelerator}.json"
    old = Profile.load(path) if path.exists() else None
    print(
        f"profiling {model.name} on {device} as {accelerator!r}, {args.dtype}, "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    start = time.perf_counter()
    layer_stages: dict[int, LlamaModel] = {}
    profile = profile_device(
        model,
        sweep,
        accelerator,
        device,
        args.comm,
        progress=lambda line: print(line, flush=True),
        layer_stages=layer_stages,
    )
    if args.host_sharing:
        profile = with_host_figures(profile, model, args)
    if old is not None:
        profile = merge_profiles(old, profile)
    out.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    rows = roofline_rows(profile)
    print(layer_table(rows))
    print(f"wrote {path} in {time.perf_counter() - start:.1f} s")
    if args.kernels > 0:
        print_kernel_breakdowns(layer_stages, sweep, device, args.kernels)
    if args.json:
        print(
            json.dumps(
                {
                    "profile": str(path),
                    "accelerator": accelerator,
                    "device": str(device),
                    "conditions": dataclasses.asdict(profile.conditions),
                    "layers": rows,
                }
            ),
            flush=True,
        )
    return path


if __name__ == "__main__":
    prefer_huge_pages(os.environ)  # as training runs allocate (before torch does)
    run_cli(lambda: main(sys.argv[1:]))
