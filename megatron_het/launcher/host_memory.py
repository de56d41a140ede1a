"""Huge pages for torch's large CPU allocations, asked for by every entry point that trains or
measures.

torch's CPU allocator backs each allocation of 2 MB or more with transparent huge pages when
``THP_MEM_ALLOC_ENABLE=1`` is in the environment at its first such allocation (it reads the
variable once; later changes do nothing). Without it, glibc maps every large block afresh and
the first write to it faults in 4 KB pages one at a time: on a 2-core CPU host, filling a fresh
84 MB tensor took 50-60 ms against 11-13 ms with the variable set, and a fresh 4 MB one 2.3-3.0
ms against 1.2-1.7 ms (docs/benchmarks.md). Activations and gradients are fresh tensors every
iteration, so a CPU run spends that time in every elementwise op. The setting changes where
memory comes from, not what is computed; allocations under 2 MB are untouched, and a kernel
whose transparent huge pages are off (``/sys/kernel/mm/transparent_hugepage/enabled``:
``never``) ignores it.

Entry points call :func:`prefer_huge_pages` with ``os.environ`` before torch allocates (the
variable is inherited by the processes they start); a value the user set, ``0`` included, is
kept.
"""

from __future__ import annotations

from collections.abc import MutableMapping

THP_VARIABLE = "THP_MEM_ALLOC_ENABLE"


def prefer_huge_pages(environ: MutableMapping[str, str]) -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` in ``environ`` unless it is set already; whether huge
    pages are asked for now (the variable is ``1``)."""
    environ.setdefault(THP_VARIABLE, "1")
    return environ[THP_VARIABLE] == "1"
