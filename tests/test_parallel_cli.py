"""The parallel command line: torchrun end to end, --dry-run, and one-line errors."""

from __future__ import annotations

import io
import json
import pathlib
import re
import subprocess
import sys

import pytest

from megatron_het.arguments import parse_run_config
from megatron_het.errors import UserError
from megatron_het.launcher.launch_env import read_launch_env
from megatron_het.training.dry_run import dry_run
from megatron_het.training.setup import prepare_run

REPO = pathlib.Path(__file__).resolve().parent.parent
CLUSTER = str(REPO / "scripts" / "clusters" / "cpu_emulated.yaml")
PLANS = REPO / "scripts" / "plans"
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
]


@pytest.mark.slow
def test_torchrun_trains_on_the_emulated_cluster(tmp_path: pathlib.Path) -> None:
    metrics, save = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "4",
        "pretrain_llama.py",
        *COMMON,
        "--cluster",
        CLUSTER,
        "--plan",
        str(PLANS / "cpu_emulated_pp4.json"),
        "--train-iters",
        "3",
        "--lr",
        "1e-3",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--metrics-file",
        str(metrics),
        "--save",
        str(save),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [1, 2, 3]
    assert lines[0]["global_batch_size"] == 8  # from the plan: 2 x 4 micro-batches
    assert set(lines[0]["tflops_per_accelerator"]) == {"emu-fast (emulated)", "emu-slow (emulated)"}
    assert [s["accelerator"] for s in lines[0]["stages"]] == ["emu-fast (emulated)"] * 2 + [
        "emu-slow (emulated)"
    ] * 2
    assert proc.stdout.count(" iteration        3/       3 |") == 1  # one rank logs
    assert "MFU:" in proc.stdout
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_dry_run_prints_plan_and_prediction() -> None:
    out = io.StringIO()
    dry_run(
        parse_run_config(
            [
                *COMMON,
                "--cluster",
                CLUSTER,
                "--plan",
                str(PLANS / "cpu_emulated_3stage.json"),
                "--dry-run",
            ]
        ),
        out,
    )
    text = out.getvalue()
    assert "stage 0: emu-fast (emulated), tp=2, 1 layer [0, 1) +embedding, ranks [0, 1]" in text
    assert "stage 1: emu-slow (emulated), tp=1, 2 layers [1, 3), ranks [2]" in text
    assert "global batch 8 = 2 x 4 micro-batches" in text
    assert "> predicted iteration time:" in text
    assert "decoder layers eager (no --compile)" in text
    out = io.StringIO()
    dry_run(
        parse_run_config(
            [
                *COMMON,
                "--cluster",
                CLUSTER,
                "--plan",
                str(PLANS / "cpu_emulated_3stage.json"),
                "--dry-run",
                "--compile",
            ]
        ),
        out,
    )
    assert "decoder layers compiled (--compile)" in out.getvalue()


def test_dry_run_megatron_flags_without_cluster_use_cpu_ranks() -> None:
    setup = prepare_run(
        parse_run_config(
            [
                *COMMON,
                "--pipeline-model-parallel-size",
                "2",
                "--decoder-first-pipeline-num-layers",
                "3",
                "--global-batch-size",
                "4",
                "--dry-run",
            ]
        ),
        world_size=None,
    )
    assert [s.layers for s in setup.plan.pipelines[0].stages] == [(0, 3), (3, 4)]
    assert setup.cluster.world_size == 2 and setup.accelerator(1).name == "cpu"


@pytest.mark.parametrize(
    "flags",
    [
        ["--num-layers-per-virtual-pipeline-stage", "2"],
        ["--virtual-pipeline-model-parallel-size", "2"],
        ["--pipeline-model-parallel-layout", "Et*2|t*2|t*2|t*2L"],
    ],
)
def test_megatron_interleaving_flags_give_round_robin_chunks(flags: list[str]) -> None:
    setup = prepare_run(
        parse_run_config(
            [
                *COMMON,
                "--num-layers",
                "8",
                "--pipeline-model-parallel-size",
                "2",
                "--global-batch-size",
                "4",
                *flags,
            ]
        ),
        world_size=None,
    )
    stages = setup.plan.pipelines[0].stages
    assert [(s.layers, s.ranks) for s in stages] == [
        ((0, 2), (0,)),
        ((2, 4), (1,)),
        ((4, 6), (0,)),
        ((6, 8), (1,)),
    ]
    assert stages[0].has_embedding and stages[-1].has_head


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            [
                "--num-layers-per-virtual-pipeline-stage",
                "2",
                "--virtual-pipeline-model-parallel-size",
                "2",
            ],
            "not both",
        ),
        (
            ["--num-layers-per-virtual-pipeline-stage", "3"],
            "--num-layers 8 is not a multiple of --num-layers-per-virtual-pipeline-stage 3",
        ),
        (
            ["--num-layers-per-virtual-pipeline-stage", "2", "--micro-batch-size", "4"],
            "needs at least 2 micro_batches (got 1): use 2 or more",
        ),
    ],
)
def test_megatron_interleaving_flag_mistakes_are_one_line(flags: list[str], message: str) -> None:
    with pytest.raises(UserError) as info:
        prepare_run(
            parse_run_config(
                [
                    *COMMON,
                    "--num-layers",
                    "8",
                    "--pipeline-model-parallel-size",
                    "2",
                    "--global-batch-size",
                    "4",
                    *flags,
                ]
            ),
            world_size=None,
        )
    assert message in str(info.value) and "\n" not in str(info.value)


def test_auto_plan_fills_the_cluster() -> None:
    setup = prepare_run(
        parse_run_config(
            [*COMMON, "--cluster", CLUSTER, "--plan", "auto", "--global-batch-size", "8"]
        ),
        4,
    )
    assert setup.plan.world_size == 4 and setup.plan.global_batch_size == 8
    assert setup.train.micro_batch_size == setup.plan.micro_batch_size


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            [
                "--cluster",
                CLUSTER,
                "--plan",
                str(PLANS / "cpu_emulated_3stage.json"),
                "--global-batch-size",
                "6",
            ],
            "--global-batch-size 6 differs from the plan's 8",
        ),
        (
            ["--plan", str(PLANS / "cpu_emulated_3stage.json")],
            "stage 0 of pipeline 0 says emu-fast but rank 0 is cpu",
        ),
        (
            [
                "--plan",
                str(PLANS / "cpu_emulated_3stage.json"),
                "--tensor-model-parallel-size",
                "2",
            ],
            "--plan and --tensor-model-parallel-size both describe the layout",
        ),
        (
            [
                "--cluster",
                CLUSTER,
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "3",
            ],
            "is not divisible by",
        ),
        (
            [
                "--cluster",
                CLUSTER,
                "--plan",
                str(PLANS / "cpu_emulated_tp2_pp2.json"),
                "--micro-batch-size",
                "4",
            ],
            "--micro-batch-size 4 differs from the plan's",
        ),
        (
            [
                "--cluster",
                CLUSTER,
                "--plan",
                str(PLANS / "cpu_emulated_tp2_pp2.json"),
                "--num-attention-heads",
                "3",
                "--num-query-groups",
                "3",
                "--hidden-size",
                "48",
            ],
            "has tp=2, which does not divide",
        ),
        (
            [
                "--cluster",
                CLUSTER,
                "--plan",
                str(PLANS / "cpu_emulated_tp2_pp2.json"),
                "--tp-comm-overlap",
            ],
            "--tp-comm-overlap overlaps sequence parallelism's all-gathers",
        ),
    ],
)
def test_mismatches_are_one_line_errors(flags: list[str], message: str) -> None:
    with pytest.raises(UserError) as info:
        prepare_run(parse_run_config([*COMMON, *flags]), world_size=None)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_launched_world_must_match_the_cluster() -> None:
    with pytest.raises(UserError, match="2 ranks were launched but cluster cpu_emulated has 4"):
        prepare_run(parse_run_config([*COMMON, "--cluster", CLUSTER]), world_size=2)


@pytest.mark.slow
def test_dry_run_exit_status_and_error_line() -> None:
    base = [
        sys.executable,
        "pretrain_llama.py",
        *COMMON,
        "--cluster",
        CLUSTER,
        "--plan",
        str(PLANS / "cpu_emulated_tp2_pp2.json"),
        "--dry-run",
    ]
    ok = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "emu-slow (emulated), tp=2, 2 layers [2, 4) +head, ranks [2, 3]" in ok.stdout
    bad = subprocess.run(
        base + ["--global-batch-size", "16"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: --global-batch-size 16 differs from the plan's 8")
    assert bad.stderr.count("\n") == 1


def device_times(setup) -> dict:
    """EMULATION: every emulated rank's (forward, backward) seconds from the run's profile."""
    from megatron_het.training.run import rank_emulation

    return rank_emulation(setup, rank=0, threads=1).device_times


def _host_profile(path: pathlib.Path, vocab: int, dtype: str = "fp32") -> str:
    """A "cpu" profile of the tiny model at seq 32, micro-batch 2, TP 1 and 2: a layer takes
    (10, 20) ms, the embedding (1, 2) ms and the head (3, 4) ms, divided by TP."""
    from megatron_het.perf.measure.profile_format import (
        EndEntry,
        LayerEntry,
        Profile,
        ProfileConditions,
    )

    def ends(fwd: float, bwd: float) -> tuple:
        return tuple(EndEntry(64, vocab, 32, 2, tp, dtype, fwd / tp, bwd / tp) for tp in (1, 2))

    layers = tuple(
        LayerEntry(64, 176, 4, 2, 32, 2, tp, dtype, 0.010 / tp, 0.020 / tp, 1e5) for tp in (1, 2)
    )
    Profile(
        "cpu",
        ProfileConditions("host", "2.13", 1, "2026-11-30"),
        layers=layers,
        embedding=ends(0.001, 0.002),
        head=ends(0.003, 0.004),
    ).save(path)
    return str(path)


def test_emulation_profile_times_each_emulated_stage(tmp_path: pathlib.Path) -> None:
    flags = [*COMMON, "--cluster", CLUSTER, "--plan", str(PLANS / "cpu_emulated_3stage.json")]
    vocab = prepare_run(parse_run_config(flags), None).model_config.vocab_size
    profile = _host_profile(tmp_path / "cpu.json", vocab)
    run = parse_run_config([*flags, "--emulation-profile", profile, "--dry-run"])
    times = device_times(prepare_run(run, None))
    # Stage 0: tp=2, 1 layer + embedding; stage 1: 2 layers; stage 2: 1 layer + head.
    # One (forward, backward) pair per stage a rank runs (several when it interleaves chunks).
    assert times == {
        0: (pytest.approx((0.0055, 0.011)),),
        1: (pytest.approx((0.0055, 0.011)),),
        2: (pytest.approx((0.020, 0.040)),),
        3: (pytest.approx((0.013, 0.024)),),
    }
    out = io.StringIO()
    dry_run(run, out)
    assert (
        f"> EMULATION: stage compute of emulated ranks timed from profile {profile} "
        f"(slowdown x forward + backward per micro-batch): rank 0 1 x (5.5 + 11.0) ms; "
        f"rank 1 1 x (5.5 + 11.0) ms; rank 2 2 x (20.0 + 40.0) ms; rank 3 2 x (13.0 + "
        f"24.0) ms"
    ) in out.getvalue()
    # The prediction uses the same figures (x the kind's slowdown): stage 1 is 2 emu-slow layers.
    assert re.search(r"emu-slow \(emulated\) +1 +1-3 +40\.00 +80\.00 ", out.getvalue())
    auto = prepare_run(
        parse_run_config(
            [
                *COMMON,
                "--cluster",
                CLUSTER,
                "--plan",
                "auto",
                "--global-batch-size",
                "8",
                "--emulation-profile",
                profile,
            ]
        ),
        4,
    )
    assert sorted(device_times(auto)) == [0, 1, 2, 3]


def test_emulation_profile_errors_are_one_line(tmp_path: pathlib.Path) -> None:
    flags = [*COMMON, "--cluster", CLUSTER, "--plan", str(PLANS / "cpu_emulated_3stage.json")]
    vocab = prepare_run(parse_run_config(flags), None).model_config.vocab_size
    bf16_only = _host_profile(tmp_path / "bf16.json", vocab, dtype="bf16")
    with pytest.raises(UserError, match="no fp32 figures for the stage on ranks \\[0, 1\\]"):
        device_times(
            prepare_run(parse_run_config([*flags, "--emulation-profile", bf16_only]), None)
        )
    profile = _host_profile(tmp_path / "cpu.json", vocab)
    with pytest.raises(UserError, match="cluster cpu has none; drop the flag"):
        device_times(
            prepare_run(
                parse_run_config(
                    [
                        *COMMON,
                        "--pipeline-model-parallel-size",
                        "2",
                        "--global-batch-size",
                        "4",
                        "--emulation-profile",
                        profile,
                    ]
                ),
                None,
            )
        )
    with pytest.raises(UserError, match="missing.json"):
        prepare_run(
            parse_run_config([*flags, "--emulation-profile", str(tmp_path / "missing.json")]), None
        )


def test_launch_env_needs_torchrun_variables() -> None:
    env = read_launch_env(
        {
            "RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert (env.rank, env.world_size, env.local_rank) == (1, 4, 1)
    assert env.init_method == "tcp://127.0.0.1:29500" and env.run_id == ""
    assert (
        read_launch_env(
            {
                "RANK": "1",
                "WORLD_SIZE": "4",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
                "TORCHELASTIC_RUN_ID": "job7-2",
            }
        ).run_id
        == "job7-2"
    )
    with pytest.raises(UserError, match="MASTER_ADDR, MASTER_PORT not set"):
        read_launch_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(UserError, match="outside WORLD_SIZE"):
        read_launch_env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_a_stage_over_its_emulated_memory_cap_fails_at_start(tmp_path: pathlib.Path) -> None:
    """The cap is enforced where a run starts (dry run and every rank alike), in one line."""
    import yaml

    data = yaml.safe_load(pathlib.Path(CLUSTER).read_text())
    data["accelerators"] = {"emu-slow": {"memory_cap_gib": 1e-4}}
    capped = tmp_path / "capped.yaml"
    capped.write_text(yaml.safe_dump(data))
    run = parse_run_config(
        [
            *COMMON,
            "--cluster",
            str(capped),
            "--plan",
            str(PLANS / "cpu_emulated_3stage.json"),
            "--dry-run",
        ]
    )
    with pytest.raises(UserError) as info:
        dry_run(run, io.StringIO())
    message = str(info.value)
    assert message.startswith("pipeline 0 stage 1 (emu-slow (emulated), tp=1, ranks [2]) needs")
    assert "GiB per device but the emulated memory cap of emu-slow is 0.0001 GiB" in message
    assert "\n" not in message
