"""--overlap-param-gather's waits: each part of a stage (embedding, every layer, the head)
waits right before it runs for the all-gathers of the buckets holding its parameters, the head
also for a tied embedding's; the waits sit between layers, so compiled layers keep one graph."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_het.config import model_preset
from megatron_het.model.llama import LlamaModel
from megatron_het.optim.parallel_optimizer import _wait_for_gathers

TIED = model_preset("tiny-tied")


class Gathers:
    """A stand-in for FlatParams: one bucket per parameter, recording the waits."""

    def __init__(self, stage: torch.nn.Module) -> None:
        names = [name for name, _ in stage.named_parameters()]
        self.bucket_of = {name: index for index, name in enumerate(names)}
        self.buckets = SimpleNamespace(
            slots=[SimpleNamespace(name=n, bucket=i) for n, i in self.bucket_of.items()]
        )
        self.waits: list[tuple[int, ...]] = []

    def wait_param_gather(self, buckets) -> None:
        self.waits.append(tuple(buckets))

    def names(self, waited: tuple[int, ...]) -> set[str]:
        return {n for n, i in self.bucket_of.items() if i in waited}


def test_each_part_waits_for_its_own_buckets_in_forward_order() -> None:
    stage = LlamaModel(TIED)  # one stage: embedding, layers 0-3, head (tied)
    flat = Gathers(stage)
    _wait_for_gathers(stage, flat)
    tokens = torch.randint(0, TIED.vocab_size, (2, 8))
    stage(tokens, labels=tokens)
    parts = [flat.names(w) for w in flat.waits]
    assert parts[0] == {"embedding.weight"}
    for i in range(TIED.num_layers):
        assert parts[1 + i] == {n for n in flat.bucket_of if n.startswith(f"layers.{i}.")}
    # the head multiplies by the tied embedding: it waits for that bucket too
    assert parts[-1] == {"final_norm.weight", "embedding.weight"}
    assert len(parts) == TIED.num_layers + 2


def test_a_last_stage_with_a_tied_copy_waits_for_it_before_the_head() -> None:
    stage = LlamaModel(TIED, layer_range=(2, 4), has_embedding=False, has_head=True)
    flat = Gathers(stage)
    _wait_for_gathers(stage, flat)
    stage(torch.randn(2, 8, TIED.hidden_size), labels=torch.randint(0, TIED.vocab_size, (2, 8)))
    assert [flat.names(w) for w in flat.waits][-1] == {"final_norm.weight", "embedding.weight"}
    assert "embedding.weight" not in set().union(*(flat.names(w) for w in flat.waits[:-1]))


def test_an_untied_head_waits_for_its_output_matrix_only() -> None:
    config = model_preset("tiny")
    stage = LlamaModel(config, layer_range=(3, 4), has_embedding=False, has_head=True)
    flat = Gathers(stage)
    _wait_for_gathers(stage, flat)
    stage(torch.randn(1, 4, config.hidden_size))
    assert [flat.names(w) for w in flat.waits][-1] == {"final_norm.weight", "output.weight"}


@pytest.mark.slow
def test_compiled_layers_run_with_the_waits_set() -> None:
    from megatron_het.model.compile import compile_available, compile_layers

    ok, why = compile_available("cpu")
    if not ok:
        pytest.skip(why)
    torch.manual_seed(0)
    stage = LlamaModel(TIED)
    tokens = torch.randint(0, TIED.vocab_size, (2, 8))
    expected = stage(tokens, labels=tokens)
    flat = Gathers(stage)
    _wait_for_gathers(stage, flat)
    compile_layers(stage)  # fullgraph: a wait inside a layer's graph would fail to compile
    got = stage(tokens, labels=tokens)
    got.backward()
    assert torch.allclose(got, expected, rtol=1e-5)
    assert len(flat.waits) == TIED.num_layers + 2


def test_a_tensor_parallel_head_waits_for_its_buckets_too(monkeypatch) -> None:
    """The TP model overrides the head: it must wait like LlamaModel's (a head reading a
    bucket still being gathered would read half-written weights)."""
    from megatron_het.tensor_parallel import apply

    config = model_preset("tiny")
    stage = LlamaModel(config, layer_range=(3, 4), has_embedding=False, has_head=True)
    stage.__class__ = apply.TensorParallelLlamaModel  # a one-rank group's TP model
    stage.tp_group, stage.vocab_range, stage.sequence_parallel = None, (0, config.vocab_size), False
    monkeypatch.setattr(
        apply, "vocab_parallel_linear_cross_entropy", lambda normed, *_, **__: normed.sum()
    )
    flat = Gathers(stage)
    _wait_for_gathers(stage, flat)
    stage(torch.randn(1, 4, config.hidden_size), labels=torch.randint(0, 8, (1, 4)))
    assert [flat.names(w) for w in flat.waits][-1] == {"final_norm.weight", "output.weight"}
