"""Importing the optional fused-kernel libraries (apex, liger-kernel, flash-attn) safely.

Each library is looked up once, at import of the module that uses it. A library counts as
present only when every module its kernel needs imports: a Python wrapper whose compiled
extension (or Triton) is missing is absent, so the caller falls back to torch instead of
failing at the first call.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

ImportModule = Callable[[str], Any]


def optional_attr(
    module: str,
    attr: str,
    requires: Sequence[str] = (),
    import_module: ImportModule = importlib.import_module,
) -> Any | None:
    """``module.attr``, or None when ``module``, ``attr`` or any module named in ``requires``
    (a compiled extension the wrapper loads lazily, say) cannot be imported.

    ``import_module`` replaces :func:`importlib.import_module` (tests inject fakes). Any
    exception counts as absent: a broken install (wrong CUDA, missing symbols) raises all sorts.
    """
    try:
        found = getattr(import_module(module), attr)
        for extension in requires:
            import_module(extension)
    except Exception:  # absent, or present but unusable here
        return None
    return found
