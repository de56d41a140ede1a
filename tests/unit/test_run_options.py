"""The run's options are resolved once, by one rule, from the flags and the plan
(megatron_het.arguments.options): a flag at its default says nothing, a flag given fills what
the plan leaves unset, a flag that contradicts a plan file is one error naming both, and under
--plan auto the planner's choices give way to the flags given."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_het.arguments import parse_run_config
from megatron_het.arguments.options import resolve_run_options
from megatron_het.config import RunOptions
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan

REPO = Path(__file__).resolve().parents[2]
PLAN = json.loads((REPO / "scripts/plans/cpu_emulated_tp2_pp2.json").read_text())
BASE = [
    "--model",
    "tiny",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "300",
]

# (flag, the plan key it sets, the flag's value, the other value)
BOOLEAN_FLAGS = [
    ("--use-distributed-optimizer", "use_distributed_optimizer", True, False),
    ("--sequence-parallel", "sequence_parallel", True, False),
    ("--overlap-grad-reduce", "overlap_grad_reduce", True, False),
    ("--no-overlap-p2p-communication", "overlap_p2p_comm", False, True),
]


def _resolve(flags: list[str], plan_keys: dict | None = None, auto: bool = False):
    run = parse_run_config([*BASE, *flags, *(["--plan", "auto"] if auto else [])])
    plan = ParallelPlan.from_dict({**PLAN, **(plan_keys or {})})
    return resolve_run_options(run.parallel, run.train, plan)


def test_without_flags_the_plan_decides_and_defaults_fill_the_rest() -> None:
    plan, options = _resolve([])
    assert options == RunOptions(dtype="fp32", fused_elementwise=False)
    plan, options = _resolve([], {"use_distributed_optimizer": True, "dtype": "bf16"})
    assert options.use_distributed_optimizer and options.dtype == "bf16"
    assert not options.overlap_grad_reduce and options.overlap_p2p_comm


@pytest.mark.parametrize("flag, key, value, other", BOOLEAN_FLAGS)
def test_a_flag_fills_what_the_plan_leaves_unset(flag, key, value, other) -> None:
    plan, options = _resolve([flag])
    assert getattr(plan, key) is value  # the plan says what the run does
    if key in RunOptions.__dataclass_fields__:
        assert getattr(options, key) is value


@pytest.mark.parametrize("flag, key, value, other", BOOLEAN_FLAGS)
def test_a_flag_that_agrees_with_the_plan_is_fine(flag, key, value, other) -> None:
    plan, _ = _resolve([flag], {key: value})
    assert getattr(plan, key) is value


@pytest.mark.parametrize("flag, key, value, other", BOOLEAN_FLAGS)
def test_a_flag_that_contradicts_the_plan_file_names_both(flag, key, value, other) -> None:
    with pytest.raises(UserError) as info:
        _resolve([flag], {key: other})
    assert str(info.value) == (
        f'{flag} contradicts the plan\'s "{key}": {json.dumps(other)}; drop {flag} or set '
        f'"{key}": {json.dumps(value)} in the plan'
    )


@pytest.mark.parametrize("flag, key, value, other", BOOLEAN_FLAGS)
def test_the_flags_given_beat_a_searched_plan(flag, key, value, other) -> None:
    plan, options = _resolve([flag], {key: other}, auto=True)
    assert getattr(plan, key) is value


def test_the_precision_follows_the_same_rule() -> None:
    assert _resolve(["--bf16"])[1].dtype == "bf16"
    assert _resolve([], {"dtype": "bf16"})[1].dtype == "bf16"
    with pytest.raises(
        UserError,
        match=r'^--fp16 contradicts the plan\'s dtype bf16; drop --fp16 or set "dtype": "fp16"',
    ):
        _resolve(["--fp16"], {"dtype": "bf16"})


def test_recompute_flags_fill_a_plan_without_recompute_and_must_agree_with_one_that_has_it() -> (
    None
):
    flags = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    flags += ["--recompute-num-layers", "1"]
    plan, _ = _resolve(flags)
    assert all(st.recompute for st in plan.pipelines[0].stages)
    recomputed = json.loads(json.dumps(PLAN))
    for stage in recomputed["pipelines"][0]["stages"]:
        stage["recompute"] = True
    run = parse_run_config([*BASE, *flags])
    resolve_run_options(run.parallel, run.train, ParallelPlan.from_dict(recomputed))  # agrees
    block = parse_run_config(
        [*BASE, "--recompute-granularity", "full", "--recompute-method", "block"]
        + ["--recompute-num-layers", "1"]
    )
    with pytest.raises(UserError, match="contradicts the recompute the plan's stages set"):
        resolve_run_options(block.parallel, block.train, ParallelPlan.from_dict(recomputed))


def test_options_that_need_another_say_which_asked() -> None:
    with pytest.raises(UserError, match="^--grad-reduce-in-bf16 needs bf16 training"):
        _resolve(["--grad-reduce-in-bf16"])
    with pytest.raises(UserError, match="^the plan's grad_reduce_in_bf16 needs bf16 training"):
        _resolve([], {"grad_reduce_in_bf16": True})
    with pytest.raises(UserError, match="^--overlap-param-gather overlaps the distributed"):
        _resolve(["--overlap-param-gather"])
    with pytest.raises(UserError, match="^--tp-comm-overlap overlaps sequence parallelism"):
        _resolve(["--tp-comm-overlap"])


def test_what_if_options_come_from_a_plan_with_given_replacements() -> None:
    plan = ParallelPlan.from_dict({**PLAN, "overlap_grad_reduce": True})
    assert RunOptions.from_plan(plan).overlap_grad_reduce
    assert RunOptions.from_plan(plan).dtype == "bf16"  # the predictor's default precision
    assert not RunOptions.from_plan(plan, overlap_grad_reduce=False).overlap_grad_reduce
    assert dataclasses.replace(RunOptions(), dtype="fp32") == RunOptions().replace(dtype="fp32")


def test_a_searched_plan_is_made_for_the_options_the_flags_give() -> None:
    """--plan auto's search is handed the command line's own options: its precision, its
    layers' mode and bucket size, and the options given (defaults for the rest)."""
    from megatron_het.arguments.options import flag_options

    run = parse_run_config(BASE)
    assert flag_options(run.parallel, run.train) == RunOptions(
        dtype="fp32", fused_elementwise=False
    )
    run = parse_run_config(
        [*BASE, "--bf16", "--compile", "--use-distributed-optimizer", "--ddp-bucket-size", "64"]
        + ["--no-overlap-p2p-communication"]
    )
    assert flag_options(run.parallel, run.train) == RunOptions(
        dtype="bf16",
        use_distributed_optimizer=True,
        overlap_p2p_comm=False,
        ddp_bucket_size=64,
        fused_elementwise=True,
    )
