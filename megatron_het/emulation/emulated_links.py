"""Emulated links: cross-kind traffic of a CPU-emulated cluster paced to a modelled link.

On an emulated cluster every rank is a CPU process on one machine, so traffic between kinds
would cross loopback at memory speed. A link the cluster marks ``emulated: true`` gets an
:class:`EmulatedLink` with its bandwidth and latency (:func:`emulated_link`), and
:func:`emulated_wires` turns a cluster's emulated links into the communicator's wire hooks
(:class:`~megatron_het.comm.wire.WireHooks`): every backend link that spans those kinds books
each transfer on an :class:`EmulatedWire`, a per-process virtual clock in front of the link
(transfers queue behind each other, at the link's bandwidth plus its latency), and the rank
waits, when the transfer completes, until the booked finish time.

Approximation: each rank books its own traffic; ranks sharing a node do not share the modelled
bandwidth with each other. Every object here keeps its own counters (no global state) and takes
``clock``/``sleep`` callables so tests can drive it with a fake clock. Everything here is
emulation; its ``repr`` says so.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from typing import Any

from megatron_het.errors import UserError


class EmulatedLink:
    """A link of ``bandwidth_gbps`` GB/s (gigabytes per second) and ``latency_s`` seconds.

    ``delay(nbytes)`` is the modelled transfer time; ``wait(nbytes, elapsed_s)`` sleeps whatever of
    it the real transfer (``elapsed_s``) did not already take, and accounts it.
    """

    def __init__(
        self, bandwidth_gbps: float, latency_s: float, sleep: Callable[[float], Any] = time.sleep
    ) -> None:
        if isinstance(bandwidth_gbps, bool) or not bandwidth_gbps > 0:
            raise UserError(
                f"emulated link: bandwidth_gbps must be positive, got {bandwidth_gbps!r}"
            )
        if isinstance(latency_s, bool) or not latency_s >= 0:
            raise UserError(f"emulated link: latency_s must be zero or more, got {latency_s!r}")
        self.bandwidth_gbps = float(bandwidth_gbps)
        self.latency_s = float(latency_s)
        self._sleep = sleep
        self._transfers = 0
        self._bytes = 0
        self._injected_s = 0.0

    def delay(self, nbytes: int) -> float:
        """Seconds a transfer of ``nbytes`` takes on this link."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return self.latency_s + nbytes / (self.bandwidth_gbps * 1e9)

    def wait(self, nbytes: int, elapsed_s: float = 0.0) -> float:
        """Sleep ``delay(nbytes) - elapsed_s`` (if positive) and return the seconds slept."""
        injected = max(0.0, self.delay(nbytes) - max(0.0, elapsed_s))
        if injected > 0:
            self._sleep(injected)
        self._transfers += 1
        self._bytes += nbytes
        self._injected_s += injected
        return injected

    @property
    def injected_s(self) -> float:
        return self._injected_s

    @property
    def bytes_sent(self) -> int:
        return self._bytes

    @property
    def transfers(self) -> int:
        return self._transfers

    def __repr__(self) -> str:
        return (
            f"EmulatedLink(bandwidth_gbps={self.bandwidth_gbps:g}, "
            f"latency_s={self.latency_s:g}) (emulated)"
        )


def emulated_link(link: Any, sleep: Callable[[float], Any] = time.sleep) -> EmulatedLink:
    """An :class:`EmulatedLink` with the figures of a cluster ``Link`` (its ``bandwidth_gbps``
    and ``latency_s``), e.g. ``cluster.link_between(a, b)`` of an emulated bridge."""
    return EmulatedLink(link.bandwidth_gbps, link.latency_s, sleep=sleep)


def emulated_bridge_links(cluster: Any) -> dict[frozenset[str], EmulatedLink]:
    """The emulated links between kinds of ``cluster`` (``ClusterSpec``; the first rank of each
    kind is the witness), keyed by the pair of kind names; empty when none is emulated."""
    first: dict[str, int] = {}
    for info in sorted(cluster.rank_map(), key=lambda info: info.rank):
        first.setdefault(info.accelerator.name, info.rank)
    links = {}
    for a, b in itertools.combinations(first, 2):
        link = cluster.link_between(first[a], first[b])
        if link.emulated:
            links[frozenset((a, b))] = emulated_link(link)
    return links


class EmulatedWire:
    """Virtual clocks (one per direction) in front of one :class:`EmulatedLink`; a
    :class:`~megatron_het.comm.wire.Wire`."""

    def __init__(self, link: EmulatedLink, clock: Callable[[], float] = time.perf_counter) -> None:
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

    def __repr__(self) -> str:
        return f"EmulatedWire({self.link!r})"


class EmulatedWires:
    """The wire hooks of one process (:class:`~megatron_het.comm.wire.WireHooks`): the wire
    of the slowest emulated link between any two kinds a backend link spans."""

    def __init__(
        self,
        links: Mapping[frozenset[str], EmulatedLink],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.links = dict(links)
        self._clock = clock
        self._wires: dict[int, EmulatedWire] = {}

    def wire_for(self, kinds: frozenset[str]) -> EmulatedWire | None:
        """The wire of the slowest emulated link between two of ``kinds`` (None: no such link)."""
        found = [link for pair, link in self.links.items() if len(pair) == 2 and pair <= kinds]
        if len(kinds) < 2 or not found:
            return None
        slowest = min(found, key=lambda link: (link.bandwidth_gbps, -link.latency_s))
        return self._wires.setdefault(id(slowest), EmulatedWire(slowest, self._clock))

    def describe(self) -> str:
        """The emulated links, e.g. "emu-fast <-> emu-slow 2 GB/s, 50 us" ("" without any)."""
        return "; ".join(
            f"{' <-> '.join(sorted(pair))} {link.bandwidth_gbps:g} GB/s, "
            f"{link.latency_s * 1e6:g} us"
            for pair, link in sorted(self.links.items(), key=lambda item: sorted(item[0]))
        )

    def __repr__(self) -> str:
        return f"EmulatedWires({self.describe() or 'no links'}) (emulated)"


def emulated_wires(cluster: Any) -> EmulatedWires | None:
    """The communicator's wire hooks for ``cluster``'s emulated links; None when it has none
    (then nothing is booked)."""
    links = emulated_bridge_links(cluster)
    return EmulatedWires(links) if links else None


__all__ = [
    "EmulatedLink",
    "EmulatedWire",
    "EmulatedWires",
    "emulated_bridge_links",
    "emulated_link",
    "emulated_wires",
]
