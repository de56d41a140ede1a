"""Published large-scale training runs as data, and what the predictor makes of them.

Each :class:`PublishedRun` is one table row: its source, the GPT model's shape, the layout
(TP, PP, virtual stages, DP, GPUs), batch and micro-batch, sequence and vocabulary, the
options that change time (recompute, boundary scatter/gather, DP overlap, ZeRO-1, the
gradient reduction's precision, the software's attention kernel), what the run did that the
predictor cannot express (:attr:`PublishedRun.not_expressed`), the published throughput
(TFLOP/s per GPU) and the FLOP count that paper defines it with.
:attr:`PublishedRun.published_iteration_s` turns the throughput back into an iteration time
with THAT formula (not ours); :func:`build` gives the ``(ModelConfig, ParallelPlan,
ClusterSpec, seq_length)`` to predict; :func:`fit_efficiency` refits a kind's calibration
(:mod:`megatron_het.perf.calibration`).

FLOP counts (B batch, s sequence, l layers, h hidden, V vocabulary):

* ``narayanan2021``: ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``, Narayanan et al. 2021's own
  count; it includes the recomputed forward (4 passes of the layers, 3 of the logits).
* ``megatron_core``: Megatron-LM's ``num_floating_point_operations`` (training.py, July 2024):
  ``12 B s l h^2 ((1 + g/a + s/h) q/h + (f/h) m + V/(2 l h))`` with g/a = 1 (MHA), q = h,
  f = 4h, m = 1 (no gated MLP): ``12 B s l h^2 (6 + s/h + V/(2 l h))``, no recompute counted.

GPT onto our Llama: multi-head attention (query groups = heads, head size h/a); a SwiGLU MLP
of ``f = 8h/3`` (rounded to a multiple of tp), whose three matrices have GPT's 4h GELU MLP's
FLOPs and parameters (``3 h 8h/3 = 2 h 4h``); tied embeddings (both sources tie them). What
differs: RMSNorm for LayerNorm and SwiGLU for GELU (the same memory traffic to within a few
%), RoPE instead of learned positions (no position table: ``s h`` parameters fewer), no biases
and no hidden dropouts (GPT's bias adds and its two bias-dropout-adds per layer are
memory-bound work our cost model lacks; the A100 GEMM fit absorbs them). The attention is the
software's: the 2021 rows run Megatron-LM's unfused attention (``attention_kernel="unfused"``,
:func:`~megatron_het.perf.cost_model.attention_ops`: materialised scores, the fused causal
softmax, attention dropout 0.1 -- Megatron's default, which the scripts keep), the 2024 rows a
flash-class kernel (TransformerEngine's fused attention: ``"flash"``, our runtime's too).

Calibration set: Narayanan et al. 2021 (arXiv 2104.04473, SC21), Table 1 ("weak-scaling
throughput", also ``images/cases_april2021.png`` of the Megatron-LM repository): heads, hidden
size, layers, model-parallel size (TP x PP), GPUs, batch and TFLOP/s per GPU. TP, PP, the
micro-batch, the virtual stages (``--num-layers-per-virtual-pipeline-stage``: v = layers / pp
/ that), ``--activations-checkpoint-method uniform`` (full recompute, one layer per
checkpoint), ``--DDP-impl`` and fp16 come from the paper's artifact script
``examples/sc21/run_table_1.sh`` and ``CONFIG.sh`` (Megatron-LM commit 6985e58, Aug 2021,
the commit their README names; removed in 2024). At that commit the pipeline's boundary
tensors go scatter/gather (each TP rank sends 1/tp, the receiver all-gathers over NVLink; on
by default): the bytes of a sequence-parallel boundary, in layers without sequence
parallelism (which came in 2022): :func:`predict_run` passes
``scatter_gather_tensors_in_pipeline`` (the flag's name then) to the predictor, which prices
those boundaries as sequence-parallel ones and everything else without it.
``DDP-impl torch`` rows overlap the gradient all-reduce with the last backward
(``overlap_grad_reduce``); ``local`` rows reduce after it. Both reduce fp16 gradients; the
predictor counts fp32 ones (twice the bytes).
Hardware: Selene, DGX A100 nodes of 8 A100-80GB (NVLink/NVSwitch 600 GB/s), 8 x 200 Gb/s HDR
InfiniBand per node (the paper's experimental setup).

The other rows (:data:`GPT3_README_RUN`, :data:`MEGATRON_CORE_H100_RUNS`); the H100 table's
rows without a pipeline (1.7B-32B) are H100's calibration set (its GEMM figure), its rows with
one (70B-462B) and the GPT-3 example are held out (no constant is tuned on them):

* ``megatron-readme-gpt3-175B``: the Megatron-LM README's GPT-3 example (commit 152aab3, Jan
  2021, ``examples/pretrain_gpt3_175B.sh``): 96 layers, h 12288, 96 heads, TP 8, PP 16, 1,024
  A100, batch 1,536, micro-batch 1, ``--checkpoint-activations``, fp16, no interleaving, no
  scatter/gather yet; "around 32 seconds", 138 TFLOP/s per GPU (its FLOPs: Narayanan's).
* ``megatron-core-h100-*``: the Megatron-LM README's H100 weak-scaling table (commit f2e5db4,
  July 2024, ``images/model_table.png``, Megatron-Core r0.8.0): GPT, vocabulary 131,072,
  sequence 4,096, DP 48; heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU. The
  README names ``--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap``; those
  imply ``--use-distributed-optimizer`` and ``--sequence-parallel`` (Megatron asserts both),
  and bf16 accumulates and reduces gradients in fp32 (``arguments.py`` forces
  ``accumulate_allreduce_grads_in_fp32``). Set as the runs had them: bf16,
  ``sequence_parallel`` and ``tp_comm_overlap`` (where tp > 1; TransformerEngine's userbuffer
  overlap, priced as the runtime's rings beside the GEMMs), ``use_distributed_optimizer``,
  ``overlap_grad_reduce``, ``overlap_param_gather`` and ``grad_reduce_in_bf16`` off. Their
  DDP buckets are Megatron's default, ``max(4e7, 1e6 dp)`` parameters (``ddp_bucket_size``).
  NOT published, inferred here (:func:`schedule_of` gives both rules; the only GPT script of
  that commit, ``examples/gpt3/train_gpt3_175b_distributed.sh``: fp16, sequence 2048, none of
  the overlap flags, is not these runs' and settles none of them):

  - with a pipeline (PP > 1), the interleaved schedule at one layer per virtual stage
    (``--num-layers-per-virtual-pipeline-stage 1``), micro-batch 1. The README credits
    pipeline communication overlap ("PP (enabled by default)"), and Megatron's
    ``arguments.py`` turns ``overlap_p2p_comm`` off unless the interleaved schedule runs;
    one layer per virtual stage is the only degree open to every row (119B's 23 and 462B's
    7 layers per stage are prime);
  - without one (PP = 1), one micro-batch of the whole local batch (global / DP = 4
    sequences): without a pipeline, gradient accumulation only saves memory, and every such
    row fits (the predicted peak is at most about 51 GB of 80). Micro-batch 1 cannot have
    been run at 32B: Megatron starts the gradient reduce-scatter at the last micro-batch's
    backward (``no_sync`` before it), and 32B's fp32 gradients, about 15 GB per GPU over its
    50 GB/s NIC, then need at least 0.29 s, of which at most one micro-batch's backward
    (about 0.15 s) hides, and the parameter all-gather (about 0.15 s) has only the first
    forward to hide behind; that would leave at most about 0.6 s of the published 0.89 s for
    the compute, over 60% of H100's peak, where the README reports 41-48% MFU for its
    whole table.

  Also assumed: no recompute, DGX H100 nodes with 8 x 400 Gb/s NDR.
  ``bench/published_runs.py --h100-plain-schedule`` predicts the rows with micro-batch 1 and
  no interleaving instead, the plainest reading, to show what the inference changes.

Left out: Korthikanti et al. 2022 (arXiv 2205.05198) -- we could not confirm its table's
iteration times and configurations from a primary source, and its selective
recompute is not a plan option (recompute is all-or-nothing per stage); the Megatron-LM
README's MFU/HFU table (the same runs, configurations not given there); Llama 3 (arXiv
2407.21783, Table 4) -- FSDP, context parallelism in its long-context row, a modified pipeline
schedule and an unpublished FLOP formula; the H100 strong-scaling figure (plotted, no table).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_het.cluster import ClusterSpec, NodeGroup, get_accelerator
from megatron_het.config import ModelConfig
from megatron_het.parallel.buckets import megatron_default_bucket_size
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_builders import plan_from_megatron_flags
from megatron_het.perf.calibration import (
    FACTORS,
    STEP,
    CalibrationFit,
    efficiency_for,
    least_squares,
    sensitivity,
)
from megatron_het.perf.cost_model import DEFAULT_EFFICIENCY, Efficiency
from megatron_het.perf.prediction import Prediction
from megatron_het.perf.predictor import predict
from megatron_het.perf.simulator import SimulationCache

GBIT_PER_GBYTE = 8.0
# What fit_efficiency solves for on Table 1 (calibration module docstring), and its rounds.
FITTED_FACTORS = ("gemm",)
FIT_ROUNDS = 4


@dataclass(frozen=True)
class PublishedRun:
    """One published training run (see the module docstring for the sources and fields)."""

    name: str
    study: str  # short name of the source, to group rows by
    source: str
    split: str  # "calibration" | "held_out"
    gpu: str  # accelerator kind
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    num_gpus: int
    global_batch: int
    micro_batch: int
    tflops_per_gpu: float  # published, per the FLOP count ``flop_formula``
    flop_formula: str  # "narayanan2021" | "megatron_core"
    seq_length: int = 2048
    vocab: int = 51200
    virtual_stages: int = 1
    recompute: bool = True
    dtype: str = "fp16"
    scatter_gather_p2p: bool = False
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_in_bf16: bool = False
    tp_comm_overlap: bool = False  # with sequence_parallel: the runtime's rings
    attention_kernel: str = "flash"  # the software's (cost_model.ATTENTION_KERNELS)
    gpus_per_node: int = 8
    nic_gbit_per_s: float = 1600.0  # per node, all NICs together
    published_time_s: float | None = None  # an iteration time the source states itself
    not_expressed: tuple[str, ...] = ()  # what the run did that the predictor cannot express
    ddp_bucket_size: int | None = None  # --ddp-bucket-size (None: the runtime's default)
    notes: str = ""

    @property
    def dp(self) -> int:
        return self.num_gpus // (self.tp * self.pp)

    @property
    def published_flops(self) -> float:
        """FLOPs of one iteration by the source's own count."""
        return FLOP_FORMULAS[self.flop_formula](self)

    @property
    def published_iteration_s(self) -> float:
        """The iteration time the published TFLOP/s per GPU stands for."""
        return self.published_flops / (self.tflops_per_gpu * 1e12 * self.num_gpus)


def narayanan2021_flops(run: PublishedRun) -> float:
    """``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` (Narayanan et al. 2021)."""
    b, s, l, h, v = run.global_batch, run.seq_length, run.layers, run.hidden, run.vocab
    return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def megatron_core_flops(run: PublishedRun) -> float:
    """Megatron-LM's ``num_floating_point_operations`` for GPT (MHA, 4h GELU MLP):
    ``12 B s l h^2 (6 + s/h + V/(2 l h))``."""
    b, s, l, h, v = run.global_batch, run.seq_length, run.layers, run.hidden, run.vocab
    return 12.0 * b * s * l * h * h * (6 + s / h + v / (2 * l * h))


FLOP_FORMULAS: dict[str, Callable[[PublishedRun], float]] = {
    "narayanan2021": narayanan2021_flops,
    "megatron_core": megatron_core_flops,
}


@dataclass(frozen=True)
class BuiltRun:
    """What :func:`predict` takes for a run."""

    model: ModelConfig
    plan: ParallelPlan
    cluster: ClusterSpec
    seq_length: int


def model_config(run: PublishedRun) -> ModelConfig:
    """The GPT of ``run`` as our Llama (module docstring): MHA, SwiGLU of ~8h/3, tied."""
    ffn = run.tp * round(8 * run.hidden / (3 * run.tp))
    return ModelConfig(
        num_layers=run.layers,
        hidden_size=run.hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=run.heads,
        num_query_groups=run.heads,
        vocab_size=run.vocab,
        max_position_embeddings=run.seq_length,
        tie_embeddings=True,
        name=run.name,
    )


def cluster_spec(run: PublishedRun) -> ClusterSpec:
    """``num_gpus / gpus_per_node`` nodes of ``run.gpu``; the kind's NVLink-class figure inside
    a node, the node's NICs between nodes."""
    if run.num_gpus % run.gpus_per_node:
        raise ValueError(
            f"{run.name}: {run.num_gpus} GPUs do not fill nodes of {run.gpus_per_node}"
        )
    group = NodeGroup(
        run.gpu.lower(),
        get_accelerator(run.gpu),
        run.num_gpus // run.gpus_per_node,
        run.gpus_per_node,
        run.nic_gbit_per_s / GBIT_PER_GBYTE,
    )
    return ClusterSpec([group], name=run.name)


def build(run: PublishedRun) -> BuiltRun:
    """The model, plan (Megatron's rank order; validated) and cluster of ``run``; scatter/gather
    boundaries are not a plan option (:func:`predict_run` passes them to the predictor)."""
    model, cluster = model_config(run), cluster_spec(run)
    plan = plan_from_megatron_flags(
        model,
        run.num_gpus,
        run.tp,
        run.pp,
        run.micro_batch,
        run.global_batch,
        accelerator_of=cluster,
        recompute=run.recompute,
        virtual_stages=run.virtual_stages if run.virtual_stages > 1 else None,
    )
    sharded = run.tp > 1 and run.sequence_parallel
    plan = dataclasses.replace(
        plan,
        dtype=run.dtype,
        sequence_parallel=sharded,
        use_distributed_optimizer=run.distributed_optimizer,
        overlap_grad_reduce=run.overlap_grad_reduce,
        overlap_param_gather=run.overlap_param_gather,
        grad_reduce_in_bf16=run.grad_reduce_in_bf16,
        tp_comm_overlap=(sharded and run.tp_comm_overlap) or None,
    )
    return BuiltRun(model, plan, cluster, run.seq_length)


def plain_schedule(run: PublishedRun) -> PublishedRun:
    """``run`` with micro-batch 1 and no interleaving (the plainest reading of an H100 row,
    ``bench/published_runs.py --h100-plain-schedule``)."""
    return dataclasses.replace(run, micro_batch=1, virtual_stages=1)


def run_efficiency(run: PublishedRun, efficiency: Efficiency | None = None) -> Efficiency:
    """The factors ``run`` is priced at: ``efficiency`` (None: its kind's calibrated figures,
    :func:`~megatron_het.perf.calibration.efficiency_for`) with the row's attention kernel
    (the software's, not the device's)."""
    base = efficiency_for(get_accelerator(run.gpu)) if efficiency is None else efficiency
    return dataclasses.replace(base, attention_kernel=run.attention_kernel)


def predict_run(
    run: PublishedRun,
    efficiency: Efficiency | None = None,
    pipeline_model: str = "simulate",
    cache: SimulationCache | None = None,
) -> Prediction:
    """The predictor's estimate of ``run`` at :func:`run_efficiency` ``(run, efficiency)``, with
    the row's scatter/gather boundaries."""
    built = build(run)
    return predict(
        built.model,
        built.plan,
        built.cluster,
        built.seq_length,
        efficiency=run_efficiency(run, efficiency),
        pipeline_model=pipeline_model,
        cache=cache,
        validate=False,
        ddp_bucket_size=run.ddp_bucket_size,
        scatter_gather_tensors_in_pipeline=run.scatter_gather_p2p,
    )


def fit_efficiency(
    runs: Sequence[PublishedRun] | None = None,
    factors: Sequence[str] = FITTED_FACTORS,
    base: Efficiency = DEFAULT_EFFICIENCY,
    rounds: int = FIT_ROUNDS,
    gpu: str = "A100-80G",
) -> CalibrationFit:
    """Refit ``factors`` of one kind on ``runs`` (default: the calibration rows of ``gpu``) as
    :mod:`megatron_het.perf.calibration` describes: per run, a closed-form prediction at the
    current factors and one with each fitted factor raised by ``STEP``, then
    :func:`~megatron_het.perf.calibration.least_squares`; repeated from the fitted factors
    (``rounds`` in all, or until they move less than 1e-4) so that the linear form is taken
    where the fit lands (an op near its roofline's ridge changes sides between factors)."""
    if runs is None:
        runs = [run for run in CALIBRATION_RUNS if run.gpu == gpu]
    runs = list(runs)
    if not runs:
        raise ValueError(f"no calibration rows of {gpu!r}")
    kinds = {run.gpu for run in runs}
    if len(kinds) != 1:
        raise ValueError(f"fit one accelerator kind at a time, got {sorted(kinds)}")
    unknown = set(factors) - set(FACTORS)
    if unknown or not factors:
        raise ValueError(f"fit some of {', '.join(FACTORS)}; got {list(factors)}")
    if rounds < 1:
        raise ValueError(f"a fit takes at least one round, got {rounds}")
    cache = SimulationCache()
    current = base
    for _ in range(rounds):
        found = []
        for run in runs:

            def time_at(e: Efficiency) -> float:
                return predict_run(run, e, "closed_form", cache).iteration_time_s

            raised = {
                f: time_at(dataclasses.replace(current, **{f: getattr(current, f) * STEP}))
                for f in factors
            }
            found.append(
                sensitivity(run.name, run.published_iteration_s, current, time_at(current), raised)
            )
        fitted = least_squares(found, current)
        moved = max(abs(getattr(fitted, f) / getattr(current, f) - 1) for f in factors)
        current = fitted
        if moved < 1e-4:
            break
    return CalibrationFit(current, tuple(found))


_NARAYANAN = (
    "Narayanan et al. 2021, arXiv 2104.04473, Table 1; settings: Megatron-LM "
    "examples/sc21/run_table_1.sh"
)
# What Megatron-LM of 2021 did that the predictor cannot express (its attention it can:
# attention_kernel "unfused").
_MEGATRON_2021_GAPS = (
    "fp16 gradient reduction (the predictor reduces fp32; a 2-byte reduction only for bf16)",
    "GPT's bias adds, GELU and hidden dropouts (bias-dropout-add, p 0.1): memory-bound work "
    "the Llama cost model lacks",
)


def _narayanan(
    size: str,
    heads: int,
    hidden: int,
    layers: int,
    tp: int,
    pp: int,
    gpus: int,
    batch: int,
    tflops: float,
    mbs: int,
    layers_per_virtual: int | None,
    ddp_torch: bool,
) -> PublishedRun:
    v = layers // pp // layers_per_virtual if layers_per_virtual else 1
    return PublishedRun(
        name=f"narayanan2021-{size}",
        study="narayanan2021",
        source=_NARAYANAN,
        split="calibration",
        gpu="A100-80G",
        heads=heads,
        hidden=hidden,
        layers=layers,
        tp=tp,
        pp=pp,
        num_gpus=gpus,
        global_batch=batch,
        micro_batch=mbs,
        tflops_per_gpu=tflops,
        flop_formula="narayanan2021",
        virtual_stages=v,
        scatter_gather_p2p=True,
        overlap_grad_reduce=ddp_torch,
        attention_kernel="unfused",
        not_expressed=_MEGATRON_2021_GAPS,
        notes=f"DDP-impl {'torch' if ddp_torch else 'local'}",
    )


NARAYANAN_RUNS: tuple[PublishedRun, ...] = (
    #          size    heads hidden layers tp pp  GPUs  batch TFLOP/s mbs layers/virtual torch
    _narayanan("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, None, True),
    _narayanan("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, None, True),
    _narayanan("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, None, True),
    _narayanan("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, None, True),
    _narayanan("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, None, False),
    _narayanan("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5, False),
    _narayanan("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5, False),
    _narayanan("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3, False),
    _narayanan("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1, False),
    _narayanan("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, None, False),
)

_MCORE = (
    "Megatron-LM README, H100 weak-scaling table (images/model_table.png, commit "
    "f2e5db4, July 2024); micro-batch and interleaving inferred, recompute and NICs "
    "assumed"
)


def schedule_of(layers: int, pp: int, dp: int, global_batch: int) -> tuple[int, int]:
    """``(micro_batch, virtual_stages)`` inferred for a Megatron-Core H100 row (module
    docstring): with a pipeline, micro-batch 1 interleaved at one layer per virtual stage;
    without one, the whole local batch as one micro-batch."""
    if pp > 1:
        return 1, layers // pp
    return global_batch // dp, 1


def _megatron_core(
    size: str,
    heads: int,
    hidden: int,
    layers: int,
    tp: int,
    pp: int,
    gpus: int,
    batch: int,
    tflops: float,
) -> PublishedRun:
    # --tp-comm-overlap asserts --sequence-parallel, --overlap-param-gather asserts the
    # distributed optimizer and --overlap-grad-reduce; bf16 forces fp32 gradient reductions.
    micro_batch, virtual = schedule_of(layers, pp, gpus // (tp * pp), batch)
    return PublishedRun(
        name=f"megatron-core-h100-{size}",
        study="megatron-core-h100",
        source=_MCORE,
        split="calibration" if pp == 1 else "held_out",
        gpu="H100",
        heads=heads,
        hidden=hidden,
        layers=layers,
        tp=tp,
        pp=pp,
        num_gpus=gpus,
        global_batch=batch,
        micro_batch=micro_batch,
        tflops_per_gpu=tflops,
        virtual_stages=virtual,
        flop_formula="megatron_core",
        seq_length=4096,
        vocab=131072,
        recompute=False,
        dtype="bf16",
        sequence_parallel=True,
        distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        grad_reduce_in_bf16=False,
        tp_comm_overlap=tp > 1,
        attention_kernel="flash",
        nic_gbit_per_s=3200.0,
        ddp_bucket_size=megatron_default_bucket_size(gpus // (tp * pp)),
        notes="micro-batch and interleaving not published (inferred: schedule_of); "
        "no recompute assumed",
    )


GPT3_README_RUN = PublishedRun(
    name="megatron-readme-gpt3-175B",
    study="megatron-readme-gpt3",
    source="Megatron-LM README, GPT-3 example (commit 152aab3, Jan 2021; "
    "examples/pretrain_gpt3_175B.sh)",
    split="held_out",
    gpu="A100-80G",
    heads=96,
    hidden=12288,
    layers=96,
    tp=8,
    pp=16,
    num_gpus=1024,
    global_batch=1536,
    micro_batch=1,
    tflops_per_gpu=138,
    flop_formula="narayanan2021",
    published_time_s=32.0,
    attention_kernel="unfused",
    not_expressed=_MEGATRON_2021_GAPS,
    notes="A100 memory size not stated there (Selene's are 80GB); DDP-impl local",
)

MEGATRON_CORE_H100_RUNS: tuple[PublishedRun, ...] = (
    #              size   heads hidden layers tp pp GPUs  batch TFLOP/s
    _megatron_core("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _megatron_core("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    _megatron_core("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    _megatron_core("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    _megatron_core("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    _megatron_core("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    _megatron_core("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    _megatron_core("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    _megatron_core("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
)

# Calibration: Table 1 (A100's GEMM) and the H100 rows without a pipeline (H100's GEMM);
# held out: the GPT-3 example and the H100 rows with one.
CALIBRATION_RUNS: tuple[PublishedRun, ...] = NARAYANAN_RUNS + tuple(
    r for r in MEGATRON_CORE_H100_RUNS if r.split == "calibration"
)
HELD_OUT_RUNS: tuple[PublishedRun, ...] = (GPT3_README_RUN,) + tuple(
    r for r in MEGATRON_CORE_H100_RUNS if r.split == "held_out"
)
ALL_RUNS: tuple[PublishedRun, ...] = NARAYANAN_RUNS + (GPT3_README_RUN,) + MEGATRON_CORE_H100_RUNS

__all__ = [
    "ALL_RUNS",
    "BuiltRun",
    "CALIBRATION_RUNS",
    "FITTED_FACTORS",
    "FIT_ROUNDS",
    "FLOP_FORMULAS",
    "GPT3_README_RUN",
    "HELD_OUT_RUNS",
    "MEGATRON_CORE_H100_RUNS",
    "NARAYANAN_RUNS",
    "PublishedRun",
    "build",
    "cluster_spec",
    "fit_efficiency",
    "megatron_core_flops",
    "model_config",
    "narayanan2021_flops",
    "plain_schedule",
    "predict_run",
    "run_efficiency",
    "schedule_of",
]
