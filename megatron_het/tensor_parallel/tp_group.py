"""``TPGroup``: what the tensor-parallel layers use of the group they communicate over.

A :class:`~megatron_het.comm.groups.UnifiedGroup` is one; so is a stand-in that skips the
collectives to time a shard's compute alone
(:class:`~megatron_het.perf.measure.shard_cases.ComputeOnlyGroup`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from megatron_het.comm.p2p import P2PHandle, P2POp


class TPGroup(Protocol):
    """The ranks of one TP group; this process is group rank ``rank`` of ``size``.

    The collectives are blocking and in place, as torch.distributed's: ``all_reduce`` over
    the group, ``all_gather_into_tensor`` (``output`` holds every rank's ``input`` in rank
    order), ``reduce_scatter_tensor`` (``input`` holds ``size`` blocks; block i, reduced,
    lands in rank i's ``output``). ``batch_isend_irecv`` starts transfers to and from global
    ranks (``ranks``) and returns their handles (the sequence-parallel rings of
    ``--tp-comm-overlap``).
    """

    @property
    def size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def ranks(self) -> tuple[int, ...]: ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> object: ...

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> object: ...

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum"
    ) -> object: ...

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[P2PHandle]: ...
