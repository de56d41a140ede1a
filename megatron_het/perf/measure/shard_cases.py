"""What the profiler times: one TP rank's shard of a decoder layer, the embedding, the head and
the optimizer step, as :class:`~megatron_het.perf.measure.timed_cases.Case` objects.

A shard (:func:`rank_stage`) holds ``heads/tp`` query heads, ``kv_groups/tp`` kv heads,
``ffn/tp`` MLP units and a ``vocab/tp`` slice of the embedding and the output layer, exactly as
:func:`megatron_het.tensor_parallel.apply_tp` shards them. TP communication is left out on
purpose: the shard runs with a :class:`ComputeOnlyGroup`, whose collectives do nothing, and the
predictor adds TP communication from its link model.

With ``dtype="bf16"`` the shard's parameters are bf16 and the passes run on bf16 inputs without
autocast, as training runs it (Megatron's mixed precision: bf16 weights, with the fp32 master
weights and main gradients in the optimizer, whose step is measured on its own:
:func:`measure_optimizer_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_het.comm.p2p import P2PHandle, P2POp
from megatron_het.config import ModelConfig, OptimizerConfig
from megatron_het.model.llama import LlamaModel, WeightedLayer, build_model
from megatron_het.model.rope import rope_table_dtype
from megatron_het.optim.clip_grad import clip_grad_norm
from megatron_het.optim.optimizer import build_optimizer
from megatron_het.perf.measure.profile_format import EndEntry, LayerEntry
from megatron_het.perf.measure.timed_cases import Case, activation_bytes, run_cases
from megatron_het.tensor_parallel import apply_tp, check_tp_size, vocab_sizes

PROFILE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The optimizer is timed on up to this many parameters of decoder layers (enough that the
# per-parameter time no longer carries the per-call overhead).
OPTIMIZER_PARAMS = 1 << 24


class ComputeOnlyGroup:
    """Stands in for a TP group of ``size`` ranks whose collectives are skipped.

    A shard built with it runs exactly this rank's computation of the tensor-parallel layers
    (the sums they would receive are left as the local partial values), so a timing of it is
    compute only.
    """

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> None:
        """Nothing: the tensor keeps this rank's contribution."""

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Every slot of ``output`` receives this rank's ``input``."""
        output.view(self.size, -1).copy_(input.reshape(1, -1))

    # The rest of a TP group's interface serves sequence parallelism, which shards built here
    # do not run.
    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.size))

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum"
    ) -> None:
        raise NotImplementedError("a compute-only shard runs without sequence parallelism")

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[P2PHandle]:
        raise NotImplementedError("a compute-only shard runs without sequence parallelism")


def rank_stage(
    config: ModelConfig,
    tp: int,
    layer_range: tuple[int, int],
    has_embedding: bool,
    has_head: bool,
    device: torch.device,
    seed: int,
    dtype: str = "fp32",
) -> LlamaModel:
    """One TP rank's (rank 0's) shard of a stage, built on ``device`` with parameters in
    ``dtype`` (a profile dtype; initialised in fp32, then cast), with TP collectives replaced
    by :class:`ComputeOnlyGroup`'s no-ops."""
    check_tp_size(config, tp)
    vocab_sizes(config.vocab_size, tp)
    stage = build_model(config, seed, layer_range, has_embedding, has_head, device=device)
    if tp > 1:
        apply_tp(stage, ComputeOnlyGroup(tp), config)
    return stage.to(dtype=PROFILE_DTYPES[dtype])


def _check_dtype(module: torch.nn.Module | WeightedLayer, dtype: str) -> torch.dtype:
    """The torch dtype of ``dtype``; ValueError unless ``module``'s parameters have it."""
    want = PROFILE_DTYPES[dtype]
    found = {p.dtype for p in module.parameters()}
    if found - {want}:
        raise ValueError(
            f"a {dtype} case needs {want} parameters, the stage has "
            f"{sorted(map(str, found))}; build it with rank_stage(..., "
            f"dtype={dtype!r})"
        )
    return want


def layer_case(
    stage: LlamaModel,
    seq: int,
    micro_batch: int,
    tp: int,
    dtype: str,
    device: torch.device,
    compiled: bool = False,
) -> Case:
    """The first decoder layer of ``stage`` (a :func:`rank_stage` shard of ``dtype``) on a
    ``[micro_batch, seq, hidden]`` input of ``dtype`` (the residual stream's dtype in
    training); makes a :class:`LayerEntry` with its activation bytes, marked ``compiled``
    (the caller compiled the stage's layers with
    :func:`~megatron_het.model.compile.compile_layers`)."""
    config = stage.config
    layer = next(iter(stage.layers.values()))
    torch_dtype = _check_dtype(layer, dtype)
    x = torch.randn(
        micro_batch, seq, config.hidden_size, device=device, dtype=torch_dtype, requires_grad=True
    )
    grad = torch.randn_like(x)
    cos, sin = stage.rotary.cos_sin(seq, device, rope_table_dtype(x, stage.kernels))

    def forward() -> torch.Tensor:
        return layer(x, cos, sin)

    def backward(out: torch.Tensor) -> None:
        out.backward(grad)
        x.grad = None

    def entry(fwd: float, bwd: float, saved: float) -> LayerEntry:
        return LayerEntry(
            config.hidden_size,
            config.ffn_hidden_size,
            config.num_attention_heads,
            config.num_query_groups,
            seq,
            micro_batch,
            tp,
            dtype,
            fwd,
            bwd,
            float(saved),
            compiled,
        )

    return Case(
        forward,
        backward,
        entry,
        lambda: activation_bytes(forward, list(layer.parameters()), (cos, sin), device),
    )


def embedding_case(
    stage: LlamaModel, seq: int, micro_batch: int, tp: int, dtype: str, device: torch.device
) -> Case:
    """The (vocab-parallel) embedding lookup of ``[micro_batch, seq]`` random token ids."""
    config = stage.config
    embedding = stage.embedding
    assert embedding is not None  # the profiler builds this stage with the embedding
    tokens = torch.randint(0, config.vocab_size, (micro_batch, seq), device=device)
    grad = torch.randn(
        micro_batch,
        seq,
        config.hidden_size,
        device=device,
        dtype=_check_dtype(embedding, dtype),
    )

    def forward() -> torch.Tensor:
        return embedding(tokens)

    return Case(
        forward,
        lambda out: out.backward(grad),
        lambda f, b, _: EndEntry(
            config.hidden_size, config.vocab_size, seq, micro_batch, tp, dtype, f, b
        ),
    )


def head_case(
    stage: LlamaModel, seq: int, micro_batch: int, tp: int, dtype: str, device: torch.device
) -> Case:
    """Final norm + output layer + loss of a head stage without layers (the fused loss computes
    most gradients in its forward, so the split follows the implementation)."""
    config = stage.config
    hidden = torch.randn(
        micro_batch,
        seq,
        config.hidden_size,
        device=device,
        dtype=_check_dtype(stage, dtype),
        requires_grad=True,
    )
    labels = torch.randint(0, config.vocab_size, (micro_batch, seq), device=device)

    def forward() -> torch.Tensor:
        return stage(hidden, labels=labels)

    def backward(loss: torch.Tensor) -> None:
        loss.backward()
        hidden.grad = None

    return Case(
        forward,
        backward,
        lambda f, b, _: EndEntry(
            config.hidden_size, config.vocab_size, seq, micro_batch, tp, dtype, f, b
        ),
    )


def measure_optimizer_step(
    config: ModelConfig,
    device: torch.device,
    warmup: int,
    iters: int,
    seed: int = 1234,
    max_params: int = OPTIMIZER_PARAMS,
) -> float:
    """Seconds per parameter of one optimizer step (global-norm clipping + AdamW, as training
    runs it) over the decoder layers that fit in ``max_params`` (at least one layer)."""
    per_layer = config.replace(num_layers=1).num_parameters(include_embeddings=False)
    layers = max(1, min(config.num_layers, max_params // per_layer))
    model = build_model(config, seed, (0, layers), False, False, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device=device, generator=generator) * 1e-3
    optimizer = build_optimizer(model, OptimizerConfig())

    def step() -> torch.Tensor:
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        return torch.zeros(())

    case = Case(step, lambda _: None, lambda f, b, s: f)
    params = sum(p.numel() for p in model.parameters())
    return run_cases([case], device, warmup, iters)[0] / params


__all__ = [
    "OPTIMIZER_PARAMS",
    "PROFILE_DTYPES",
    "ComputeOnlyGroup",
    "embedding_case",
    "head_case",
    "layer_case",
    "measure_optimizer_step",
    "rank_stage",
]
