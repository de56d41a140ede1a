"""build_process_groups on the shipped example plans (gloo, 4 forked ranks of two kinds).

Every group's members are checked against the plans read by hand, and every group is used once
(an all-reduce of the global ranks), so the backend groups really connect those ranks.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch

from megatron_het.comm import UnifiedCommunicator
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.process_groups import build_process_groups
from tests.distributed.harness import run_ranks

PLANS = Path(__file__).resolve().parents[2] / "scripts" / "plans"
FIELDS = ("tp", "dp", "pipeline", "embedding", "stage_cross_dp")

# plan file -> per rank: (tp, dp, pipeline, embedding, stage_cross_dp) members (None: no group).
EXPECTED = {
    "cpu_emulated_3stage.json": [
        ((0, 1), (0,), (0, 1, 2, 3), (0, 1, 3), (0, 1)),  # tp 2 -> 1: both end stages whole
        ((0, 1), (1,), (0, 1, 2, 3), (0, 1, 3), (0, 1)),
        ((2,), (2,), (0, 1, 2, 3), None, (2,)),
        ((3,), (3,), (0, 1, 2, 3), (0, 1, 3), (3,)),
    ],
    "cpu_emulated_dp2_fast_heavy.json": [
        ((0,), (0, 1), (0, 2), (0, 2), (0, 1)),
        ((1,), (0, 1), (1, 3), (1, 3), (0, 1)),
        ((2,), (2, 3), (0, 2), (0, 2), (2, 3)),
        ((3,), (2, 3), (1, 3), (1, 3), (2, 3)),
    ],
    "cpu_emulated_pp4.json": [
        ((0,), (0,), (0, 1, 2, 3), (0, 3), (0,)),
        ((1,), (1,), (0, 1, 2, 3), None, (1,)),
        ((2,), (2,), (0, 1, 2, 3), None, (2,)),
        ((3,), (3,), (0, 1, 2, 3), (0, 3), (3,)),
    ],
    "cpu_emulated_tp2_pp2.json": [  # equal tp on both ends: rank-by-rank pairs
        ((0, 1), (0,), (0, 1, 2, 3), (0, 2), (0, 1)),
        ((0, 1), (1,), (0, 1, 2, 3), (1, 3), (0, 1)),
        ((2, 3), (2,), (0, 1, 2, 3), (0, 2), (2, 3)),
        ((2, 3), (3,), (0, 1, 2, 3), (1, 3), (2, 3)),
    ],
}


def _members(groups: object) -> tuple:
    out = []
    for name in FIELDS:
        group = getattr(groups, name)
        out.append(None if group is None else tuple(group.ranks))
    return tuple(out)


def _sums(groups: object, rank: int) -> tuple:
    """All-reduce of the global rank over each group: the sum of its members."""
    out = []
    for name in FIELDS:
        group = getattr(groups, name)
        if group is None:
            out.append(None)
            continue
        value = torch.tensor([float(rank)])
        group.all_reduce(value, "sum")
        out.append(int(value.item()))
    return tuple(out)


def _build_all(rank: int, world_size: int) -> dict:
    comm = UnifiedCommunicator(
        ["fast", "fast", "slow", "slow"],
        {"fast": "gloo", "slow": "gloo"},
        {"fast": "cpu", "slow": "cpu"},
        timeout=datetime.timedelta(seconds=60),
    )
    result: dict = {}
    for name in EXPECTED:
        plan = ParallelPlan.load(PLANS / name)
        groups = build_process_groups(comm, plan)
        role = groups.role
        result[name] = {
            "members": _members(groups),
            "sums": _sums(groups, rank),
            "role": (role.pipeline, role.stage, role.tp_rank),
            "tp_rank": groups.tp.rank,
            "world": tuple(groups.world.ranks),
        }
    untied = build_process_groups(
        comm, ParallelPlan.load(PLANS / "cpu_emulated_pp4.json"), tie_embeddings=False
    )
    result["untied_embedding"] = untied.embedding
    errors = []
    bad = ParallelPlan.load(PLANS / "cpu_emulated_tp2_pp2.json").to_dict()
    bad["pipelines"][0]["stages"][0]["ranks"] = [1, 0]
    small = ParallelPlan.load(PLANS / "cpu_emulated_pp4.json").to_dict()
    small["pipelines"][0]["stages"] = small["pipelines"][0]["stages"][:3]
    small["pipelines"][0]["stages"][-1]["layers"] = [2, 4]
    for d in (bad, small):
        try:
            build_process_groups(comm, ParallelPlan.from_dict(d))
        except UserError as exc:
            errors.append(str(exc))
    result["errors"] = errors
    return result


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_ranks(_build_all, 4, timeout=90)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_groups_of_example_plans(per_rank: list[dict], name: str) -> None:
    plan = ParallelPlan.load(PLANS / name)
    for rank, expected in enumerate(EXPECTED[name]):
        got = per_rank[rank][name]
        assert got["members"] == expected, (name, rank)
        assert got["sums"] == tuple(None if m is None else sum(m) for m in expected)
        role = plan.rank_role(rank)
        assert got["role"] == (role.pipeline, role.stage, role.tp_rank)
        assert got["tp_rank"] == role.tp_rank  # group rank order = the plan's tp_rank order
        assert got["world"] == (0, 1, 2, 3)
        same_shard = tuple(
            r
            for r in plan.ranks()
            if plan.rank_role(r).tp_rank == role.tp_rank
            and plan.rank_role(r).stage_plan.layers == role.stage_plan.layers
        )
        assert got["members"][1] == same_shard


def test_untied_and_refused_plans(per_rank: list[dict]) -> None:
    for rank in range(4):
        assert per_rank[rank]["untied_embedding"] is None
        unsorted, too_small = per_rank[rank]["errors"]
        assert "ascending order" in unsorted and "\n" not in unsorted
        assert "launch 3 ranks" in too_small
