"""The unified communicator: collectives and transfers over ranks of mixed accelerator types.

Entry points: :class:`UnifiedCommunicator` (built once after ``torch.distributed`` is
initialised), its :class:`UnifiedGroup` objects (collectives may be asynchronous and return a
:class:`CollectiveHandle`), :class:`P2POp` for batched transfers, and
:func:`register_unified_backend` for code written against torch.distributed (DDP), the wire
hook (:class:`WireHooks`) through which a wire model paces cross-kind links, and
:func:`choose_direct_backend`, which says which backend a direct bridge would use.
"""

from __future__ import annotations

from megatron_het.comm.async_ops import CollectiveHandle
from megatron_het.comm.backend import UnifiedProcessGroup, register_unified_backend
from megatron_het.comm.communicator import UnifiedCommunicator
from megatron_het.comm.direct import choose_direct_backend
from megatron_het.comm.faults import CollectiveMismatchError, CommError
from megatron_het.comm.groups import UnifiedGroup
from megatron_het.comm.layout import GroupLayout
from megatron_het.comm.p2p import P2PHandle, P2POp
from megatron_het.comm.wire import Wire, WireHooks

__all__ = [
    "CollectiveHandle",
    "CollectiveMismatchError",
    "CommError",
    "GroupLayout",
    "P2PHandle",
    "P2POp",
    "UnifiedCommunicator",
    "UnifiedGroup",
    "UnifiedProcessGroup",
    "Wire",
    "WireHooks",
    "choose_direct_backend",
    "register_unified_backend",
]
