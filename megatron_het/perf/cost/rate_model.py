"""The predictor's optional rate model: ranks that do not own their device.

By default :func:`~megatron_het.perf.predictor.predict` takes every rank to own its device. A
:class:`RateModel` passed to it (``predict(..., rate_model=...)``) may replace that for a plan whose
ranks share a host's cores: from the prediction's inputs and its per-stage rows it gives every
stage's compute regions as CPU work, waits and floors, the rate at which work progresses on a shared
node (:class:`~megatron_het.perf.schedule.simulator.CoreSharing`), and the iteration's DP sync,
optimizer step and other per-iteration time on those hosts. The predictor then runs all pipelines at
once in its one simulator (:func:`~megatron_het.perf.schedule.simulator.simulate_pipelines`). CPU
emulation implements it (:class:`megatron_het.emulation.host_model.SharedHostModel`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan
from megatron_het.perf.cost.comm_time import CommCost, SyncCost
from megatron_het.perf.cost.compute_time import StageCompute
from megatron_het.perf.cost.tp_collectives import TPCollectives
from megatron_het.perf.estimates import StagePrediction
from megatron_het.perf.measure.profile_format import Profile
from megatron_het.perf.schedule.simulator import CoreSharing, StageTiming


class PredictionInputs(Protocol):
    """What a rate model may read of one prediction (the predictor's context).

    ``act_bytes`` is one micro-batch's ``[micro_batch, seq, hidden]`` activations in the
    compute dtype (a rank of a sequence-parallel stage holds ``1/tp`` of them:
    :func:`~megatron_het.perf.cost.boundary_time.rank_activation_bytes`); ``comm`` the prediction's
    communication model over the cluster."""

    plan: ParallelPlan
    profiles: Mapping[str, Profile] | None
    comm: CommCost
    act_bytes: float
    tp_comm_overlap: bool  # sequence-parallel stages run their TP rings (the runtime's flag)

    def recomputed_layers_of(self, stage: StagePlan) -> float:
        """How many of ``stage``'s layers recompute their forward in backward in this
        prediction (a half layer counts half)."""

    def compute(self, stage_index: int, pipeline: PipelinePlan) -> StageCompute:
        """The stage's compute per micro-batch on one TP rank, TP communication excluded."""

    def tp_collectives(self, stage_index: int, pipeline: PipelinePlan) -> TPCollectives:
        """The stage's TP collectives per micro-batch (sequence parallelism applied)."""

    def tp_comm(self, stage_index: int, pipeline: PipelinePlan) -> tuple[float, float]:
        """The stage's (forward, backward) TP communication seconds per micro-batch."""

    def dp_sync_over(self, comm: CommCost, stage_index: int, pipeline: int = 0) -> SyncCost:
        """The DP sync of the whole device group that runs stage ``stage_index`` of pipeline
        ``pipeline`` (all its chunks, every TP rank of it at once), costed by another
        communication model."""


@dataclass(frozen=True)
class SharedIteration:
    """One iteration as a rate model sees it: ``stages[p][s]`` is stage s of pipeline p,
    ``sharing`` the rate of compute on shared nodes; the rest in seconds per iteration."""

    stages: tuple[tuple[StageTiming, ...], ...]
    sharing: CoreSharing
    dp_sync_s: float
    optimizer_s: float
    overhead_s: float = 0.0


class RateModel(Protocol):
    """An optional model of ranks that share their compute (see the module docstring)."""

    def shared_iteration(
        self, inputs: PredictionInputs, rows: Sequence[StagePrediction]
    ) -> SharedIteration | None:
        """The iteration on shared hosts, or None where the model does not apply (the
        predictor then keeps one device per rank)."""


__all__ = ["PredictionInputs", "RateModel", "SharedIteration"]
