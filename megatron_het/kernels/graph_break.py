"""Functions that a ``torch.compile`` graph must call out to, marked without importing dynamo.

``torch.compiler.disable`` imports ``torch._dynamo`` (about two seconds of CPU) the moment it
decorates, so a module that used it at import time would charge every process, compiling or
not. :func:`graph_break` instead wraps the function in a thin caller that looks the real one up
at each call; :func:`apply_graph_breaks`, run before anything is compiled
(:func:`megatron_het.model.compile.compile_layers`), swaps in the disabled version. Eager calls
pay one dictionary lookup; a compiled graph breaks at the call, as with the decorator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])

# one {"fn": callable} per marked function: the plain function, then its disabled version
_MARKED: list[dict[str, Any]] = []
_applied = False


def graph_break(fn: F) -> F:
    """``fn`` runs outside any compiled graph once :func:`apply_graph_breaks` has run."""
    target = {"fn": fn}
    _MARKED.append(target)
    if _applied:  # marked after the first compilation was set up
        import torch

        target["fn"] = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return target["fn"](*args, **kwargs)

    return cast(F, call)  # functools.wraps keeps fn's signature, which mypy cannot follow


def apply_graph_breaks() -> None:
    """Mark every :func:`graph_break` function with ``torch.compiler.disable`` (once per
    process; imports dynamo)."""
    global _applied
    if _applied:
        return
    import torch

    for target in _MARKED:
        target["fn"] = torch.compiler.disable(target["fn"])
    _applied = True


__all__ = ["apply_graph_breaks", "graph_break"]
