"""The clusters and plans that bench/hetero_efficiency.py compares (EMULATION).

:func:`cluster_dicts` gives the 4-rank emulated cluster and its single-kind halves. The plan
functions take and return plan files' JSON mappings (``megatron_het.plan/1``), built from the
planner's:

* :func:`uniform_split`: the planned layout with layers split evenly over its stages;
* :func:`interleaved`: the planned layout with every device group running ``v`` chunks
  (:func:`megatron_het.parallel.plan_builders.interleave_plan`);
* :func:`replicas_by_kind`: heterogeneous data parallelism, one replica per kind (the
  planner's single-kind plans side by side, ranks renumbered into the mixed cluster), the
  global batch shared in proportion to the kinds' predicted speeds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.emulated_cluster import dilated_cluster
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_builders import interleave_plan

BASE_CLUSTER = Path(__file__).resolve().parents[1] / "scripts" / "clusters" / "cpu_emulated.yaml"


def cluster_dicts(dilation: float) -> dict[str, dict[str, Any]]:
    """The 4-rank cluster (cpu_emulated.yaml, slowdowns x ``dilation``) and its two 2-rank
    halves, as cluster-file mappings keyed by configuration group ("mixed", "fast", "slow")."""
    mixed = dilated_cluster(BASE_CLUSTER, dilation)
    extra = {"accelerators": mixed["accelerators"]} if "accelerators" in mixed else {}
    halves = {}
    for group in mixed["node_groups"]:
        alone = {k: v for k, v in group.items() if k != "colocate_with"}
        halves[group["name"]] = {
            "name": f"{mixed['name']}_{group['name']}_only",
            "node_groups": [alone],
            **extra,
        }
    return {"mixed": mixed, **halves}


def describe(plan: dict[str, Any]) -> str:
    """One line: per pipeline, its micro-batches and stages as kind:layers."""
    parts = []
    for pipeline in plan["pipelines"]:
        stages = " | ".join(
            f"{s['accelerator']} tp{s['tp']} L{s['layers'][0]}-{s['layers'][1]} r{s['ranks']}"
            for s in pipeline["stages"]
        )
        parts.append(f"m={pipeline['micro_batches']}: {stages}")
    return f"mbs={plan['micro_batch_size']}; " + "; ".join(parts)


def uniform_split(plan: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``plan`` with every pipeline's layers spread evenly over its stages (earlier stages take
    the remainder), everything else unchanged."""
    out = json.loads(json.dumps(plan))
    for pipeline in out["pipelines"]:
        stages = pipeline["stages"]
        base, extra = divmod(num_layers, len(stages))
        start = 0
        for i, stage in enumerate(stages):
            count = base + (1 if i < extra else 0)
            stage["layers"] = [start, start + count]
            start += count
    out["description"] = "uniform layer split of the planned layout"
    return out


def interleaved(plan: dict[str, Any], num_chunks: int) -> dict[str, Any]:
    """``plan`` interleaved: each device group runs ``num_chunks`` model chunks (UserError when
    its layout cannot be, e.g. a one-stage pipeline)."""
    out = interleave_plan(ParallelPlan.load(plan), num_chunks).to_dict()
    out["description"] = f"the planned layout, {num_chunks} interleaved chunks per device group"
    return out


def replicas_by_kind(
    fast: dict[str, Any],
    slow: dict[str, Any],
    fast_ranks: int,
    fast_tokens_per_s: float,
    slow_tokens_per_s: float,
    micro_batch_size: int | None = None,
) -> dict[str, Any]:
    """The single-kind plans ``fast`` (ranks ``0..fast_ranks-1`` of the mixed cluster) and
    ``slow`` (its ranks shifted by ``fast_ranks``) as the replicas of one plan, with the
    micro-batches of the global batch shared by the kinds' speeds (at least one each), of
    ``micro_batch_size`` (default: the smaller of the two plans')."""
    mbs = micro_batch_size or min(fast["micro_batch_size"], slow["micro_batch_size"])
    total = sum(p["micro_batches"] for p in fast["pipelines"]) * fast["micro_batch_size"] // mbs
    share = fast_tokens_per_s / (fast_tokens_per_s + slow_tokens_per_s)
    counts = {
        "fast": min(
            total - len(slow["pipelines"]), max(len(fast["pipelines"]), round(total * share))
        )
    }
    counts["slow"] = total - counts["fast"]
    pipelines = []
    for kind, plan, shift in (("fast", fast, 0), ("slow", slow, fast_ranks)):
        replicas = plan["pipelines"]
        base, extra = divmod(counts[kind], len(replicas))
        for i, pipeline in enumerate(replicas):
            stages = [
                {**stage, "ranks": [r + shift for r in stage["ranks"]]}
                for stage in pipeline["stages"]
            ]
            pipelines.append({"micro_batches": base + (i < extra), "stages": stages})
    out = {
        "format": fast["format"],
        "micro_batch_size": mbs,
        "pipelines": pipelines,
        "description": "heterogeneous data parallelism: one replica per kind, batch shares "
        "by speed",
    }
    for key in ("dtype", "use_distributed_optimizer"):
        if key in fast:
            out[key] = fast[key]
    return out
