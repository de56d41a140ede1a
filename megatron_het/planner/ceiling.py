"""The compute ceiling of a cluster: the throughput no plan can pass under the cost model.

Per accelerator kind: the least compute seconds per token of a whole model's forward and
backward on one device of that kind (tp=1, no recompute, embedding and head included), over
the micro-batch sizes the planner may use; the ceiling is the sum over devices of the inverse.
It is every device computing its share of the model's work at its best rate with no
communication, pipeline bubble, recompute or duplicated work, and with memory ignored (a device
may not be able to hold the model it is credited with computing).

The figures are the predictor's own (:func:`megatron_het.perf.cost.compute_time.stage_compute` with
the profile :func:`~megatron_het.perf.cost.compute_time.choose_profile` picks and the predictor's
default efficiency, each kind's calibrated figures), so a prediction of any plan on the same
cluster stays below it: a stage at tp=t spends at least 1/t of the tp=1 time per rank (TP
shards the GEMMs and the heads and replicates the rest), recompute and communication only add
time, and a pipeline or DP replica computes each token's layers once. Two assumptions: no kind
gains by taking only the part of the model it is relatively fastest at (the head, say; the
kinds' ratios of head to layer time differ by a few percent, which would move the ceiling by
well under 1% on the shipped clusters), and a measured profile's tp>1 entries are no faster
than 1/tp of its tp=1 entry.

It takes a few stage computes per kind (milliseconds), so the planner computes it always; the
homogeneous baseline (:mod:`megatron_het.planner.baseline`) needs a search per kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_het.cluster import AcceleratorSpec, ClusterSpec
from megatron_het.config import ModelConfig, RunOptions
from megatron_het.errors import UserError
from megatron_het.perf import Profile
from megatron_het.perf.cost.compute_time import choose_profile, stage_compute
from megatron_het.perf.cost.roofline import Efficiency, LayerShape
from megatron_het.planner.space import micro_batch_sizes

# The planner's largest micro-batch (search_plan's max_micro_batch_size default).
MAX_MICRO_BATCH_SIZE = 16


@dataclass(frozen=True)
class KindCeiling:
    """One kind's share of the ceiling: ``devices`` each at their best compute rate.

    ``seconds_per_token``: forward + backward of the whole model per token on one device at
    tp=1, no recompute, at ``micro_batch_size`` (the best of those tried); ``source``: where
    the compute figures came from (roofline or a profile)."""

    kind: str
    devices: int
    seconds_per_token: float
    micro_batch_size: int
    source: str

    @property
    def tokens_per_s_per_device(self) -> float:
        return 1.0 / self.seconds_per_token

    @property
    def tokens_per_s(self) -> float:
        return self.devices / self.seconds_per_token


@dataclass(frozen=True)
class Ceiling:
    """The compute ceiling in tokens/s and its per-kind terms (memory ignored)."""

    kinds: tuple[KindCeiling, ...]

    @property
    def tokens_per_s(self) -> float:
        return sum(k.tokens_per_s for k in self.kinds)

    def kind(self, name: str) -> KindCeiling:
        return next(k for k in self.kinds if k.kind == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens_per_s": self.tokens_per_s,
            "memory": "ignored",
            "kinds": [
                {
                    "kind": k.kind,
                    "devices": k.devices,
                    "seconds_per_token": k.seconds_per_token,
                    "tokens_per_s_per_device": k.tokens_per_s_per_device,
                    "micro_batch_size": k.micro_batch_size,
                    "source": k.source,
                }
                for k in self.kinds
            ],
        }


def kind_seconds_per_token(
    model: ModelConfig,
    spec: AcceleratorSpec,
    seq_length: int,
    sizes: list[int],
    profiles: Mapping[str, Profile] | None = None,
    dtype: str = "bf16",
    efficiency: Efficiency | None = None,
    fused_elementwise: bool = True,
) -> tuple[float, int, str]:
    """(seconds per token, micro-batch size, source) of the fastest of ``sizes`` for the whole
    model's forward + backward on one device of ``spec`` (tp=1, no recompute; its layers
    priced eager where ``fused_elementwise`` is False, as :func:`~megatron_het.perf.predict`
    prices them)."""
    choice = choose_profile(spec, profiles)
    best: tuple[float, int, str] | None = None
    for mbs in sizes:
        compute = stage_compute(
            model,
            spec,
            LayerShape.of(model, seq_length, mbs, 1),
            model.num_layers,
            True,
            True,
            0,
            dtype,
            choice,
            efficiency,
            fused_elementwise=fused_elementwise,
        )
        per_token = (compute.forward_s + compute.backward_s) / (mbs * seq_length)
        if best is None or per_token < best[0]:
            best = (per_token, mbs, compute.source)
    assert best is not None
    return best


def compute_ceiling(
    model: ModelConfig,
    cluster: ClusterSpec,
    global_batch_size: int,
    seq_length: int,
    profiles: Mapping[str, Profile] | None = None,
    options: RunOptions | None = None,
    *,
    max_micro_batch_size: int = MAX_MICRO_BATCH_SIZE,
    efficiency: Efficiency | None = None,
) -> Ceiling:
    """The compute ceiling of ``cluster`` for ``model`` (see the module docstring).

    Micro-batch sizes tried: those the planner may use for ``global_batch_size`` (divisors up
    to ``max_micro_batch_size``; pass at least a given plan's own size when it is larger).
    ``efficiency`` must be the one the plans are predicted with: None, the predictor's
    default, is each kind's calibrated figures (:mod:`megatron_het.perf.cost.calibration`), and
    ``options`` too (the run's precision and layer mode: ``fused_elementwise`` False for the
    layers of a run without ``--compile``; None: bf16, fused)."""
    options = options if options is not None else RunOptions()
    if global_batch_size < 1 or seq_length < 1:
        raise UserError(
            f"--global-batch-size ({global_batch_size}) and --seq-length "
            f"({seq_length}) must be at least 1"
        )
    sizes = micro_batch_sizes(global_batch_size, 1, max_micro_batch_size)
    specs: dict[str, AcceleratorSpec] = {}
    for info in cluster.rank_map():
        specs.setdefault(info.accelerator.name, info.accelerator)
    kinds = []
    for kind, devices in cluster.accelerator_counts().items():
        seconds, mbs, source = kind_seconds_per_token(
            model,
            specs[kind],
            seq_length,
            sizes,
            profiles,
            options.dtype,
            efficiency,
            options.fused_elementwise,
        )
        kinds.append(KindCeiling(kind, devices, seconds, mbs, source))
    return Ceiling(tuple(kinds))


__all__ = [
    "MAX_MICRO_BATCH_SIZE",
    "Ceiling",
    "KindCeiling",
    "compute_ceiling",
    "kind_seconds_per_token",
]
