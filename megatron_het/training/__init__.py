"""Training: one trainer over (plan, groups) for every run, a single process being the
one-stage, one-rank plan. ``pretrain`` is the entry point; ``pretrain_on_world`` trains on a
world the caller initialised. Names load on first use, so ``pretrain_llama.py --help`` answers
without importing torch."""

from __future__ import annotations

from typing import Any

__all__ = ["StopRequest", "pretrain", "pretrain_on_world"]


def __getattr__(name: str) -> Any:
    if name in ("pretrain", "pretrain_on_world"):
        from megatron_het.training import run

        return getattr(run, name)
    if name == "StopRequest":
        from megatron_het.training.stop import StopRequest

        return StopRequest
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
