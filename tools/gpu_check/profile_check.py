"""``tools/profile_device.py`` on CUDA for the MFU model's shape (bf16), eager and then
compiled (``--compile``, micro-batch 4 only: each shape compiles anew), each measured layer
against its roofline.

The peak roofline of a layer entry is :func:`megatron_het.perf.cost.roofline.ops_time` of its
kernels at 100% of the kind's datasheet peak and bandwidth (causal attention counted at half its
S x S work, as the cost model does); a row shows roofline time / measured time ("40% of
roofline"). The cost model's estimate is the same with the kind's efficiency factors for the
entry's mode (the calibrated ones where the kind has them, with the eager elementwise traffic
for an eager entry: :func:`~megatron_het.perf.cost.calibration.layer_efficiency`, what the
predictor uses for such a run without a profile, and the roofline column the tool prints);
measured / estimate ("x1.30 est.") says how far the predictor is off. The rows are a record
(PASS when the tool ran and wrote entries); the tool's printed layer table is kept in the
details.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch

from megatron_het.cluster.accelerators import AcceleratorRegistry, AcceleratorSpec
from megatron_het.errors import UserError
from megatron_het.perf.cost.calibration import layer_efficiency, resolve_efficiency
from megatron_het.perf.cost.compute_time import mode_ratio
from megatron_het.perf.cost.roofline import Efficiency, layer_forward_ops, ops_time
from megatron_het.perf.measure.profile_format import LayerEntry, Profile
from tools.gpu_check.context import REPO, CheckContext
from tools.gpu_check.device_checks import skip_all
from tools.gpu_check.report import FAIL, PASS

RUN_S = 20.0  # the eager sweep (the whole check took 15 s on one H200)
# The compiled sweep: start-up, one layer compiled forward and backward, the timed passes.
# After the MFU check's compiled run of the same layer, inductor's and Triton's caches are
# warm; cold (``--only profile``), the compile alone takes some 20-25 s on one H200.
COMPILED_RUN_S = 45.0
PEAK = Efficiency(gemm=1.0, attention=1.0, memory=1.0)
SHAPE_FLAGS = [
    "--num-layers",
    "22",
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
]


def sweep_flags(micro_batch_sizes: str) -> list[str]:
    """tools/profile_device.py's sweep at seq 2048, TP 1, bf16 over ``micro_batch_sizes``."""
    return [
        "--seq-lengths",
        "2048",
        "--micro-batch-sizes",
        micro_batch_sizes,
        "--tp",
        "1",
        "--dtype",
        "bf16",
        "--warmup",
        "2",
        "--iters",
        "5",
    ]


SWEEP_FLAGS = sweep_flags("1,4")
COMPILED_FLAGS = [*sweep_flags("4"), "--compile"]


def check_profile(ctx: CheckContext) -> None:
    """Rows ``profile.run``, ``profile.run.compiled`` and one
    ``profile.layer.s<seq>-b<mb>-tp<tp>[.compiled]`` per layer entry."""
    if not torch.cuda.is_available():
        skip_all(ctx, ("profile.run", "profile.run.compiled"))
        return
    out = ctx.work / "profiles"
    tool = [
        ctx.python,
        str(REPO / "tools" / "profile_device.py"),
        *SHAPE_FLAGS,
        "--device",
        "cuda",
        "--out",
        str(out),
    ]
    run = ctx.run([*tool, *SWEEP_FLAGS], RUN_S, "profile.log")
    files = sorted(out.glob("*.json"))
    if not run.ok or not files:
        ctx.rows.add(
            "profile.run",
            FAIL,
            f"profile_device.py {run.why()}",
            "writes a profile",
            log_tail=run.tail(),
        )
        return
    profile = Profile.load(files[0])
    ctx.rows.add(
        "profile.run",
        PASS,
        f"{files[0].name}: {len(profile.layers)} layer entries",
        "writes a profile",
        printed_table=_printed_table(run.log_path),
    )
    compiled = ctx.run([*tool, *COMPILED_FLAGS], COMPILED_RUN_S, "profile_compiled.log")
    if compiled.ok:
        profile = Profile.load(files[0])  # the compiled entries merged beside the eager ones
        count = sum(e.compiled for e in profile.layers)
        ctx.rows.add(
            "profile.run.compiled",
            PASS if count else FAIL,
            f"{count} compiled layer entries",
            "writes compiled entries",
            printed_table=_printed_table(compiled.log_path),
        )
    else:
        ctx.rows.add(
            "profile.run.compiled",
            FAIL,
            f"profile_device.py --compile {compiled.why()}",
            "writes compiled entries",
            log_tail=compiled.tail(),
        )
    try:
        spec = AcceleratorRegistry.builtin().get(profile.accelerator)
    except UserError as exc:
        ctx.rows.add("profile.roofline", FAIL, str(exc), "a kind of the accelerator table")
        return
    for entry in profile.layers:
        name, value, details = roofline_row(entry, spec)
        ctx.rows.add(name, PASS, value, "recorded", **details)
    for eager, compiled in mode_pairs(profile):
        name, value, details = mode_ratio_row(eager, compiled, spec)
        ctx.rows.add(name, PASS, value, "recorded", **details)


def mode_pairs(profile: Profile) -> list[tuple[LayerEntry, LayerEntry]]:
    """(eager, compiled) entries of one shape and dtype."""

    def key(e: LayerEntry) -> tuple:
        return (e.hidden, e.ffn, e.heads, e.kv_groups, e.seq, e.micro_batch, e.tp, e.dtype)

    compiled = {key(e): e for e in profile.layers if e.compiled}
    return [(e, compiled[key(e)]) for e in profile.layers if not e.compiled and key(e) in compiled]


def mode_ratio_row(
    eager: LayerEntry, compiled: LayerEntry, spec: AcceleratorSpec
) -> tuple[str, str, dict[str, Any]]:
    """(row name, table text, details): compiled / eager time of one layer shape, measured,
    beside the roofline's ratio of the modes (what the predictor scales a profile's entries
    of one mode by where the other mode has none)."""
    measured = (compiled.forward_s / eager.forward_s, compiled.backward_s / eager.backward_s)
    model = mode_ratio(eager.shape(), spec, eager.dtype, True) or (1.0, 1.0)
    name = f"profile.mode-ratio.s{eager.seq}-b{eager.micro_batch}-tp{eager.tp}"
    value = "; ".join(
        f"{part} compiled/eager x{m:.2f} (roofline x{r:.2f})"
        for part, m, r in zip(("fwd", "bwd"), measured, model)
    )
    return name, value, {"measured": measured, "roofline": model}


def roofline_row(entry: LayerEntry, spec: AcceleratorSpec) -> tuple[str, str, dict[str, Any]]:
    """(row name, table text, details) of one measured layer against its roofline on
    ``spec`` at full peak, with the predictor's estimate beside it."""
    ops = layer_forward_ops(entry.shape())
    roof_f, roof_b = ops_time(ops, spec, entry.dtype, PEAK)
    estimate = resolve_efficiency(spec, layer_efficiency(spec, entry.dtype, entry.compiled))
    model_f, model_b = ops_time(ops, spec, entry.dtype, estimate)
    name = (
        f"profile.layer.s{entry.seq}-b{entry.micro_batch}-tp{entry.tp}"
        f"{'.compiled' if entry.compiled else ''}"
    )
    value = "; ".join(
        f"{part} {measured * 1e3:.3g} ms ({roof / measured:.0%} of roofline {roof * 1e3:.3g}, "
        f"x{measured / model:.2f} est.)"
        for part, measured, roof, model in (
            ("fwd", entry.forward_s, roof_f, model_f),
            ("bwd", entry.backward_s, roof_b, model_b),
        )
    )
    details = {
        "forward_s": entry.forward_s,
        "backward_s": entry.backward_s,
        "roofline_forward_s": roof_f,
        "roofline_backward_s": roof_b,
        "predicted_forward_s": model_f,
        "predicted_backward_s": model_b,
        "activation_bytes": entry.activation_bytes,
        "dtype": entry.dtype,
        "compiled": entry.compiled,
    }
    return name, value, details


def _printed_table(log: pathlib.Path) -> str:
    """The layer table profile_device.py printed (from its header line to 'wrote ...')."""
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("hidden")), None)
    if start is None:
        return ""
    table = []
    for line in lines[start:]:
        if line.startswith("wrote "):
            break
        table.append(line)
    return "\n".join(table)
