"""Slurm: the batch step's fan-out to one task per node, and a node task's place in the job.

In the batch step (sbatch's script, or inside salloc) the launcher starts one srun step whose
tasks, one per node, run the mix's script again as node tasks (HET_SLURM_NODE=1). A
heterogeneous job (``sbatch OPTS0 : OPTS1 ...``, e.g. one component per device GRES) gets one
step per component, run together (:func:`run_steps`), its components' hosts in order being the
cluster file's node order. A node task takes its NODE_RANK and MASTER_ADDR from NODE_ORDER, else
from Slurm's node order (:func:`node_place`).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from megatron_het.errors import UserError

# Runs a command and returns its result (subprocess.run's signature).
Runner = Callable[..., subprocess.CompletedProcess]
# Signals for the batch step that go on to the steps (see run_steps).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


@dataclass(frozen=True)
class SlurmJob:
    """What Slurm tells a process of the job: its id ("": not inside an allocation), node
    count, the components' host lists of a heterogeneous job (one: a plain job; "" where the
    variable is missing), the job's host list, and, in a node task, its node index, host name
    and GPU count (None: not set)."""

    job_id: str
    num_nodes: int | None
    component_hosts: tuple[str, ...]
    node_list: str
    node_id: int | None
    node_name: str
    gpus_on_node: int | None


def read_slurm_job(environ: Mapping[str, str], short_hostname: str) -> SlurmJob:
    """Slurm's variables in ``environ`` (SLURMD_NODENAME defaults to ``short_hostname``)."""
    components = _integer(environ, "SLURM_HET_SIZE") or 1
    return SlurmJob(
        job_id=environ.get("SLURM_JOB_ID", ""),
        num_nodes=_integer(environ, "SLURM_JOB_NUM_NODES"),
        component_hosts=tuple(
            environ.get(f"SLURM_JOB_NODELIST_HET_GROUP_{i}", "") for i in range(components)
        ),
        node_list=environ.get("SLURM_JOB_NODELIST", ""),
        node_id=_integer(environ, "SLURM_NODEID"),
        node_name=environ.get("SLURMD_NODENAME") or short_hostname,
        gpus_on_node=_integer(environ, "SLURM_GPUS_ON_NODE"),
    )


def _integer(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name, "")
    if not text:
        return None
    if not text.isdigit():
        raise UserError(f"{name} is '{text}', not a count; run inside a Slurm allocation")
    return int(text)


def host_names(hosts: str, run: Runner = subprocess.run) -> list[str]:
    """The host names of a Slurm host list ("gpu[01-02],mi[01-04]", or names separated by
    commas or spaces), in its order; a list with brackets is expanded by ``scontrol show
    hostnames``."""
    if "[" not in hosts:
        return hosts.replace(",", " ").split()
    try:
        result = run(["scontrol", "show", "hostnames", hosts], capture_output=True, text=True)
    except OSError:
        result = None
    if result is None or result.returncode != 0:
        raise UserError(f"scontrol cannot expand the host list '{hosts}'; run inside Slurm")
    return result.stdout.split()


@dataclass(frozen=True)
class FanOut:
    """The batch step's srun steps: node counts per component (one: a plain job) and the node
    order the node tasks take their place in ("": Slurm's)."""

    counts: tuple[int, ...]
    node_order: str


def fan_out(
    job: SlurmJob,
    nnodes: int,
    runs: Sequence[int],
    node_order: str,
    cluster_name: str,
    run: Runner = subprocess.run,
) -> FanOut:
    """Check the allocation against a cluster of ``nnodes`` nodes whose accelerator kinds
    change after each of ``runs`` nodes, and return its steps. ``node_order``: NODE_ORDER as
    given. UserError (one line) for an allocation that does not fit."""
    if not job.job_id:
        raise UserError(
            "LAUNCHER=slurm needs a Slurm allocation; submit with sbatch or run inside salloc"
        )
    counts: tuple[int, ...] = (nnodes,)
    if len(job.component_hosts) > 1:
        counts, node_order = _components(job, nnodes, runs, node_order, cluster_name, run)
    elif job.num_nodes is not None and job.num_nodes != nnodes:
        raise UserError(
            f"the allocation has {job.num_nodes} nodes but cluster {cluster_name} needs "
            f"{nnodes}; use sbatch --nodes={nnodes}"
        )
    if node_order:
        listed = len(host_names(node_order, run))
        if listed != nnodes:
            raise UserError(
                f"NODE_ORDER lists {listed} hosts but cluster {cluster_name} has {nnodes} "
                "nodes; list every node once, in the cluster file's order"
            )
    return FanOut(counts, node_order)


def _components(
    job: SlurmJob,
    nnodes: int,
    runs: Sequence[int],
    node_order: str,
    cluster_name: str,
    run: Runner,
) -> tuple[tuple[int, ...], str]:
    """A heterogeneous job's node count per component and its node order: NODE_ORDER where
    given (the same hosts), else the components' hosts in order. A component must end where
    the nodes' kinds change (``runs``): components are node groups, or runs of them, in the
    cluster file's order, and a boundary elsewhere means the counts do not match the groups."""
    size = len(job.component_hosts)
    hosts: list[str] = []
    counts = []
    for i, listed in enumerate(job.component_hosts):
        if not listed:
            raise UserError(
                f"the heterogeneous job has {size} components but "
                f"SLURM_JOB_NODELIST_HET_GROUP_{i} is not set; run the script as the job's "
                "batch script"
            )
        names = host_names(listed, run)
        counts.append(len(names))
        hosts += names
    if len(hosts) != nnodes:
        raise UserError(
            f"the heterogeneous job's {size} components have {len(hosts)} nodes "
            f"({' '.join(map(str, counts))}) but cluster {cluster_name} needs {nnodes}; give "
            "each node group's nodes to the components, in the cluster file's order"
        )
    run_ends = {sum(runs[: i + 1]) for i in range(len(runs))}
    for i in range(size):
        end = sum(counts[: i + 1])
        if end not in run_ends:
            raise UserError(
                f"the heterogeneous job's component {i} ends at node {end} of cluster "
                f"{cluster_name}, inside a run of nodes of one kind (runs of "
                f"{' '.join(map(str, runs))} nodes in the cluster file's order); give each "
                "component whole node groups, in that order"
            )
    if not node_order:
        return tuple(counts), " ".join(hosts)
    if sorted(host_names(node_order, run)) != sorted(hosts):
        raise UserError(
            f"NODE_ORDER ({node_order}) does not list the heterogeneous job's hosts "
            f"({' '.join(hosts)}); list each of them once, in the cluster file's order, or "
            "leave NODE_ORDER unset to take the components' order"
        )
    return tuple(counts), node_order


def step_commands(fan: FanOut, elastic: bool, task: Sequence[str]) -> list[list[str]]:
    """The srun command of each step, each running ``task`` (the node task) once per node.
    A plain job ends when any node's task fails. An elastic one must outlive a lost node: the
    supervisors left relaunch on the devices left (submit it with sbatch --no-kill too, or
    Slurm ends the whole job when a node fails)."""
    keep = ["--kill-on-bad-exit=0", "--no-kill"] if elastic else ["--kill-on-bad-exit=1"]
    # srun sets HET_SLURM_NODE in its tasks only: they are the node tasks, not the batch step.
    options = [*keep, "--export=ALL,HET_SLURM_NODE=1", *task]
    if len(fan.counts) == 1:
        n = fan.counts[0]
        return [["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", *options]]
    return [
        ["srun", f"--het-group={i}", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1"]
        + options
        for i, n in enumerate(fan.counts)
    ]


def node_place(
    job: SlurmJob, node_order: str, master_addr: str, run: Runner = subprocess.run
) -> tuple[int, str]:
    """A node task's (NODE_RANK, MASTER_ADDR): with ``node_order``, this host's place in it and
    its first host; otherwise Slurm's node index and the allocation's first host, which is the
    cluster file's order only when Slurm lists the nodes in that order (the start-up device
    check stops a job whose nodes are out of order). A given ``master_addr`` is kept."""
    if node_order:
        hosts = host_names(node_order, run)
        if job.node_name not in hosts:
            raise UserError(
                f"this node ({job.node_name}) is not in NODE_ORDER; list the allocation's "
                "hosts in the cluster file's order"
            )
        return hosts.index(job.node_name), master_addr or hosts[0]
    if job.node_id is None:
        raise UserError("SLURM_NODEID is not set; srun starts the node tasks")
    if not master_addr:
        first = host_names(job.node_list, run)[:1]
        master_addr = first[0] if first else ""
    return job.node_id, master_addr


def check_gpus(job: SlurmJob, node_rank: int, gpu_ranks: int) -> None:
    """Stop early when Slurm gave this node fewer GPUs than its GPU ranks (cgroups hide the
    rest)."""
    if job.gpus_on_node is not None and job.gpus_on_node < gpu_ranks:
        raise UserError(
            f"Slurm gave node {node_rank} {job.gpus_on_node} GPUs but it runs {gpu_ranks} GPU "
            f"ranks; submit with sbatch --gpus-per-node={gpu_ranks}"
        )


def run_steps(
    commands: Sequence[Sequence[str]], env: Mapping[str, str], elastic: bool, cwd: str
) -> int:
    """Run one srun step per command at once, in ``cwd`` with ``env``. A plain job stops the
    other steps when one fails (as --kill-on-bad-exit does inside a step); an elastic one lets
    them go on. Returns the first failed step's status (128 + N for signal N), else 0.

    A signal for the batch step (scancel -b, sbatch --signal=B:...) goes on to the steps still
    running, as it would reach the one srun the batch step otherwise becomes (SIGTERM: the
    run saves at the end of its iteration and exits); the handlers are in place before the
    steps start and are restored after."""
    steps: list[subprocess.Popen] = []

    def forward(signum: int, _frame: object = None) -> None:
        for step in steps:
            if step.poll() is None:
                step.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        steps += [subprocess.Popen(list(cmd), env=dict(env), cwd=cwd) for cmd in commands]
        status, ended = 0, set[int]()
        while len(ended) < len(steps):
            time.sleep(0.2)
            for i, step in enumerate(steps):
                code = step.poll()
                if i in ended or code is None:
                    continue
                ended.add(i)
                if code != 0 and status == 0:
                    status = 128 - code if code < 0 else code
                    if not elastic:
                        forward(signal.SIGTERM)
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
