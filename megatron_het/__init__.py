"""megatron_het: Megatron-style Llama pretraining on clusters that mix accelerator types."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from megatron_het.model.llama import LlamaModel


def load_pretrained(
    checkpoint_dir: str, iteration: int | None = None, map_location: Any = "cpu"
) -> LlamaModel:
    """Load a trained model for single-process use.

    ``checkpoint_dir`` is a ``--save`` directory (the latest iteration is used unless
    ``iteration`` is given) or one ``iter_XXXXXXX`` directory inside it. Returns a
    :class:`~megatron_het.model.llama.LlamaModel` in eval mode whose ``forward(tokens[B, S])``
    returns logits ``[B, S, vocab]``.
    """
    from megatron_het.checkpoint.pretrained import load_pretrained as _load

    return _load(checkpoint_dir, iteration=iteration, map_location=map_location)
