"""``pretrain_llama.py``'s flags for checkpoints, logging and faults (Megatron's names where it
has them) -> :class:`~megatron_het.config.FaultConfig` and the I/O fields of TrainConfig."""

from __future__ import annotations

import argparse

from megatron_het.config import FaultConfig, ProfileConfig, TrainConfig, WandbConfig
from megatron_het.errors import UserError


def add_io_flags(p: argparse.ArgumentParser) -> None:
    """Checkpoint, logging and fault flags."""
    t, f = TrainConfig(), FaultConfig()
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--save", default=None, help="checkpoint directory to write")
    g.add_argument(
        "--load",
        default=None,
        help="checkpoint to resume from: a --save directory (its latest iteration) "
        "or one iter_XXXXXXX directory, of this trainer or of Megatron-LM "
        "(--ckpt-format torch or torch_dist, converted onto this run's plan as it "
        "loads). A model-only checkpoint (e.g. converted weights) starts a fresh "
        "optimizer at iteration 0, and so does a Megatron-LM one whose optimizer state "
        "cannot be carried (only torch_dist saves keep it by parameter) unless "
        "--no-load-optim is given. When --load equals --save and holds no checkpoint "
        "yet, training starts from scratch",
    )
    g.add_argument(
        "--finetune",
        action="store_true",
        help="load the model weights only: start at iteration 0 and sample 0 with a "
        "fresh optimizer, LR schedule and loss scale, and the RNG of --seed",
    )
    g.add_argument(
        "--no-load-optim",
        action="store_true",
        help="do not load the optimizer state (Adam moments, loss scale) nor the LR "
        "schedule's position: continue at the checkpoint's iteration and data "
        "position with a fresh optimizer whose LR schedule starts over there",
    )
    g.add_argument(
        "--no-load-rng",
        action="store_true",
        help="do not load the random generators' state; they start from --seed",
    )
    g.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="take the model's shape from the --load checkpoint; shape flags given "
        "must agree with it",
    )
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument(
        "--async-save",
        action="store_true",
        help="write checkpoints from a background thread while training goes on; "
        "an iteration is committed (renamed, recorded as the latest) once "
        "every rank's files are complete",
    )
    g.add_argument("--eval-interval", type=int, default=t.eval_interval)
    g.add_argument(
        "--eval-iters",
        type=int,
        default=t.eval_iters,
        help="global batches of the valid split per evaluation (the same ones "
        "every time); 0 disables evaluation",
    )
    g.add_argument("--log-interval", type=int, default=t.log_interval)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument(
        "--metrics-file",
        default=None,
        metavar="PATH",
        help="JSON lines: one per iteration (split 'train') and one per evaluation "
        "(split 'valid'). Truncated at a fresh start; on resume, lines past the "
        "loaded iteration are dropped and new ones appended",
    )
    g = p.add_argument_group("weights & biases")
    g.add_argument(
        "--wandb-project",
        default=None,
        help="log the run's scalars (those tensorboard gets, per kind included) to this "
        "wandb project from the logging rank (wandb must be installed; its own "
        "WANDB_MODE=offline keeps the run on disk)",
    )
    g.add_argument("--wandb-exp-name", default=None, help="the wandb run's name")
    g.add_argument(
        "--wandb-save-dir",
        default=None,
        help="where wandb keeps the run's files (default: <--save>/wandb)",
    )
    g.add_argument("--wandb-entity", default=None, help="the wandb team or user")
    g = p.add_argument_group("profiling")
    pc = ProfileConfig()
    g.add_argument(
        "--profile",
        action="store_true",
        help="record iterations --profile-step-start to --profile-step-end - 1 on "
        "--profile-ranks: one merged Chrome trace of those ranks with the predicted schedule "
        "beside (with --use-pytorch-profiler: torch.profiler's trace of each rank instead)",
    )
    g.add_argument("--profile-step-start", type=int, default=pc.step_start, metavar="N")
    g.add_argument("--profile-step-end", type=int, default=pc.step_end, metavar="N")
    g.add_argument(
        "--profile-ranks",
        type=int,
        nargs="+",
        default=list(pc.ranks),
        metavar="R",
        help="world ranks to profile (default: 0)",
    )
    g.add_argument(
        "--use-pytorch-profiler",
        action="store_true",
        help="with --profile: torch.profiler's trace of each profiled rank (operators, "
        "and kernels on a GPU) into --tensorboard-dir, which TensorBoard's profiler "
        "plugin and Perfetto (ui.perfetto.dev) open",
    )
    g = p.add_argument_group("faults")
    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=f.distributed_timeout_minutes,
        metavar="N",
        help="fail instead of waiting longer than N minutes for a peer (every "
        "collective, transfer, barrier, start-up and checkpoint commit; "
        "fractions allowed)",
    )
    g.add_argument(
        "--log-straggler",
        action="store_true",
        help="every --log-interval, compare each rank's compute time with the "
        "median of its accelerator kind and name the ranks slower by more than "
        "--straggler-threshold",
    )
    g.add_argument(
        "--straggler-threshold",
        type=float,
        default=f.straggler_threshold,
        metavar="F",
        help="a straggler is slower than its kind's median by more "
        f"than this fraction (default {f.straggler_threshold})",
    )
    g.add_argument(
        "--skip-nonfinite-steps",
        action="store_true",
        help="skip (and count) an iteration whose loss or gradient norm is NaN or "
        "Inf instead of stopping the run",
    )


def fault_config(args: argparse.Namespace) -> FaultConfig:
    """The parsed fault flags; UserError for a timeout or threshold that is not positive."""
    if not args.distributed_timeout_minutes > 0:
        raise UserError(
            "--distributed-timeout-minutes must be positive, got "
            f"{args.distributed_timeout_minutes}"
        )
    if not args.straggler_threshold > 0:
        raise UserError(f"--straggler-threshold must be positive, got {args.straggler_threshold}")
    return FaultConfig(
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        async_save=args.async_save,
        log_straggler=args.log_straggler,
        straggler_threshold=args.straggler_threshold,
        skip_nonfinite_steps=args.skip_nonfinite_steps,
    )


def profile_config(args: argparse.Namespace) -> ProfileConfig:
    """The parsed profiling flags; UserError (one line) for a window that is empty or starts
    after the run's last iteration, a negative rank, or a profiler flag without its partner.
    Ranks beyond the world are refused once the world is known
    (:func:`megatron_het.training.profiling.check_profile`)."""
    start, end = args.profile_step_start, args.profile_step_end
    if not args.profile:
        if args.use_pytorch_profiler:
            raise UserError("--use-pytorch-profiler applies with --profile; add --profile")
        return ProfileConfig(step_start=start, step_end=end, ranks=tuple(args.profile_ranks))
    if start < 1 or end <= start:
        raise UserError(
            f"--profile-step-start {start} and --profile-step-end {end} record no iteration: "
            "the start must be at least 1 and the end after it"
        )
    if start > args.train_iters:
        raise UserError(
            f"--profile-step-start {start} is after the run's last iteration "
            f"(--train-iters {args.train_iters})"
        )
    if any(rank < 0 for rank in args.profile_ranks):
        raise UserError(f"--profile-ranks {args.profile_ranks} holds a negative rank")
    if args.tensorboard_dir is None:
        what = (
            "each profiled rank's torch.profiler trace"
            if args.use_pytorch_profiler
            else "the merged timeline of the profiled ranks"
        )
        raise UserError(f"--profile writes {what} into --tensorboard-dir; pass one")
    return ProfileConfig(
        enabled=True,
        step_start=start,
        step_end=end,
        ranks=tuple(sorted(set(args.profile_ranks))),
        use_pytorch_profiler=args.use_pytorch_profiler,
    )


def wandb_config(args: argparse.Namespace) -> WandbConfig:
    """The parsed wandb flags; UserError (one line) for a name or directory without a
    project, or a project without a run name (as Megatron-LM)."""
    config = WandbConfig(
        project=args.wandb_project,
        exp_name=args.wandb_exp_name,
        save_dir=args.wandb_save_dir,
        entity=args.wandb_entity,
    )
    if config.project is None:
        given = [
            flag
            for flag, value in (
                ("--wandb-exp-name", config.exp_name),
                ("--wandb-save-dir", config.save_dir),
                ("--wandb-entity", config.entity),
            )
            if value is not None
        ]
        if given:
            raise UserError(f"{', '.join(given)} applies with --wandb-project; add it")
        return config
    if not config.exp_name:
        raise UserError("--wandb-project needs --wandb-exp-name: name the wandb run")
    return config
