"""Megatron-LM legacy (--ckpt-format torch) checkpoints through tools/convert_checkpoint.py: our
checkpoint -> Megatron at TP/PP degrees and both namings -> ours again, bitwise; the Megatron
files' names and shapes as megatron-core (0.16) lays them out; and every refusal one line, with
nothing written."""

from __future__ import annotations

import argparse
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_het.checkpoint.io import save_checkpoint
from megatron_het.checkpoint.megatron_lm import load_rank_file
from megatron_het.checkpoint.reader import load_model_state
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.model.llama import build_model
from tools import convert_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[2]
H, F, NH, NG, VOCAB, LAYERS = 64, 96, 4, 2, 100, 4
D = H // NH


def make_config(tied: bool) -> ModelConfig:
    return ModelConfig(
        num_layers=LAYERS,
        hidden_size=H,
        ffn_hidden_size=F,
        num_attention_heads=NH,
        num_query_groups=NG,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rope_theta=500000.0,
        norm_eps=1e-5,
        tie_embeddings=tied,
    )


def save_ours(root: pathlib.Path, tied: bool) -> tuple[pathlib.Path, dict[str, torch.Tensor]]:
    model = build_model(make_config(tied), seed=7)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_checkpoint(root / "ours", 3, model.config, state)
    return root / "ours", state


def to_megatron(src: pathlib.Path, dst: pathlib.Path, *flags: str) -> None:
    convert_checkpoint.main(
        ["--source-format", "megatron_het", "--target-format", "megatron"]
        + ["--load-dir", str(src), "--save-dir", str(dst), *flags]
    )


def from_megatron(src: pathlib.Path, dst: pathlib.Path, *flags: str) -> None:
    convert_checkpoint.main(
        ["--source-format", "megatron", "--target-format", "megatron_het"]
        + ["--load-dir", str(src), "--save-dir", str(dst), *flags]
    )


def expected_rank_layout(tp: int, stage_layers: int, first: bool, last: bool, tied: bool, te: bool):
    """Names and shapes of one rank's ``model`` state dict, as megatron-core 0.16's GPTModel
    (gpt_layer_specs.py local / Transformer Engine spec) lists them; None for _extra_state."""
    vp = -(-VOCAB // (128 * tp)) * 128 * tp  # Megatron's padding: a multiple of 128 * tp
    qkv_rows = (NH + 2 * NG) * D // tp
    layout: dict[str, tuple[int, ...] | None] = {}
    if first:
        layout["embedding.word_embeddings.weight"] = (vp // tp, H)
    for i in range(stage_layers):
        p = f"decoder.layers.{i}."
        if te:
            layout[p + "self_attention.linear_qkv.layer_norm_weight"] = (H,)
            layout[p + "mlp.linear_fc1.layer_norm_weight"] = (H,)
            layout[p + "self_attention.core_attention._extra_state"] = None
        else:
            layout[p + "input_layernorm.weight"] = (H,)
            layout[p + "pre_mlp_layernorm.weight"] = (H,)
        layout[p + "self_attention.linear_qkv.weight"] = (qkv_rows, H)
        layout[p + "self_attention.linear_proj.weight"] = (H, NH * D // tp)
        layout[p + "mlp.linear_fc1.weight"] = (2 * F // tp, H)
        layout[p + "mlp.linear_fc2.weight"] = (H, F // tp)
        for module in ("self_attention.linear_qkv", "self_attention.linear_proj"):
            layout[f"{p}{module}._extra_state"] = None
        for module in ("mlp.linear_fc1", "mlp.linear_fc2"):
            layout[f"{p}{module}._extra_state"] = None
    if last:
        layout["decoder.final_layernorm.weight"] = (H,)
        if not tied or not first:  # a tied model's last stage keeps a copy under PP
            layout["output_layer.weight"] = (vp // tp, H)
        layout["output_layer._extra_state"] = None
    return layout


@pytest.mark.parametrize(
    ("tp", "pp", "naming", "tied"),
    [(1, 1, "local", False), (2, 1, "te", True), (1, 2, "local", True), (2, 2, "te", False)],
)
def test_round_trip_is_bitwise(tmp_path, tp: int, pp: int, naming: str, tied: bool) -> None:
    ours, state = save_ours(tmp_path, tied)
    to_megatron(
        ours,
        tmp_path / "mlm",
        "--target-tensor-parallel-size",
        str(tp),
        "--target-pipeline-parallel-size",
        str(pp),
        "--megatron-naming",
        naming,
    )
    assert (tmp_path / "mlm/latest_checkpointed_iteration.txt").read_text().strip() == "3"
    iteration_dir = tmp_path / "mlm/iter_0000003"
    assert not (iteration_dir / "metadata.json").exists()  # Megatron would take it for torch_dist
    per_stage = LAYERS // pp
    for p in range(pp):
        for t in range(tp):
            name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            payload = load_rank_file(iteration_dir / name / "model_optim_rng.pt")
            assert payload["checkpoint_version"] == 3.0 and payload["iteration"] == 3
            assert payload["args"].tensor_model_parallel_size == tp
            assert payload["args"].padded_vocab_size == -(-VOCAB // (128 * tp)) * 128 * tp
            got = {k: None if v is None else tuple(v.shape) for k, v in payload["model"].items()}
            want = expected_rank_layout(tp, per_stage, p == 0, p == pp - 1, tied, naming == "te")
            assert got == want
            model = payload["model"]
            if p == 0:
                # Megatron's layouts, by construction from our weights: qkv group-major rows,
                # fc1 each rank's gate block then its up block, vocabulary rows by rank.
                qkv = state["layers.0.attention.qkv.weight"]
                rows = qkv.shape[0] // tp
                layer0 = "decoder.layers.0."
                assert torch.equal(
                    model[layer0 + "self_attention.linear_qkv.weight"],
                    qkv[t * rows : (t + 1) * rows],
                )
                block = F // tp
                fc1 = model[layer0 + "mlp.linear_fc1.weight"]
                gate, up = (state[f"layers.0.mlp.{w}.weight"] for w in ("gate", "up"))
                assert torch.equal(fc1[:block], gate[t * block : (t + 1) * block])
                assert torch.equal(fc1[block:], up[t * block : (t + 1) * block])
    from_megatron(tmp_path / "mlm", tmp_path / "back")
    cfg, back = load_model_state(tmp_path / "back")
    assert cfg == make_config(tied).replace(name="megatron")
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def rewrite_files(directory: pathlib.Path, edit) -> None:
    """Apply ``edit(payload)`` to every rank file of a Megatron iteration directory."""
    for path in sorted(directory.glob("mp_rank_*/model_optim_rng.pt")):
        payload = torch.load(path, weights_only=False)
        edit(payload)
        torch.save(payload, path)


def test_reads_what_training_runs_save(tmp_path) -> None:
    """A file with what Megatron-LM's trainer adds (rng state with numpy's, optimizer state,
    an exit signal among the args) and a ``release`` tracker reads."""
    ours, state = save_ours(tmp_path, tied=False)
    to_megatron(ours, tmp_path / "mlm")
    (tmp_path / "mlm/iter_0000003").rename(tmp_path / "mlm/release")
    (tmp_path / "mlm/latest_checkpointed_iteration.txt").write_text("release")

    def as_trained(payload: dict) -> None:
        payload["args"].exit_signal = signal.SIGTERM
        payload["args"].params_dtype = torch.bfloat16
        payload["rng_state"] = [{"np_rng_state": np.random.get_state(), "random_rng_state": (3,)}]
        payload["optimizer"] = {"optimizer": {"state": {0: {"exp_avg": torch.zeros(2)}}}}
        payload["opt_param_scheduler"] = {"num_steps": 12}

    rewrite_files(tmp_path / "mlm/release", as_trained)
    from_megatron(tmp_path / "mlm", tmp_path / "back")
    _, back = load_model_state(tmp_path / "back")
    assert all(torch.equal(back[k], v) for k, v in state.items())


class Planted:
    """Not a type any Megatron-LM file holds."""


def _args(**changes):
    def edit(payload: dict) -> None:
        for key, value in changes.items():
            setattr(payload["args"], key, value)

    return edit


def _add_key(key: str):
    def edit(payload: dict) -> None:
        payload["model"][key] = torch.zeros(H)

    return edit


IMPORT_ERRORS = {
    "bias_args": (_args(add_bias_linear=True), "add_bias_linear"),
    "bias_key": (
        _add_key("decoder.layers.0.self_attention.linear_qkv.bias"),
        "bias terms",
    ),
    "layernorm": (_args(normalization="LayerNorm"), "normalization='LayerNorm'"),
    "layernorm_bias": (
        _add_key("decoder.layers.0.self_attention.linear_qkv.layer_norm_bias"),
        "bias terms",
    ),
    "learned_positions": (
        _args(position_embedding_type="learned_absolute"),
        "position_embedding_type='learned_absolute'",
    ),
    "moe": (_args(num_experts=8), "mixture of experts"),
    "not_swiglu": (_args(swiglu=False), "not SwiGLU"),
    "tp_vs_groups": (_args(tensor_model_parallel_size=4), "does not divide its 2 query groups"),
    "planted_global": (_args(extra=Planted()), "Planted"),
}


@pytest.mark.parametrize("case", sorted(IMPORT_ERRORS))
def test_import_refusals_are_one_line(tmp_path, case: str) -> None:
    ours, _ = save_ours(tmp_path, tied=False)
    to_megatron(ours, tmp_path / "mlm", "--target-tensor-parallel-size", "2")
    edit, words = IMPORT_ERRORS[case]
    rewrite_files(tmp_path / "mlm/iter_0000003", edit)
    with pytest.raises(UserError) as err:
        from_megatron(tmp_path / "mlm", tmp_path / "out")
    assert words in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_missing_torn_and_dist_checkpoints_are_refused(tmp_path) -> None:
    ours, _ = save_ours(tmp_path, tied=True)
    to_megatron(ours, tmp_path / "mlm", "--target-tensor-parallel-size", "2")
    iteration_dir = tmp_path / "mlm/iter_0000003"
    torn = iteration_dir / "mp_rank_01/model_optim_rng.pt"
    torn.write_bytes(torn.read_bytes()[:-4096])
    with pytest.raises(UserError, match="damaged or truncated"):
        from_megatron(tmp_path / "mlm", tmp_path / "out")
    torn.unlink()
    with pytest.raises(UserError, match="is missing"):
        from_megatron(tmp_path / "mlm", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (iteration_dir / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    with pytest.raises(UserError, match="sharded_backend 'zarr'; only torch_dist is supported"):
        from_megatron(tmp_path / "mlm", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--target-tensor-parallel-size", "3"), "does not divide the model's 4 attention heads"),
        (("--target-pipeline-parallel-size", "3"), "does not divide the model's 4 layers"),
        (
            ("--ckpt-format", "torch_dist", "--target-pipeline-parallel-size", "3"),
            "does not divide the model's 4 layers",
        ),
        (("--with-optimizer",), "writes Megatron-LM's torch_dist format only"),
        (("--ckpt-format", "torch_dist", "--with-optimizer"), "holds no optimizer state"),
        (("--use-distributed-optimizer",), "lays out optimizer state; add --with-optimizer"),
    ],
)
def test_export_refusals_write_nothing(tmp_path, flags: tuple[str, ...], words: str) -> None:
    ours, _ = save_ours(tmp_path, tied=False)
    with pytest.raises(UserError, match=words):
        to_megatron(ours, tmp_path / "mlm", *flags)
    assert not (tmp_path / "mlm").exists()


def test_with_optimizer_refusals(tmp_path) -> None:
    ours, _ = save_ours(tmp_path, tied=False)
    to_megatron(ours, tmp_path / "mlm", "--ckpt-format", "torch_dist")
    with pytest.raises(UserError, match="--with-optimizer keeps the float32 main weights"):
        from_megatron(tmp_path / "mlm", tmp_path / "out", "--with-optimizer", "--dtype", "bf16")
    with pytest.raises(UserError, match=r"holds no optimizer state \(saved with --no-save-optim"):
        from_megatron(tmp_path / "mlm", tmp_path / "out", "--with-optimizer")
    with pytest.raises(UserError, match="conversions from or to Megatron-LM"):
        convert_checkpoint.main(
            ["--source-format", "hf", "--target-format", "megatron_het", "--with-optimizer"]
            + ["--load-dir", str(tmp_path), "--save-dir", str(tmp_path / "out")]
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a fresh interpreter importing torch: about 5 s
def test_cli_refusal_is_one_line_exit_2(tmp_path) -> None:
    (tmp_path / "mlm").mkdir()
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools/convert_checkpoint.py"), "--source-format", "megatron"]
        + ["--target-format", "megatron_het", "--load-dir", str(tmp_path / "mlm")]
        + ["--save-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "latest_checkpointed_iteration.txt" in result.stderr
    assert not (tmp_path / "out").exists()


def test_args_namespace_is_plain(tmp_path) -> None:
    """The written args hold plain values only, so any Megatron-LM version unpickles them."""
    ours, _ = save_ours(tmp_path, tied=False)
    to_megatron(ours, tmp_path / "mlm")
    path = tmp_path / "mlm/iter_0000003/mp_rank_00/model_optim_rng.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        payload = torch.load(path, weights_only=True)
    args = payload["args"]
    assert (args.normalization, args.swiglu, args.position_embedding_type) == (
        "RMSNorm",
        True,
        "rope",
    )
    assert (args.num_query_groups, args.group_query_attention, args.kv_channels) == (NG, True, D)
    assert args.add_bias_linear is False and args.untie_embeddings_and_output_weights is True
