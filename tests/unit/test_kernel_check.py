"""The GPU check's ``kernels`` rows, off the GPU: its float64 references of the op contract
agree with the compiled CPU ops (small shapes), and without a device every row is SKIP."""

from __future__ import annotations

import pytest
import torch

from tools.gpu_check import kernel_check, kernel_refs

try:
    import megatron_het._C  # noqa: F401  (registers torch.ops.megatron_het.*)

    BUILT = True
except ImportError:
    BUILT = False


def has_cpu_kernel(op: str) -> bool:
    return BUILT and torch._C._dispatch_has_kernel_for_dispatch_key(f"megatron_het::{op}", "CPU")


@pytest.fixture
def small_shapes(monkeypatch):
    """The references' module constants cut from the 7B layer's to a few rows."""
    for name, value in {
        "ROWS": 64,
        "HIDDEN": 256,
        "FFN": 200,
        "SEQ": 24,
        "Q_HEADS": 4,
        "KV_HEADS": 2,
        "HEAD_DIM": 32,
        "CE_ROWS": 48,
        "VOCAB": 3000,
    }.items():
        monkeypatch.setattr(kernel_refs, name, value)


@pytest.mark.parametrize("label", list(kernel_check.DTYPES))
@pytest.mark.parametrize("op", kernel_check.OPS)
def test_the_references_agree_with_the_cpu_ops(op, label, small_shapes):
    if not has_cpu_kernel(op):
        pytest.skip(f"megatron_het._C has no CPU kernel for {op}")
    errors = kernel_check.PARITY[op](torch.device("cpu"), kernel_check.DTYPES[label])
    assert errors and max(errors.values()) <= kernel_check.TOLERANCE[label], errors


def test_a_wrong_output_is_measured_against_the_largest_reference_value():
    expected = torch.tensor([1.0, -4.0, 2.0], dtype=torch.float64)
    assert kernel_check.err(expected.float(), expected) == 0.0
    assert kernel_check.err(torch.tensor([1.0, -4.0, 3.0]), expected) == pytest.approx(0.25)
    assert kernel_check.err(torch.zeros(2), expected) == float("inf")  # wrong shape


def test_bytes_and_bandwidth_arithmetic():
    cos = torch.zeros(100, 64)
    assert kernel_refs.table_bytes(cos, seq=50, offset=16) == 2 * 50 * 64 * 4
    assert kernel_refs.bytes_moved(torch.zeros(4, 8, dtype=torch.bfloat16), cos) == 64 + 25600
    assert kernel_refs.gigabytes_per_second(2 * 10**9, 1000.0) == pytest.approx(2.0)
