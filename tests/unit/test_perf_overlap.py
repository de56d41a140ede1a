"""The DP options in the predictor: gradient buckets overlapped with backward, ZeRO-1's parameter
all-gather overlapped with the next forward, bf16 reduction."""

import dataclasses
import inspect
import json
import pathlib
import random

import pytest
import torch

from megatron_het.cluster import ClusterSpec
from megatron_het.config import RunOptions, model_preset
from megatron_het.errors import UserError
from megatron_het.model.llama import LlamaModel
from megatron_het.optim.data_parallel import GradBuckets, plan_buckets
from megatron_het.optim.parallel_optimizer import build_parallel_optimizer
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_builders import plan_from_megatron_flags
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan
from megatron_het.perf import predict
from megatron_het.perf.cost.comm_time import SyncCost
from megatron_het.perf.cost.dp_sync import DPSync
from megatron_het.perf.cost.dp_sync_overlap import (
    BUCKET_SIZE_MB,
    BucketTiming,
    bucket_layout,
    device_parameters,
    exposed_sync,
    gather_delay,
    reduction_end,
)
from megatron_het.perf.schedule.closed_forms import last_backward_ends
from megatron_het.perf.schedule.simulator import simulate_1f1b
from megatron_het.tensor_parallel.sharding import parameter_shape, shard_spec
from megatron_het.training.plan_setup import local_cluster

TINY, TIED = model_preset("tiny"), model_preset("tiny-tied")
LLAMA = model_preset("llama2-7b")
SEQ = 4096


def a100_nodes(nodes: int) -> ClusterSpec:
    return ClusterSpec.from_dict(
        {
            "name": "a100",
            "node_groups": [
                {
                    "name": "a100",
                    "accelerator": "A100-40G",
                    "nodes": nodes,
                    "devices_per_node": 8,
                    "nic_bandwidth_gbit_per_s": 200,
                }
            ],
        }
    )


@pytest.fixture(scope="module")
def cross_node():
    """llama2-7b, tp=8 pp=4 dp=2 on 8 nodes: every DP group crosses the NICs."""
    cluster = a100_nodes(8)
    return cluster, plan_from_megatron_flags(LLAMA, 64, 8, 4, 1, 16, accelerator_of=cluster)


# ---- the runtime's buckets ---------------------------------------------------------------
def _stage_params(model, pipeline, group):
    chunks = [pipeline.stages[s] for s in pipeline.group_stages(group)]
    with torch.device("meta"):
        stage = LlamaModel(
            model,
            has_embedding=chunks[0].has_embedding,
            has_head=chunks[-1].has_head,
            chunks=[(c.layers[0], c.layers[1], False) for c in chunks],
        )
    return [(n, p) for n, p in stage.named_parameters() if p.requires_grad]


def _pipeline(splits, tp=1, repeat=1):
    """One pipeline of ``len(splits)`` groups (each chunk's layers), chunks round-robin."""
    groups = len(splits) // repeat
    return PipelinePlan(
        2,
        tuple(
            StagePlan("cpu", tp, layers, tuple(range(tp * (i % groups), tp * (i % groups) + tp)))
            for i, layers in enumerate(splits)
        ),
    )


@pytest.mark.parametrize("model", [TINY, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize(
    "splits, repeat",
    [
        ([(0, 4)], 1),
        ([(0, 1), (1, 3), (3, 4)], 1),
        ([(0, 1), (1, 2), (2, 3), (3, 4)], 2),
        ([(0, 1.5), (1.5, 2.5), (2.5, 4)], 1),
    ],
    ids=["one stage", "three stages", "interleaved", "half layers"],
)
def test_buckets_are_the_runtimes(model, splits, repeat):
    pipeline = _pipeline(splits, repeat=repeat)
    for group in range(pipeline.pp_size):
        named = _stage_params(model, pipeline, group)
        params = device_parameters(model, pipeline, group)
        assert [(p.name, p.elements) for p in params] == [(n, t.numel()) for n, t in named]
        for size_mb, dp in ((0.01, 1), (0.03, 3), (BUCKET_SIZE_MB, 4)):
            runtime = [b.numel for b in plan_buckets(named, size_mb, dp)]
            assert [b.elements for b in bucket_layout(params, dp, size_mb)] == runtime
    assert (
        BUCKET_SIZE_MB
        == inspect.signature(build_parallel_optimizer).parameters["bucket_size_mb"].default
        == inspect.signature(GradBuckets).parameters["bucket_size_mb"].default
    )


def test_tp_shards_and_held_back_embeddings():
    pipeline = _pipeline([(0, 2), (2, 4)], tp=2)
    for group in (0, 1):
        for p in device_parameters(TIED, pipeline, group):
            full = parameter_shape(p.name, TIED)
            shard = shard_spec(p.name, TIED, 2).shard_shape(full, 0)
            assert p.elements == torch.Size(shard).numel(), p.name
            assert p.held_back == (p.name == "embedding.weight")  # tied over 2 stages
    alone = device_parameters(TIED, _pipeline([(0, 4)]), 0)
    assert not any(p.held_back for p in alone)  # one stage holds both ends: no pair sum
    layout = bucket_layout(device_parameters(TIED, pipeline, 0), 1, 0.01)
    assert layout[-1].held_back and layout[-1].done == 1.0  # the embedding comes last
    assert [b.done for b in layout] == sorted(b.done for b in layout)


# ---- the model by hand -------------------------------------------------------------------
def test_a_two_stage_example_by_hand():
    # Stage 0 ends the pipeline at T = 10 with a 2 s last backward and two equal buckets of
    # its R = 1 s reduction, the first complete half-way through it; stage 1 (one bucket,
    # R = 2 s) ended its last backward b_0 + c^b_0 = 2 + 0.5 s earlier.
    ends = last_backward_ends([2.0, 3.0], 10.0, 2, [0.5])
    assert ends == [10.0, 7.5]
    stage0 = [BucketTiming(100, 0.5, False), BucketTiming(100, 1.0, False)]
    # bucket 1 ready at 10 - 2 * 0.5 = 9, done 9.5; bucket 2 ready at 10, done 10.5
    assert reduction_end(stage0, 1.0, [[(10.0, 2.0)]], 10.0) == pytest.approx(10.5)
    # stage 1: ready at 7.5, done at 9.5, hidden behind stage 0's drain
    assert reduction_end([BucketTiming(50, 1.0, False)], 2.0, [[(7.5, 3.0)]], 10.0) == 9.5
    # held back, it waits for the pipeline's end: 10 + 2
    assert reduction_end([BucketTiming(50, 1.0, True)], 2.0, [[(7.5, 3.0)]], 10.0) == 12.0
    # The later member of a DP group sets each bucket's start: bucket 1 waits for the second
    # (9.9 - 0.2 * 0.5 = 9.8 > 10 - 0.5 * 0.5), so 9.8 + 0.5, then 10.3 + 0.5.
    assert reduction_end(stage0, 1.0, [[(10.0, 2.0)], [(9.0, 4.0)]], 10.0) == pytest.approx(10.5)
    assert reduction_end(stage0, 1.0, [[(10.0, 0.5)]], 10.0) == pytest.approx(10.75)
    assert reduction_end(stage0, 1.0, [[(10.0, 0.5)], [(9.9, 0.2)]], 10.0) == pytest.approx(10.8)


def test_exposed_sync_of_a_plan_by_hand():
    plan = ParallelPlan(1, (_pipeline([(0, 2), (2, 4)]), _pipeline([(0, 2), (2, 4)])))
    splits = {0: (1.0, 0.25), 1: (2.0, 0.25)}  # (reduction, ZeRO-1 all-gather) per group
    ends = [[((10.0, 2.0),), ((7.5, 3.0),)]] * 2
    got = exposed_sync(TINY, plan, splits.__getitem__, [10.0, 10.0], ends)
    # tiny fits one 25 MiB bucket per group: group 0 reduces [10, 11] + 0.25, group 1
    # [7.5, 9.5] + 0.25
    assert got == pytest.approx(1.25)


def test_gather_delay_by_hand():
    # Two equal buckets, A = 2 s: the last (first layers) lands at 1, the first at 2. The
    # forward starts at 0.5 and takes 1 s; the last bucket's parameters come first (F = 1),
    # the first bucket's after half the forward (F = 0.5: needed at 1.0).
    buckets = [BucketTiming(100, 0.5, False), BucketTiming(100, 1.0, False)]
    assert gather_delay(buckets, 2.0, [[(0.5, 1.0)]]) == pytest.approx(1.0)  # 2 - 1.0
    # A later fill (stage 2 of a pipeline) hides it all; the earliest member decides.
    assert gather_delay(buckets, 2.0, [[(3.0, 1.0)]]) == 0.0
    assert gather_delay(buckets, 2.0, [[(3.0, 1.0)], [(0.5, 1.0)]]) == pytest.approx(1.0)
    assert gather_delay(buckets, 0.0, [[(0.0, 1.0)]]) == 0.0
    # Never more than the whole all-gather.
    assert gather_delay(buckets, 2.0, [[(0.0, 0.0)]]) == pytest.approx(2.0)


def test_exposed_sync_with_the_gather_under_the_next_forward():
    plan = ParallelPlan(1, (_pipeline([(0, 2), (2, 4)]), _pipeline([(0, 2), (2, 4)])))
    splits = {0: (1.0, 0.25), 1: (2.0, 0.25)}
    ends = [[((10.0, 2.0),), ((7.5, 3.0),)]] * 2
    # one bucket per group: group 0 needs it at its first forward's start (0: 0.25 late),
    # group 1 at 1.5 (after group 0's forward and transfer: hidden)
    firsts = [[((0.0, 1.0),), ((1.5, 1.0),)]] * 2
    got = exposed_sync(TINY, plan, splits.__getitem__, [10.0, 10.0], ends, first_forwards=firsts)
    assert got == pytest.approx(1.0 + 0.25)
    firsts = [[((0.5, 1.0),), ((1.5, 1.0),)]] * 2  # a fill before group 0 hides it too
    assert exposed_sync(
        TINY, plan, splits.__getitem__, [10.0, 10.0], ends, first_forwards=firsts
    ) == pytest.approx(1.0)
    # without the reduction overlapped: it starts at T
    assert exposed_sync(
        TINY, plan, splits.__getitem__, [10.0, 10.0], None, first_forwards=firsts
    ) == pytest.approx(2.0)
    assert exposed_sync(TINY, plan, splits.__getitem__, [10.0, 10.0], None) == pytest.approx(2.25)


@pytest.mark.parametrize("pipeline_model", ["simulate", "closed_form"])
def test_the_param_gather_overlap_hides_at_most_the_all_gather(cross_node, pipeline_model):
    cluster, plan = cross_node
    from megatron_het.perf.cost.comm_time import CommCost

    sync = DPSync(LLAMA, plan, "bf16", True)
    gathers = [sync.split(CommCost(cluster), 0, g)[1] for g in range(4)]
    zero1 = RunOptions.from_plan(plan, use_distributed_optimizer=True)

    def run(**given):
        options = zero1.replace(**given)
        return predict(LLAMA, plan, cluster, SEQ, options=options, pipeline_model=pipeline_model)

    grad_only = run(overlap_grad_reduce=True)
    both = run(overlap_grad_reduce=True, overlap_param_gather=True)
    gather_only = run(overlap_param_gather=True)
    off = run()
    assert both.overlap_param_gather and not grad_only.overlap_param_gather
    assert both.pipeline_time_s == grad_only.pipeline_time_s
    hidden = grad_only.dp_exposed_s - both.dp_exposed_s
    assert 0 < hidden <= max(gathers) + 1e-12
    assert off.dp_exposed_s - gather_only.dp_exposed_s == pytest.approx(hidden, rel=0.5)
    assert gather_only.dp_exposed_s < off.dp_exposed_s == off.dp_sync_s
    assert both.iteration_time_s < grad_only.iteration_time_s
    assert "overlapped with backward and the next forward" in both.table().splitlines()[-1]
    assert both.to_dict()["overlap_param_gather"] is True
    # It needs the distributed optimizer: without, it changes nothing.
    plain = predict(
        LLAMA,
        plan,
        cluster,
        SEQ,
        options=RunOptions.from_plan(plan, overlap_param_gather=True),
        pipeline_model=pipeline_model,
    )
    assert not plain.overlap_param_gather
    assert (
        plain.iteration_time_s
        == predict(LLAMA, plan, cluster, SEQ, pipeline_model=pipeline_model).iteration_time_s
    )
    planned = dataclasses.replace(
        plan, use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
    )
    assert (
        predict(LLAMA, planned, cluster, SEQ, pipeline_model=pipeline_model).iteration_time_s
        == both.iteration_time_s
    )


# ---- the predictor -----------------------------------------------------------------------
def _last_bucket_reduce(pred, model, plan, g=0):
    sync = DPSync(model, plan, pred.dtype, pred.use_distributed_optimizer, pred.grad_reduce_in_bf16)
    from megatron_het.perf.cost.comm_time import CommCost

    reduce_s, _ = sync.split(CommCost(a100_nodes(8)), 0, g)
    buckets = bucket_layout(device_parameters(model, plan.pipelines[0], g), plan.dp_size)
    return reduce_s * buckets[-1].elements / sum(b.elements for b in buckets)


def test_ddp_bucket_size_lays_out_the_buckets(cross_node):
    cluster, plan = cross_node

    def exposed(size):
        return predict(
            LLAMA,
            plan,
            cluster,
            SEQ,
            options=RunOptions.from_plan(plan, overlap_grad_reduce=True, ddp_bucket_size=size),
        ).dp_exposed_s

    default = exposed(None)
    assert default == exposed(int(BUCKET_SIZE_MB * 1024 * 1024 / 4))  # 25 MiB of fp32
    # One bucket per device waits for the whole backward; finer buckets start earlier.
    assert exposed(10**12) > exposed(40_000_000) >= default >= exposed(1_000_000)


@pytest.mark.parametrize("zero1", [False, True], ids=["all-reduce", "zero1"])
@pytest.mark.parametrize("pipeline_model", ["simulate", "closed_form"])
def test_overlap_hides_all_but_the_last_bucket_at_most(cross_node, zero1, pipeline_model):
    cluster, plan = cross_node
    off, on = (
        predict(
            LLAMA,
            plan,
            cluster,
            SEQ,
            options=RunOptions.from_plan(
                plan, use_distributed_optimizer=zero1, overlap_grad_reduce=overlap
            ),
            pipeline_model=pipeline_model,
        )
        for overlap in (False, True)
    )
    assert off.dp_exposed_s == off.dp_sync_s and not off.overlap_grad_reduce
    assert on.overlap_grad_reduce and on.dp_sync_s == off.dp_sync_s
    assert on.pipeline_time_s == off.pipeline_time_s and on.optimizer_s == off.optimizer_s
    assert _last_bucket_reduce(on, LLAMA, plan) <= on.dp_exposed_s < on.dp_sync_s
    assert on.iteration_time_s < off.iteration_time_s
    # Stage 0 ends the pipeline: its sync hides behind its own last backward only.
    stage0 = on.stages[0]
    assert on.dp_exposed_s >= stage0.dp_sync_s - stage0.backward_s - 1e-12
    for pred in (on, off):
        assert pred.iteration_time_s == pytest.approx(
            pred.pipeline_time_s + pred.dp_exposed_s + pred.optimizer_s + pred.overhead_s
        )
    if zero1:  # the parameter all-gather after the step is never hidden
        sync = DPSync(LLAMA, plan, "bf16", True)
        from megatron_het.perf.cost.comm_time import CommCost

        gather = max(sync.split(CommCost(cluster), 0, g)[1] for g in range(4))
        assert on.dp_exposed_s >= gather > 0
    d = on.to_dict()
    assert d["dp_exposed_s"] == on.dp_exposed_s and d["overlap_grad_reduce"] is True
    json.dumps(d)
    assert "overlapped with backward" in on.table().splitlines()[-1]


def test_overlap_never_increases_time_on_random_plans():
    rng = random.Random(3)
    cluster = ClusterSpec.load("scripts/clusters/cpu_emulated.yaml")  # ranks 0-1 fast, 2-3 slow
    for _ in range(6):
        cut = rng.randint(1, 3)

        def stages(ranks):
            return (
                StagePlan("emu-fast", 1, (0, cut), (ranks[0],)),
                StagePlan("emu-slow", 1, (cut, 4), (ranks[1],)),
            )

        plan = ParallelPlan(
            1,
            (
                PipelinePlan(rng.randint(1, 5), stages((0, 2))),
                PipelinePlan(rng.randint(1, 5), stages((1, 3))),
            ),
        )
        model = rng.choice([TINY, TIED, model_preset("small")])
        for pipeline_model in ("simulate", "closed_form"):
            options = RunOptions.from_plan(plan, use_distributed_optimizer=rng.random() < 0.5)
            off = predict(model, plan, cluster, 64, options=options, pipeline_model=pipeline_model)
            on = predict(
                model,
                plan,
                cluster,
                64,
                options=options.replace(overlap_grad_reduce=True),
                pipeline_model=pipeline_model,
            )
            assert on.dp_exposed_s <= off.dp_sync_s + 1e-15
            assert on.iteration_time_s <= off.iteration_time_s + 1e-15
            assert on.dp_exposed_s > 0


def test_heterogeneous_dp_does_not_overlap():
    cluster = local_cluster(4)
    plan = ParallelPlan.load("scripts/plans/cpu_hetero_dp.json")
    off = predict(TINY, plan, cluster, 64)
    on = predict(
        TINY, plan, cluster, 64, options=RunOptions.from_plan(plan, overlap_grad_reduce=True)
    )
    assert on.dp_exposed_s == on.dp_sync_s == off.dp_sync_s > 0
    assert on.iteration_time_s == off.iteration_time_s


def test_plan_keys_set_the_options_and_arguments_override_them(cross_node):
    cluster, plan = cross_node
    planned = dataclasses.replace(plan, overlap_grad_reduce=True, grad_reduce_in_bf16=True)
    from_plan = predict(LLAMA, planned, cluster, SEQ, pipeline_model="closed_form")
    assert from_plan.overlap_grad_reduce and from_plan.grad_reduce_in_bf16
    explicit = predict(
        LLAMA,
        plan,
        cluster,
        SEQ,
        options=RunOptions.from_plan(plan, overlap_grad_reduce=True, grad_reduce_in_bf16=True),
        pipeline_model="closed_form",
    )
    assert explicit.iteration_time_s == from_plan.iteration_time_s
    overridden = predict(
        LLAMA,
        planned,
        cluster,
        SEQ,
        options=RunOptions.from_plan(planned, overlap_grad_reduce=False, grad_reduce_in_bf16=False),
        pipeline_model="closed_form",
    )
    default = predict(LLAMA, plan, cluster, SEQ, pipeline_model="closed_form")
    assert overridden.iteration_time_s == default.iteration_time_s
    assert not default.overlap_grad_reduce and not default.grad_reduce_in_bf16


# ---- bf16 reduction ----------------------------------------------------------------------
class _Recording:
    """A CommCost stand-in that records the bytes each DP sync is asked to move."""

    def __init__(self):
        self.calls = []

    def dp_sync(self, ranks, grad_bytes, param_bytes=None):
        self.calls.append((grad_bytes, param_bytes))
        return SyncCost(1.0, "recorded")

    def kind_of(self, rank):
        return "cpu"


@pytest.mark.parametrize("plan_file", ["cpu_emulated_dp2_fast_heavy.json", "cpu_hetero_dp.json"])
@pytest.mark.parametrize("zero1", [False, True])
def test_bf16_reduction_halves_the_gradient_bytes(plan_file, zero1):
    plan = ParallelPlan.load(f"scripts/plans/{plan_file}")
    fp32, bf16 = _Recording(), _Recording()
    plain, halved = (DPSync(TINY, plan, "bf16", zero1, half) for half in (False, True))
    plain.over(fp32, 0, 0)
    halved.over(bf16, 0, 0)
    assert fp32.calls and len(bf16.calls) == len(fp32.calls)
    if plain.uniform or not zero1:  # ZeRO-1's parameters (uniform) stay in the training dtype
        assert bf16.calls == [(g / 2, p) for g, p in fp32.calls]
    else:  # per unit: its gradients, then ZeRO-1's parameter shares in the training dtype
        assert bf16.calls[0::2] == [(g / 2, p) for g, p in fp32.calls[0::2]]
        assert bf16.calls[1::2] == fp32.calls[1::2]
    ranks = plan.pipelines[0].stages[0].ranks
    assert halved.buffer_bytes(ranks) == plain.buffer_bytes(ranks) / 2


def test_bf16_reduction_in_the_predictor(cross_node):
    cluster, plan = cross_node
    fp32 = predict(LLAMA, plan, cluster, SEQ, pipeline_model="closed_form")
    bf16 = predict(
        LLAMA,
        plan,
        cluster,
        SEQ,
        options=RunOptions.from_plan(plan, grad_reduce_in_bf16=True),
        pipeline_model="closed_form",
    )
    assert 0.45 * fp32.dp_sync_s < bf16.dp_sync_s < 0.55 * fp32.dp_sync_s  # latency stays
    assert bf16.pipeline_time_s == fp32.pipeline_time_s
    with pytest.raises(UserError) as info:
        predict(
            LLAMA,
            plan,
            cluster,
            SEQ,
            options=RunOptions.from_plan(plan, dtype="fp32", grad_reduce_in_bf16=True),
        )
    assert "grad_reduce_in_bf16 needs bf16 training" in str(info.value)
    assert "\n" not in str(info.value)


def test_split_adds_up_to_the_sync(cross_node):
    from megatron_het.perf.cost.comm_time import CommCost, gather_time

    cluster, plan = cross_node
    comm = CommCost(cluster)
    for zero1 in (False, True):
        sync = DPSync(LLAMA, plan, "bf16", zero1)
        for g in range(4):
            reduce_s, gather_s = sync.split(comm, 0, g)
            assert reduce_s + gather_s == pytest.approx(sync.over(comm, 0, g).time_s)
            assert (gather_s > 0) == zero1
    group, params = DPSync(LLAMA, plan, "bf16", True)._group(0)
    expected = gather_time(params * 4, 2, comm.ring_path(group))
    assert DPSync(LLAMA, plan, "bf16", True).split(comm, 0, 0)[0] == pytest.approx(expected)


# ---- closed form vs simulation -----------------------------------------------------------
def _simulated_ends(f, b, m, cf, cb, v=1):
    """The makespan and every stage's last backward end (chunk c of group g: stage c p + g)."""
    result = simulate_1f1b(f, b, m, cf, cb, num_chunks=v)
    ends = {}
    for events in result.timeline:
        for e in events:
            if e.kind == "backward":
                ends[e.stage] = e.end_s
    return result.makespan_s, [ends[s] for s in range(len(f))]


@pytest.mark.parametrize("v", [1, 2])
def test_closed_form_ends_bound_the_simulated_ones(v):
    rng = random.Random(7 + v)
    for trial in range(40):
        p, m = rng.randint(2, 5), rng.randint(1, 9)
        n = p * v
        uniform = trial % 2 == 0
        f = [1.0] * n if uniform else [rng.uniform(0.5, 2.0) for _ in range(n)]
        b = [2.0] * n if uniform else [rng.uniform(1.0, 4.0) for _ in range(n)]
        c = rng.choice([0.0, 0.3])
        cf = [c] * (n - 1) if uniform else [rng.uniform(0, 0.5) for _ in range(n - 1)]
        cb = [c] * (n - 1) if uniform else [rng.uniform(0, 0.5) for _ in range(n - 1)]
        if v > 1:
            m = p * rng.randint(1, 3)  # interleaved 1F1B runs micro-batches in rounds of p
        makespan, simulated = _simulated_ends(f, b, m, cf, cb, v)
        closed = last_backward_ends(b, makespan, n, cb)  # every chunk's, not just chunk 0's
        assert closed[0] == simulated[0] == pytest.approx(makespan)
        for s, c_ in zip(simulated, closed):
            assert s <= c_ + 1e-9
            if uniform:
                assert s == pytest.approx(c_)
        # exposure is monotone and 1-Lipschitz in every end, so the closed form's exceeds the
        # simulation's by at most the largest gap between their ends
        # Interleaved, the first bucket holds the last chunk's parameters: it rides on that
        # chunk's (earlier) last backward.
        buckets = [BucketTiming(10, 0.5, False, v - 1), BucketTiming(10, 1.0, False, 0)]
        reduce = [rng.uniform(0.1, 6.0) for _ in range(p)]

        def exposed(ends):
            return (
                max(
                    reduction_end(
                        buckets,
                        reduce[g],
                        [[(ends[c * p + g], b[c * p + g]) for c in range(v)]],
                        makespan,
                    )
                    for g in range(p)
                )
                - makespan
            )

        slack = max(c_ - s for s, c_ in zip(simulated, closed))
        assert exposed(simulated) - 1e-9 <= exposed(closed) <= exposed(simulated) + slack + 1e-9


def test_closed_form_and_simulation_agree_on_uniform_plans(cross_node):
    cluster, plan = cross_node
    sim, closed = (
        predict(
            LLAMA,
            plan,
            cluster,
            SEQ,
            options=RunOptions.from_plan(plan, overlap_grad_reduce=True),
            pipeline_model=model,
        )
        for model in ("simulate", "closed_form")
    )
    # llama2-7b's stages are nearly uniform (the ends differ by the embedding and the head)
    assert closed.dp_exposed_s == pytest.approx(sim.dp_exposed_s, rel=0.05)
    assert closed.dp_exposed_s >= sim.dp_exposed_s - 1e-12


# ---- the runtime's resolution -----------------------------------------------------------
REPO = pathlib.Path(__file__).resolve().parents[2]
RUN_FLAGS = [
    "--model",
    "tiny",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "300",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "2",
    "--eval-iters",
    "0",
]


def _plan_file(tmp_path, **options) -> str:
    path = tmp_path / "plan.json"
    path.write_text(
        json.dumps(
            {
                "format": "megatron_het.plan/1",
                "micro_batch_size": 2,
                "pipelines": [
                    {
                        "micro_batches": 2,
                        "stages": [{"accelerator": "cpu", "tp": 1, "layers": [0, 4], "ranks": [0]}],
                    }
                ],
                **options,
            }
        )
    )
    return str(path)


@pytest.mark.parametrize(
    "planned, flags, expected",
    [
        ({}, [], (False, False)),
        ({}, ["--overlap-grad-reduce", "--grad-reduce-in-bf16"], (True, True)),
        ({"overlap_grad_reduce": True, "grad_reduce_in_bf16": True}, [], (True, True)),
        ({"overlap_grad_reduce": True}, ["--grad-reduce-in-bf16"], (True, True)),
        (
            {"overlap_grad_reduce": False, "grad_reduce_in_bf16": False},
            ["--overlap-grad-reduce", "--grad-reduce-in-bf16"],
            None,
        ),  # a flag that contradicts the plan file is an error naming both
    ],
)
def test_the_run_takes_the_plans_dp_options(tmp_path, planned, flags, expected):
    from megatron_het.arguments import parse_run_config
    from megatron_het.training.run import predict_run
    from megatron_het.training.setup import prepare_run
    from megatron_het.training.trainer import grad_reduce_dtype

    run = parse_run_config(
        [*RUN_FLAGS, "--bf16", "--plan", _plan_file(tmp_path, **planned), *flags]
    )
    if expected is None:
        with pytest.raises(
            UserError,
            match='^--overlap-grad-reduce contradicts the plan\'s "overlap_grad_reduce": false',
        ):
            prepare_run(run)
        return
    setup = prepare_run(run)
    options = setup.options  # what the trainer builds the optimizer from
    assert (options.overlap_grad_reduce, options.grad_reduce_in_bf16) == expected
    assert grad_reduce_dtype(setup) == (torch.bfloat16 if expected[1] else torch.float32)
    prediction = predict_run(setup)
    assert (prediction.overlap_grad_reduce, prediction.grad_reduce_in_bf16) == expected


def test_the_plans_bf16_reduction_needs_bf16_training(tmp_path):
    from megatron_het.arguments import parse_run_config
    from megatron_het.training.setup import prepare_run

    run = parse_run_config([*RUN_FLAGS, "--plan", _plan_file(tmp_path, grad_reduce_in_bf16=True)])
    with pytest.raises(UserError) as info:
        prepare_run(run)
    assert str(info.value) == (
        "the plan's grad_reduce_in_bf16 needs bf16 training but the run "
        "trains in fp32; add --bf16 or drop the plan's key"
    )


def test_the_param_gather_overlap_needs_the_distributed_optimizer(tmp_path):
    from megatron_het.arguments import parse_run_config
    from megatron_het.training.run import predict_run
    from megatron_het.training.setup import prepare_run

    with pytest.raises(
        UserError,
        match="^--overlap-param-gather overlaps the distributed "
        "optimizer's parameter all-gather; add "
        "--use-distributed-optimizer",
    ):
        prepare_run(parse_run_config([*RUN_FLAGS, "--overlap-param-gather"]))
    with pytest.raises(
        UserError, match="^the plan's overlap_param_gather needs the distributed optimizer"
    ):
        prepare_run(
            parse_run_config(
                [*RUN_FLAGS, "--plan", _plan_file(tmp_path, overlap_param_gather=True)]
            )
        )
    with pytest.raises(UserError, match="plan.json: plan: overlap_param_gather overlaps the "):
        ParallelPlan.load(
            _plan_file(tmp_path, use_distributed_optimizer=False, overlap_param_gather=True)
        )
    for flags in (
        ["--use-distributed-optimizer", "--overlap-param-gather"],
        ["--plan", _plan_file(tmp_path, use_distributed_optimizer=True, overlap_param_gather=True)],
    ):
        setup = prepare_run(parse_run_config([*RUN_FLAGS, *flags]))
        assert setup.options.overlap_param_gather
        assert predict_run(setup).overlap_param_gather


@pytest.mark.parametrize(
    "planned, flags, expected",
    [
        ({}, [], True),  # Megatron-LM's default
        ({}, ["--no-overlap-p2p-communication"], False),
        ({"overlap_p2p_comm": True}, ["--no-overlap-p2p-communication"], None),  # contradicts
        ({"overlap_p2p_comm": False}, [], False),
    ],
)
def test_the_run_takes_the_plans_p2p_overlap(tmp_path, planned, flags, expected):
    from megatron_het.arguments import parse_run_config
    from megatron_het.training.run import predict_run
    from megatron_het.training.setup import prepare_run

    plan = json.loads((REPO / "scripts/plans/cpu_interleaved_tp2_tp1.json").read_text())
    path = tmp_path / "interleaved.json"
    path.write_text(json.dumps({**plan, **planned}))
    flags = [
        *RUN_FLAGS,
        "--num-layers",
        "6",
        "--global-batch-size",
        "8",
        "--plan",
        str(path),
        *flags,
    ]
    if expected is None:
        with pytest.raises(UserError, match="^--no-overlap-p2p-communication contradicts"):
            prepare_run(parse_run_config(flags), world_size=3)
        return
    setup = prepare_run(parse_run_config(flags), world_size=3)
    assert setup.options.overlap_p2p_comm is expected  # what the executor is built with
    prediction = predict_run(setup)
    assert prediction.overlap_p2p_comm is expected
    other = setup.options.replace(overlap_p2p_comm=not expected)
    flipped = predict_run(dataclasses.replace(setup, options=other))
    faster, slower = (prediction, flipped) if expected else (flipped, prediction)
    assert faster.pipeline_time_s < slower.pipeline_time_s


@pytest.mark.parametrize(
    "flags, expected",
    [
        ([], [0, 0, 0, 0]),
        (
            [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
            [2, 1, 2, 1],
        ),  # every layer of every chunk
        (
            [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "block",
                "--recompute-num-layers",
                "1",
            ],
            [1, 1, 1, 1],
        ),  # the first of each chunk
    ],
)
def test_megatron_recompute_flags_reach_every_stage_of_the_plan(flags, expected):
    from megatron_het.arguments import parse_run_config
    from megatron_het.training.run import predict_run
    from megatron_het.training.setup import prepare_run

    base = [
        *RUN_FLAGS,
        "--num-layers",
        "6",
        "--global-batch-size",
        "8",
        "--plan",
        str(REPO / "scripts/plans/cpu_interleaved_tp2_tp1.json"),
    ]
    setup = prepare_run(parse_run_config([*base, *flags]), world_size=3)
    stages = setup.plan.pipelines[0].stages
    assert [st.recomputed_layers for st in stages] == expected
    plain = predict_run(prepare_run(parse_run_config(base), world_size=3))
    for row, plain_row, count in zip(predict_run(setup).stages, plain.stages, expected):
        assert (row.backward_s > plain_row.backward_s) == (count > 0)
