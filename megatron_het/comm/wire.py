"""Emulated bridge wires: cross-type traffic slowed to a modelled link (CPU emulation only).

On an emulated cluster every rank is a CPU process on one machine, so traffic between kinds
would cross loopback at memory speed. When the cluster marks the link between two kinds as
emulated, the communicator gives every backend link that spans those kinds an
:class:`EmulatedWire`: each transfer is booked on a per-process virtual clock (transfers queue
behind each other, at the link's bandwidth plus its latency) and the rank waits, when the
transfer completes, until the booked finish time. The sleeping and its accounting are done by
:class:`megatron_het.emulation.EmulatedLink`.

Approximation: each rank books its own traffic; ranks sharing a node do not share the modelled
bandwidth with each other. Everything here is emulation.
"""
from __future__ import annotations

import time
from typing import Callable, Mapping

from megatron_het.emulation import EmulatedLink

# Kinds pair -> the emulated link between them (absent: not emulated).
BridgeLinks = Mapping[frozenset[str], EmulatedLink]


class EmulatedWire:
    """Virtual clocks (one per direction) in front of one :class:`EmulatedLink`."""

    def __init__(self, link: EmulatedLink, clock: Callable[[], float] = time.perf_counter
                 ) -> None:
        self.link = link
        self._clock = clock
        self._free_at = {"tx": 0.0, "rx": 0.0}

    def book(self, nbytes: int, direction: str = "tx") -> Callable[[], None]:
        """Book a transfer of ``nbytes`` starting now; returns the wait to call once it is done.

        The wire is full duplex: sends ("tx") and receives ("rx") queue separately. Collectives
        book what this rank sends; a ring receives as much at the same time.
        """
        start = max(self._clock(), self._free_at[direction])
        finish = start + self.link.delay(nbytes)
        self._free_at[direction] = finish

        def settle() -> None:
            remaining = finish - self._clock()
            # EmulatedLink sleeps delay - elapsed; pass the elapsed that leaves `remaining`
            self.link.wait(nbytes, elapsed_s=self.link.delay(nbytes) - remaining)

        return settle


class WireSet:
    """The wires of one process, keyed by the set of kinds a backend link spans."""

    def __init__(self, links: BridgeLinks | None) -> None:
        self._links = dict(links or {})
        self._wires: dict[int, EmulatedWire] = {}

    def for_kinds(self, kinds: set[str]) -> EmulatedWire | None:
        """The wire of the slowest emulated link between any two of ``kinds`` (or None)."""
        found = [link for pair, link in self._links.items() if pair <= kinds and len(pair) == 2]
        if len(kinds) < 2 or not found:
            return None
        slowest = min(found, key=lambda link: (link.bandwidth_gbps, -link.latency_s))
        return self._wires.setdefault(id(slowest), EmulatedWire(slowest))
