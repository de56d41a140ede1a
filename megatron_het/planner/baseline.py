"""The homogeneous baseline of a mixed cluster's throughput (the HETHUB paper's figure).

Baseline = sum over accelerator kinds of (devices of that kind x per-device tokens/s of the best
homogeneous plan for that kind alone), each searched like the mixed cluster (same model, batch,
sequence and predictor) on the cluster's node groups of that kind only. It is a reference, not
a bound: efficiency = predicted tokens/s / baseline exceeds 1 when mixing helps a kind, e.g.
where a kind alone must use a wider TP (or recompute) to hold the model and in the mix shares
the layers with others. :func:`why_above_baseline` says which, from the plans' figures. The
bound no plan passes is the compute ceiling (:mod:`megatron_het.planner.ceiling`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from megatron_het.cluster import ClusterSpec, kind_subcluster
from megatron_het.config import ModelConfig, RunOptions
from megatron_het.errors import UserError
from megatron_het.perf import Prediction, Profile, StagePrediction
from megatron_het.planner.result import HomogeneousBaseline, KindBaseline, SearchResult
from megatron_het.planner.search import search_plan
from megatron_het.planner.space import Layout

# A share (bubble, DP sync) counts as lower in the mix only by more than this.
SHARE_MARGIN = 1e-3
# An efficiency counts as above 1 only past this (a homogeneous cluster is its own baseline up
# to rounding).
ABOVE_ONE = 1.0 + 1e-9


def tp_comm_share(rows: list[StagePrediction]) -> float:
    """TP communication over the rows' forward + backward time (which include it)."""
    busy = sum(r.forward_s + r.backward_s for r in rows)
    return sum(r.tp_comm_s for r in rows) / busy if busy else 0.0


def _kind_baseline(
    kind: str, devices: int, found: SearchResult, memory_ignored: bool
) -> KindBaseline:
    p: Prediction = found.prediction
    layout = found.candidates[0].layout
    assert isinstance(layout, Layout)  # one kind alone: no replicas of different kinds
    return KindBaseline(
        kind,
        devices,
        p.tokens_per_s / devices,
        layout.describe(),
        memory_ignored,
        layout,
        p.bubble_fraction,
        tp_comm_share(list(p.stages)),
        p.dp_sync_s / p.iteration_time_s,
    )


def homogeneous_baseline(
    model: ModelConfig,
    cluster: ClusterSpec,
    global_batch_size: int,
    seq_length: int,
    profiles: Mapping[str, Profile] | None = None,
    options: RunOptions | None = None,
    **search_options: Any,
) -> HomogeneousBaseline:
    """Search each kind alone (:func:`search_plan` with the run's ``options`` and the search
    options given; without the memory limit for a kind that cannot hold the model alone) and
    sum the devices' rates."""
    start = time.perf_counter()
    kinds = []
    for kind, devices in cluster.accelerator_counts().items():
        sub = kind_subcluster(cluster, kind)
        ignored = False
        try:
            found = search_plan(
                model, sub, global_batch_size, seq_length, profiles, options, **search_options
            )
        except UserError:
            ignored = True
            found = search_plan(
                model,
                sub,
                global_batch_size,
                seq_length,
                profiles,
                options,
                check_memory=False,
                **search_options,
            )
        kinds.append(_kind_baseline(kind, devices, found, ignored))
    return HomogeneousBaseline(tuple(kinds), time.perf_counter() - start)


def _tps(tps: list[int]) -> str:
    return "tp=" + "/".join(str(t) for t in sorted(set(tps)))


def _kind_reasons(result: SearchResult, k: KindBaseline) -> list[str]:
    """What favours kind ``k`` in the mixed plan against its own best plan: a narrower TP,
    less recompute, a larger micro-batch."""
    assert k.layout is not None
    blocks = k.layout.blocks  # the kind's stages alone (two TP degrees at most)
    stages = [
        (p, s, st)
        for p, pp in enumerate(result.plan.pipelines)
        for s, st in enumerate(pp.stages)
        if st.accelerator.lower() == k.kind.lower()
    ]
    if not stages:
        return []
    where = {(p, s) for p, s, _ in stages}
    rows = [r for r in result.prediction.stages if (r.pipeline, r.stage) in where]
    out = []
    tps, base_tps = [st.tp for _, _, st in stages], [b.tp for b in blocks]
    if max(tps) < max(base_tps):
        out.append(
            f"{k.kind} runs {_tps(tps)} in the mixed plan against {_tps(base_tps)} "
            f"alone (its best homogeneous plan: {k.plan_summary}), so TP communication "
            f"takes {tp_comm_share(rows):.1%} of its stage time against "
            f"{k.tp_comm_share or 0.0:.1%}"
        )
    recomputed = sum(st.recompute for _, _, st in stages)
    base_share = sum(b.stages for b in blocks if b.recompute) / sum(b.stages for b in blocks)
    if recomputed / len(stages) < base_share:
        alone = "" if base_share == 1 else f" on {base_share:.0%} of its stages"
        mixed = (
            "does not" if recomputed == 0 else f"does on {recomputed} of its {len(stages)} stages"
        )
        out.append(
            f"{k.kind} alone recomputes activations{alone} to fit its memory; in the "
            f"mixed plan it {mixed}"
        )
    if result.plan.micro_batch_size > k.layout.micro_batch_size:
        out.append(
            f"the mixed plan runs micro-batch {result.plan.micro_batch_size} against "
            f"{k.layout.micro_batch_size} for {k.kind} alone"
        )
    return out


def _schedule_reasons(result: SearchResult, k: KindBaseline) -> list[str]:
    """What favours the mixed plan's schedule against kind ``k``'s plan: a smaller bubble (a
    longer pipeline sharing it, more micro-batches or interleaving), a smaller DP sync
    share."""
    assert k.layout is not None
    p, plan = result.prediction, result.plan
    out = []
    if k.bubble_fraction is not None and p.bubble_fraction < k.bubble_fraction - SHARE_MARGIN:
        pp = "/".join(str(n) for n in sorted({q.pp_size for q in plan.pipelines}))
        m = "/".join(str(n) for n in sorted({q.micro_batches for q in plan.pipelines}))
        v = max(q.num_chunks for q in plan.pipelines)
        chunks = f", {v} chunks per device group" if v > 1 else ""
        out.append(
            f"the mixed {pp}-stage pipeline ({m} micro-batches{chunks}) idles "
            f"{p.bubble_fraction:.1%} in its bubble against {k.bubble_fraction:.1%} "
            f"for {k.kind} alone ({k.plan_summary})"
        )
    mixed_sync = p.dp_sync_s / p.iteration_time_s
    if k.dp_sync_share is not None and mixed_sync < k.dp_sync_share - SHARE_MARGIN:
        out.append(
            f"DP sync takes {mixed_sync:.1%} of the mixed iteration (dp={plan.dp_size}) "
            f"against {k.dp_sync_share:.1%} for {k.kind} alone (dp={k.layout.dp})"
        )
    return out


def why_above_baseline(result: SearchResult) -> str | None:
    """One line on why the efficiency exceeds 1 (None when it does not, or without a
    baseline): per kind, how its place in the mixed plan differs from its best plan alone."""
    efficiency = result.efficiency
    if efficiency is None or efficiency <= ABOVE_ONE or result.baseline is None:
        return None
    reasons = []
    for k in result.baseline.kinds:
        if k.layout is not None:
            reasons += _kind_reasons(result, k) + _schedule_reasons(result, k)
    if not reasons:
        reasons = [
            "every kind keeps the TP degree, recompute and micro-batch size of its best "
            "plan alone and no bubble or DP-sync share is smaller; the difference lies in "
            "the layer split and the transfers between stages"
        ]
    return f"above 1 ({efficiency:.4f}): " + "; ".join(reasons)


__all__ = [
    "ABOVE_ONE",
    "SHARE_MARGIN",
    "homogeneous_baseline",
    "kind_subcluster",
    "tp_comm_share",
    "why_above_baseline",
]
