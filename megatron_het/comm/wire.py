"""The wire hook: what a backend link calls per transfer, so a wire model can pace its traffic.

The communicator knows nothing of how a wire is modelled. It takes an optional
:class:`WireHooks` (``UnifiedCommunicator(..., wire_hooks=...)``) and asks it, for every backend
link it builds, for the :class:`Wire` of the accelerator kinds that link spans (None: the link
runs at the backend's own speed). The link then books every operation on that wire before it
starts (:meth:`Wire.book`) and calls what the booking returned once the backend has finished.
CPU emulation plugs in here (:mod:`megatron_het.emulation.emulated_links` slows cross-kind traffic
to an emulated bridge link); without hooks nothing is booked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

# Called once the backend has finished the booked transfer; may block (e.g. to pace the link).
Settle = Callable[[], None]


class Wire(Protocol):
    """The wire of one backend link, booked once per operation."""

    def book(self, nbytes: int, direction: str = "tx") -> Settle:
        """Book a transfer of ``nbytes`` this rank starts now; ``direction`` is "tx" (sent) or
        "rx" (received). Returns what to call once the backend has finished it."""


class WireHooks(Protocol):
    """Gives the wire of a backend link from the accelerator kinds it spans."""

    def wire_for(self, kinds: frozenset[str]) -> Wire | None:
        """The wire of a link over ranks of ``kinds``, or None (no booking)."""


__all__ = ["Settle", "Wire", "WireHooks"]
