"""``pretrain_llama.py``'s Megatron-style command line -> frozen configs.

Flag names follow Megatron-LM where it has one. The model shape comes from ``--model PRESET``
with explicit shape flags overriding the preset's fields, or from the shape flags alone. The
vocabulary is only known once the tokenizer is loaded, so parsing yields a :class:`ModelSpec` and
:func:`resolve_model_config` turns it into a :class:`ModelConfig`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_het.arguments_io import add_io_flags, fault_config
from megatron_het.cli_args import ArgParser, add_shape_flags, integer_shape_dests, shape_overrides
from megatron_het.config import (
    MODEL_PRESETS,
    DataConfig,
    FaultConfig,
    ModelConfig,
    OptimizerConfig,
    TrainConfig,
    model_preset,
)
from megatron_het.errors import UserError
from megatron_het.optim.lr_schedule import DECAY_STYLES, LRSchedule

PROG = "pretrain_llama.py"


@dataclass(frozen=True)
class ModelSpec:
    """The model as the command line describes it, before the vocabulary is known.

    ``overrides`` maps ModelConfig fields to values given explicitly by shape flags.
    ``vocab_size`` is the exact model vocabulary (``--vocab-size`` with a tokenizer other than
    NullTokenizer), else None: the preset's, or the tokenizer's padded to a multiple of
    ``make_vocab_size_divisible_by``.
    """

    preset: str | None
    overrides: dict[str, Any] = field(default_factory=dict)
    make_vocab_size_divisible_by: int = 128
    vocab_size: int | None = None


BRIDGES = ("relay", "direct")


@dataclass(frozen=True)
class ParallelSpec:
    """How the run is spread over ranks, as the command line says it.

    ``plan`` is a plan file path, "auto" (search one at start-up) or None (Megatron's
    ``tensor/pipeline_model_parallel_size`` flags, data parallelism implied by the world size).
    ``cluster`` is a cluster YAML path; None means one node of this machine's kind ("cpu", or
    the built-in kind of its GPU).
    ``batch_given`` records whether --micro-batch-size / --global-batch-size were on the
    command line (a plan file supplies them otherwise).
    """

    cluster: str | None = None
    plan: str | None = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    virtual_pipeline_model_parallel_size: int | None = None
    pipeline_model_parallel_layout: str | None = None
    use_distributed_optimizer: bool = False
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_in_bf16: bool = False
    ddp_bucket_size: int | None = None
    overlap_p2p_comm: bool = True
    recompute: tuple[str, int] | None = None  # (method, layers) of --recompute-*
    bridge: str = "relay"
    emulation_profile: str | None = None
    emulation_extra_slowdown: tuple[tuple[int, float], ...] = ()
    dry_run: bool = False
    batch_given: tuple[bool, bool] = (False, False)


@dataclass(frozen=True)
class RunConfig:
    """Everything one pretraining run is configured with."""

    model: ModelSpec
    data: DataConfig
    optimizer: OptimizerConfig
    train: TrainConfig
    argv: tuple[str, ...] = ()
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    faults: FaultConfig = field(default_factory=FaultConfig)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=None,
        metavar="PRESET",
        help=f"model preset ({', '.join(sorted(MODEL_PRESETS))}); shape flags "
        "given explicitly override its fields",
    )
    add_shape_flags(g, common_only=False)
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        help="accepted for Megatron compatibility; --num-query-groups always applies",
    )
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="separate output matrix; without it a preset decides, and a model "
        "built from shape flags alone is tied (Megatron's default)",
    )
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the tokenizer's vocabulary up to a multiple of this (default 128)",
    )


def _add_training_flags(p: argparse.ArgumentParser) -> None:
    t, o = TrainConfig(), OptimizerConfig()
    g = p.add_argument_group("training")
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help=f"sequences per micro-batch (default: a --plan file's, else {t.micro_batch_size})",
    )
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per iteration; a multiple of --micro-batch-size (the rest is "
        "gradient accumulation); default: a --plan file's, else "
        "--micro-batch-size",
    )
    g.add_argument("--train-iters", type=int, default=t.train_iters)
    g.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="stop (after saving, with --save) once the iteration is a multiple",
    )
    g.add_argument("--seed", type=int, default=t.seed)
    g.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 weights and activations; fp32 main gradients, master weights and "
        "Adam state in the optimizer (Megatron's mixed precision)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="compile each decoder layer with torch.compile (fused kernels; the "
        "first iterations pay the compile time)",
    )
    g.add_argument(
        "--fp16",
        action="store_true",
        help="fp16 weights and activations with loss scaling; fp32 main gradients, "
        "master weights and Adam state (as --bf16)",
    )
    g.add_argument(
        "--loss-scale",
        type=float,
        default=None,
        help="fp16: a fixed loss scale (default: dynamic scaling)",
    )
    g.add_argument(
        "--initial-loss-scale",
        type=float,
        default=t.initial_loss_scale,
        help="fp16: the dynamic loss scale to start from",
    )
    g.add_argument(
        "--min-loss-scale",
        type=float,
        default=t.min_loss_scale,
        help="fp16: the smallest dynamic loss scale",
    )
    g.add_argument(
        "--loss-scale-window",
        type=int,
        default=t.loss_scale_window,
        help="fp16: steps without overflow before the dynamic scale doubles",
    )
    g.add_argument(
        "--hysteresis",
        type=int,
        default=t.hysteresis,
        help="fp16: overflowing steps that halve the dynamic scale once",
    )
    g.add_argument("--lr", type=float, default=o.lr)
    g.add_argument("--min-lr", type=float, default=o.min_lr)
    g.add_argument("--lr-decay-style", choices=DECAY_STYLES, default=o.lr_decay_style)
    g.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="iteration at which the LR reaches --min-lr (default --train-iters)",
    )
    g.add_argument("--lr-warmup-iters", type=int, default=o.lr_warmup_iters)
    g.add_argument(
        "--weight-decay",
        type=float,
        default=o.weight_decay,
        help="AdamW decay on >= 2-D weights; norms (1-D) get none",
    )
    g.add_argument("--adam-beta1", type=float, default=o.adam_beta1)
    g.add_argument("--adam-beta2", type=float, default=o.adam_beta2)
    g.add_argument("--adam-eps", type=float, default=o.adam_eps)
    g.add_argument(
        "--clip-grad",
        type=float,
        default=o.clip_grad,
        help="global gradient-norm limit; 0 disables clipping",
    )


def _add_data_flags(p: argparse.ArgumentParser) -> None:
    d = DataConfig()
    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="+",
        default=None,
        help="dataset prefixes (PREFIX.bin/.idx), or weight prefix pairs to blend",
    )
    g.add_argument(
        "--mock-data",
        action="store_true",
        help="synthetic uniformly random tokens instead of --data-path",
    )
    g.add_argument("--split", default=d.split, help="train,valid,test document proportions")
    g.add_argument("--seq-length", type=int, default=d.seq_length)
    g.add_argument(
        "--tokenizer-type",
        default=d.tokenizer_type,
        help="SentencePieceTokenizer (needs --tokenizer-model) or NullTokenizer "
        "(needs --vocab-size)",
    )
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer: token ids in the data (its eod id is this value); other "
        "tokenizers: the model's exact vocabulary (>= the tokenizer's)",
    )


def _add_parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (launch with torchrun; see --dry-run)")
    g.add_argument(
        "--cluster",
        default=None,
        metavar="YAML",
        help="cluster description (accelerator of every rank); default: one node "
        "of this machine's kind (cpu, or its GPU's built-in kind)",
    )
    g.add_argument(
        "--plan",
        default=None,
        metavar="PLAN.json|auto",
        help="parallel plan file, or 'auto' to search the fastest plan for the "
        "cluster at start-up; excludes the Megatron parallel-size flags",
    )
    g.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        metavar="TP",
        help="uniform plan: TP degree of every stage (data parallelism is the world "
        "size / (TP x PP))",
    )
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="PP")
    g.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        metavar="N",
        help="uniform plan: layers of the first stage (the rest split evenly)",
    )
    g.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        metavar="N",
        help="uniform plan: layers of the last stage",
    )
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        metavar="N",
        help="uniform plan: interleave model chunks of N layers "
        "round-robin over the pipeline ranks (interleaved 1F1B)",
    )
    g.add_argument(
        "--virtual-pipeline-model-parallel-size",
        type=int,
        default=None,
        metavar="V",
        help="uniform plan: V interleaved model chunks per pipeline "
        "rank (the other way to say the same)",
    )
    g.add_argument(
        "--pipeline-model-parallel-layout",
        default=None,
        metavar="LAYOUT",
        help="uniform plan: every stage's layers as Megatron writes them, e.g. "
        "'Et*2|t*3|t*3|t*2L' (stage i on pipeline rank i mod PP)",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="shard the regions between TP blocks (norms, residuals, stage "
        "boundaries) along the sequence; needs --seq-length divisible by tp",
    )
    g.add_argument(
        "--tp-comm-overlap",
        action="store_true",
        help="with --sequence-parallel: run each TP block's sequence all-gather "
        "and reduce-scatter as rings of point-to-point steps, each beside the "
        "GEMM of the block already at hand",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        default=None,
        help="full: recompute decoder layers' activations in backward, keeping "
        "only their inputs, on every stage of the plan (with "
        "--recompute-method and --recompute-num-layers)",
    )
    g.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        default=None,
        help="with --recompute-granularity full: uniform recomputes every layer "
        "(--recompute-num-layers 1); block only the first "
        "--recompute-num-layers layers of each stage (model chunk)",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        metavar="N",
        help="layers per recomputed group (uniform: 1) or recomputed per stage (block)",
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="shard the optimizer state over data-parallel replicas (ZeRO-1)",
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="start each gradient bucket's data-parallel reduction (asynchronously) "
        "as soon as its last gradient of the iteration is in, while backward "
        "goes on",
    )
    g.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="with --use-distributed-optimizer: leave the all-gather of the updated "
        "parameters running into the next forward, each layer waiting only for "
        "its own buckets",
    )
    g.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="with --bf16: reduce gradients over data-parallel replicas in bf16 "
        "(half the bytes) instead of fp32; accumulation stays fp32",
    )
    g.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        metavar="N",
        help="parameters per data-parallel gradient bucket (default: 25 MiB of "
        "float32 gradients, 6,553,600 parameters); each bucket is reduced as "
        "one collective",
    )
    g.add_argument(
        "--no-overlap-p2p-communication",
        action="store_false",
        dest="overlap_p2p_comm",
        help="interleaved pipelines: wait for every stage-boundary exchange before "
        "the next compute (by default transfers are posted without waiting and "
        "overlap the forward or backward that follows)",
    )
    g.add_argument(
        "--bridge",
        choices=BRIDGES,
        default="relay",
        help="traffic between accelerator kinds: relay (host staging) or direct",
    )
    g.add_argument(
        "--emulation-profile",
        default=None,
        metavar="PROFILE.json",
        help="EMULATION: emulated ranks time each stage forward and backward as "
        "their slowdown x this profile's figures for the stage (a one-thread "
        "profile of this host from tools/profile_device.py --threads 1) "
        "instead of x the measured CPU time, so emulated kinds keep one speed "
        "while the host's drifts; --plan auto and --dry-run's prediction use "
        "the same figures",
    )
    g.add_argument(
        "--emulation-extra-slowdown",
        action="append",
        default=[],
        metavar="RANK=FACTOR",
        help="EMULATION: make emulated rank RANK FACTOR times slower than its kind "
        "(a straggler for --log-straggler to find); repeatable",
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="check plan, cluster, model and batch together, print the plan and its "
        "predicted iteration time, and exit without starting processes",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``pretrain_llama.py`` parser; its errors raise UserError instead of exiting."""
    p = ArgParser(prog=PROG, description="Pretrain a Llama model (Megatron-style flags).")
    for add in (
        _add_model_flags,
        _add_training_flags,
        _add_data_flags,
        add_io_flags,
        _add_parallel_flags,
    ):
        add(p)
    return p


def _check_positive(args: argparse.Namespace, names: Sequence[str], minimum: int = 1) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < minimum:
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{flag} must be at least {minimum}, got {value}")


def _validate(args: argparse.Namespace) -> None:
    _check_positive(
        args,
        (
            "micro_batch_size",
            "global_batch_size",
            "train_iters",
            "seq_length",
            "log_interval",
            "eval_interval",
            "save_interval",
            "exit_interval",
            "make_vocab_size_divisible_by",
            *integer_shape_dests(),
        ),
    )
    _check_positive(args, ("eval_iters", "lr_warmup_iters"), minimum=0)
    if args.global_batch_size % args.micro_batch_size:
        raise UserError(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size {args.micro_batch_size}; use a multiple of it"
        )
    if args.fp16 and args.bf16:
        raise UserError("--fp16 and --bf16 both set the training dtype; keep one")
    if not args.mock_data and not args.data_path:
        raise UserError("no training data: pass --data-path PREFIX [PREFIX ...] or --mock-data")
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None:
            raise UserError("--tokenizer-type NullTokenizer needs --vocab-size N")
    elif not args.tokenizer_model:
        raise UserError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model PATH")
    if args.save_interval is not None and not args.save:
        raise UserError("--save-interval needs --save DIR")
    if args.async_save and not args.save:
        raise UserError("--async-save needs --save DIR")


def _model_spec(args: argparse.Namespace) -> ModelSpec:
    overrides = shape_overrides(args)
    if args.untie_embeddings_and_output_weights:
        overrides["tie_embeddings"] = False
    exact_vocab = args.vocab_size if args.tokenizer_type != "NullTokenizer" else None
    return ModelSpec(
        preset=args.model,
        overrides=overrides,
        vocab_size=exact_vocab,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )


def parse_run_config(argv: Sequence[str]) -> RunConfig:
    """Parse ``argv`` (without the program name) into a validated :class:`RunConfig`.

    Checks everything that needs no file: flag values, batch divisibility, the model shape
    (with a placeholder vocabulary) against ``--seq-length``, and the LR schedule. Raises
    UserError with one line on any problem.
    """
    args = build_parser().parse_args(list(argv))
    batch_given = (args.micro_batch_size is not None, args.global_batch_size is not None)
    if args.micro_batch_size is None:
        args.micro_batch_size = TrainConfig().micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size
    _validate(args)
    parallel = _parallel_spec(args, batch_given)
    spec = _model_spec(args)
    resolve_model_config(spec, tokenizer_vocab_size=1, seq_length=args.seq_length)
    data = DataConfig(
        data_path=tuple(args.data_path or ()),
        split=args.split,
        seq_length=args.seq_length,
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        seed=args.seed,
        mock_data=args.mock_data,
    )
    optimizer = OptimizerConfig(
        lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        lr_decay_iters=args.lr_decay_iters,
        lr_warmup_iters=args.lr_warmup_iters,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
    )
    LRSchedule.from_config(optimizer, args.train_iters)  # validates the schedule
    train = TrainConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        train_iters=args.train_iters,
        exit_interval=args.exit_interval,
        bf16=args.bf16,
        fp16=args.fp16,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        compile=args.compile,
        seed=args.seed,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        log_interval=args.log_interval,
        save=args.save,
        load=args.load,
        save_interval=args.save_interval,
        tensorboard_dir=args.tensorboard_dir,
        metrics_file=args.metrics_file,
    )
    return RunConfig(
        model=spec,
        data=data,
        optimizer=optimizer,
        train=train,
        argv=tuple(argv),
        parallel=parallel,
        faults=fault_config(args),
    )


def _parallel_spec(args: argparse.Namespace, batch_given: tuple[bool, bool]) -> ParallelSpec:
    _check_positive(args, ("tensor_model_parallel_size", "pipeline_model_parallel_size"))
    _check_positive(
        args, ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"), minimum=0
    )
    _check_positive(
        args,
        (
            "num_layers_per_virtual_pipeline_stage",
            "virtual_pipeline_model_parallel_size",
            "ddp_bucket_size",
        ),
    )
    megatron_flags = [
        flag
        for flag, value in (
            ("--tensor-model-parallel-size", args.tensor_model_parallel_size != 1),
            ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size != 1),
            (
                "--decoder-first-pipeline-num-layers",
                args.decoder_first_pipeline_num_layers is not None,
            ),
            (
                "--decoder-last-pipeline-num-layers",
                args.decoder_last_pipeline_num_layers is not None,
            ),
            (
                "--num-layers-per-virtual-pipeline-stage",
                args.num_layers_per_virtual_pipeline_stage is not None,
            ),
            (
                "--virtual-pipeline-model-parallel-size",
                args.virtual_pipeline_model_parallel_size is not None,
            ),
            ("--pipeline-model-parallel-layout", args.pipeline_model_parallel_layout is not None),
        )
        if value
    ]
    if args.plan is not None and megatron_flags:
        raise UserError(
            f"--plan and {megatron_flags[0]} both describe the layout; the plan "
            f"file already fixes TP and PP, so drop {megatron_flags[0]}"
        )
    return ParallelSpec(
        cluster=args.cluster,
        plan=args.plan,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        use_distributed_optimizer=args.use_distributed_optimizer,
        sequence_parallel=args.sequence_parallel,
        tp_comm_overlap=args.tp_comm_overlap,
        recompute=_recompute(args),
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
        ddp_bucket_size=args.ddp_bucket_size,
        overlap_p2p_comm=args.overlap_p2p_comm,
        bridge=args.bridge,
        emulation_profile=args.emulation_profile,
        emulation_extra_slowdown=_extra_slowdowns(args.emulation_extra_slowdown),
        dry_run=args.dry_run,
        batch_given=batch_given,
    )


def _recompute(args: argparse.Namespace) -> tuple[str, int] | None:
    """(method, layers) from Megatron's --recompute-* flags, or None."""
    granularity, method, count = (
        args.recompute_granularity,
        args.recompute_method,
        args.recompute_num_layers,
    )
    if granularity is None:
        if method is not None or count is not None:
            raise UserError(
                "--recompute-method and --recompute-num-layers need --recompute-granularity full"
            )
        return None
    if granularity == "selective":
        raise UserError(
            "--recompute-granularity selective recomputes the core attention, "
            "which the flash attention kernel here never stores; use full "
            "(with --recompute-method block to recompute only some layers)"
        )
    if method is None or count is None:
        raise UserError(
            "--recompute-granularity full needs --recompute-method (uniform or "
            "block) and --recompute-num-layers N"
        )
    if count < 1:
        raise UserError(f"--recompute-num-layers must be at least 1, got {count}")
    if method == "uniform" and count != 1:
        raise UserError(
            f"--recompute-method uniform with --recompute-num-layers {count} "
            f"(one checkpoint per {count} layers) is not supported: use 1 (every "
            f"layer recomputed from its own input) or --recompute-method block"
        )
    return method, count


def _extra_slowdowns(values: Sequence[str]) -> tuple[tuple[int, float], ...]:
    pairs = []
    for value in values:
        rank, _, factor = value.partition("=")
        try:
            pair = (int(rank), float(factor))
        except ValueError:
            pair = (-1, 0.0)
        if pair[0] < 0 or not pair[1] >= 1.0:
            raise UserError(
                f"--emulation-extra-slowdown {value}: expected RANK=FACTOR with a "
                "rank >= 0 and a factor >= 1, e.g. 2=1.5"
            )
        pairs.append(pair)
    return tuple(pairs)


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (Megatron's vocab padding)."""
    return int(math.ceil(vocab_size / multiple) * multiple)


def _base_fields(spec: ModelSpec) -> dict[str, Any]:
    if spec.preset is not None:
        return model_preset(spec.preset).to_dict()
    missing = [
        flag
        for flag, name in (
            ("--num-layers", "num_layers"),
            ("--hidden-size", "hidden_size"),
            ("--num-attention-heads", "num_attention_heads"),
        )
        if name not in spec.overrides
    ]
    if missing:
        raise UserError(f"no model shape: pass --model PRESET or {', '.join(missing)}")
    hidden = spec.overrides["hidden_size"]
    return {
        "name": "custom",
        "ffn_hidden_size": 4 * hidden,
        "tie_embeddings": True,
        "num_query_groups": spec.overrides["num_attention_heads"],
    }


def resolve_model_config(
    spec: ModelSpec, tokenizer_vocab_size: int, seq_length: int
) -> ModelConfig:
    """The ModelConfig for ``spec`` once the tokenizer's vocabulary size is known.

    Vocabulary: ``spec.vocab_size`` if set, else the preset's, else the tokenizer's padded to
    ``spec.make_vocab_size_divisible_by``; it must hold every tokenizer id. Without a preset,
    ``max_position_embeddings`` defaults to ``seq_length``. Raises UserError for a shape that
    does not work or a ``seq_length`` beyond the model's positions.
    """
    fields = _base_fields(spec)
    fields.update(spec.overrides)
    fields.setdefault("max_position_embeddings", seq_length)
    if spec.vocab_size is not None:
        vocab, source = spec.vocab_size, f"--vocab-size {spec.vocab_size}"
    elif spec.preset is not None:
        vocab, source = fields["vocab_size"], f"--model {spec.preset}"
    else:
        vocab = padded_vocab_size(tokenizer_vocab_size, spec.make_vocab_size_divisible_by)
        source = "padded tokenizer vocabulary"
    if vocab < tokenizer_vocab_size:
        hint = (
            "pass --vocab-size of at least that"
            if spec.preset is not None and spec.vocab_size is None
            else "raise --vocab-size"
        )
        raise UserError(
            f"{source} gives a {vocab}-token model vocabulary but the tokenizer has "
            f"{tokenizer_vocab_size} tokens; {hint}, or use a model whose "
            "vocabulary holds the tokenizer's"
        )
    fields["vocab_size"] = vocab
    config = ModelConfig.from_dict(fields)
    if seq_length > config.max_position_embeddings:
        raise UserError(
            f"--seq-length {seq_length} exceeds the model's "
            f"--max-position-embeddings {config.max_position_embeddings}; lower "
            "--seq-length or raise --max-position-embeddings"
        )
    return config
