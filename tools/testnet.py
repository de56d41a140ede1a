"""Hosts of a cluster file on this machine: one network namespace per node, shaped by tc.

    sudo python tools/testnet.py up --cluster scripts/clusters/testnet_3nodes.yaml \\
        --scale 0.01 --run-id demo
    sudo python tools/testnet.py run --run-id demo -- python -m torch.distributed.run \\
        --nnodes {nnodes} --node-rank {node} --nproc-per-node {nproc} \\
        --master-addr {master_addr} --master-port 29500 pretrain_llama.py ...
    sudo python tools/testnet.py status
    sudo python tools/testnet.py down --run-id demo      # or: down (every run and leftover)
    python tools/testnet.py plan --cluster CLUSTER.yaml --scale 0.01   # no root: names, shapes

``up`` makes one namespace per node of the cluster (``mht-<run>-n<node>``, interface
``eth0``, address ``10.213.x.y/16``) on a private bridge, and shapes each node's egress with
HTB and netem: the node's NIC (``nic_bandwidth_gbit_per_s``) and each explicit ``links:``
entry between kinds (bandwidth and latency, per destination node), all at ``--scale``
(bandwidths times it, latencies divided by it). Nothing is reachable from outside the
namespaces. ``down`` removes a run (also one whose ``up`` or whose user crashed); ``status``
lists the runs and any leftovers. See :mod:`megatron_het.testnet.topology` and
:mod:`megatron_het.testnet.netns`, and docs/multi-node.md.
"""

from __future__ import annotations

import argparse
import pathlib
import secrets
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from megatron_het.arguments.parser import ArgParser
from megatron_het.cluster import ClusterSpec
from megatron_het.errors import UserError, run_cli
from megatron_het.testnet import netns, network_faults
from megatron_het.testnet.launch import run_on_nodes
from megatron_het.testnet.topology import TestnetPlan, check_run_id, describe, plan_testnet


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    out = out or sys.stdout
    parser = ArgParser(prog="testnet.py", description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "command",
        choices=("up", "run", "fault", "down", "status", "plan"),
        help="up: make a cluster file's namespaces, bridge and shaping; run: start the "
        "command after '--' on every node of a run, each in its namespace; fault: a network "
        "fault on one node; down: remove a run "
        "(without --run-id every run and leftover); status: list them; plan: print what up "
        "would make (no root needed)",
    )
    parser.add_argument("--cluster", help="cluster YAML (up, plan)")
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="links' time dilation: bandwidths x SCALE, latencies / SCALE (default 1)",
    )
    parser.add_argument("--run-id", help="1-6 lowercase letters or digits (up: default random)")
    parser.add_argument(
        "--log-dir",
        default="testnet_logs",
        help="run: where node<K>.log goes (default %(default)s)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=1800.0,
        help="run: stop every node's command after this many seconds (default %(default)s)",
    )
    faults = parser.add_argument_group("fault")
    faults.add_argument("--node", type=int, help="the node the fault hits")
    faults.add_argument("--to-node", type=int, help="only its link to this node")
    faults.add_argument("--link", choices=("down", "up"), help="pull or replug its cable")
    faults.add_argument(
        "--rate-fraction", type=float, help="its shaped rates times this (1: the planned ones)"
    )
    faults.add_argument("--loss", type=float, help="drop this %% of its sent packets (0: none)")
    faults.add_argument("--at-s", type=float, default=0.0, help="wait this many seconds first")
    faults.add_argument(
        "--at-iteration", type=int, help="wait until --metrics-file has logged this iteration"
    )
    faults.add_argument("--metrics-file", help="the run's --metrics-file (--at-iteration)")
    argv = list(argv)
    command: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args, command, out)
    if args.command == "fault":
        return fault(args, out)
    if args.command in ("up", "plan") and not args.cluster:
        raise UserError(f"testnet.py {args.command} needs --cluster CLUSTER.yaml")

    if args.command in ("up", "plan"):
        run_id = check_run_id(args.run_id) if args.run_id else secrets.token_hex(3)
        plan = plan_testnet(ClusterSpec.load(args.cluster), run_id, args.scale)
        if args.command == "up":
            record = netns.up(plan)
            print(describe(plan), file=out)
            if not netns.netem_of(plan.run_id):
                print(
                    "note: this kernel has no netem qdisc: the links keep their rates, "
                    "without their latencies",
                    file=out,
                )
            print(f"up; recorded in {record}", file=out)
        else:
            print(describe(plan), file=out)
    elif args.command == "down":
        run_id = check_run_id(args.run_id) if args.run_id else None
        removed = netns.down(run_id)
        print(f"removed {len(removed)}: {' '.join(removed) or 'nothing was up'}", file=out)
    else:
        lines = netns.status()
        print("\n".join(lines) if lines else "no testnet is up", file=out)
    return 0


def _recorded(args: argparse.Namespace, what: str) -> TestnetPlan:
    if not args.run_id:
        raise UserError(f"testnet.py {what} needs --run-id (the run 'up' made)")
    netns.check_host()
    plan = netns.load_plan(check_run_id(args.run_id))
    if plan is None:
        raise UserError(f"testnet {args.run_id} is not up (tools/testnet.py status lists runs)")
    return plan


def fault(args: argparse.Namespace, out: TextIO) -> int:
    """``fault``: one of --link, --rate-fraction, --loss on --node, when --at-s / --at-iteration
    says."""
    plan = _recorded(args, "fault")
    chosen = [f for f in ("link", "rate_fraction", "loss") if getattr(args, f) is not None]
    if len(chosen) != 1:
        raise UserError("testnet.py fault needs exactly one of --link, --rate-fraction, --loss")
    for flag, value in (("--node", args.node), ("--to-node", args.to_node)):
        if value is not None and not 0 <= value < len(plan.nodes):
            raise UserError(f"{flag} {value} is not a node of testnet {plan.run_id} "
                            f"(0-{len(plan.nodes) - 1})")  # fmt: skip
    if args.node is None:
        raise UserError("testnet.py fault needs --node")
    node = plan.node(args.node)
    if args.link is not None:
        commands = network_faults.link_state_commands(node, up=args.link == "up")
    elif args.rate_fraction is not None:
        commands = network_faults.rate_commands(node, args.rate_fraction, args.to_node)
    else:
        network_faults.check_nft()
        commands = network_faults.loss_commands(plan, node, args.loss, args.to_node)
    if args.at_iteration is not None:
        if not args.metrics_file:
            raise UserError("--at-iteration needs --metrics-file (the run's)")
        network_faults.wait_for_iteration(pathlib.Path(args.metrics_file), args.at_iteration,
                                  args.timeout_s)  # fmt: skip
    if args.at_s > 0:
        time.sleep(min(args.at_s, args.timeout_s))
    for argv in commands:
        tolerated = "delete" in argv  # removing a loss table that was never added
        netns.run_command(argv, check=not tolerated)
    if args.link is not None:
        what = f"link {args.link}"
    elif args.rate_fraction is not None:
        what = f"rates x {args.rate_fraction:g}"
    else:
        what = f"{args.loss:g}% loss"
    where = f"node {node.node}" + (f" -> node {args.to_node}" if args.to_node is not None else "")
    print(f"{time.strftime('%H:%M:%S')} {where}: {what}", file=out, flush=True)
    return 0


def run(args: argparse.Namespace, command: list[str], out: TextIO) -> int:
    """``run``: the command on every node of the recorded run; the worst exit status."""
    plan = _recorded(args, "run")
    results = run_on_nodes(plan, command, pathlib.Path(args.log_dir), args.timeout_s)
    for result in results:
        print(f"node {result.node}: exit status {result.returncode} ({result.log})", file=out)
    failed = [r.returncode for r in results if r.returncode != 0]
    if not failed:
        return 0
    return failed[0] if failed[0] > 0 else 128 - failed[0]  # killed by signal N: 128 + N


if __name__ == "__main__":
    run_cli(lambda: sys.exit(main(sys.argv[1:])))
