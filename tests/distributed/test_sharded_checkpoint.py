"""Sharded checkpoints across plans (gloo, 4 forked ranks of two accelerator kinds).

Reference values are FULL tensors computed from the parameter name alone, so every check is
"the loaded slice equals the reference's slice under the loading plan", independent of the code
under test. One launch runs every distributed phase; the parent then checks single-process
loading, offline resharding against the online save, and the crash-before-commit state.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import pathlib
import zlib

import pytest
import torch

from megatron_het.checkpoint import io, sharded
from megatron_het.checkpoint.reader import CheckpointReader, load_model_state, load_train_state
from megatron_het.checkpoint.reshard import take_slice, target_slice, written_names
from megatron_het.checkpoint.sharded import load_sharded, reshard_checkpoint, save_sharded
from megatron_het.comm import UnifiedCommunicator
from megatron_het.config import ModelConfig, OptimizerConfig
from megatron_het.model.llama import build_model
from megatron_het.optim.optimizer import build_optimizer
from megatron_het.optim.parallel_optimizer import build_parallel_optimizer
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.process_groups import build_process_groups
from megatron_het.pipeline.stage import build_stage
from megatron_het.tensor_parallel.sharding import parameter_shape
from megatron_het.training.state import rng_state
from tests.distributed.harness import run_ranks
from tests.reference import restore_train_state

CONFIG = ModelConfig(
    num_layers=4,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=61,
    tie_embeddings=True,
    name="ckpt-tied",
)
ITERATION = 5
STEP = 7


def make_plan(*pipelines: list[tuple[str, int, tuple[int, int], list[int]]]) -> ParallelPlan:
    return ParallelPlan.from_dict(
        {
            "format": "megatron_het.plan/1",
            "micro_batch_size": 1,
            "pipelines": [
                {
                    "micro_batches": 2,
                    "stages": [
                        {"accelerator": kind, "tp": tp, "layers": list(layers), "ranks": ranks}
                        for kind, tp, layers, ranks in stages
                    ],
                }
                for stages in pipelines
            ],
        }
    )


PLAN_A = make_plan([("fast", 2, (0, 2), [0, 1]), ("slow", 2, (2, 4), [2, 3])])
PLAN_B1 = make_plan(
    [("fast", 2, (0, 1), [0, 1]), ("slow", 1, (1, 3), [2]), ("slow", 1, (3, 4), [3])]
)
PLAN_B2 = make_plan(
    [("fast", 1, (0, 2), [0]), ("fast", 1, (2, 4), [1])],
    [("slow", 1, (0, 2), [2]), ("slow", 1, (2, 4), [3])],
)


def reference(name: str, kind: str) -> torch.Tensor:
    """The full reference tensor ``kind`` (param | exp_avg | exp_avg_sq) of ``name``."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{kind}".encode()))
    value = torch.randn(parameter_shape(name, CONFIG), generator=generator)
    return value.abs() if kind == "exp_avg_sq" else value


def box_of(plan: ParallelPlan, rank: int, name: str):
    role = plan.rank_role(rank)
    return target_slice(name, CONFIG, role.stage_plan.tp, role.tp_rank)


def expected_slice(plan: ParallelPlan, rank: int, name: str, kind: str) -> torch.Tensor:
    return take_slice(reference(name, kind), *box_of(plan, rank, name))


def reference_state(plan: ParallelPlan, rank: int, stage: torch.nn.Module) -> dict:
    return {
        n: {
            "step": STEP,
            "exp_avg": expected_slice(plan, rank, n, "exp_avg"),
            "exp_avg_sq": expected_slice(plan, rank, n, "exp_avg_sq"),
        }
        for n, _ in stage.named_parameters()
    }


def check_loaded(
    plan: ParallelPlan, rank: int, stage: torch.nn.Module, optimizer: dict, what: str
) -> None:
    names = sorted(n for n, _ in stage.named_parameters())
    assert sorted(optimizer) == names, what
    for name, param in stage.named_parameters():
        assert torch.equal(param.detach(), expected_slice(plan, rank, name, "param")), (what, name)
        assert optimizer[name]["step"] == STEP
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer[name][key], expected_slice(plan, rank, name, key)), (
                what,
                name,
                key,
            )


def stage_for(comm: UnifiedCommunicator, plan: ParallelPlan, seed: int):
    groups = build_process_groups(comm, plan)
    return groups, build_stage(CONFIG, plan, groups, seed=seed)


def _phases(rank: int, world_size: int, dirs: dict[str, str]) -> dict:
    comm = UnifiedCommunicator(
        ["fast", "fast", "slow", "slow"],
        {"fast": "gloo", "slow": "gloo"},
        {"fast": "cpu", "slow": "cpu"},
        timeout=datetime.timedelta(seconds=60),
    )
    torch.manual_seed(100 + rank)
    train_state = {
        "version": 1,
        "iteration": ITERATION,
        "consumed_samples": 40,
        "lr_schedule": {},
        "rng": rng_state("cpu"),
    }
    _save_resume_and_crash(comm, rank, dirs, train_state)
    _reshard_on_load(comm, rank, dirs, train_state)
    return _real_optimizer(comm, rank, dirs, train_state)


def _save_resume_and_crash(
    comm: UnifiedCommunicator, rank: int, dirs: dict[str, str], train_state: dict
) -> None:
    # Plan A saves the reference values; resume under plan A is bitwise exact.
    groups, stage = stage_for(comm, PLAN_A, seed=1)
    with torch.no_grad():
        for name, param in stage.named_parameters():
            param.copy_(expected_slice(PLAN_A, rank, name, "param"))
    save_sharded(
        dirs["a"],
        ITERATION,
        CONFIG,
        PLAN_A,
        groups,
        stage,
        reference_state(PLAN_A, rank, stage),
        train_state,
        {"note": "plan A"},
    )
    _, fresh = stage_for(comm, PLAN_A, seed=2)
    optimizer, loaded_train = load_sharded(dirs["a"], CONFIG, PLAN_A, groups, fresh)
    check_loaded(PLAN_A, rank, fresh, optimizer, "resume A")
    assert torch.equal(loaded_train["rng"]["torch"], train_state["rng"]["torch"])

    # A crash between writing and committing iteration 6 leaves iteration 5 the latest.
    def crash(*args, **kwargs):
        raise OSError("simulated crash before the commit")

    real_commit, sharded.commit_checkpoint = sharded.commit_checkpoint, crash
    try:
        with pytest.raises((OSError, RuntimeError), match="crash|failed on"):
            save_sharded(
                dirs["a"],
                ITERATION + 1,
                CONFIG,
                PLAN_A,
                groups,
                stage,
                reference_state(PLAN_A, rank, stage),
                train_state,
                {},
            )
    finally:
        sharded.commit_checkpoint = real_commit
    assert io.read_latest_iteration(dirs["a"]) == ITERATION
    assert any(p.name.startswith(".staging") for p in pathlib.Path(dirs["a"]).iterdir())
    _, fresh = stage_for(comm, PLAN_A, seed=2)
    optimizer, _ = load_sharded(dirs["a"], CONFIG, PLAN_A, groups, fresh)
    check_loaded(PLAN_A, rank, fresh, optimizer, "after crash")
    comm.barrier()  # every rank has read iteration 5 before the next save
    save_sharded(
        dirs["a"],
        ITERATION + 1,
        CONFIG,
        PLAN_A,
        groups,
        stage,
        reference_state(PLAN_A, rank, stage),
        train_state,
        {},
    )


def _reshard_on_load(
    comm: UnifiedCommunicator, rank: int, dirs: dict[str, str], train_state: dict
) -> None:
    # Plan B1 (PP3, TP (2, 1, 1), layers (1, 2, 1)) reshards on load, then saves (for offline).
    groups, stage = stage_for(comm, PLAN_B1, seed=3)
    optimizer, loaded_train = load_sharded(dirs["a"], CONFIG, PLAN_B1, groups, stage)
    check_loaded(PLAN_B1, rank, stage, optimizer, "A -> B1")
    save_sharded(dirs["b1"], ITERATION, CONFIG, PLAN_B1, groups, stage, optimizer, loaded_train)

    # Plan B2 (DP2 x PP2, other kinds) from plan A and from a single-process checkpoint; then a
    # save where the DP replicas hold overlapping parts of the optimizer state (as a ZeRO-1
    # partition may): replica 0 names i % 3 != 2, replica 1 names i % 3 != 0.
    groups, stage = stage_for(comm, PLAN_B2, seed=4)
    for source in ("a", "single"):
        optimizer, _ = load_sharded(dirs[source], CONFIG, PLAN_B2, groups, stage)
        check_loaded(PLAN_B2, rank, stage, optimizer, f"{source} -> B2")
    names = [n for n, _ in stage.named_parameters()]
    skip = 2 if groups.dp.rank == 0 else 0
    owned = {n: optimizer[n] for i, n in enumerate(names) if i % 3 != skip}
    save_sharded(dirs["zero"], ITERATION, CONFIG, PLAN_B2, groups, stage, owned, train_state)


def _real_optimizer(
    comm: UnifiedCommunicator, rank: int, dirs: dict[str, str], train_state: dict
) -> dict:
    """The real optimizer: a ZeRO-1 step under B2, saved, resumed under plan A."""
    out: dict = {}
    groups, stage = stage_for(comm, PLAN_B2, seed=5)
    opt = build_parallel_optimizer(stage, groups, OptimizerConfig(lr=1e-2), True)
    for name, param in stage.named_parameters():
        param.grad = expected_slice(PLAN_B2, rank, name, "exp_avg")
    opt.sync_grads()
    opt.clip_and_step(1e-2, 1.0)
    out["b2_state"] = opt.state_dict()
    out["b2_params"] = {n: p.detach().clone() for n, p in stage.named_parameters()}
    save_sharded(dirs["real"], 1, CONFIG, PLAN_B2, groups, stage, out["b2_state"], train_state)
    groups, stage = stage_for(comm, PLAN_A, seed=6)
    opt = build_parallel_optimizer(stage, groups, OptimizerConfig(lr=1e-2), False)
    optimizer, _ = load_sharded(dirs["real"], CONFIG, PLAN_A, groups, stage)
    opt.load_state_dict(optimizer)
    out["a_state"] = opt.state_dict()
    out["a_params"] = {n: p.detach().clone() for n, p in stage.named_parameters()}
    return out


def _single_process_checkpoint(directory: pathlib.Path) -> None:
    model = build_model(CONFIG, seed=0)
    state = {n: reference(n, "param") for n, _ in model.named_parameters()}
    optimizer = {
        "state": {
            n: {
                "step": torch.tensor(float(STEP)),
                "exp_avg": reference(n, "exp_avg"),
                "exp_avg_sq": reference(n, "exp_avg_sq"),
            }
            for n in state
        },
        "param_groups": [],
    }
    io.save_checkpoint(
        directory,
        ITERATION,
        CONFIG,
        state,
        {
            "version": 1,
            "iteration": ITERATION,
            "consumed_samples": 40,
            "lr_schedule": {},
            "optimizer": optimizer,
            "rng": rng_state("cpu"),
        },
    )


def _shard_payloads(directory: pathlib.Path) -> list:
    files = [
        f
        for pattern in ("model_shard_*.pt", "optim_shard_*.pt", "train_state_*.pt")
        for f in sorted(directory.glob(pattern))
    ]
    return [(f.name, io.read_checkpoint_file(f)) for f in files]


def _assert_same_payload(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b), where
        for key in a:
            _assert_same_payload(a[key], b[key], f"{where}/{key}")
    else:
        assert a == b, where


def test_sharded_checkpoints_across_plans(tmp_path: pathlib.Path) -> None:
    dirs = {k: str(tmp_path / k) for k in ("a", "b1", "zero", "single", "real")}
    _single_process_checkpoint(pathlib.Path(dirs["single"]))
    results = run_ranks(_phases, 4, dirs, timeout=120)

    # The save after the crash cleaned up the crashed save's staging directory.
    assert io.read_latest_iteration(dirs["a"]) == ITERATION + 1
    assert not any(p.name.startswith(".") for p in (tmp_path / "a").iterdir())

    # Single-process loading of a plan's checkpoint: full weights and full optimizer state.
    for source in ("a", "b1", "zero"):
        config, state = load_model_state(dirs[source])
        assert config == CONFIG
        assert sorted(state) == sorted(n for n, _ in build_model(CONFIG, 0).named_parameters())
        for name, value in state.items():
            assert torch.equal(value, reference(name, "param")), (source, name)
        train = load_train_state(dirs[source])
        assert train["consumed_samples"] == 40
        for name, entry in train["optimizer"]["state"].items():
            assert float(entry["step"]) == STEP
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(entry[key], reference(name, key)), (source, name, key)
        model = build_model(CONFIG, seed=9)
        model.load_state_dict(state)
        progress = restore_train_state(train, build_optimizer(model, OptimizerConfig()))
        assert progress.consumed_samples == 40
    # A rank reads only the files holding its pieces: layer 3 lives in plan A's stage 1.
    reader = CheckpointReader(tmp_path / "a" / io.iteration_dir_name(ITERATION))
    for name in ("layers.3.mlp.down.weight", "layers.3.input_norm.weight"):
        box = box_of(PLAN_B1, 3, name)
        assert torch.equal(reader.model_slice(name, box), expected_slice(PLAN_B1, 3, name, "param"))
        reader.optimizer_slice(name, box)
    assert reader.opened_files == [("model", 2), ("model", 3), ("optim", 2), ("optim", 3)]
    # ... and hashes only the pieces it reads (both TP halves of layer 3's weights and moments;
    # layer 2's pieces in the same files are never read).
    needed = 3 * sum(
        reference(n, "param").numel() * 4
        for n in ("layers.3.mlp.down.weight", "layers.3.input_norm.weight")
    )
    opened = sum(
        (reader.directory / f"{kind}_{r:05d}.pt").stat().st_size
        for kind in ("model_shard", "optim_shard")
        for r in (2, 3)
    )
    assert reader.stats.verified_bytes == reader.stats.bytes == needed < 0.5 * opened

    # Overlapping ownership still wrote every optimizer state exactly once.
    meta = json.loads((tmp_path / "zero" / "iter_0000005" / "metadata.json").read_text())
    assert all(len(e["pieces"]) == 1 for e in meta["sharded"]["optimizer"].values())
    assert meta["sharded"]["plan"] == PLAN_B2.to_dict()

    # Offline resharding to B1 equals the online B1 save, file by file.
    reshard_checkpoint(dirs["a"], tmp_path / "offline", PLAN_B1, iteration=ITERATION)
    online, offline = tmp_path / "b1" / "iter_0000005", tmp_path / "offline" / "iter_0000005"
    assert [n for n, _ in _shard_payloads(online)] == [n for n, _ in _shard_payloads(offline)]
    for (name, a), (_, b) in zip(_shard_payloads(online), _shard_payloads(offline)):
        _assert_same_payload(a, b, name)
    meta_on, meta_off = (json.loads((d / "metadata.json").read_text()) for d in (online, offline))
    assert meta_on["sharded"] == meta_off["sharded"]
    # Both record every rank's files, with the same bytes.
    assert sorted(meta_on["files"]) == sorted(
        f"{kind}_{rank:05d}.pt"
        for kind in ("model_shard", "optim_shard", "train_state")
        for rank in range(4)
    )
    assert meta_on["files"] == meta_off["files"]
    moments = meta_on["files"]["optim_shard_00002.pt"]["tensors"]  # rank 2: layers 1-2, tp 1
    assert sorted(moments) == sorted(
        f"{n}/{m}"
        for n in written_names(CONFIG, PLAN_B1.rank_role(2).stage_plan, 0)
        for m in ("exp_avg", "exp_avg_sq")
    )
    assert (
        moments["layers.1.mlp.up.weight/exp_avg"]
        == hashlib.sha256(
            reference("layers.1.mlp.up.weight", "exp_avg").numpy().tobytes()
        ).hexdigest()
    )

    # The real optimizer's ZeRO-1 state under B2 (tp 1: full tensors on pipeline 0) resumes
    # under plan A as its slices.
    full_state = {**results[0]["b2_state"], **results[1]["b2_state"]}
    full_params = {**results[0]["b2_params"], **results[1]["b2_params"]}
    assert full_state["layers.0.mlp.up.weight"]["step"] == 1
    for rank in range(4):
        for name, entry in results[rank]["a_state"].items():
            box = box_of(PLAN_A, rank, name)
            assert torch.equal(results[rank]["a_params"][name], take_slice(full_params[name], *box))
            assert entry["step"] == 1
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(entry[key], take_slice(full_state[name][key], *box)), name
