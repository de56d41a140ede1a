"""The planner against an independent brute force on small mixed clusters.

The brute force enumerates every plan of the plan format's space with identical DP replicas:
any sequence of stages (one accelerator kind and a TP degree each, kinds in any order and even
interleaved, TP groups inside a node), every split of the layers, those device groups also
running 2 or 3 interleaved chunks each (every split of the layers into the chunks, the
transfers overlapped with compute as the runtime does by default), every micro-batch size,
recompute on or off (on only where the plan does not fit without: it only adds time), ZeRO-1
on or off, sequence parallelism on or off (on the tight-memory
cluster, where it is what makes plans fit), the DP reduction overlapped with backward where
dp > 1 (the predictor's overlap never costs time, so that is the better of on and off); ranks are handed out in cluster rank order (pipeline d
takes the d-th block of each kind's ranks, in stage order). Each plan is predicted with the
event-driven simulation and kept if it fits in memory. The planner's plan must be within 1% of
the best. A second brute force enumerates heterogeneous DP (replicas of one kind each, every
kind's replicas, splits and batch shares) on a cluster whose kinds' counts share no divisor.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_validation import validate
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan
from megatron_het.perf import SimulationCache, fits, predict
from megatron_het.perf.cost.comm_time import CommCost
from megatron_het.planner.search import search_plan

SEQ = 1024
MODEL = ModelConfig(
    name="bf-6l",
    num_layers=6,
    hidden_size=2048,
    ffn_hidden_size=5632,
    num_attention_heads=16,
    num_query_groups=4,
    vocab_size=32000,
)


def _group(name: str, kind: str, nodes: int, per_node: int, nic_gbit: float = 400) -> dict:
    return {
        "name": name,
        "accelerator": kind,
        "nodes": nodes,
        "devices_per_node": per_node,
        "nic_bandwidth_gbit_per_s": nic_gbit,
    }


CLUSTERS = {  # cluster, global batch, the sequence-parallel options enumerated, whether the
    # best plan interleaves (a small batch over few devices: the bubble dominates)
    "h100+a100": (
        {"name": "bf2", "node_groups": [_group("h", "H100", 1, 4), _group("a", "A100-80G", 1, 4)]},
        8,
        (False,),
        False,
    ),
    "h100+mi250x+a100": (
        {
            "name": "bf3",
            "node_groups": [
                _group("h", "H100", 1, 2),
                _group("m", "MI250X", 1, 2),
                _group("a", "A100-40G", 2, 2),
            ],
        },
        8,
        (False,),
        False,
    ),
    "tight memory": (
        {
            "name": "bft",
            "accelerators": {
                "small-a": {"base": "A100-80G", "memory_gib": 1.3},
                "small-b": {"base": "MI250X", "memory_gib": 1.5},
            },
            "node_groups": [_group("a", "small-a", 2, 2), _group("b", "small-b", 1, 2)],
        },
        4,
        (False, True),
        False,
    ),
    "h100+a100 small batch": (
        {"name": "bfi", "node_groups": [_group("h", "H100", 1, 2), _group("a", "A100-80G", 1, 2)]},
        4,
        (False,),
        True,
    ),
}


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def _stage_sequences(
    per_pipeline: dict[str, int], tps: list[int], max_stages: int
) -> Iterator[tuple[tuple[str, int], ...]]:
    """Every ordered sequence of (kind, tp) stages using exactly ``per_pipeline`` devices."""
    if not any(per_pipeline.values()):
        yield ()
        return
    if max_stages == 0:
        return
    for kind, left in per_pipeline.items():
        for tp in tps:
            if tp <= left:
                rest = dict(per_pipeline, **{kind: left - tp})
                for tail in _stage_sequences(rest, tps, max_stages - 1):
                    yield ((kind, tp), *tail)


def _chunked_splits(num_layers: int, groups: int) -> Iterator[tuple[int, tuple[int, ...]]]:
    """(v, layers per stage): every split into ``groups`` stages, and with v = 2 and 3 every
    split into v x ``groups`` interleaved chunks (chunk s on device group s % groups)."""
    for chunks in (1, 2, 3):
        if chunks == 1 or (groups >= 2 and chunks * groups <= num_layers):
            for split in _compositions(num_layers, chunks * groups):
                yield chunks, split


def _ranks(cluster: ClusterSpec, dp: int, sequence) -> list[list[tuple[int, ...]]] | None:
    by_kind: dict[str, list[int]] = {}
    for info in cluster.rank_map():
        by_kind.setdefault(info.accelerator.name, []).append(info.rank)
    out = []
    for d in range(dp):
        taken = {k: d * len(v) // dp for k, v in by_kind.items()}
        stages = []
        for kind, tp in sequence:
            group = tuple(by_kind[kind][taken[kind] : taken[kind] + tp])
            taken[kind] += tp
            if len({cluster.rank_info(r).node for r in group}) > 1:
                return None  # TP groups stay inside a node
            stages.append(group)
        out.append(stages)
    return out


def brute_force_best(
    model: ModelConfig,
    cluster: ClusterSpec,
    global_batch_size: int,
    sequence_parallel: tuple[bool, ...] = (False,),
) -> tuple[float, ParallelPlan | None]:
    """The least simulated iteration time of every plan that fits (see the module docstring),
    and that plan; ``sequence_parallel`` (True as well) tries it on plans with a tp > 1
    stage."""
    counts = cluster.accelerator_counts()
    tps = [
        t
        for t in (1, 2, 4, 8)
        if model.num_attention_heads % t == 0
        and model.num_query_groups % t == 0
        and model.ffn_hidden_size % t == 0
    ]
    cache, best, best_plan = SimulationCache(), float("inf"), None
    comm = CommCost(cluster)  # its memos are pure: shared by every prediction
    for dp in range(1, cluster.world_size + 1):
        if any(n % dp for n in counts.values()) or global_batch_size % dp:
            continue
        share = global_batch_size // dp
        per_pipeline = {k: n // dp for k, n in counts.items()}
        for sequence in _stage_sequences(per_pipeline, tps, model.num_layers):
            ranks = _ranks(cluster, dp, sequence)
            if ranks is None:
                continue
            tp_stages = any(tp > 1 for _, tp in sequence)
            p = len(sequence)
            for (chunks, split), mbs, zero1, sp in itertools.product(
                _chunked_splits(model.num_layers, p),
                [b for b in range(1, share + 1) if share % b == 0],
                (False, True) if dp > 1 else (False,),
                sequence_parallel if tp_stages else (False,),
            ):
                if chunks > 1 and share // mbs < p:
                    continue  # interleaved 1F1B runs at least one micro-batch per group
                for recompute in (False, True):
                    pipelines = []
                    for d in range(dp):
                        start, stages = 0, []
                        for s, n in enumerate(split):
                            (kind, tp), group = sequence[s % p], ranks[d][s % p]
                            stages.append(
                                StagePlan(kind, tp, (start, start + n), group, recompute=recompute)
                            )
                            start += n
                        pipelines.append(PipelinePlan(share // mbs, tuple(stages)))
                    plan = ParallelPlan(
                        mbs,
                        tuple(pipelines),
                        "bf16",
                        zero1,
                        sequence_parallel=sp or None,
                        overlap_grad_reduce=dp > 1 or None,
                    )
                    prediction = predict(
                        model, plan, cluster, SEQ, cache=cache, validate=False, comm=comm
                    )
                    if fits(prediction, cluster).ok:
                        if prediction.iteration_time_s < best:
                            best, best_plan = prediction.iteration_time_s, plan
                        break  # recompute only adds time: needed only where it makes fit
    return best, best_plan


@pytest.mark.parametrize("name", list(CLUSTERS))
@pytest.mark.slow
def test_planner_within_one_percent_of_brute_force(name: str) -> None:
    spec, global_batch_size, sequence_parallel, interleaves = CLUSTERS[name]
    cluster = ClusterSpec.from_dict(spec)
    result = search_plan(MODEL, cluster, global_batch_size, SEQ)
    validate(result.plan, MODEL, cluster, global_batch_size)
    assert fits(result.prediction, cluster).ok
    best, best_plan = brute_force_best(MODEL, cluster, global_batch_size, sequence_parallel)
    assert best_plan is not None
    # There the best plan's chunks are uneven ([1, 3, 1, 1]: the head's chunk holds less),
    # which the planner finds by moving layers between the chunks of its finalists.
    assert best_plan.pipelines[0].interleaved == interleaves
    # Where the enumerated best interleaves, so must the planner's; elsewhere the planner may
    # still interleave with uneven chunks the enumeration lacks, if that is as fast (h100+a100:
    # chunks [1, 3] and [1, 1] per group, 0.03% faster than the enumerated plain best).
    if interleaves:
        assert result.plan.pipelines[0].interleaved
    assert result.prediction.iteration_time_s <= best * 1.01, (
        f"planner {result.prediction.iteration_time_s:.6f} s:\n{result.plan.describe()}\n"
        f"brute force {best:.6f} s:\n{best_plan.describe()}"
    )


def _kind_pipelines(
    model: ModelConfig, cluster: ClusterSpec, kind: str, tps: list[int]
) -> Iterator[tuple[int, list[list[StagePlan]]]]:
    """Every way to run ``kind``'s devices alone as identical replicas: (dp, per replica its
    stages), every stage sequence and layer split, ranks in rank order, TP inside a node."""
    ranks = [i.rank for i in cluster.rank_map() if i.accelerator.name == kind]
    sub = {kind: len(ranks)}
    for dp in range(1, len(ranks) + 1):
        if len(ranks) % dp:
            continue
        per = len(ranks) // dp
        for sequence in _stage_sequences({kind: per}, tps, model.num_layers):
            for split in _compositions(model.num_layers, len(sequence)):
                replicas, ok = [], True
                for d in range(dp):
                    taken, start, stages = d * per, 0, []
                    for (_, tp), n in zip(sequence, split):
                        group = tuple(ranks[taken : taken + tp])
                        ok &= len({cluster.rank_info(r).node for r in group}) == 1
                        stages.append(StagePlan(kind, tp, (start, start + n), group))
                        taken, start = taken + tp, start + n
                    replicas.append(stages)
                if ok:
                    yield dp, replicas
    del sub


def _splits(total: int, dps: list[int]) -> Iterator[tuple[int, ...]]:
    """Every (m_k >= 1) with sum dps[k] * m_k == total."""
    if not dps:
        if total == 0:
            yield ()
        return
    for m in range(1, total // dps[0] + 1):
        for tail in _splits(total - dps[0] * m, dps[1:]):
            yield (m, *tail)


def brute_force_replicas(
    model: ModelConfig, cluster: ClusterSpec, global_batch_size: int
) -> tuple[float, ParallelPlan | None]:
    """The least simulated time of every heterogeneous-DP plan of replicas of one kind each
    (:func:`_kind_pipelines` per kind, every micro-batch size and batch share, ZeRO-1 on or
    off, recompute on where the plan does not fit without) that fits, and that plan."""
    tps = [
        t
        for t in (1, 2, 4, 8)
        if model.num_attention_heads % t == 0
        and model.num_query_groups % t == 0
        and model.ffn_hidden_size % t == 0
    ]
    kinds = list(cluster.accelerator_counts())
    cache, comm, best, best_plan = SimulationCache(), CommCost(cluster), float("inf"), None
    per_kind = [list(_kind_pipelines(model, cluster, k, tps)) for k in kinds]
    for choice in itertools.product(*per_kind):
        dps = [dp for dp, _ in choice]
        for mbs in [b for b in range(1, global_batch_size + 1) if global_batch_size % b == 0]:
            for shares in _splits(global_batch_size // mbs, dps):
                for zero1 in (False, True):
                    for recompute in (False, True):
                        pipelines = tuple(
                            PipelinePlan(
                                m,
                                tuple(
                                    StagePlan(
                                        s.accelerator, s.tp, s.layers, s.ranks, recompute=recompute
                                    )
                                    for s in stages
                                ),
                            )
                            for (_, replicas), m in zip(choice, shares)
                            for stages in replicas
                        )
                        plan = ParallelPlan(mbs, pipelines, "bf16", zero1)
                        prediction = predict(
                            model, plan, cluster, SEQ, cache=cache, validate=False, comm=comm
                        )
                        if fits(prediction, cluster).ok:
                            if prediction.iteration_time_s < best:
                                best, best_plan = prediction.iteration_time_s, plan
                            break  # recompute only adds time
    return best, best_plan


REPLICA_MODEL = ModelConfig(
    name="bf-4l",
    num_layers=4,
    hidden_size=2048,
    ffn_hidden_size=5632,
    num_attention_heads=16,
    num_query_groups=4,
    vocab_size=32000,
)


@pytest.mark.slow
def test_planner_within_one_percent_of_brute_force_with_replicas_of_one_kind() -> None:
    """Device counts with no common divisor: every uniform pipeline holds both kinds, and
    replicas of one kind each (batch shared by speed) win; the planner finds them."""
    cluster = ClusterSpec.from_dict(
        {
            "name": "bfr",
            "node_groups": [_group("h", "H100", 1, 2, 3200), _group("m", "MI250X", 1, 3, 3200)],
        }
    )
    global_batch_size = 12
    result = search_plan(REPLICA_MODEL, cluster, global_batch_size, SEQ)
    validate(result.plan, REPLICA_MODEL, cluster, global_batch_size)
    assert fits(result.prediction, cluster).ok
    uniform, _ = brute_force_best(REPLICA_MODEL, cluster, global_batch_size)
    best, best_plan = brute_force_replicas(REPLICA_MODEL, cluster, global_batch_size)
    assert best_plan is not None and best < uniform  # the case is one for replicas
    assert result.prediction.iteration_time_s <= best * 1.01, (
        f"planner {result.prediction.iteration_time_s:.6f} s:\n{result.plan.describe()}\n"
        f"brute force {best:.6f} s:\n{best_plan.describe()}"
    )
