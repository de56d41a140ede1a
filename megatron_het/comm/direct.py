"""Which backend a ``direct`` bridge runs on: the one native backend that spans every kind.

A direct bridge hands cross-kind traffic unstaged to a single backend group over ranks of every
kind, so that backend must really connect them. It does when every kind of the world runs the
same native backend, on the same device type, through the same collective library: H100 and
A100 (nccl on cuda, NCCL) share one; H100 and MI300X do not, although both name "nccl" on
"cuda" (a CUDA build of torch links NCCL, a ROCm build links RCCL, and the two cannot form one
communicator); any GPU kind and a CPU kind do not either. Without such a backend the bridge
must relay through host memory (``--bridge relay``).

Pure functions of the kind tables, so the choice is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megatron_het.errors import UserError


def _describe(kind: str, backend: str, device_type: str, library: str) -> str:
    via = backend if library == backend else f"{backend} ({library})"
    return f"{kind} uses {via} on {device_type}"


def spanning_backend(
    rank_kinds: Sequence[str],
    native_backends: Mapping[str, str],
    device_types: Mapping[str, str],
    collective_libraries: Mapping[str, str] | None = None,
) -> str | None:
    """The native backend every kind of ``rank_kinds`` shares, or None when there is none.

    ``collective_libraries[kind]`` names the library behind the backend ("nccl", "rccl");
    kinds missing from it (or no table) count as running the backend's own library.
    """
    libraries = collective_libraries or {}
    seen = {
        (native_backends[k], device_types[k], libraries.get(k, native_backends[k]))
        for k in dict.fromkeys(rank_kinds)
    }
    if len(seen) != 1:
        return None
    return next(iter(seen))[0]


def choose_direct_backend(
    rank_kinds: Sequence[str],
    native_backends: Mapping[str, str],
    device_types: Mapping[str, str],
    collective_libraries: Mapping[str, str] | None = None,
) -> str:
    """The backend of a direct bridge over these kinds; raises a one-line UserError saying to
    use the relay bridge when no backend spans them all (see the module docstring)."""
    backend = spanning_backend(rank_kinds, native_backends, device_types, collective_libraries)
    if backend is not None:
        return backend
    libraries = collective_libraries or {}
    parts, shown = [], set()
    for kind in dict.fromkeys(rank_kinds):
        key = (
            native_backends[kind],
            device_types[kind],
            libraries.get(kind, native_backends[kind]),
        )
        if key not in shown:  # one kind per distinct stack keeps the line short
            shown.add(key)
            parts.append(_describe(kind, *key))
    raise UserError(
        "bridge 'direct' needs one backend that spans every accelerator kind, but "
        f"{' and '.join(parts)}; use --bridge relay"
    )


__all__ = ["choose_direct_backend", "spanning_backend"]
