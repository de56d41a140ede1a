"""The distributed driver against the single-process run: same data, seed and losses.

Every parallel run here goes through :func:`pretrain_on_world` in ``run_ranks`` workers (4
ranks, gloo) and writes its metrics file from the logging rank; the reference is
:func:`pretrain` in this process. Per-iteration losses and gradient norms must agree within
2e-4 relative (fp32). Tensor parallelism sums partial products in another order than one
process does, so gradient elements that are themselves tiny (|g| ~ 1e-8, sums of cancelling
terms) differ in their last bits; Adam with eps 1e-8 turns that into lr-sized weight changes.
The runs therefore use ``--adam-eps 1e-6``, which keeps those elements' updates small, so the
comparison measures the parallel code and not the amplified rounding.
"""

from __future__ import annotations

import io
import json
import math
import pathlib
import re
import shutil
from collections.abc import Callable
from typing import Any

import pytest

from megatron_het.arguments import parse_run_config
from megatron_het.checkpoint.io import read_latest_iteration
from megatron_het.training.stop import StopRequest
from tests.distributed.harness import RankFailure, run_ranks

REPO = pathlib.Path(__file__).resolve().parents[2]
CLUSTER = str(REPO / "scripts" / "clusters" / "cpu_emulated.yaml")
PLANS = REPO / "scripts" / "plans"
TRAIN_ITERS = 8
RTOL = 2e-4

BASE = [
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "300",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    str(TRAIN_ITERS),
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-warmup-iters",
    "2",
    "--lr-decay-style",
    "cosine",
    "--weight-decay",
    "0.1",
    "--clip-grad",
    "1.0",
    "--adam-eps",
    "1e-6",
    "--seed",
    "7",
    "--eval-interval",
    "4",
    "--eval-iters",
    "1",
    "--log-interval",
    "4",
]

# name -> (model preset, layout flags). Tied presets exercise the first/last-stage embedding sync.
CASES = {
    "pp3_tp211_layers121": (
        "tiny-tied",
        ["--cluster", CLUSTER, "--plan", str(PLANS / "cpu_emulated_3stage.json")],
    ),
    "tp2_dp2": ("tiny", ["--tensor-model-parallel-size", "2", "--overlap-grad-reduce"]),
    "pp2_dp2_zero1_uneven": (
        "tiny-tied",
        [
            "--cluster",
            CLUSTER,
            "--plan",
            str(PLANS / "cpu_emulated_dp2_fast_heavy.json"),
            "--use-distributed-optimizer",
            "--overlap-param-gather",
            "--bridge",
            "direct",
        ],
    ),
    "tp2_pp2": (
        "tiny",
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    ),
    # Sequence parallelism: [b, s/2, H] blocks between the TP-2 stages' blocks and over their
    # boundary; the 3-stage plan reshards them across its TP 2 -> TP 1 boundary.
    "tp2_pp2_sp": (
        "tiny",
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
    ),
    "pp3_tp211_sp": (
        "tiny-tied",
        [
            "--cluster",
            CLUSTER,
            "--sequence-parallel",
            "--plan",
            str(PLANS / "cpu_emulated_3stage.json"),
        ],
    ),
    # ... with the TP-2 stage's all-gathers and reduce-scatters as rings beside the GEMMs.
    "tp2_pp2_overlap_sp": (
        "tiny",
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--tp-comm-overlap",
        ],
    ),
    # Heterogeneous data parallelism: a 2-stage tp=1 replica with 3 micro-batches beside a
    # 1-stage tp=2 replica with 1; gradients summed in the full parameter shapes.
    "hetero_dp_pp2_tp2": ("tiny-tied", ["--plan", str(PLANS / "cpu_hetero_dp.json")]),
    "hetero_dp_zero1": (
        "tiny-tied",
        [
            "--plan",
            str(PLANS / "cpu_hetero_dp.json"),
            "--use-distributed-optimizer",
            "--overlap-param-gather",
        ],
    ),
    # ... and across kinds: an emu-fast tp=2 replica beside an emu-slow 2-stage one, their
    # gradient (and ZeRO-1 parameter) shares crossing the bridge.
    "hetero_dp_two_kinds": (
        "tiny-tied",
        ["--cluster", CLUSTER, "--plan", str(PLANS / "cpu_emulated_hetero_dp.json")],
    ),
    "hetero_dp_two_kinds_zero1": (
        "tiny-tied",
        [
            "--cluster",
            CLUSTER,
            "--plan",
            str(PLANS / "cpu_emulated_hetero_dp.json"),
            "--use-distributed-optimizer",
        ],
    ),
    # Stage bounds inside layers (between a layer's attention and MLP blocks), across a
    # TP 2 -> 1 boundary with sequence parallelism, and in a heterogeneous-DP replica whose
    # layer 2 is split over two ranks while the other replica holds it whole.
    "pp3_half_layers_sp": (
        "tiny-tied",
        [
            "--cluster",
            CLUSTER,
            "--sequence-parallel",
            "--plan",
            str(PLANS / "cpu_emulated_half_layers.json"),
        ],
    ),
    "hetero_dp_half_layers_zero1": (
        "tiny-tied",
        [
            "--cluster",
            CLUSTER,
            "--plan",
            str(PLANS / "cpu_emulated_hetero_dp_half_layers.json"),
            "--use-distributed-optimizer",
        ],
    ),
}
# (pipeline, stage) of every stage, as the metrics lines list them.
STAGES = {
    "pp3_tp211_layers121": [(0, 0), (0, 1), (0, 2)],
    "tp2_dp2": [(0, 0), (1, 0)],
    "pp2_dp2_zero1_uneven": [(0, 0), (0, 1), (1, 0), (1, 1)],
    "tp2_pp2": [(0, 0), (0, 1)],
    "tp2_pp2_sp": [(0, 0), (0, 1)],
    "tp2_pp2_overlap_sp": [(0, 0), (0, 1)],
    "pp3_tp211_sp": [(0, 0), (0, 1), (0, 2)],
    "hetero_dp_pp2_tp2": [(0, 0), (0, 1), (1, 0)],
    "hetero_dp_zero1": [(0, 0), (0, 1), (1, 0)],
    "hetero_dp_two_kinds": [(0, 0), (1, 0), (1, 1)],
    "hetero_dp_two_kinds_zero1": [(0, 0), (1, 0), (1, 1)],
    "pp3_half_layers_sp": [(0, 0), (0, 1), (0, 2)],
    "hetero_dp_half_layers_zero1": [(0, 0), (1, 0), (1, 1)],
}


def records(path: pathlib.Path, split: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


class StopAtIteration:
    """A stop request that reads as set from the ``n``-th check on: a SIGTERM arriving on one
    rank during iteration ``n``."""

    def __init__(self, n: int) -> None:
        self.n, self.checks, self.reason = n, 0, "SIGTERM"

    @property
    def requested(self) -> bool:
        self.checks += 1
        return self.checks >= self.n


def _train_worker(
    rank: int, world_size: int, argv: list[str], stop_rank: int | None = None, stop_at: int = 0
) -> tuple[int, str]:
    from megatron_het.training import pretrain_on_world

    stop = StopAtIteration(stop_at) if rank == stop_rank else StopRequest()
    out = io.StringIO()
    progress = pretrain_on_world(parse_run_config(argv), world_size, stop=stop, out=out)
    return progress.iteration, out.getvalue()


def run_parallel(argv: list[str], **kwargs: Any) -> list[tuple[int, str]]:
    return run_ranks(_train_worker, 4, argv, timeout=120, **kwargs)


def run_single(argv: list[str]) -> str:
    from megatron_het.training.run import pretrain

    out = io.StringIO()
    pretrain(parse_run_config(argv), out=out)
    return out.getvalue()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("parallel")


@pytest.fixture(scope="module")
def reference(workdir: pathlib.Path) -> Callable[[str], pathlib.Path]:
    """model preset -> metrics file of its single-process run (run once per preset)."""
    done: dict[str, pathlib.Path] = {}

    def get(model: str) -> pathlib.Path:
        if model not in done:
            path = workdir / f"single-{model}.jsonl"
            run_single(["--model", model, *BASE, "--metrics-file", str(path)])
            done[model] = path
        return done[model]

    return get


@pytest.fixture(scope="module")
def parallel(workdir: pathlib.Path) -> Callable[[str], tuple[pathlib.Path, str]]:
    """case name -> (metrics file, logging rank's output) of its uninterrupted parallel run."""
    done: dict[str, tuple[pathlib.Path, str]] = {}

    def get(name: str) -> tuple[pathlib.Path, str]:
        if name not in done:
            model, layout = CASES[name]
            path = workdir / f"parallel-{name}.jsonl"
            results = run_parallel(["--model", model, *BASE, *layout, "--metrics-file", str(path)])
            assert [iteration for iteration, _ in results] == [TRAIN_ITERS] * 4
            done[name] = (path, "".join(text for _, text in results))
        return done[name]

    return get


def assert_close(expected: list[dict], got: list[dict], keys: tuple[str, ...]) -> None:
    assert [r["iteration"] for r in got] == [r["iteration"] for r in expected]
    for key in keys:
        want, have = [r[key] for r in expected], [r[key] for r in got]
        assert have == pytest.approx(want, rel=RTOL), key


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(name: str, reference: Callable, parallel: Callable) -> None:
    model, layout = CASES[name]
    expected_path = reference(model)
    path, text = parallel(name)
    single, got = records(expected_path, "train"), records(path, "train")
    assert_close(single, got, ("loss", "grad_norm", "lr"))
    assert [r["consumed_samples"] for r in got] == [r["consumed_samples"] for r in single]
    assert_close(records(expected_path, "valid"), records(path, "valid"), ("loss",))
    # The same keys as single-process, plus the parallel fields.
    assert set(single[0]) <= set(got[0])
    assert {"stages", "mfu", "tflops_per_accelerator", "world_size"} <= set(got[0])
    stages = got[0]["stages"]
    assert [(s["pipeline"], s["stage"]) for s in stages] == STAGES[name]
    assert all(s["compute_s"] > 0 and s["bubble_s"] >= 0 for s in stages)
    assert 0 < got[0]["mfu"] < 1
    if "--cluster" in layout:  # emulated kinds are labelled wherever they are named
        assert set(got[0]["tflops_per_accelerator"]) == {
            "emu-fast (emulated)",
            "emu-slow (emulated)",
        }
        assert "emu-slow (emulated)" in text and "emu-slow," not in text
    assert text.count("validation loss at iteration") == 2  # exactly one rank logs
    # the sequence-parallel cases run with it on (their start-up plan line says so)
    assert (", sequence parallel" in text) == name.endswith("_sp")
    assert ("TP communication overlapped" in text) == ("--tp-comm-overlap" in layout)


# Low-precision plans against the single-process run of the same precision: ZeRO-1 with
# overlapped bf16 reductions over a tied pipeline (main_grad of the embedding copies), TP (the
# vocab-parallel head), and fp16 with loss scaling (every rank unscales and skips alike).
LOW_PRECISION_CASES = {
    "pp2_dp2_zero1_bf16": (
        "tiny-tied",
        [
            "--cluster",
            CLUSTER,
            "--plan",
            str(PLANS / "cpu_emulated_dp2_fast_heavy.json"),
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--grad-reduce-in-bf16",
        ],
        ["--bf16"],
    ),
    "tp2_pp2_bf16": (
        "tiny",
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        ["--bf16"],
    ),
    # The TP rings in bf16, run again by every recomputed layer in its backward.
    "tp2_pp2_sp_overlap_recompute_bf16": (
        "tiny",
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--tp-comm-overlap",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
        ["--bf16"],
    ),
    "tp2_dp2_zero1_fp16": (
        "tiny",
        [
            "--tensor-model-parallel-size",
            "2",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
        ],
        ["--fp16", "--initial-loss-scale", str(2**17), "--hysteresis", "1"],
    ),
    # Replicas of different layouts: bf16 parameters shared by their owners after each step.
    "hetero_dp_zero1_bf16": (
        "tiny-tied",
        [
            "--plan",
            str(PLANS / "cpu_hetero_dp.json"),
            "--use-distributed-optimizer",
            "--grad-reduce-in-bf16",
        ],
        ["--bf16"],
    ),
}
LOW_PRECISION_RTOL = 2e-2


@pytest.mark.parametrize("name", list(LOW_PRECISION_CASES))
def test_low_precision_plan_matches_the_single_process_run(
    name: str, workdir: pathlib.Path
) -> None:
    model, layout, precision = LOW_PRECISION_CASES[name]
    single_path = workdir / f"single-low-{name}.jsonl"
    run_single(["--model", model, *BASE, *precision, "--metrics-file", str(single_path)])
    path = workdir / f"parallel-low-{name}.jsonl"
    results = run_parallel(
        ["--model", model, *BASE, *layout, *precision, "--metrics-file", str(path)]
    )
    assert [iteration for iteration, _ in results] == [TRAIN_ITERS] * 4
    single, got = records(single_path, "train"), records(path, "train")
    assert [r["iteration"] for r in got] == [r["iteration"] for r in single]
    assert [r["loss"] for r in got] == pytest.approx(
        [r["loss"] for r in single], rel=LOW_PRECISION_RTOL
    )
    # The first gradient comes from the same weights; later ones from weights that bf16
    # rounding in another summation order has moved apart, and a gradient norm amplifies that.
    norms, expected = [r["grad_norm"] for r in got], [r["grad_norm"] for r in single]
    finite = [i for i, norm in enumerate(expected) if math.isfinite(norm)]
    assert [i for i, norm in enumerate(norms) if math.isfinite(norm)] == finite
    assert norms[finite[0]] == pytest.approx(expected[finite[0]], rel=LOW_PRECISION_RTOL)
    assert [norms[i] for i in finite] == pytest.approx([expected[i] for i in finite], rel=0.1)
    assert [r.get("loss_scale") for r in got] == [r.get("loss_scale") for r in single]
    assert records(path, "valid")[-1]["loss"] == pytest.approx(
        records(single_path, "valid")[-1]["loss"], rel=LOW_PRECISION_RTOL
    )


@pytest.fixture(scope="module")
def stopped_checkpoint(workdir: pathlib.Path) -> pathlib.Path:
    """tp2_pp2 run where only rank 1 gets a SIGTERM during iteration 4; all ranks save it."""
    model, layout = CASES["tp2_pp2"]
    save = workdir / "ckpt-tp2_pp2"
    results = run_parallel(
        [
            "--model",
            model,
            *BASE,
            *layout,
            "--save",
            str(save),
            "--metrics-file",
            str(workdir / "stopped.jsonl"),
        ],
        stop_rank=1,
        stop_at=4,
    )
    assert [iteration for iteration, _ in results] == [4] * 4
    log = "".join(text for _, text in results)
    assert "stopping after iteration 4 (stop requested by another rank)" in log
    assert read_latest_iteration(save) == 4
    return save


def test_resume_same_plan_is_exact(
    workdir: pathlib.Path, parallel: Callable, stopped_checkpoint: pathlib.Path
) -> None:
    model, layout = CASES["tp2_pp2"]
    path = workdir / "resumed.jsonl"
    results = run_parallel(
        [
            "--model",
            model,
            *BASE,
            *layout,
            "--load",
            str(stopped_checkpoint),
            "--metrics-file",
            str(path),
        ]
    )
    assert [iteration for iteration, _ in results] == [TRAIN_ITERS] * 4
    full = records(parallel("tp2_pp2")[0], "train")[4:]
    got = records(path, "train")
    assert [r["iteration"] for r in got] == list(range(5, TRAIN_ITERS + 1))
    for key in ("loss", "grad_norm", "lr", "consumed_samples"):
        assert [r[key] for r in got] == [r[key] for r in full], key


def test_load_under_another_plan_continues_like_single_process(
    workdir: pathlib.Path, reference: Callable, stopped_checkpoint: pathlib.Path
) -> None:
    # Saved by tp=2 x pp=2 without ZeRO; loaded by tp=2 x dp=2 with ZeRO-1 (its Adam state
    # sharded over the replicas).
    model, layout = CASES["tp2_dp2"]
    path = workdir / "resharded.jsonl"
    run_parallel(
        [
            "--model",
            model,
            *BASE,
            *layout,
            "--use-distributed-optimizer",
            "--load",
            str(stopped_checkpoint),
            "--metrics-file",
            str(path),
        ]
    )
    single = records(reference(model), "train")[4:]
    assert_close(single, records(path, "train"), ("loss", "grad_norm", "lr"))


def test_single_process_loads_a_parallel_checkpoint(
    workdir: pathlib.Path, reference: Callable, stopped_checkpoint: pathlib.Path
) -> None:
    path = workdir / "single-from-parallel.jsonl"
    run_single(
        ["--model", "tiny", *BASE, "--load", str(stopped_checkpoint), "--metrics-file", str(path)]
    )
    single = records(reference("tiny"), "train")[4:]
    assert_close(single, records(path, "train"), ("loss", "grad_norm", "lr"))


def test_heterogeneous_dp_checkpoint_loads_on_one_process(
    workdir: pathlib.Path, reference: Callable
) -> None:
    # ZeRO-1 over replicas of different layouts: the owners' rows of Adam state are shared
    # into full shards before pipeline 0 writes them.
    model, layout = CASES["hetero_dp_zero1"]
    save = workdir / "ckpt-hetero"
    run_parallel(
        [
            "--model",
            model,
            *BASE,
            *layout,
            "--save",
            str(save),
            "--exit-interval",
            "4",
            "--metrics-file",
            str(workdir / "hetero-first-half.jsonl"),
        ]
    )
    path = workdir / "single-from-hetero.jsonl"
    run_single(["--model", model, *BASE, "--load", str(save), "--metrics-file", str(path)])
    assert_close(
        records(reference(model), "train")[4:], records(path, "train"), ("loss", "grad_norm", "lr")
    )


def test_half_layer_checkpoints_load_under_other_bounds(
    workdir: pathlib.Path, reference: Callable
) -> None:
    # Written by stages whose bounds split layers 1 and 2; read by whole-layer stages, and by a
    # heterogeneous-DP plan that splits layer 2 only (with ZeRO-1).
    model, layout = CASES["pp3_half_layers_sp"]
    save = workdir / "ckpt-half-layers"
    run_parallel(
        [
            "--model",
            model,
            *BASE,
            *layout,
            "--save",
            str(save),
            "--exit-interval",
            "4",
            "--metrics-file",
            str(workdir / "half-layers-first-half.jsonl"),
        ]
    )
    single = records(reference(model), "train")[4:]
    for name in ("pp3_tp211_layers121", "hetero_dp_half_layers_zero1"):
        path = workdir / f"{name}-from-half-layers.jsonl"
        run_parallel(
            [
                "--model",
                model,
                *BASE,
                *CASES[name][1],
                "--load",
                str(save),
                "--metrics-file",
                str(path),
            ]
        )
        assert_close(single, records(path, "train"), ("loss", "grad_norm", "lr"))


def _disagreeing_worker(rank: int, world_size: int) -> None:
    from megatron_het.training import pretrain_on_world

    lr = "3e-3" if rank == 0 else "1e-3"  # rank 1 launched with another flag
    argv = ["--model", "tiny", *BASE, "--pipeline-model-parallel-size", "2", "--lr", lr]
    pretrain_on_world(parse_run_config(argv), world_size, out=io.StringIO())


def test_ranks_launched_with_different_flags_refuse_to_start() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_disagreeing_worker, 2, timeout=60)
    assert "resolved a different plan, model or training setup" in str(info.value)


def test_a_damaged_shard_is_named_on_every_rank(
    workdir: pathlib.Path, stopped_checkpoint: pathlib.Path
) -> None:
    # Rank 3's model shard truncated: rank 3 finds it, and every other rank (rank 2, the
    # logging rank, among them) fails with the same line rather than "see its error".
    damaged = workdir / "ckpt-damaged"
    shutil.copytree(stopped_checkpoint, damaged)
    shard = damaged / "iter_0000004" / "model_shard_00003.pt"
    shard.write_bytes(shard.read_bytes()[:-7])
    model, layout = CASES["tp2_pp2"]
    with pytest.raises(RankFailure) as info:
        run_parallel(
            [
                "--model",
                model,
                *BASE,
                *layout,
                "--load",
                str(damaged),
                "--metrics-file",
                str(workdir / "damaged.jsonl"),
            ]
        )
    parts = re.split(r"(?m)^rank (\d+) failed:$", str(info.value))
    reports = dict(zip(map(int, parts[1::2]), parts[2::2]))
    assert sorted(reports) == [0, 1, 2, 3], str(info.value)[-3000:]
    for _rank, text in reports.items():
        assert f"{shard} is damaged (truncated" in text, text[-2000:]
        assert "see its error" not in text
