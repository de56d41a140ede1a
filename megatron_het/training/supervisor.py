"""Relaunch a run on the devices that are left: the elastic supervisor of ``tools/elastic_run.py``.

    python tools/elastic_run.py [--max-restarts 3] -- --cluster C.yaml --save DIR ... (the
        flags of pretrain_llama.py)

The supervisor launches ``torchrun --standalone`` on every device of the cluster file (one
host). When a run ends because a peer was lost, its reporting rank has written
``DIR/last_failure.json`` (:func:`write_failure`: the ranks that stopped answering or were
stuck in compute). The supervisor then writes the cluster without those devices
(:func:`~megatron_het.cluster.shrink.without_ranks`) to ``DIR/elastic/cluster_<k>.yaml`` and
relaunches on it with ``--plan auto`` and ``--load DIR``: the run reshards the last committed
checkpoint to the new plan and continues at the same global batch and data position (the
start-up log says what changed). Any other end (success, a user error, a crash with no lost
peer, no restarts left) is the supervisor's exit status.

A launch has one record: the first rank to write one for its job id wins (:func:`write_failure`
claims ``DIR/elastic/records/<job id>`` first), so every supervisor reads the same. Under a
supervisor (``MEGATRON_HET_RECORD_ERRORS=1`` in the ranks' environment) a rank that ends with
an error of its own (a bad flag, a bug, no lost peer) records that too
(:func:`record_own_error`), so the supervisors of a multi-node job stop at once instead of
waiting out the timeout for a lost peer's record that never comes.

A multi-node job runs one supervisor per node of the cluster file (``--node-rank K
--master-addr A --master-port P``; ``DIR`` on a filesystem every node shares, as its
checkpoints need). Each launches its node's torchrun (static rendezvous at ``A:P``, job id
``<job>-<k>`` for launch k) and publishes its own address in ``DIR/elastic/nodes/``. After a
lost peer every supervisor reads the same record (the one of its launch's job id, waiting for
it as long as the run's timeout), works out the same smaller cluster and where each node went
(:func:`~megatron_het.cluster.shrink.shrink`), and relaunches its node at its new node rank,
with the new node 0's address as master and port ``P + k``; a node with no device left ends.
Every relaunch leaves the lost ranks' devices out of the visible devices (:class:`HostDevices`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_het.cluster import ClusterSpec
from megatron_het.cluster.nodes import RankInfo
from megatron_het.cluster.shrink import shrink, without_ranks
from megatron_het.errors import RanksError, UserError
from megatron_het.fileio import write_text_atomically

FAILURE_FILE = "last_failure.json"
# The variable that lists a vendor's visible devices (a lost device is left out of it).
VISIBLE_DEVICES = {
    "nvidia": "CUDA_VISIBLE_DEVICES",
    "amd": "HIP_VISIBLE_DEVICES",
    "huawei": "ASCEND_RT_VISIBLE_DEVICES",
}
PRETRAIN = Path(__file__).resolve().parents[2] / "pretrain_llama.py"
DEFAULT_MAX_RESTARTS = 3
# Set by the supervisors in their ranks' environment: a rank's own error is recorded too.
RECORD_ERRORS_VAR = "MEGATRON_HET_RECORD_ERRORS"


def write_failure(
    save_dir: str | Path,
    iteration: int,
    world_size: int,
    silent: Sequence[int],
    stuck: Sequence[int],
    failed: Sequence[int],
    line: str,
    run_id: str = "",
) -> bool:
    """Record a lost peer for a supervisor (atomically, in ``save_dir``): the ranks lost
    (``silent`` ones stopped answering, ``stuck`` ones stayed in compute), those that failed
    with an error of their own, the world size, the report line and the launcher's job id
    (``run_id``: torchrun's ``--rdzv-id``, which tells the supervisors of a multi-node job
    their own launch's record from an older one). With a ``run_id`` the first record of that
    launch stands: it is linked into place whole as ``elastic/records/<run_id>``, which fails
    for every later one (False: nothing written)."""
    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    record = {
        "iteration": iteration,
        "world_size": world_size,
        "lost_ranks": sorted(set(silent) | set(stuck)),
        "silent": list(silent),
        "stuck": list(stuck),
        "failed": list(failed),
        "line": line,
        "run_id": run_id,
    }
    text = json.dumps(record, indent=1)
    if run_id and not _claim_record(root, run_id, text):
        return False
    write_text_atomically(root / FAILURE_FILE, text)
    return True


def _claim_path(root: Path, run_id: str) -> Path:
    return (
        root
        / "elastic"
        / "records"
        / "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
    )


def _claim_record(root: Path, run_id: str, text: str) -> bool:
    """Put launch ``run_id``'s record in place with its content at once (a hard link of a
    written file, which fails where one exists); False when another came first."""
    path = _claim_path(root, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".claim-")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


def _forget_record(save: str, run_id: str) -> None:
    """Remove an older job's record and claim for ``run_id`` (a job id used again) before
    launching it: no rank of this launch has started yet."""
    stale = read_failure(save)
    if stale is not None and stale.get("run_id") == run_id:
        (Path(save) / FAILURE_FILE).unlink(missing_ok=True)
    _claim_path(Path(save), run_id).unlink(missing_ok=True)


def record_own_error(argv: Sequence[str], environ: Mapping[str, str], error: BaseException) -> bool:
    """Under a supervisor (:data:`RECORD_ERRORS_VAR` set), record that this rank of the
    launch ended with an error of its own: no lost rank, this one failed, its first line (a
    :class:`~megatron_het.errors.RanksError`, which every rank raises alike: the ranks and the
    line it names).
    ``argv`` (pretrain_llama.py's flags) gives ``--save``. Never raises; True if written."""
    from megatron_het.comm.faults import first_line

    save = flag_value(argv, "--save")
    if environ.get(RECORD_ERRORS_VAR) != "1" or not save:
        return False
    try:
        rank, world_size = int(environ.get("RANK", "0")), int(environ.get("WORLD_SIZE", "1"))
        if isinstance(error, RanksError):  # every rank's, naming the ranks it concerns
            failed, line = list(error.ranks) or list(range(world_size)), first_line(error)
        else:
            what = (
                f"exited with status {error.code}"
                if isinstance(error, SystemExit)
                else first_line(error)
            )
            failed, line = [rank], f"rank {rank}: {what}"
        return write_failure(
            save,
            -1,
            world_size,
            [],
            [],
            failed,
            line,
            run_id=environ.get("TORCHELASTIC_RUN_ID", ""),
        )
    except (OSError, ValueError):
        return False


def read_failure(save_dir: str | Path, run_id: str = "") -> dict | None:
    """The record :func:`write_failure` left in ``save_dir`` (None: none); with ``run_id``,
    that launch's own record only."""
    if run_id:
        claim = _claim_path(Path(save_dir), run_id)
        if claim.is_file():
            return json.loads(claim.read_text())
    path = Path(save_dir) / FAILURE_FILE
    record = json.loads(path.read_text()) if path.is_file() else None
    if run_id and record is not None and record.get("run_id") != run_id:
        return None
    return record


def flag_value(flags: Sequence[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``flags`` (the last one; None: absent)."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
    return value


def with_flag(flags: Sequence[str], name: str, value: str) -> list[str]:
    """``flags`` with every ``--name`` dropped and ``--name value`` appended."""
    out: list[str] = []
    skip = False
    for i, flag in enumerate(flags):
        if skip:
            skip = False
            continue
        if flag == name:
            skip = i + 1 < len(flags)
            continue
        if flag.startswith(name + "="):
            continue
        out.append(flag)
    return out + [name, value]


class HostDevices:
    """The devices this host's accelerator ranks run on, in local-rank order, kept across
    relaunches: a relaunch must not put a rank back on the device that was lost, so the lost
    ranks' devices leave the vendor's visible-devices list (``CUDA_VISIBLE_DEVICES``,
    ``HIP_VISIBLE_DEVICES``, ``ASCEND_RT_VISIBLE_DEVICES``) that the relaunch gets. Starts
    from that variable in ``environ`` (else devices 0..n-1). CPU and emulated ranks have no
    device; a host with several vendors' devices is left as it is."""

    def __init__(self, ranks: Sequence[RankInfo], environ: Mapping[str, str]) -> None:
        self.environ = dict(environ)
        devices = self._device_ranks(ranks)
        vendors = {r.accelerator.vendor for r in devices}
        self.var = VISIBLE_DEVICES.get(vendors.pop()) if len(vendors) == 1 else None
        given = self.environ.get(self.var, "") if self.var else ""
        self.ids = given.split(",") if given else [str(i) for i in range(len(devices))]
        self._ranks = [r.rank for r in devices]
        self.changed = False

    @staticmethod
    def _device_ranks(ranks: Sequence[RankInfo]) -> list[RankInfo]:
        return [
            r for r in ranks if r.accelerator.device_type != "cpu" and not r.accelerator.emulated
        ]

    def drop(self, lost: Sequence[int], ranks_after: Sequence[RankInfo]) -> None:
        """Leave out the devices of the ``lost`` ranks (this launch's numbering); the host's
        ranks are ``ranks_after`` from the next launch on."""
        if self.var is None or len(self.ids) < len(self._ranks):
            return
        lost_ranks = set(lost)
        gone = {i for i, rank in enumerate(self._ranks) if rank in lost_ranks}
        self.ids = [d for i, d in enumerate(self.ids) if i not in gone]
        self._ranks = [r.rank for r in self._device_ranks(ranks_after)]
        self.changed = self.changed or bool(gone)

    def env(self) -> dict[str, str]:
        """The environment of the next launch: the given one, the visible devices left, and
        :data:`RECORD_ERRORS_VAR` (its ranks record their own errors)."""
        env = {**self.environ, RECORD_ERRORS_VAR: "1"}
        if self.changed:
            env[self.var] = ",".join(self.ids)
        return env


def torchrun_command(nproc: int, flags: Sequence[str]) -> list[str]:
    """One host's torchrun of pretrain_llama.py on ``nproc`` ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        str(PRETRAIN),
        *flags,
    ]


@dataclass(frozen=True)
class NodeLaunch:
    """This supervisor's node of a multi-node job: its node rank in the cluster file, the
    first launch's master (node 0's address and port), the address other nodes reach this one
    at, and the job id (the same on every node; it names each launch's failure record)."""

    node_rank: int
    master_addr: str
    master_port: int
    node_addr: str
    job_id: str


def node_torchrun_command(
    nnodes: int,
    node_rank: int,
    nproc: int,
    master_addr: str,
    master_port: int,
    run_id: str,
    flags: Sequence[str],
) -> list[str]:
    """One node's torchrun of pretrain_llama.py in a job of ``nnodes`` nodes (static
    rendezvous at ``master_addr:master_port``, node 0's agent serving the store)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node_rank",
        str(node_rank),
        "--nproc_per_node",
        str(nproc),
        "--rdzv_backend",
        "static",
        "--rdzv_id",
        run_id,
        "--master_addr",
        master_addr,
        "--master_port",
        str(master_port),
        str(PRETRAIN),
        *flags,
    ]


def _publish_address(save: str, identity: int, addr: str) -> None:
    root = Path(save) / "elastic" / "nodes"
    root.mkdir(parents=True, exist_ok=True)
    write_text_atomically(
        root / f"node{identity}.json", json.dumps({"node": identity, "addr": addr})
    )


def _address_of(save: str, identity: int) -> str:
    path = Path(save) / "elastic" / "nodes" / f"node{identity}.json"
    if not path.is_file():
        raise UserError(
            f"elastic_run: node {identity} published no address in {path.parent}; "
            "start a supervisor on every node of the cluster file"
        )
    return json.loads(path.read_text())["addr"]


def _wait_for_record(
    save: str,
    run_id: str,
    wait_s: float,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> dict | None:
    """The failure record of launch ``run_id``, waiting up to ``wait_s`` for it (another
    node's rank may report it after this node's run ended); None if none comes."""
    deadline = clock() + wait_s
    while True:
        record = read_failure(save, run_id)
        if record is not None:
            return record
        if clock() >= deadline:
            return None
        sleep(0.5)


def supervise_node(
    flags: Sequence[str],
    node: NodeLaunch,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    launch: Callable[[list[str], dict | None], int] | None = None,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """:func:`supervise` for one node of a multi-node job (module docstring); returns this
    node's last run's exit status."""
    launch = launch or _call
    cluster_path, save = _cluster_and_save(flags)
    cluster = ClusterSpec.load(cluster_path)
    if not 0 <= node.node_rank < cluster.num_nodes:
        raise UserError(
            f"--node-rank {node.node_rank} is not a node of cluster "
            f"{cluster.name} ({cluster.num_nodes} nodes)"
        )
    try:  # how long another node's rank may take to report a loss (the run checks the flag)
        timeout_min = float(flag_value(flags, "--distributed-timeout-minutes") or 10)
    except ValueError:
        timeout_min = 10.0
    wait_s = 60.0 * timeout_min + 30.0
    _publish_address(save, node.node_rank, node.node_addr)
    flags = list(flags)
    identities = list(range(cluster.num_nodes))  # the original node rank of each node now
    index, master = node.node_rank, node.master_addr
    devices = HostDevices(_ranks_of_node(cluster, index), os.environ)
    restarts = 0
    while True:
        run_id = f"{node.job_id}-{restarts}"
        _forget_record(save, run_id)
        status = launch(
            node_torchrun_command(
                cluster.num_nodes,
                index,
                cluster.nodes()[index].nproc,
                master,
                node.master_port + restarts,
                run_id,
                flags,
            ),
            devices.env(),
        )
        if status == 0:
            return status
        say(
            f"elastic_run: launch {run_id} ended with status {status}; waiting up to "
            f"{wait_s:.0f} s for its failure record in {save}"
        )
        failure = _wait_for_record(save, run_id, wait_s, sleep, clock)
        if _stops(failure, status, restarts, max_restarts, say):
            return status
        restarts += 1
        lost = failure["lost_ranks"]
        cluster, placed = shrink(cluster, lost)
        if index not in placed:
            say(
                f"elastic_run: ranks {failure['lost_ranks']} lost; no device of this node "
                f"(node {identities[index]} of the first launch) is left, so it leaves the job"
            )
            return status
        identities = [
            identity
            for _, identity in sorted((new, identities[old]) for old, new in placed.items())
        ]
        index = placed[index]
        devices.drop(lost, _ranks_of_node(cluster, index))
        master = _address_of(save, identities[0])
        flags, path, resume = _relaunch(flags, cluster, save, restarts)
        say(
            f"{_restart_line(failure, restarts, max_restarts, cluster, path)}, this node now "
            f"node {index} of {cluster.num_nodes} with {cluster.nodes()[index].nproc} ranks, "
            f"master {master}:{node.master_port + restarts}, --plan auto"
            + (f", --load {save}" if resume else ", from the start")
        )


def supervise(
    flags: Sequence[str],
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    launch: Callable[[list[str], dict | None], int] | None = None,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> int:
    """Run ``flags`` (pretrain_llama.py's) under torchrun and relaunch on the devices that are
    left after each lost peer, at most ``max_restarts`` times; returns the last run's exit
    status. UserError without ``--cluster`` or ``--save``."""
    launch = launch or _call
    cluster_path, save = _cluster_and_save(flags)
    flags = list(flags)
    cluster = ClusterSpec.load(cluster_path)
    devices = HostDevices(cluster.rank_map(), os.environ)
    restarts = 0
    while True:
        stale = Path(save) / FAILURE_FILE
        if stale.exists():
            stale.unlink()
        status = launch(torchrun_command(cluster.world_size, flags), devices.env())
        failure = read_failure(save)
        if status == 0 or _stops(failure, status, restarts, max_restarts, say):
            return status
        restarts += 1
        cluster = without_ranks(cluster, failure["lost_ranks"])
        devices.drop(failure["lost_ranks"], cluster.rank_map())
        flags, path, resume = _relaunch(flags, cluster, save, restarts)
        say(
            f"{_restart_line(failure, restarts, max_restarts, cluster, path)}, --plan auto"
            + (f", --load {save}" if resume else ", from the start")
        )


def _call(cmd: list[str], env: dict | None) -> int:
    return subprocess.call(cmd, env=env)


def _ranks_of_node(cluster: ClusterSpec, node: int) -> list[RankInfo]:
    return [info for info in cluster.rank_map() if info.node == node]


def _stops(
    failure: dict | None, status: int, restarts: int, max_restarts: int, say: Callable[[str], None]
) -> bool:
    """Whether a run that ended with ``status`` ends the supervision: no lost peer recorded,
    or no restart left (said)."""
    if failure is None:
        return True
    if not failure["lost_ranks"]:
        say(
            f"elastic_run: the run ended with an error of its own ({failure['line']}), "
            f"not a lost peer: no relaunch; exit status {status}"
        )
        return True
    if restarts == max_restarts:
        say(
            f"elastic_run: ranks {failure['lost_ranks']} lost and no restart left "
            f"(--max-restarts {max_restarts}); exit status {status}"
        )
        return True
    return False


def _cluster_and_save(flags: Sequence[str]) -> tuple[str, str]:
    """The run's ``--cluster`` and ``--save`` (UserError when one is missing)."""
    cluster_path, save = flag_value(flags, "--cluster"), flag_value(flags, "--save")
    if cluster_path is None or save is None:
        raise UserError(
            "tools/elastic_run.py needs --cluster (the devices to start on) and "
            "--save (where checkpoints and the failure record go) among the "
            "run's flags"
        )
    return cluster_path, save


def _relaunch(
    flags: Sequence[str], cluster: ClusterSpec, save: str, restarts: int
) -> tuple[list[str], Path, bool]:
    """Write ``cluster`` to ``save/elastic/cluster_<restarts>.yaml`` (atomically: every node's
    supervisor writes the same file) and return the relaunch's flags (that cluster,
    ``--plan auto``, ``--load save`` when a checkpoint is committed), the file and whether
    the run resumes."""
    path = Path(save) / "elastic" / f"cluster_{restarts}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, _yaml(cluster.to_dict()))
    flags = with_flag(with_flag(flags, "--cluster", str(path)), "--plan", "auto")
    resume = _has_checkpoint(save)
    return (with_flag(flags, "--load", save) if resume else flags), path, resume


def _restart_line(
    failure: dict, restarts: int, max_restarts: int, cluster: ClusterSpec, path: Path
) -> str:
    return (
        f"elastic_run: iteration {failure['iteration']}: ranks {failure['lost_ranks']} "
        f"lost ({failure['line']}); restart {restarts} of {max_restarts} on the "
        f"{cluster.world_size} devices left ({path})"
    )


def _has_checkpoint(save: str) -> bool:
    from megatron_het.checkpoint.io import read_latest_iteration

    return read_latest_iteration(save) is not None


def _yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


USAGE = (
    "usage: tools/elastic_run.py [--max-restarts N] [--node-rank K --master-addr A "
    "--master-port P [--node-addr B] [--job-id J]] -- <pretrain_llama.py flags>"
)


def main(argv: Sequence[str], environ: dict | None = None) -> int:
    """``[--max-restarts N] [--node-rank K --master-addr A --master-port P [--node-addr B]
    [--job-id J]] -- FLAGS``: :func:`supervise` FLAGS on this host, or :func:`supervise_node`
    for node K of a multi-node job (``--node-addr`` defaults to this host's name, ``--job-id``
    to $SLURM_JOB_ID, else ``A:P``); the last run's status."""
    import socket

    argv = list(argv)
    environ = dict(os.environ) if environ is None else environ
    if "--" not in argv:
        raise UserError(USAGE)
    split = argv.index("--")
    head, flags = argv[:split], argv[split + 1 :]
    names = (
        "--max-restarts",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--node-addr",
        "--job-id",
    )
    if len(head) % 2 or any(name not in names for name in head[::2]):
        raise UserError(f"unknown supervisor flags {' '.join(head)}; {USAGE}")
    options = dict(zip(head[::2], head[1::2]))
    for name in ("--max-restarts", "--node-rank", "--master-port"):
        if name in options and not options[name].isdigit():
            raise UserError(f"{name} takes a non-negative integer, got {options[name]!r}")
    max_restarts = int(options.get("--max-restarts", DEFAULT_MAX_RESTARTS))
    multi = [name for name in ("--node-rank", "--master-addr", "--master-port") if name in options]
    if not multi:
        if "--node-addr" in options or "--job-id" in options:
            raise UserError(
                "--node-addr and --job-id are for a multi-node job: give "
                "--node-rank, --master-addr and --master-port too"
            )
        return supervise(flags, max_restarts)
    if len(multi) != 3:
        raise UserError(
            "a multi-node job's supervisor needs --node-rank, --master-addr and "
            "--master-port together"
        )
    master_addr, master_port = options["--master-addr"], int(options["--master-port"])
    node = NodeLaunch(
        int(options["--node-rank"]),
        master_addr,
        master_port,
        options.get("--node-addr", socket.gethostname()),
        options.get("--job-id", environ.get("SLURM_JOB_ID") or f"{master_addr}:{master_port}"),
    )
    return supervise_node(flags, node, max_restarts)


__all__ = [
    "FAILURE_FILE",
    "RECORD_ERRORS_VAR",
    "NodeLaunch",
    "flag_value",
    "main",
    "node_torchrun_command",
    "read_failure",
    "record_own_error",
    "supervise",
    "supervise_node",
    "torchrun_command",
    "with_flag",
    "write_failure",
]
