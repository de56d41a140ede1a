"""torchrun's environment (or a single process) -> the world process group.

The entry point hands :func:`read_launch_env` ``os.environ`` and gets a :class:`LaunchEnv` back;
library code reads no environment variable (a launched CPU rank writes two, to hide the host's
GPUs from itself: :func:`select_local_device`). A single process gets a world of one rank in this
process (:func:`init_world` without an env), so it runs the same trainer as a launched job.
Everything after the world group is built goes through the unified communicator.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_het.comm.faults import first_line
from megatron_het.errors import PeerFailure, RanksError, UserError
from megatron_het.perf.measure_procs import HIDING_VARIABLES

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the launched job (torchrun's variables)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    restart_count: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT: which launch of the job
    local_world_size: int = 0  # torchrun's LOCAL_WORLD_SIZE: ranks on this node (0: unknown)
    run_id: str = ""  # torchrun's TORCHELASTIC_RUN_ID (--rdzv-id): which job ("": none given)
    gloo_socket_ifname: str = ""  # GLOO_SOCKET_IFNAME: the interface gloo listens on ("": unset)
    agent_store: bool = False  # TORCHELASTIC_USE_AGENT_STORE: torchrun's agent serves the store
    use_libuv: bool = True  # USE_LIBUV (torch.distributed's): the store's server runs on libuv

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def launched_by_torchrun(environ: Mapping[str, str]) -> bool:
    """True when ``environ`` carries a launcher's rank variables (RANK and WORLD_SIZE)."""
    return "RANK" in environ and "WORLD_SIZE" in environ


def read_launch_env(environ: Mapping[str, str]) -> LaunchEnv:
    """Parse RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (UserError if absent),
    and torchrun's TORCHELASTIC_RESTART_COUNT, LOCAL_WORLD_SIZE, TORCHELASTIC_RUN_ID and
    TORCHELASTIC_USE_AGENT_STORE, gloo's GLOO_SOCKET_IFNAME and torch's USE_LIBUV where set."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [name for name in names if not environ.get(name)]
    if missing:
        raise UserError(
            f"{', '.join(missing)} not set; launch the parallel run with torchrun "
            "(python -m torch.distributed.run --nproc_per_node N pretrain_llama.py "
            "...) or use --dry-run"
        )
    try:
        values = {name: int(environ[name]) for name in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        local_rank = int(environ.get("LOCAL_RANK", values["RANK"]))
    except ValueError:
        raise UserError(
            "RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers; launch with torchrun"
        ) from None
    if not 0 < values["MASTER_PORT"] < 2**16:
        raise UserError(f"MASTER_PORT {values['MASTER_PORT']} is not a TCP port (1-65535)")
    if not 0 <= values["RANK"] < values["WORLD_SIZE"]:
        raise UserError(
            f"RANK {values['RANK']} is outside WORLD_SIZE {values['WORLD_SIZE']}; "
            "launch with torchrun"
        )
    return LaunchEnv(
        values["RANK"],
        values["WORLD_SIZE"],
        local_rank,
        environ["MASTER_ADDR"],
        values["MASTER_PORT"],
        _optional_int(environ, "TORCHELASTIC_RESTART_COUNT"),
        _optional_int(environ, "LOCAL_WORLD_SIZE"),
        environ.get("TORCHELASTIC_RUN_ID", ""),
        environ.get("GLOO_SOCKET_IFNAME", ""),
        environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        environ.get("USE_LIBUV", "1") == "1",
    )


def _optional_int(environ: Mapping[str, str], name: str) -> int:
    """``environ[name]`` as a non-negative integer; 0 where it is absent or not one."""
    try:
        return max(int(environ.get(name, "0") or 0), 0)
    except ValueError:
        return 0


def init_world(
    env: LaunchEnv | None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    device_type: str | None = None,
    device_index: int = 0,
) -> None:
    """Initialise torch.distributed's default (world) group with gloo: over
    ``env.init_method``, or, without an env, a world of this one process (an in-memory store).

    The world group only bootstraps the unified communicator, which builds each kind's native
    groups itself; gloo works for every kind. The rank's local device (visible device
    ``device_index``) is selected first (see :func:`select_local_device`; a "cpu" rank leaves
    torch.cuda alone). Side effect: global
    torch.distributed state; raises RuntimeError when a world is already initialised.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised; train on that world with "
            "megatron_het.training.pretrain_on_world"
        )
    # a single process may be someone's Python session: its GPUs stay visible
    select_local_device(device_type, device_index, hide_gpus=env is not None)
    if env is None:
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    join_world(env, timeout, gloo_address_problem(env))


def join_world(env: LaunchEnv, timeout: datetime.timedelta, problem: str | None) -> None:
    """Join the job's rendezvous, agree at start-up (:func:`agree_at_start`), then build the
    gloo world group.

    Every rank posts ``problem`` (why it cannot take part, e.g. :func:`gloo_address_problem`;
    None when it can) to the rendezvous store and waits for every other rank's (the
    rendezvous itself, within ``timeout``). Where any rank has one, every rank raises the same
    :class:`~megatron_het.errors.RanksError` naming the ranks and their problems (a problem
    of every rank alone), instead of the others waiting out the timeout for a rank that left;
    ranks missing at the timeout are named by every rank.
    Side effect: global torch.distributed state.
    """
    import torch.distributed as dist

    store = _rendezvous_store(env, timeout)
    error = agree_at_start(store, env, problem, timeout)
    if error is not None:
        raise error
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("default_pg", store),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )


def stop_together(env: LaunchEnv, timeout: datetime.timedelta, problem: str) -> RanksError:
    """For a rank that cannot start (``problem``, e.g. a file its node lacks), before the
    world exists: the error every rank stops with (:func:`agree_at_start`), once the others
    have heard of it; the ranks that can start stop with the same one. Where the store cannot
    be reached, this rank's own problem alone."""
    try:
        store = _rendezvous_store(env, timeout)
    except StartupError:
        return _own(env, problem)
    error = agree_at_start(store, env, problem, timeout)
    return error if error is not None else _own(env, problem)


def _rendezvous_store(env: LaunchEnv, timeout: datetime.timedelta) -> Any:
    """The job's rendezvous store: a client of torchrun's agent's store, or, without torchrun,
    one that rank 0 serves. Rank 0 does not wait for the others to connect: they are counted
    at the agreement (:func:`agree_at_start`), which can name the ones missing."""
    import torch.distributed as dist

    serve = env.rank == 0 and not env.agent_store
    try:
        return dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=serve,
            timeout=timeout,
            wait_for_workers=False,
            multi_tenant=serve,
            use_libuv=env.use_libuv,
        )
    except RuntimeError as exc:
        raise _startup_error(env, timeout, first_line(exc)) from None


def _startup_error(env: LaunchEnv, timeout: datetime.timedelta, why: str) -> StartupError:
    return StartupError(
        f"start-up: rank {env.rank} could not join the {env.world_size}-rank rendezvous at "
        f"{env.master_addr}:{env.master_port} within {timeout.total_seconds() / 60:g} min "
        f"({why}); start every rank (torchrun on every node) or raise "
        "--distributed-timeout-minutes"
    )


# How long a rank that is about to stop waits for the others to read the store first: it may
# be served by a rank that stops, or by the agent of a node whose ranks all stop.
_READ_GRACE_S = 10.0
# How long the rank that serves the store (rank 0 without torchrun) stays after the last read.
_SERVER_GRACE_S = 0.5


def agree_at_start(
    store: Any, env: LaunchEnv, problem: str | None, timeout: datetime.timedelta
) -> RanksError | None:
    """Post this rank's start-up ``problem`` (None: none) to ``store`` and wait for every
    rank's; returns None when no rank has one, else the error every rank raises: one line of
    each problem with the ranks that have it ("ranks 8-15: ..."; a problem of every rank
    alone), and those ranks.

    The last rank to arrive, or the first to wait ``timeout`` since it arrived, settles the
    outcome for all (one key, set once): every rank then stops, or goes on, together. Ranks
    missing at the timeout are named in a :class:`StartupError` (in the RanksError, after the
    problems, where there are any). Keys are per job and launch (``env.run_id``,
    ``env.restart_count``, as the launch scripts' static rendezvous and the elastic
    supervisors keep them distinct): torchrun's agent store outlives a launch."""
    own = None if problem is None else first_line(problem)
    try:
        problems, ranks, missing = _agree(store, env, own, timeout)
    except RuntimeError as exc:  # the store went away: its rank or agent stopped
        if own is not None:
            return _own(env, own)
        raise StartupError(
            f"start-up: rank {env.rank} lost the rendezvous store at {env.master_addr}:"
            f"{env.master_port} ({first_line(exc)}); a rank on the store's node stopped, see "
            "its output"
        ) from None
    if problems and missing:
        return RanksError(f"{problems}; rank(s) {missing} had not arrived at the timeout", ranks)
    if missing:
        raise _startup_error(env, timeout, f"rank(s) {missing} had not arrived at the timeout")
    return RanksError(problems, ranks) if problems else None


def _own(env: LaunchEnv, problem: str) -> RanksError:
    """This rank's ``problem`` alone, where the other ranks could not be told."""
    return RanksError(f"rank {env.rank}: {first_line(problem)}", (env.rank,))


def _agree(
    store: Any, env: LaunchEnv, own: str | None, timeout: datetime.timedelta
) -> tuple[str, tuple[int, ...], str]:
    """(the problems line, the ranks with problems, the ranks missing at the timeout) of
    :func:`agree_at_start`; "", (), "" when every rank arrived without a problem."""
    import torch.distributed as dist

    from megatron_het.cluster.cluster import format_ranks

    prefix = f"megatron_het/start/{env.run_id}/{env.restart_count}/"
    if own is not None:
        store.append(prefix + "problems", f"{env.rank}\t{own}\n")
    store.append(prefix + "arrived", f"{env.rank},")
    # The outcome, set once: "all", or "missing:<ranks>" from the first rank to give up; then
    # "settled", whose plain set wakes the waiting ranks on either kind of store server (the
    # one without libuv does not wake them at a compare_set).
    outcome, settled_key = prefix + "outcome", prefix + "settled"
    if store.add(prefix + "count", 1) == env.world_size:
        store.compare_set(outcome, "", "all")
        store.set(settled_key, "1")
    try:
        store.wait([settled_key], timeout)
    except dist.DistStoreError:  # this rank's timeout: give up, unless another settled it
        arrived = {int(r) for r in store.get(prefix + "arrived").decode().split(",") if r}
        missing = [r for r in range(env.world_size) if r not in arrived]
        store.compare_set(outcome, "", f"missing:{format_ranks(missing)}")
        store.set(settled_key, "1")
    settled = store.get(outcome).decode()
    missing_ranks = settled.removeprefix("missing:") if settled != "all" else ""
    problems, with_problems = "", ()
    if store.check([prefix + "problems"]):
        by_line: dict[str, list[int]] = {}
        for entry in store.get(prefix + "problems").decode().splitlines():
            rank, line = entry.split("\t", 1)
            by_line.setdefault(line, []).append(int(rank))
        with_problems = tuple(sorted(r for ranks in by_line.values() for r in ranks))
        if len(by_line) == 1 and len(next(iter(by_line.values()))) == env.world_size:
            problems = next(iter(by_line))  # every rank's: the line alone
        else:
            problems = "; ".join(
                f"{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(sorted(ranks))}: {line}"
                for line, ranks in sorted(by_line.items(), key=lambda item: min(item[1]))
            )
    if problems or missing_ranks:
        arrived_count = int(store.add(prefix + "count", 0))
        _linger(store, prefix + "read", arrived_count, env.rank == 0 and not env.agent_store)
    return problems, with_problems, missing_ranks


def _linger(store: Any, key: str, ranks: int, serves: bool) -> None:
    """Count this rank at ``key`` and wait until ``ranks`` ranks are counted there, at most
    :data:`_READ_GRACE_S` (see there): the rank that completes the count wakes the others. The
    rank that ``serves`` the store then gives their wake-ups time to leave before it exits."""
    try:
        if store.add(key, 1) >= ranks:
            store.set(key + "/done", "1")
        else:
            store.wait([key + "/done"], datetime.timedelta(seconds=_READ_GRACE_S))
    except RuntimeError:
        pass  # the store left with the rank or agent that served it; this rank has read it
    if serves:
        time.sleep(_SERVER_GRACE_S)


def gloo_address_problem(
    env: LaunchEnv,
    resolve: Callable[[str], str] | None = None,
    hostname: Callable[[], str] = socket.gethostname,
) -> str | None:
    """Why gloo could not reach this rank from other nodes, or None.

    Without GLOO_SOCKET_IFNAME gloo listens on the address this host's name resolves to and
    tells the other ranks to connect there. Where /etc/hosts maps the name to a loopback
    address (127.0.1.1 on Debian and Ubuntu), ranks on other nodes would connect to
    themselves and the world would never form; the same when the name does not resolve. Only
    a job over several nodes (LOCAL_WORLD_SIZE below WORLD_SIZE) is affected, and not one
    whose master is given as a loopback address (127.0.0.1, ::1, localhost): its "nodes" all
    run on this host. A master given by name is not looked up: on node 0 it is this host's
    own name, which is what is being checked."""
    if env.gloo_socket_ifname or not 0 < env.local_world_size < env.world_size:
        return None
    if _is_loopback_literal(env.master_addr):
        return None
    resolve = resolve or _first_address
    name = hostname()
    try:
        address = resolve(name)
    except OSError as exc:
        found = f"does not resolve ({exc})"
    else:
        if not ipaddress.ip_address(address).is_loopback:
            return None
        found = f"resolves to the loopback address {address}"
    return (
        f"this host's name {name!r} {found}, where gloo would listen for ranks on the other "
        "nodes; set GLOO_SOCKET_IFNAME to the network interface they reach this node on "
        "(HET_SOCKET_IFNAME in scripts/<mix>/ launch scripts), or fix /etc/hosts"
    )


def _first_address(host: str) -> str:
    """The first address ``host`` resolves to (IPv4 or IPv6), as gloo's lookup finds it."""
    return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])


def _is_loopback_literal(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class StartupError(PeerFailure):
    """Not every rank joined the job's rendezvous within the timeout."""


def connect_store(env: LaunchEnv, timeout: datetime.timedelta) -> Any:
    """A client of the job's rendezvous store (torchrun's agent serves it, or rank 0 without
    torchrun), for the ranks' heartbeats (:mod:`megatron_het.training.peer_watch`)."""
    import torch.distributed as dist

    return dist.TCPStore(
        env.master_addr, env.master_port, is_master=False, timeout=timeout, wait_for_workers=False
    )


def npu_module() -> Any | None:
    """``torch.npu`` when Ascend's torch_npu is importable (importing it registers the module),
    else None."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return None
    import torch

    return getattr(torch, "npu", None)


def local_device_index(device_types: Sequence[str], local_rank: int) -> int:
    """Which of this node's visible devices local rank ``local_rank`` drives: its place among
    the node's ranks of its own device type. ``device_types`` holds the device type of each
    local rank of the node up to this one, in order. The launch scripts expose the node's
    first devices (CUDA_VISIBLE_DEVICES=0,...), so on a node of GPU and CPU ranks the i-th GPU
    rank drives GPU i whichever local ranks the CPU ranks take."""
    mine = device_types[local_rank]
    return sum(1 for kind in device_types[:local_rank] if kind == mine)


def rank_device_index(device_type_of: Callable[[int], str], rank: int, local_rank: int) -> int:
    """:func:`local_device_index` of global ``rank``, ``local_rank`` on its node, where
    ``device_type_of(r)`` is global rank r's device type (its node's ranks are the
    ``local_rank`` before it)."""
    first = max(0, rank - local_rank)
    return local_device_index([device_type_of(r) for r in range(first, rank + 1)], rank - first)


def select_local_device(
    device_type: str | None,
    index: int,
    environ: MutableMapping[str, str] | None = None,
    hide_gpus: bool = True,
) -> None:
    """Make visible device ``index`` (:func:`local_device_index`) this process's current one:
    on a "cuda" rank (CUDA and ROCm) through ``torch.cuda.set_device``, on an "npu" rank
    (Ascend) through ``torch.npu.set_device`` when torch_npu is importable. Nothing when that
    device is not visible (:func:`device_problem` reports it on every rank; two ranks must
    never share a device).

    A "cpu" rank never touches torch.cuda and, with ``hide_gpus`` (a launched rank: the
    process is the rank's for its whole life), hides the host's GPUs from itself: the
    variables of :data:`~megatron_het.perf.measure_procs.HIDING_VARIABLES` set empty in
    ``environ`` (default this process's environment, which the driver reads when first asked,
    so before that; it is then for the rest of the process and its children). So torch's own
    calls on such a rank (``torch.optim``'s step asks the current CUDA stream whether it is
    being captured; autograd starts per-device threads) create no CUDA context on GPU 0 beside
    the GPU ranks'. Nothing for any other device type (None: a run that chose no kind)."""
    if device_type == "cpu":
        if not hide_gpus:
            return
        env = os.environ if environ is None else environ
        for name in HIDING_VARIABLES:
            env[name] = ""
        return
    module = _device_module(device_type)
    if module is not None and index < module.device_count():
        module.set_device(index)


def _device_module(device_type: str | None) -> Any | None:
    if device_type == "cuda":
        import torch

        return torch.cuda
    return npu_module() if device_type == "npu" else None


# A device with less memory than this share of its kind's nominal memory is not that kind (a
# GPU reports a little less than its nominal size: an H200 139.8 of 141, an A100-80G 79.2).
_MEMORY_SHARE = 0.9


def device_problem(spec: Any, index: int = 0, identity: bool = True) -> str | None:
    """Why this process cannot be a rank of kind ``spec`` (an AcceleratorSpec) driving visible
    device ``index`` (:func:`local_device_index`), or None. ``identity=False`` leaves out the
    device's model and memory (a run without a cluster file, whose kind was taken from this
    device by its name: :func:`local_accelerator`).

    Checks what would otherwise hang or fail deep inside a backend, or run a plan made for
    other hardware: a GPU kind with no GPU visible, an AMD kind on a CUDA build of torch or an
    NVIDIA kind on a ROCm build (NCCL and RCCL ranks in one kind's group never connect), an
    Ascend kind without torch_npu, fewer devices visible than the node's ranks of the kind
    (ranks would share one), and a device that is not the kind: one of the built-in GPU
    models other than the kind's, or less memory than the kind has (nodes started in another
    order than the cluster file's). CPU and emulated kinds always fit. Reads only this
    process's torch build and visible devices."""
    if spec.device_type == "cpu" or spec.emulated:
        return None
    if spec.device_type == "npu":
        module = npu_module()
        if module is None:
            return "torch_npu is not importable here"
        count = module.device_count()
        if count == 0:
            return "no Ascend device is visible"
        return _too_few(index, count, "Ascend devices", "ASCEND_RT_VISIBLE_DEVICES")
    if spec.device_type != "cuda":
        return None
    import torch

    rocm = torch.version.hip is not None
    if spec.vendor == "amd" and not rocm:
        return "an AMD kind on a torch built without ROCm"
    if spec.vendor == "nvidia" and rocm:
        return "an NVIDIA kind on a torch built for ROCm"
    if not torch.cuda.is_available():
        return "no GPU is visible"
    too_few = _too_few(
        index,
        torch.cuda.device_count(),
        "GPUs",
        "HIP_VISIBLE_DEVICES" if rocm else "CUDA_VISIBLE_DEVICES",
    )
    if too_few is not None or not identity:
        return too_few
    name = torch.cuda.get_device_name(index)
    memory_gib = torch.cuda.get_device_properties(index).total_memory / 2**30
    models = gpu_models(name)
    own = gpu_models(spec.name)
    if models and own and not models & own:
        return f"GPU {index} is {name!r}, not kind {spec.name}"
    if memory_gib < _MEMORY_SHARE * spec.memory_gib:
        return (
            f"GPU {index} ({name or 'unnamed'}) has {memory_gib:.1f} GiB, kind {spec.name} "
            f"{spec.memory_gib:g} GiB"
        )
    return None


def _too_few(index: int, count: int, what: str, variable: str) -> str | None:
    if index < count:
        return None
    return (
        f"it is the node's rank {index + 1} of its kind but only {count} {what} are "
        f"visible (set {variable}; under Slurm request the node's devices, e.g. "
        "sbatch --gpus-per-node)"
    )


def gpu_models(name: str) -> set[str]:
    """The built-in GPU models (the accelerator table's kind names without a memory suffix:
    H100, A100, MI300X ...) that a device or kind name names."""
    from megatron_het.cluster.accelerators import AcceleratorRegistry

    flat = name.upper().replace(" ", "").replace("-", "")
    return {
        _model(spec.name)
        for spec in AcceleratorRegistry.builtin()
        if spec.device_type == "cuda" and not spec.emulated and _model(spec.name) in flat
    }


def _model(kind: str) -> str:
    return kind.upper().split("-")[0]


def local_accelerator() -> str:
    """The accelerator kind of this machine's devices for a run without ``--cluster``: the
    built-in kind whose name the first CUDA/ROCm device's name contains, else "cpu". UserError
    for a GPU the accelerator table does not know (describe it in a cluster file)."""
    import torch

    from megatron_het.cluster.accelerators import AcceleratorRegistry

    if not torch.cuda.is_available():
        return "cpu"
    device_name = torch.cuda.get_device_name(0)
    memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    models = gpu_models(device_name)
    matches = [
        spec
        for spec in AcceleratorRegistry.builtin()
        if spec.device_type == "cuda" and _model(spec.name) in models
    ]
    if matches:  # A100-40G or A100-80G: the nearest memory size
        return min(matches, key=lambda spec: abs(spec.memory_gib - memory_gib)).name
    raise UserError(
        f"this machine's GPU {device_name!r} is not in the accelerator table; pass "
        "--cluster with a node group of its kind (see scripts/clusters/)"
    )


def shutdown_world() -> None:
    """Destroy the world group if one is initialised."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
