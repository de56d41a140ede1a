"""``tools/elastic_run.py``'s command line -> frozen configs, parsed once.

    tools/elastic_run.py [--max-restarts N] [--node-rank K --master-addr A --master-port P
        [--node-addr B] [--job-id J]] -- <pretrain_llama.py flags>

The supervisor's own flags go through argparse into :class:`SupervisorConfig`; the run's flags
(after ``--``) are kept as given and read through ``pretrain_llama.py``'s own parser
(:func:`megatron_het.arguments.build_parser`) for the three values the supervisor needs
(:class:`RunFlags`), so a flag the run would refuse is refused before anything starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_het.arguments.parser import ArgParser
from megatron_het.errors import UserError

PROG = "tools/elastic_run.py"
DEFAULT_MAX_RESTARTS = 3
USAGE = (
    f"usage: {PROG} [--max-restarts N] [--node-rank K --master-addr A "
    "--master-port P [--node-addr B] [--job-id J]] -- <pretrain_llama.py flags>"
)


@dataclass(frozen=True)
class RunFlags:
    """The run's flags (``pretrain_llama.py``'s, as given) and what the supervisor reads of
    them: ``--cluster`` (the devices of the first launch), ``--save`` (checkpoints and the
    failure records) and ``--distributed-timeout-minutes``."""

    flags: tuple[str, ...]
    cluster: str
    save: str
    timeout_minutes: float


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


@dataclass(frozen=True)
class SupervisorConfig:
    """What one supervisor runs: the run, at most ``max_restarts`` relaunches, and its node of a
    multi-node job (None: every device of the cluster file on this host)."""

    run: RunFlags
    max_restarts: int = DEFAULT_MAX_RESTARTS
    node: NodeLaunch | None = None


def read_run_flags(flags: Sequence[str]) -> RunFlags:
    """:class:`RunFlags` of ``flags``, read by ``pretrain_llama.py``'s parser (its one-line
    UserError for a flag it refuses); UserError without ``--cluster`` or ``--save``."""
    from megatron_het.arguments import build_parser

    args = build_parser().parse_args(list(flags))
    if args.cluster is None or args.save is None:
        raise UserError(
            f"{PROG} needs --cluster (the devices to start on) and --save (where checkpoints "
            "and the failure record go) among the run's flags"
        )
    return RunFlags(tuple(flags), args.cluster, args.save, args.distributed_timeout_minutes)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"takes a non-negative integer, got {text!r}")
    return int(text)


def _parser() -> ArgParser:
    p = ArgParser(prog=PROG, usage=USAGE.removeprefix("usage: "), allow_abbrev=False)
    p.add_argument("--max-restarts", type=_count, default=DEFAULT_MAX_RESTARTS)
    p.add_argument("--node-rank", type=_count, help="this node's index in the cluster file")
    p.add_argument("--master-addr", help="node 0's address (the first launch's master)")
    p.add_argument("--master-port", type=_count, help="the first launch's port (then +1 each)")
    p.add_argument("--node-addr", help="this node's address for the others (default hostname)")
    p.add_argument("--job-id", help="the same on every node (default $SLURM_JOB_ID, else A:P)")
    return p


def parse_supervisor_args(
    argv: Sequence[str], environ: Mapping[str, str], hostname: str
) -> SupervisorConfig:
    """``argv`` (without the program name) -> :class:`SupervisorConfig`. ``--node-addr``
    defaults to ``hostname``, ``--job-id`` to ``environ``'s SLURM_JOB_ID, else ``A:P``.
    UserError (one line) for a command line that does not make a job."""
    argv = list(argv)
    if "--" not in argv:
        raise UserError(USAGE)
    split = argv.index("--")
    args = _parser().parse_args(argv[:split])
    run = read_run_flags(argv[split + 1 :])
    multi = [args.node_rank, args.master_addr, args.master_port]
    if all(value is None for value in multi):
        if args.node_addr is not None or args.job_id is not None:
            raise UserError(
                "--node-addr and --job-id are for a multi-node job: give --node-rank, "
                "--master-addr and --master-port too"
            )
        return SupervisorConfig(run, args.max_restarts)
    if any(value is None for value in multi):
        raise UserError(
            "a multi-node job's supervisor needs --node-rank, --master-addr and "
            "--master-port together"
        )
    job_id = args.job_id or environ.get("SLURM_JOB_ID") or f"{args.master_addr}:{args.master_port}"
    node = NodeLaunch(
        args.node_rank, args.master_addr, args.master_port, args.node_addr or hostname, job_id
    )
    return SupervisorConfig(run, args.max_restarts, node)
