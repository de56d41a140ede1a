"""``pretrain_llama.py``'s command line -> one frozen :class:`RunConfig`, parsed and checked once.

Everything that needs no file is checked here (flag values, batch divisibility, the model shape
with a placeholder vocabulary, the LR schedule); what needs files (the tokenizer, the plan, the
cluster, the data, a checkpoint) is checked by :func:`megatron_het.training.setup.prepare_run`.
The flags are kept as given: the options a run executes with are resolved once, with the plan,
by :func:`megatron_het.arguments.options.resolve_run_options`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_het.arguments.io_flags import fault_config, profile_config, wandb_config
from megatron_het.arguments.model_flags import ModelSpec, resolve_model_config
from megatron_het.arguments.parser import integer_shape_dests, shape_overrides
from megatron_het.arguments.pretrain_flags import build_parser
from megatron_het.config import DataConfig, FaultConfig, OptimizerConfig, TrainConfig
from megatron_het.errors import UserError
from megatron_het.optim.lr_schedule import LRSchedule


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
    for flag in ("finetune", "no_load_optim", "no_load_rng", "use_checkpoint_args"):
        if getattr(args, flag) and not args.load:
            raise UserError(f"--{flag.replace('_', '-')} needs --load DIR")


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
    if not args.use_checkpoint_args:  # else the checkpoint completes the shape, at start-up
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
        rope_fusion=args.rope_fusion,
        rms_norm_fusion=args.rms_norm_fusion,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        bias_swiglu_fusion=args.bias_swiglu_fusion,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        reference_kernels=args.reference_kernels,
        seed=args.seed,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        log_interval=args.log_interval,
        save=args.save,
        load=args.load,
        finetune=args.finetune,
        no_load_optim=args.no_load_optim,
        no_load_rng=args.no_load_rng,
        use_checkpoint_args=args.use_checkpoint_args,
        save_interval=args.save_interval,
        tensorboard_dir=args.tensorboard_dir,
        metrics_file=args.metrics_file,
        profile=profile_config(args),
        wandb=wandb_config(args),
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
