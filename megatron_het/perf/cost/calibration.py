"""Calibrated kernel efficiencies per accelerator kind, and the fit that produces them.

The roofline cost model (:mod:`megatron_het.perf.cost.roofline`) turns FLOPs and bytes into time
with three fractions of the datasheet figures (:class:`~megatron_het.perf.cost.roofline.Efficiency`,
which also names the attention kernel of the software being predicted: ours is ``"flash"``, the
default). Its defaults (0.6 GEMM, 0.4 attention, 0.8 memory) are one guess for every kind. This
module holds figures fitted to, or taken from, published measurements, and
:func:`efficiency_for` picks a spec's. Kinds without a calibration, every emulated kind and
``cpu`` keep the defaults exactly (the emulated cluster's tests and runs are timed against
them).

A100 (both memory sizes: the same GA100 silicon and clocks) -- GEMM fitted, attention published
    GEMM: fitted on the calibration set of :mod:`bench.published_runs`: Narayanan
    et al. 2021 (arXiv 2104.04473) Table 1, ten GPT runs of 1.7B to 1T parameters on 32 to
    3,072 A100-80GB, each predicted with the attention that software ran
    (``attention_kernel="unfused"``, :func:`~megatron_het.perf.cost.roofline.attention_ops`:
    two cuBLAS batched GEMMs over the whole ``s x s`` scores, priced at the GEMM factor, and
    the fused softmax, the dropout and their backward passes over the materialised scores,
    priced at the memory factor). A run's predicted time is then ``c + G / gemm`` (``c``:
    memory-bound ops, communication, the optimizer), linear in ``1 / gemm`` while no op changes
    sides of its roofline. :func:`~bench.published_runs.fit_efficiency` measures
    ``G`` per run from two closed-form predictions (the current factor and that factor raised
    by 5%, :func:`sensitivity`), :func:`least_squares` minimises the sum of squared relative
    errors ``(T_i - P_i) / P_i`` against the published times ``P_i`` (each derived from the
    paper's TFLOP/s with the paper's own FLOP count), and the fit is redone from its result
    until it settles (the score GEMMs, ``k = d = 96..160``, sit near A100's ridge, so the
    linear form is taken where the fit lands). Result: 0.627. Redo it with
    ``bench.published_runs.fit_efficiency()``; ``tests/unit/test_calibration.py`` checks the stored
    figure against a refit.

    Memory: not fitted; the default 0.8 (about what streaming kernels reach of A100's HBM). The
    table does separate it, but barely: fitting ``("gemm", "memory")`` gives gemm 0.656 and
    memory 0.659 (two standard errors: about 0.57 to 0.77; the two estimates correlate at
    about -0.8), and lowers the calibration median error from 3.0% to 2.4% (F about 5.9 on 1
    and 8 degrees of freedom, p about 0.04). A memory factor fitted to these runs would also
    absorb the memory-bound work of GPT that the Llama cost model lacks (bias adds, GELU, the
    hidden dropouts' bias-dropout-add): a property of that model, not of A100's HBM, and
    wrong for our runtime.

    Attention: the runs above say nothing of a flash kernel (their software had none), so the
    figure that prices our flash attention on A100 comes from FlashAttention-2's published
    speed (Dao 2023, arXiv 2307.08691, Figure 4(d), A100 80GB SXM4, forward + backward, causal,
    head dimension 128): 155 TFLOP/s at sequence 2k and 173 at 4k. That paper counts FLOPs as
    ``op_time`` does (the causal half of ``4 s^2 d`` per head; backward 2.5x the forward), so
    one factor ``e`` gives forward + backward ``3.5 F / (peak e)`` and ``e`` is the speed over
    the peak: the mean of the two, 164 of 312 TFLOP/s, is 0.526. A measured profile
    (``tools/profile_device.py``) replaces these figures where it exists.

H100 (and H200, the same GH100 compute) -- GEMM fitted, attention published
    GEMM: fitted as A100's is, on the rows of the Megatron-LM README's H100 weak-scaling table
    without a pipeline (1.7B-32B, :mod:`bench.published_runs`:
    ``fit_efficiency(gpu="H100", base=H100_EFFICIENCY)``); its rows with a pipeline (70B-462B)
    are held out. Result: 0.504 (fitted on the pipelined rows instead: 0.505). The A100 fit's
    share of the best measured matmul (0.627 of 0.859) carried to H100's (S. Bekman's
    ml-engineering table: 792.1 of 989, 0.801) would give 0.585 (:func:`carried_gemm`), and
    with it every H100 row comes out too fast, by 8-19%: H100's training GEMMs reach a
    smaller share of its best matmul than A100's do. The table's GH200 entry (H100 compute
    with HBM3e, 83.0%) is why H200 shares the figure. Attention: FlashAttention-2 reaches
    about 35% of H100's peak (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608,
    abstract); our trainer's attention is that class of kernel. Memory: the default 0.8.

MI250X (one GCD, a torch device) and MI300X -- GEMM from published kernel figures, the rest
    the defaults. GEMM: the same share of their entries in that table (ROCm 6.2): MI250X 147.0
    of one GCD's 191.5 TFLOP/s (0.768) gives 0.561, MI300X 781.9 of 1,307.4 (0.598) gives 0.437.
    Attention 0.4 and memory 0.8 stay the cost model's defaults: no published speed of a
    flash-attention kernel on these parts is used. No published training run on them is
    predicted here either.

Ascend 910B, and any kind not named here: the defaults (no published matmul or training
figure used).

Links: one efficiency for every link kind (``LINK_EFFICIENCY`` of
:mod:`megatron_het.perf.cost.comm_time`) was kept: the fit's residuals (within about 8%) take both
signs among the runs with the most communication (TP 8 with large micro-batches, DP over
hundreds of nodes), so a per-kind link figure would have nothing consistent to correct.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_het.cluster import AcceleratorSpec
from megatron_het.perf.cost.roofline import (
    DEFAULT_EFFICIENCY,
    EAGER_ELEMENTWISE_TRAFFIC,
    MEMORY_EFFICIENCY,
    Efficiency,
)

# A100 dense FP16/BF16 peak (TFLOP/s), the figure the published kernel speeds are shares of.
A100_PEAK_TFLOPS = 312.0
# FlashAttention-2 forward + backward, causal, head dimension 128, on A100 80GB SXM4 at
# sequence 2k and 4k (Dao 2023, arXiv 2307.08691, Figure 4(d); the same chart is the
# flash-attention repository's assets/flash2_a100_fwd_bwd_benchmark.png), TFLOP/s counted as
# our op_time counts them: the causal half of 4 s^2 d per head, backward 2.5x the forward.
FLASH_ATTENTION_2_A100_TFLOPS = (155.0, 173.0)
# GEMM: least-squares fit on Narayanan et al. 2021 Table 1 with the unfused attention of the
# software those runs used (module docstring; redo it with bench.published_runs.fit_efficiency()),
# rounded to 3 figures. Attention (our flash kernel only): FlashAttention-2's mean speed above
# as a share of the peak. Memory: not fitted (module docstring), the default.
A100_EFFICIENCY = Efficiency(
    gemm=0.627,
    attention=round(
        sum(FLASH_ATTENTION_2_A100_TFLOPS) / len(FLASH_ATTENTION_2_A100_TFLOPS) / A100_PEAK_TFLOPS,
        3,
    ),
    memory=MEMORY_EFFICIENCY,
)
# Best measured BF16 matmul as a fraction of the dense peak of our spec ("maximum achievable
# matmul FLOPS", S. Bekman, ml-engineering, compute/accelerator/README.md, its first table:
# CUDA 12.1 / ROCm 6.2): A100 SXM 267.9 / 312, H100 SXM 792.1 / 989, MI250X 147.0 of one
# GCD's 191.5, MI300X 781.9 / 1307.4 TFLOP/s.
BEST_MATMUL_FRACTION = {
    "A100": 267.9 / A100_PEAK_TFLOPS,
    "H100": 792.1 / 989,
    "MI250X": 147.0 / 191.5,
    "MI300X": 781.9 / 1307.4,
}


def carried_gemm(kind: str) -> float:
    """The A100 fit's share of A100's best matmul, carried to ``kind``'s best matmul (three
    figures): what training GEMMs reach of a kind whose BLAS reaches that best."""
    return round(
        A100_EFFICIENCY.gemm * BEST_MATMUL_FRACTION[kind] / BEST_MATMUL_FRACTION["A100"], 3
    )


# GEMM: fitted on the H100 weak-scaling rows without a pipeline (module docstring; redo it
# with bench.published_runs.fit_efficiency(gpu="H100", base=H100_EFFICIENCY)), 3 figures.
# Attention: FlashAttention-2's ~35% of H100's peak (FlashAttention-3 paper, arXiv 2407.08608,
# abstract).
H100_EFFICIENCY = Efficiency(gemm=0.504, attention=0.35, memory=MEMORY_EFFICIENCY)
# GEMM: carried. Attention and memory: the cost model's defaults (no published flash-attention
# speed on these parts is used).
MI250X_EFFICIENCY = dataclasses.replace(DEFAULT_EFFICIENCY, gemm=carried_gemm("MI250X"))
MI300X_EFFICIENCY = dataclasses.replace(DEFAULT_EFFICIENCY, gemm=carried_gemm("MI300X"))

CALIBRATED: dict[str, Efficiency] = {
    "a100-80g": A100_EFFICIENCY,  # GEMM fitted: Narayanan et al. 2021, Table 1 (A100 80GB)
    "a100-40g": A100_EFFICIENCY,  # same silicon; its lower HBM bandwidth is in the spec
    "h100": H100_EFFICIENCY,  # GEMM fitted: Megatron-LM's H100 weak-scaling rows
    "h200": H100_EFFICIENCY,  # H100 compute with more, faster HBM (in the spec)
    "mi250x": MI250X_EFFICIENCY,  # GEMM from its published best matmul (module docstring)
    "mi300x": MI300X_EFFICIENCY,  # GEMM from its published best matmul (module docstring)
}

# Each factor is raised by this much to measure a run's sensitivity to it.
STEP = 1.05
# The factors a fit can solve for (fields of Efficiency).
FACTORS = ("gemm", "attention", "memory")
# A pivot this small against the largest diagonal entry: the normal equations are singular.
SINGULAR = 1e-9


def efficiency_for(spec: AcceleratorSpec) -> Efficiency:
    """The calibrated efficiencies of ``spec``'s kind (by name, any case); the cost model's
    defaults for emulated kinds, ``cpu`` and kinds without a calibration."""
    if spec.emulated:
        return DEFAULT_EFFICIENCY
    return CALIBRATED.get(spec.name.lower(), DEFAULT_EFFICIENCY)


def resolve_efficiency(spec: AcceleratorSpec, efficiency: Efficiency | None) -> Efficiency:
    """``efficiency`` if given (an explicit override), else :func:`efficiency_for` ``spec``."""
    return efficiency_for(spec) if efficiency is None else efficiency


# Where the eager layers' elementwise traffic was measured: bf16 (and fp16, the same kernels)
# on a CUDA/ROCm GPU. fp32 has no dtype copies, and other kinds run other kernels.
EAGER_TRAFFIC_DTYPES = ("bf16", "fp16")


def layer_efficiency(
    spec: AcceleratorSpec, dtype: str, fused_elementwise: bool, efficiency: Efficiency | None = None
) -> Efficiency | None:
    """What prices ``spec``'s decoder layers: ``efficiency`` (None: the kind's calibrated
    figures, left to the stage costs), or, for the runtime's eager layers
    (``fused_elementwise`` False: no ``--compile``) on a real CUDA/ROCm kind in bf16 or fp16,
    those figures with
    :data:`~megatron_het.perf.cost.roofline.EAGER_ELEMENTWISE_TRAFFIC` (an ``efficiency`` that
    sets its own ``elementwise_traffic`` keeps it). CPU and emulated kinds are priced from
    host profiles and emulation, fused or not."""
    if (
        fused_elementwise
        or spec.emulated
        or spec.device_type != "cuda"
        or dtype not in EAGER_TRAFFIC_DTYPES
    ):
        return efficiency
    base = resolve_efficiency(spec, efficiency)
    if base.elementwise_traffic != 1.0:
        return base
    return dataclasses.replace(base, elementwise_traffic=EAGER_ELEMENTWISE_TRAFFIC)


@dataclass(frozen=True)
class RunSensitivity:
    """A run's predicted time as ``constant_s + sum_f seconds[f] / f`` over the fitted factors
    ``f`` (:data:`FACTORS`; ``seconds[f]``: the time its ops priced by ``f`` would take at
    efficiency 1), and its published time."""

    name: str
    constant_s: float
    seconds: Mapping[str, float]
    published_s: float

    def predicted_s(self, efficiency: Efficiency) -> float:
        return self.constant_s + sum(t / getattr(efficiency, f) for f, t in self.seconds.items())


@dataclass(frozen=True)
class CalibrationFit:
    """The fitted efficiencies and every run's relative error ``predicted / published - 1``
    under them (from the linear form of :class:`RunSensitivity`)."""

    efficiency: Efficiency
    runs: tuple[RunSensitivity, ...]

    @property
    def errors(self) -> dict[str, float]:
        return {r.name: r.predicted_s(self.efficiency) / r.published_s - 1 for r in self.runs}


def sensitivity(
    name: str, published_s: float, base: Efficiency, at_base: float, raised: Mapping[str, float]
) -> RunSensitivity:
    """A run's :class:`RunSensitivity` from its predicted time at ``base`` and, per factor
    ``f`` of ``raised``, the time with ``f`` raised by ``STEP`` (the time is linear in
    ``1 / f`` while no op changes sides of its roofline)."""
    seconds = {}
    for factor, time_raised in raised.items():
        value = getattr(base, factor)
        seconds[factor] = (at_base - time_raised) / (1.0 / value - 1.0 / (value * STEP))
    constant = at_base - sum(t / getattr(base, f) for f, t in seconds.items())
    return RunSensitivity(name, constant, seconds, published_s)


def least_squares(runs: Sequence[RunSensitivity], base: Efficiency) -> Efficiency:
    """The factors of ``runs``' sensitivities minimising ``sum_i (T_i / P_i - 1)^2``: linear
    least squares in ``x_f = 1 / f`` (normal equations); ``base``'s other fields are kept."""
    if not runs:
        raise ValueError("a fit needs at least one run")
    factors = tuple(runs[0].seconds)
    if len(runs) < len(factors):
        raise ValueError(
            f"a fit of {len(factors)} factors needs at least {len(factors)} runs, got {len(runs)}"
        )
    rows = [[r.seconds[f] / r.published_s for f in factors] for r in runs]
    rhs = [1.0 - r.constant_s / r.published_s for r in runs]
    k = len(factors)
    normal = [
        [sum(a[i] * a[j] for a in rows) for j in range(k)]
        + [sum(a[i] * b for a, b in zip(rows, rhs))]
        for i in range(k)
    ]
    x = _solve(normal)
    if any(v <= 0 for v in x):
        raise ValueError(
            f"the fit gives non-positive 1/efficiency "
            f"({', '.join(f'{v:.3g}' for v in x)}); the runs' fixed costs alone "
            f"exceed their published times"
        )
    # The factors are float fields of Efficiency named at run time, which mypy cannot match to
    # the fields' types.
    fitted: dict[str, Any] = {f: 1.0 / v for f, v in zip(factors, x)}
    return dataclasses.replace(base, **fitted)


def _solve(augmented: list[list[float]]) -> list[float]:
    """Gaussian elimination with partial pivoting of ``[A | b]`` (k x k+1); ValueError when
    ``A`` is singular to within rounding (the runs cannot tell the factors apart)."""
    m = [row[:] for row in augmented]
    k = len(m)
    scale = max(abs(m[i][i]) for i in range(k))
    for c in range(k):
        pivot = max(range(c, k), key=lambda r: abs(m[r][c]))
        if abs(m[pivot][c]) <= SINGULAR * scale:
            raise ValueError("the runs cannot separate the fitted factors")
        m[c], m[pivot] = m[pivot], m[c]
        for r in range(c + 1, k):
            ratio = m[r][c] / m[c][c]
            m[r] = [a - ratio * b for a, b in zip(m[r], m[c])]
    x = [0.0] * k
    for c in reversed(range(k)):
        x[c] = (m[c][k] - sum(m[c][j] * x[j] for j in range(c + 1, k))) / m[c][c]
    return x


__all__ = [
    "A100_EFFICIENCY",
    "A100_PEAK_TFLOPS",
    "BEST_MATMUL_FRACTION",
    "CALIBRATED",
    "CalibrationFit",
    "FACTORS",
    "FLASH_ATTENTION_2_A100_TFLOPS",
    "H100_EFFICIENCY",
    "MI250X_EFFICIENCY",
    "MI300X_EFFICIENCY",
    "carried_gemm",
    "RunSensitivity",
    "SINGULAR",
    "STEP",
    "EAGER_TRAFFIC_DTYPES",
    "efficiency_for",
    "layer_efficiency",
    "least_squares",
    "resolve_efficiency",
    "sensitivity",
]
