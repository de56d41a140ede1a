"""The planner prices stages as the predictor does, on every shape a real search prices.

A spy records every stage model (:func:`~megatron_het.planner.stage_model.probe_stage_model`)
and every per-kind cost table (:class:`~megatron_het.planner.bounds.KindCosts`) that
:func:`~megatron_het.planner.search_plan` builds, plain, interleaved and heterogeneous-DP
families alike; each is then checked against ``predict(..., pipeline_model="closed_form")`` of
the plans it stands for: the stage model's iteration time (and, for plain layouts, its
memory) equals the prediction's, and the time and memory bounds lie below it.
"""

from __future__ import annotations

import inspect
import pathlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, RunOptions, model_preset
from megatron_het.perf import Prediction, fits, predict
from megatron_het.perf.cost.comm_time import CommCost
from megatron_het.perf.cost.memory import RESERVED_FRACTION
from megatron_het.planner import bounds, kind_replicas, layout_search, search_plan, stage_model
from megatron_het.planner.space import Layout, Placement, build_plan

REPO = pathlib.Path(__file__).resolve().parents[2]
RELATIVE = 1e-9
MODEL = ModelConfig(
    name="t-12l",
    num_layers=12,
    hidden_size=2048,
    ffn_hidden_size=5632,
    num_attention_heads=16,
    num_query_groups=4,
    vocab_size=32000,
)


def _odd_gpus() -> ClusterSpec:
    """4 H100 + 3 MI250X: no uniform replica of both kinds, so heterogeneous DP is probed."""
    return ClusterSpec.from_dict(
        {
            "name": "odd",
            "node_groups": [
                {
                    "name": group,
                    "accelerator": kind,
                    "nodes": 1,
                    "devices_per_node": n,
                    "nic_bandwidth_gbit_per_s": 3200,
                }
                for group, kind, n in (("h", "H100", 4), ("m", "MI250X", 3))
            ],
        }
    )


# (model, cluster, global batch, sequence); every search runs with interleaving (up to 4
# chunks) and heterogeneous DP on, their defaults.
SEARCHES: dict[str, Callable[[], tuple[ModelConfig, ClusterSpec, int, int]]] = {
    "two_emulated_kinds": lambda: (
        model_preset("tiny"),
        ClusterSpec.load(REPO / "scripts/clusters/cpu_emulated.yaml"),
        8,
        128,
    ),
    "h100_a100": lambda: (
        MODEL,
        ClusterSpec.load(REPO / "scripts/clusters/h100_a100.yaml"),
        64,
        1024,
    ),
    "h100_mi250x_uneven": lambda: (MODEL, _odd_gpus(), 24, 1024),
}


@dataclass(frozen=True)
class Probe:
    """One stage model a search built, with what it was probed on."""

    model: ModelConfig
    layout: Layout
    placement: Placement
    cluster: ClusterSpec
    seq_length: int
    profiles: Any
    dtype: str
    fused_elementwise: bool
    result: stage_model.StageModel
    family: str  # the planner module that probed it


def _recorded_search(monkeypatch, name: str) -> tuple[list[Probe], list[bounds.KindCosts]]:
    """Run the search ``name`` with spies on the stage models and cost tables it builds."""
    probes: list[Probe] = []
    tables: list[bounds.KindCosts] = []
    real = stage_model.probe_stage_model

    def spied(family: str) -> Callable[..., stage_model.StageModel]:
        def probe(*args: Any, **kwargs: Any) -> stage_model.StageModel:
            bound = inspect.signature(real).bind(*args, **kwargs)
            bound.apply_defaults()
            given = bound.arguments
            result = real(*args, **kwargs)
            probes.append(
                Probe(
                    given["model"],
                    given["layout"],
                    given["placement"],
                    given["cluster"],
                    given["seq_length"],
                    given["profiles"],
                    given["dtype"],
                    given["fused_elementwise"],
                    result,
                    family,
                )
            )
            return result

        return probe

    class RecordedCosts(bounds.KindCosts):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            tables.append(self)

    for module in (layout_search, kind_replicas):
        monkeypatch.setattr(module, "probe_stage_model", spied(module.__name__))
        monkeypatch.setattr(module, "KindCosts", RecordedCosts)
    model, cluster, gbs, seq = SEARCHES[name]()
    search_plan(model, cluster, gbs, seq, top_k=2)
    return probes, tables


def _splits(probe: Probe, count: int = 3) -> list[list[int]]:
    """The balanced split of the probe's layout and random ones (every device group at least
    one layer per chunk)."""
    sm, layers = probe.result, probe.model.num_layers
    least, stages = sm.min_layers, sm.num_stages
    out = []
    balanced = stage_model.balance_layers(sm, layers, check_memory=False)
    if balanced is not None:
        out.append(balanced)
    rng = random.Random(len(probe.layout.describe()) + stages)
    spare = layers - least * stages
    for _ in range(count - len(out)):
        cuts = sorted(rng.randint(0, spare) for _ in range(stages - 1))
        extra = [b - a for a, b in zip([0, *cuts], [*cuts, spare])]
        out.append([least + e for e in extra])
    return out


def _closed_form(probe: Probe, split: list[int]) -> Prediction:
    plan = build_plan(probe.layout, split, probe.placement, probe.dtype)
    return predict(
        probe.model,
        plan,
        probe.cluster,
        probe.seq_length,
        probe.profiles,
        options=RunOptions.from_plan(
            plan, dtype=probe.dtype, fused_elementwise=probe.fused_elementwise
        ),
        pipeline_model="closed_form",
    )


def _check_bounds(
    probe: Probe, table: bounds.KindCosts, split: list[int], prediction: Prediction
) -> None:
    """Every bound of the layout below the prediction of this split of it: the time bounds
    (loose and tight, plus the sync bound) below its time; a layout whose split fits is
    feasible by the per-layer bytes; those bytes alone below every device's bytes."""
    layout, layers = probe.layout, probe.model.num_layers
    comm = CommCost(probe.cluster, probe.profiles)
    sync = bounds.sync_lower_bound(layout, table, layers, comm)
    for tight in (False, True):
        bound = bounds.time_lower_bound(layout, table, layers, tight) + sync
        assert bound <= prediction.iteration_time_s * (1 + RELATIVE), (tight, layout.describe())
    assert bounds.memory_feasible(layout, table, layers) or not fits(prediction, probe.cluster).ok
    room = bounds.layer_room(layout, table)
    for g, n in enumerate(split):
        row = prediction.stages[g]  # a device group's figures sit on each of its rows
        usable = row.capacity_bytes * (1 - RESERVED_FRACTION)
        # n layers' bytes alone (usable / room each) never exceed the device's predicted bytes
        assert n * usable <= room[g] * row.memory.total_bytes * (1 + RELATIVE), (
            g,
            layout.describe(),
        )


@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_every_stage_model_and_bound_of_a_search_agrees_with_the_predictor(
    monkeypatch, name: str
) -> None:
    probes, tables = _recorded_search(monkeypatch, name)
    table_of = {id(t.placement): t for t in tables}
    assert probes and tables
    assert any(p.layout.num_chunks > 1 for p in probes)  # the interleaved family was priced
    if name != "h100_a100":  # uneven kinds: the heterogeneous-DP family was priced
        assert any(p.family == kind_replicas.__name__ for p in probes)
    checked_bounds = 0
    for probe in probes:
        sm = probe.result
        for split in _splits(probe):
            closed = _closed_form(probe, split)
            assert sm.iteration_time(split) == pytest.approx(
                closed.iteration_time_s, rel=RELATIVE
            ), (probe.layout.describe(), split)
            if probe.layout.num_chunks == 1:  # interleaved memory is interpolated
                for g, n in enumerate(split):
                    assert sm.memory[g](n) == pytest.approx(
                        closed.stages[g].memory.total_bytes, rel=RELATIVE
                    )
            table = table_of.get(id(probe.placement))
            if table is not None:
                _check_bounds(probe, table, split, closed)
                checked_bounds += 1
    assert checked_bounds >= len(probes)
