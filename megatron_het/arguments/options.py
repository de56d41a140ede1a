"""The run's options, resolved once: the command line's flags merged with the plan's keys.

A plan file may set the options a flag sets (``"use_distributed_optimizer": true`` beside
``--use-distributed-optimizer``, ``"dtype"`` beside ``--bf16``, ``"sequence_parallel"``,
a stage's ``"recompute"`` ...). One rule decides, for every option alike:

- a flag left at its default says nothing: the plan's value holds, else the default;
- a flag given and a plan silent on it: the flag's value;
- a flag given and a plan file that says otherwise: one error naming both;
- under ``--plan auto`` the planner's choices give way to the flags given (the plan is the
  planner's, not the user's, so nothing contradicts the command line).

:func:`resolve_run_options` returns the plan with every option the command line gave written into
it (so the plan says what the run does: the stages' builder reads its ``sequence_parallel``,
``tp_comm_overlap`` and recompute, a checkpoint records it) and one
:class:`~megatron_het.config.RunOptions`; the trainer, the predictor and the dry run all take
that same object.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from megatron_het.arguments.run_config import ParallelSpec
from megatron_het.config import RunOptions, TrainConfig
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_builders import with_recompute

# (plan key, flag, the flag's value when given); a flag not given is absent from a run's list.
_Given = tuple[str, str, Any]


def given_flags(spec: ParallelSpec, train: TrainConfig) -> list[_Given]:
    """The options the command line gives explicitly (flags not left at their default)."""
    given: list[_Given] = []
    if train.bf16 or train.fp16:
        dtype = "bf16" if train.bf16 else "fp16"
        given.append(("dtype", f"--{dtype}", dtype))
    for key in (
        "use_distributed_optimizer",
        "sequence_parallel",
        "tp_comm_overlap",
        "overlap_grad_reduce",
        "overlap_param_gather",
        "grad_reduce_in_bf16",
    ):
        if getattr(spec, key):
            given.append((key, "--" + key.replace("_", "-"), True))
    if not spec.overlap_p2p_comm:
        given.append(("overlap_p2p_comm", "--no-overlap-p2p-communication", False))
    return given


def flag_options(spec: ParallelSpec, train: TrainConfig) -> RunOptions:
    """The options the command line alone gives (defaults for the rest; the precision fp32
    without ``--bf16``/``--fp16``): what a plan searched at start-up (``--plan auto``) is
    priced with, before it joins the resolution."""
    given = {key: value for key, _, value in given_flags(spec, train)}
    return RunOptions(
        dtype=given.get("dtype", "fp32"),
        ddp_bucket_size=spec.ddp_bucket_size,
        fused_elementwise=train.compile,
        **{k: v for k, v in given.items() if k in RunOptions.__dataclass_fields__ and k != "dtype"},
    )


def resolve_run_options(
    spec: ParallelSpec, train: TrainConfig, plan: ParallelPlan
) -> tuple[ParallelPlan, RunOptions]:
    """``plan`` with the options the flags give written into it, and the run's
    :class:`RunOptions`, by the module's rule (``spec.plan == "auto"``: the planner's plan).
    UserError with one line for a flag that contradicts the plan file, or options that do not
    go together."""
    searched = spec.plan == "auto"
    given = given_flags(spec, train)
    for key, flag, value in given:
        said = getattr(plan, key)
        if said is not None and said != value and not searched:
            raise UserError(_contradiction(flag, key, said, value))
    # The plan then says what the run does, for whoever reads it (the stages' builder, a
    # checkpoint's metadata, the predictor).
    plan = dataclasses.replace(plan, **{key: value for key, _, value in given})
    plan = _resolve_recompute(spec, plan, searched)
    options = RunOptions.from_plan(
        plan,
        dtype=plan.dtype or "fp32",
        ddp_bucket_size=spec.ddp_bucket_size,
        fused_elementwise=train.compile,
    )
    _check_together(plan, options, {key for key, _, _ in given})
    return plan, options


def _contradiction(flag: str, key: str, said: Any, value: Any) -> str:
    if key == "dtype":  # (the flag is --bf16 or --fp16)
        return (
            f"{flag} contradicts the plan's dtype {said}; drop {flag} or set "
            f'"dtype": "{value}" in the plan'
        )
    return (
        f"{flag} contradicts the plan's {json.dumps(key)}: {json.dumps(said)}; drop {flag} or "
        f"set {json.dumps(key)}: {json.dumps(value)} in the plan"
    )


def _resolve_recompute(spec: ParallelSpec, plan: ParallelPlan, searched: bool) -> ParallelPlan:
    """The plan with the ``--recompute-*`` flags applied to every stage; UserError where a
    plan file's stages set a recompute the flags do not."""
    if spec.recompute is None:
        return plan
    method, count = spec.recompute
    flagged = with_recompute(plan, count if method == "block" else None)
    planned = any(st.recompute for pipeline in plan.pipelines for st in pipeline.stages)
    if planned and flagged != plan and not searched:
        flags = f"--recompute-method {method} --recompute-num-layers {count}"
        raise UserError(
            f"{flags} contradicts the recompute the plan's stages set; drop the "
            '--recompute-* flags or the stages\' "recompute" keys'
        )
    return flagged


def _check_together(plan: ParallelPlan, options: RunOptions, given: set[str]) -> None:
    """Options that need another: each error names the flag or the plan key that asked."""
    if plan.tp_comm_overlap and not plan.sequence_parallel:
        raise UserError(
            "--tp-comm-overlap overlaps sequence parallelism's all-gathers and reduce-scatters "
            'with the GEMMs; add --sequence-parallel (or "sequence_parallel": true in the plan)'
        )
    if options.grad_reduce_in_bf16 and options.dtype != "bf16":
        if "grad_reduce_in_bf16" in given:
            raise UserError(
                "--grad-reduce-in-bf16 needs bf16 training; add --bf16 (or set "
                '"dtype": "bf16" in the plan) or drop the flag'
            )
        raise UserError(
            f"the plan's grad_reduce_in_bf16 needs bf16 training but the run trains in "
            f"{options.dtype}; add --bf16 or drop the plan's key"
        )
    if options.overlap_param_gather and not options.use_distributed_optimizer:
        if "overlap_param_gather" in given:
            raise UserError(
                "--overlap-param-gather overlaps the distributed optimizer's parameter "
                "all-gather; add --use-distributed-optimizer (or set "
                '"use_distributed_optimizer": true in the plan) or drop the flag'
            )
        raise UserError(
            "the plan's overlap_param_gather needs the distributed optimizer; add "
            "--use-distributed-optimizer or drop the plan's key"
        )
