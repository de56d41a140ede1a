"""Hugging Face Llama interop: config and state-dict conversion (pure functions on dicts) and
the tokenizer files that let ``transformers.AutoTokenizer`` load a run's SentencePiece model.

Name mapping (Hugging Face ``LlamaForCausalLM`` -> megatron_het, see ``model/llama.py``):

    model.embed_tokens.weight                     -> embedding.weight
    model.layers.{i}.input_layernorm.weight       -> layers.{i}.input_norm.weight
    model.layers.{i}.self_attn.{q,k,v}_proj.weight -> layers.{i}.attention.qkv.weight (grouped)
    model.layers.{i}.self_attn.o_proj.weight      -> layers.{i}.attention.proj.weight
    model.layers.{i}.post_attention_layernorm.weight -> layers.{i}.post_attention_norm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight -> layers.{i}.mlp.{gate,up,down}.weight
    model.norm.weight                             -> final_norm.weight
    lm_head.weight                                -> output.weight (untied only)

Both sides use the rotate-half RoPE convention, so q/k rows need no permutation; only the
q, k, v matrices are regrouped into the fused group-major ``qkv`` layout.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from megatron_het.config import ModelConfig, RopeScaling
from megatron_het.errors import UserError

_LAYER_RENAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "self_attn.o_proj.weight": "attention.proj.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
_GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embedding.weight",
    "model.norm.weight": "final_norm.weight",
    "lm_head.weight": "output.weight",
}
_QKV_AND_RENAMES = frozenset(_LAYER_RENAMES) | {f"self_attn.{p}_proj.weight" for p in "qkv"}
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _rope_fields(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either the legacy or the ``rope_parameters`` config layout."""
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise UserError(
            f"Hugging Face config has rope_type {rope_type!r}; only 'default' and "
            f"'llama3' RoPE are supported"
        )
    scaling = RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
    return theta, scaling


def hf_config_to_model_config(hf_config: dict[str, Any]) -> ModelConfig:
    """A :class:`ModelConfig` from a ``LlamaForCausalLM`` ``config.json`` dict.

    Raises UserError for configs this model cannot represent (biases, another activation, a
    head dimension other than hidden / heads, unsupported RoPE types).
    """
    if hf_config.get("model_type", "llama") != "llama":
        raise UserError(
            f"config.json has model_type {hf_config.get('model_type')!r}; only "
            f"'llama' checkpoints can be converted"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf_config.get(flag):
            raise UserError(f"config.json sets {flag}=true; megatron_het Llama has no biases")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise UserError(
            f"config.json has hidden_act {hf_config['hidden_act']!r}; only 'silu' "
            f"(SwiGLU) is supported"
        )
    hidden, heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
    head_dim = hf_config.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise UserError(
            f"config.json has head_dim {head_dim} but hidden_size / "
            f"num_attention_heads = {hidden // heads}; only the latter is supported"
        )
    theta, scaling = _rope_fields(hf_config)
    return ModelConfig(
        num_layers=int(hf_config["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(hf_config["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(hf_config.get("num_key_value_heads") or heads),
        vocab_size=int(hf_config["vocab_size"]),
        max_position_embeddings=int(hf_config.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        init_method_std=float(hf_config.get("initializer_range", 0.02)),
        name=str(hf_config.get("_name_or_path") or "custom"),
    )


def model_config_to_hf_config(
    cfg: ModelConfig, dtype: str = "float32", special_ids: dict[str, int | None] | None = None
) -> dict[str, Any]:
    """A ``config.json`` dict for ``LlamaForCausalLM``.

    RoPE is written both in the legacy keys (``rope_theta``, ``rope_scaling``), which older
    transformers read, and as ``rope_parameters``, which transformers 5 reads. ``dtype`` is
    the weights' dtype name ("float32", "bfloat16", "float16"). ``special_ids``
    (``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``, as :func:`write_hf_tokenizer`
    returns) are added when given, so ``generate`` stops at the tokenizer's end of sequence.
    """
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    rope_scaling = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope_scaling = {
            "rope_type": "llama3",
            "type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
        rope_parameters = {k: v for k, v in rope_scaling.items() if k != "type"}
        rope_parameters["rope_theta"] = cfg.rope_theta
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.init_method_std,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
        **{k: v for k, v in (special_ids or {}).items() if v is not None},
    }


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def write_hf_tokenizer(
    tokenizer_model: str | Path, save_dir: str | Path, vocab_size: int | None = None
) -> dict[str, int | None]:
    """Write a run's SentencePiece ``tokenizer_model`` into ``save_dir`` for transformers.

    transformers converts the model's pieces (BPE or unigram, byte fallback) into
    ``tokenizer.json``; its normalizer, pre-tokenizer and decoder are then set from the
    model's own ``NormalizerSpec`` (:func:`_set_spm_text_pipeline`), so
    ``AutoTokenizer.from_pretrained(save_dir)`` encodes a text to the ids
    ``SentencePieceProcessor.encode`` gives, adding no BOS/EOS, as the training data was
    tokenized, whatever the installed transformers version. ``tokenizer_config.json`` and a
    copy of the ``.model`` go beside it. ``vocab_size`` (the model's) must hold every piece.
    Returns the special ids for ``config.json``. Raises UserError, writing nothing, for a
    missing or unreadable model, one larger than ``vocab_size``, a normalizer option the
    tokenizers library cannot express, or a written tokenizer that encodes a probe text
    differently from SentencePiece (:func:`_check_round_trip`).
    """
    from transformers import PreTrainedTokenizerFast

    from megatron_het.data.tokenizer import SentencePieceTokenizer

    source = SentencePieceTokenizer(str(tokenizer_model))  # validates the file
    if vocab_size is not None and source.vocab_size > vocab_size:
        raise UserError(
            f"tokenizer model {tokenizer_model} has {source.vocab_size} pieces but "
            f"the checkpoint's vocabulary is {vocab_size}; pass the run's own "
            f"--tokenizer-model"
        )
    with tempfile.TemporaryDirectory() as tmp:
        # transformers converts a SentencePiece model it finds as tokenizer.model in a folder.
        shutil.copyfile(tokenizer_model, Path(tmp) / "tokenizer.model")
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp)
    pieces = _set_spm_text_pipeline(tokenizer.backend_tokenizer, source)
    _check_round_trip(tokenizer, source, pieces)
    out = Path(save_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    shutil.copyfile(tokenizer_model, out / "tokenizer.model")
    return {"bos_token_id": source.bos, "eos_token_id": source.eod, "pad_token_id": source.pad}


_SPACE = "\u2581"  # SentencePiece's escaped space


def _set_spm_text_pipeline(backend: Any, source: Any) -> list[str]:
    """Give ``backend`` (a ``tokenizers.Tokenizer``) the normalizer, pre-tokenizer and decoder
    the SentencePiece model of ``source`` (a loaded SentencePieceTokenizer) prescribes in its
    ``NormalizerSpec``; returns the model's ordinary pieces (not control, unknown, byte,
    unused or user-defined ones).

    transformers' conversion builds the vocabulary and merges the same way across versions but
    not the text handling around them: 5.17, for one, drops the dummy prefix and the whitespace
    clean-up, so every first word and repeated space encodes to other ids. Setting these three
    parts from the model file keeps the written tokenizer independent of the installed version.
    """
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    # The generated protobuf module defines its message classes at import time, out of mypy's
    # sight, and ships no stub.
    model_proto: Any = sentencepiece_model_pb2.ModelProto  # type: ignore[attr-defined]
    proto = model_proto()
    proto.ParseFromString(source.model_proto())
    spec = proto.normalizer_spec
    for unsupported, option in (
        (proto.trainer_spec.treat_whitespace_as_suffix, "treat_whitespace_as_suffix"),
        (not spec.escape_whitespaces, "escape_whitespaces=false"),
    ):
        if unsupported:
            raise UserError(
                f"tokenizer model {source.model_path} is trained with {option}, "
                "which the Hugging Face tokenizer cannot reproduce; --no-tokenizer "
                "converts the weights alone"
            )
    steps: list[normalizers.Normalizer] = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:  # strip both ends, collapse runs of spaces
        steps += [
            normalizers.Replace(Regex(r"\A +| +\z"), ""),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    steps.append(normalizers.Replace(" ", _SPACE))
    if spec.add_dummy_prefix:
        # SentencePiece always prepends one; the Metaspace step below does not when the text
        # already starts with an (escaped) space, so that space is doubled here first.
        steps.append(normalizers.Replace(Regex(f"\\A{_SPACE}"), _SPACE * 2))
    backend.normalizer = normalizers.Sequence(steps)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE,
        prepend_scheme="always" if spec.add_dummy_prefix else "never",
        split=False,
    )
    parts: list[decoders.Decoder] = [decoders.Replace(_SPACE, " ")]
    if proto.trainer_spec.byte_fallback:
        parts.append(decoders.ByteFallback())
    parts.append(decoders.Fuse())
    # SentencePiece's decoding drops the text's leading spaces: all of them when it removes
    # extra whitespace (then no piece holds two spaces, so each leading space is a piece it
    # drops), else the one dummy prefix.
    if spec.remove_extra_whitespaces:
        parts.append(decoders.Strip(" ", 1 << 30, 0))
    elif spec.add_dummy_prefix:
        parts.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(parts)
    normal = model_proto.SentencePiece.NORMAL
    return [piece.piece for piece in proto.pieces if piece.type == normal]


def _check_round_trip(tokenizer: Any, source: Any, pieces: list[str]) -> None:
    """Raise UserError unless ``tokenizer`` (transformers) encodes probe texts, some 200 of the
    model's ordinary ``pieces`` spread over its vocabulary among them, to the ids the
    SentencePiece tokenizer ``source`` gives: a tokenizer written wrong would silently change
    every id a converted model sees."""
    import transformers

    step = max(len(pieces) // 200, 1)
    words = " ".join(piece.replace(_SPACE, " ").strip() for piece in pieces[::step])
    for text in (
        "the quick brown fox",
        "  leading, double  and trailing spaces  ",
        "two\nlines\tand a tab",
        "Zürich 42! ÀÉÎ",
        words,
    ):
        got = tokenizer(text, add_special_tokens=False)["input_ids"]
        want = source.tokenize(text)
        if got != want:
            raise UserError(
                f"transformers {transformers.__version__} tokenizes {text[:40]!r} "
                f"to {got[:8]}... but the SentencePiece model to {want[:8]}...; "
                f"the written tokenizer would not match the run's (--no-tokenizer "
                f"converts the weights alone)"
            )


def _group_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Separate q ``[nh*d, H]``, k, v ``[ng*d, H]`` -> grouped qkv ``[(nh+2ng)*d, H]``."""
    ng, d = cfg.num_query_groups, cfg.kv_channels
    hidden = q.shape[1]
    grouped = torch.cat(
        (q.reshape(ng, -1, hidden), k.reshape(ng, d, hidden), v.reshape(ng, d, hidden)), dim=1
    )
    return grouped.reshape(-1, hidden)


def _ungroup_qkv(
    qkv: torch.Tensor, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_group_qkv`; returns contiguous q, k, v."""
    ng, d = cfg.num_query_groups, cfg.kv_channels
    per_group = cfg.num_attention_heads // ng
    grouped = qkv.reshape(ng, (per_group + 2) * d, qkv.shape[1])
    q, k, v = grouped.split((per_group * d, d, d), dim=1)
    return (
        q.reshape(-1, qkv.shape[1]).contiguous(),
        k.reshape(-1, qkv.shape[1]).contiguous(),
        v.reshape(-1, qkv.shape[1]).contiguous(),
    )


def _take(state: dict[str, torch.Tensor], key: str, source: str = "Hugging Face") -> torch.Tensor:
    if key not in state:
        raise UserError(
            f"{source} checkpoint lacks {key}; is it a complete Llama checkpoint "
            f"matching its config?"
        )
    return state[key]


def hf_to_megatron_het_state(
    hf_state: dict[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """Rename and regroup a ``LlamaForCausalLM`` state dict into megatron_het names.

    Tensors keep their dtype; renamed ones are shared with the input, not copied. ``lm_head``
    is dropped for tied models; rotary ``inv_freq`` buffers are ignored. Raises UserError for
    missing or unexpected keys.
    """
    out = {
        "embedding.weight": _take(hf_state, "model.embed_tokens.weight"),
        "final_norm.weight": _take(hf_state, "model.norm.weight"),
    }
    if not cfg.tie_embeddings:
        out["output.weight"] = _take(hf_state, "lm_head.weight")
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        for hf_name, name in _LAYER_RENAMES.items():
            out[f"layers.{i}.{name}"] = _take(hf_state, prefix + hf_name)
        q, k, v = (_take(hf_state, f"{prefix}self_attn.{p}_proj.weight") for p in "qkv")
        out[f"layers.{i}.attention.qkv.weight"] = _group_qkv(q, k, v, cfg)
    _check_no_extra_keys(hf_state, cfg)
    return out


def _check_no_extra_keys(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    for key in hf_state:
        if key in _GLOBAL_RENAMES or key.endswith("rotary_emb.inv_freq"):
            continue
        match = _LAYER_KEY.fullmatch(key)
        if match and int(match.group(1)) < cfg.num_layers and match.group(2) in _QKV_AND_RENAMES:
            continue
        raise UserError(
            f"Hugging Face checkpoint has unexpected tensor {key}; its config.json "
            f"does not describe it (num_hidden_layers={cfg.num_layers})"
        )


def megatron_het_to_hf_state(
    state: dict[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """Rename and split a megatron_het state dict into ``LlamaForCausalLM`` names.

    The result has no shared tensors (``lm_head.weight`` is omitted when tied, as
    ``save_pretrained`` does), so it can be written with ``safetensors.torch.save_file``.
    """

    def take(key: str) -> torch.Tensor:
        return _take(state, key, "megatron_het")

    out = {
        "model.embed_tokens.weight": take("embedding.weight"),
        "model.norm.weight": take("final_norm.weight"),
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = take("output.weight")
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        for hf_name, name in _LAYER_RENAMES.items():
            out[prefix + hf_name] = take(f"layers.{i}.{name}")
        q, k, v = _ungroup_qkv(take(f"layers.{i}.attention.qkv.weight"), cfg)
        out[prefix + "self_attn.q_proj.weight"] = q
        out[prefix + "self_attn.k_proj.weight"] = k
        out[prefix + "self_attn.v_proj.weight"] = v
    return out
