"""Load a saved (or converted) checkpoint as one single-process :class:`LlamaModel`."""

from __future__ import annotations

from typing import Any

import torch

from megatron_het.checkpoint.reader import load_model_state
from megatron_het.errors import UserError
from megatron_het.model.llama import LlamaModel


def load_pretrained(
    checkpoint_dir: str, iteration: int | None = None, map_location: Any = "cpu"
) -> LlamaModel:
    """The full model stored at ``checkpoint_dir``, in eval mode.

    ``checkpoint_dir`` is a ``--save`` directory (latest iteration unless ``iteration`` is
    given) or one ``iter_XXXXXXX`` directory. Tensors are assembled from however many shards the
    saving run wrote; the model takes their dtype and the device of ``map_location``. Raises
    UserError when the checkpoint lacks a tensor the model needs or has one it does not know.
    """
    config, state = load_model_state(checkpoint_dir, iteration=iteration, map_location=map_location)
    with torch.device("meta"):
        model = LlamaModel(config)
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        detail = f"lacks {missing[:3]}" if missing else f"has unknown tensors {unexpected[:3]}"
        raise UserError(
            f"checkpoint {checkpoint_dir} {detail} for a {config.num_layers}-layer "
            f"model; it was not written from this model config"
        )
    for name, tensor in model.state_dict().items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise UserError(
                f"checkpoint tensor {name} has shape {tuple(state[name].shape)} but "
                f"its model config implies {tuple(tensor.shape)}; the checkpoint "
                "is damaged"
            )
    model.load_state_dict(state, assign=True)
    return model.eval()
