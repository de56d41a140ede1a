"""tools/convert_checkpoint.py --mode reshard and HF export from a plan's checkpoint.

A single-process run (untied embeddings, one real AdamW step) is saved; resharding it offline to
several plans and back must keep every weight and optimizer tensor, a single-process run must
resume from the resharded checkpoint exactly, and the HF export of a plan's checkpoint must equal
the export of the single-process one.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megatron_het.checkpoint.io import load_checkpoint_metadata, save_checkpoint
from megatron_het.checkpoint.reader import load_model_state, load_train_state
from megatron_het.config import ModelConfig, OptimizerConfig
from megatron_het.errors import UserError
from megatron_het.model.llama import build_model
from megatron_het.optim.lr_schedule import LRSchedule
from megatron_het.optim.optimizer import build_optimizer
from megatron_het.training.state import Progress
from tests.reference import (
    capture_train_state,
    forward_backward,
    optimizer_step,
    restore_train_state,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "convert_checkpoint.py"
from tools import convert_checkpoint  # noqa: E402

CONFIG = ModelConfig(
    num_layers=4,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=57,
    name="reshard-untied",
)
TOKENS = torch.randint(0, 57, (2, 9), generator=torch.Generator().manual_seed(0))
BATCH = [(TOKENS[:, :-1], TOKENS[:, 1:])]


def plan_json(
    path: pathlib.Path, *pipelines: list[tuple[int, tuple[int, int], list[int]]]
) -> pathlib.Path:
    path.write_text(
        json.dumps(
            {
                "format": "megatron_het.plan/1",
                "micro_batch_size": 1,
                "pipelines": [
                    {
                        "micro_batches": 1,
                        "stages": [
                            {"accelerator": "cpu", "tp": tp, "layers": list(layers), "ranks": ranks}
                            for tp, layers, ranks in stages
                        ],
                    }
                    for stages in pipelines
                ],
            }
        )
    )
    return path


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, iteration: int) -> None:
    optimizer.zero_grad(set_to_none=True)
    forward_backward(model, BATCH)
    optimizer_step(model, optimizer, 1e-2, 1.0, iteration)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict, dict]:
    """A single-process checkpoint after one step, with its weights and optimizer state."""
    directory = tmp_path_factory.mktemp("single")
    model = build_model(CONFIG, seed=3)
    optimizer = build_optimizer(model, OptimizerConfig())
    train_step(model, optimizer, 1)
    schedule = LRSchedule.from_config(OptimizerConfig(), train_iters=10)
    train_state = capture_train_state(optimizer, schedule, Progress(1, 2))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    save_checkpoint(directory, 1, CONFIG, weights, train_state)
    return directory, weights, train_state["optimizer"]["state"]


def reshard(source: pathlib.Path, target: pathlib.Path, plan: pathlib.Path) -> None:
    convert_checkpoint.main(
        [
            "--mode",
            "reshard",
            "--load-dir",
            str(source),
            "--save-dir",
            str(target),
            "--target-plan",
            str(plan),
        ]
    )


def assert_same_checkpoint(directory: pathlib.Path, weights: dict, optimizer: dict) -> None:
    config, state = load_model_state(directory)
    assert config == CONFIG and sorted(state) == sorted(weights)
    for name, value in state.items():
        assert torch.equal(value, weights[name]), name
    saved = load_train_state(directory)["optimizer"]["state"]
    assert sorted(saved) == sorted(optimizer)
    for name, entry in saved.items():
        assert float(entry["step"]) == float(optimizer[name]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], optimizer[name][key]), (name, key)


def test_reshard_round_trips_through_plans(tmp_path: pathlib.Path, single) -> None:
    source, weights, optimizer = single
    tp2xpp2 = plan_json(tmp_path / "a.json", [(2, (0, 2), [0, 1]), (2, (2, 4), [2, 3])])
    pp3 = plan_json(tmp_path / "b.json", [(2, (0, 1), [0, 1]), (1, (1, 3), [2]), (1, (3, 4), [3])])
    dp2 = plan_json(
        tmp_path / "c.json",
        [(1, (0, 3), [0]), (1, (3, 4), [1])],
        [(1, (0, 3), [2]), (1, (3, 4), [3])],
    )
    one = plan_json(tmp_path / "d.json", [(1, (0, 4), [0])])
    chain = [(tp2xpp2, 4), (pp3, 4), (dp2, 4), (one, 1)]
    previous = source
    for index, (plan, world) in enumerate(chain):
        target = tmp_path / f"out{index}"
        reshard(previous, target, plan)
        metadata = load_checkpoint_metadata(target)
        assert metadata["iteration"] == 1 and metadata["num_model_shards"] == world
        assert metadata["sharded"]["plan"] == json.loads(plan.read_text())
        assert_same_checkpoint(target, weights, optimizer)
        previous = target

    # A single-process run resumes from a plan's checkpoint exactly as from its own.
    results = []
    for directory in (source, tmp_path / "out0"):
        _, state = load_model_state(directory)
        model = build_model(CONFIG, seed=11)
        model.load_state_dict(state)
        opt = build_optimizer(model, OptimizerConfig())
        progress = restore_train_state(load_train_state(directory), opt)
        train_step(model, opt, progress.iteration + 1)
        results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for name, value in results[0].items():
        assert torch.equal(value, results[1][name]), name


def test_hf_export_from_a_plan_checkpoint(tmp_path: pathlib.Path, single) -> None:
    source, _, _ = single
    plan = plan_json(tmp_path / "p.json", [(2, (0, 1), [0, 1]), (1, (1, 3), [2]), (1, (3, 4), [3])])
    reshard(source, tmp_path / "planned", plan)
    for name, directory in (("from_single", source), ("from_plan", tmp_path / "planned")):
        convert_checkpoint.main(
            [
                "--target-format",
                "hf",
                "--load-dir",
                str(directory),
                "--save-dir",
                str(tmp_path / name),
            ]
        )
    a = load_file(str(tmp_path / "from_single" / "model.safetensors"))
    b = load_file(str(tmp_path / "from_plan" / "model.safetensors"))
    assert sorted(a) == sorted(b) and "lm_head.weight" in a
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(
    "case,message",
    [
        ("no_plan", "needs --target-plan"),
        ("missing_plan", "not found"),
        ("bad_tp", "tp=3"),
        ("missing_load", "does not exist"),
        ("dtype", "--dtype applies to --mode convert only"),
        ("no_format", "needs --target-format"),
    ],
)
def test_user_errors(tmp_path: pathlib.Path, single, case: str, message: str) -> None:
    source, _, _ = single
    good = plan_json(tmp_path / "good.json", [(2, (0, 4), [0, 1])])
    bad = plan_json(tmp_path / "bad.json", [(3, (0, 4), [0, 1, 2])])
    args = {
        "no_plan": ["--mode", "reshard", "--load-dir", str(source)],
        "missing_plan": [
            "--mode",
            "reshard",
            "--load-dir",
            str(source),
            "--target-plan",
            str(tmp_path / "none.json"),
        ],
        "bad_tp": ["--mode", "reshard", "--load-dir", str(source), "--target-plan", str(bad)],
        "missing_load": [
            "--mode",
            "reshard",
            "--load-dir",
            str(tmp_path / "nothing"),
            "--target-plan",
            str(good),
        ],
        "dtype": [
            "--mode",
            "reshard",
            "--load-dir",
            str(source),
            "--target-plan",
            str(good),
            "--dtype",
            "bf16",
        ],
        "no_format": ["--load-dir", str(source)],
    }[case]
    with pytest.raises(UserError, match=message):
        convert_checkpoint.main([*args, "--save-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "iter_0000001").exists()


@pytest.mark.slow  # a process start or a 768-device chart: several seconds
def test_cli_reshard_error_is_one_line_exit_2(tmp_path: pathlib.Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--mode",
            "reshard",
            "--load-dir",
            str(tmp_path / "missing"),
            "--save-dir",
            str(tmp_path / "o"),
            "--target-plan",
            str(tmp_path / "p.json"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1
