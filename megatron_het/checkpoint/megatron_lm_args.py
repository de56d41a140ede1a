"""Megatron-LM's ``args`` Namespace and our :class:`ModelConfig`, both ways.

Reading checks that ``args`` describes a model we can hold (Llama: RMSNorm, RoPE over the whole
head, SwiGLU, no biases, dense MLP, head dimension hidden / heads) and refuses anything else with
one line naming the file and the feature. Writing gives megatron-core what it needs to rebuild
the model (the fields ``load_args_from_checkpoint`` and ``check_checkpoint_args`` read).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from megatron_het.config import ModelConfig, RopeScaling
from megatron_het.errors import UserError

# Megatron-LM's Llama-3 RoPE scaling takes only a factor; the rest is fixed in its code.
_MEGATRON_ROPE_SCALING = RopeScaling(8.0, 1.0, 4.0, 8192)


def _unsupported(args: argparse.Namespace) -> str | None:
    """The first feature ``args`` turns on that our Llama lacks, or None."""
    get = vars(args).get
    checks = (
        (get("normalization", "LayerNorm") != "RMSNorm", f"normalization={get('normalization')!r}"),
        (bool(get("add_bias_linear", True)), "add_bias_linear (bias terms)"),
        (bool(get("add_qkv_bias")), "add_qkv_bias (QKV bias)"),
        (
            get("position_embedding_type", "learned_absolute") != "rope",
            f"position_embedding_type={get('position_embedding_type')!r} (only rope)",
        ),
        (bool(get("num_experts")), f"num_experts={get('num_experts')} (mixture of experts)"),
        (not get("swiglu", False), "an MLP that is not SwiGLU (swiglu=False)"),
        (float(get("rotary_percent", 1.0) or 1.0) != 1.0, "rotary_percent below 1.0"),
        (bool(get("rotary_interleaved")), "rotary_interleaved"),
        (bool(get("apply_layernorm_1p")), "apply_layernorm_1p"),
        (bool(get("qk_layernorm")), "qk_layernorm"),
        (bool(get("multi_latent_attention")), "multi_latent_attention"),
        (bool(get("mtp_num_layers")), "multi-token prediction layers"),
        (
            get("virtual_pipeline_model_parallel_size") not in (None, 1),
            "a virtual pipeline (virtual_pipeline_model_parallel_size); not supported yet",
        ),
    )
    return next((what for bad, what in checks if bad), None)


def _rope_scaling(args: argparse.Namespace) -> RopeScaling | None:
    if not getattr(args, "use_rope_scaling", False):
        return None
    factor = float(getattr(args, "rope_scaling_factor", 8.0) or 8.0)
    return RopeScaling(
        factor=factor,
        low_freq_factor=_MEGATRON_ROPE_SCALING.low_freq_factor,
        high_freq_factor=_MEGATRON_ROPE_SCALING.high_freq_factor,
        original_max_position_embeddings=_MEGATRON_ROPE_SCALING.original_max_position_embeddings,
    )


def _required(args: argparse.Namespace, name: str, source: str) -> Any:
    value = getattr(args, name, None)
    if value is None:
        raise UserError(f"{source}: its args lack {name}; it is not a megatron-core GPT checkpoint")
    return value


def model_config_from_args(
    args: argparse.Namespace, source: str, tp_size: int, vocab_size: int | None = None
) -> tuple[ModelConfig, int]:
    """(our config, Megatron's padded vocabulary) from a checkpoint's ``args``.

    The true vocabulary is ``vocab_size`` when given, else ``args.vocab_size``, else the padded
    size (its rows are then all kept). Raises UserError naming ``source`` for a model family we
    cannot hold, a head dimension other than hidden / heads, or a TP size that does not divide
    the heads and query groups."""
    what = _unsupported(args)
    if what is not None:
        raise UserError(
            f"{source}: the model uses {what}, which megatron_het cannot hold (a Llama model: "
            "RMSNorm, RoPE, SwiGLU, no biases)"
        )
    hidden = int(_required(args, "hidden_size", source))
    heads = int(_required(args, "num_attention_heads", source))
    groups = int(args.num_query_groups) if getattr(args, "group_query_attention", False) else heads
    kv_channels = getattr(args, "kv_channels", None)
    if kv_channels is not None and int(kv_channels) * heads != hidden:
        raise UserError(
            f"{source}: kv_channels {kv_channels} is not hidden_size / num_attention_heads "
            f"= {hidden // heads}; megatron_het supports only the latter"
        )
    for what, count in (("attention heads", heads), ("query groups", groups)):
        if count % tp_size:
            raise UserError(
                f"{source}: tensor_model_parallel_size {tp_size} does not divide its {count} "
                f"{what}; the checkpoint is inconsistent"
            )
    padded = int(_required(args, "padded_vocab_size", source))
    vocab = vocab_size or getattr(args, "vocab_size", None) or padded
    if vocab > padded:
        raise UserError(
            f"{source}: vocabulary size {vocab} exceeds the padded {padded}; pass the "
            "tokenizer's --vocab-size"
        )
    # Older Megatron-LM called it layernorm_epsilon.
    epsilon = getattr(args, "norm_epsilon", None) or getattr(args, "layernorm_epsilon", None)
    positions = getattr(args, "max_position_embeddings", None) or _required(
        args, "seq_length", source
    )
    cfg = ModelConfig(
        num_layers=int(_required(args, "num_layers", source)),
        hidden_size=hidden,
        ffn_hidden_size=int(_required(args, "ffn_hidden_size", source)),
        num_attention_heads=heads,
        num_query_groups=groups,
        vocab_size=int(vocab),
        max_position_embeddings=int(positions),
        rope_theta=float(getattr(args, "rotary_base", 10000) or 10000),
        rope_scaling=_rope_scaling(args),
        norm_eps=float(epsilon if epsilon is not None else 1e-5),
        tie_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
        init_method_std=float(getattr(args, "init_method_std", 0.02) or 0.02),
        name="megatron",
    )
    return cfg, padded


def rebuild_args(
    cfg: ModelConfig,
    tp_size: int,
    pp_size: int,
    padded_vocab: int,
    divisible_by: int,
    dtype: torch.dtype,
    iteration: int,
) -> argparse.Namespace:
    """The ``args`` Namespace written into every rank file: what megatron-core's
    ``load_args_from_checkpoint`` (``--use-checkpoint-args``) and ``check_checkpoint_args``
    read, plain values only. Raises UserError for RoPE scaling Megatron-LM cannot express."""
    scaling = cfg.rope_scaling
    if scaling is not None and (
        scaling.low_freq_factor,
        scaling.high_freq_factor,
        scaling.original_max_position_embeddings,
    ) != (
        _MEGATRON_ROPE_SCALING.low_freq_factor,
        _MEGATRON_ROPE_SCALING.high_freq_factor,
        _MEGATRON_ROPE_SCALING.original_max_position_embeddings,
    ):
        raise UserError(
            "the model's llama3 RoPE scaling has low/high frequency factors or original "
            "context other than 1, 4 and 8192, which Megatron-LM cannot express"
        )
    return argparse.Namespace(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        group_query_attention=cfg.num_query_groups != cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        seq_length=cfg.max_position_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        position_embedding_type="rope",
        add_position_embedding=False,
        use_rotary_position_embeddings=True,
        rotary_base=int(cfg.rope_theta)
        if cfg.rope_theta == int(cfg.rope_theta)
        else cfg.rope_theta,
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=scaling is not None,
        rope_scaling_factor=scaling.factor if scaling is not None else 8.0,
        normalization="RMSNorm",
        norm_epsilon=cfg.norm_eps,
        apply_layernorm_1p=False,
        swiglu=True,
        squared_relu=False,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=False,
        num_experts=None,
        untie_embeddings_and_output_weights=not cfg.tie_embeddings,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        apply_query_key_layer_scaling=False,
        init_method_std=cfg.init_method_std,
        vocab_size=cfg.vocab_size,
        padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=divisible_by,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        ckpt_format="torch",
        iteration=int(iteration),
    )
