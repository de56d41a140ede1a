"""The theoretical upper bound of a mixed cluster's throughput.

Bound = sum over accelerator kinds of (devices of that kind x per-device tokens/s of the best
homogeneous plan for that kind alone), each searched like the mixed cluster (same model, batch,
sequence and predictor) on the cluster's node groups of that kind only. A mixed plan reaches it
only if mixing costs nothing (no extra bubble from a longer pipeline, no slow bridge, a perfect
layer balance), so efficiency = predicted tokens/s / bound is at most about 1.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Mapping, Optional

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.perf import Profile
from megatron_het.planner.result import KindBound, UpperBound
from megatron_het.planner.search import search_plan


def kind_subcluster(cluster: ClusterSpec, kind: str) -> ClusterSpec:
    """The node groups of ``cluster`` whose accelerator is ``kind``, with the links among them.

    A group colocated with a host of another kind gets its own nodes of the same count.
    """
    groups = [g for g in cluster.node_groups if g.accelerator.name == kind]
    names = {g.name for g in groups}
    if not groups:
        raise UserError(f"cluster {cluster.name} has no {kind} devices")
    groups = [g if g.colocate_with is None or g.colocate_with in names
              else replace(g, colocate_with=None) for g in groups]
    links = [cluster.group_link(a.name, b.name) for i, a in enumerate(groups)
             for b in groups[i + 1:]]
    order = [name for name in cluster.rank_order if name in names]
    return ClusterSpec(groups, links, order, name=f"{cluster.name}[{kind}]")


def upper_bound(model: ModelConfig, cluster: ClusterSpec, global_batch_size: int,
                seq_length: int, profiles: Optional[Mapping[str, Profile]] = None,
                dtype: str = "bf16", **search_options: Any) -> UpperBound:
    """Search each kind alone (:func:`search_plan`, options as given) and sum the devices'
    rates."""
    start = time.perf_counter()
    kinds = []
    for kind, devices in cluster.accelerator_counts().items():
        sub = kind_subcluster(cluster, kind)
        ignored = False
        try:
            found = search_plan(model, sub, global_batch_size, seq_length, profiles, dtype,
                                **search_options)
        except UserError:
            ignored = True
            found = search_plan(model, sub, global_batch_size, seq_length, profiles, dtype,
                                check_memory=False, **search_options)
        kinds.append(KindBound(kind, devices, found.prediction.tokens_per_s / devices,
                               found.candidates[0].layout.describe(), ignored))
    return UpperBound(tuple(kinds), time.perf_counter() - start)


__all__ = ["KindBound", "UpperBound", "kind_subcluster", "upper_bound"]
