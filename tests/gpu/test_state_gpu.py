"""A CUDA/ROCm rank's local device and generator states on a real device (skipped without a
GPU): selection by local rank, a restore that matches the draws, and a resume that saved more
devices than it sees."""
import pytest
import torch

from megatron_het.training.launch import select_local_device
from megatron_het.training.state import rng_state, set_rng_state

pytestmark = pytest.mark.gpu


def test_a_cuda_rank_selects_its_local_device():
    count = torch.cuda.device_count()
    before = torch.cuda.current_device()
    try:
        select_local_device("cuda", count + 1)
        assert torch.cuda.current_device() == (count + 1) % count
    finally:
        torch.cuda.set_device(before)


def test_cuda_generators_round_trip_and_survive_fewer_devices():
    torch.cuda.manual_seed_all(11)
    state = rng_state("cuda")
    assert len(state["cuda"]) == torch.cuda.device_count()
    expected = torch.rand(4, device="cuda")
    # Saved on a host with more devices than this one sees: the visible ones are restored.
    set_rng_state({**state, "cuda": [*state["cuda"], *state["cuda"]]}, "cuda")
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    set_rng_state(state)  # no device type: CUDA is initialised here, so it is restored too
    assert torch.equal(torch.rand(4, device="cuda"), expected)
