"""tools/convert_checkpoint.py both ways, through real files, and load_pretrained."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from megatron_het import load_pretrained  # noqa: E402
from megatron_het.checkpoint.reader import load_model_state  # noqa: E402
from megatron_het.errors import UserError  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "convert_checkpoint.py"
from tools import convert_checkpoint  # noqa: E402

TOKENS = torch.randint(0, 53, (2, 20), generator=torch.Generator().manual_seed(0))


def make_hf(tied: bool) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=53,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=1000.0,
        tie_word_embeddings=tied,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    )
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


@pytest.mark.slow
def test_cli_round_trip_matches_hf(tmp_path: pathlib.Path) -> None:
    hf = make_hf(tied=False)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    with torch.no_grad():
        expected = hf(TOKENS).logits

    done = run_tool(
        "--source-format",
        "hf",
        "--target-format",
        "megatron_het",
        "--load-dir",
        str(tmp_path / "hf"),
        "--save-dir",
        str(tmp_path / "mh"),
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "mh" / "iter_0000000").is_dir()
    model = load_pretrained(str(tmp_path / "mh"))
    assert not model.training
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), expected, atol=1e-4, rtol=1e-4)

    done = run_tool(
        "--source-format",
        "megatron_het",
        "--target-format",
        "hf",
        "--load-dir",
        str(tmp_path / "mh"),
        "--save-dir",
        str(tmp_path / "back"),
    )
    assert done.returncode == 0, done.stderr
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, expected, atol=1e-4, rtol=1e-4)


def test_sharded_tied_input_and_dtype_cast(tmp_path: pathlib.Path) -> None:
    hf = make_hf(tied=True)
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text(hf.config.to_json_string())
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file_name, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(source / file_name))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    convert_checkpoint.main(
        [
            "--source-format",
            "hf",
            "--target-format",
            "megatron_het",
            "--load-dir",
            str(source),
            "--save-dir",
            str(tmp_path / "mh"),
        ]
    )
    model = load_pretrained(str(tmp_path / "mh"), iteration=0)
    assert model.config.tie_embeddings and model.output is None
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS).logits, atol=1e-4, rtol=1e-4)

    convert_checkpoint.main(
        [
            "--source-format",
            "megatron_het",
            "--target-format",
            "hf",
            "--load-dir",
            str(tmp_path / "mh"),
            "--save-dir",
            str(tmp_path / "bf16"),
            "--dtype",
            "bf16",
        ]
    )
    written = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert "lm_head.weight" not in written
    assert {v.dtype for v in written.values()} == {torch.bfloat16}
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    _, original = load_model_state(tmp_path / "mh")
    torch.testing.assert_close(
        written["model.embed_tokens.weight"].float(),
        original["embedding.weight"],
        atol=1e-2,
        rtol=1e-2,
    )


@pytest.mark.parametrize(
    "setup,args,message",
    [
        (
            "nothing",
            ["--source-format", "hf", "--target-format", "megatron_het"],
            "not a directory",
        ),
        ("empty", ["--source-format", "hf", "--target-format", "megatron_het"], "no config.json"),
        ("config", ["--source-format", "hf", "--target-format", "megatron_het"], "safetensors"),
        ("damaged", ["--source-format", "hf", "--target-format", "megatron_het"], "cannot read"),
        ("empty", ["--source-format", "hf", "--target-format", "hf"], "same"),
        ("empty", ["--source-format", "megatron_het", "--target-format", "hf"], "no checkpoint"),
    ],
)
def test_user_errors(tmp_path: pathlib.Path, setup: str, args: list[str], message: str) -> None:
    source = tmp_path / "in"
    if setup != "nothing":
        source.mkdir()
    if setup in ("config", "damaged"):
        (source / "config.json").write_text(make_hf(False).config.to_json_string())
    if setup == "damaged":
        (source / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(UserError, match=message):
        convert_checkpoint.main(
            [*args, "--load-dir", str(source), "--save-dir", str(tmp_path / "out")]
        )


@pytest.mark.slow  # a process start or a 768-device chart: several seconds
def test_cli_user_error_is_one_line_exit_2(tmp_path: pathlib.Path) -> None:
    done = run_tool(
        "--source-format",
        "hf",
        "--target-format",
        "megatron_het",
        "--load-dir",
        str(tmp_path / "missing"),
        "--save-dir",
        str(tmp_path / "o"),
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1
