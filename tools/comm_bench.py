"""Collective bandwidth sweep in the manner of nccl-tests, for the unified communicator.

Run under torchrun, one process per rank of the cluster file::

    torchrun --standalone --nproc_per_node 4 tools/comm_bench.py \\
        --cluster scripts/clusters/cpu_emulated.yaml --json OUT.json

For every op and size it times impl "flat" (torch.distributed on one plain gloo group over all
ranks) and "unified" (the communicator's world group over the cluster's kinds), checks both
results against values computed locally from the known inputs, prints a table and writes a JSON
list of records. Sizes are the total bytes of the op's buffer as in nccl-tests (all_gather:
output; reduce_scatter: input; all_to_all: per-rank send buffer). ``time_us`` is the median over
iterations of the slowest rank's time (``time_us_mean`` the mean); ``algbw = bytes / time``; ``busbw
= algbw x factor`` with nccl-tests' factors (all_reduce 2(n-1)/n; all_gather, reduce_scatter,
all_to_all (n-1)/n; broadcast 1). Broadcast sends from the last rank (of the last kind, so it
crosses kinds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_het.arguments.parser import ArgParser
from megatron_het.cluster import ClusterSpec
from megatron_het.comm.communicator import UnifiedCommunicator
from megatron_het.emulation.emulated_links import emulated_wires
from megatron_het.errors import UserError, run_cli
from megatron_het.launcher.launch_env import (
    gloo_address_problem,
    launched_by_torchrun,
    read_launch_env,
)
from megatron_het.launcher.rank_device import device_problem, rank_device_index, select_local_device
from megatron_het.launcher.world import join_world

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
IMPLS = ("flat", "unified")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``op`` over ``n`` ranks."""
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


class Case:
    """Buffers, the op of each impl, and the expected result for one (op, size).

    Inputs are integer-valued (``i % 251 + rank``), so every sum is exact in float32 and the
    expected outputs follow in closed form.
    """

    def __init__(
        self,
        op: str,
        nbytes: int,
        dtype: torch.dtype,
        comm: UnifiedCommunicator,
        flat: dist.ProcessGroup,
    ) -> None:
        n, me, esize = comm.world_size, comm.rank, torch.tensor([], dtype=dtype).element_size()
        self.op, self.n, self.me = op, n, me
        per = max(1, nbytes // esize // (n if op in ("all_gather",) else 1))
        per = -(-per // n) * n if op in ("reduce_scatter", "all_to_all") else per
        self.numel = per
        self.device = comm.device  # the rank's accelerator (its native backend needs it there)
        self.base = (torch.arange(per, device=self.device) % 251).to(dtype)
        self.input = self.base + me
        self.src = n - 1
        size_out = {"all_gather": per * n, "reduce_scatter": per // n}.get(op, per)
        self.output = torch.empty(size_out, dtype=dtype, device=self.device)
        self.bytes = {"all_gather": per * n}.get(op, per) * esize
        w = comm.world
        m = per // n
        self.run: dict[str, Callable[[], None]] = {
            "all_reduce": {
                "flat": lambda: dist.all_reduce(self.output, group=flat),
                "unified": lambda: w.all_reduce(self.output),
            },
            "all_gather": {
                "flat": lambda: dist.all_gather_into_tensor(self.output, self.input, group=flat),
                "unified": lambda: w.all_gather_into_tensor(self.output, self.input),
            },
            "reduce_scatter": {
                "flat": lambda: dist.reduce_scatter_tensor(self.output, self.input, group=flat),
                "unified": lambda: w.reduce_scatter_tensor(self.output, self.input),
            },
            "broadcast": {
                "flat": lambda: dist.broadcast(self.output, self.src, group=flat),
                "unified": lambda: w.broadcast(self.output, self.src),
            },
            "all_to_all": {
                "flat": lambda: dist.all_to_all_single(self.output, self.input, group=flat),
                "unified": lambda: w.all_to_all(
                    list(self.output.split(m)), list(self.input.split(m))
                ),
            },
        }[op]

    def reset(self) -> None:
        """Refill the in-place buffers with this rank's input."""
        if self.op in ("all_reduce", "broadcast"):
            self.output.copy_(self.input)
        self.sync()

    def sync(self) -> None:
        """Wait for the device's queued work, so timers measure finished operations."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def expected(self) -> torch.Tensor:
        n, me, base = self.n, self.me, self.base
        m = self.numel // n
        ranks_sum = n * (n - 1) // 2
        if self.op == "all_reduce":
            return base * n + ranks_sum
        if self.op == "all_gather":
            return torch.cat([base + r for r in range(n)])
        if self.op == "reduce_scatter":
            return base[me * m : (me + 1) * m] * n + ranks_sum
        if self.op == "broadcast":
            return base + self.src
        return torch.cat([base[me * m : (me + 1) * m] + r for r in range(n)])  # all_to_all


def time_cases(
    case: Case, impls: list[str], warmup: int, iters: int, flat: dist.ProcessGroup
) -> list[dict]:
    """Time every impl of ``case``; iterations of the impls alternate, so load from other
    processes on the machine falls on all of them alike. Per iteration the slowest rank's time
    counts; the record holds the median over iterations (and the mean)."""
    for impl in impls:
        for _ in range(warmup):
            case.reset()
            case.run[impl]()
    times = torch.zeros(len(impls), iters, dtype=torch.float64)
    for it in range(iters):
        for k, impl in enumerate(impls):
            case.reset()
            dist.barrier(group=flat)
            start = time.perf_counter()
            case.run[impl]()
            case.sync()
            times[k, it] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=flat)
    records = []
    for k, impl in enumerate(impls):
        case.reset()
        case.run[impl]()
        ok = torch.tensor([int(torch.equal(case.output, case.expected()))], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=flat)
        seconds = float(times[k].median())
        algbw = case.bytes / seconds / 1e9
        records.append(
            {
                "op": case.op,
                "impl": impl,
                "bytes": case.bytes,
                "count": case.numel,
                "time_us": round(seconds * 1e6, 1),
                "time_us_mean": round(float(times[k].mean()) * 1e6, 1),
                "algbw_gbps": round(algbw, 4),
                "busbw_gbps": round(algbw * bus_factor(case.op, case.n), 4),
                "correct": bool(ok.item()),
            }
        )
    return records


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size)
        size *= factor
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgParser(prog="tools/comm_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", required=True, help="cluster YAML (its ranks = the launch)")
    p.add_argument("--json", help="write the records to this file (rank 0)")
    p.add_argument("--min-bytes", default="1K")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--step-factor", type=int, default=4, help="size multiplier between rows")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument(
        "--bridge",
        default="relay",
        choices=("relay", "direct"),
        help="direct: the one native backend all kinds share (error if none)",
    )
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument(
        "--emulate-bridge",
        action="store_true",
        help="slow cross-kind traffic to the cluster's emulated links (off: measure "
        "the communicator itself against flat gloo)",
    )
    args = p.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    args.impls = [i for i in args.impls.split(",") if i]
    for name, allowed, given in (("--ops", OPS, args.ops), ("--impls", IMPLS, args.impls)):
        bad = sorted(set(given) - set(allowed))
        if bad:
            raise UserError(f"{name}: unknown {bad}; choose from {', '.join(allowed)}")
    if args.step_factor < 2 or args.iters < 1 or args.warmup < 0:
        raise UserError("--step-factor must be >= 2, --iters >= 1 and --warmup >= 0")
    return args


def main() -> None:
    args = parse_args()
    cluster = ClusterSpec.load(args.cluster)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    if not launched_by_torchrun(os.environ):
        raise UserError(
            "run comm_bench under torchrun, one process per rank of the cluster "
            "file: torchrun --nproc_per_node N tools/comm_bench.py --cluster ..."
        )
    env = read_launch_env(os.environ)  # torchrun's: rank, world, rendezvous
    if env.world_size != cluster.world_size:
        raise UserError(
            f"torchrun started {env.world_size} ranks but cluster "
            f"{cluster.name} has {cluster.world_size}; use --nproc_per_node (and "
            "--nnodes) to match it"
        )

    def device_type(r: int) -> str:
        return cluster.accelerator_of(r).device_type

    # The same start as training: the rank's device (a CPU rank leaves torch.cuda alone), then
    # the world once every rank has agreed that each can drive its kind's device and be
    # reached by the others.
    index = rank_device_index(device_type, env.rank, env.local_rank)
    select_local_device(device_type(env.rank), index)
    problem = device_problem(cluster.accelerator_of(env.rank), index) or gloo_address_problem(env)
    join_world(env, timeout, problem)
    hooks = emulated_wires(cluster) if args.emulate_bridge else None  # EMULATION
    comm = UnifiedCommunicator.from_cluster(
        cluster, bridge=args.bridge, timeout=timeout, wire_hooks=hooks
    )
    if "flat" in args.impls and comm.device.type != "cpu":
        raise UserError(
            f"--impls flat runs plain gloo on CPU tensors, but this rank's tensors "
            f"live on {comm.device.type}; use --impls unified"
        )
    flat = dist.new_group(list(range(comm.world_size)), backend="gloo", timeout=timeout)
    records = []
    if comm.rank == 0:
        kinds = "+".join(f"{comm.rank_kinds.count(k)}x{k}" for k in dict.fromkeys(comm.rank_kinds))
        print(
            f"# comm_bench: {comm.world_size} ranks ({kinds}), bridge {args.bridge}, "
            f"{args.dtype}, {args.iters} iters, {args.warmup} warmup"
        )
        print(
            f"{'op':>15} {'impl':>8} {'bytes':>11} {'time_us':>11} {'algbw GB/s':>11} "
            f"{'busbw GB/s':>11} {'correct':>8}"
        )
    for op in args.ops:
        for nbytes in sizes(
            parse_size(args.min_bytes), parse_size(args.max_bytes), args.step_factor
        ):
            case = Case(op, nbytes, DTYPES[args.dtype], comm, flat)
            for rec in time_cases(case, args.impls, args.warmup, args.iters, flat):
                rec.update(
                    dtype=args.dtype,
                    world_size=comm.world_size,
                    bridge=args.bridge,
                    cluster=args.cluster,
                    kinds=list(comm.rank_kinds),
                    emulated_bridge=args.emulate_bridge,
                    iters=args.iters,
                )
                records.append(rec)
                if comm.rank == 0:
                    print(
                        f"{op:>15} {rec['impl']:>8} {rec['bytes']:>11} {rec['time_us']:>11.1f} "
                        f"{rec['algbw_gbps']:>11.4f} {rec['busbw_gbps']:>11.4f} "
                        f"{str(rec['correct']):>8}",
                        flush=True,
                    )
    if comm.rank == 0:
        summarize(records)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(records, fh, indent=1)
    dist.destroy_process_group()
    if not all(r["correct"] for r in records):
        raise SystemExit("error: some results were wrong (see the 'correct' column)")


def summarize(records: list[dict]) -> None:
    """Print unified/flat bus-bandwidth ratios per (op, size)."""
    flat = {(r["op"], r["bytes"]): r["busbw_gbps"] for r in records if r["impl"] == "flat"}
    for r in records:
        key = (r["op"], r["bytes"])
        if r["impl"] == "unified" and flat.get(key):
            print(
                f"# {r['op']} {r['bytes']} B: unified/flat busbw = "
                f"{r['busbw_gbps'] / flat[key]:.3f}"
            )


if __name__ == "__main__":
    run_cli(main)
