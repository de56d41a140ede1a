"""Generator state capture and restore (training/state.py) with fake accelerator modules: a CPU
rank never touches torch.cuda, a resume restores the rank's device generator onto the device
it runs on now."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

from megatron_het.training.state import rng_state, seed_everything, set_rng_state
from tests.unit.test_launch_devices import FakeAccelerator, Untouchable, install_npu


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3)


def assert_same_draws(a: tuple, b: tuple) -> None:
    assert a[:2] == b[:2] and torch.equal(a[2], b[2])


class UninitialisedCuda(Untouchable):
    """A GPU host's torch.cuda before anything initialised CUDA: only the check is allowed."""

    def is_initialized(self) -> bool:
        return False


# "cpu": torch.cuda is not touched at all; None (no device type given): only asked whether
# this process initialised CUDA.
@pytest.mark.parametrize("device_type, cuda", [("cpu", Untouchable()), (None, UninitialisedCuda())])
def test_a_cpu_rank_round_trips_without_torch_cuda(
    monkeypatch: pytest.MonkeyPatch, device_type, cuda
) -> None:
    seed_everything(5)
    monkeypatch.setattr(torch, "cuda", cuda)
    state = rng_state(device_type)
    assert "cuda" not in state
    expected = draws()
    # A GPU rank's state loaded on a CPU rank: its CUDA part is left alone.
    set_rng_state({**state, "cuda": [torch.tensor([1], dtype=torch.uint8)]}, device_type)
    assert_same_draws(draws(), expected)


def test_a_cuda_rank_captures_its_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeAccelerator(3)
    monkeypatch.setattr(torch, "cuda", cuda)
    cuda.current = 2
    assert int(rng_state("cuda")["cuda"][0]) == 12
    assert int(rng_state()["cuda"][0]) == 12  # initialised: asked


@pytest.mark.parametrize(
    "saved_on, devices, now_on",
    [
        (1, 2, 1),  # the same device
        (1, 1, 0),  # relaunched with one visible device: the rank's device is now index 0
        (0, 4, 3),  # moved to another device of the host
    ],
)
def test_restore_goes_to_the_device_the_rank_runs_on(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    saved_on: int,
    devices: int,
    now_on: int,
) -> None:
    before = FakeAccelerator(2)
    before.current = saved_on
    monkeypatch.setattr(torch, "cuda", before)
    state = rng_state("cuda")
    now = FakeAccelerator(devices)
    now.current = now_on
    monkeypatch.setattr(torch, "cuda", now)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_rng_state(state, "cuda")
    assert now.calls == [("set_rng_state", now_on, 10 + saved_on)]
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("current, restored", [(1, [("set_rng_state", 1, 11)]), (2, [])])
def test_a_state_of_every_visible_device_restores_the_current_ones_entry(
    monkeypatch: pytest.MonkeyPatch, current: int, restored: list
) -> None:
    now = FakeAccelerator(3)
    now.current = current
    monkeypatch.setattr(torch, "cuda", now)
    state = {
        **rng_state("cpu"),
        "cuda": [torch.tensor([10 + i], dtype=torch.uint8) for i in range(2)],
    }
    if restored:
        set_rng_state(state, "cuda")
    else:
        with pytest.warns(UserWarning, match="none for device 2"):
            set_rng_state(state, "cuda")
    assert now.calls == restored


def test_an_ascend_rank_keeps_its_npu_generators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "cuda", Untouchable())
    install_npu(monkeypatch, FakeAccelerator(2))
    state = rng_state("npu")
    assert int(state["npu"][0]) == 10 and "cuda" not in state
    now = FakeAccelerator(1)
    install_npu(monkeypatch, now)
    set_rng_state(state, "npu")
    assert now.calls == [("set_rng_state", 0, 10)]
