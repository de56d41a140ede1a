"""The TP rings of ``--tp-comm-overlap`` on one device: ranks as threads of one process.

TP needs two devices of one kind, which one GPU cannot give; the rings'
(:mod:`megatron_het.tensor_parallel.comm_overlap`) arithmetic on the device can still be
checked. :class:`ThreadRing` runs ``size`` ranks as threads that exchange tensors through
queues in place of a process group, and :func:`ring_errors` compares each rank's ring results
(forward and backward of both ring operations, a micro-batch of one and of two) with the plain
products of the whole tensors computed in float32 on the CPU.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from megatron_het.comm.p2p import P2POp
from megatron_het.tensor_parallel.comm_overlap import all_gather_linear, linear_reduce_scatter

SEED = 4321
# Seconds a rank waits for a peer's block before the check fails instead of hanging (well
# inside the numerics check's budget, so a hang shows as this failure, not as a timeout).
WAIT_S = 20.0


class _Received:
    """The handle of a receive: ``wait()`` copies the block the peer put in the queue."""

    def __init__(self, box: queue.Queue, into: torch.Tensor) -> None:
        self.box, self.into = box, into

    def wait(self) -> None:
        self.into.copy_(self.box.get(timeout=WAIT_S))


class _Sent:
    def wait(self) -> None:
        pass


class ThreadRing:
    """``size`` ranks as threads of one process; :meth:`member` is rank r's view of the group
    (``size``, ``rank``, ``ranks`` and ``batch_isend_irecv``, as the rings use it)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ranks = tuple(range(size))
        self._boxes: dict[tuple[int, int, int], queue.Queue] = {}
        self._lock = threading.Lock()

    def _box(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._boxes.setdefault((src, dst, tag), queue.Queue())

    def member(self, rank: int) -> Any:
        ring = self

        class Member:
            size, ranks = ring.size, ring.ranks

            def __init__(self) -> None:
                self.rank = rank

            def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Any]:
                handles: list[Any] = []
                for op in ops:
                    if op.op == "isend":
                        ring._box(rank, op.peer, op.tag).put(op.tensor.detach().clone())
                        handles.append(_Sent())
                    else:
                        handles.append(_Received(ring._box(op.peer, rank, op.tag), op.tensor))
                return handles

        return Member()

    def run(self, work: Callable[[Any], Any]) -> list[Any]:
        """``work(member)`` on every rank at once; the results by rank (a rank's exception is
        raised here, with its rank).

        Each rank's backward runs on its own thread: autograd otherwise runs the backward of
        CUDA graphs on one worker thread per device, where one rank's ring backward, waiting
        for its peer's block, would block the peer's backward queued behind it."""
        results: list[Any] = [None] * self.size
        errors: list[tuple[int, BaseException]] = []

        def target(r: int) -> None:
            try:
                with torch.autograd.set_multithreading_enabled(False):
                    results[r] = work(self.member(r))
            except BaseException as error:
                errors.append((r, error))

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            rank, error = errors[0]
            raise RuntimeError(f"TP ring rank {rank} failed: {error}") from error
        return results


def _randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def ring_errors(
    device: str, dtype: torch.dtype, tp: int = 2, seq: int = 256, hidden: int = 128
) -> float:
    """The largest error (max |difference| over max |value| of each tensor) of the rings'
    outputs and gradients on ``device`` in ``dtype`` against float32 products of the whole
    tensors on the CPU, over micro-batches of one and two."""
    worst = 0.0
    for batch in (1, 2):
        g = torch.Generator().manual_seed(SEED + batch)
        x = _randn(g, batch, seq, hidden)
        gate, up = _randn(g, tp, 48, hidden), _randn(g, tp, 32, hidden)  # per-rank shards
        down = 0.1 * _randn(g, tp, hidden, 40)
        dy_gather = [_randn(g, tp, batch, seq, n) for n in (48, 32)]
        act = _randn(g, tp, batch, seq, 40)
        dy_scatter = _randn(g, batch, seq, hidden)
        block = seq // tp
        ring = ThreadRing(tp)

        def on_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype).requires_grad_()

        def rank_work(group: Any) -> dict[str, torch.Tensor]:
            r = group.rank
            xs = on_device(x[:, r * block : (r + 1) * block])
            ws = [on_device(gate[r]), on_device(up[r])]
            outs = all_gather_linear(xs, ws, group)
            sum(
                (o * d[r].to(device=device, dtype=dtype)).sum() for o, d in zip(outs, dy_gather)
            ).backward()
            a, wd = on_device(act[r]), on_device(down[r])
            y = linear_reduce_scatter(a, wd, group)
            (
                y * dy_scatter[:, r * block : (r + 1) * block].to(device=device, dtype=dtype)
            ).sum().backward()
            return {
                "gate": outs[0],
                "up": outs[1],
                "x.grad": xs.grad,
                "gate.grad": ws[0].grad,
                "up.grad": ws[1].grad,
                "y": y,
                "act.grad": a.grad,
                "down.grad": wd.grad,
            }

        results = ring.run(rank_work)
        expected_y = sum(F.linear(act[r], down[r]) for r in range(tp))
        dx = sum(dy_gather[0][r] @ gate[r] + dy_gather[1][r] @ up[r] for r in range(tp))
        for r, got in enumerate(results):
            rows = slice(r * block, (r + 1) * block)
            want = {
                "gate": F.linear(x, gate[r]),
                "up": F.linear(x, up[r]),
                "x.grad": dx[:, rows],
                "gate.grad": dy_gather[0][r].reshape(-1, 48).t() @ x.reshape(-1, hidden),
                "up.grad": dy_gather[1][r].reshape(-1, 32).t() @ x.reshape(-1, hidden),
                "y": expected_y[:, rows],
                "act.grad": dy_scatter @ down[r],
                "down.grad": dy_scatter.reshape(-1, hidden).t() @ act[r].reshape(-1, 40),
            }
            for name, expected in want.items():
                actual = got[name].detach().float().cpu()
                scale = float(expected.abs().max())
                worst = max(worst, float((actual - expected).abs().max()) / max(scale, 1e-30))
    return worst
