"""The profiler on a CUDA/ROCm device: allocator-based activation bytes against the saved-tensor
count, and passes timed by CUDA events (skipped without a GPU)."""

import pytest
import torch

from megatron_het.config import model_preset
from megatron_het.perf.measure.shard_cases import PROFILE_DTYPES, layer_case, rank_stage
from megatron_het.perf.measure.timed_cases import SavedActivations, run_cases
from megatron_het.pipeline.timing import EventTimer, pass_timer

pytestmark = pytest.mark.gpu

TINY = model_preset("tiny")


def cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_allocator_activations_agree_with_the_saved_tensor_count(dtype):
    device = cuda_device()
    stage = rank_stage(TINY, 2, (0, 1), False, False, device, seed=3, dtype=dtype)
    layer = stage.layers["0"]
    entry = run_cases([layer_case(stage, 64, 2, 2, dtype, device)], device, 1, 2)[0]
    x = torch.randn(
        2, 64, TINY.hidden_size, device=device, dtype=PROFILE_DTYPES[dtype], requires_grad=True
    )
    cos, sin = stage.rotary.cos_sin(64, device, PROFILE_DTYPES[dtype])
    with SavedActivations(layer.parameters(), (cos, sin)) as counter:
        out = layer(x, cos, sin)
    # The allocator also holds the output (in place of the saved input) and rounds blocks up.
    assert entry.activation_bytes == pytest.approx(counter.nbytes, rel=0.25)
    assert entry.forward_s > 0 and entry.backward_s > 0
    del out


def test_passes_are_timed_by_cuda_events(monkeypatch: pytest.MonkeyPatch):
    device = cuda_device()
    assert isinstance(pass_timer(device), EventTimer)
    made = []

    class CountedEvent(torch.cuda.Event):
        def __new__(cls, *args, **kwargs):
            event = super().__new__(cls, *args, **kwargs)
            made.append(kwargs.get("enable_timing", False))
            return event

    monkeypatch.setattr(torch.cuda, "Event", CountedEvent)
    stage = rank_stage(TINY, 1, (0, 1), False, False, device, seed=3, dtype="bf16")
    small, large = run_cases(
        [layer_case(stage, 64, mb, 1, "bf16", device) for mb in (1, 32)], device, warmup=2, iters=5
    )
    assert 0 < small.forward_s and 0 < small.backward_s
    assert 0 < large.forward_s and 0 < large.backward_s
    # every timed pass of both cases is marked by timing events (at least a start and an end
    # per forward and backward), not by the host clock
    assert len(made) >= 2 * 2 * 5 and all(made)
