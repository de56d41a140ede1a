"""tools/comm_bench.py as README runs it: torchrun over the emulated cluster, every op's result
checked on every rank, both implementations timed at every size; and its one-line errors."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
CLUSTER = str(REPO / "scripts" / "clusters" / "cpu_emulated.yaml")


def _bench(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "tools/comm_bench.py",
        "--cluster",
        CLUSTER,
        *args,
    ]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_the_sweep_checks_and_times_every_op_and_size(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    proc = _bench(4, "--max-bytes", "4K", "--iters", "2", "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    ops = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"}
    assert {r["op"] for r in records} == ops
    assert {(r["op"], r["impl"], r["bytes"]) for r in records} == {
        (op, impl, size) for op in ops for impl in ("flat", "unified") for size in (1024, 4096)
    }
    assert all(r["correct"] and r["time_us"] > 0 and r["world_size"] == 4 for r in records)
    assert records[0]["kinds"] == ["emu-fast"] * 2 + ["emu-slow"] * 2
    assert "unified/flat busbw" in proc.stdout


@pytest.mark.slow
def test_a_world_other_than_the_clusters_stops_with_one_line() -> None:
    proc = _bench(2, "--max-bytes", "1K")
    errors = {line for line in proc.stderr.splitlines() if line.startswith("error:")}
    assert proc.returncode != 0
    assert errors == {
        "error: torchrun started 2 ranks but cluster cpu_emulated has 4; use "
        "--nproc_per_node (and --nnodes) to match it"
    }, proc.stderr[-2000:]
