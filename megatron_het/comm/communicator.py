"""``UnifiedCommunicator``: the one entry point the rest of the project uses to communicate.

It is built after ``torch.distributed`` is initialised (by the launcher; this module never reads
argv or the environment) from the accelerator kind of every rank. It owns ``world`` (all ranks)
and makes further :class:`UnifiedGroup` objects with :meth:`new_group`. Rank, world size,
barrier and point-to-point transfers over the world are exposed here too, so no other module
needs to call ``torch.distributed`` directly.
"""

from __future__ import annotations

import datetime
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_het.comm.direct import choose_direct_backend
from megatron_het.comm.groups import UnifiedGroup
from megatron_het.comm.layout import GroupLayout
from megatron_het.comm.p2p import P2PHandle, P2POp
from megatron_het.comm.pending import device_timeout
from megatron_het.comm.relay import Bridge
from megatron_het.comm.wire import WireHooks
from megatron_het.errors import UserError
from megatron_het.trace.recorder import Recorder

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def native_backend_available(backend: str) -> bool:
    """Whether this torch build can create groups of ``backend``."""
    if backend == "gloo":
        return dist.is_gloo_available()
    if backend == "nccl":  # also RCCL: ROCm builds of torch expose it as "nccl"
        return dist.is_nccl_available()
    return backend.upper() in dist.Backend._plugins or hasattr(dist.Backend, backend.upper())


def validate_kinds(
    rank_kinds: Sequence[str],
    native_backends: Mapping[str, str],
    device_types: Mapping[str, str],
    world_size: int,
) -> None:
    """Raise UserError when the kinds do not describe this world."""
    if len(rank_kinds) != world_size:
        raise UserError(
            f"the cluster describes {len(rank_kinds)} ranks but {world_size} were "
            f"launched; launch {len(rank_kinds)} processes or fix the cluster file"
        )
    for kind in dict.fromkeys(rank_kinds):
        if kind not in native_backends or kind not in device_types:
            raise UserError(
                f"accelerator kind {kind!r} has no native backend or device type; "
                "add it to the cluster's accelerator table"
            )


def _new_group_takes_device() -> bool:
    return "device_id" in inspect.signature(dist.new_group).parameters


class UnifiedCommunicator:
    """Collectives and transfers over ranks of mixed accelerator types.

    ``rank_kinds[r]`` is the accelerator kind of global rank r; ``native_backends[kind]`` and
    ``device_types[kind]`` give its backend ("nccl", "hccl", "gloo") and device type ("cuda",
    "npu", "cpu"); ``collective_libraries[kind]`` (optional) the library behind the backend
    ("nccl", "rccl"), which tells a CUDA build's NCCL from a ROCm build's RCCL. ``bridge`` is
    "relay" (host staging + gloo) or "direct": one backend group spans every kind;
    ``direct_backend`` names it, or None chooses the native backend all kinds share
    (:func:`~megatron_het.comm.direct.choose_direct_backend`; a UserError when there is none).
    Every backend group is created with ``timeout``; an operation whose peer
    died or hung raises :class:`~megatron_het.comm.faults.CommError` after it. ``debug`` checks
    shapes and dtypes across ranks before every collective. ``wire_hooks`` give every backend
    link that spans several kinds a wire it books its transfers on (see ``comm/wire.py``; CPU
    emulation uses it to slow an emulated bridge); None: links run at their backend's speed.

    Construction is collective over all ranks (it builds ``world``).
    """

    def __init__(
        self,
        rank_kinds: Sequence[str],
        native_backends: Mapping[str, str],
        device_types: Mapping[str, str],
        bridge: str = "relay",
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        debug: bool = False,
        direct_backend: str | None = None,
        wire_hooks: WireHooks | None = None,
        collective_libraries: Mapping[str, str] | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed before building the communicator")
        validate_kinds(rank_kinds, native_backends, device_types, dist.get_world_size())
        self.rank_kinds = tuple(rank_kinds)
        self.native_backends = dict(native_backends)
        self.device_types = dict(device_types)
        if bridge == "direct" and direct_backend is None:
            direct_backend = choose_direct_backend(
                self.rank_kinds, self.native_backends, self.device_types, collective_libraries
            )
        host_only = all(self.device_types[k] == "cpu" for k in self.rank_kinds)
        self.bridge = Bridge(bridge, direct_backend or "gloo", wire_hooks, host_only=host_only)
        self.timeout = timeout
        self.debug = debug
        self._rank = dist.get_rank()
        self._count = 0
        # Off until a profiled window switches it on; every group records into it.
        self.recorder = Recorder()
        self.world = self.new_group(range(len(self.rank_kinds)), name="world")

    @classmethod
    def from_cluster(
        cls,
        cluster: Any,
        bridge: str = "relay",
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        debug: bool = False,
        direct_backend: str | None = None,
        wire_hooks: WireHooks | None = None,
    ) -> UnifiedCommunicator:
        """Build from a ``ClusterSpec`` (its ``rank_map()`` gives every rank's accelerator).

        With ``bridge="direct"`` and no ``direct_backend``, the backend is chosen from the
        accelerators' backends, device types and collective libraries. ``wire_hooks`` as for
        the constructor: links the cluster marks as emulated are slowed only when the caller
        passes the emulation's hooks (:func:`megatron_het.emulation.emulated_links.emulated_wires`).
        """
        infos = sorted(cluster.rank_map(), key=lambda info: info.rank)
        kinds = [info.accelerator.name for info in infos]
        accels = {info.accelerator.name: info.accelerator for info in infos}
        backends = {k: a.native_backend for k, a in accels.items()}
        devices = {k: a.device_type for k, a in accels.items()}
        libraries = {k: a.collective_library for k, a in accels.items()}
        return cls(
            kinds,
            backends,
            devices,
            bridge=bridge,
            timeout=timeout,
            debug=debug,
            direct_backend=direct_backend,
            wire_hooks=wire_hooks,
            collective_libraries=libraries,
        )

    # -- facts -------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self.rank_kinds)

    @property
    def kind(self) -> str:
        """This rank's accelerator kind."""
        return self.rank_kinds[self._rank]

    @property
    def device(self) -> torch.device:
        """The device this rank's tensors live on (``cuda``/``npu`` use the current index)."""
        device_type = self.device_types[self.kind]
        if device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(device_type)

    # -- groups ------------------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int], name: str | None = None) -> UnifiedGroup:
        """A unified group over ``ranks`` (any subset, kinds may mix).

        Collective over ALL ranks, like ``dist.new_group``: every rank must call it, in the same
        order, with the same ranks. Ranks outside get a handle whose operations raise.
        """
        self._count += 1
        name = name or f"group{self._count}"
        layout = GroupLayout.build(list(ranks), self.rank_kinds)
        for kind in layout.kinds:
            backend = self.native_backends[kind]
            if self.rank_kinds[self._rank] == kind and not self._backend_available(backend):
                raise UserError(
                    f"native backend {backend!r} of {kind!r} is not available in "
                    "this torch build; install the vendor's torch build"
                )
        return UnifiedGroup(
            layout,
            self._rank,
            name,
            self.bridge,
            self.native_backends,
            self._new_backend_group,
            self.debug,
            self.recorder,
        )

    def _backend_available(self, backend: str) -> bool:
        return native_backend_available(backend)

    def _new_backend_group(self, ranks: tuple[int, ...], backend: str) -> Any:
        """``dist.new_group`` (collective over all ranks). A member of an NCCL group passes its
        device, where this torch takes one, so the communicator is created right away."""
        kwargs: dict[str, Any] = {}
        if (
            backend == "nccl"
            and self._rank in ranks
            and self.device_types[self.kind] == "cuda"
            and _new_group_takes_device()
            and getattr(dist.group.WORLD, "bound_device_id", None) is None
        ):
            kwargs["device_id"] = self.device
        # A device backend's watchdog is the backstop behind the run's own deadline on its
        # operations (megatron_het.comm.pending), so it gets a little longer.
        timeout = self.timeout if backend == "gloo" else device_timeout(self.timeout)
        return dist.new_group(list(ranks), timeout=timeout, backend=backend, **kwargs)

    def register_torch_backend(self) -> None:
        """Register the "unified" torch.distributed backend with this communicator's settings,
        so ``dist.new_group(ranks, backend="unified")`` (and DDP on it) spans the kinds."""
        from megatron_het.comm.backend import register_unified_backend

        register_unified_backend(
            self.rank_kinds,
            self.native_backends,
            self.bridge.mode,
            self.debug,
            self.bridge.backend,
            self.bridge.wire_hooks,
        )

    # -- world shortcuts ---------------------------------------------------------------------
    def barrier(self) -> None:
        self.world.barrier()

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.world.send(tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.world.recv(tensor, src, tag)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> P2PHandle:
        return self.world.isend(tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> P2PHandle:
        return self.world.irecv(tensor, src, tag)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[P2PHandle]:
        return self.world.batch_isend_irecv(ops)
