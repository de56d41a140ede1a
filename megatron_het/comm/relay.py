"""The bridge between accelerator types.

Two modes:

- ``relay``: a device tensor is copied into a host buffer (pinned where CUDA is present, so the
  copy is a DMA), moved by the CPU backend (gloo over TCP) and copied back onto the device. Works
  between any two vendors, since only host memory and sockets are involved.
- ``direct``: the site has one backend that spans the vendors; tensors go to it unstaged and a
  mixed group's operations run flat on one group of that backend.

On CPU ranks staging is free: a contiguous CPU tensor is its own host buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_het.comm.wire import Wire, WireHooks
from megatron_het.errors import UserError

BRIDGE_MODES = ("relay", "direct")


@dataclass(frozen=True)
class Staged:
    """A host view of a device tensor; ``finish()`` copies received data back to the device."""

    host: torch.Tensor
    device: torch.Tensor

    def finish(self) -> None:
        if self.host is not self.device:
            self.device.copy_(self.host)


class Bridge:
    """How cross-type traffic moves: ``mode`` is "relay" or "direct"; ``backend`` carries it.

    ``wire_hooks`` give the wire that links spanning several kinds book their transfers on (see
    :mod:`megatron_het.comm.wire`; None: no booking)."""

    def __init__(self, mode: str, backend: str = "gloo",
                 wire_hooks: Optional[WireHooks] = None) -> None:
        if mode not in BRIDGE_MODES:
            raise UserError(f"unknown bridge mode {mode!r}; use one of {', '.join(BRIDGE_MODES)}")
        self.mode = mode
        self.backend = backend if mode == "direct" else "gloo"
        self.wire_hooks = wire_hooks

    def wire_for(self, kinds: frozenset[str]) -> Optional[Wire]:
        """The wire of a backend link over ranks of ``kinds`` (None: none, or a single kind)."""
        if self.wire_hooks is None or len(kinds) < 2:
            return None
        return self.wire_hooks.wire_for(kinds)

    @property
    def stages(self) -> bool:
        """True when tensors pass through host memory on their way across types."""
        return self.mode == "relay"

    def stage(self, tensor: torch.Tensor, copy_in: bool = True) -> Staged:
        """Host buffer for ``tensor`` (the tensor itself on CPU or in direct mode).

        ``copy_in=False`` skips copying the device data in (for receive buffers).
        """
        if not self.stages or (tensor.device.type == "cpu" and tensor.is_contiguous()):
            return Staged(tensor, tensor)
        pin = tensor.device.type == "cuda"
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        if copy_in:
            host.copy_(tensor)
        return Staged(host, tensor)

    def then_finish(self, staged: Staged) -> Callable[[], None] | None:
        """Callback that copies a staged receive back to the device, or None when not needed."""
        return None if staged.host is staged.device else staged.finish
