"""torch.distributed.checkpoint (DCP) beside our checkpoint format, for ``bench.checkpoint_io``.

A rank's state as a DCP user writes it: ``{"model": {global name: tensor}, "optim": {global
name: {"step", "exp_avg", "exp_avg_sq"}}, "train": {...}}``, plain tensors under global names
(with a pipeline-only plan every tensor of a stage is whole, so DCP's resharding by names is
all a change of pipeline split needs). ``dcp.save`` writes it with a ``FileSystemWriter``
(``thread_count`` files per rank, fsync'ed) and ``dcp.load`` reads it back into preallocated
tensors, each rank reading only its keys.

Our integrity on top (measured apart, so the comparison is like for like): at save every
tensor's sha256 (:func:`~megatron_het.checkpoint.integrity.tensor_sha256`, as our shards
record each piece), written to ``integrity_<rank>.json`` beside DCP's files; at load every
tensor read is hashed and checked against it. The check also proves the load bitwise.

:class:`DcpAsyncSaves` is ``dcp.async_save`` as a one-process run would use it: one save in
flight, on a gloo group of its own, and the tracker file written once DCP's future is done.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron_het.checkpoint.integrity import tensor_paths, tensor_sha256
from megatron_het.checkpoint.names import TRACKER_FILE, iteration_dir_name

THREAD_COUNTS = (1, 2)  # FileSystemWriter's writer threads (and files per rank)
INTEGRITY_PREFIX = "integrity_"
GB = 1e9


def dcp_state(
    model: dict[str, torch.Tensor], optimizer: dict[str, dict[str, Any]], train: dict[str, Any]
) -> dict[str, Any]:
    """The state dict a DCP user saves: the model's and optimizer's tensors by global name."""
    return {
        "model": dict(model),
        "optim": {n: dict(e) for n, e in optimizer.items()},
        "train": train,
    }


def empty_like_state(state: Any) -> Any:
    """``state`` with every tensor replaced by an uninitialised one of its shape and dtype
    (what ``dcp.load`` fills in place); other values are kept (DCP replaces them)."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    return state


def state_nbytes(state: Any) -> int:
    """Bytes of every tensor in ``state``."""
    return sum(t.numel() * t.element_size() for t in tensor_paths(state).values())


def dir_bytes(directory: pathlib.Path) -> int:
    """Bytes of DCP's files in ``directory`` (our digests left out)."""
    return sum(
        p.stat().st_size
        for p in directory.iterdir()
        if p.is_file() and not p.name.startswith(INTEGRITY_PREFIX)
    )


def save(state: Any, directory: pathlib.Path, thread_count: int) -> float:
    """``dcp.save`` of this rank's ``state`` into ``directory`` (collective over the default
    group); seconds."""
    start = time.perf_counter()
    writer = dcp.FileSystemWriter(directory, thread_count=thread_count, sync_files=True)
    dcp.save(state, storage_writer=writer)
    return time.perf_counter() - start


def load(state: Any, directory: pathlib.Path) -> float:
    """``dcp.load`` into this rank's preallocated ``state`` (collective); seconds."""
    start = time.perf_counter()
    dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    return time.perf_counter() - start


def write_digests(state: Any, directory: pathlib.Path, rank: int) -> float:
    """Our integrity on DCP, save side: every tensor's sha256 into ``integrity_<rank>.json``
    (fsync'ed) in ``directory``; seconds."""
    start = time.perf_counter()
    digests = {key: tensor_sha256(t) for key, t in tensor_paths(state).items()}
    path = directory / f"{INTEGRITY_PREFIX}{rank}.json"
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(digests, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return time.perf_counter() - start


def verify_digests(state: Any, directory: pathlib.Path) -> float:
    """Our integrity on DCP, load side: hash every tensor of the loaded ``state`` and check it
    against the digests the saving ranks wrote; seconds. RuntimeError on a mismatch."""
    start = time.perf_counter()
    recorded: dict[str, str] = {}
    for path in sorted(directory.glob(f"{INTEGRITY_PREFIX}*.json")):
        recorded.update(json.loads(path.read_text(encoding="utf-8")))
    for key, tensor in tensor_paths(state).items():
        if recorded.get(key) != tensor_sha256(tensor):
            raise RuntimeError(f"DCP checkpoint {directory}: {key} differs from what was saved")
    return time.perf_counter() - start


def round_row(
    state: Any, directory: pathlib.Path, thread_count: int, rank: int, barrier: Any
) -> dict[str, Any]:
    """One DCP save + load round of this rank (collective): seconds of the save, of our digests,
    of the load into fresh tensors and of their verification, and the bytes."""
    barrier()
    write_s = save(state, directory, thread_count)
    hash_s = write_digests(state, directory, rank)
    barrier()
    target = empty_like_state(state)
    read_s = load(target, directory)
    verify_s = verify_digests(target, directory)
    barrier()
    nbytes = state_nbytes(state)
    return {
        "write_s": write_s,
        "hash_s": hash_s,
        "read_s": read_s,
        "verify_s": verify_s,
        "bytes": dir_bytes(directory) if rank == 0 else 0,
        "tensor_bytes": nbytes,
    }


def resharded_row(state: Any, directory: pathlib.Path, barrier: Any) -> dict[str, Any]:
    """This rank's keys of another plan's DCP checkpoint loaded and verified (collective)."""
    barrier()
    target = empty_like_state(state)
    read_s = load(target, directory)
    verify_s = verify_digests(target, directory)
    barrier()
    return {"read_s": read_s, "verify_s": verify_s, "tensor_bytes": state_nbytes(state)}


def plan_round(
    state: Any,
    root: pathlib.Path,
    thread_count: int,
    iteration: int,
    reshard_source: pathlib.Path | None,
    world: Any,
) -> dict[str, Any]:
    """One round of a plan's rank (collective over ``world``, which has ``rank`` and
    ``barrier()``): :func:`round_row` into ``root/iter_XXXXXXX`` and, with ``reshard_source``
    (another plan's DCP checkpoint), :func:`resharded_row` of it; the previous round's
    checkpoint is then removed."""
    directory = root / f"iter_{iteration:07d}"
    row = round_row(state, directory, thread_count, world.rank, world.barrier)
    if reshard_source is not None:
        row["resharded"] = resharded_row(state, reshard_source, world.barrier)
    if world.rank == 0 and iteration > 1:
        shutil.rmtree(root / f"iter_{iteration - 1:07d}", ignore_errors=True)
    return row


def _rate(nbytes: float, rows: Sequence[dict], *keys: str) -> float:
    """GB/s of ``nbytes`` over the slowest rank's summed ``keys`` seconds."""
    return nbytes / GB / max(sum(row[k] for k in keys) for row in rows)


def _reads(rounds: list) -> dict[str, Any]:
    tensor = [sum(row["tensor_bytes"] for row in rows) for rows in rounds]
    read = [_rate(b, rows, "read_s") for b, rows in zip(tensor, rounds)]
    checked = [_rate(b, rows, "read_s", "verify_s") for b, rows in zip(tensor, rounds)]
    verify_s = [sum(row["verify_s"] for row in rows) / (b / GB) for b, rows in zip(tensor, rounds)]
    return {
        "read_gbps": round(statistics.median(read), 3),
        "read_gb": round(tensor[-1] / GB, 3),
        "read_gbps_with_sha256": round(statistics.median(checked), 3),
        "verify_s_per_gb": round(statistics.median(verify_s), 3),
        "read_gbps_rounds": [round(v, 3) for v in read],
    }


def figures(rounds: list, resharded: bool) -> dict[str, Any]:
    """DCP's figures from its rows: write and read GB/s as ours are counted, and what our
    per-tensor sha256 adds (core-seconds per GB hashed; GB/s with the hashing run after the
    write and after the read, as a layer on top of DCP would)."""
    nbytes = rounds[0][0]["bytes"]
    tensor = [sum(row["tensor_bytes"] for row in rows) for rows in rounds]
    write = [_rate(nbytes, rows, "write_s") for rows in rounds]
    hashed = [_rate(nbytes, rows, "write_s", "hash_s") for rows in rounds]
    hash_s = [sum(row["hash_s"] for row in rows) / (b / GB) for b, rows in zip(tensor, rounds)]
    out = {
        "checkpoint_gb": round(nbytes / GB, 3),
        "write_gbps": round(statistics.median(write), 3),
        "write_gbps_with_sha256": round(statistics.median(hashed), 3),
        "sha256_s_per_gb": round(statistics.median(hash_s), 3),
        **_reads(rounds),
        "write_gbps_rounds": [round(v, 3) for v in write],
    }
    if resharded:
        out["resharded"] = _reads([tuple(row["resharded"] for row in rows) for rows in rounds])
    return out


def trainer_state(trainer: Any) -> dict[str, Any]:
    """The trainer's state as a DCP user hands it to ``dcp.async_save``: the same tensors our
    saver writes (float32 masters where kept, else the parameters; the optimizer's CPU copies
    of its moments), the counters and the generators."""
    from megatron_het.training.state import rng_state

    optimizer = trainer.optimizer
    optimizer.params_ready()
    weights = optimizer.master_weights() or {
        n: p.detach() for n, p in trainer.stage.named_parameters()
    }
    progress = trainer.progress
    train = {
        "iteration": progress.iteration,
        "consumed_samples": progress.consumed_samples,
        "rng": rng_state(trainer.device.type),
    }
    return dcp_state(weights, optimizer.state_dict(), train)


class DcpAsyncSaves:
    """``dcp.async_save`` of one process's state into ``save_dir/iter_XXXXXXX``: one save in
    flight; when its future is done the tracker file is replaced (the commit a DCP user adds).
    Uses a gloo group of its own, so the writer thread's collectives never meet training's."""

    def __init__(self, save_dir: pathlib.Path, thread_count: int = 1) -> None:
        self.save_dir, self.thread_count = save_dir, thread_count
        self.group = dist.new_group(backend="gloo")
        self._pending: tuple[Future, int] | None = None

    def start(self, state: Any, iteration: int) -> pathlib.Path:
        """Finish the previous save, then stage ``state`` (DCP copies it) and write it on a
        background thread; returns the iteration directory."""
        self.finish()
        path = self.save_dir / iteration_dir_name(iteration)
        writer = dcp.FileSystemWriter(path, thread_count=self.thread_count, sync_files=True)
        future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
        assert isinstance(future, Future)  # without async staging DCP returns the upload future
        self._pending = (future, iteration)
        return path

    def poll(self) -> None:
        """Commit the pending save if its write is done."""
        if self._pending is not None and self._pending[0].done():
            self.finish()

    def finish(self) -> None:
        """Wait for the pending save and commit it."""
        if self._pending is None:
            return
        future, iteration = self._pending
        self._pending = None
        future.result()
        tracker = self.save_dir / TRACKER_FILE
        temporary = tracker.with_name(f".{TRACKER_FILE}.tmp")
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(f"{iteration}\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, tracker)

    def close(self) -> None:
        """Wait for a pending write without committing it."""
        if self._pending is not None:
            self._pending[0].exception()
            self._pending = None
