"""The Llama decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

A :class:`LlamaModel` may hold a contiguous slice of the layers (a pipeline stage) with or
without the embedding and the head, or several such slices ("model chunks", the virtual stages
of an interleaved pipeline that one device group runs), each run on its own. Parameter names are
GLOBAL and do not depend on the parallel plan; checkpoints, initialisation and tensor-parallel code
rely on them.

Parameter names and layouts (nh query heads, ng kv groups, r = nh/ng, d head dim, H hidden,
F ffn hidden, V vocabulary). All linear weights are ``[out, in]`` and there are no biases; the
decoder's linears accumulate their weight gradients in their backward GEMM
(:class:`~megatron_het.kernels.wgrad_fusion.FusedWgradLinear`, an ``nn.Linear``).

    embedding.weight                          [V, H]
    layers.{i}.input_norm.weight              [H]
    layers.{i}.attention.qkv.weight           [(nh + 2*ng) * d, H]
    layers.{i}.attention.proj.weight          [H, nh * d]
    layers.{i}.post_attention_norm.weight     [H]
    layers.{i}.mlp.gate.weight                [F, H]
    layers.{i}.mlp.up.weight                  [F, H]
    layers.{i}.mlp.down.weight                [H, F]
    final_norm.weight                         [H]
    output.weight                             [V, H]   (absent when embeddings are tied)

The fused ``qkv`` rows are GROUPED by kv group: for g = 0 .. ng-1, the r query heads of group g
(query heads g*r .. g*r + r - 1), then group g's key head, then its value head, d rows each. A
tensor-parallel split by kv groups is therefore a contiguous slice of rows. Query head j attends
with kv head j // r, as in Hugging Face's GQA. ``attention.proj`` columns follow query-head order.

Tied embeddings: the head multiplies by ``embedding.weight``. When a stage has the head but not
the embedding, it holds its own copy under the same name ``embedding.weight`` (same initial
values, since initialisation is seeded by name); the pipeline code keeps the two copies equal by
summing their gradients across the first and last stages, as Megatron does.

Shape legend: B batch, S sequence, H hidden, N heads, D head dim, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.kernels import causal_attention, swiglu
from megatron_het.kernels.norms import add_rms_norm, rms_norm
from megatron_het.kernels.selection import ALL_FUSED, KernelChoice
from megatron_het.kernels.wgrad_fusion import FusedWgradLinear
from megatron_het.model.init import init_weights
from megatron_het.model.loss import linear_cross_entropy
from megatron_het.model.rope import RotaryEmbedding, apply_rope_qk, rope_table_dtype
from megatron_het.parallel.stage_plan import ATTENTION_BLOCK, LAYER_PARTS, MLP_BLOCK, layer_parts


class WeightedLayer(Protocol):
    """A module that multiplies by, or looks up rows of, one weight: ``nn.Linear`` or
    ``nn.Embedding`` here, or the tensor-parallel module that
    :func:`~megatron_het.tensor_parallel.apply.apply_tp` puts in its place."""

    @property
    def weight(self) -> torch.Tensor:
        """The full weight, or this TP rank's shard of it."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension.

    Normalises in float32 and returns ``x``'s dtype whatever the weight's dtype and autocast
    (:func:`~megatron_het.kernels.norms.rms_norm`, which picks our compiled kernel, or apex's
    or liger's on CUDA/ROCm, as ``kernels`` allows: :func:`use_kernels`)."""

    kernels: KernelChoice = ALL_FUSED

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def norm_weight(self) -> torch.Tensor:
        """The weight the norm multiplies by (a sequence-parallel norm wraps it)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.norm_weight(), self.eps, choice=self.kernels)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` in one pass where the fused kernel runs."""
        return add_rms_norm(x, residual, self.norm_weight(), self.eps, choice=self.kernels)


class Attention(nn.Module):
    """Causal grouped-query self-attention with a fused, group-major ``qkv`` projection.

    The attention kernel is chosen per call from the device, dtype and what is installed
    (:mod:`megatron_het.kernels.attention`): flash attention for bf16/fp16 on CUDA/ROCm, the
    memory-efficient kernel for fp32 on CUDA, the CPU flash kernel on CPU; none of them builds
    the ``S x S`` score matrix. RoPE rotates q and k together
    (:func:`~megatron_het.model.rope.apply_rope_qk`, our kernel where ``kernels`` allows)."""

    kernels: KernelChoice = ALL_FUSED

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_query_groups
        self.head_dim = config.kv_channels
        rows = (self.num_heads + 2 * self.num_groups) * self.head_dim
        self.qkv: WeightedLayer = FusedWgradLinear(config.hidden_size, rows)
        self.proj: WeightedLayer = FusedWgradLinear(
            self.num_heads * self.head_dim, config.hidden_size
        )

    def forward(self, x_BSH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x[B, S, H] -> [B, S, H]``; ``cos``/``sin`` are ``[S, 1, D/2]`` RoPE tables."""
        per_group = self.num_heads // self.num_groups
        qkv = self.qkv(x_BSH)  # [B, S, ...]: sequence-parallel input arrives gathered here
        B, S = qkv.shape[:2]
        qkv = qkv.view(B, S, self.num_groups, per_group + 2, self.head_dim)
        # One split (not three slices): its backward is a single concatenation instead of a
        # zero-filled full-size gradient per slice. RoPE writes fresh contiguous tensors, so
        # q and k need no copy of their own; v gets one, since a view of the qkv output saved
        # for backward would keep all of it (q and k too) alive until then.
        q, k, v = qkv.split((per_group, 1, 1), dim=3)
        q, k = apply_rope_qk(q, k, cos, sin, choice=self.kernels)
        q = q.view(B, S, self.num_heads, -1)
        out = causal_attention(q, k.squeeze(3), v.squeeze(3).contiguous())  # [B, S, N, D]
        return self.proj(out.reshape(B, S, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    kernels: KernelChoice = ALL_FUSED

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = FusedWgradLinear(config.hidden_size, config.ffn_hidden_size)
        self.up = FusedWgradLinear(config.hidden_size, config.ffn_hidden_size)
        self.down = FusedWgradLinear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate(x), self.up(x), choice=self.kernels))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    ``parts`` builds and runs only some of its two blocks: ``("attention",)`` (input norm and
    attention) or ``("mlp",)`` (post-attention norm and MLP), for a pipeline stage whose
    bound falls inside the layer (:mod:`megatron_het.parallel.plan`)."""

    def __init__(self, config: ModelConfig, parts: Sequence[str] = LAYER_PARTS) -> None:
        super().__init__()
        if not parts or any(p not in LAYER_PARTS for p in parts):
            raise ValueError(f"a decoder layer's parts are among {LAYER_PARTS}, got {parts!r}")
        self.parts = tuple(p for p in LAYER_PARTS if p in parts)
        if ATTENTION_BLOCK in self.parts:
            self.input_norm = RMSNorm(config.hidden_size, config.norm_eps)
            self.attention = Attention(config)
        if MLP_BLOCK in self.parts:
            self.post_attention_norm = RMSNorm(config.hidden_size, config.norm_eps)
            self.mlp: nn.Module = MLP(config)  # or apply_tp's ParallelMLP

    def forward(self, x_BSH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The attention block's residual add and the MLP block's norm run as one op
        (:meth:`RMSNorm.add_and_norm`)."""
        if ATTENTION_BLOCK not in self.parts:
            return x_BSH + self.mlp(self.post_attention_norm(x_BSH))
        attended = self.attention(self.input_norm(x_BSH), cos, sin)
        if MLP_BLOCK not in self.parts:
            return x_BSH + attended
        normed, x_BSH = self.post_attention_norm.add_and_norm(attended, x_BSH)
        return x_BSH + self.mlp(normed)


class LlamaModel(nn.Module):
    """A Llama decoder, or the part of it that one pipeline rank holds.

    Args:
        config: model shape.
        layer_range: ``(start, stop)`` global layer indices held here; ``None`` means all.
            A bound may be a half-layer bound ``x.5`` (:mod:`megatron_het.parallel.plan`):
            the layer it falls in is built with the one block the range holds.
        has_embedding: holds the token embedding; ``forward`` (of chunk 0) then takes tokens.
        has_head: holds the final norm and output projection; ``forward`` (of the last chunk)
            then returns logits.
        recompute: recompute each layer's activations in backward (activation checkpointing)
            while training, trading compute for memory.
        chunks: instead of ``layer_range`` and ``recompute``, the model chunks held here, in
            pipeline order: ``(start, stop, recompute)`` each, disjoint and ascending, where
            ``recompute`` is True (every layer of the chunk), False, or how many of its first
            layers recompute (Megatron-LM's block method). Each chunk runs on its own
            (``forward(..., chunk=c)``): the embedding belongs to chunk 0 and the head to the
            last chunk. A recomputing chunk checkpoints each of its layers (or its block of a
            layer split by a half-layer bound) on its own.

    Layers live in ``self.layers``, an ``nn.ModuleDict`` keyed by the global layer index as a
    string, so a stage holding layers [3, 5) has keys "3" and "4". Parameters are created with
    PyTorch's default initialisation; call :func:`megatron_het.model.init.init_weights` for the
    layout-independent one.

    ``wait_for`` (None, or set by an optimizer whose parameter updates may still be arriving:
    ``--overlap-param-gather``) is called with ``"embedding"``, ``"layers.<i>"`` or ``"head"``
    right before that part runs. It is called here, between the layers, rather than from module
    hooks, which would run inside a compiled layer (``--compile``).
    """

    kernels: KernelChoice = ALL_FUSED

    def __init__(
        self,
        config: ModelConfig,
        layer_range: tuple[float, float] | None = None,
        has_embedding: bool = True,
        has_head: bool = True,
        recompute: bool = False,
        chunks: Sequence[tuple[float, float, bool | int]] | None = None,
    ) -> None:
        super().__init__()
        if chunks is None:
            start, stop = (0, config.num_layers) if layer_range is None else layer_range
            chunks = ((start, stop, recompute),)
        elif layer_range is not None:
            raise ValueError("give layer_range or chunks, not both")
        previous: float = 0  # the last chunk's stop
        for start, stop, _ in chunks:
            if not previous <= start <= stop <= config.num_layers:
                raise UserError(
                    f"layer range [{start}, {stop}) does not fit a model of "
                    f"{config.num_layers} layers after layer {previous}; use "
                    f"ascending, disjoint ranges inside [0, {config.num_layers})"
                )
            if start == previous and start != int(start):
                raise UserError(
                    f"two chunks of one model share layer {math.floor(start)} "
                    f"(bound {start}); keep both of its blocks in one chunk"
                )
            previous = stop
        self.config = config
        # (start, stop, how many of the first layers recompute)
        self.chunks = tuple(
            (start, stop, _recomputed(start, stop, rc)) for start, stop, rc in chunks
        )
        self.layer_range = (self.chunks[0][0], self.chunks[-1][1])
        self.has_embedding = has_embedding
        self.has_head = has_head
        self.recompute = any(count for _, _, count in self.chunks)
        self.rotary = RotaryEmbedding(config)
        self.wait_for: Callable[[str], None] | None = None
        needs_embedding = has_embedding or (has_head and config.tie_embeddings)
        self.embedding: WeightedLayer | None = _embedding(config) if needs_embedding else None
        self.layers = nn.ModuleDict(
            {
                str(i): DecoderLayer(config, layer_parts((start, stop), i))
                for start, stop, _ in self.chunks
                for i in _touched(start, stop)
            }
        )
        self.final_norm = RMSNorm(config.hidden_size, config.norm_eps) if has_head else None
        self.output = (
            nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if has_head and not config.tie_embeddings
            else None
        )

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def decoder_layers(self) -> Iterator[tuple[int, DecoderLayer]]:
        """(global index, layer) of each decoder layer held here, in ascending order."""
        for key, layer in self.layers.items():
            # nn.ModuleDict is untyped; __init__ fills this one with DecoderLayers only.
            yield int(key), cast(DecoderLayer, layer)

    def output_weight(self) -> torch.Tensor:
        """The ``[V, H]`` matrix the head multiplies by (``embedding.weight`` when tied)."""
        held = self.embedding if self.config.tie_embeddings else self.output
        if not self.has_head or held is None:  # a head holds the one it multiplies by
            raise RuntimeError("this stage has no head")
        return held.weight

    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        chunk: int = 0,
    ) -> torch.Tensor:
        """Run model chunk ``chunk`` (0 when the model holds one): :meth:`hidden_states`, then
        :meth:`head` when the chunk is the last and the model has the head.

        ``x`` is tokens ``LongTensor[B, S]`` when the chunk has the embedding, otherwise hidden
        states ``[B, S, H]``. Returns logits ``[B, S, V]`` when the chunk has the head, otherwise
        hidden states ``[B, S, H]``. Attention is causal over positions ``0 .. S-1``.

        With ``labels[B, S]`` (head chunk only) it returns instead the float32 scalar loss
        ``sum(loss_weights * cross_entropy)`` from the fused, chunked
        :func:`~megatron_het.model.loss.linear_cross_entropy`, which never materialises the
        full logits; ``loss_weights`` defaults to the mean over tokens whose label is not -100.
        """
        hidden = self.hidden_states(x, chunk)
        if not (self.has_head and chunk == len(self.chunks) - 1):
            if labels is not None:
                raise RuntimeError("labels given to a chunk without the head")
            return hidden
        return self.head(hidden, labels, loss_weights)

    def hidden_states(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """The embedding (chunk 0, if held) and the chunk's decoder layers: tokens ``[B, S]`` or
        hidden states ``[B, S, H]`` in, hidden states ``[B, S, H]`` out (before the final
        norm)."""
        if not 0 <= chunk < len(self.chunks):
            raise IndexError(f"chunk {chunk} of a model holding {len(self.chunks)} chunk(s)")
        start, stop, recomputed = self.chunks[chunk]
        if self.has_embedding and chunk == 0:
            assert self.embedding is not None  # has_embedding: built in __init__
            self._ready("embedding")
            hidden = self.embedding(x)
        else:
            hidden = x
        cos, sin = self.rotary.cos_sin(
            self.sequence_length(hidden), hidden.device, rope_table_dtype(hidden, self.kernels)
        )
        use_recompute = recomputed > 0 and self.training and torch.is_grad_enabled()
        for n, index in enumerate(_touched(start, stop)):
            layer = self.layers[str(index)]
            self._ready(f"layers.{index}")
            if use_recompute and n < recomputed:
                hidden = checkpoint(layer, hidden, cos, sin, use_reentrant=False)
            else:
                hidden = layer(hidden, cos, sin)
        return hidden

    def _ready(self, part: str) -> None:
        if self.wait_for is not None:
            self.wait_for(part)

    def sequence_length(self, hidden: torch.Tensor) -> int:
        """The sequence length S of hidden states ``[B, S, H]`` held here (a sequence-parallel
        stage holds ``S / tp`` positions of them)."""
        return hidden.shape[1]

    def head(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final norm and output projection of hidden states ``[B, S, H]`` (head stages only):
        logits ``[B, S, V]``, or with ``labels`` the fused float32 scalar loss (see
        :meth:`forward`)."""
        if not self.has_head or self.final_norm is None:  # a head has its final norm
            raise RuntimeError("this stage has no head")
        self._ready("head")
        if labels is not None:
            return linear_cross_entropy(
                self.final_norm(hidden),
                self.output_weight(),
                labels,
                loss_weights,
                choice=self.kernels,
            )
        return F.linear(self.final_norm(hidden), self.output_weight())


def _touched(start: float, stop: float) -> range:
    """The layers of which chunk ``[start, stop)`` holds a block or both."""
    return range(math.floor(start), math.ceil(stop))


def _recomputed(start: float, stop: float, recompute: bool | int) -> int:
    """How many of the first layers (or blocks of split layers) of chunk ``[start, stop)``
    recompute: all for True, none for False, else the count (at most the chunk's)."""
    pieces = len(_touched(start, stop))
    if recompute is True:
        return pieces
    if recompute is False or recompute is None:
        return 0
    if recompute < 0:
        raise ValueError(f"a chunk cannot recompute {recompute} layers")
    return min(int(recompute), pieces)


def _embedding(config: ModelConfig) -> nn.Embedding:
    """``nn.Embedding(vocab, hidden)`` with its default N(0, 1) initialisation, skipped on the
    meta device (meta ``normal_`` is a Python decomposition whose first call imports
    ``torch._dynamo``, seconds of start-up; :func:`build_model` initialises afterwards)."""
    weight = torch.empty(config.vocab_size, config.hidden_size)
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)


def use_kernels(model: nn.Module, choice: KernelChoice) -> None:
    """Let every op of ``model`` use the fused kernels ``choice`` allows (each module that
    runs one has a ``kernels`` attribute; the default allows all)."""
    for module in model.modules():
        if isinstance(getattr(type(module), "kernels", None), KernelChoice):
            vars(module)["kernels"] = choice  # a plain attribute (nn.Module's typing says not)


def build_model(
    config: ModelConfig,
    seed: int,
    layer_range: tuple[int, int] | None = None,
    has_embedding: bool = True,
    has_head: bool = True,
    recompute: bool = False,
    device: torch.device | str = "cpu",
) -> LlamaModel:
    """A :class:`LlamaModel` on ``device`` with the layout-independent initialisation.

    Parameters are allocated directly on ``device`` (built on "meta" first, so PyTorch's
    default initialisation is skipped) and then filled by
    :func:`~megatron_het.model.init.init_weights` from ``seed``.
    """
    with torch.device("meta"):
        model = LlamaModel(config, layer_range, has_embedding, has_head, recompute)
    model.to_empty(device=device)
    init_weights(model, seed)
    return model
