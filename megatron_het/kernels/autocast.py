"""Autocast queries that work for every device type (autocast exists for only some; asking
about "meta", say, raises) and inside ``torch.compile``'d code.

Whether a device type has autocast at all is a fixed property of the torch build, asked once
per device type and kept: the question is a C function that some torch releases' dynamo cannot
trace (torch 2.11 breaks the graph on ``torch._C._is_autocast_available``), so compiled code
reads the kept answer instead (the common device types are asked at import).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

_AVAILABLE: dict[str, bool] = {
    device_type: torch.amp.is_autocast_available(device_type) for device_type in ("cpu", "cuda")
}


def autocast_available(device_type: str) -> bool:
    """Whether ``device_type`` has autocast in this torch build (kept per device type; inside
    compiled code a device type not asked before counts as without autocast, so
    :func:`~megatron_het.model.compile.compile_layers` asks for the layers' device type first)."""
    known = _AVAILABLE.get(device_type)
    if known is None:
        if torch.compiler.is_compiling():
            return False
        known = _AVAILABLE[device_type] = torch.amp.is_autocast_available(device_type)
    return known


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype when autocast is on for ``device_type``, else None."""
    if not autocast_available(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_off(device_type: str) -> AbstractContextManager[object]:
    """Autocast disabled for ``device_type`` (a no-op context when it is off already)."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)
