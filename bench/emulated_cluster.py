"""The CPU-emulated cluster with its kinds' slowdowns scaled, for the benchmarks (EMULATION);
see :mod:`megatron_het.emulation.dilation`."""

from __future__ import annotations

from megatron_het.emulation.dilation import dilated_cluster

__all__ = ["dilated_cluster"]
