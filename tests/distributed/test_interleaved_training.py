"""Interleaved pipelines against the single-process run: same data, seed and losses.

The plan (scripts/plans/cpu_interleaved_tp2_tp1.json, 3 ranks) interleaves 4 model chunks of
uneven size over 2 device groups of different TP degree: ranks 0-1 run chunks 0 and 2 with
tp=2, rank 2 chunks 1 and 3 with tp=1, on a 6-layer tied model (the embedding copies live on
groups of different TP). Losses, gradient norms and validation losses must match the
single-process run within 2e-4 relative over 8 iterations (fp32), with the transfers overlapped
with compute (the default) and waited for one by one (--no-overlap-p2p-communication), and
checkpoints move between the interleaved plan and one process in both directions. A run with 5
micro-batches on the 2 groups takes them in Megatron-LM's micro-batch groups (3 + 2). The last
test runs interleaving, heterogeneous data parallelism and sequence parallelism in one plan,
with 3 micro-batches on its 2 interleaved groups. The checkpoint chain carries one run through
all of these plans and one process, a checkpoint every two iterations, each loaded by the next.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from megatron_het.checkpoint.io import read_latest_iteration
from tests.distributed.harness import run_ranks
from tests.distributed.test_parallel_training import (
    BASE,
    PLANS,
    TRAIN_ITERS,
    _train_worker,
    assert_close,
    records,
    run_single,
)

MODEL = ["--model", "tiny-tied", "--num-layers", "6"]
GLOBAL_BATCH = int(BASE[BASE.index("--global-batch-size") + 1])
PLAN = ["--plan", str(PLANS / "cpu_interleaved_tp2_tp1.json")]
WORLD = 3


def run_interleaved(argv: list[str], **kwargs: Any) -> list[tuple[int, str]]:
    return run_ranks(_train_worker, WORLD, [*MODEL, *BASE, *PLAN, *argv], timeout=120, **kwargs)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("interleaved")


@pytest.fixture(scope="module")
def single(workdir: pathlib.Path) -> pathlib.Path:
    path = workdir / "single.jsonl"
    run_single([*MODEL, *BASE, "--metrics-file", str(path)])
    return path


@pytest.fixture(scope="module")
def interleaved(workdir: pathlib.Path) -> tuple[pathlib.Path, str]:
    path = workdir / "interleaved.jsonl"
    results = run_interleaved(["--metrics-file", str(path)])
    assert [iteration for iteration, _ in results] == [TRAIN_ITERS] * WORLD
    return path, "".join(text for _, text in results)


def test_interleaved_matches_single_process(
    single: pathlib.Path, interleaved: tuple[pathlib.Path, str]
) -> None:
    path, text = interleaved
    expected, got = records(single, "train"), records(path, "train")
    assert_close(expected, got, ("loss", "grad_norm", "lr"))
    assert_close(records(single, "valid"), records(path, "valid"), ("loss",))
    # One row per device group: its ranks time all of their chunks together.
    assert [(s["pipeline"], s["stage"]) for s in got[0]["stages"]] == [(0, 0), (0, 1)]
    assert "2 chunks on each of 2 device groups" in text


def test_interleaved_checkpoint_loads_on_one_process(
    workdir: pathlib.Path, single: pathlib.Path
) -> None:
    # This run waits for every exchange (the others overlap transfers with compute): the
    # same losses either way.
    save, first_half = workdir / "ckpt-interleaved", workdir / "first-half.jsonl"
    run_interleaved(
        [
            "--save",
            str(save),
            "--exit-interval",
            "4",
            "--metrics-file",
            str(first_half),
            "--no-overlap-p2p-communication",
        ]
    )
    assert read_latest_iteration(save) == 4
    assert_close(records(single, "train")[:4], records(first_half, "train"), ("loss", "grad_norm"))
    path = workdir / "single-from-interleaved.jsonl"
    run_single([*MODEL, *BASE, "--load", str(save), "--metrics-file", str(path)])
    assert_close(records(single, "train")[4:], records(path, "train"), ("loss", "grad_norm"))


def test_single_process_checkpoint_loads_interleaved(
    workdir: pathlib.Path, single: pathlib.Path
) -> None:
    save = workdir / "ckpt-single"
    run_single(
        [
            *MODEL,
            *BASE,
            "--save",
            str(save),
            "--exit-interval",
            "4",
            "--metrics-file",
            str(workdir / "single-first-half.jsonl"),
        ]
    )
    path = workdir / "interleaved-from-single.jsonl"
    results = run_interleaved(["--load", str(save), "--metrics-file", str(path)])
    assert [iteration for iteration, _ in results] == [TRAIN_ITERS] * WORLD
    assert_close(records(single, "train")[4:], records(path, "train"), ("loss", "grad_norm"))


def test_micro_batches_not_a_multiple_of_the_groups_match_single_process(
    workdir: pathlib.Path,
) -> None:
    # 5 micro-batches over 2 device groups: micro-batch groups of 3 then 2 (Megatron-LM's
    # --microbatch-group-size-per-virtual-stage rule); the first group receives chunk 1's
    # inputs as the last group sends them and holds them until its turn.
    plan = json.loads((PLANS / "cpu_interleaved_tp2_tp1.json").read_text())
    plan["pipelines"][0]["micro_batches"] = 5
    plan_path = workdir / "interleaved-m5.json"
    plan_path.write_text(json.dumps(plan))
    batch = ["--global-batch-size", "10"]
    single, path = workdir / "single-m5.jsonl", workdir / "interleaved-m5.jsonl"
    run_single([*MODEL, *BASE, *batch, "--metrics-file", str(single)])
    results = run_ranks(
        _train_worker,
        WORLD,
        [*MODEL, *BASE, *batch, "--plan", str(plan_path), "--metrics-file", str(path)],
        timeout=120,
    )
    assert [iteration for iteration, _ in results] == [TRAIN_ITERS] * WORLD
    assert_close(records(single, "train"), records(path, "train"), ("loss", "grad_norm", "lr"))
    assert_close(records(single, "valid"), records(path, "valid"), ("loss",))
    assert "2 chunks on each of 2 device groups, in micro-batch groups of 3" in "".join(
        text for _, text in results
    )


def test_block_recompute_matches_single_process(
    workdir: pathlib.Path, single: pathlib.Path
) -> None:
    # Megatron's block method: every chunk recomputes its first layer in backward.
    path = workdir / "interleaved-block-recompute.jsonl"
    results = run_interleaved(
        [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "1",
            "--metrics-file",
            str(path),
        ]
    )
    assert [iteration for iteration, _ in results] == [TRAIN_ITERS] * WORLD
    assert_close(records(single, "train"), records(path, "train"), ("loss", "grad_norm"))
    assert "recompute 1 of 2 layers" in "".join(text for _, text in results)


def test_interleaving_hetero_dp_and_sequence_parallelism_together(
    workdir: pathlib.Path, single: pathlib.Path
) -> None:
    # Pipeline 0 interleaves sequence-parallel tp=2 chunks with tp=1 ones over 3 micro-batches
    # (one micro-batch group of 3); pipeline 1 is one rank holding the whole model, with its
    # own share of the batch, 1 micro-batch (ZeRO-1 across both).
    path, save = workdir / "all-three.jsonl", workdir / "ckpt-all-three"
    plan = str(PLANS / "cpu_interleaved_hetero_dp_sp.json")
    results = run_ranks(
        _train_worker,
        4,
        [
            *MODEL,
            *BASE,
            "--plan",
            plan,
            "--use-distributed-optimizer",
            "--save",
            str(save),
            "--save-interval",
            "4",
            "--metrics-file",
            str(path),
        ],
        timeout=120,
    )
    assert [iteration for iteration, _ in results] == [TRAIN_ITERS] * 4
    assert_close(records(single, "train"), records(path, "train"), ("loss", "grad_norm", "lr"))
    assert_close(records(single, "valid"), records(path, "valid"), ("loss",))
    # Its iteration-4 checkpoint (ZeRO-1 state owned across the replicas) continues on the
    # 3-rank interleaved plan like the single process.
    resumed = workdir / "interleaved-from-all-three.jsonl"
    run_interleaved(["--load", str(save / "iter_0000004"), "--metrics-file", str(resumed)])
    assert_close(records(single, "train")[4:], records(resumed, "train"), ("loss", "grad_norm"))


# Plans of the 6-layer model for the chain below, next to the shipped interleaved ones.
HETERO_DP_6 = {
    "micro_batch_size": 2,
    "pipelines": [
        {
            "micro_batches": 3,
            "stages": [
                {"accelerator": "cpu", "tp": 1, "layers": [0, 3], "ranks": [0]},
                {"accelerator": "cpu", "tp": 1, "layers": [3, 6], "ranks": [1]},
            ],
        },
        {
            "micro_batches": 1,
            "stages": [{"accelerator": "cpu", "tp": 2, "layers": [0, 6], "ranks": [2, 3]}],
        },
    ],
}
SP_TP2_TO_TP1_6 = {
    "micro_batch_size": 2,
    "sequence_parallel": True,
    "pipelines": [
        {
            "micro_batches": 4,
            "stages": [
                {"accelerator": "cpu", "tp": 2, "layers": [0, 2], "ranks": [0, 1]},
                {"accelerator": "cpu", "tp": 1, "layers": [2, 6], "ranks": [2]},
            ],
        }
    ],
}


def test_a_checkpoint_chain_through_every_kind_of_plan_follows_one_process(
    workdir: pathlib.Path, single: pathlib.Path
) -> None:
    """Two iterations per plan, each loading the previous plan's checkpoint: interleaving +
    heterogeneous DP + SP with ZeRO-1 (4 ranks) -> heterogeneous DP with ZeRO-1 (replicas of
    TP 1 x 2 stages and TP 2 x 1 stage) -> SP across a TP 2 -> TP 1 boundary (3 ranks) ->
    the interleaved TP 2 / TP 1 plan (3 ranks), and the SP checkpoint on one process too.
    Every hop's losses and gradient norms equal the single-process run's iterations."""
    chain = workdir / "chain"
    chain.mkdir()
    plans = {"all-three": str(PLANS / "cpu_interleaved_hetero_dp_sp.json")}
    for name, plan in (("hetero-dp", HETERO_DP_6), ("sp-tp2-tp1", SP_TP2_TO_TP1_6)):
        path = chain / f"{name}.json"
        path.write_text(json.dumps({"format": "megatron_het.plan/1", **plan}))
        plans[name] = str(path)
    hops = [
        ("all-three", 4, ["--plan", plans["all-three"], "--use-distributed-optimizer"]),
        ("hetero-dp", 4, ["--plan", plans["hetero-dp"], "--use-distributed-optimizer"]),
        ("sp-tp2-tp1", 3, ["--plan", plans["sp-tp2-tp1"]]),
        ("interleaved", WORLD, PLAN),
    ]
    expected = records(single, "train")
    previous = None
    for hop, (name, world, layout) in enumerate(hops):
        end = 2 * (hop + 1)
        save, path = chain / f"ckpt-{name}", chain / f"{name}.jsonl"
        argv = [
            *MODEL,
            *BASE,
            *layout,
            "--save",
            str(save),
            "--exit-interval",
            str(end),
            "--metrics-file",
            str(path),
        ]
        if previous is not None:
            argv += ["--load", str(previous)]
        results = run_ranks(_train_worker, world, argv, timeout=120)
        assert [iteration for iteration, _ in results] == [end] * world, name
        got = records(path, "train")
        assert [r["iteration"] for r in got] == [end - 1, end], name
        assert_close(expected[end - 2 : end], got, ("loss", "grad_norm", "lr"))
        assert read_latest_iteration(save) == end
        if previous is not None:  # each hop is an explicit new plan: the log says what changed
            log = "".join(text for _, text in results)
            assert (
                f"> elastic restart from iteration {end - 2}: the checkpoint was written "
                f"by {hops[hop - 1][1]} ranks" in log
            ), log[-3000:]
            assert f"now {world} ranks" in log
            assert (
                f"global batch {GLOBAL_BATCH} kept; data continues at sample "
                f"{(end - 2) * GLOBAL_BATCH}"
            ) in log
            assert "predicted iteration time now" in log
        previous = save
        if name == "sp-tp2-tp1":  # the same checkpoint continues on one process as well
            one = chain / "one-process.jsonl"
            run_single(
                [
                    *MODEL,
                    *BASE,
                    "--load",
                    str(save),
                    "--exit-interval",
                    str(end + 2),
                    "--metrics-file",
                    str(one),
                ]
            )
            assert_close(expected[end : end + 2], records(one, "train"), ("loss", "grad_norm"))
