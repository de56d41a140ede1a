"""The predictor on pipelines of different layouts (heterogeneous data parallelism): per-pipeline
rows, the DP sync as full-unit all-reduces over each unit's holders (by hand), ZeRO-1's rows
owned per pipeline as the runtime owns them, the sync's full-size buffers in memory."""

import glob
import pathlib

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import RunOptions, model_preset
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.replicas import ReplicaUnit, replica_units, uniform_layouts
from megatron_het.perf import fits, predict
from megatron_het.perf.cost.dp_sync import unit_parameters
from megatron_het.perf.cost.memory import layer_parameters
from megatron_het.training.plan_setup import local_cluster

SEQ = 64
TIED = model_preset("tiny-tied")
HETERO = "scripts/plans/cpu_hetero_dp.json"
HETERO_SP = "scripts/plans/cpu_interleaved_hetero_dp_sp.json"
# local_cluster's intra-node link: 10 GB/s at the comm model's 80% efficiency, 1 us.
BANDWIDTH, LATENCY = 10e9 * 0.8, 1e-6


def ring_all_reduce(nbytes, k):
    return 2 * (k - 1) / k * nbytes / BANDWIDTH + 2 * (k - 1) * LATENCY


@pytest.fixture(scope="module")
def hetero():
    return ParallelPlan.load(HETERO)


def test_a_plan_whose_pipelines_differ_predicts(hetero):
    cluster = local_cluster(4)
    pred = predict(TIED, hetero, cluster, SEQ)
    assert [(s.pipeline, s.stage, s.tp) for s in pred.stages] == [(0, 0, 1), (0, 1, 1), (1, 0, 2)]
    assert [p.micro_batches for p in pred.pipelines] == [3, 1]
    for p in pred.pipelines:
        assert p.lower_bound_s - 1e-12 <= p.time_s <= p.closed_form_s + 1e-12
    assert pred.iteration_time_s == pytest.approx(
        pred.pipeline_time_s + pred.dp_sync_s + pred.optimizer_s
    )
    assert pred.pipeline_time_s == max(p.time_s for p in pred.pipelines)
    assert pred.stages[0].p2p_forward_s > 0 and pred.stages[2].p2p_forward_s == 0.0
    assert pred.stages[2].tp_comm_s > 0
    assert fits(pred, cluster).ok
    assert len(pred.table().splitlines()) == 5


def test_the_dp_sync_is_every_held_units_full_all_reduce_by_hand(hetero):
    h, v = TIED.hidden_size, TIED.vocab_size
    layer = 2 * (h * (64 + 2 * 32) + 64 * h + 3 * h * TIED.ffn_hidden_size + 2 * h)
    assert layer == 2 * layer_parameters(TIED, 1)  # two layers per unit
    # Units and holders: the embedding on both first stages and (tied) on the last stage of
    # pipeline 0; layers 0-1 on ranks 0, 2, 3; layers 2-3 and the final norm on 1, 2, 3.
    units = [
        (ReplicaUnit("embedding"), (0, 1, 2, 3)),
        (ReplicaUnit("layers", (0, 2)), (0, 2, 3)),
        (ReplicaUnit("layers", (2, 4)), (1, 2, 3)),
        (ReplicaUnit("head"), (1, 2, 3)),
    ]
    assert replica_units(hetero, TIED.num_layers, True) == units
    assert [unit_parameters(TIED, u) for u, _ in units] == [v * h, layer, layer, h]
    emb, first, second, norm = (
        ring_all_reduce(4 * n, k) for n, k in ((v * h, 4), (layer, 3), (layer, 3), (h, 3))
    )
    plain = predict(
        TIED, hetero, local_cluster(4), SEQ, options=RunOptions.from_plan(hetero, dtype="bf16")
    )
    expected = [emb + first, emb + second + norm, emb + first + second + norm]
    assert [s.dp_sync_s for s in plain.stages] == pytest.approx(expected, rel=1e-12)
    assert plain.dp_sync_s == pytest.approx(max(expected), rel=1e-12)
    assert plain.stages[2].dp_algorithm.startswith("4 full-unit all-reduces")
    # ZeRO-1: a second all-reduce of each full unit, in bf16, shares the updated rows.
    zero = predict(
        TIED,
        hetero,
        local_cluster(4),
        SEQ,
        options=RunOptions.from_plan(hetero, dtype="bf16", use_distributed_optimizer=True),
    )
    shares = [ring_all_reduce(2 * n, k) for n, k in ((v * h, 4), (layer, 3), (layer, 3), (h, 3))]
    assert zero.stages[0].dp_sync_s == pytest.approx(emb + first + shares[0] + shares[1], rel=1e-12)
    assert zero.stages[2].dp_sync_s == pytest.approx(sum(expected[2:]) + sum(shares), rel=1e-12)


def _runtime_owned(model, plan, rank):
    """Parameters ``rank`` owns under ZeRO-1 across replicas, from the runtime's ReplicaSync."""
    from megatron_het.checkpoint.reshard import stage_parameter_names
    from megatron_het.optim.replica_sync import ReplicaSync

    role = plan.rank_role(rank)
    names = list(
        dict.fromkeys(n for c in role.chunk_plans for n in stage_parameter_names(model, c))
    )
    units = [
        (u, None)
        for u, holders in replica_units(plan, model.num_layers, model.tie_embeddings)
        if rank in holders
    ]
    sync = ReplicaSync(
        names, units, model, role.stage_plan, role.tp_rank, role.pipeline, plan.dp_size
    )
    owned = 0
    for name in names:
        a, b = sync.owned_rows(name)
        box = [index.stop - index.start for index in sync.entry[name].index]
        per_row = 1
        for n in box[1:]:
            per_row *= n
        owned += (b - a) * per_row
    return owned


@pytest.mark.parametrize("path, layers", [(HETERO, 4), (HETERO_SP, 6)])
@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_zero1_owns_each_row_once_where_the_runtime_does(path, layers, name):
    model = model_preset(name).replace(num_layers=layers)
    plan = ParallelPlan.load(path)
    pred = predict(
        model,
        plan,
        local_cluster(4),
        SEQ,
        options=RunOptions.from_plan(plan, dtype="bf16", use_distributed_optimizer=True),
    )
    owned = {r: _runtime_owned(model, plan, r) for r in plan.ranks()}
    total = model.vocab_size * model.hidden_size * (1 if model.tie_embeddings else 2) + (
        layers * layer_parameters(model, 1) + model.hidden_size
    )
    assert sum(owned.values()) == total  # every element has exactly one owner
    for row in pred.stages:
        # bf16: fp32 master + Adam's two fp32 moments per owned parameter, the group's peak.
        assert row.memory.optimizer_bytes == 12 * max(owned[r] for r in row.ranks)


def test_zero1_splits_the_optimizer_state_per_pipeline(hetero):
    plain = predict(
        TIED, hetero, local_cluster(4), SEQ, options=RunOptions.from_plan(hetero, dtype="bf16")
    )
    zero = predict(
        TIED,
        hetero,
        local_cluster(4),
        SEQ,
        options=RunOptions.from_plan(hetero, dtype="bf16", use_distributed_optimizer=True),
    )
    # Rank 0 (pipeline 0 of 2) holds the embedding and layers 0-1 whole: it owns the first half
    # of every parameter's rows, half its state; the optimizer step does half the work.
    assert zero.stages[0].memory.optimizer_bytes == plain.stages[0].memory.optimizer_bytes / 2
    assert zero.stages[0].optimizer_s == pytest.approx(plain.stages[0].optimizer_s / 2)
    # Rank 1's copy of the tied embedding owns nothing: half of the rest.
    embedding = TIED.vocab_size * TIED.hidden_size
    assert (
        zero.stages[1].memory.optimizer_bytes == 12 * (plain.stages[1].parameters - embedding) / 2
    )
    assert zero.stages[1].memory.weights_bytes == plain.stages[1].memory.weights_bytes


def test_the_sync_buffers_are_the_full_units_and_count_after_the_backward(hetero):
    pred = predict(
        TIED, hetero, local_cluster(4), SEQ, options=RunOptions.from_plan(hetero, dtype="fp32")
    )
    h, v = TIED.hidden_size, TIED.vocab_size
    layer = 2 * layer_parameters(TIED, 1)
    # The tp=2 stage allocates every unit in full: twice its shard's gradients and more.
    assert pred.stages[2].memory.replica_sync_bytes == 4 * (v * h + 2 * layer + h)
    assert pred.stages[0].memory.replica_sync_bytes == 4 * (v * h + layer)
    for row in pred.stages:
        m = row.memory
        static = m.weights_bytes + m.grads_bytes + m.optimizer_bytes
        assert m.total_bytes == pytest.approx(
            static + max(m.activation_bytes + m.transient_bytes, m.replica_sync_bytes)
        )
    uniform = predict(
        TIED,
        ParallelPlan.load("scripts/plans/cpu_emulated_dp2_fast_heavy.json"),
        ClusterSpec.load("scripts/clusters/cpu_emulated.yaml"),
        SEQ,
    )
    assert all(s.memory.replica_sync_bytes == 0.0 for s in uniform.stages)


def test_the_layout_check_tells_apart_the_shipped_plans():
    plans = {
        pathlib.Path(p).name: ParallelPlan.load(p)
        for p in sorted(glob.glob("scripts/plans/*.json"))
    }
    assert not uniform_layouts(plans["cpu_hetero_dp.json"])
    assert not uniform_layouts(plans["cpu_interleaved_hetero_dp_sp.json"])
    assert uniform_layouts(plans["cpu_emulated_dp2_fast_heavy.json"])
