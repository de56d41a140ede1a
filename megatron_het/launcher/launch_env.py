"""torchrun's environment -> :class:`LaunchEnv`: where this process sits in the launched job.

The entry point hands :func:`read_launch_env` ``os.environ`` and gets a :class:`LaunchEnv` back;
library code reads no environment variable. :func:`gloo_address_problem` says, before the
rendezvous, why gloo on this host could not be reached from the other nodes.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from megatron_het.errors import UserError


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
