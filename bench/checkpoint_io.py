"""Checkpoint I/O: write and read GB/s of sharded checkpoints, ours against
torch.distributed.checkpoint (DCP), what background saves cost, and Megatron-LM conversion.

Three measurements, printed as one JSON object (the last line) with the conditions:

* ``io``: a model of a few hundred MB (float32 weights, plus Adam moments: the checkpoint is about
  3x the weights) saved and loaded back by a one-rank plan and by a 2-rank plan (pp=2; ``--ranks``
  for another size, ``--skip-single`` for that plan alone), each rank
  a forked gloo process, in each format ``--format`` names, rounds alternating the formats:
  ``ours`` (``save_sharded`` / ``load_sharded``) and ``dcp1``, ``dcp2`` (``dcp.save`` with a
  ``FileSystemWriter`` of 1 and 2 threads, ``dcp.load`` into preallocated tensors; the same
  tensors under global names, :mod:`bench.checkpoint_dcp`). Our load checks every opened file's
  size and sha256-verifies each tensor piece it reads (not whole files), so it hashes only what
  it reads: ``read_gb`` (tensor bytes read, all ranks) and ``verified_gb`` (bytes hashed) say how
  much that was against ``checkpoint_gb``. DCP checks nothing; what our per-piece sha256 would
  add on top of it is timed apart (``sha256_s_per_gb`` at save, ``verify_s_per_gb`` at load, in
  core-seconds per GB; ``*_with_sha256``: GB/s with the hashing after the write or the read).
  Write GB/s = the checkpoint's bytes / the slowest rank's time, read GB/s = ``read_gb`` / the
  slowest rank's time; medians over ``--rounds``. The 2-rank plan also loads the one-rank
  plan's checkpoints (``resharded``: each rank reads only its stage's pieces; DCP by names).
  The files were just written, so reads come from the page cache (a figure for the code's own
  cost, not the disk's); ``sha256_gbps`` is one core's hashing rate. ``async_stall_s``: how
  long one asynchronous save holds a rank's training thread (the slowest rank's), ours (the
  host copies ``--async-save`` takes before its background write) and ``dcp.async_save``'s.
* ``async_overhead`` (:mod:`bench.checkpoint_overhead`): the demo's model preset and save interval
  (``small``, every 100 iterations, sequence 256, global batch 8), trained in this process for 2
  save intervals with synchronous saves, with ``--async-save``, with ``dcp.async_save`` of the
  same state (a gloo group of its own, the tracker written when its future is done) and without
  saving (``--overhead-io-model``: the io model instead, so that a save costs as much as several
  iterations). Iteration time = the loop's time from the end of iteration 1 (the process warms up
  in it) to the last save point, over the iterations in between: it holds one save (the final one,
  alike in every run, is left out). ``stall_s_per_save``: how long each save held the training
  thread (the median of every save). Medians over ``--runs`` alternating runs;
  ``ratio_async_vs_sync`` < 1 means background saves cost training less than synchronous ones.
* ``megatron_conversion`` (:mod:`bench.checkpoint_conversion`): seconds and GB/s to convert a
  Megatron-LM checkpoint (legacy TP 2 x PP 2, and torch_dist) of a ~1 GB bf16 state to ours
  and back with ``tools/convert_checkpoint.py``'s functions.

    .venv/bin/python -m bench.checkpoint_io                      # everything (~15 minutes)
    .venv/bin/python -m bench.checkpoint_io --hidden-size 256 --vocab-size 4096 --rounds 1 \\
        --save-interval 5 --runs 1 --conversion-hidden-size 256 --conversion-layers 2
                                                                  # a smoke run (< 1 minute)
    .venv/bin/python -m bench.checkpoint_io --skip-io --overhead-io-model --save-interval 10
                                                                  # saves that weigh
    .venv/bin/python -m bench.checkpoint_io --megatron-conversion # the conversion part only
    .venv/bin/python -m bench.checkpoint_io --hidden-size 2048 --num-layers 16 \\
        --vocab-size 32000 --ranks 4 --skip-single --skip-overhead --skip-conversion \\
        --rounds 2                                  # a 0.9B model on 4 ranks (10.6 GB a save)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import os
import pathlib
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench import checkpoint_dcp
from bench.checkpoint_conversion import measure_conversion
from bench.checkpoint_overhead import measure_overhead
from megatron_het.checkpoint.integrity import files_total_bytes
from megatron_het.checkpoint.reader import ReadStats
from megatron_het.checkpoint.verify import read_metadata_file
from megatron_het.config import ModelConfig
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf.measure.worker_processes import free_loopback_port

_GB = 1e9


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument(
        "--format",
        choices=("ours", "dcp", "both"),
        default="both",
        help="io and overhead parts: our checkpoint format, torch.distributed.checkpoint "
        "(DCP), or both, rounds alternating",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="save+load rounds per plan (and conversion rounds)"
    )
    p.add_argument(
        "--save-interval",
        type=int,
        default=100,
        help="iterations between saves in the overhead runs (the demo's: 100)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="io part: ranks of the multi-rank plan (pipeline stages, one rank each)",
    )
    p.add_argument(
        "--skip-single",
        action="store_true",
        help="io part: measure the multi-rank plan alone (no one-rank plan, no reshard)",
    )
    p.add_argument("--runs", type=int, default=3, help="overhead runs per mode")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--skip-io", action="store_true")
    p.add_argument("--skip-conversion", action="store_true")
    p.add_argument(
        "--megatron-conversion",
        action="store_true",
        help="run the megatron_conversion part only (a default run includes it)",
    )
    p.add_argument(
        "--conversion-hidden-size",
        type=int,
        default=2048,
        help="megatron_conversion: hidden size (TinyLlama-1.1B's proportions)",
    )
    p.add_argument("--conversion-layers", type=int, default=8, help="megatron_conversion: layers")
    p.add_argument(
        "--conversion-dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="megatron_conversion: the state's dtype (bf16: 8 layers make 0.97 GB)",
    )
    p.add_argument(
        "--overhead-io-model",
        action="store_true",
        help="time the overhead runs on the io model's layers (--hidden-size, "
        "--num-layers; the demo's vocabulary) instead of the demo's small "
        "preset: a checkpoint whose save weighs on training",
    )
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    return p.parse_args(argv)


def io_model(args: argparse.Namespace) -> ModelConfig:
    hidden = args.hidden_size
    return ModelConfig(
        num_layers=args.num_layers,
        hidden_size=hidden,
        ffn_hidden_size=hidden * 11 // 4,
        num_attention_heads=max(1, hidden // 64),
        num_query_groups=max(1, hidden // 128),
        vocab_size=args.vocab_size,
        name="bench-ckpt",
    )


def pp_plan(config: ModelConfig, world_size: int) -> ParallelPlan:
    per = config.num_layers // world_size
    stages = [
        {
            "accelerator": "cpu",
            "tp": 1,
            "ranks": [r],
            "layers": [r * per, config.num_layers if r == world_size - 1 else (r + 1) * per],
        }
        for r in range(world_size)
    ]
    return ParallelPlan.from_dict(
        {
            "format": "megatron_het.plan/1",
            "micro_batch_size": 1,
            "pipelines": [{"micro_batches": world_size, "stages": stages}],
        }
    )


def _timed_load(load: Any) -> dict[str, float]:
    """Seconds, bytes read and bytes sha256-verified of one ``load(stats)`` on this rank."""
    stats = ReadStats()
    start = time.perf_counter()
    load(stats)
    return {
        "s": time.perf_counter() - start,
        "bytes": stats.bytes,
        "verified": stats.verified_bytes,
    }


def formats_of(args: argparse.Namespace) -> list[str]:
    """The io part's formats in round order: ``ours``, ``dcp1``, ``dcp2`` (DCP with 1 and 2
    writer threads), as ``--format`` picks."""
    dcp = [f"dcp{t}" for t in checkpoint_dcp.THREAD_COUNTS]
    return {"ours": ["ours"], "dcp": dcp, "both": ["ours", *dcp]}[args.format]


@dataclasses.dataclass(frozen=True)
class _RankState:
    """One io rank's state: its stage, plan, groups and the same tensors for both formats."""

    config: ModelConfig
    plan: ParallelPlan
    groups: Any
    stage: Any
    optimizer: dict[str, dict[str, Any]]

    def dcp(self, iteration: int) -> dict[str, Any]:
        model = {n: p.detach() for n, p in self.stage.named_parameters()}
        return checkpoint_dcp.dcp_state(
            model, self.optimizer, {"iteration": iteration, "consumed_samples": 0}
        )


def _stalls(state: _RankState, root: pathlib.Path, iteration: int, dcp_group: Any) -> dict:
    """How long one asynchronous save holds this rank's training thread (collective): ours,
    ``--async-save``'s part in it (fresh host copies of the optimizer state, as the optimizer's
    ``state_dict()`` gives them, and :func:`snapshot_sharded`'s copies of the parameters; the
    background write is not started), and ``dcp.async_save``'s return (its staging), whose
    write is then waited for (``dcp_group``: a gloo group of its own, None: no DCP). Seconds by
    format."""
    import torch.distributed.checkpoint as torch_dcp

    from megatron_het.checkpoint.io import remove_stale_staging
    from megatron_het.checkpoint.sharded import snapshot_sharded

    world, out = state.groups.world, {}
    world.barrier()
    start = time.perf_counter()
    optimizer = {
        n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        for n, entry in state.optimizer.items()
    }
    save_dir = root / "ours-async"
    snapshot_sharded(
        save_dir,
        iteration,
        state.config,
        state.groups,
        state.stage,
        optimizer,
        {"iteration": iteration, "consumed_samples": 0},
    )
    out["ours"] = time.perf_counter() - start
    del optimizer  # the copies go before DCP stages its own
    world.barrier()
    if world.rank == 0:
        remove_stale_staging(save_dir)
    if dcp_group is not None:
        path = root / "dcp-async" / f"iter_{iteration:07d}"
        writer = torch_dcp.FileSystemWriter(path, thread_count=2, sync_files=True)
        world.barrier()
        start = time.perf_counter()
        future = torch_dcp.async_save(
            state.dcp(iteration), storage_writer=writer, process_group=dcp_group
        )
        out["dcp"] = time.perf_counter() - start
        future.result()
        world.barrier()
        if world.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    return out


def _ours_round(
    state: _RankState, root: pathlib.Path, iteration: int, reshard_from: str | None
) -> dict[str, Any]:
    """One save + load round of our format on this rank (collective)."""
    from megatron_het.checkpoint.sharded import load_sharded, save_sharded

    config, plan, groups, stage = state.config, state.plan, state.groups, state.stage
    save_dir = root / "ours"
    groups.world.barrier()
    start = time.perf_counter()
    path = save_sharded(
        save_dir,
        iteration,
        config,
        plan,
        groups,
        stage,
        state.optimizer,
        {"iteration": iteration, "consumed_samples": 0},
    )
    write_s = time.perf_counter() - start
    groups.world.barrier()
    row = {
        "write_s": write_s,
        "bytes": files_total_bytes(read_metadata_file(path) or {}),
        "read": _timed_load(
            lambda stats: load_sharded(save_dir, config, plan, groups, stage, stats=stats)
        ),
    }
    groups.world.barrier()
    if reshard_from is not None:
        source = pathlib.Path(reshard_from) / "ours"
        row["resharded"] = _timed_load(
            lambda stats: load_sharded(source, config, plan, groups, stage, stats=stats)
        )
        groups.world.barrier()
    if groups.world.rank == 0 and iteration > 1:
        shutil.rmtree(save_dir / f"iter_{iteration - 1:07d}", ignore_errors=True)
    return row


def _io_rank(
    rank: int,
    world_size: int,
    port: int,
    args: argparse.Namespace,
    root: str,
    reshard_from: str | None,
    queue: Any,
) -> None:
    import datetime

    import torch.distributed as dist

    from megatron_het.comm import UnifiedCommunicator
    from megatron_het.parallel.process_groups import build_process_groups
    from megatron_het.pipeline.stage import build_stage

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=10),
    )
    config, plan = io_model(args), pp_plan(io_model(args), world_size)
    comm = UnifiedCommunicator(["cpu"] * world_size, {"cpu": "gloo"}, {"cpu": "cpu"})
    groups = build_process_groups(comm, plan)
    stage = build_stage(config, plan, groups, seed=1)
    optimizer = {
        n: {"step": 1, "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
        for n, p in stage.named_parameters()
    }
    state = _RankState(config, plan, groups, stage, optimizer)
    formats, rows = formats_of(args), []
    # dcp.async_save's writes run on a gloo group of their own, as in the overhead part.
    dcp_group = dist.new_group(backend="gloo") if any(f != "ours" for f in formats) else None
    for round_index in range(args.rounds):
        row: dict[str, Any] = {}
        # Rounds alternate the formats and rotate which goes first: the host's drift and the
        # page cache's state hit every format alike.
        shift = round_index % len(formats)
        for fmt in formats[shift:] + formats[:shift]:
            if fmt == "ours":
                row[fmt] = _ours_round(state, pathlib.Path(root), round_index + 1, reshard_from)
            else:
                source = None
                if reshard_from is not None:  # the other plan keeps its last round's save
                    source = pathlib.Path(reshard_from) / fmt / f"iter_{args.rounds:07d}"
                row[fmt] = checkpoint_dcp.plan_round(
                    state.dcp(round_index + 1),
                    pathlib.Path(root) / fmt,
                    int(fmt.removeprefix("dcp")),
                    round_index + 1,
                    source,
                    groups.world,
                )
        row["async_stall_s"] = _stalls(state, pathlib.Path(root), round_index + 1, dcp_group)
        rows.append(row)
    dist.destroy_process_group()
    queue.put((rank, rows))


def _reads(rounds: list, key: str) -> dict[str, Any]:
    """Read GB/s (bytes read by all ranks / the slowest rank's time), GB read and GB verified
    of our loads ``key`` (read | resharded), medians over the rounds."""
    gbps = [
        sum(row[key]["bytes"] for row in rows) / _GB / max(row[key]["s"] for row in rows)
        for rows in rounds
    ]
    return {
        "read_gbps": round(statistics.median(gbps), 3),
        "read_gb": round(sum(row[key]["bytes"] for row in rounds[-1]) / _GB, 3),
        "read_gb_per_rank": [round(row[key]["bytes"] / _GB, 3) for row in rounds[-1]],
        "verified_gb": round(sum(row[key]["verified"] for row in rounds[-1]) / _GB, 3),
        "read_gbps_rounds": [round(v, 3) for v in gbps],
    }


def _ours_figures(rounds: list, resharded: bool) -> dict[str, Any]:
    """Our format's figures from its rows (one tuple of ranks' rows per round)."""
    nbytes = rounds[0][0]["bytes"]
    write = [nbytes / _GB / max(row["write_s"] for row in rows) for rows in rounds]
    out = {
        "checkpoint_gb": round(nbytes / _GB, 3),
        "write_gbps": round(statistics.median(write), 3),
        **_reads(rounds, "read"),
        "write_gbps_rounds": [round(v, 3) for v in write],
    }
    if resharded:
        out["resharded"] = _reads(rounds, "resharded")
    return out


def measure_plan(
    world_size: int,
    args: argparse.Namespace,
    root: pathlib.Path,
    reshard_from: pathlib.Path | None = None,
    keep: bool = False,
) -> dict:
    """Write/read GB/s of ``world_size`` forked ranks (pp plan) in each of :func:`formats_of`,
    medians over the rounds; also the load of the checkpoints in ``reshard_from`` (another
    plan's directory, its last round) when given. ``keep`` leaves this plan's directory
    (``root/plan<world_size>``) in place."""
    port = free_loopback_port()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    target = root / f"plan{world_size}"
    source = None if reshard_from is None else str(reshard_from)
    procs = [
        ctx.Process(target=_io_rank, args=(r, world_size, port, args, str(target), source, queue))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
    if not keep:
        shutil.rmtree(target, ignore_errors=True)
    out: dict[str, Any] = {"ranks": world_size}
    if reshard_from is not None:
        out["resharded_from"] = reshard_from.name
    for fmt in formats_of(args):
        rounds = [
            tuple(row[fmt] for row in rows)
            for rows in zip(*(results[r] for r in range(world_size)))
        ]
        figures = _ours_figures if fmt == "ours" else checkpoint_dcp.figures
        out[fmt] = figures(rounds, reshard_from is not None)
    # The slowest rank's stall per round, medians over the rounds.
    stalls: dict[str, list[float]] = {}
    for rows in zip(*(results[r] for r in range(world_size))):
        for fmt in rows[0]["async_stall_s"]:
            stalls.setdefault(fmt, []).append(max(row["async_stall_s"][fmt] for row in rows))
    out["async_stall_s"] = {
        fmt: {"median": round(statistics.median(v), 3), "rounds": [round(x, 3) for x in v]}
        for fmt, v in stalls.items()
    }
    return out


def sha256_gbps(nbytes: int = 256 << 20) -> float:
    data = os.urandom(nbytes)
    start = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return round(nbytes / _GB / (time.perf_counter() - start), 3)


def _conditions(args: argparse.Namespace, root: pathlib.Path) -> dict[str, Any]:
    config = io_model(args)
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dir": str(root),
        "format": args.format,
        "io_model_parameters": config.num_parameters(),
        "io_model_weights_gb": round(config.num_parameters() * 4 / _GB, 3),
        "io_model": {
            "hidden_size": config.hidden_size,
            "num_layers": config.num_layers,
            "vocab_size": config.vocab_size,
        },
        "reads": "page cache (just written); ours: every opened file's size checked, every "
        "tensor piece read sha256-verified (files are not hashed whole): see read_gb / "
        "verified_gb; DCP: as DCP reads (no check), and *_with_sha256 with our digests",
        "dcp_writer": "FileSystemWriter(sync_files=True, single_file_per_rank=True), "
        "dcpN: thread_count N",
        "overhead_run": "one process, mock data, "
        + ("the io model" if args.overhead_io_model else "the demo's small preset"),
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    only_conversion = args.megatron_conversion
    try:
        result: dict[str, Any] = {
            "benchmark": "checkpoint_io",
            "conditions": _conditions(args, root),
            "sha256_gbps": sha256_gbps(),
        }
        if not (args.skip_io or only_conversion):
            if args.skip_single:
                result["io"] = [measure_plan(args.ranks, args, root)]
            else:
                result["io"] = [
                    measure_plan(1, args, root, keep=True),
                    measure_plan(args.ranks, args, root, reshard_from=root / "plan1"),
                ]
            shutil.rmtree(root / "plan1", ignore_errors=True)
        if not (args.skip_overhead or only_conversion):
            result["async_overhead"] = measure_overhead(args, root, io_model(args))
        if not args.skip_conversion or only_conversion:
            result["megatron_conversion"] = measure_conversion(args, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
