"""How many TP collectives one micro-batch of a stage runs, and what ``--tp-comm-overlap``'s
rings leave exposed beside the GEMMs they run with.

Counts, not times: the predictor prices each collective over the stage's TP links
(:class:`~megatron_het.perf.cost.comm_time.CommCost`) and the GEMMs by the roofline
(:mod:`megatron_het.perf.cost.roofline`). Megatron's TP layout: QKV and the MLP's gate/up are
column-parallel, the attention projection and MLP down row-parallel, the embedding and the
head vocab-parallel; sequence parallelism
(:mod:`megatron_het.tensor_parallel.sequence_parallel`) turns every all-reduce into a
reduce-scatter and an all-gather.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# The vocab-parallel cross-entropy's small all-reduces in its forward (the maximum, then the
# sums), of a few numbers per token rather than activations.
CROSS_ENTROPY_COLLECTIVES = 2


@dataclass(frozen=True)
class TPCollectives:
    """The TP collectives of one micro-batch on a stage: ``forward`` and ``backward``
    all-reduces of the ``[micro_batch, seq, hidden]`` activations, ``cross_entropy`` small
    ones in the forward (the head's); with sequence parallelism, instead of the all-reduces,
    ``forward_gathers`` and ``backward_gathers`` all-gathers or reduce-scatters of those
    activations (each moves half an all-reduce's bytes) and ``norm_grads`` all-reduces of one
    norm weight's float32 ``[hidden]`` gradient in the backward. Counts are whole numbers but
    typed float: a stage with a half-layer bound counts its half layer's share."""

    forward: float
    backward: float
    cross_entropy: int = 0
    forward_gathers: float = 0
    backward_gathers: float = 0
    norm_grads: float = 0

    @property
    def forward_all(self) -> float:
        """Every collective of the forward, small ones included, a gather counting half (its
        bytes are half an all-reduce's)."""
        if not self.forward_gathers:
            return self.forward + self.cross_entropy
        return self.forward + self.forward_gathers / 2 + self.cross_entropy

    @property
    def backward_all(self) -> float:
        """Every collective of the backward, as :attr:`forward_all` counts them (the norm
        weights' small all-reduces included)."""
        if not (self.backward_gathers or self.norm_grads):
            return self.backward
        return self.backward + self.backward_gathers / 2 + self.norm_grads


def recomputed_count(recompute_layers: float, num_layers: float) -> float:
    """How many of a stage's ``num_layers`` recompute: ``recompute_layers`` within ``0 ..
    num_layers``. TypeError for a bool: a count is meant, and True would read as 1."""
    if isinstance(recompute_layers, bool):
        raise TypeError("recompute_layers is a number of layers, not a bool")
    return max(0, min(recompute_layers, num_layers))


def tp_collectives(
    tp: int,
    num_layers: float,
    has_embedding: bool = False,
    has_head: bool = False,
    recompute_layers: float = 0,
    sequence_parallel: bool = False,
) -> TPCollectives:
    """The TP collectives per micro-batch of a stage of ``tp`` ranks (none at tp=1).

    Without sequence parallelism: each layer's 2 all-reduces forward (attention and MLP
    outputs) and 2 backward (their input gradients), 2 more backward per layer of the
    ``recompute_layers`` that recompute (their forward again), the vocab-parallel embedding's
    forward one, and the head's input-gradient one and its cross-entropy's 2 small ones in the
    forward.

    With it every all-reduce becomes a reduce-scatter and an all-gather of the same bytes in
    all: per layer, forward, an all-gather before qkv and before gate/up and a reduce-scatter
    after proj and after down (4), and their mirror images in backward (4, 8 where recomputed);
    the embedding reduce-scatters its output (forward) and all-gathers its gradient
    (backward); the head all-gathers the final norm's output (forward) and reduce-scatters its
    gradient (backward). The norm weights see a rank's positions only, so their gradients are
    all-reduced in backward: 2 per layer and the head's final norm.
    """
    if tp == 1:
        return TPCollectives(0, 0)
    recomputed = recomputed_count(recompute_layers, num_layers)
    cross_entropy = CROSS_ENTROPY_COLLECTIVES if has_head else 0
    if sequence_parallel:
        ends = (1 if has_embedding else 0) + (1 if has_head else 0)
        return TPCollectives(
            0,
            0,
            cross_entropy,
            4 * num_layers + ends,
            4 * (num_layers + recomputed) + ends,
            2 * num_layers + (1 if has_head else 0),
        )
    forward = 2 * num_layers + (1 if has_embedding else 0)
    backward = 2 * (num_layers + recomputed) + (1 if has_head else 0)
    return TPCollectives(forward, backward, cross_entropy)


def ring_collectives(num_layers: float, recomputed: float) -> tuple[float, float]:
    """(forward, backward) of a sequence-parallel stage's gathers and reduce-scatters
    (:attr:`TPCollectives.forward_gathers` and ``backward_gathers``) that ``--tp-comm-overlap``
    runs as rings: the layers' 4 each way (and a recomputed layer's forward 4 again); the
    embedding's and the head's stay collectives. The rings' backward also gathers qkv's and
    gate/up's inputs again: :data:`REGATHERS` more per layer."""
    return 4 * num_layers, 4 * (num_layers + recomputed)


# Rings a layer's backward adds under --tp-comm-overlap: qkv's and gate/up's inputs gathered
# again (the GEMMs keep only the rank's own block).
REGATHERS = 2


def ring_exposed(transfer_s: float, gemm_s: float, tp: int) -> float:
    """What an overlapped TP ring (``--tp-comm-overlap``,
    :mod:`megatron_het.tensor_parallel.comm_overlap`) adds to the GEMMs it runs beside: its
    ``tp - 1`` steps each move ``transfer_s / (tp - 1)`` while ``gemm_s / tp`` of the GEMMs
    computes, and a step lasts the longer of the two (the last step computes alone)."""
    if tp <= 1:
        return 0.0
    return (tp - 1) * max(0.0, transfer_s / (tp - 1) - gemm_s / tp)


def overlapped_layer_tp(
    gather_s: float, gemms: Mapping[str, float], tp: int
) -> tuple[float, float]:
    """(forward, backward) exposed TP seconds of one sequence-parallel layer under
    ``--tp-comm-overlap``: ``gather_s`` is one all-gather (or reduce-scatter) of the layer's
    activations, ``gemms`` the forward seconds of its ``qkv``, ``proj``, ``gate_up`` and
    ``down`` GEMMs on one rank.

    Forward: the all-gathers before qkv and gate/up and the reduce-scatters after proj and
    down each hide behind their GEMM. Backward: proj's and down's output-gradient all-gathers
    behind their data and weight gradients (twice the forward GEMM); qkv's and gate/up's
    input-gradient reduce-scatters together with the all-gather of their input again (only
    the rank's own sequence block is kept) behind theirs."""
    forward = sum(
        ring_exposed(gather_s, gemms[name], tp) for name in ("qkv", "proj", "gate_up", "down")
    )
    backward = sum(ring_exposed(gather_s, 2 * gemms[name], tp) for name in ("proj", "down")) + sum(
        ring_exposed(2 * gather_s, 2 * gemms[name], tp) for name in ("qkv", "gate_up")
    )
    return forward, backward


__all__ = [
    "CROSS_ENTROPY_COLLECTIVES",
    "REGATHERS",
    "TPCollectives",
    "overlapped_layer_tp",
    "recomputed_count",
    "ring_collectives",
    "ring_exposed",
    "tp_collectives",
]
