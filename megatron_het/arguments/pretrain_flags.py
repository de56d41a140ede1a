"""``pretrain_llama.py``'s flags, Megatron-LM's names where it has one, grouped as ``--help``
shows them: model, training, data, checkpoints and logging, faults, parallelism."""

from __future__ import annotations

import argparse

from megatron_het.arguments.io_flags import add_io_flags
from megatron_het.arguments.parser import ArgParser, add_shape_flags
from megatron_het.config import MODEL_PRESETS, DataConfig, OptimizerConfig, TrainConfig
from megatron_het.optim.lr_schedule import DECAY_STYLES

PROG = "pretrain_llama.py"
BRIDGES = ("relay", "direct")


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


def _add_kernel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "fused kernels (python -m megatron_het.kernels shows which implementation each op has)"
    )
    g.add_argument(
        "--no-rope-fusion",
        dest="rope_fusion",
        action="store_false",
        help="RoPE by torch's ops instead of the fused q/k kernel",
    )
    g.add_argument(
        "--no-rms-norm-fusion",
        dest="rms_norm_fusion",
        action="store_false",
        help="RMSNorm (and the residual add before it) by torch's ops instead of the fused kernel "
        "(ours, else apex's or liger's)",
    )
    g.add_argument(
        "--no-cross-entropy-loss-fusion",
        dest="cross_entropy_loss_fusion",
        action="store_false",
        help="the head's softmax cross-entropy by torch's ops instead of the fused kernel "
        "(the head stays chunked: full logits are never formed)",
    )
    g.add_argument(
        "--no-bias-swiglu-fusion",
        dest="bias_swiglu_fusion",
        action="store_false",
        help="SwiGLU by torch's two ops instead of the fused kernel (ours, or liger's)",
    )
    g.add_argument(
        "--no-gradient-accumulation-fusion",
        dest="gradient_accumulation_fusion",
        action="store_false",
        help="linear layers hand their weight gradient to autograd instead of adding it into "
        "the float32 main gradient (or .grad) in their backward GEMM",
    )
    g.add_argument(
        "--reference-kernels",
        action="store_true",
        help="every op by its torch reference (no csrc, apex or liger kernel), to compare",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``pretrain_llama.py`` parser; its errors raise UserError instead of exiting."""
    p = ArgParser(prog=PROG, description="Pretrain a Llama model (Megatron-style flags).")
    for add in (
        _add_model_flags,
        _add_training_flags,
        _add_data_flags,
        _add_kernel_flags,
        add_io_flags,
        _add_parallel_flags,
    ):
        add(p)
    return p
