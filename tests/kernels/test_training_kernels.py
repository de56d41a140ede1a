"""Training with the compiled kernels equals training with the torch references (fp32, 8
iterations): every iteration's loss and gradient norm, and every parameter tensor at the end,
within 1e-5 relative — on one process, and on a heterogeneous plan across emulated kinds (a
TP-2 replica, whose head is vocabulary-parallel, beside a 2-stage replica).

Parameters are compared as tensors (the norm of the difference against the norm of the
reference): Adam divides each gradient element by its own running magnitude, so an element
whose gradient is a near-cancelling sum moves by a learning-rate-sized step on a last-bit
difference, whatever kernel summed it; element-wise relative errors measure that, not the
kernels."""

from __future__ import annotations

import pathlib

import pytest

from megatron_het.checkpoint.reader import load_model_state
from tests.distributed.test_parallel_training import (
    BASE,
    CLUSTER,
    PLANS,
    TRAIN_ITERS,
    records,
    run_parallel,
    run_single,
)

RTOL = 1e-5


def assert_same_training(kernels: pathlib.Path, reference: pathlib.Path) -> None:
    """Metrics files and final checkpoints (``<metrics>.ckpt``) of two runs agree."""
    got, want = records(kernels, "train"), records(reference, "train")
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want]
    assert len(got) == TRAIN_ITERS
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=RTOL), key
    _, params = load_model_state(kernels.with_suffix(".ckpt"))
    _, ref_params = load_model_state(reference.with_suffix(".ckpt"))
    assert params.keys() == ref_params.keys()
    for name, value in params.items():
        error = (value - ref_params[name]).norm() / ref_params[name].norm()
        assert error <= RTOL, f"{name}: relative error {error:.3g}"


def run_args(path: pathlib.Path, *extra: str) -> list[str]:
    save = ["--save", str(path.with_suffix(".ckpt")), "--save-interval", str(TRAIN_ITERS)]
    return [*BASE, "--metrics-file", str(path), *save, *extra]


@pytest.mark.slow
def test_one_process_training_equals_the_references(tmp_path):
    runs = {name: tmp_path / f"{name}.jsonl" for name in ("kernels", "reference")}
    text = run_single(run_args(runs["kernels"], "--model", "tiny"))
    compiled = "rms_norm: csrc C++, rope: csrc C++, cross_entropy: csrc C++, swiglu: csrc C++"
    assert f"> kernels on cpu: {compiled}" in text
    reference = run_single(run_args(runs["reference"], "--model", "tiny", "--reference-kernels"))
    torch_only = "rms_norm: torch, rope: torch, cross_entropy: torch, swiglu: torch"
    assert f"> kernels on cpu: {torch_only}" in reference
    assert_same_training(runs["kernels"], runs["reference"])


@pytest.mark.distributed
def test_heterogeneous_plan_training_equals_the_references(tmp_path):
    plan = ["--cluster", CLUSTER, "--plan", str(PLANS / "cpu_emulated_hetero_dp.json")]
    runs = {name: tmp_path / f"{name}.jsonl" for name in ("kernels", "reference")}
    run_parallel(run_args(runs["kernels"], "--model", "tiny-tied", *plan))
    run_parallel(run_args(runs["reference"], "--model", "tiny-tied", *plan, "--reference-kernels"))
    assert_same_training(runs["kernels"], runs["reference"])
