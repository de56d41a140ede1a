"""Convert Llama checkpoints between Hugging Face, Megatron-LM and megatron_het formats, or
reshard them.

    python tools/convert_checkpoint.py --source-format hf --target-format megatron_het \\
        --load-dir HF_DIR --save-dir OUT [--dtype bf16]
    python tools/convert_checkpoint.py --source-format megatron_het --target-format hf \\
        --load-dir SAVE_DIR [--iteration N] --save-dir HF_OUT \\
        [--tokenizer-model M.model | --no-tokenizer]
    python tools/convert_checkpoint.py --source-format megatron --target-format megatron_het \\
        --load-dir MLM_SAVE [--iteration N] [--vocab-size V] --save-dir OUT [--with-optimizer]
    python tools/convert_checkpoint.py --source-format megatron_het --target-format megatron \\
        --load-dir SAVE_DIR --save-dir MLM_OUT [--target-tensor-parallel-size T] \\
        [--target-pipeline-parallel-size P] [--megatron-naming local|te] \\
        [--ckpt-format torch_dist [--with-optimizer [--use-distributed-optimizer]]]
    python tools/convert_checkpoint.py --mode reshard --load-dir SAVE_DIR [--iteration N] \\
        --save-dir OUT --target-plan plan.json

A Hugging Face directory holds config.json and model.safetensors (or sharded *.safetensors
with model.safetensors.index.json); one model.safetensors is written. A converted Hugging Face
model is saved as megatron_het iteration 0 without training state. A megatron_het source may
have been saved by any parallel plan or by a single process.

``--target-format hf`` also writes the run's tokenizer (tokenizer.json, tokenizer_config.json
and the SentencePiece tokenizer.model), so ``AutoTokenizer.from_pretrained(HF_OUT)`` loads next
to ``AutoModelForCausalLM.from_pretrained(HF_OUT)``. The tokenizer is the ``--tokenizer-model``
the checkpoint's run recorded in its metadata, or the one passed here (which takes precedence);
a run without one (NullTokenizer, converted weights) gets the weights only, with a note, as does
``--no-tokenizer``. A tokenizer that transformers would not encode exactly as the SentencePiece
model does is refused with one line, before anything is written.

``megatron`` is a Megatron-LM checkpoint in either format, told apart on reading: the legacy
``--ckpt-format torch`` layout (iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt), read at any
TP/PP degree and written for ``--target-tensor-parallel-size`` and
``--target-pipeline-parallel-size`` with megatron-core's local-spec names or (``--megatron-naming
te``) Transformer Engine's; or, with ``--ckpt-format torch_dist``, megatron-core's
dist_checkpointing layout (iter_NNNNNNN/metadata.json, common.pt, .metadata, *.distcp), whose
global tensors Megatron-LM loads at any TP/PP. By default only the model weights are converted:
an imported run starts as a model-only checkpoint at iteration 0; an exported legacy one loads in
Megatron-LM with ``--finetune`` or ``--no-load-optim --no-load-rng``, a torch_dist one as it is
(its args say no optimizer or RNG state was saved). ``--with-optimizer`` (torch_dist only, whose
optimizer state is kept by parameter) also carries Adam's moments and step, the float32 main
weights, the iteration and the data position both ways, so the run continues; an export lays the
state out for a non-distributed optimizer, or with ``--use-distributed-optimizer`` for
Megatron-LM's distributed one (``fully_reshardable``), and holds no RNG state (load it with
``--no-load-rng``). See :mod:`megatron_het.checkpoint.megatron_lm_optim`.

``--mode reshard`` rewrites a megatron_het checkpoint (of any plan) offline, in one process, as
the target plan would have saved it: per-rank model and optimizer shards cut to that plan's
stages and TP slices, the same iteration and training state, metadata recording the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import torch

from megatron_het.arguments.parser import ArgParser
from megatron_het.checkpoint.hf import (
    hf_config_to_model_config,
    hf_to_megatron_het_state,
    megatron_het_to_hf_state,
    model_config_to_hf_config,
    write_hf_tokenizer,
)
from megatron_het.checkpoint.io import (
    load_checkpoint_metadata,
    resolve_checkpoint_dir,
    save_checkpoint,
)
from megatron_het.checkpoint.megatron_lm import (
    read_megatron_checkpoint,
    write_megatron_checkpoint,
)
from megatron_het.checkpoint.megatron_lm_dist import DistExtras, write_dist_checkpoint
from megatron_het.checkpoint.megatron_lm_names import NAMINGS, padded_vocab_size
from megatron_het.checkpoint.megatron_lm_optim import (
    MEGATRON_RUN_KEY,
    TrainingRun,
    dist_optimizer_extras,
    optimizer_of_ours,
    resume_train_state,
)
from megatron_het.checkpoint.reader import load_model_state
from megatron_het.checkpoint.sharded import reshard_checkpoint
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError, run_cli
from megatron_het.optim.lr_schedule import LRSchedule
from megatron_het.parallel.plan import ParallelPlan

FORMATS = ("hf", "megatron_het", "megatron")
CKPT_FORMATS = ("torch", "torch_dist")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def build_parser() -> argparse.ArgumentParser:
    """Flags; ``--mode`` chooses the operation (format conversion or resharding)."""
    parser = ArgParser(
        prog="tools/convert_checkpoint.py", description="Convert or reshard Llama checkpoints."
    )
    parser.add_argument(
        "--mode",
        choices=("convert", "reshard"),
        default="convert",
        help="'convert' changes the checkpoint format; 'reshard' lays a "
        "megatron_het checkpoint out for --target-plan",
    )
    parser.add_argument(
        "--source-format",
        choices=FORMATS,
        default=None,
        help="convert: format of --load-dir (default: the one that is not --target-format)",
    )
    parser.add_argument(
        "--target-format", choices=FORMATS, default=None, help="convert: format to write"
    )
    parser.add_argument(
        "--target-plan",
        default=None,
        help="reshard: parallel plan JSON the checkpoint is laid out for",
    )
    parser.add_argument("--load-dir", required=True, help="checkpoint to read")
    parser.add_argument("--save-dir", required=True, help="directory to write")
    parser.add_argument(
        "--iteration",
        type=int,
        default=None,
        help="megatron_het or megatron source: iteration to read (default: the tracker's)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="cast floating-point tensors (default: keep their dtype)",
    )
    parser.add_argument(
        "--tokenizer-model",
        default=None,
        metavar="M.model",
        help="--target-format hf: the run's SentencePiece model to write as the "
        "Hugging Face tokenizer (default: the one the checkpoint's "
        "metadata records)",
    )
    parser.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="--target-format hf: write the weights and config alone, no tokenizer",
    )
    _add_megatron_flags(parser)
    return parser


def _add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of the Megatron-LM format (None: not given, so misuse can be refused)."""
    parser.add_argument(
        "--target-tensor-parallel-size",
        type=int,
        default=None,
        metavar="T",
        help="--target-format megatron: TP degree to write (default 1)",
    )
    parser.add_argument(
        "--target-pipeline-parallel-size",
        type=int,
        default=None,
        metavar="P",
        help="--target-format megatron: PP degree to write, dividing the layers (default 1)",
    )
    parser.add_argument(
        "--megatron-naming",
        choices=NAMINGS,
        default=None,
        help="--target-format megatron: megatron-core's local-spec names (default) or "
        "Transformer Engine's (te); a megatron source is read in either",
    )
    parser.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=None,
        metavar="N",
        help="--target-format megatron: pad the vocabulary to a multiple of N * T (default 128)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="V",
        help="--source-format megatron: the tokenizer's vocabulary size, to drop Megatron's "
        "padding rows (default: the checkpoint's args.vocab_size, else keep them)",
    )
    parser.add_argument(
        "--with-optimizer",
        action="store_true",
        help="megatron <-> megatron_het: carry Adam's state, the float32 main weights, the "
        "iteration and the data position, so the run continues (torch_dist only)",
    )
    parser.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="--target-format megatron --with-optimizer: lay the optimizer state out for a "
        "Megatron-LM run with --use-distributed-optimizer (its fully_reshardable layout)",
    )
    parser.add_argument(
        "--ckpt-format",
        choices=CKPT_FORMATS,
        default=None,
        help="--target-format megatron: Megatron-LM's legacy torch layout (default) or "
        "torch_dist (megatron-core dist_checkpointing); a megatron source's is detected",
    )


def read_hf_dir(load_dir: pathlib.Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json dict, state)`` of a Hugging Face model directory (single or sharded)."""
    from safetensors.torch import load_file

    if not load_dir.is_dir():
        raise UserError(
            f"--load-dir {load_dir} is not a directory; pass a Hugging Face model "
            "directory holding config.json and *.safetensors"
        )
    config_path = load_dir / "config.json"
    if not config_path.is_file():
        raise UserError(f"{load_dir} has no config.json; pass a Hugging Face model directory")
    try:
        hf_config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{config_path} is not valid JSON ({exc}); fix or re-download it") from None
    index_path = load_dir / SAFETENSORS_INDEX
    if (load_dir / SAFETENSORS_FILE).is_file():
        files = [load_dir / SAFETENSORS_FILE]
    elif index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(
                f"{index_path} is not a safetensors index (no weight_map); fix or re-download it"
            ) from None
        files = [load_dir / name for name in sorted(set(weight_map.values()))]
    else:
        raise UserError(
            f"{load_dir} has neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX}; "
            "save the model with safe_serialization=True"
        )
    state: dict[str, torch.Tensor] = {}
    for path in files:
        if not path.is_file():
            raise UserError(f"{index_path} lists {path.name}, which is missing; re-download it")
        try:
            state.update(load_file(str(path)))
        except Exception as exc:  # safetensors raises its own error type for damaged files
            raise UserError(
                f"cannot read {path} ({str(exc).splitlines()[0][:120]}); re-download or re-save it"
            ) from None
    return hf_config, state


def write_hf_dir(save_dir: pathlib.Path, hf_config: dict, state: dict[str, torch.Tensor]) -> None:
    """Write config.json and one model.safetensors into ``save_dir``."""
    from safetensors.torch import save_file

    save_dir.mkdir(parents=True, exist_ok=True)
    (save_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(save_dir / SAFETENSORS_FILE),
        metadata={"format": "pt"},
    )


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Floating-point tensors cast to ``dtype`` (None keeps them)."""
    if dtype is None:
        return state
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def state_dtype_name(state: dict[str, torch.Tensor]) -> str:
    floating = [v.dtype for v in state.values() if v.is_floating_point()]
    return DTYPE_NAMES.get(floating[0], "float32") if floating else "float32"


def hf_to_megatron_het(args: argparse.Namespace) -> pathlib.Path:
    hf_config, hf_state = read_hf_dir(pathlib.Path(args.load_dir))
    cfg = hf_config_to_model_config(hf_config)
    state = cast(hf_to_megatron_het_state(hf_state, cfg), DTYPES.get(args.dtype))
    return save_checkpoint(
        args.save_dir,
        0,
        cfg,
        state,
        train_state=None,
        metadata={"converted_from": "hf", "source": str(args.load_dir)},
    )


def recorded_tokenizer_model(metadata: dict) -> str | None:
    """The SentencePiece ``--tokenizer-model`` a training run recorded in its checkpoint's
    metadata (its run_config, else its argv); None for NullTokenizer runs and converted
    weights."""
    run_config = metadata.get("run_config")
    if isinstance(run_config, dict):
        data = run_config.get("data") or {}
        if data.get("tokenizer_type", "SentencePieceTokenizer") != "SentencePieceTokenizer":
            return None
        return data.get("tokenizer_model") or None
    argv = [str(a) for a in metadata.get("argv") or ()]
    for i, arg in enumerate(argv):
        if arg == "--tokenizer-model" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--tokenizer-model="):
            return arg.split("=", 1)[1]
    return None


def _tokenizer_model(args: argparse.Namespace) -> str | None:
    """--tokenizer-model, else the checkpoint's; a recorded path that is gone is a UserError."""
    if args.tokenizer_model is not None:
        return args.tokenizer_model
    recorded = recorded_tokenizer_model(load_checkpoint_metadata(args.load_dir, args.iteration))
    if recorded is not None and not pathlib.Path(recorded).is_file():
        raise UserError(
            f"the checkpoint's run used tokenizer model {recorded}, which does not "
            f"exist here (a relative path is the run's); pass --tokenizer-model PATH "
            f"to that SentencePiece .model, or --no-tokenizer for the weights alone"
        )
    return recorded


def megatron_het_to_hf(args: argparse.Namespace) -> pathlib.Path:
    cfg, state = load_model_state(args.load_dir, iteration=args.iteration)
    tokenizer_model = None if args.no_tokenizer else _tokenizer_model(args)
    hf_state = cast(megatron_het_to_hf_state(state, cfg), DTYPES.get(args.dtype))
    save_dir = pathlib.Path(args.save_dir)
    special_ids = None
    if args.no_tokenizer:
        print("note: no tokenizer written (--no-tokenizer)", file=sys.stderr)
    elif tokenizer_model is not None:
        special_ids = write_hf_tokenizer(tokenizer_model, save_dir, cfg.vocab_size)
    else:
        print(
            "note: no tokenizer written: the checkpoint records no SentencePiece "
            "--tokenizer-model; pass --tokenizer-model M.model to add one",
            file=sys.stderr,
        )
    write_hf_dir(
        save_dir, model_config_to_hf_config(cfg, state_dtype_name(hf_state), special_ids), hf_state
    )
    return save_dir


def megatron_to_megatron_het(args: argparse.Namespace) -> pathlib.Path:
    loaded = read_megatron_checkpoint(
        args.load_dir, args.iteration, args.vocab_size, with_optimizer=args.with_optimizer
    )
    if args.vocab_size is None and getattr(loaded.args, "vocab_size", None) is None:
        print(
            f"note: the checkpoint's args hold no vocab_size, so its {loaded.config.vocab_size} "
            "padded vocabulary rows are kept; pass --vocab-size V to drop the padding",
            file=sys.stderr,
        )
    metadata = {
        "converted_from": "megatron",
        "source": str(loaded.directory),
        "source_iteration": loaded.iteration,
    }
    if loaded.optimizer is None:
        state = cast(loaded.state, DTYPES.get(args.dtype))
        return save_checkpoint(args.save_dir, 0, loaded.config, state, None, metadata)
    # A resumable checkpoint of ours holds the float32 main weights as its model.
    weights = loaded.optimizer.main_params or cast(loaded.state, torch.float32)
    metadata["megatron_optimizer_layout"] = loaded.optimizer.layout
    consumed = int(getattr(loaded.args, "consumed_train_samples", 0) or 0)
    run = TrainingRun.from_megatron_args(loaded.args, loaded.iteration, consumed)
    if run is not None:
        metadata[MEGATRON_RUN_KEY] = dataclasses.asdict(run)
    return save_checkpoint(
        args.save_dir,
        loaded.iteration,
        loaded.config,
        weights,
        resume_train_state(loaded),
        metadata,
    )


def megatron_het_to_megatron(args: argparse.Namespace) -> pathlib.Path:
    cfg, state = load_model_state(args.load_dir, iteration=args.iteration)
    metadata = load_checkpoint_metadata(args.load_dir, args.iteration)
    iteration = int(metadata["iteration"])
    tp_size = args.target_tensor_parallel_size or 1
    divisible_by = args.make_vocab_size_divisible_by or 128
    model_state = cast(state, DTYPES.get(args.dtype))
    extras = None
    if args.with_optimizer:
        if args.ckpt_format != "torch_dist":
            raise UserError(
                "--with-optimizer writes Megatron-LM's torch_dist format only (the legacy one "
                "indexes optimizer state by position); add --ckpt-format torch_dist"
            )
        extras = _megatron_optimizer(args, cfg, state, metadata, tp_size, divisible_by)
    write = write_dist_checkpoint if args.ckpt_format == "torch_dist" else write_megatron_checkpoint
    return write(
        args.save_dir,
        cfg,
        model_state,
        iteration,
        tp_size=tp_size,
        pp_size=args.target_pipeline_parallel_size or 1,
        naming=args.megatron_naming or "local",
        divisible_by=divisible_by,
        **({} if extras is None else {"extras": extras}),
    )


def _megatron_optimizer(
    args: argparse.Namespace,
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    metadata: dict,
    tp_size: int,
    divisible_by: int,
) -> DistExtras:
    """The optimizer's part of a torch_dist export of our checkpoint (``weights``: its float32
    main weights)."""
    directory = resolve_checkpoint_dir(args.load_dir, args.iteration)
    optimizer = optimizer_of_ours(directory)
    run = TrainingRun.from_metadata(metadata, str(directory))
    decay_iters = run.train_iters if run.lr_decay_iters is None else run.lr_decay_iters
    schedule = LRSchedule(run.lr, run.min_lr, run.lr_warmup_iters, decay_iters, run.lr_decay_style)
    return dist_optimizer_extras(
        optimizer,
        {n: t.float() for n, t in weights.items()},
        cfg,
        padded_vocab_size(cfg.vocab_size, divisible_by, tp_size),
        DTYPES.get(args.dtype) or next(iter(weights.values())).dtype,
        run,
        schedule.lr_at(max(run.iteration, 1)),
        args.use_distributed_optimizer,
    )


def _check_megatron_flags(args: argparse.Namespace, source: str, target: str) -> None:
    """Refuse Megatron-only flags outside the conversions they apply to."""
    for flag, value, side, fmt in (
        ("--ckpt-format", args.ckpt_format, "target", target),
        ("--target-tensor-parallel-size", args.target_tensor_parallel_size, "target", target),
        ("--target-pipeline-parallel-size", args.target_pipeline_parallel_size, "target", target),
        ("--megatron-naming", args.megatron_naming, "target", target),
        ("--make-vocab-size-divisible-by", args.make_vocab_size_divisible_by, "target", target),
        ("--vocab-size", args.vocab_size, "source", source),
        ("--use-distributed-optimizer", args.use_distributed_optimizer or None, "target", target),
    ):
        if value is not None and fmt != "megatron":
            raise UserError(f"{flag} applies to --{side}-format megatron only; drop it")
    if args.with_optimizer and "megatron" not in (source, target):
        raise UserError(
            "--with-optimizer applies to conversions from or to Megatron-LM "
            "(--source-format or --target-format megatron) only; drop it"
        )
    if args.use_distributed_optimizer and not args.with_optimizer:
        raise UserError(
            "--use-distributed-optimizer lays out optimizer state; add --with-optimizer"
        )
    if args.with_optimizer and args.dtype is not None and source == "megatron":
        raise UserError(
            "--with-optimizer keeps the float32 main weights, which --dtype would round; "
            "drop --dtype"
        )


def reshard(args: argparse.Namespace) -> pathlib.Path:
    if args.target_plan is None:
        raise UserError(
            "--mode reshard needs --target-plan PLAN.json (the plan to lay the checkpoint out for)"
        )
    if args.dtype is not None:
        raise UserError("--dtype applies to --mode convert only; drop it when resharding")
    if args.tokenizer_model is not None or args.no_tokenizer:
        flag = "--tokenizer-model" if args.tokenizer_model is not None else "--no-tokenizer"
        raise UserError(f"{flag} applies to --target-format hf only; drop it when resharding")
    plan = ParallelPlan.load(args.target_plan)
    return reshard_checkpoint(args.load_dir, args.save_dir, plan, iteration=args.iteration)


def _formats(args: argparse.Namespace) -> tuple[str, str]:
    source, target = args.source_format, args.target_format
    if target is None:
        raise UserError("--mode convert needs --target-format (hf, megatron_het or megatron)")
    if source is None:
        source = "hf" if target == "megatron_het" else "megatron_het"
    return source, target


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.mode == "reshard":
        written = reshard(args)
        print(f"wrote megatron_het checkpoint for plan {args.target_plan} to {written}")
        return
    source_format, target_format = _formats(args)
    conversions = {
        ("hf", "megatron_het"): hf_to_megatron_het,
        ("megatron_het", "hf"): megatron_het_to_hf,
        ("megatron", "megatron_het"): megatron_to_megatron_het,
        ("megatron_het", "megatron"): megatron_het_to_megatron,
    }
    conversion = conversions.get((source_format, target_format))
    if conversion is None:
        if source_format == target_format:
            raise UserError(
                f"--source-format {source_format} and --target-format "
                f"{target_format} are the same; pick two different formats"
            )
        raise UserError(
            f"no direct conversion from {source_format} to {target_format}; convert to "
            f"megatron_het first, then from it"
        )
    _check_megatron_flags(args, source_format, target_format)
    for flag, given in (
        ("--tokenizer-model", args.tokenizer_model is not None),
        ("--no-tokenizer", args.no_tokenizer),
    ):
        if given and target_format != "hf":
            raise UserError(f"{flag} applies to --target-format hf only; drop it")
    if args.tokenizer_model is not None and args.no_tokenizer:
        raise UserError("--tokenizer-model and --no-tokenizer contradict each other; keep one")
    written = conversion(args)
    print(f"wrote {target_format} checkpoint to {written}")


if __name__ == "__main__":
    run_cli(main)
