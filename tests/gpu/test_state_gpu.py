"""A CUDA/ROCm rank's local device and generator states on a real device (skipped without a
GPU): selection by local rank and a restore of the rank's device generator that matches the
draws."""

import pytest
import torch

from megatron_het.launcher.rank_device import select_local_device
from megatron_het.training.state import rng_state, set_rng_state

pytestmark = pytest.mark.gpu


def test_a_cuda_rank_selects_its_device_and_never_wraps_onto_another():
    count = torch.cuda.device_count()
    before = torch.cuda.current_device()
    try:
        select_local_device("cuda", count - 1)
        assert torch.cuda.current_device() == count - 1
        torch.cuda.set_device(before)
        select_local_device("cuda", count)  # not visible: no device selected (it is reported)
        assert torch.cuda.current_device() == before
    finally:
        torch.cuda.set_device(before)


def test_the_rank_devices_generator_round_trips():
    torch.cuda.manual_seed_all(11)
    state = rng_state("cuda")
    assert isinstance(state["cuda"], torch.Tensor)  # the current device's
    expected = torch.rand(4, device="cuda")
    set_rng_state(state, "cuda")
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    set_rng_state(state)  # no device type: CUDA is initialised here, so it is restored too
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    # a state saved as one per visible device: the current device's entry
    index = torch.cuda.current_device()
    set_rng_state({**state, "cuda": [state["cuda"]] * (index + 1)}, "cuda")
    assert torch.equal(torch.rand(4, device="cuda"), expected)
