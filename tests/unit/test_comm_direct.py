"""Choosing the backend of a direct bridge from the kinds of the world (pure, no processes)."""

from __future__ import annotations

import pytest

from megatron_het.cluster.accelerators import get_accelerator
from megatron_het.comm.direct import choose_direct_backend, spanning_backend
from megatron_het.errors import UserError


def tables(*names: str) -> tuple[list[str], dict, dict, dict]:
    """Two ranks of every named built-in accelerator, with its backend/device/library tables."""
    specs = {n: get_accelerator(n) for n in names}
    kinds = [n for n in names for _ in range(2)]
    return (
        kinds,
        {n: s.native_backend for n, s in specs.items()},
        {n: s.device_type for n, s in specs.items()},
        {n: s.collective_library for n, s in specs.items()},
    )


@pytest.mark.parametrize(
    "names, backend",
    [
        (("H100",), "nccl"),
        (("H100", "A100-80G"), "nccl"),  # one vendor: NCCL spans both kinds
        (("MI250X", "MI300X"), "nccl"),  # one ROCm build: RCCL under torch's "nccl" name
        (("emu-fast", "emu-slow"), "gloo"),  # CPU emulation
        (("Ascend910B",), "hccl"),
    ],
)
def test_a_shared_native_stack_is_chosen(names: tuple[str, ...], backend: str) -> None:
    assert choose_direct_backend(*tables(*names)) == backend


@pytest.mark.parametrize(
    "names, says",
    [
        (("H100", "MI300X"), "H100 uses nccl on cuda and MI300X uses nccl (rccl) on cuda"),
        (("H100", "cpu"), "H100 uses nccl on cuda and cpu uses gloo on cpu"),
        (("A100-80G", "Ascend910B"), "A100-80G uses nccl on cuda and Ascend910B uses hccl on npu"),
    ],
)
def test_no_spanning_backend_is_a_one_line_user_error(names: tuple[str, ...], says: str) -> None:
    with pytest.raises(UserError) as info:
        choose_direct_backend(*tables(*names))
    text = str(info.value)
    assert "\n" not in text
    assert says in text and text.endswith("use --bridge relay")
    assert spanning_backend(*tables(*names)) is None


def test_without_library_table_the_backend_name_is_the_library() -> None:
    kinds, backends, devices, _ = tables("H100", "MI300X")
    # A caller that knows only backend names cannot tell NCCL from RCCL.
    assert spanning_backend(kinds, backends, devices) == "nccl"
    assert spanning_backend(kinds, backends, devices, {"MI300X": "rccl"}) is None


def test_kinds_are_deduplicated_and_listed_once_per_stack() -> None:
    kinds = ["a", "b", "a", "c"]
    backends = {"a": "nccl", "b": "nccl", "c": "gloo"}
    devices = {"a": "cuda", "b": "cuda", "c": "cpu"}
    with pytest.raises(UserError, match=r"a uses nccl on cuda and c uses gloo on cpu; use"):
        choose_direct_backend(kinds, backends, devices)
