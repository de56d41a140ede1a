"""Frozen configuration dataclasses and model presets.

Every component receives the config objects it needs explicitly; nothing reads argv or the
environment here (:mod:`megatron_het.arguments` is the only place that parses the command line).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_het.errors import UserError


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent RoPE scaling."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama decoder.

    ``num_query_groups`` is the number of key/value heads (GQA); it equals
    ``num_attention_heads`` for plain multi-head attention.
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_method_std: float = 0.02
    name: str = "custom"

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kv_channels(self) -> int:
        """Per-head dimension."""
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        positive = (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "vocab_size",
            "max_position_embeddings",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise UserError(f"model: {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise UserError(
                f"model: --num-attention-heads {self.num_attention_heads} does not divide "
                f"--hidden-size {self.hidden_size}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise UserError(
                f"model: --num-query-groups {self.num_query_groups} does not divide "
                f"--num-attention-heads {self.num_attention_heads}"
            )
        if self.kv_channels % 2:
            raise UserError(f"model: head dimension {self.kv_channels} must be even for RoPE")

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    # ---- size and cost -------------------------------------------------------------------
    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Exact parameter count of the model built from this config."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.kv_channels
        q = self.num_attention_heads * d
        kv = self.num_query_groups * d
        attn = h * (q + 2 * kv) + q * h
        mlp = 3 * h * f
        norms = 2 * h
        per_layer = attn + mlp + norms
        total = self.num_layers * per_layer + h  # final norm
        if include_embeddings:
            total += self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return total

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token (forward + backward), Megatron-LM's formula.

        Follows ``num_floating_point_operations`` in Megatron-LM's training.py: GEMMs count
        2 FLOPs per multiply-add, backward costs twice the forward, attention scores count the
        full (not causal-halved) S x S product, SwiGLU adds a third MLP matrix, and the output
        layer is included. No activation recompute is counted.
        """
        h, L = self.hidden_size, self.num_layers
        q_ratio = self.num_attention_heads * self.kv_channels / h
        attention = (
            1 + self.num_query_groups / self.num_attention_heads + seq_length / h
        ) * q_ratio
        mlp = (self.ffn_hidden_size / h) * 1.5
        logits = self.vocab_size / (2 * L * h)
        return 12.0 * L * h * h * (attention + mlp + logits)


def _llama2(name: str, layers: int, hidden: int, ffn: int, heads: int, groups: int) -> ModelConfig:
    return ModelConfig(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=groups,
        vocab_size=32000,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        norm_eps=1e-5,
    )


def _llama3(name: str, layers: int, hidden: int, ffn: int, heads: int, groups: int) -> ModelConfig:
    return ModelConfig(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=groups,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        norm_eps=1e-5,
    )


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Test-sized models: vocabulary 512 covers the tests' synthetic token ids.
    "tiny": ModelConfig(
        name="tiny",
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=176,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=512,
        max_position_embeddings=256,
    ),
    "tiny-tied": ModelConfig(
        name="tiny-tied",
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=176,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=512,
        max_position_embeddings=256,
        tie_embeddings=True,
    ),
    # The demo model (~8M parameters with a 4k vocabulary): trains in minutes on a CPU.
    "small": ModelConfig(
        name="small",
        num_layers=4,
        hidden_size=256,
        ffn_hidden_size=688,
        num_attention_heads=8,
        num_query_groups=4,
        vocab_size=4096,
        max_position_embeddings=1024,
    ),
    "llama2-7b": _llama2("llama2-7b", 32, 4096, 11008, 32, 32),
    "llama2-13b": _llama2("llama2-13b", 40, 5120, 13824, 40, 40),
    "llama2-70b": _llama2("llama2-70b", 80, 8192, 28672, 64, 8),
    "llama3-8b": _llama3("llama3-8b", 32, 4096, 14336, 32, 8),
    "llama3-70b": _llama3("llama3-70b", 80, 8192, 28672, 64, 8),
    # The HETHUB paper trains a "Llama-140B" whose shape it does not publish. This shape is
    # our choice: 88 layers of a 12288-wide Llama-2-style decoder with 8 KV heads, which gives
    # about 139B parameters (see ModelConfig.num_parameters).
    "llama-140b": ModelConfig(
        name="llama-140b",
        num_layers=88,
        hidden_size=12288,
        ffn_hidden_size=33792,
        num_attention_heads=96,
        num_query_groups=8,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
}


def model_preset(name: str) -> ModelConfig:
    """The preset called ``name``; a clear error lists the known ones."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise UserError(
            f"unknown --model {name!r}; known presets: {', '.join(sorted(MODEL_PRESETS))}"
        ) from None


@dataclass(frozen=True)
class DataConfig:
    """Where training tokens come from.

    ``data_path`` is Megatron's list: either prefixes, or alternating weight/prefix pairs
    (``["0.3", "a", "0.7", "b"]``) for blending.
    """

    data_path: tuple[str, ...] = ()
    split: str = "969,30,1"
    seq_length: int = 128
    tokenizer_type: str = "SentencePieceTokenizer"
    tokenizer_model: str | None = None
    vocab_size: int | None = None  # NullTokenizer only
    seed: int = 1234
    mock_data: bool = False


@dataclass(frozen=True)
class FaultConfig:
    """How a run meets faults (Megatron's flag names where it has them).

    ``distributed_timeout_minutes`` bounds every wait on a peer (collectives, p2p, barriers,
    start-up, checkpoint commits); ``async_save`` writes checkpoints from a background thread;
    ``log_straggler`` names ranks slower than their kind's median by more than
    ``straggler_threshold`` (a fraction); ``skip_nonfinite_steps`` skips an iteration whose loss
    or gradient norm is not finite instead of stopping the run.
    """

    distributed_timeout_minutes: float = 10.0
    async_save: bool = False
    log_straggler: bool = False
    straggler_threshold: float = 0.2
    skip_nonfinite_steps: bool = False


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    lr_decay_iters: int | None = None
    lr_warmup_iters: int = 0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass(frozen=True)
class ProfileConfig:
    """Megatron-LM's profiling flags: ``--profile`` records iterations ``step_start`` to
    ``step_end - 1`` (the log's iteration numbers) on the world ranks ``ranks`` into
    ``--tensorboard-dir``: the run's own merged timeline of those ranks
    (:mod:`megatron_het.training.timeline`), or with ``use_pytorch_profiler`` torch.profiler's
    trace of each (:mod:`megatron_het.training.profiling`)."""

    enabled: bool = False
    step_start: int = 10
    step_end: int = 12
    ranks: tuple[int, ...] = (0,)
    use_pytorch_profiler: bool = False


@dataclass(frozen=True)
class WandbConfig:
    """Megatron-LM's Weights & Biases flags: with ``project`` set, the logging rank logs the
    run's scalars (the ones tensorboard gets) to a wandb run named ``exp_name`` whose files go
    to ``save_dir`` (default ``<--save>/wandb``) (:mod:`megatron_het.training.wandb_log`)."""

    project: str | None = None
    exp_name: str | None = None
    save_dir: str | None = None
    entity: str | None = None


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 1
    train_iters: int = 100
    exit_interval: int | None = None
    bf16: bool = False
    fp16: bool = False
    # fp16 loss scaling (Megatron's flags): a fixed --loss-scale, else dynamic from the initial.
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    compile: bool = False
    # Fused kernels (megatron_het.kernels.selection.KernelChoice): each op family's on/off.
    rope_fusion: bool = True
    rms_norm_fusion: bool = True
    cross_entropy_loss_fusion: bool = True
    bias_swiglu_fusion: bool = True
    gradient_accumulation_fusion: bool = True
    reference_kernels: bool = False
    seed: int = 1234
    eval_interval: int = 1000
    eval_iters: int = 10
    log_interval: int = 10
    save: str | None = None
    load: str | None = None
    # What --load restores, as Megatron-LM's flags of these names (training/checkpointing.py).
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    use_checkpoint_args: bool = False
    save_interval: int | None = None
    tensorboard_dir: str | None = None
    metrics_file: str | None = None
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    extra: dict[str, Any] = field(default_factory=dict)


# The options a plan file may set, as ParallelPlan's keys and RunOptions' fields of those names.
PLAN_OPTION_KEYS = (
    "dtype",
    "use_distributed_optimizer",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "grad_reduce_in_bf16",
    "overlap_p2p_comm",
)


@dataclass(frozen=True)
class RunOptions:
    """How a run executes its plan's layout, beyond the layout itself.

    A run resolves them once, from its flags and its plan
    (:func:`megatron_het.arguments.options.resolve_run_options`), and hands the same object to
    the trainer, the predictor and the dry run. Names and meanings are Megatron-LM's flags':
    ``dtype`` the training precision ("fp32", "bf16", "fp16"), ZeRO-1
    (``use_distributed_optimizer``), the DP reduction started during backward
    (``overlap_grad_reduce``) in buckets of ``ddp_bucket_size`` parameters (None: 25 MiB of
    float32 gradients) and in bf16 (``grad_reduce_in_bf16``), ZeRO-1's parameter all-gather
    left running into the next forward (``overlap_param_gather``), interleaved pipelines'
    transfers overlapped with compute (``overlap_p2p_comm``). ``fused_elementwise`` is
    ``--compile``: decoder layers whose elementwise work is fused (eager ones move more bytes).

    The defaults are the predictor's for a plan that says nothing (bf16, fused layers, as the
    published runs it is calibrated on); a run always sets ``dtype`` and ``fused_elementwise``.
    Sequence parallelism, its TP overlap and recompute are part of the plan's layout
    (``ParallelPlan.sequence_parallel``, ``tp_comm_overlap``, a stage's ``recompute``).
    """

    dtype: str = "bf16"
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_in_bf16: bool = False
    overlap_p2p_comm: bool = True
    ddp_bucket_size: int | None = None
    fused_elementwise: bool = True

    @classmethod
    def from_plan(cls, plan: Any, **given: Any) -> RunOptions:
        """What ``plan`` (a :class:`~megatron_het.parallel.plan.ParallelPlan`, read by its keys
        so that this module stays below the plan's) says, the defaults where it says nothing,
        then ``given`` (a what-if: each replaces the plan's value; no command line involved)."""
        said = {key: getattr(plan, key) for key in PLAN_OPTION_KEYS}
        return cls(**{**{k: v for k, v in said.items() if v is not None}, **given})

    def replace(self, **changes: Any) -> RunOptions:
        return dataclasses.replace(self, **changes)
