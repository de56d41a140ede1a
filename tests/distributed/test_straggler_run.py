"""EMULATION: --emulation-extra-slowdown makes one emulated rank a straggler, and --log-straggler
names it, end to end on 4 emulated ranks (run_ranks, gloo); the extra slowdown's set-up and its
one-line errors without processes.

The runs use scripts/clusters/cpu_emulated.yaml with every kind's slowdown x3 (the demo's
--dilation), so that every compute region is padded to its kind's time: with emu-fast at x1 its
regions would last what the shared host gives them, which differs between the two emu-fast
ranks by more than the run's ratios allow on a busy host. The plan gives the two emu-slow ranks
the same stage in two pipelines, so rank 3 at 2 x its kind computes 2 x rank 2's time, 1.33 x
their median.
"""

from __future__ import annotations

import io
import json
import pathlib
import re

import pytest
import yaml

from megatron_het.arguments import parse_run_config
from megatron_het.cluster import ClusterSpec
from megatron_het.emulation import Emulator
from megatron_het.emulation.dilation import dilated_cluster
from megatron_het.errors import UserError
from megatron_het.training.setup import prepare_run
from tests.distributed.harness import run_ranks

REPO = pathlib.Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "clusters" / "cpu_emulated.yaml"
PLAN = str(REPO / "scripts" / "plans" / "cpu_emulated_dp2_fast_heavy.json")
COMMON = [
    "--model",
    "tiny",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "300",
    "--seq-length",
    "32",
    "--plan",
    PLAN,
]
NAMED = re.compile(r"^ straggler: rank (\d+) ", re.MULTILINE)


def rank_emulation(flags: list[str], rank: int):
    from megatron_het.training.run import rank_emulation as build

    setup = prepare_run(parse_run_config([*COMMON, "--cluster", str(CLUSTER), *flags]), None)
    return build(setup, rank, threads=1)


def test_the_extra_slowdown_multiplies_one_ranks_kind_and_is_described() -> None:
    flags = ["--emulation-extra-slowdown", "3=2.5", "--emulation-extra-slowdown", "0=1.5"]
    slowdowns = [rank_emulation(flags, rank).region_timer.slowdown for rank in range(4)]
    assert slowdowns == [1.5, 1.0, 2.0, 5.0]  # emu-fast x1, emu-slow x2, times the extras
    description = rank_emulation(flags, 1).description
    assert description.startswith("> EMULATION: ")
    assert description.endswith(
        "; stragglers (--emulation-extra-slowdown): rank 0 x1.5 its "
        "kind's time, rank 3 x2.5 its kind's time"
    )
    assert "stragglers" not in rank_emulation([], 1).description


def test_a_straggler_region_lasts_factor_x_its_kinds_time() -> None:
    spec = ClusterSpec.load(CLUSTER).accelerator_of(2)  # emu-slow, x2
    now, waits = [0.0], []

    def timed(extra: float) -> float:
        waits.clear()
        emulator = Emulator.from_spec(
            spec,
            clock=lambda: now[0],
            sleep=waits.append,
            cpu_clock=lambda: now[0],
            extra_slowdown=extra,
        )
        with emulator.timed_region(("forward", False, 0)):
            now[0] += 0.1  # 0.1 s of CPU work
        return 0.1 + sum(waits)

    assert timed(1.0) == pytest.approx(0.2) and timed(3.0) == pytest.approx(0.6)
    with pytest.raises(UserError, match="an extra slowdown must be >= 1.0"):
        Emulator.from_spec(spec, cpu_clock=lambda: 0.0, extra_slowdown=0.5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--emulation-extra-slowdown", "4=2"],
            "--emulation-extra-slowdown 4=2: rank 4 is outside "
            "the world of cluster cpu_emulated (ranks 0-3)",
        ),
        (
            ["--emulation-extra-slowdown", "1=2", "--emulation-extra-slowdown", "1=3"],
            "--emulation-extra-slowdown 1=3: rank 1 is named twice; give each rank one factor",
        ),
    ],
)
def test_extra_slowdown_mistakes_are_one_line(flags: list[str], message: str) -> None:
    with pytest.raises(UserError) as info:
        rank_emulation(flags, 0)
    assert str(info.value) == message


def test_only_an_emulated_rank_can_be_slowed() -> None:
    from megatron_het.training.run import rank_emulation as build

    setup = prepare_run(
        parse_run_config(
            [
                *COMMON[:-2],
                "--pipeline-model-parallel-size",
                "2",
                "--global-batch-size",
                "4",
                "--emulation-extra-slowdown",
                "1=2",
            ]
        ),
        None,
    )
    with pytest.raises(UserError) as info:
        build(setup, 0, threads=1)
    assert str(info.value) == (
        "--emulation-extra-slowdown 1=2: rank 1 is cpu, which is not "
        "emulated; only an emulated rank can be slowed (EMULATION)"
    )


def _train_worker(rank: int, world_size: int, argv: list[str]) -> str:
    from megatron_het.training import pretrain_on_world

    out = io.StringIO()
    pretrain_on_world(parse_run_config(argv), world_size, out=out)
    return out.getvalue()


def run_emulated(tmp_path: pathlib.Path, *flags: str) -> tuple[str, list[dict]]:
    """The logging rank's output and the metrics records of a 4-iteration emulated run."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(dilated_cluster(CLUSTER, 3.0)))
    metrics = tmp_path / "metrics.jsonl"
    argv = [
        *COMMON,
        "--cluster",
        str(cluster),
        "--train-iters",
        "4",
        "--log-interval",
        "2",
        "--eval-iters",
        "0",
        "--log-straggler",
        "--metrics-file",
        str(metrics),
        *flags,
    ]
    text = "".join(run_ranks(_train_worker, 4, argv, timeout=120))
    return text, [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.mark.slow
def test_log_straggler_names_the_slowed_rank_and_no_other(tmp_path: pathlib.Path) -> None:
    text, records = run_emulated(tmp_path, "--emulation-extra-slowdown", "3=2.0")
    assert "stragglers (--emulation-extra-slowdown): rank 3 x2 its kind's time" in text
    assert set(NAMED.findall(text)) == {"3"}
    assert " straggler: rank 3 (pipeline 1 stage 1, emu-slow (emulated)) computed " in text
    reports = [r["straggler"] for r in records if "straggler" in r]
    assert [r["first_iteration"] for r in reports] == [1, 3]
    assert all(set(r["stragglers"]) <= {3} for r in reports)
    assert reports[-1]["stragglers"] == [3]  # the last interval's, past the warm-up
    assert reports[-1]["ratio_to_kind_median"][3] > 1.2
    assert all(len(r["rank_compute_s"]) == 4 for r in records)


@pytest.mark.slow
def test_log_straggler_names_none_without_a_slowed_rank(tmp_path: pathlib.Path) -> None:
    # Four ranks share two cores with the other tests: a kind's two ranks can drift apart by
    # 1.5x (the default threshold's naming point for a pair), never by 3x (threshold 0.5).
    text, records = run_emulated(tmp_path, "--straggler-threshold", "0.5")
    assert NAMED.findall(text) == []
    assert text.count("   compute s per rank over iterations ") == 2
    assert [r["straggler"]["stragglers"] for r in records if "straggler" in r] == [[], []]
