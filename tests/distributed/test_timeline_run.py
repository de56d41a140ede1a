"""EMULATION: ``--profile`` on 4 emulated ranks of two kinds (run_ranks, gloo): the merged
Chrome trace holds every rank's spans as the executor ran its schedule, with the predicted
schedule beside each rank.

The plan interleaves 4 chunks of a 6-layer model over a tp=2 emu-fast group (ranks 0-1) and a
tp=1 emu-slow group (rank 2) on 3 micro-batches, beside a second replica of the whole model on
rank 3 (emu-slow, 1 micro-batch): two kinds, interleaving, a TP change at every boundary and
heterogeneous data parallelism in one trace.
"""

from __future__ import annotations

import io
import json
import pathlib
from collections import Counter

import pytest

from megatron_het.arguments import parse_run_config
from megatron_het.pipeline.schedules import Action, ActionKind, build_schedule
from megatron_het.trace.chrome import read_trace, tracks_of, validate_chrome_trace
from tests.distributed.harness import run_ranks

REPO = pathlib.Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "clusters" / "cpu_emulated.yaml"
PLAN = {
    "format": "megatron_het.plan/1",
    "description": "EMULATION: interleaved tp=2 emu-fast / tp=1 emu-slow, and rank 3 alone",
    "micro_batch_size": 2,
    "pipelines": [
        {
            "micro_batches": 3,
            "stages": [
                {"accelerator": "emu-fast", "tp": 2, "layers": [0, 2], "ranks": [0, 1]},
                {"accelerator": "emu-slow", "tp": 1, "layers": [2, 3], "ranks": [2]},
                {"accelerator": "emu-fast", "tp": 2, "layers": [3, 5], "ranks": [0, 1]},
                {"accelerator": "emu-slow", "tp": 1, "layers": [5, 6], "ranks": [2]},
            ],
        },
        {
            "micro_batches": 1,
            "stages": [{"accelerator": "emu-slow", "tp": 1, "layers": [0, 6], "ranks": [3]}],
        },
    ],
}
# rank -> (pipeline's device groups, chunks, micro-batches, the rank's device group)
PLACES = {0: (2, 2, 3, 0), 1: (2, 2, 3, 0), 2: (2, 2, 3, 1), 3: (1, 1, 1, 0)}


def _worker(rank: int, world_size: int, argv: list[str]) -> str:
    from megatron_het.training import pretrain_on_world

    out = io.StringIO()
    pretrain_on_world(parse_run_config(argv), world_size, out=out)
    return out.getvalue()


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    root = tmp_path_factory.mktemp("timeline")
    plan = root / "plan.json"
    plan.write_text(json.dumps(PLAN))
    board = root / "board"
    argv = [
        *("--model", "tiny", "--num-layers", "6", "--mock-data"),
        *("--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--seq-length", "32"),
        *("--cluster", str(CLUSTER), "--plan", str(plan)),
        *("--train-iters", "3", "--eval-iters", "0", "--log-interval", "1"),
        *("--profile", "--profile-step-start", "2", "--profile-step-end", "4"),
        *("--profile-ranks", "0", "1", "2", "3", "--tensorboard-dir", str(board)),
    ]
    text = "".join(run_ranks(_worker, 4, argv, timeout=180))
    (path,) = board.glob("timeline_*.json")
    return read_trace(path), text


def compute_order(rank: int) -> list[tuple[str, int, int]]:
    """(kind, global stage, micro-batch) of each compute step the executor runs on ``rank``."""
    groups, chunks, micro_batches, group = PLACES[rank]
    steps = build_schedule("1f1b", groups, micro_batches, num_chunks=chunks)[group]
    out = []
    for step in steps:
        if isinstance(step, Action) and step.kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
            stage = group if step.stage is None else step.stage
            out.append((step.kind.value, stage, step.micro_batch))
    return out


def by_iteration(events: list[dict]) -> dict[int, list[dict]]:
    """Complete events grouped by the iteration span they fall in."""
    iterations = [e for e in events if e["cat"] == "iteration"]
    out: dict[int, list[dict]] = {int(i["args"]["iteration"]): [] for i in iterations}
    for e in events:
        for it in iterations:
            if e["cat"] != "iteration" and it["ts"] <= e["ts"] <= it["ts"] + it["dur"]:
                out[int(it["args"]["iteration"])].append(e)
    return out


@pytest.mark.slow
def test_the_trace_is_a_valid_chrome_trace_of_every_rank(traced: tuple[dict, str]) -> None:
    trace, text = traced
    assert validate_chrome_trace(trace) == []
    assert "timeline of iterations 2-3 (ranks 0, 1, 2, 3) written to " in text
    names = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    assert names[0] == "rank 0 · emu-fast (emulated) · stages 0,2 · tp 0/2"
    assert names[8] == "rank 2 · emu-slow (emulated) · stages 1,3 · tp 0/1"
    assert names[12] == "rank 3 · emu-slow (emulated) · pipeline 1 stage 0 · tp 0/1"
    assert {tid for tid in names if tid % 4 == 1} == {1, 5, 9, 13}  # predicted, every rank


@pytest.mark.slow
def test_each_rank_ran_its_schedule_in_order(traced: tuple[dict, str]) -> None:
    trace, _ = traced
    for rank, sides in tracks_of(trace).items():
        iterations = by_iteration(sides["measured"])
        assert sorted(iterations) == [2, 3]
        for events in iterations.values():
            compute = [e for e in events if e["cat"] == "compute"]
            ran = [
                (e["name"].split()[0], e["args"]["stage"], e["args"]["micro_batch"])
                for e in compute
            ]
            assert ran == compute_order(rank), rank
            for a, b in zip(compute, compute[1:]):  # one compute at a time
                assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (rank, a["name"], b["name"])
            kinds = [e["name"] for e in events if e["cat"] == "step"]
            assert "DP gradient sync" in kinds and "optimizer step" in kinds
        predicted = [e for e in sides["predicted"] if e["cat"] == "compute"]
        ran = Counter(
            (e["name"].split()[0], e["args"]["stage"], e["args"]["micro_batch"]) for e in predicted
        )
        assert ran == Counter(compute_order(rank) * 2), rank


def _transfers(events: list[dict]) -> list[tuple[dict, dict]]:
    return [(e, t) for e in events if e["name"].startswith("post") for t in e["args"]["transfers"]]


@pytest.mark.slow
def test_every_send_meets_its_receive(traced: tuple[dict, str]) -> None:
    trace, _ = traced
    tracks = tracks_of(trace)
    posts = {rank: by_iteration(sides["measured"]) for rank, sides in tracks.items()}
    matched = 0
    pairs = {"send_forward": ("recv_forward", 1), "send_backward": ("recv_backward", -1)}
    for rank, iterations in posts.items():
        for number, events in iterations.items():
            for post, sent in _transfers(events):
                if sent["kind"] not in pairs:
                    continue
                want, step = pairs[sent["kind"]]
                for peer in sent["peers"]:
                    found = [
                        (p, t)
                        for p, t in _transfers(posts[peer][number])
                        if t["kind"] == want
                        and t["stage"] == sent["stage"] + step
                        and t["micro_batch"] == sent["micro_batch"]
                        and rank in t["peers"]
                    ]
                    assert len(found) == 1, (rank, peer, sent)
                    # the receive was not done before the send was posted
                    received_post = found[0][0]
                    wait = next(
                        e
                        for e in posts[peer][number]
                        if e["name"] == "wait" + received_post["name"][len("post") :]
                        and e["ts"] >= received_post["ts"]
                    )
                    assert wait["ts"] + wait["dur"] >= post["ts"] - 1e3, (rank, peer, sent)
                    matched += 1
    received = sum(
        len(t["peers"])
        for iterations in posts.values()
        for events in iterations.values()
        for _, t in _transfers(events)
        if t["kind"].startswith("recv")
    )
    assert matched == received  # and every receive met a send
    # Per micro-batch: forward, one message over each tp=2 -> tp=1 boundary (0->1, 2->3) and
    # two over 1->2 (rank 2 feeds both TP ranks); backward two over 3->2 and 1->0, one over
    # 2->1. 9 x 3 micro-batches x 2 iterations.
    assert matched == 9 * 3 * 2


@pytest.mark.slow
def test_collectives_sit_where_they_ran(traced: tuple[dict, str]) -> None:
    trace, _ = traced
    tracks = tracks_of(trace)
    for rank in (0, 1):  # the tp=2 group's reductions run inside its forwards and backwards
        events = tracks[rank]["measured"]
        compute = [e for e in events if e["cat"] == "compute"]
        tp = [e for e in events if e["cat"] == "collective" and e["args"]["group"] == "tp-p0s0"]
        assert tp and all(
            any(c["ts"] <= e["ts"] and e["ts"] + e["dur"] <= c["ts"] + c["dur"] for c in compute)
            for e in tp
        )
    # rank 3's replica sums its gradients with the other kind's ranks: across the bridge
    paths = {e["args"]["path"] for e in tracks[3]["measured"] if e["cat"] == "collective"}
    assert any(path.startswith("bridge") for path in paths), paths
