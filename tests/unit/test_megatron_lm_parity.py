"""Parity with megatron-core itself (the pinned test dependency, requirements.txt): a GPTModel
built by megatron-core with its local spec, saved in Megatron-LM's legacy layout, converts to a
model of ours with the same logits; ours converted back loads into megatron-core's GPTModel with
``load_state_dict(strict=True)`` and gives the same logits. Megatron-LM's own enums ride in the
saved args, as in a real file.

megatron-core builds a GPTModel on CPU (use_cpu_initialization) in a one-rank gloo world, but
its forward reaches for CUDA in three places that a CPU run never needs; :func:`cpu_forward`
steps around them: the RoPE table (computed here from the module's own frequencies), the
attention-score scratch buffer (given a CPU tensor) and the dropout RNG fork (a no-op in eval).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import types
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (requirements.txt)")
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_het import load_pretrained
from megatron_het.checkpoint.io import save_checkpoint
from megatron_het.checkpoint.megatron_lm import load_rank_file
from megatron_het.config import ModelConfig
from megatron_het.model.llama import build_model
from tools import convert_checkpoint

pytestmark = pytest.mark.slow  # megatron-core takes seconds to import

H, F, NH, NG, LAYERS, VOCAB, PADDED, SEQ = 64, 96, 4, 2, 2, 100, 128, 12
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


@contextlib.contextmanager
def model_parallel(tp: int, pp: int) -> Iterator[None]:
    """megatron-core's model-parallel state at TP ``tp`` x PP ``pp`` over the current world,
    made ready for :func:`cpu_forward`, torn down after."""
    parallel_state.initialize_model_parallel(tp, pp)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda name=None: contextlib.nullcontext()  # dropout is off in eval
    buffers = parallel_state.get_global_memory_buffer().buffer
    buffers[("mpu", torch.float32)] = torch.empty(4 * NH * SEQ * SEQ)
    try:
        yield
    finally:
        del tracker.fork
        buffers.clear()
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def megatron_world():
    """A one-rank gloo world with megatron-core's model-parallel state, torn down after."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with model_parallel(1, 1):
        yield
    if owned:
        dist.destroy_process_group()


def megatron_model(tied: bool) -> GPTModel:
    """This rank's part of the GPTModel at megatron-core's current TP and PP degrees (the
    vocabulary padded to ``PADDED`` x TP, as Megatron-LM pads it)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=H,
        ffn_hidden_size=F,
        num_attention_heads=NH,
        num_query_groups=NG,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=PADDED * tp,
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=10000,
        share_embeddings_and_output_weights=tied,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    return model.eval()


def _cpu_rope(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def cpu_forward(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """megatron-core's logits ``[B, S, Vp]`` on CPU (see the module docstring)."""
    model.rotary_pos_emb.get_emb = types.MethodType(_cpu_rope, model.rotary_pos_emb)
    seq = tokens.shape[1]
    positions = torch.arange(seq).expand_as(tokens)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        return model(tokens, positions, attention_mask=mask)


def megatron_args(tied: bool) -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=LAYERS,
        hidden_size=H,
        ffn_hidden_size=F,
        num_attention_heads=NH,
        group_query_attention=True,
        num_query_groups=NG,
        kv_channels=None,
        seq_length=64,
        max_position_embeddings=64,
        position_embedding_type="rope",
        rotary_base=10000,
        rotary_percent=1.0,
        normalization="RMSNorm",
        norm_epsilon=1e-5,
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not tied,
        vocab_size=VOCAB,
        padded_vocab_size=PADDED,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        params_dtype=torch.float32,
        attention_backend=AttnBackend.auto,
        exit_signal=signal.SIGTERM,
    )


def our_config(tied: bool) -> ModelConfig:
    """Our model of the same shape as :func:`megatron_model`."""
    return ModelConfig(
        num_layers=LAYERS,
        hidden_size=H,
        ffn_hidden_size=F,
        num_attention_heads=NH,
        num_query_groups=NG,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_embeddings=tied,
    )


@pytest.mark.parametrize("tied", [False, True])
def test_megatron_core_to_ours(tmp_path, megatron_world, tied: bool) -> None:
    torch.manual_seed(5)
    model = megatron_model(tied)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    rank_dir = tmp_path / "mlm/iter_0000020/mp_rank_00"
    rank_dir.mkdir(parents=True)
    payload = {
        "args": megatron_args(tied),
        "checkpoint_version": 3.0,
        "iteration": 20,
        "model": model.state_dict_for_save_checkpoint(),
    }
    torch.save(payload, rank_dir / "model_optim_rng.pt")
    (tmp_path / "mlm/latest_checkpointed_iteration.txt").write_text("20")
    convert_checkpoint.main(
        ["--source-format", "megatron", "--target-format", "megatron_het"]
        + ["--load-dir", str(tmp_path / "mlm"), "--save-dir", str(tmp_path / "ours")]
    )
    ours = load_pretrained(str(tmp_path / "ours"))
    assert ours.config.vocab_size == VOCAB and ours.config.tie_embeddings == tied
    with torch.no_grad():
        got = ours(TOKENS)
    want = cpu_forward(model, TOKENS)[..., :VOCAB]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_ours_to_megatron_core(tmp_path, megatron_world) -> None:
    cfg = our_config(tied=False)
    ours = build_model(cfg, seed=11).eval()
    save_checkpoint(tmp_path / "ours", 4, cfg, ours.state_dict())
    convert_checkpoint.main(
        ["--source-format", "megatron_het", "--target-format", "megatron"]
        + ["--load-dir", str(tmp_path / "ours"), "--save-dir", str(tmp_path / "mlm")]
    )
    payload = load_rank_file(tmp_path / "mlm/iter_0000004/mp_rank_00/model_optim_rng.pt")
    assert payload["args"].padded_vocab_size == PADDED
    model = megatron_model(tied=False)
    model.load_state_dict(payload["model"], strict=True)
    with torch.no_grad():
        want = ours(TOKENS)
    got = cpu_forward(model, TOKENS)
    torch.testing.assert_close(got[..., :VOCAB], want, rtol=0, atol=1e-4)
