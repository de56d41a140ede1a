"""Relaunch a run on the devices that are left: the elastic supervisor of ``tools/elastic_run.py``.

    python tools/elastic_run.py [--max-restarts 3] -- --cluster C.yaml --save DIR ... (the
        flags of pretrain_llama.py)

The supervisor launches ``torchrun --standalone`` on every device of the cluster file (one
host). When a run ends because a peer was lost, its reporting rank has written the launch's
failure record (:mod:`~megatron_het.launcher.failure_record`: the ranks that stopped answering
or were stuck in compute). The supervisor then writes the cluster without those devices
(:func:`~megatron_het.launcher.shrink.without_ranks`) to ``DIR/elastic/cluster_<k>.yaml`` and
relaunches on it with ``--plan auto`` and ``--load DIR``: the run reshards the last committed
checkpoint to the new plan and continues at the same global batch and data position (the
start-up log says what changed). Any other end (success, a user error, a crash with no lost
peer, no restarts left) is the supervisor's exit status. Its command line is parsed once into
frozen configs (:mod:`~megatron_het.launcher.supervisor_config`); each launch's command is
built from them.

A multi-node job runs one supervisor per node of the cluster file (``--node-rank K
--master-addr A --master-port P``; ``DIR`` on a filesystem every node shares, as its
checkpoints need). Each launches its node's torchrun (static rendezvous at ``A:P``, job id
``<job>-<k>`` for launch k) and publishes its own address in ``DIR/elastic/nodes/``. After a
lost peer every supervisor reads the same record (the one of its launch's job id, waiting for
it as long as the run's timeout), works out the same smaller cluster and where each node went
(:func:`~megatron_het.launcher.shrink.shrink`), and relaunches its node at its new node rank,
with the new node 0's address as master and port ``P + k``; a node with no device left ends.
Every relaunch leaves the lost ranks' devices out of the visible devices (:class:`HostDevices`).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from megatron_het.cluster import ClusterSpec
from megatron_het.cluster.nodes import RankInfo
from megatron_het.errors import UserError
from megatron_het.fileio import write_text_atomically
from megatron_het.launcher.failure_record import (
    FAILURE_FILE,
    RECORD_ERRORS_VAR,
    forget_record,
    read_failure,
    wait_for_record,
)
from megatron_het.launcher.node_env import VISIBLE_DEVICES
from megatron_het.launcher.shrink import shrink, without_ranks
from megatron_het.launcher.supervisor_config import (
    DEFAULT_MAX_RESTARTS,
    NodeLaunch,
    RunFlags,
    parse_supervisor_args,
)
from megatron_het.launcher.torchrun import TorchrunNode, node_torchrun, standalone_torchrun

PRETRAIN = str(Path(__file__).resolve().parents[2] / "pretrain_llama.py")
# How a launch is run: its command and environment -> its exit status.
Launch = Callable[[list[str], dict], int]


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
        if self.changed and self.var is not None:
            env[self.var] = ",".join(self.ids)
        return env


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


def supervise_node(
    run: RunFlags,
    node: NodeLaunch,
    environ: Mapping[str, str],
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    launch: Launch | None = None,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """:func:`supervise` for one node of a multi-node job (module docstring); ``environ`` is
    this node's environment (its visible devices). Returns this node's last run's exit
    status."""
    launch = launch or _call
    cluster = ClusterSpec.load(run.cluster)
    if not 0 <= node.node_rank < cluster.num_nodes:
        raise UserError(
            f"--node-rank {node.node_rank} is not a node of cluster "
            f"{cluster.name} ({cluster.num_nodes} nodes)"
        )
    # how long another node's rank may take to report a loss (the run checks the flag)
    wait_s = 60.0 * run.timeout_minutes + 30.0
    _publish_address(run.save, node.node_rank, node.node_addr)
    identities = list(range(cluster.num_nodes))  # the original node rank of each node now
    index, master = node.node_rank, node.master_addr
    devices = HostDevices(_ranks_of_node(cluster, index), environ)
    flags, restarts = run.flags, 0
    while True:
        run_id = f"{node.job_id}-{restarts}"
        forget_record(run.save, run_id)
        place = TorchrunNode(
            cluster.num_nodes,
            index,
            cluster.nodes()[index].nproc,
            master,
            node.master_port + restarts,
            run_id,
        )
        status = launch(node_torchrun(sys.executable, place, PRETRAIN, flags), devices.env())
        if status == 0:
            return status
        say(
            f"elastic_run: launch {run_id} ended with status {status}; waiting up to "
            f"{wait_s:.0f} s for its failure record in {run.save}"
        )
        failure = wait_for_record(run.save, run_id, wait_s, sleep, clock)
        if failure is None or _stops(failure, status, restarts, max_restarts, say):
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
        master = _address_of(run.save, identities[0])
        flags, path, resume = _relaunch(run, cluster, restarts)
        say(
            f"{_restart_line(failure, restarts, max_restarts, cluster, path)}, this node now "
            f"node {index} of {cluster.num_nodes} with {cluster.nodes()[index].nproc} ranks, "
            f"master {master}:{node.master_port + restarts}, --plan auto"
            + (f", --load {run.save}" if resume else ", from the start")
        )


def supervise(
    run: RunFlags,
    environ: Mapping[str, str],
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    launch: Launch | None = None,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> int:
    """Run ``run`` under torchrun on every device of its cluster file (this host, whose
    environment is ``environ``) and relaunch on the devices that are left after each lost
    peer, at most ``max_restarts`` times; returns the last run's exit status."""
    launch = launch or _call
    cluster = ClusterSpec.load(run.cluster)
    devices = HostDevices(cluster.rank_map(), environ)
    flags, restarts = run.flags, 0
    while True:
        (Path(run.save) / FAILURE_FILE).unlink(missing_ok=True)
        command = standalone_torchrun(sys.executable, cluster.world_size, PRETRAIN, flags)
        status = launch(command, devices.env())
        failure = read_failure(run.save)
        if status == 0 or failure is None or _stops(failure, status, restarts, max_restarts, say):
            return status
        restarts += 1
        cluster = without_ranks(cluster, failure["lost_ranks"])
        devices.drop(failure["lost_ranks"], cluster.rank_map())
        flags, path, resume = _relaunch(run, cluster, restarts)
        say(
            f"{_restart_line(failure, restarts, max_restarts, cluster, path)}, --plan auto"
            + (f", --load {run.save}" if resume else ", from the start")
        )


def _call(cmd: list[str], env: dict) -> int:
    return subprocess.call(cmd, env=env)


def _ranks_of_node(cluster: ClusterSpec, node: int) -> list[RankInfo]:
    return [info for info in cluster.rank_map() if info.node == node]


def _stops(
    failure: dict, status: int, restarts: int, max_restarts: int, say: Callable[[str], None]
) -> bool:
    """Whether a run that ended with ``status`` and left ``failure`` ends the supervision:
    no lost peer in it (an error of its own), or no restart left (said)."""
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


# Megatron-LM's load flags that leave part of a checkpoint behind: a relaunch that resumes from
# the run's own checkpoints drops them, or it would reset the run's iteration or optimizer.
FIRST_LOAD_ONLY_FLAGS = ("--finetune", "--no-load-optim", "--no-load-rng")


def _relaunch(
    run: RunFlags, cluster: ClusterSpec, restarts: int
) -> tuple[tuple[str, ...], Path, bool]:
    """Write ``cluster`` to ``DIR/elastic/cluster_<restarts>.yaml`` (``DIR``: the run's
    ``--save``; atomically: every node's supervisor writes the same file) and return the
    relaunch's flags, the file and whether the run resumes (a checkpoint is committed)."""
    path = Path(run.save) / "elastic" / f"cluster_{restarts}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, _yaml(cluster.to_dict()))
    resume = _has_checkpoint(run.save)
    # The run's own flags, then the relaunch's: pretrain_llama.py's parser keeps the last
    # value of a flag given twice, so this cluster, --plan auto and --load bind whatever the
    # run's flags said.
    relaunch = ["--cluster", str(path), "--plan", "auto"]
    flags = run.flags
    if resume:
        relaunch += ["--load", run.save]
        # They applied to the checkpoint the run started from; from its own, it resumes whole.
        flags = tuple(flag for flag in flags if flag not in FIRST_LOAD_ONLY_FLAGS)
    return (*flags, *relaunch), path, resume


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


def main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """``tools/elastic_run.py``: parse ``argv`` (:func:`~megatron_het.launcher.
    supervisor_config.parse_supervisor_args`), then :func:`supervise` the run on this host or
    :func:`supervise_node` this node of a multi-node job; the last run's exit status."""
    config = parse_supervisor_args(argv, environ, socket.gethostname())
    if config.node is None:
        return supervise(config.run, environ, config.max_restarts)
    return supervise_node(config.run, config.node, environ, config.max_restarts)
