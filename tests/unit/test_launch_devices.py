"""Selecting a rank's local device (training/launch.py) with fake accelerator modules: CUDA and
Ascend ranks select theirs, a CPU rank never touches torch.cuda (no CUDA context on GPU hosts)."""
from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.distributed as dist

from megatron_het.training.launch import init_world, select_local_device, shutdown_world


class Untouchable:
    """Stands in for torch.cuda where nothing may be called: any attribute fails the test."""

    def __getattr__(self, name: str):
        if name.startswith("__"):  # introspection (pytest's ids, repr), not a CUDA call
            raise AttributeError(name)
        raise AssertionError(f"torch.cuda.{name} used on a rank that must not touch CUDA")


class FakeAccelerator:
    """A torch.cuda / torch.npu of ``devices`` devices whose generator state ``i`` is
    ``tensor([10 + i])``; records the calls that change anything."""

    def __init__(self, devices: int, initialised: bool = True) -> None:
        self.devices, self.initialised = devices, initialised
        self.states = [torch.tensor([10 + i], dtype=torch.uint8) for i in range(devices)]
        self.calls: list[tuple] = []
        self.current = 0

    def is_initialized(self) -> bool:
        return self.initialised

    def device_count(self) -> int:
        return self.devices

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))
        self.current = index

    def current_device(self) -> int:
        return self.current

    def get_rng_state(self, device: int) -> torch.Tensor:
        return self.states[device].clone()

    def set_rng_state(self, state: torch.Tensor, device: int) -> None:
        self.calls.append(("set_rng_state", device, int(state[0])))
        self.states[device] = state.clone()


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "cuda", Untouchable())


def install_npu(monkeypatch: pytest.MonkeyPatch, npu: object) -> None:
    """torch_npu importable (a stub module) and ``torch.npu`` the fake, as torch_npu makes it."""
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", npu, raising=False)


def test_a_cpu_rank_leaves_torch_cuda_alone(no_cuda: None) -> None:
    select_local_device("cpu", 3)
    select_local_device(None, 3)
    init_world(None, device_type="cpu")
    try:
        assert dist.get_world_size() == 1
    finally:
        shutdown_world()


@pytest.mark.parametrize("devices, local_rank, expected", [
    (2, 3, [("set_device", 1)]), (4, 2, [("set_device", 2)]), (0, 1, [])])
def test_a_cuda_rank_selects_its_local_device(monkeypatch: pytest.MonkeyPatch, devices: int,
                                              local_rank: int, expected: list) -> None:
    cuda = FakeAccelerator(devices)
    monkeypatch.setattr(torch, "cuda", cuda)
    select_local_device("cuda", local_rank)
    assert cuda.calls == expected


def test_an_ascend_rank_selects_its_npu(monkeypatch: pytest.MonkeyPatch, no_cuda: None) -> None:
    npu = FakeAccelerator(8)
    install_npu(monkeypatch, npu)
    select_local_device("npu", 11)
    assert npu.calls == [("set_device", 3)]


def test_an_ascend_rank_without_torch_npu_selects_nothing(monkeypatch: pytest.MonkeyPatch,
                                                          no_cuda: None) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    monkeypatch.setattr(torch, "npu", Untouchable(), raising=False)
    select_local_device("npu", 0)


# ---- a rank's hardware against the kind the cluster file gives it --------------------------
def _kind(name: str):
    from megatron_het.cluster.accelerators import get_accelerator
    return get_accelerator(name)


@pytest.mark.parametrize("name", ["cpu", "emu-slow"])
def test_cpu_and_emulated_kinds_fit_any_process(monkeypatch, name: str) -> None:
    from megatron_het.training.launch import device_problem

    monkeypatch.setattr(torch, "cuda", Untouchable())
    assert device_problem(_kind(name)) is None


@pytest.mark.parametrize("name, hip, devices, problem", [
    ("MI300X", None, 8, "an AMD kind on a torch built without ROCm"),
    ("H100", "6.2", 8, "an NVIDIA kind on a torch built for ROCm"),
    ("H100", None, 0, "no GPU is visible"),
    ("MI300X", "6.2", 0, "no GPU is visible"),
    ("H100", None, 8, None),
    ("MI250X", "6.2", 8, None),
])
def test_a_gpu_kind_needs_its_vendors_build_and_a_gpu(monkeypatch, name, hip, devices,
                                                      problem) -> None:
    from megatron_het.training.launch import device_problem

    fake = FakeAccelerator(devices)
    fake.is_available = lambda: devices > 0
    monkeypatch.setattr(torch, "cuda", fake)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert device_problem(_kind(name)) == problem


def test_an_ascend_kind_needs_torch_npu_and_a_device(monkeypatch) -> None:
    from megatron_het.training.launch import device_problem

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    assert device_problem(_kind("Ascend910B")) == "torch_npu is not importable here"
    install_npu(monkeypatch, FakeAccelerator(0))
    assert device_problem(_kind("Ascend910B")) == "no Ascend device is visible"
    install_npu(monkeypatch, FakeAccelerator(8))
    assert device_problem(_kind("Ascend910B")) is None
