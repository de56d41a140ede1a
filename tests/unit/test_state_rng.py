"""Generator state capture and restore (training/state.py) with fake accelerator modules: a CPU
rank never touches torch.cuda, a resume with fewer visible devices restores those it has."""
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
@pytest.mark.parametrize("device_type, cuda", [("cpu", Untouchable()),
                                               (None, UninitialisedCuda())])
def test_a_cpu_rank_round_trips_without_torch_cuda(monkeypatch: pytest.MonkeyPatch,
                                                   device_type, cuda) -> None:
    seed_everything(5)
    monkeypatch.setattr(torch, "cuda", cuda)
    state = rng_state(device_type)
    assert "cuda" not in state
    expected = draws()
    # A GPU rank's state loaded on a CPU rank: its CUDA part is left alone.
    set_rng_state({**state, "cuda": [torch.tensor([1], dtype=torch.uint8)]}, device_type)
    assert_same_draws(draws(), expected)


def test_a_cuda_rank_captures_every_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "cuda", FakeAccelerator(3))
    state = rng_state("cuda")
    assert [int(s[0]) for s in state["cuda"]] == [10, 11, 12]
    assert [int(s[0]) for s in rng_state()["cuda"]] == [10, 11, 12]  # initialised: asked


@pytest.mark.parametrize("devices, restored", [
    (1, [("set_rng_state", 0, 10)]),  # fewer devices visible than saved: the first one
    (2, [("set_rng_state", 0, 10), ("set_rng_state", 1, 11)]),
    (4, [("set_rng_state", 0, 10), ("set_rng_state", 1, 11)]),  # the extra two keep theirs
])
def test_restore_goes_to_the_devices_that_exist_by_index(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, devices: int,
        restored: list) -> None:
    monkeypatch.setattr(torch, "cuda", FakeAccelerator(2))
    state = rng_state("cuda")
    now = FakeAccelerator(devices)
    monkeypatch.setattr(torch, "cuda", now)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_rng_state(state, "cuda")
    assert now.calls == restored
    assert capsys.readouterr() == ("", "")


def test_an_ascend_rank_keeps_its_npu_generators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "cuda", Untouchable())
    install_npu(monkeypatch, FakeAccelerator(2))
    state = rng_state("npu")
    assert [int(s[0]) for s in state["npu"]] == [10, 11] and "cuda" not in state
    now = FakeAccelerator(1)
    install_npu(monkeypatch, now)
    set_rng_state(state, "npu")
    assert now.calls == [("set_rng_state", 0, 10)]
