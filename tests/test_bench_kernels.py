"""bench/kernels.py: its ``--quick`` run's JSON, and every implementation it times giving the
reference's outputs and gradients (never its timings)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import kernels
from bench.kernel_cases import DTYPES, FWD, FWD_BWD, OPS, QUICK_SHAPES, STEP, build_cases

RESULT_KEYS = {
    "implementation",
    "median_ms",
    "min_ms",
    "max_ms",
    "gb_per_s",
    "first_call_s",
    "max_rel_err",
    "matches_reference",
}


def run_quick(*flags: str) -> tuple[dict, list[str]]:
    lines: list[str] = []
    record = kernels.main(["--quick", "--threads", "1", *flags], echo=lines.append)
    assert json.loads(lines[-1]) == json.loads(json.dumps(record))
    return record, lines


def check_record(record: dict, compiled: bool, ops: tuple[str, ...] = OPS) -> None:
    cases = record["cases"]
    assert record["benchmark"] == "kernels" and record["quick"] is True
    assert len(record["summary"]) == len(cases)
    assert {(c["op"], c["pass"]) for c in cases} == {
        *((op, p) for op in ops if op != "adamw" for p in (FWD, FWD_BWD)),
        *((("adamw", STEP),) if "adamw" in ops else ()),
    }
    for case in cases:
        assert "error" not in case, case
        results = case["results"]
        expected = {"ours", "fused"} if case["op"] == "adamw" else {"ours", "eager"}
        if case["op"] in ("rms_norm", "add_rms_norm", "rope", "cross_entropy"):
            expected.add("formula")
        if compiled and case["op"] != "adamw":
            expected.add("compiled")
        assert set(results) == expected, case["op"]
        assert set(case["ratios"]) == {f"{name}/ours" for name in expected - {"ours"}}
        assert set(case["paired_ratios"]) == set(case["ratios"])
        assert case["bytes"] > 0 and case["iters_per_round"] >= 1
        for name, result in results.items():
            assert RESULT_KEYS <= set(result), name
            assert result["min_ms"] <= result["median_ms"] <= result["max_ms"]
            assert result["matches_reference"], (case["op"], case["dtype"], case["pass"], name)
        assert ("compile_s" in results.get("compiled", {})) == ("compiled" in results)


def test_quick_run_prints_every_case_as_json() -> None:
    record, lines = run_quick("--no-compile")
    assert len(lines) == len(record["cases"]) + 1
    assert [json.loads(line) for line in lines[:-1]] == record["cases"]
    assert record["dtypes"] == list(DTYPES) and record["threads"] == 1
    assert record["compile"] is False and record["rounds"] == 3
    check_record(record, compiled=False)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_implementation_matches_the_reference(dtype: str) -> None:
    """Outputs and input gradients of each implementation, on fresh inputs, against the
    case's reference (our compiled kernels where built)."""
    for case in build_cases(QUICK_SHAPES, OPS, (dtype,), with_compile=False):
        variants = {v.name: v for v in case.variants}
        want = variants[case.reference].prepare(case.make_inputs())()
        for name, variant in variants.items():
            got = variant.prepare(case.make_inputs())()
            assert len(got) == len(want), (case.op, name)
            for a, b in zip(got, want, strict=True):
                tol = case.tolerance * max(b.detach().abs().max().item(), 1.0)
                torch.testing.assert_close(
                    a.detach().float(), b.detach().float(), rtol=case.tolerance, atol=tol
                )


@pytest.mark.slow
def test_quick_run_with_torch_compile() -> None:
    # one op: the compiled contestant's plumbing, without a cold compile of every case
    record, _ = run_quick("--dtypes", "fp32", "--ops", "rms_norm")
    check_record(record, compiled=True, ops=("rms_norm",))


@pytest.mark.parametrize(
    "flags",
    [["--ops", "rms_norm,gelu"], ["--dtypes", "fp8"], ["--rounds", "3"], ["--shapes", "huge"]],
)
def test_bad_flags_are_refused(flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        kernels.parse_args(flags)


def test_flags_pick_shapes_and_rounds() -> None:
    args = kernels.parse_args(["--shapes", "llama2-7b", "--ops", "rope"])
    assert [s.preset for s in args.shape_list] == ["llama2-7b"] and args.ops == ("rope",)
    assert args.rounds == kernels.MIN_ROUNDS and args.threads == 2
    quick = kernels.parse_args(["--quick", "--rounds", "1"])
    assert [s.preset for s in quick.shape_list] == ["tiny"] and quick.rounds == 1
