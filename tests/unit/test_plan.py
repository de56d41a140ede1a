"""ParallelPlan: JSON round trips, rank queries, validation messages, Megatron-flag plans."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import model_preset
from megatron_het.errors import UserError
from megatron_het.parallel import (
    ParallelPlan,
    PipelinePlan,
    StagePlan,
    megatron_layer_split,
    plan_from_megatron_flags,
    valid_tp_sizes,
    validate,
)
from megatron_het.parallel.process_groups import dp_members

ROOT = Path(__file__).resolve().parents[2]
PLANS = ROOT / "scripts" / "plans"
TINY = model_preset("tiny")  # 4 layers, 4 heads, 2 query groups, ffn 176

EXAMPLE = {
    "format": "megatron_het.plan/1",
    "micro_batch_size": 2,
    "pipelines": [
        {
            "micro_batches": 4,
            "stages": [
                {"accelerator": "emu-fast", "tp": 2, "layers": [0, 1], "ranks": [0, 1]},
                {"accelerator": "emu-slow", "tp": 1, "layers": [1, 3], "ranks": [2]},
                {"accelerator": "emu-slow", "tp": 1, "layers": [3, 4], "ranks": [3]},
            ],
        }
    ],
}
DP2 = {
    "format": "megatron_het.plan/1",
    "micro_batch_size": 1,
    "pipelines": [
        {
            "micro_batches": 3,
            "stages": [
                {"accelerator": "emu-fast", "tp": 1, "layers": [0, 3], "ranks": [0]},
                {"accelerator": "emu-slow", "tp": 1, "layers": [3, 4], "ranks": [2]},
            ],
        },
        {
            "micro_batches": 5,
            "stages": [
                {"accelerator": "emu-fast", "tp": 1, "layers": [0, 3], "ranks": [1]},
                {"accelerator": "emu-slow", "tp": 1, "layers": [3, 4], "ranks": [3]},
            ],
        },
    ],
}


@pytest.fixture(scope="module")
def cluster():
    return ClusterSpec.load(ROOT / "scripts" / "clusters" / "cpu_emulated.yaml")


def edited(base, edit):
    d = copy.deepcopy(base)
    edit(d)
    return ParallelPlan.load(d)


def user_error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---- shipped plans and JSON ------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(PLANS.glob("cpu_emulated_*.json")), ids=lambda p: p.name)
def test_shipped_plan_fits_the_emulated_cluster(path, cluster):
    plan = ParallelPlan.load(path)
    layers = plan.pipelines[0].stages[-1].layers[1]  # 4, or 8 for the interleaved example
    for model in ("tiny", "small"):
        validate(
            plan,
            model_preset(model).replace(num_layers=layers),
            cluster,
            global_batch_size=plan.global_batch_size,
        )
    assert plan.world_size == cluster.world_size
    assert ParallelPlan.from_dict(json.loads(path.read_text())) == plan
    assert json.loads(path.read_text()) == plan.to_dict()


def test_at_least_four_example_plans_ship():
    assert len(list(PLANS.glob("cpu_emulated_*.json"))) >= 4


def test_save_and_load_round_trip(tmp_path):
    d = copy.deepcopy(EXAMPLE)
    d.update(dtype="bf16", use_distributed_optimizer=True, description="x")
    d["pipelines"][0]["stages"][1]["recompute"] = True
    plan = ParallelPlan.load(d)
    plan.save(tmp_path / "p.json")
    again = ParallelPlan.load(tmp_path / "p.json")
    assert again == plan and again.to_dict() == d
    assert again.pipelines[0].stages[1].recompute and again.dtype == "bf16"


def test_block_recompute_of_a_stage_round_trips_and_counts(tmp_path):
    d = copy.deepcopy(EXAMPLE)
    stage = d["pipelines"][0]["stages"][1]
    stage.update(recompute=True, recompute_num_layers=1)
    plan = ParallelPlan.load(d)
    plan.save(tmp_path / "p.json")
    again = ParallelPlan.load(tmp_path / "p.json")
    assert again == plan and again.to_dict() == d
    st = again.pipelines[0].stages[1]
    assert (st.recompute_num_layers, st.recomputed_layers) == (1, 1)
    assert f"recompute 1 of {st.num_layers} layers" in again.describe()
    full = ParallelPlan.load(EXAMPLE).pipelines[0].stages[1]
    assert full.recomputed_layers == 0


@pytest.mark.parametrize(
    "options",
    [
        {"overlap_grad_reduce": True, "grad_reduce_in_bf16": True, "dtype": "bf16"},
        {"overlap_grad_reduce": False, "grad_reduce_in_bf16": True},  # dtype left to the run
        {"grad_reduce_in_bf16": False, "dtype": "fp32", "overlap_p2p_comm": False},
        {"use_distributed_optimizer": True, "overlap_param_gather": True},
        {"overlap_param_gather": False},
    ],
)
def test_dp_options_round_trip(tmp_path, options):
    d = copy.deepcopy(EXAMPLE)
    d.update(options)
    plan = ParallelPlan.load(d)
    for key in (
        "overlap_grad_reduce",
        "grad_reduce_in_bf16",
        "overlap_p2p_comm",
        "overlap_param_gather",
    ):
        assert getattr(plan, key) == options.get(key)
    plan.save(tmp_path / "p.json")
    again = ParallelPlan.load(tmp_path / "p.json")
    assert again == plan and again.to_dict() == d
    bare = ParallelPlan.load(EXAMPLE)
    assert bare.overlap_grad_reduce is None and bare.grad_reduce_in_bf16 is None
    assert bare.overlap_p2p_comm is None and bare.overlap_param_gather is None
    assert "overlap_grad_reduce" not in bare.to_dict()


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            lambda d: d.update(overlap_grad_reduce="yes"),
            "plan: overlap_grad_reduce must be true or false, got 'yes'",
        ),
        (
            lambda d: d.update(grad_reduce_in_bf16=1),
            "plan: grad_reduce_in_bf16 must be true or false, got 1",
        ),
        (
            lambda d: d.update(grad_reduce_in_bf16=True, dtype="fp32"),
            'plan: grad_reduce_in_bf16 needs bf16 training but dtype is fp32; set "dtype": '
            '"bf16" or drop grad_reduce_in_bf16',
        ),
        (
            lambda d: d.update(overlap_p2p_comm="no"),
            "plan: overlap_p2p_comm must be true or false, got 'no'",
        ),
        (
            lambda d: d.update(overlap_param_gather="on"),
            "plan: overlap_param_gather must be true or false, got 'on'",
        ),
        (
            lambda d: d.update(overlap_param_gather=True, use_distributed_optimizer=False),
            "plan: overlap_param_gather overlaps the distributed optimizer's all-gather but "
            "use_distributed_optimizer is false; set it true or drop overlap_param_gather",
        ),
        (
            lambda d: d.update(overlap=True),
            "known keys: format, micro_batch_size, pipelines, "
            "description, dtype, use_distributed_optimizer, sequence_parallel, tp_comm_overlap, "
            "overlap_grad_reduce, overlap_param_gather, grad_reduce_in_bf16, overlap_p2p_comm",
        ),
    ],
)
def test_bad_dp_options_are_refused_with_one_line(edit, expected):
    assert expected in user_error(edited, EXAMPLE, edit)


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            lambda d: d["pipelines"][0]["stages"][0].update(recomput=True),
            "stage 0 of pipeline 0: unknown key 'recomput'; known keys: accelerator, tp, layers, "
            "ranks, recompute, recompute_num_layers",
        ),
        (
            lambda d: d["pipelines"][0]["stages"][0].update(recompute_num_layers=1),
            "stage 0 of pipeline 0: recompute_num_layers (the first N layers recomputed) needs "
            '"recompute": true and N >= 1, got 1 with recompute false',
        ),
        (
            lambda d: d["pipelines"][0]["stages"][0].update(recompute=True, recompute_num_layers=0),
            'needs "recompute": true and N >= 1, got 0 with recompute true',
        ),
        (
            lambda d: d.update(zero=1),
            "plan: unknown key 'zero'; known keys: format, "
            "micro_batch_size, pipelines, description, dtype, use_distributed_optimizer",
        ),
        (lambda d: d.update(format="plan/2"), "format must be 'megatron_het.plan/1'"),
        (lambda d: d.update(dtype="fp8"), "dtype must be one of fp32, bf16, fp16"),
        (lambda d: d["pipelines"][0]["stages"][1].update(tp="1"), "tp must be an integer"),
        (
            lambda d: d["pipelines"][0]["stages"][1].update(layers=[1]),
            "layers must be [first, end)",
        ),
        (
            lambda d: d["pipelines"][0].pop("micro_batches"),
            "pipeline 0: missing key 'micro_batches'",
        ),
        (lambda d: d.update(pipelines=[]), "pipelines must be a non-empty list"),
        (
            lambda d: d.update(tp_comm_overlap=True, sequence_parallel=False),
            "plan: tp_comm_overlap overlaps sequence parallelism's all-gathers and reduce-scatters but "
            "sequence_parallel is false",
        ),
    ],
)
def test_bad_json_is_refused_with_one_line(edit, expected):
    assert expected in user_error(edited, EXAMPLE, edit)


def test_bad_files_are_user_errors(tmp_path):
    assert "not found" in user_error(ParallelPlan.load, tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"format": ')
    assert "is not valid JSON" in user_error(ParallelPlan.load, tmp_path / "bad.json")


# ---- queries ---------------------------------------------------------------------------------
def test_queries_of_the_example_plan():
    plan = ParallelPlan.load(EXAMPLE)
    assert (plan.world_size, plan.dp_size, plan.pp_size(0), plan.global_batch_size) == (4, 1, 3, 8)
    roles = {r: plan.rank_role(r) for r in range(4)}
    assert [(x.pipeline, x.stage, x.tp_rank) for x in roles.values()] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 2, 0),
    ]
    assert roles[1].stage_plan.layers == (0, 1) and roles[2].stage_plan.layers == (1, 3)
    assert [(x.is_first_stage, x.is_last_stage) for x in roles.values()] == [
        (True, False),
        (True, False),
        (False, False),
        (False, True),
    ]
    assert plan.pipelines[0].stages[0].ranks == (0, 1)
    assert dp_members(plan, 1, 0) == (2,)
    assert "rank 7 is on no stage" in user_error(plan.rank_role, 7)


def test_dp_members_hold_the_same_layers_and_tp_rank():
    plan = ParallelPlan.load(DP2)
    assert plan.dp_size == 2 and plan.global_batch_size == 8
    for rank in range(4):
        mine = plan.rank_role(rank)
        expected = tuple(
            r
            for r in range(4)
            if plan.rank_role(r).stage_plan.layers == mine.stage_plan.layers
            and plan.rank_role(r).tp_rank == mine.tp_rank
        )
        assert dp_members(plan, mine.stage, mine.tp_rank) == expected


def test_embedding_and_head_follow_stage_position():
    stage = StagePlan("cpu", 1, (0, 4), (0,), has_embedding=False, has_head=False)
    only = PipelinePlan(1, (stage,)).stages[0]
    assert only.has_embedding and only.has_head and only.layer_indices == range(0, 4)


# ---- validation ------------------------------------------------------------------------------
def stage(d, i):
    return d["pipelines"][0]["stages"][i]


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            lambda d: stage(d, 1).update(layers=[2, 3]),
            "layers [1, 2) are on no stage of pipeline 0: stage 1 of pipeline 0 starts at layer 2; "
            "make it start at 1",
        ),
        (
            lambda d: stage(d, 1).update(layers=[0, 3]),
            "layers [0, 1) are on both stage 0 and stage 1 of pipeline 0; make stage 1 start at layer 1",
        ),
        (
            lambda d: stage(d, 1).update(layers=[1, 1]),
            "stage 1 of pipeline 0 has an empty layer range [1, 1)",
        ),
        (
            lambda d: stage(d, 2).update(layers=[3, 5]),
            "stage 2 of pipeline 0 has layers [3, 5) but the model's layers are [0, 4)",
        ),
        (lambda d: stage(d, 2).update(layers=[3, 3]), "empty layer range [3, 3)"),
        (
            lambda d: stage(d, 1).update(layers=[1, 2]) or stage(d, 2).update(layers=[2, 3]),
            "layers [3, 4) are on no stage of pipeline 0: its last stage ends at layer 3; end it at 4",
        ),
        (
            lambda d: stage(d, 2).update(ranks=[2]),
            "pipeline 0 has 3 stages on 2 device groups (ranks [0, 1]: 1, ranks [2]: 2); stages that "
            "share ranks are interleaved chunks of one group, and every group must hold the same "
            "number: use a multiple of 2 stages, or give each stage ranks of its own",
        ),
        (
            lambda d: d["pipelines"].append(
                {
                    "micro_batches": 1,
                    "stages": [
                        {"accelerator": "emu-slow", "tp": 1, "layers": [0, 4], "ranks": [3]}
                    ],
                }
            ),
            "rank 3 is on stage 2 of pipeline 0 and on stage 0 of pipeline 1; give every rank exactly "
            "one stage",
        ),
        (
            lambda d: stage(d, 0).update(ranks=[0]),
            "stage 0 of pipeline 0 has tp=2 but lists 1 rank [0]; list exactly 2",
        ),
        (
            lambda d: stage(d, 2).update(ranks=[7]),
            "stage 2 of pipeline 0 lists rank 7 but the ranks of cluster cpu_emulated are 0-3",
        ),
        (
            lambda d: stage(d, 0).update(tp=1, ranks=[0]),
            "rank 1 is on no stage but the ranks of cluster cpu_emulated are 0-3",
        ),
        (
            lambda d: stage(d, 1).update(accelerator="EMU-FAST"),
            "stage 1 of pipeline 0 says EMU-FAST but rank 2 is emu-slow in cluster cpu_emulated; set "
            "the stage's accelerator to emu-slow or use EMU-FAST ranks (0-1)",
        ),
        (lambda d: stage(d, 1).update(accelerator="H100"), "(the cluster has no H100)"),
        (lambda d: d["pipelines"][0].update(micro_batches=0), "micro_batches must be at least 1"),
        (lambda d: d.update(micro_batch_size=0), "micro_batch_size must be at least 1, got 0"),
    ],
)
def test_validate_names_the_problem(edit, expected, cluster):
    assert expected in user_error(validate, edited(EXAMPLE, edit), TINY, cluster)


def test_accelerator_mismatch_on_a_rank_of_the_other_kind(cluster):
    def edit(d):
        d["pipelines"][0]["stages"] = [
            {"accelerator": "emu-fast", "tp": 1, "layers": [0, 1], "ranks": [0]},
            {"accelerator": "emu-slow", "tp": 1, "layers": [1, 3], "ranks": [1]},
            {"accelerator": "emu-slow", "tp": 2, "layers": [3, 4], "ranks": [2, 3]},
        ]

    plan = edited(EXAMPLE, edit)
    validate(plan, TINY)  # consistent without a cluster
    assert user_error(validate, plan, TINY, cluster).startswith(
        "stage 1 of pipeline 0 says emu-slow but rank 1 is emu-fast in cluster cpu_emulated"
    )


def test_ranks_must_be_dense_without_a_cluster():
    plan = edited(EXAMPLE, lambda d: stage(d, 2).update(ranks=[5]))
    assert "lists rank 5 but the plan places 4 ranks, so its ranks are 0-3" in user_error(
        validate, plan, TINY
    )


@pytest.mark.parametrize(
    "tp, bad",
    [
        (3, "the model's 4 attention heads or 2 query groups (kv heads) or ffn_hidden_size 176"),
        (4, "the model's 2 query groups (kv heads);"),
    ],
)
def test_tp_must_divide_heads_groups_and_ffn(tp, bad):
    plan = ParallelPlan(
        1,
        [
            PipelinePlan(
                1,
                [
                    StagePlan("cpu", tp, (0, 2), tuple(range(tp))),
                    StagePlan("cpu", 1, (2, 4), (tp,)),
                ],
            )
        ],
    )
    message = user_error(validate, plan, TINY)
    assert f"stage 0 of pipeline 0 has tp={tp}, which does not divide {bad}" in message
    assert message.endswith("use tp in {1, 2}")
    assert valid_tp_sizes(model_preset("llama2-70b")) == [1, 2, 4, 8]


def test_pipelines_may_split_the_model_differently(cluster):
    validate(ParallelPlan.load(DP2), TINY, cluster, 8)
    plan = edited(
        DP2,
        lambda d: (
            d["pipelines"][1]["stages"][0].update(layers=[0, 2])
            or d["pipelines"][1]["stages"][1].update(layers=[2, 4])
        ),
    )
    validate(plan, TINY, cluster, 8)  # heterogeneous data parallelism


def test_batch_must_add_up():
    plan = ParallelPlan.load(DP2)
    validate(plan, TINY, global_batch_size=8)
    assert (
        "the plan's batch is micro_batch_size 1 x (3 + 5) micro-batches = 8 sequences but "
        "--global-batch-size is 16; set --global-batch-size 8 or make the pipelines' "
        "micro_batches sum to 16"
    ) == user_error(validate, plan, TINY, None, 16)


# ---- Megatron flags --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "world, tp, pp", [(1, 1, 1), (4, 2, 2), (8, 2, 2), (8, 1, 4), (16, 2, 2), (12, 2, 1), (8, 1, 2)]
)
def test_megatron_rank_order_matches_a_tp_dp_pp_grid(world, tp, pp):
    model = TINY.replace(num_layers=8)
    dp = world // (tp * pp)
    plan = plan_from_megatron_flags(
        model, world, tp, pp, micro_batch_size=1, global_batch_size=2 * dp, accelerator_of="cpu"
    )
    # Megatron's "tp-cp-ep-dp-pp": tp varies fastest, pp slowest.
    grid = np.arange(world).reshape(pp, dp, tp)
    assert plan.dp_size == dp and plan.pp_size() == pp and plan.world_size == world
    for d in range(dp):
        assert plan.pipelines[d].micro_batches == 2
        for p in range(pp):
            assert plan.pipelines[d].stages[p].ranks == tuple(grid[p, d].tolist())
            assert plan.pipelines[d].stages[p].layers == (p * 8 // pp, (p + 1) * 8 // pp)


@pytest.mark.parametrize(
    "layers, pp, first, last, expected",
    [
        (10, 4, 1, 3, [(0, 1), (1, 4), (4, 7), (7, 10)]),
        (10, 3, 4, None, [(0, 4), (4, 7), (7, 10)]),
        (10, 3, None, 2, [(0, 4), (4, 8), (8, 10)]),
        (5, 2, 3, 2, [(0, 3), (3, 5)]),
    ],
)
def test_uneven_first_and_last_stages(layers, pp, first, last, expected):
    assert megatron_layer_split(layers, pp, first, last) == expected


@pytest.mark.parametrize(
    "layers, pp, first, last, expected",
    [
        (10, 4, None, None, "10 remaining layers of --num-layers 10 do not split evenly over 4"),
        (10, 4, 1, 2, "7 remaining layers after the first/last stages' 3"),
        (5, 2, 3, 1, "1 remaining layers"),
        (4, 3, 3, 2, "add up to 5, more than"),
        (4, 1, 2, None, "needs --pipeline-model-parallel-size > 1"),
    ],
)
def test_layer_splits_that_do_not_divide(layers, pp, first, last, expected):
    assert expected in user_error(megatron_layer_split, layers, pp, first, last)


def test_flag_errors(cluster):
    assert "world size 6 is not divisible by" in user_error(
        plan_from_megatron_flags, TINY, 6, 2, 2, 1, 4
    )
    assert (
        "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size"
        in user_error(plan_from_megatron_flags, TINY, 4, 1, 2, 2, 6)
    )
    assert "ranks [0, 1, 2, 3] (emu-fast, emu-slow) in one TP group" in user_error(
        plan_from_megatron_flags, TINY, 4, 4, 1, 1, 4, accelerator_of=cluster
    )
    assert "world size 8 differs from cluster cpu_emulated's 4 ranks" in user_error(
        plan_from_megatron_flags, TINY, 8, 1, 2, 1, 4, accelerator_of=cluster
    )
    assert "does not divide the model's 2 query groups" in user_error(
        plan_from_megatron_flags, TINY, 4, 4, 1, 1, 4
    )


def test_flags_on_the_emulated_cluster(cluster):
    plan = plan_from_megatron_flags(
        TINY, 4, 1, 2, micro_batch_size=2, global_batch_size=8, accelerator_of=cluster
    )
    assert [s.accelerator for p in plan.pipelines for s in p.stages] == [
        "emu-fast",
        "emu-slow",
        "emu-fast",
        "emu-slow",
    ]
    assert dp_members(plan, 0, 0) == (0, 1) and dp_members(plan, 1, 0) == (2, 3)
    named = plan_from_megatron_flags(
        TINY, 4, 2, 2, 1, 4, accelerator_of=lambda r: cluster.accelerator_of(r)
    )
    assert [s.accelerator for s in named.pipelines[0].stages] == ["emu-fast", "emu-slow"]


def test_stage_ranks_must_be_ascending(cluster):
    def swap(d):
        d["pipelines"][0]["stages"][0]["ranks"] = [1, 0]

    message = user_error(validate, edited(EXAMPLE, swap), TINY, cluster)
    assert message == (
        "stage 0 of pipeline 0 lists ranks [1, 0] out of order; list a stage's ranks "
        "in ascending order ([0, 1]): tp_rank follows the global rank order inside "
        "a TP group"
    )


def test_sequence_parallelism_needs_a_sequence_the_tp_degrees_divide():
    plan = edited(DP2, lambda d: d.update(sequence_parallel=True))
    assert plan.sequence_parallel and plan.to_dict()["sequence_parallel"] is True
    validate(plan, TINY, seq_length=30)  # every stage has tp=1
    wide = ParallelPlan(
        1, [PipelinePlan(1, [StagePlan("cpu", 2, (0, 4), (0, 1))])], sequence_parallel=True
    )
    assert (
        "stage 0 of pipeline 0 has tp=2, which does not divide --seq-length 31; sequence "
        "parallelism splits the sequence over the TP ranks: use a multiple of 2"
    ) in (user_error(validate, wide, TINY, None, None, 31))
    validate(wide, TINY, seq_length=32)
