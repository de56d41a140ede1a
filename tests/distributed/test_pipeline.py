"""The pipeline executor against the single-process model (gloo, forked ranks of two kinds).

Each case builds the stages of a plan, runs one pipeline over the same micro-batches as the
single-process reference (every micro-batch's mean loss scaled by 1/num_micro_batches), and
compares the summed loss and every parameter's gradient, TP shards gathered to full, with the
reference: norm-wise relative error <= 1e-5 in float32. Tied embeddings are compared on both
copies (first and last stage). Ranks 0-1 are kind "fast", the others "slow", so some boundaries
cross kinds (the communicator's bridge).
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch

from megatron_het.comm import UnifiedCommunicator
from megatron_het.config import ModelConfig
from megatron_het.emulation.emulator import Emulator
from megatron_het.model.llama import build_model
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.process_groups import build_process_groups
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan
from megatron_het.pipeline.executor import PipelineExecutor, compute_region_key
from megatron_het.pipeline.stage import build_stage
from megatron_het.pipeline.stage_boundary import boundary_peers
from megatron_het.tensor_parallel import unshard
from tests.distributed.harness import run_ranks

SEED = 4321
MBS, SEQ, NUM_MB = 2, 8, 5
# GQA; a vocabulary not divisible by 2, so vocabulary shards are uneven.
UNTIED = ModelConfig(
    num_layers=4,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=131,
    max_position_embeddings=64,
    name="pp-untied",
)
TIED = UNTIED.replace(tie_embeddings=True, name="pp-tied")
CONFIGS = {"tied": TIED, "untied": UNTIED}


def _plan(stages: list[tuple[int, tuple[int, int], list[int]]]) -> ParallelPlan:
    """One pipeline from (tp, layers, ranks) per stage."""
    return ParallelPlan(
        MBS,
        (
            PipelinePlan(
                NUM_MB,
                tuple(StagePlan("cpu", tp, layers, tuple(ranks)) for tp, layers, ranks in stages),
            ),
        ),
    )


PP3_TP211 = _plan([(2, (0, 1), [0, 1]), (1, (1, 3), [2]), (1, (3, 4), [3])])
PP4 = _plan([(1, (i, i + 1), [i]) for i in range(4)])
PP2_TP22 = _plan([(2, (0, 2), [0, 1]), (2, (2, 4), [2, 3])])
PP2_TP12 = _plan([(1, (0, 3), [0]), (2, (3, 4), [1, 2])])
DP2_PP2 = ParallelPlan(
    MBS,
    tuple(
        PipelinePlan(
            NUM_MB, (StagePlan("cpu", 1, (0, 3), (p,)), StagePlan("cpu", 1, (3, 4), (p + 2,)))
        )
        for p in (0, 1)
    ),
)

# (plan, config name, schedule) per world size; every case of a world runs in one launch.
CASES = {
    4: [
        ("pp3_tp211", PP3_TP211, "tied", "1f1b"),
        ("pp3_tp211", PP3_TP211, "untied", "gpipe"),
        ("pp4", PP4, "tied", "gpipe"),
        ("pp4", PP4, "untied", "1f1b"),
        ("pp2_tp22", PP2_TP22, "tied", "1f1b"),
    ],
    3: [("pp2_tp12", PP2_TP12, "tied", "1f1b"), ("pp2_tp12", PP2_TP12, "untied", "gpipe")],
}
KINDS = ["fast", "fast", "slow", "slow"]


def _micro_batches(
    config: ModelConfig, count: int = NUM_MB
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, config.vocab_size, (MBS, SEQ), generator=g)
        labels = torch.randint(0, config.vocab_size, (MBS, SEQ), generator=g)
        labels[0, :2] = -100
        out.append((tokens, labels))
    return out


def _reference(config: ModelConfig, bf16: bool = False, count: int = NUM_MB) -> dict[str, Any]:
    model = build_model(config, SEED)
    if bf16:  # bf16 weights and activations, as mixed-precision training runs the model
        model.to(torch.bfloat16)
    loss_sum = 0.0
    for tokens, labels in _micro_batches(config, count):
        loss = model(tokens, labels=labels)
        (loss / count).backward()
        loss_sum += loss.item()
    return {"loss_sum": loss_sum, "grads": {n: p.grad.float() for n, p in model.named_parameters()}}


def _run_case(
    comm: UnifiedCommunicator,
    plan: ParallelPlan,
    config: ModelConfig,
    schedule: str,
    repeat: int = 1,
    dtype: torch.dtype = torch.float32,
    zeroed_run: bool = False,
    **executor_args: Any,
) -> dict[str, Any]:
    groups = build_process_groups(comm, plan)
    stage = build_stage(config, plan, groups, SEED).to(dtype)
    executor = PipelineExecutor(stage, groups, config, SEQ, MBS, schedule=schedule, **executor_args)
    # Pipeline p takes the p-th block of NUM_MB micro-batches of the global batch.
    pipeline, total = groups.role.pipeline, NUM_MB * plan.dp_size
    micro_batches = _micro_batches(config, total)[pipeline * NUM_MB : (pipeline + 1) * NUM_MB]
    allocated = []
    for _ in range(repeat):
        stats = executor.run(micro_batches, 1.0 / total)
        allocated.append(executor.pool.allocated)
    role = groups.role
    out = {
        "pipeline": pipeline,
        "stage": role.stage,
        "tp_rank": role.tp_rank,
        "tp": role.stage_plan.tp,
        "last": role.is_last_stage,
        "stats": stats,
        "allocated": allocated,
        "grads": {n: p.grad.float().clone() for n, p in stage.named_parameters()},
        "forward_only": executor.run(micro_batches, 1.0 / total, True),
        "grads_after_forward_only": {
            n: p.grad.float().clone() for n, p in stage.named_parameters()
        },
    }
    if not zeroed_run:
        return out
    # as the trainer runs it: gradients zeroed first, so no copy of the tied one is kept
    for param in stage.parameters():
        param.grad.zero_()
    executor.run(micro_batches, 1.0 / total, grads_zeroed=True)
    out["grads_zeroed_run"] = {n: p.grad.float() for n, p in stage.named_parameters()}
    return out


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    comm = UnifiedCommunicator(
        KINDS[:world_size],
        {"fast": "gloo", "slow": "gloo"},
        {"fast": "cpu", "slow": "cpu"},
        timeout=datetime.timedelta(seconds=60),
    )
    results: dict[str, Any] = {}
    for i, (name, plan, config_name, schedule) in enumerate(CASES[world_size]):
        results[f"{name}/{config_name}/{schedule}"] = _run_case(
            comm, plan, CONFIGS[config_name], schedule, repeat=2 if i == 0 else 1, zeroed_run=True
        )
    if world_size == 4:  # two pipelines (DP replicas) of two stages
        results["dp2"] = _run_case(comm, DP2_PP2, TIED, "1f1b")
    if world_size == 3:
        # Emulated slowdown with a recording sleep (no real waiting), and bf16 weights.
        emulator = Emulator(2.0, sleep=lambda s: None)
        results["emulated"] = _run_case(comm, PP2_TP12, UNTIED, "1f1b", region_timer=emulator)
        results["emulated"]["regions"] = emulator.stats().regions
        # Stage times fixed per region key (--emulation-profile): every region waits for its
        # key's slowdown x fixed time, whatever it measured.
        slept: list[float] = []
        fixed = {
            compute_region_key("forward", False): 5.0,
            compute_region_key("backward", False): 7.0,
            compute_region_key("forward", True): 3.0,
        }
        emulator = Emulator(
            2.0, sleep=slept.append, cpu_clock=time.thread_time, fixed_reference_s=fixed
        )
        results["fixed"] = _run_case(comm, PP2_TP12, UNTIED, "1f1b", region_timer=emulator)
        results["fixed"]["slept"] = slept
        results["bf16"] = _run_case(comm, PP2_TP12, UNTIED, "1f1b", dtype=torch.bfloat16)
    return results


@pytest.fixture(scope="module")
def outcomes() -> dict[int, list[dict[str, Any]]]:
    return {world: run_ranks(_worker, world, timeout=120) for world in CASES}


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    return {name: _reference(config) for name, config in CONFIGS.items()}


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def _gathered_grads(
    per_rank: list[dict[str, Any]], config: ModelConfig
) -> list[tuple[int, str, torch.Tensor]]:
    """(stage, name, full gradient) for every parameter of every stage."""
    out = []
    for stage in sorted({r["stage"] for r in per_rank}):
        ranks = sorted((r for r in per_rank if r["stage"] == stage), key=lambda r: r["tp_rank"])
        for name in ranks[0]["grads"]:
            shards = [r["grads"][name] for r in ranks]
            out.append((stage, name, unshard(name, shards, config, len(ranks))))
    return out


def _check_against_reference(
    per_rank: list[dict[str, Any]],
    config: ModelConfig,
    reference: dict[str, Any],
    scale: float = 1.0,
) -> None:
    seen = set()
    for stage, name, grad in _gathered_grads(per_rank, config):
        expected = reference["grads"][name] * scale
        assert _relative_error(grad, expected) <= 1e-5, (stage, name)
        seen.add(name)
    assert seen == set(reference["grads"]), "some parameters are on no stage"
    for r in per_rank:
        loss = r["stats"].loss_sum
        if r["last"]:
            assert abs(loss - reference["loss_sum"]) <= 1e-5 * reference["loss_sum"]
        else:
            assert loss == 0.0


CASE_IDS = [
    (world, f"{name}/{config}/{schedule}")
    for world, cases in CASES.items()
    for name, _, config, schedule in cases
]


@pytest.mark.parametrize("world,case", CASE_IDS, ids=[c for _, c in CASE_IDS])
def test_pipeline_matches_single_process(
    outcomes: dict, references: dict, world: int, case: str
) -> None:
    per_rank = [r[case] for r in outcomes[world]]
    config_name = case.split("/")[1]
    # The first case of each launch runs twice: gradients accumulate, buffers are reused.
    scale = float(len(per_rank[0]["allocated"]))
    _check_against_reference(per_rank, CONFIGS[config_name], references[config_name], scale)
    for r in per_rank:
        assert r["allocated"][0] == r["allocated"][-1], "the second run allocated buffers"
        stats, forward_only = r["stats"], r["forward_only"]
        assert stats.num_micro_batches == NUM_MB
        assert min(stats.compute_s, stats.p2p_wait_s, stats.bubble_s) >= 0.0
        assert forward_only.loss_sum == pytest.approx(stats.loss_sum, rel=1e-6)
        for name, grad in r["grads"].items():  # forward_only leaves gradients alone
            assert torch.equal(r["grads_after_forward_only"][name], grad), name
    # one run on zeroed gradients (the trainer's way) gives the single-process gradients
    _check_against_reference(
        [{**r, "grads": r["grads_zeroed_run"]} for r in per_rank],
        CONFIGS[config_name],
        references[config_name],
    )


def test_emulated_slowdown_and_bf16(outcomes: dict, references: dict) -> None:
    per_rank = outcomes[3]
    for r in per_rank:
        # One timed region per forward and per backward, then the forward-only run's forwards.
        assert r["emulated"]["regions"] == 3 * NUM_MB
    _check_against_reference([r["emulated"] for r in per_rank], UNTIED, references["untied"])
    _check_against_reference([r["fixed"] for r in per_rank], UNTIED, references["untied"])
    for r in per_rank:  # 2 x 5 s per forward, 2 x 7 s per backward, 2 x 3 s per eval forward
        slept = sorted(round(s) for s in r["fixed"]["slept"])
        assert slept == [6] * NUM_MB + [10] * NUM_MB + [14] * NUM_MB
    bf16 = _reference(UNTIED, bf16=True)
    last = [r["bf16"]["stats"].loss_sum for r in per_rank if r["bf16"]["last"]]
    assert last and all(abs(loss - bf16["loss_sum"]) <= 1e-2 * bf16["loss_sum"] for loss in last)
    for _stage, name, grad in _gathered_grads([r["bf16"] for r in per_rank], UNTIED):
        assert _relative_error(grad, references["untied"]["grads"][name]) <= 5e-2, name


def test_data_parallel_pipelines_sum_to_single_process(outcomes: dict) -> None:
    """Two pipelines, each on its block of the global batch: their gradients SUM (as the DP
    sync does) to the single-process gradient of the global-batch mean loss."""
    reference = _reference(TIED, count=2 * NUM_MB)
    per_rank = [r["dp2"] for r in outcomes[4]]
    summed: dict[tuple[int, str], torch.Tensor] = {}
    for p in (0, 1):
        for stage, name, grad in _gathered_grads([r for r in per_rank if r["pipeline"] == p], TIED):
            summed[(stage, name)] = summed.get((stage, name), 0) + grad
    assert {name for _, name in summed} == set(reference["grads"])
    for (stage, name), grad in summed.items():
        assert _relative_error(grad, reference["grads"][name]) <= 1e-5, (stage, name)
    losses = sum(r["stats"].loss_sum for r in per_rank if r["last"])
    assert abs(losses - reference["loss_sum"]) <= 1e-5 * reference["loss_sum"]


@pytest.mark.parametrize("tps", [(2, 1, 1), (1, 2), (2, 4), (4, 2), (4, 1, 3)])
def test_boundary_peers_pair_up(tps: tuple[int, ...]) -> None:
    """Every rank receives exactly once per direction, from the rank ``own % peer_tp``, and
    every send has its matching receive (pure function of the plan, no processes)."""
    ranks = iter(range(sum(tps)))
    plan = _plan([(tp, (i, i + 1), [next(ranks) for _ in range(tp)]) for i, tp in enumerate(tps)])
    stages = plan.pipelines[0].stages
    peers = {r: boundary_peers(plan, r) for r in plan.ranks()}
    sends_fwd = sorted((src, d.peer) for src, p in peers.items() for d in p.send_forward)
    recvs_fwd = sorted((d.peer, dst) for dst, p in peers.items() for d in p.recv_forward)
    assert sends_fwd == recvs_fwd
    sends_bwd = sorted((src, d.peer) for src, p in peers.items() for d in p.send_backward)
    recvs_bwd = sorted((d.peer, dst) for dst, p in peers.items() for d in p.recv_backward)
    assert sends_bwd == recvs_bwd
    for k in range(len(stages) - 1):
        low, high = stages[k], stages[k + 1]
        for j, rank in enumerate(high.ranks):
            assert [d.peer for d in peers[rank].recv_forward] == [low.ranks[j % low.tp]]
        for i, rank in enumerate(low.ranks):
            assert [d.peer for d in peers[rank].recv_backward] == [high.ranks[i % high.tp]]
    assert all(d.start is None for p in peers.values() for d in p.recv_forward)  # whole
    assert peers[stages[0].ranks[0]].recv_forward == ()
    assert peers[stages[-1].ranks[0]].recv_backward == ()


@pytest.mark.parametrize("tps", [(2, 1, 1), (1, 2), (2, 4), (4, 2), (4, 1, 3)])
def test_sequence_parallel_boundaries_exchange_overlapping_positions(tps: tuple[int, ...]) -> None:
    """Under sequence parallelism every position of a receiving rank's block arrives exactly
    once, from the rank of the adjacent stage holding it, and sends mirror receives."""
    import dataclasses

    from megatron_het.parallel.sequence import local_positions

    ranks = iter(range(sum(tps)))
    plan = dataclasses.replace(
        _plan([(tp, (i, i + 1), [next(ranks) for _ in range(tp)]) for i, tp in enumerate(tps)]),
        sequence_parallel=True,
    )
    seq = 12
    stages = plan.pipelines[0].stages
    peers = {r: boundary_peers(plan, r, seq) for r in plan.ranks()}

    def positions(rank: int) -> tuple[int, int]:
        role = plan.rank_role(rank)
        return local_positions(plan, role.stage_plan, role.tp_rank, seq)

    for kind, send in (("recv_forward", "send_forward"), ("recv_backward", "send_backward")):
        for rank, p in peers.items():
            start, stop = positions(rank)
            got = sorted((start + d.start, start + d.stop) for d in getattr(p, kind))
            if got:
                assert got[0][0] == start and got[-1][1] == stop, (rank, kind)
                assert all(a[1] == b[0] for a, b in zip(got, got[1:])), (rank, kind)
            for d in getattr(p, kind):  # the sender sends the same global positions
                (mirror,) = [m for m in getattr(peers[d.peer], send) if m.peer == rank]
                sender_start = positions(d.peer)[0]
                assert (sender_start + mirror.start, sender_start + mirror.stop) == (
                    start + d.start,
                    start + d.stop,
                )
    assert peers[stages[0].ranks[0]].recv_forward == ()
