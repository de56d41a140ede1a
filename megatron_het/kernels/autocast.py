"""Autocast queries that work for every device type (autocast exists for only some; asking
about "meta", say, raises)."""
from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype when autocast is on for ``device_type``, else None."""
    if not torch.amp.is_autocast_available(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_off(device_type: str) -> ContextManager[object]:
    """Autocast disabled for ``device_type`` (a no-op context when it is off already)."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)
