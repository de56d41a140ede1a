"""CPU emulation: everything that exists only because accelerator kinds are emulated on CPU.

An emulated kind is a CPU rank with a slowdown factor and an optional memory cap; an emulated
link is a cluster link whose cross-kind traffic is paced to its bandwidth and latency. The
product knows none of it: emulation reaches it through two hooks, the pipeline executor's region
timer (:class:`~megatron_het.pipeline.executor.RegionTimer`, implemented by :class:`Emulator`)
and the communicator's wire hooks (:class:`~megatron_het.comm.wire.WireHooks`, implemented by
:class:`~megatron_het.emulation.emulated_links.EmulatedWires`), and the predictor accepts its model
of ranks sharing a host's cores as an optional rate model
(:class:`~megatron_het.emulation.host_model.SharedHostModel`).

Modules: :mod:`.emulator` (the region timer), :mod:`.links` (emulated links and wires),
:mod:`.host_sharing` / :mod:`.host_measure` / :mod:`.host_model` (ranks sharing a host: figures,
their measurement, the predictor's rate model), :mod:`.device_times` (fixed stage times from a
host profile), :mod:`.memory_caps` (the memory cap checked before a run) and :mod:`.setup`
(:func:`build_emulation`, the one call of a run's composition root). Everything here is
emulation; callers label its results as such.
"""

from __future__ import annotations

from megatron_het.emulation.emulated_links import EmulatedLink, EmulatedWires, emulated_wires
from megatron_het.emulation.emulator import (
    REFERENCE_QUANTILE,
    REFERENCE_WINDOW,
    EmulatedOutOfMemory,
    EmulationStats,
    Emulator,
)
from megatron_het.emulation.host_model import SharedHostModel
from megatron_het.emulation.memory_caps import check_memory_caps
from megatron_het.emulation.rank_emulation import RankEmulation, build_emulation

__all__ = [
    "REFERENCE_QUANTILE",
    "REFERENCE_WINDOW",
    "EmulatedLink",
    "EmulatedOutOfMemory",
    "EmulatedWires",
    "EmulationStats",
    "Emulator",
    "RankEmulation",
    "SharedHostModel",
    "build_emulation",
    "check_memory_caps",
    "emulated_wires",
]
