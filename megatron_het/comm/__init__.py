"""The unified communicator: collectives and transfers over ranks of mixed accelerator types.

Entry points: :class:`UnifiedCommunicator` (built once after ``torch.distributed`` is
initialised), its :class:`UnifiedGroup` objects, :class:`P2POp` for batched transfers, and
:func:`register_unified_backend` for code written against torch.distributed (DDP), and the
wire hook (:class:`WireHooks`) through which a wire model paces cross-kind links.
"""
from __future__ import annotations

from megatron_het.comm.backend import UnifiedProcessGroup, register_unified_backend
from megatron_het.comm.communicator import UnifiedCommunicator
from megatron_het.comm.faults import CollectiveMismatchError, CommError
from megatron_het.comm.groups import UnifiedGroup
from megatron_het.comm.layout import GroupLayout
from megatron_het.comm.p2p import P2PHandle, P2POp
from megatron_het.comm.wire import Wire, WireHooks

__all__ = ["CollectiveMismatchError", "CommError", "GroupLayout", "P2PHandle", "P2POp",
           "UnifiedCommunicator", "UnifiedGroup", "UnifiedProcessGroup",
           "Wire", "WireHooks", "register_unified_backend"]
