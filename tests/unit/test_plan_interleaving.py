"""Interleaved plans: the device groups and chunks a plan describes, and what validation refuses."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import torch

from megatron_het.config import MODEL_PRESETS
from megatron_het.errors import UserError
from megatron_het.model.llama import LlamaModel, build_model
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_builders import plan_from_megatron_flags
from megatron_het.parallel.plan_validation import validate
from megatron_het.pipeline.stage_boundary import boundary_peers

REPO = pathlib.Path(__file__).resolve().parents[2]
PLAN = REPO / "scripts" / "plans" / "cpu_interleaved_tp2_tp1.json"
SIX = MODEL_PRESETS["tiny"].replace(num_layers=6)


def plan_dict() -> dict:
    return json.loads(PLAN.read_text())


def test_device_groups_chunks_and_roles() -> None:
    plan = ParallelPlan.load(PLAN)
    validate(plan, SIX)
    pipeline = plan.pipelines[0]
    assert pipeline.device_groups == ((0, 1), (2,))
    assert (pipeline.pp_size, pipeline.num_chunks, pipeline.num_stages) == (2, 2, 4)
    assert pipeline.interleaved and plan.world_size == 3
    first, last = plan.rank_role(1), plan.rank_role(2)
    assert (first.stage, first.tp_rank, first.chunks) == (0, 1, (0, 2))
    assert first.is_first_stage and not first.is_last_stage
    assert (last.stage, last.chunks) == (1, (1, 3)) and last.is_last_stage

    # Group 0's neighbours are group 1 both ways (chunk 1 -> 2 wraps round to group 0).
    def peers_of(rank: int, kind: str) -> list[int]:
        return [piece.peer for piece in getattr(boundary_peers(plan, rank), kind)]

    assert peers_of(0, "send_forward") == peers_of(0, "recv_forward") == [2]
    assert peers_of(0, "recv_backward") == [2]
    # tp 1 -> tp 2: the one rank of group 1 feeds both ranks of group 0, each way.
    assert peers_of(2, "send_forward") == peers_of(2, "send_backward") == [0, 1]


def test_a_plain_plan_is_one_chunk_per_group() -> None:
    d = plan_dict()
    d["pipelines"][0]["stages"][2]["ranks"] = [3, 4]
    d["pipelines"][0]["stages"][3]["ranks"] = [5]
    plan = ParallelPlan.load(d)
    validate(plan, SIX)
    assert not plan.pipelines[0].interleaved and plan.pipelines[0].pp_size == 4
    assert plan.rank_role(5).chunks == (3,)


def _refused(mutate, match: str, model=SIX) -> None:
    d = copy.deepcopy(plan_dict())
    mutate(d["pipelines"][0])
    with pytest.raises(UserError, match=match):
        validate(ParallelPlan.load(d), model)


def test_interleaving_mistakes_are_named() -> None:
    def set_stage(index, **values):
        return lambda p: p["stages"][index].update(values)

    _refused(
        lambda p: p.update(micro_batches=1),
        r"interleaves 2 chunks on 2 device groups, so it needs at least 2 micro_batches "
        r"\(got 1\): use 2 or more",
    )
    _refused(
        set_stage(2, ranks=[2], tp=1),
        r"stage 2 of pipeline 0 runs on ranks \[2\] but interleaved stages go round-robin"
        r".*give it ranks \[0, 1\]",
    )
    _refused(
        lambda p: p["stages"].pop(),
        r"3 stages on 2 device groups .* same number",
        model=MODEL_PRESETS["tiny"].replace(num_layers=5),
    )
    _refused(set_stage(2, accelerator="gpu"), r"a device group has one kind")
    _refused(
        lambda p: [p["stages"][i].update(ranks=[0, 1], tp=2) for i in (1, 3)],
        "needs at least 2 device groups",
    )
    _refused(set_stage(3, ranks=[1, 2], tp=2), r"rank 1 is on stage 0 .* same ranks")


def test_megatron_virtual_pipeline_flags_interleave_round_robin() -> None:
    model = MODEL_PRESETS["tiny"].replace(num_layers=8)
    plan = plan_from_megatron_flags(
        model, 4, tp=1, pp=2, micro_batch_size=1, global_batch_size=8, virtual_stages=2
    )
    assert [(s.layers, s.ranks) for s in plan.pipelines[0].stages] == [
        ((0, 2), (0,)),
        ((2, 4), (2,)),
        ((4, 6), (0,)),
        ((6, 8), (2,)),
    ]
    assert [s.ranks for s in plan.pipelines[1].stages] == [(1,), (3,), (1,), (3,)]
    with pytest.raises(UserError, match="do not split|does not split"):
        plan_from_megatron_flags(model, 2, 1, 2, 1, 4, virtual_stages=3)
    with pytest.raises(UserError, match="needs --pipeline-model-parallel-size > 1"):
        plan_from_megatron_flags(model, 1, 1, 1, 1, 4, virtual_stages=2)


def test_model_chunks_run_like_the_whole_model() -> None:
    config = MODEL_PRESETS["tiny"]
    whole = build_model(config, seed=3)
    with torch.device("meta"):
        part = LlamaModel(
            config,
            has_embedding=True,
            has_head=True,
            chunks=[(0, 1, False), (1, 3, True), (3, 4, False)],
        )
    part.to_empty(device="cpu")
    part.load_state_dict(whole.state_dict())
    assert sorted(n for n, _ in part.named_parameters()) == sorted(
        n for n, _ in whole.named_parameters()
    )
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    hidden = part(tokens, chunk=0)
    hidden = part(hidden, chunk=1)
    torch.testing.assert_close(part(hidden, chunk=2), whole(tokens))
    with pytest.raises(RuntimeError, match="labels given to a chunk without the head"):
        part(hidden, labels=tokens, chunk=1)
    with pytest.raises(UserError, match="ascending, disjoint"):
        LlamaModel(config, chunks=[(2, 3, False), (1, 2, False)])


def test_interleave_plan_deals_each_groups_layers_out_in_rounds() -> None:
    from megatron_het.parallel.plan_builders import interleave_plan

    model = MODEL_PRESETS["tiny"].replace(num_layers=12)
    plain = ParallelPlan.load(
        {
            "format": "megatron_het.plan/1",
            "micro_batch_size": 1,
            "pipelines": [
                {
                    "micro_batches": 4,
                    "stages": [
                        {"accelerator": "cpu", "tp": 2, "layers": [0, 8], "ranks": [0, 1]},
                        {"accelerator": "cpu", "tp": 1, "layers": [8, 12], "ranks": [2]},
                    ],
                }
            ],
        }
    )
    plan = interleave_plan(plain, 2)
    validate(plan, model)
    assert [(s.layers, s.ranks) for s in plan.pipelines[0].stages] == [
        ((0, 4), (0, 1)),
        ((4, 6), (2,)),
        ((6, 10), (0, 1)),
        ((10, 12), (2,)),
    ]
    assert interleave_plan(plain, 1) is plain
    uneven = interleave_plan(plain, 3)  # 8 = 3 + 3 + 2 and 4 = 2 + 1 + 1 layers
    validate(uneven, model)
    assert [s.num_layers for s in uneven.pipelines[0].stages] == [3, 2, 3, 1, 2, 1]
    with pytest.raises(UserError, match="fewer than 5 interleaved chunks"):
        interleave_plan(plain, 5)
    with pytest.raises(UserError, match="interleaved already"):
        interleave_plan(plan, 2)


def test_megatron_layout_strings_give_each_chunks_layers() -> None:
    from megatron_het.parallel.megatron_layout import layout_layer_counts

    assert layout_layer_counts("Et*2|t*3|t*3|t*2L", 10, 2) == [2, 3, 3, 2]
    assert layout_layer_counts("Et|(tt|)*2,t L", 6, 2) == [1, 2, 2, 1]
    model = MODEL_PRESETS["tiny"].replace(num_layers=10)
    plan = plan_from_megatron_flags(
        model, 2, tp=1, pp=2, micro_batch_size=1, global_batch_size=4, layout="Et*2|t*3|t*3|t*2L"
    )
    assert [(s.layers, s.ranks) for s in plan.pipelines[0].stages] == [
        ((0, 2), (0,)),
        ((2, 5), (1,)),
        ((5, 8), (0,)),
        ((8, 10), (1,)),
    ]
    for layout, message in (
        ("t*2|Et*3|t*3|t*2L", "E .* must open the first stage"),
        ("Et*2|t*3|t*3|t*2", "L .* must close the last stage"),
        ("Et*2|t*3|t*3|t*3L", "places 11 decoder layers"),
        ("Et*2|t*3|t*5L", "3 stages, not a multiple of"),
        ("Et*2|t*3|t*5|L", "stage 3 holds no decoder layer"),
        ("Et*2|t*3|t*3|t*2mL", "unknown symbol 'm'"),
        ("E(t*2|t*3|t*3|t*2L", r"'\(' without '\)'"),
    ):
        with pytest.raises(UserError, match=message):
            layout_layer_counts(layout, 10, 2)
