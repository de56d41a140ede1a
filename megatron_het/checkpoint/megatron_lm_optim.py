"""Adam state of a Megatron-LM ``torch_dist`` checkpoint, read by parameter and written back.

megatron-core keeps an optimizer's per-parameter state in one of two kinds of layout:

* **by parameter** ("model space"): each state tensor is a global tensor shaped like its
  parameter, under ``optimizer.state.<name>.<model key>``, so it reshards like the weights.
  ``<name>`` is ``exp_avg`` and ``exp_avg_sq`` (Adam's moments) and the float32 main weights:
  ``fp32_param`` (the non-distributed optimizer under bf16/fp16; fp32 training keeps none) or
  ``param`` (the distributed optimizer saved ``fully_reshardable``, Megatron-LM's
  ``--dist-ckpt-optim-fully-reshardable``).
  Adam's step is a non-tensor value in ``common.pt``: ``common_step`` (torch's optimizers) or
  each param group's ``step`` (fused Adam, the distributed optimizer).
* **by buffer** (``dp_reshardable``, Megatron-LM's default for ``--use-distributed-optimizer``,
  and the older bucket formats): keys ``optimizer.distributed.dp_group_idx_…`` hold the
  distributed optimizer's flat gradient buckets, whose layout depends on the DP size, the bucket
  size and the parameter order of the run that wrote it. Megatron-LM itself cannot load them at
  another TP or PP degree; here they are refused with the flag that writes the other layout.

The legacy ``--ckpt-format torch`` indexes the state by the position of each parameter in the
run's param groups (or keeps it in ``distrib_optim.pt`` buckets), so its optimizer state is not
read. The LR scheduler's state (``opt_param_scheduler``) and the fp16 grad scaler's are plain
values in ``common.pt``.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from megatron_het.checkpoint.megatron_lm_boxes import read_boxes
from megatron_het.checkpoint.megatron_lm_dist import COMMON_FILE, DistExtras, dist_state
from megatron_het.checkpoint.megatron_lm_files import (
    MegatronCheckpoint,
    load_pickled,
    read_dcp_metadata,
)
from megatron_het.checkpoint.reader import CheckpointReader, full_box, full_optimizer_state
from megatron_het.checkpoint.reshard import Box
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError

STATE_PREFIX = "optimizer.state."
BUCKET_PREFIX = "optimizer.distributed."
MOMENTS = ("exp_avg", "exp_avg_sq")
# The float32 main weights: the non-distributed optimizer's, then the distributed one's.
MAIN_PARAMS = ("fp32_param", "param")
_STATE_KEY = re.compile(r"optimizer\.state\.([A-Za-z0-9_]+)\.(.+)")
FULLY_RESHARDABLE_FLAG = "--dist-ckpt-optim-fully-reshardable"
# metadata.json key of a checkpoint converted with its optimizer: the Megatron-LM run's
# schedule and Adam settings (a TrainingRun), for an export back without a run of ours.
MEGATRON_RUN_KEY = "megatron_training_run"
LEGACY_OPTIMIZER = (
    "{source} is a --ckpt-format torch save, whose optimizer state is indexed by position, not "
    "by parameter; re-save it from Megatron-LM as torch_dist (--ckpt-convert-format torch_dist "
    f"with {FULLY_RESHARDABLE_FLAG}) to carry it"
)


@dataclass(frozen=True)
class MegatronOptimizerState:
    """Adam's state of a Megatron-LM checkpoint in our single-process form.

    ``moments``: FULL float32 ``exp_avg`` / ``exp_avg_sq`` by our parameter names, vocabulary
    padding removed; ``main_params``: the float32 main weights by our names (None when the
    model's own weights are float32 and are the main weights); ``step``: Adam's step count;
    ``scheduler``: Megatron's ``opt_param_scheduler`` state (None when absent); ``grad_scaler``:
    the fp16 loss scaler's (None under bf16/fp32); ``layout``: which layout was read."""

    step: int
    moments: dict[str, dict[str, torch.Tensor]]
    main_params: dict[str, torch.Tensor] | None
    scheduler: dict[str, Any] | None
    grad_scaler: dict[str, Any] | None
    layout: str


def _walk(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every ``(dotted path, value)`` below ``obj`` (dicts and lists/tuples)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            child = f"{path}.{key}" if path else str(key)
            yield child, value
            yield from _walk(value, child)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk(value, f"{path}[{i}]")


def _found(common: dict[str, Any], name: str) -> list[Any]:
    return [v for p, v in _walk(common.get("optimizer")) if p.rsplit(".", 1)[-1] == name]


def state_names(metadata: dcp_metadata.Metadata) -> set[str]:
    """Per-parameter state names (``exp_avg``, ``param``, ...) stored by parameter."""
    matches = (_STATE_KEY.fullmatch(key) for key in metadata.state_dict_metadata)
    return {match.group(1) for match in matches if match is not None}


def optimizer_problem(
    metadata: dcp_metadata.Metadata, common: dict[str, Any], source: str
) -> str | None:
    """Why the optimizer state of this torch_dist save cannot be read by parameter, as the
    end of a sentence (None when it can)."""
    keys = metadata.state_dict_metadata
    if any(k.startswith(BUCKET_PREFIX) for k in keys):
        kinds = {str(v) for v in _found(common, "param_state_sharding_type")}
        kind = f" ({', '.join(sorted(kinds))})" if kinds else ""
        return (
            f"{source} keeps its optimizer state in the distributed optimizer's gradient "
            f"buckets{kind}, not by parameter; save it from Megatron-LM with "
            f"{FULLY_RESHARDABLE_FLAG} to carry it"
        )
    names = state_names(metadata)
    if not names:
        args = common.get("args")
        why = " (saved with --no-save-optim)" if getattr(args, "no_save_optim", False) else ""
        return f"{source} holds no optimizer state{why}"
    unknown = names - set(MOMENTS) - set(MAIN_PARAMS)
    if unknown or not set(MOMENTS) <= names:
        return (
            f"{source} holds optimizer state {sorted(names)}, not Adam's "
            f"({', '.join(MOMENTS)}); only Adam's state is carried"
        )
    return None


def _step(common: dict[str, Any], iteration: int, source: str) -> int:
    """Adam's step: ``common_step``, else the param groups' ``step``, else ``iteration``."""
    values = _found(common, "common_step") or _found(common, "step")
    steps = {int(torch.as_tensor(v).item()) for v in values if v is not None}
    if len(steps) > 1:
        raise UserError(
            f"{source}: its optimizer records different steps {sorted(steps)}; only one "
            "step shared by every parameter is supported"
        )
    return steps.pop() if steps else int(iteration)


def read_optimizer_boxes(
    directory: pathlib.Path,
    cfg: ModelConfig,
    boxes: dict[str, Box],
    common: dict[str, Any],
    metadata: dcp_metadata.Metadata,
    iteration: int,
) -> tuple[MegatronOptimizerState, int]:
    """Adam's state of the torch_dist iteration ``directory`` for the boxes of our parameters
    in ``boxes`` (each a box of our global tensor, e.g. a rank's TP slice; moments and main
    weights hold those boxes, float32), and the bytes read. Raises UserError (one line) when
    the state is not stored by parameter (:func:`optimizer_problem`) or is damaged."""
    problem = optimizer_problem(metadata, common, str(directory))
    if problem is not None:
        raise UserError(problem)
    names = state_names(metadata)
    total = 0

    def read(name: str) -> dict[str, torch.Tensor]:
        nonlocal total
        values, nbytes = read_boxes(directory, cfg, boxes, metadata, f"{STATE_PREFIX}{name}.")
        total += nbytes
        return {n: t.float() for n, t in values.items()}

    exp_avg, exp_avg_sq = (read(m) for m in MOMENTS)
    moments = {n: {"exp_avg": exp_avg[n], "exp_avg_sq": exp_avg_sq[n]} for n in exp_avg}
    main_name = next((m for m in MAIN_PARAMS if m in names), None)
    main = None if main_name is None else read(main_name)
    scheduler = common.get("opt_param_scheduler")
    scalers = _found(common, "grad_scaler")
    state = MegatronOptimizerState(
        step=_step(common, iteration, str(directory)),
        moments=moments,
        main_params=main,
        scheduler=dict(scheduler) if isinstance(scheduler, dict) else None,
        grad_scaler=dict(scalers[0]) if scalers and isinstance(scalers[0], dict) else None,
        layout=f"by parameter ({main_name or 'fp32 model weights'} as main weights)",
    )
    return state, total


def read_dist_optimizer(loaded: MegatronCheckpoint) -> MegatronOptimizerState:
    """The FULL Adam state of the torch_dist checkpoint ``loaded`` was read from (its model read
    already); UserError as :func:`read_optimizer_boxes`."""
    directory = loaded.directory
    common = load_pickled(directory / COMMON_FILE, "copy the whole iteration directory")
    boxes = {n: full_box(tuple(t.shape)) for n, t in loaded.state.items()}
    metadata = read_dcp_metadata(directory)
    state, _ = read_optimizer_boxes(
        directory, loaded.config, boxes, common, metadata, loaded.iteration
    )
    return state


def loss_scaler_state(grad_scaler: dict[str, Any]) -> dict[str, Any]:
    """Megatron's dynamic grad scaler state as our loss scaler's."""
    return {
        "scale": float(torch.as_tensor(grad_scaler["scale"]).item()),
        "clean_steps": int(grad_scaler.get("growth_tracker", 0)),
        "hysteresis_left": int(grad_scaler.get("hysteresis_tracker", 0)),
    }


def resume_train_state(loaded: MegatronCheckpoint) -> dict[str, Any]:
    """Our single-process training state for a run that continues ``loaded`` (read with its
    optimizer): the iteration, ``args.consumed_train_samples``, Adam's state by our names, the
    fp16 loss scale and, for the record, Megatron's scheduler state. No RNG state: Megatron's
    generators are not ours, so a continuing run draws from ``--seed``."""
    optimizer = loaded.optimizer
    assert isinstance(optimizer, MegatronOptimizerState), "read it with with_optimizer=True"
    step = torch.tensor(float(optimizer.step))
    state: dict[str, Any] = {
        "iteration": int(loaded.iteration),
        "consumed_samples": int(getattr(loaded.args, "consumed_train_samples", 0) or 0),
        "lr_schedule_start": 0,
        "optimizer": {
            "state": {n: {"step": step, **moments} for n, moments in optimizer.moments.items()},
            "param_groups": [],
        },
    }
    if optimizer.scheduler is not None:
        state["megatron_opt_param_scheduler"] = optimizer.scheduler
    if optimizer.grad_scaler is not None:
        state["loss_scaler"] = loss_scaler_state(optimizer.grad_scaler)
        state["skipped_iterations"] = 0
    return state


# ---- writing -----------------------------------------------------------------------------------
def optimizer_of_ours(directory: pathlib.Path) -> MegatronOptimizerState:
    """The Adam state of our checkpoint iteration ``directory`` (any plan) in full, with its
    float32 weights as the main weights; UserError for a checkpoint without optimizer state."""
    reader = CheckpointReader(directory)
    if not reader.has_optimizer:
        raise UserError(
            f"{directory} holds no optimizer state (model-only, e.g. converted weights); "
            "drop --with-optimizer"
        )
    full = full_optimizer_state(reader)["state"]
    steps = {int(entry["step"]) for entry in full.values()}
    train_state = reader.train_state(0) or {}
    scaler = train_state.get("loss_scaler")
    return MegatronOptimizerState(
        step=max(steps, default=0),
        moments={n: {m: entry[m].float() for m in MOMENTS} for n, entry in full.items()},
        main_params=None,
        scheduler=None,
        grad_scaler=None
        if scaler is None
        else {
            "scale": torch.tensor([float(scaler["scale"])]),
            "growth_tracker": int(scaler["clean_steps"]),
            "hysteresis_tracker": int(scaler["hysteresis_left"]),
        },
        layout="megatron_het",
    )


@dataclass(frozen=True)
class TrainingRun:
    """What Megatron-LM's optimizer and scheduler state need of the run that saved a
    checkpoint (our run config's optimizer and train fields)."""

    iteration: int
    consumed_samples: int
    global_batch_size: int
    train_iters: int
    lr: float
    min_lr: float
    lr_warmup_iters: int
    lr_decay_iters: int | None
    lr_decay_style: str
    weight_decay: float
    betas: tuple[float, float]
    eps: float

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], source: str) -> TrainingRun:
        """From our checkpoint's metadata.json: its run's ``run_config`` and
        ``consumed_samples``, or (a checkpoint converted from Megatron-LM with its optimizer)
        the run recorded from the Megatron-LM args under ``megatron_training_run``."""
        run = metadata.get("run_config")
        recorded = metadata.get(MEGATRON_RUN_KEY)
        if not isinstance(run, dict) and isinstance(recorded, dict):
            return cls(**{**recorded, "betas": tuple(recorded["betas"])})
        if not isinstance(run, dict):
            raise UserError(
                f"{source} records no run config, so its learning-rate schedule is unknown; "
                "drop --with-optimizer"
            )
        optim, train = run["optimizer"], run["train"]
        iteration = int(metadata["iteration"])
        consumed = int(metadata.get("consumed_samples", 0))
        return cls(
            iteration=iteration,
            consumed_samples=consumed,
            global_batch_size=int(train["global_batch_size"]),
            train_iters=int(train["train_iters"]),
            lr=float(optim["lr"]),
            min_lr=float(optim["min_lr"]),
            lr_warmup_iters=int(optim["lr_warmup_iters"]),
            lr_decay_iters=optim["lr_decay_iters"],
            lr_decay_style=str(optim["lr_decay_style"]),
            weight_decay=float(optim["weight_decay"]),
            betas=(float(optim["adam_beta1"]), float(optim["adam_beta2"])),
            eps=float(optim["adam_eps"]),
        )

    @classmethod
    def from_megatron_args(
        cls, args: Any, iteration: int, consumed_samples: int
    ) -> TrainingRun | None:
        """The run a Megatron-LM checkpoint's ``args`` describe (Megatron-LM's defaults where a
        field is absent); None without ``lr`` or ``global_batch_size``."""
        lr, gbs = getattr(args, "lr", None), getattr(args, "global_batch_size", None)
        if lr is None or not gbs:
            return None

        def field(name: str, default: Any) -> Any:
            value = getattr(args, name, None)
            return default if value is None else value

        samples = int(field("train_samples", 0))
        return cls(
            iteration=int(iteration),
            consumed_samples=int(consumed_samples),
            global_batch_size=int(gbs),
            train_iters=int(field("train_iters", samples // int(gbs) or iteration)),
            lr=float(lr),
            min_lr=float(field("min_lr", 0.0)),
            lr_warmup_iters=int(field("lr_warmup_iters", 0)),
            lr_decay_iters=getattr(args, "lr_decay_iters", None),
            lr_decay_style=str(field("lr_decay_style", "linear")),
            weight_decay=float(field("weight_decay", 0.01)),
            betas=(float(field("adam_beta1", 0.9)), float(field("adam_beta2", 0.999))),
            eps=float(field("adam_eps", 1e-8)),
        )

    def scheduler_state(self) -> dict[str, Any]:
        """Megatron-LM's ``OptimizerParamScheduler.state_dict()`` for this run (steps count
        samples; weight decay constant, as ours)."""
        gbs = self.global_batch_size
        decay_iters = self.train_iters if self.lr_decay_iters is None else self.lr_decay_iters
        return {
            "max_lr": self.lr,
            "lr_warmup_steps": self.lr_warmup_iters * gbs,
            "num_steps": self.consumed_samples,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": int(decay_iters) * gbs,
            "min_lr": self.min_lr,
            "start_wd": self.weight_decay,
            "end_wd": self.weight_decay,
            "wd_incr_style": "constant",
            "wd_incr_steps": self.train_iters * gbs,
        }

    def args(self) -> dict[str, Any]:
        """The Megatron-LM ``args`` fields its optimizer and scheduler are built from."""
        return {
            "lr": self.lr,
            "min_lr": self.min_lr,
            "lr_warmup_iters": self.lr_warmup_iters,
            "lr_decay_iters": self.lr_decay_iters,
            "lr_decay_style": self.lr_decay_style,
            "train_iters": self.train_iters,
            "global_batch_size": self.global_batch_size,
            "weight_decay": self.weight_decay,
            "start_weight_decay": self.weight_decay,
            "end_weight_decay": self.weight_decay,
            "weight_decay_incr_style": "constant",
            "optimizer": "adam",
            "adam_beta1": self.betas[0],
            "adam_beta2": self.betas[1],
            "adam_eps": self.eps,
            "consumed_train_samples": self.consumed_samples,
        }


def param_groups(run: TrainingRun, lr: float, step: float | None) -> list[dict[str, Any]]:
    """megatron-core's two param groups of a Llama model (weight decay on matrices, none on
    norms; ``wd_mult`` tells them apart), as torch's AdamW holds them, without ``params``;
    ``step`` in each group (the distributed optimizer) unless None."""
    groups = []
    for wd_mult in (1.0, 0.0):
        group: dict[str, Any] = {
            "is_expert_parallel": False,
            "default_config": True,
            "wd_mult": wd_mult,
            "lr_mult": 1.0,
            "is_decoupled_lr": False,
            "max_lr": run.lr,
            "min_lr": run.min_lr,
            "lr": lr,
            "betas": run.betas,
            "eps": run.eps,
            "weight_decay": run.weight_decay * wd_mult,
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
        }
        if step is not None:
            group["step"] = step
        groups.append(group)
    return groups


def dist_optimizer_extras(
    optimizer: MegatronOptimizerState,
    weights: dict[str, torch.Tensor],
    cfg: ModelConfig,
    padded: int,
    model_dtype: torch.dtype,
    run: TrainingRun,
    lr: float,
    distributed: bool,
) -> DistExtras:
    """The optimizer's part of a torch_dist save, laid out by parameter as megatron-core loads
    it: the non-distributed optimizer's (``fp32_param`` main weights under bf16/fp16) or, with
    ``distributed``, the distributed optimizer's ``fully_reshardable`` one (``param``).
    ``weights``: the float32 main weights by our names; ``lr``: the last step's LR."""

    def by_key(state: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
        mapped = dist_state(state, cfg, padded)
        return {
            f"{STATE_PREFIX}{name}.{key}": t.float()
            for key, t in mapped.items()
            if isinstance(t, torch.Tensor)
        }

    tensors: dict[str, torch.Tensor] = {}
    for moment in MOMENTS:
        tensors |= by_key({n: m[moment] for n, m in optimizer.moments.items()}, moment)
    step = float(optimizer.step)
    extra_args = {**run.args(), "use_distributed_optimizer": distributed, "no_save_optim": False}
    if distributed:
        tensors |= by_key(weights, "param")
        state: dict[str, Any] = {
            "optimizer": {"param_groups": param_groups(run, lr, step)},
            "param_state_sharding_type": "fully_reshardable",
        }
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    else:
        inner = {
            "param_groups": param_groups(run, lr, None),
            "state": {"common_step": torch.tensor(step)},
        }
        metadata = {}
        if model_dtype == torch.float32:
            state = inner
        else:
            tensors |= by_key(weights, "fp32_param")
            state = {"optimizer": inner}
    if optimizer.grad_scaler is not None and model_dtype == torch.float16:
        state["grad_scaler"] = optimizer.grad_scaler
    common = {"optimizer": state, "opt_param_scheduler": run.scheduler_state()}
    return DistExtras(tensors, common, extra_args, metadata)
