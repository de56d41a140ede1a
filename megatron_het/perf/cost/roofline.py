"""Compute cost of one decoder layer, the embedding and the head: FLOPs, bytes and roofline time.

All figures are per tensor-parallel rank and per micro-batch of ``micro_batch`` sequences of ``seq``
tokens, with Megatron's TP layout: QKV and the MLP's gate/up are column-parallel, the attention
projection and MLP down are row-parallel, the norms and residual adds are replicated on every TP
rank, the embedding and the head are vocab-parallel. Sequence parallelism (the ``sequence_parallel``
arguments, :mod:`megatron_het.tensor_parallel.sequence_parallel`) shards the regions between the TP
blocks along the sequence: it changes the TP collectives
(:func:`~megatron_het.perf.cost.tp_collectives.tp_collectives`), the activations saved there
(:func:`layer_activation_bytes`) and the work there: the norms and residual adds run on ``1/tp`` of
the positions (:func:`layer_forward_ops`, :func:`head_forward_ops` with ``sequence_parallel``).
Without it they run whole on every TP rank: a few percent of a layer's time at tp 2, but about 12%
of the step of the 32B H100 row of :mod:`bench.published_runs` (tp 8), where the GEMMs beside them
are split eight ways.

A GEMM of ``[m, k] x [k, n]`` costs ``2 m n k`` FLOPs and moves ``(m k + k n + m n)`` elements; its
roofline time is ``max(flops / (peak * gemm), bytes / (bandwidth * memory))`` with the
efficiency factors of :class:`Efficiency`. Norms, RoPE, SwiGLU and residual adds are
memory-bound. Backward costs twice the forward for GEMMs (input and weight gradients) and for
memory-bound ops unless an op says otherwise (:attr:`Op.backward_factor`). The factors default
to the module constants below; per-kind calibrated ones live in
:mod:`megatron_het.perf.cost.calibration`.

Attention is costed as the software being predicted runs it (:attr:`Efficiency.attention_kernel`,
:func:`attention_ops`): ``"flash"`` (our runtime, :mod:`megatron_het.kernels.attention`), one
kernel with its own factor on the causal half of the scores, or ``"unfused"`` (Megatron-LM
2021), GEMMs and memory-bound passes over the materialised ``[b, heads/tp, s, s]`` scores.

Emulated kinds: their spec figures are the host CPU's divided by the slowdown (see
:mod:`megatron_het.cluster.accelerators`), so the estimate is made for the host (figures times
the slowdown) and then multiplied by the slowdown, as an emulated run waits that much longer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from megatron_het.cluster import AcceleratorSpec
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP32_BYTES = 4

# Large bf16/fp16 GEMMs on current GPUs reach about 60-75% of the dense datasheet peak
# (cuBLAS/hipBLASLt on the layer shapes of multi-billion models); 0.6 is the low end.
GEMM_EFFICIENCY = 0.6
# Flash attention forward reaches roughly 35-50% of peak on H100-class parts; its backward less.
ATTENTION_EFFICIENCY = 0.4
# Streaming kernels (norms, elementwise, optimizer) reach about 80% of the HBM bandwidth.
MEMORY_EFFICIENCY = 0.8
# How many times the fused minimum (one read and one write of each norm, RoPE, SwiGLU and
# residual add, what compiled layers and Megatron's fused kernels move) the runtime's eager
# decoder layer moves in its elementwise kernels on a GPU: float32 intermediates of the norms
# and RoPE, dtype copies, one kernel per operation. Measured on one H200 (torch 2.11, bf16,
# TinyLlama-1.1B's layer, micro-batch 4, seq 2048; tools/profile_device.py --kernels): 4.25 ms
# of elementwise kernels per forward + backward against the 0.544 ms this model prices fused.
EAGER_ELEMENTWISE_TRAFFIC = 7.8
# A causal kernel skips the masked half of the S x S scores; model FLOPs still count all of it.
CAUSAL_ATTENTION_WORK = 0.5
# Flash attention's backward recomputes the scores: about 2.5x the forward work (not 2x).
ATTENTION_BACKWARD_FACTOR = 2.5
# How attention is implemented by the software being predicted (module docstring).
ATTENTION_KERNELS = ("flash", "unfused")
# Bytes of a dropout mask element (torch's fused dropout keeps a uint8 mask).
DROPOUT_MASK_BYTES = 1
# Adam step, bytes moved per parameter with bf16/fp16 weights: read+write the fp32 master
# weight, exp_avg and exp_avg_sq (24), read the fp32 main grad (4), write the low-precision
# weight (2), zero the grad buffer (4). With fp32 weights there is no separate master (32).
OPTIMIZER_BYTES_PER_PARAM = {"bf16": 34, "fp16": 34, "fp32": 32}


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet figures that kernels reach (see the module constants) and
    ``attention_kernel`` (:data:`ATTENTION_KERNELS`), the attention the software being
    predicted runs: ``"flash"`` (ours, the default) or ``"unfused"`` (Megatron-LM 2021, whose
    GEMMs and memory passes the other factors price; ``attention`` prices the flash kernel).
    The choice travels with the factors wherever a prediction is priced
    (``predict(efficiency=...)``, the stage costs): they say how the software's kernels perform
    on a kind, it which kernels there are. The defaults are one guess for every kind;
    :mod:`megatron_het.perf.cost.calibration` holds per-kind figures fitted to, or taken from,
    published measurements (``efficiency_for(spec)``), which the stage costs use when given
    ``efficiency=None``. The functions here take an explicit one."""

    gemm: float = GEMM_EFFICIENCY
    attention: float = ATTENTION_EFFICIENCY
    memory: float = MEMORY_EFFICIENCY
    attention_kernel: str = "flash"
    # the layers' elementwise traffic over the fused minimum (1: fused; eager layers on a GPU:
    # EAGER_ELEMENTWISE_TRAFFIC), a property of the software like attention_kernel
    elementwise_traffic: float = 1.0

    def __post_init__(self) -> None:
        if self.elementwise_traffic < 1.0:
            raise UserError(
                f"elementwise_traffic is at least 1 (the fused minimum), got "
                f"{self.elementwise_traffic:g}"
            )
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise UserError(
                f"unknown attention kernel {self.attention_kernel!r}; use "
                f"{' or '.join(ATTENTION_KERNELS)}"
            )


DEFAULT_EFFICIENCY = Efficiency()


@dataclass(frozen=True)
class LayerShape:
    """What a decoder layer's cost depends on: the model's widths and the per-rank work."""

    hidden: int
    ffn: int
    heads: int
    kv_groups: int
    seq: int
    micro_batch: int
    tp: int

    @classmethod
    def of(cls, model: ModelConfig, seq: int, micro_batch: int, tp: int) -> LayerShape:
        return cls(
            model.hidden_size,
            model.ffn_hidden_size,
            model.num_attention_heads,
            model.num_query_groups,
            seq,
            micro_batch,
            tp,
        )

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class Op:
    """One kernel: ``flops`` and ``elements`` moved; ``kind`` is gemm, attention or memory.

    ``elements`` counts values of the compute dtype; ``extra_bytes`` adds other traffic (fp32
    values, byte masks). ``backward_factor``: the backward's FLOPs and bytes as a multiple of
    the forward's (gemm and memory ops; 2 unless the op's backward is counted otherwise).
    """

    name: str
    kind: str
    flops: float
    elements: float
    extra_bytes: float = 0.0
    backward_factor: float = 2.0

    def bytes(self, dtype: str) -> float:
        return self.elements * dtype_bytes(dtype) + self.extra_bytes


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (bf16, fp16, fp32)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise UserError(f"unknown dtype {dtype!r}; use bf16, fp16 or fp32") from None


def gemm(name: str, m: float, n: float, k: float) -> Op:
    return Op(name, "gemm", 2.0 * m * n * k, m * k + k * n + m * n)


def attention_ops(shape: LayerShape, kernel: str = "flash") -> list[Op]:
    """The kernels between qkv and proj on one TP rank, as ``kernel`` runs them (both do the
    same model FLOPs, ``4 b s^2 d`` per head: Q K^T and the probabilities times V).

    ``"flash"``: one kernel reading Q, K, V and writing the output. ``"unfused"``: Megatron-LM
    2021's ``ParallelAttention`` (commit 6985e58, ``megatron/model/transformer.py`` and
    ``fused_softmax.py``), fp16 at ``s <= 2048`` (the fused softmax's limit; longer sequences
    fell back to torch's softmax, not modelled), per score element (``b heads/tp s^2`` of
    them), in elements of the compute dtype:

    * ``scores``: ``baddbmm`` of Q and K^T (the 1/sqrt(d) scale folded in), the whole square;
      backward two GEMMs (dQ, dK);
    * ``softmax``: ``ScaledUpperTriangMaskedSoftmax``, whose forward reads the causal half of
      the scores (``local_seq = row + 1``) and writes every element (zeros above): 1.5;
      backward reads the output gradients and the probabilities over the half and writes every
      input gradient: 2.0 (hence ``backward_factor`` 2.0 / 1.5);
    * ``dropout``: ``torch.nn.Dropout(0.1)`` (``--attention-dropout`` defaults to 0.1; Table 1's
      scripts leave it): reads and writes every element and writes a uint8 mask; backward reads
      the gradients and the mask and writes the gradients: the same (``backward_factor`` 1);
    * ``context``: ``bmm`` of the dropped probabilities and V, the whole square; backward two
      GEMMs (the probabilities' and V's gradients);
    * ``context_transpose``: ``permute(2, 0, 1, 3).contiguous()`` of the ``[b, np, s, hn]``
      output to ``[s, b, hp]``, a read and a write; backward the same copy back.

    Left out: the backward's scaling of dQ and dK by the baddbmm's alpha (``[b np, s, hn]``
    each, about ``d/s`` of one pass over the scores).
    """
    t, tp = shape.tokens, shape.tp
    q = shape.heads * shape.head_dim // tp
    kv = shape.kv_groups * shape.head_dim // tp
    if kernel == "flash":
        # Scores Q K^T and their product with V: 2 GEMM-like products of S x S x D per head.
        attn_flops = 4.0 * shape.micro_batch * shape.seq * shape.seq * q
        return [Op("attention", "attention", attn_flops, t * (2 * q + 2 * kv))]
    if kernel != "unfused":
        raise UserError(
            f"unknown attention kernel {kernel!r}; use {' or '.join(ATTENTION_KERNELS)}"
        )
    s, d = shape.seq, shape.head_dim
    batches = shape.micro_batch * (shape.heads // tp)
    scores = batches * s * s
    return [
        Op("scores", "gemm", 2.0 * scores * d, batches * 2 * s * d + scores),
        Op("softmax", "memory", 0.0, 1.5 * scores, backward_factor=2.0 / 1.5),
        Op(
            "dropout",
            "memory",
            0.0,
            2.0 * scores,
            extra_bytes=DROPOUT_MASK_BYTES * scores,
            backward_factor=1.0,
        ),
        Op("context", "gemm", 2.0 * scores * d, scores + batches * 2 * s * d),
        Op("context_transpose", "memory", 0.0, 2.0 * t * q, backward_factor=1.0),
    ]


def _elementwise_elements(shape: LayerShape, sequence_parallel: bool) -> tuple[float, float]:
    """Elements the memory-bound work of a layer's attention block (RoPE on q and k; the input
    norm, read+write h, and the residual add, read 2h and write h) and of its MLP block
    (SwiGLU, read 2f and write f; the norm and the residual add) moves on one TP rank. RoPE
    and SwiGLU run on every position; the norms and residual adds on the positions between
    the TP blocks (``1/tp`` of them with ``sequence_parallel``)."""
    t, h, tp = shape.tokens, shape.hidden, shape.tp
    q = shape.heads * shape.head_dim // tp
    kv = shape.kv_groups * shape.head_dim // tp
    f = shape.ffn // tp
    between = _between_blocks(shape, sequence_parallel)
    return t * 2 * (q + kv) + between * 5 * h, t * 3 * f + between * 5 * h


def layer_forward_ops(
    shape: LayerShape, attention_kernel: str = "flash", sequence_parallel: bool = False
) -> list[Op]:
    """The kernels of one layer's forward on one TP rank (attention as ``attention_kernel``
    runs it, :func:`attention_ops`); with ``sequence_parallel`` the norms and residual adds
    run on the rank's ``1/tp`` of the positions."""
    t, h, tp = shape.tokens, shape.hidden, shape.tp
    q = shape.heads * shape.head_dim // tp
    kv = shape.kv_groups * shape.head_dim // tp
    f = shape.ffn // tp
    return [
        gemm("qkv", t, q + 2 * kv, h),
        *attention_ops(shape, attention_kernel),
        gemm("proj", t, h, q),
        gemm("gate_up", t, 2 * f, h),
        gemm("down", t, h, f),
        Op("elementwise", "memory", 0.0, sum(_elementwise_elements(shape, sequence_parallel))),
    ]


def block_forward_ops(
    shape: LayerShape, attention_kernel: str = "flash", sequence_parallel: bool = False
) -> tuple[list[Op], list[Op]]:
    """:func:`layer_forward_ops` split between the layer's attention block (input norm, qkv,
    RoPE, attention, proj, residual add) and its MLP block (post-attention norm, gate/up,
    SwiGLU, down, residual add): the two lists cost what the layer's list costs."""
    ops = layer_forward_ops(shape, attention_kernel, sequence_parallel)
    attention = [op for op in ops if op.name not in ("gate_up", "down", "elementwise")]
    mlp = [op for op in ops if op.name in ("gate_up", "down")]
    for block, elements in zip((attention, mlp), _elementwise_elements(shape, sequence_parallel)):
        block.append(Op("elementwise", "memory", 0.0, elements))
    return attention, mlp


def layer_forward_flops(shape: LayerShape) -> float:
    """Model FLOPs of one layer's forward on one TP rank (attention counted in full)."""
    return sum(op.flops for op in layer_forward_ops(shape))


def head_forward_ops(shape: LayerShape, vocab: int, sequence_parallel: bool = False) -> list[Op]:
    """Final norm (on the rank's ``1/tp`` of the positions with ``sequence_parallel``), the
    vocab-parallel output GEMM and the cross-entropy (fp32 softmax)."""
    t, h, v = shape.tokens, shape.hidden, vocab / shape.tp
    return [
        Op("final_norm", "memory", 0.0, 2 * _between_blocks(shape, sequence_parallel) * h),
        gemm("output", t, v, h),
        Op("cross_entropy", "memory", 0.0, t * v, extra_bytes=2 * FP32_BYTES * t * v),
    ]


def head_forward_flops(shape: LayerShape, vocab: int) -> float:
    """Model FLOPs of the head's forward on one TP rank (the output GEMM)."""
    return 2.0 * shape.tokens * shape.hidden * vocab / shape.tp


def embedding_forward_ops(shape: LayerShape) -> list[Op]:
    """The embedding lookup: read a row and write it, per token (memory-bound)."""
    return [Op("embedding", "memory", 0.0, 2 * shape.tokens * shape.hidden)]


def emulation_factor(spec: AcceleratorSpec) -> float:
    """The slowdown of an emulated kind (its figures are the host's divided by it), else 1."""
    return spec.slowdown if spec.emulated else 1.0


def op_time(
    op: Op,
    spec: AcceleratorSpec,
    dtype: str,
    efficiency: Efficiency = DEFAULT_EFFICIENCY,
    backward: bool = False,
) -> float:
    """Roofline seconds of ``op`` (or of its backward) on one device of ``spec``."""
    slowdown = emulation_factor(spec)  # host figures, then the emulated wait
    peak = spec.peak_tflops(dtype) * 1e12 * slowdown
    bandwidth = spec.memory_bandwidth_gbps * 1e9 * slowdown * efficiency.memory
    flops, nbytes = op.flops, op.bytes(dtype)
    if op.name == "elementwise":  # the layers' norms, RoPE, SwiGLU and residual adds
        nbytes *= efficiency.elementwise_traffic
    if op.kind == "attention":
        flops *= CAUSAL_ATTENTION_WORK * (ATTENTION_BACKWARD_FACTOR if backward else 1.0)
        nbytes *= 2.0 if backward else 1.0
        compute = flops / (peak * efficiency.attention)
    else:
        if backward:
            flops, nbytes = op.backward_factor * flops, op.backward_factor * nbytes
        compute = flops / (peak * efficiency.gemm) if flops else 0.0
    return max(compute, nbytes / bandwidth) * slowdown


def ops_time(
    ops: Iterable[Op],
    spec: AcceleratorSpec,
    dtype: str,
    efficiency: Efficiency = DEFAULT_EFFICIENCY,
) -> tuple[float, float]:
    """(forward, backward) roofline seconds of a list of kernels."""
    ops = list(ops)
    return (
        sum(op_time(op, spec, dtype, efficiency) for op in ops),
        sum(op_time(op, spec, dtype, efficiency, backward=True) for op in ops),
    )


def _between_blocks(shape: LayerShape, sequence_parallel: bool) -> int:
    """Tokens per rank between the TP blocks: all of them, or ``1/tp`` under sequence
    parallelism (the plan validation makes tp divide the sequence)."""
    if sequence_parallel and shape.tp > 1:
        return shape.micro_batch * (shape.seq // shape.tp)
    return shape.tokens


def layer_activation_bytes(
    shape: LayerShape,
    dtype: str,
    sequence_parallel: bool = False,
    attention_kernel: str = "flash",
    tp_comm_overlap: bool = False,
    part: str | None = None,
) -> float:
    """Bytes one layer keeps for its backward per micro-batch on one TP rank (no recompute):
    what :class:`~megatron_het.model.llama.DecoderLayer` saves, tensor for tensor.

    Saved tensors: both norms' inputs (the residual stream, with their float32 ``1/rms``) and
    outputs (the inputs of qkv and gate/up: 4h, replicated under TP), Q/K/V after RoPE (v
    copied out of the qkv output so that it does not keep the rest alive), the attention
    output (also the projection's input), the float32 log-sum-exp of the softmax, the gate and
    up outputs and the SwiGLU output (the down projection's input).

    With ``sequence_parallel`` the norms' inputs and ``1/rms`` are ``1/tp`` of the positions
    (``[b, s/tp, h]``); the residual adds save nothing; the inputs of qkv and gate/up are the
    all-gathered ``[b, s, h]`` (the linear keeps them for its weight gradient), so they stay
    -- unless ``tp_comm_overlap`` gathers them block by block
    (:mod:`megatron_het.tensor_parallel.comm_overlap`), which keeps only the rank's own block
    and gathers it again in backward: then they are ``1/tp`` too.

    ``attention_kernel`` ``"unfused"`` (:func:`attention_ops`) keeps no log-sum-exp but, per
    score element, the softmax's probabilities (its backward reads them), the dropout's uint8
    mask and the dropped probabilities (the context bmm's saved input).

    ``part`` ("attention" or "mlp") counts one block of the layer only (a stage whose bound
    splits the layer): its norm, its GEMMs' inputs and what lies between them.
    """
    if part is None:
        return sum(
            layer_activation_bytes(
                shape, dtype, sequence_parallel, attention_kernel, tp_comm_overlap, p
            )
            for p in ("attention", "mlp")
        )
    t, h, tp = shape.tokens, shape.hidden, shape.tp
    local = _between_blocks(shape, sequence_parallel)
    q = shape.heads * shape.head_dim // tp
    kv = shape.kv_groups * shape.head_dim // tp
    f = shape.ffn // tp
    gemm_inputs = local if sequence_parallel and tp_comm_overlap else t
    norm = local * h + gemm_inputs * h  # the norm's input and output (the GEMMs' input)
    if part == "mlp":
        return (norm + t * 3 * f) * dtype_bytes(dtype) + local * FP32_BYTES
    elements = norm + t * (q + 2 * kv + q)
    if attention_kernel == "unfused":
        scores = shape.micro_batch * (shape.heads // tp) * shape.seq * shape.seq
        return (
            (elements + 2 * scores) * dtype_bytes(dtype)
            + DROPOUT_MASK_BYTES * scores
            + local * FP32_BYTES
        )  # 1/rms
    floats = t * (shape.heads // tp) + local  # log-sum-exp per head, 1/rms
    return elements * dtype_bytes(dtype) + floats * FP32_BYTES


def layer_input_bytes(shape: LayerShape, dtype: str, sequence_parallel: bool = False) -> float:
    """Bytes of one layer's input per micro-batch: all recompute keeps of a layer (``1/tp``
    of the positions under sequence parallelism)."""
    return _between_blocks(shape, sequence_parallel) * shape.hidden * dtype_bytes(dtype)


def head_activation_bytes(
    shape: LayerShape, vocab: int, dtype: str, sequence_parallel: bool = False
) -> float:
    """What the fused head (final norm + output layer + cross-entropy,
    :mod:`megatron_het.model.loss`) keeps per micro-batch until its backward: the final norm's
    input with its float32 ``1/rms`` (``1/tp`` of the positions under sequence parallelism),
    and the gradients the fused loss computes in its forward, of the hidden states
    (``[tokens, hidden]``, all of them: the loss reads the gathered sequence) and of the output
    weight (float32, ``[vocab / tp, hidden]``: it is added into the float32 main gradient in
    backward)."""
    t, h = shape.tokens, shape.hidden
    local = _between_blocks(shape, sequence_parallel)
    return (local + t) * h * dtype_bytes(dtype) + (local + vocab / shape.tp * h) * FP32_BYTES


def head_chunk_bytes(shape: LayerShape, vocab: int, device_type: str) -> float:
    """Transient bytes of the fused head's forward: one chunk's float32 logits and a
    low-precision copy of its softmax gradient (~1.5x the chunk; the chunk fills the device's
    budget of :mod:`megatron_het.model.loss` or holds every token)."""
    from megatron_het.model.loss import default_chunk_tokens

    rows = vocab / shape.tp
    tokens = min(shape.tokens, default_chunk_tokens(int(rows), device_type))
    return 1.5 * tokens * rows * FP32_BYTES
