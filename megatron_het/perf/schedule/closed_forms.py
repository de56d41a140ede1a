"""Analytic models of 1F1B pipelines, plain and interleaved: closed forms, lower bounds, bubbles.

The event-driven simulation (:mod:`megatron_het.perf.schedule.simulator`) is what the
predictor reports; these formulas are the checks beside it and the fast estimate:
:func:`closed_form_pipeline` is the one pipeline time both ``predict(...,
pipeline_model="closed_form")`` and the planner's per-stage model
(:meth:`~megatron_het.planner.stage_model.StageModel.iteration_time`) price a pipeline with
(with :func:`last_backward_ends` for the overlap of the DP reduction).
Inputs are per stage (a model chunk of an interleaved device group), in seconds per
micro-batch; ``p2p_*_s[b]`` is the transfer over boundary b (stage b to b + 1) each way. See each
docstring for its formula and when it is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_het.pipeline.schedules import interleaved_warmup


def closed_form_1f1b(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    num_micro_batches: int,
    p2p_forward_s: Sequence[float] | None = None,
    p2p_backward_s: Sequence[float] | None = None,
) -> float:
    """Iteration time of non-interleaved 1F1B with non-uniform stages, analytically.

    ``T = sum_s (f_s + b_s) + sum_b (c_b^f + c_b^b) + (m - 1) * max_s (f_s + b_s + k_s)``

    The first micro-batch's forward and backward cross every stage and boundary once (the
    critical path's ramp); the other ``m - 1`` go at the pace of the slowest stage's 1F1B cycle,
    which with blocking transfers includes its steady-state p2p: ``k_s`` is
    ``max(c_s^f, c_s^b)`` towards the next stage (send activations while receiving gradients)
    plus ``max(c_{s-1}^b, c_{s-1}^f)`` towards the previous one.

    Exact for uniform stages without p2p (``(m + p - 1)(f + b)``), and with p2p for p <= 2 or
    m = 1. With uniform p2p ``c`` and p >= 3, m >= 2 the simulation is exactly ``c`` below it
    (one steady-state exchange of the middle stages overlaps the ramp). In general the
    simulation lies between :func:`lower_bound_1f1b` and this value (tested on random stages),
    so the closed form is an upper bound.
    """
    f, b, m = list(forward_s), list(backward_s), num_micro_batches
    p = len(f)
    cf = list(p2p_forward_s or [0.0] * (p - 1))
    cb = list(p2p_backward_s or [0.0] * (p - 1))
    cycle = [
        f[s]
        + b[s]
        + (max(cf[s], cb[s]) if s < p - 1 else 0.0)
        + (max(cf[s - 1], cb[s - 1]) if s > 0 else 0.0)
        for s in range(p)
    ]
    return sum(f) + sum(b) + sum(cf) + sum(cb) + (m - 1) * max(cycle)


def closed_form_pipeline(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    num_micro_batches: int,
    num_chunks: int = 1,
    p2p_forward_s: Sequence[float] | None = None,
    p2p_backward_s: Sequence[float] | None = None,
    overlap_p2p: bool = False,
) -> float:
    """The closed-form time of one pipeline: :func:`closed_form_1f1b` for a plain one
    (``num_chunks`` 1; ``overlap_p2p`` changes nothing there), else
    :func:`closed_form_interleaved` over ``len(forward_s) // num_chunks`` device groups.
    Per-stage inputs in pipeline order (stage ``c p + g`` is chunk c of group g)."""
    if num_chunks == 1:
        return closed_form_1f1b(
            forward_s, backward_s, num_micro_batches, p2p_forward_s, p2p_backward_s
        )
    return closed_form_interleaved(
        forward_s,
        backward_s,
        num_micro_batches,
        num_chunks,
        p2p_forward_s,
        p2p_backward_s,
        overlap_p2p,
    )


def closed_form_interleaved_bubble(
    num_groups: int, num_chunks: int, num_micro_batches: int
) -> float:
    """The bubble of interleaved 1F1B relative to the ideal time ``m (F + B)`` (F, B: a group's
    forward and backward per micro-batch over all its chunks): ``(p - 1) / (v m)``.

    The fill and drain cross ``p - 1`` groups at the pace of one chunk, ``(F + B) / v``, so
    ``T = m (F + B) + (p - 1) (F + B) / v``; with ``v = 1`` it is 1F1B's ``(m + p - 1)(f + b)``.
    Exact (the simulation gives it) for uniform stages without p2p, m a multiple of p.
    """
    return (num_groups - 1) / (num_chunks * num_micro_batches)


def lower_bound_1f1b(
    forward_s: Sequence[float], backward_s: Sequence[float], num_micro_batches: int
) -> float:
    """No schedule beats this: some stage k must run all m micro-batches' forward and backward,
    after the first micro-batch reached it and before its gradient leaves for stage 0."""
    f, b, m = list(forward_s), list(backward_s), num_micro_batches
    return max(sum(f[:k]) + sum(b[:k]) + m * (f[k] + b[k]) for k in range(len(f)))


def bubble_fraction(
    makespan_s: float,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    num_micro_batches: int,
) -> float:
    """Fraction of the pipeline time the busiest stage is idle: ``1 - m (f+b)_max / T``.

    For uniform 1F1B without p2p it is ``(p - 1) / (m + p - 1)``. (Interleaved: pass the
    per-group sums of f and b.)
    """
    busiest = max(f + b for f, b in zip(forward_s, backward_s)) * num_micro_batches
    return 0.0 if makespan_s <= 0 else max(0.0, 1.0 - busiest / makespan_s)


def group_sums(
    num_groups: int, forward_s: Sequence[float], backward_s: Sequence[float]
) -> tuple[list[float], list[float]]:
    """Per device group, the forward and backward seconds of all its chunks (stage s on group
    s % num_groups) per micro-batch."""
    f = [sum(forward_s[g::num_groups]) for g in range(num_groups)]
    b = [sum(backward_s[g::num_groups]) for g in range(num_groups)]
    return f, b


def last_backward_ends(
    backward_s: Sequence[float],
    makespan_s: float,
    num_groups: int,
    p2p_backward_s: Sequence[float] | None = None,
) -> list[float]:
    """When each device group's last backward ends, 1F1B plain or interleaved (stage s on group
    ``s % num_groups``; per-stage inputs), given the pipeline's ``makespan_s``.

    ``c_g = T - sum_{k<g} (b_k + c^b_k)``

    The last micro-batch's gradient crosses stages ``g, g - 1, .., 0`` (the chunk-0 stages,
    one per group) last: stage ``k``'s last backward can start only once stage ``k + 1``'s
    has ended and its gradient has crossed boundary k, and stage 0's ends the pipeline
    (``c_0 = T``). So ``c_{k+1} <= c_k - b_k - c^b_k`` in any such schedule, with equality
    when stage k waits for that gradient (uniform stages do; a stage slower than the next has
    a backlog and ends even later than its successor's ``c + b + c^b``). Given the simulated
    ``T``, these values are upper bounds on the simulated ends (the gaps ``T - c_g`` lower
    bounds), and equal them for uniform stages.
    """
    b = list(backward_s)
    cb = list(p2p_backward_s or [0.0] * (len(b) - 1))
    ends, end = [], makespan_s
    for g in range(num_groups):
        ends.append(end)
        if g < num_groups - 1:
            end -= b[g] + cb[g]
    return ends


def _group_work(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    num_chunks: int,
    p2p_forward_s: Sequence[float] | None,
    p2p_backward_s: Sequence[float] | None,
) -> tuple[int, list[float], list[float], list[float]]:
    """(groups, per-group forward + backward per micro-batch, per-boundary p2p each way)."""
    n = len(forward_s)
    work = [x + y for x, y in zip(*group_sums(n // num_chunks, forward_s, backward_s))]
    return (
        n // num_chunks,
        work,
        list(p2p_forward_s or [0.0] * (n - 1)),
        list(p2p_backward_s or [0.0] * (n - 1)),
    )


def closed_form_interleaved(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    num_micro_batches: int,
    num_chunks: int,
    p2p_forward_s: Sequence[float] | None = None,
    p2p_backward_s: Sequence[float] | None = None,
    overlap_p2p: bool = False,
) -> float:
    """Iteration time of interleaved 1F1B, analytically; per-stage inputs, ``n = v p`` stages,
    stage s on device group ``s % p``.

    ``T = m sum_c max_g w_{c,g} + (sum_g W_g - W_max) / v + x (m v + w_0 - 1)``

    ``w_{c,g}`` is the forward and backward of group g's chunk c (stage ``c p + g``) for one
    micro-batch, ``W_g = sum_c w_{c,g}``. Every group runs its chunks in rounds (chunk c for a
    micro-batch group of p or more, then chunk c + 1), and in each round the slowest group sets
    the pace: the steady state takes ``m sum_c max_g w_{c,g}``, which is ``m W_max`` when each
    group's chunks are alike (chunks of unequal size make the groups wait on each other; on
    random such chunks the simulation lies a few percent below this). The fill and drain cross
    the other groups at the pace of one of their chunks, ``W_g / v`` each (with ``v = 1`` and no
    p2p this is :func:`closed_form_1f1b`; with uniform groups it is the bubble ``(p - 1) / (v
    m)`` of :func:`closed_form_interleaved_bubble`). With blocking transfers each exchange step
    of group 0's list waits one transfer: ``m v + w_0 - 1`` of them (``w_0``: its warm-up
    forwards; :func:`~megatron_het.pipeline.schedules.interleaved_warmup`), each costed at
    ``x``, the slowest boundary's transfer either way.

    Exact (the simulation gives it) for uniform chunks without p2p, ``m (F + B)(1 + (p - 1) /
    (v m))``, and with uniform p2p for ``m >= 2 p``. Otherwise an estimate (one slow boundary
    does not delay every exchange); :func:`lower_bound_interleaved` is the sound check.

    ``overlap_p2p`` (transfers posted without waiting,
    :func:`~megatron_het.pipeline.schedules.overlap_transfers`; ``m > p``): the steady state
    hides an activation transfer behind the backward that follows it and a gradient transfer
    behind the next forward, so only one micro-batch's way through every boundary and back,
    ``sum_b (c^f_b + c^b_b)``, is paid, plus per micro-step the most any transfer exceeds what
    covers it: the sender's backward (for activations; the receiver's forward for gradients)
    and the idle time of its stage in a round, ``P_c - w_s`` (``P_c``: the slowest chunk of
    the round). Exact for uniform stages and p2p no longer than their forward, ``m >= 2 p``;
    an estimate beyond (on 1,500 random pipelines with transfers up to their compute it lay
    between 10% below and 30% above the simulation, 4% above at the median). With ``m == p``
    every forward is warm-up and nothing overlaps: the blocking form.
    """
    m, v = num_micro_batches, num_chunks
    p, work, cf, cb = _group_work(forward_s, backward_s, v, p2p_forward_s, p2p_backward_s)
    chunk = [f + b for f, b in zip(forward_s, backward_s)]
    rounds = sum(max(chunk[c * p : (c + 1) * p]) for c in range(v))
    return (
        m * rounds
        + (sum(work) - max(work)) / v
        + exchange_time(m, v, p, forward_s, backward_s, cf, cb, overlap_p2p)
    )


def exchange_time(
    num_micro_batches: int,
    num_chunks: int,
    num_groups: int,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    p2p_forward_s: Sequence[float],
    p2p_backward_s: Sequence[float],
    overlap_p2p: bool,
) -> float:
    """The transfer time :func:`closed_form_interleaved` adds to the compute's (see there):
    per-stage compute and per-boundary p2p, ``p`` device groups, ``v`` chunks."""
    m, v, p = num_micro_batches, num_chunks, num_groups
    cf, cb = list(p2p_forward_s), list(p2p_backward_s)
    if overlap_p2p and m > p:
        f, b = forward_s, backward_s
        chunk = [x + y for x, y in zip(f, b)]
        slack = [max(chunk[(s // p) * p : (s // p + 1) * p]) - chunk[s] for s in range(len(f))]
        exceed = max([0.0] + [cf[s] - b[s] - slack[s] for s in range(len(cf))]) + max(
            [0.0] + [cb[s] - f[s + 1] - slack[s + 1] for s in range(len(cb))]
        )
        return sum(cf) + sum(cb) + m * v * exceed
    x = max((max(a, c) for a, c in zip(cf, cb)), default=0.0)
    return x * (m * v + interleaved_warmup(p, v, m, 0) - 1)


def lower_bound_interleaved(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    num_micro_batches: int,
    num_chunks: int,
    p2p_forward_s: Sequence[float] | None = None,
    p2p_backward_s: Sequence[float] | None = None,
) -> float:
    """No schedule of ``n = v p`` stages on ``p`` device groups (stage s on group ``s % p``)
    with blocking transfers beats this.

    Group k computes ``m W_k`` in all. Its first compute is a forward of a stage ``>= k``, so
    that micro-batch has crossed stages ``0..k-1`` and their boundaries; its last is a
    backward of a stage ``>= k``, whose gradient still has to cross back over them. And one
    micro-batch crosses every stage and boundary forward and back. ``T >= max(max_k
    [sum_{s<k} (f_s + b_s + c^f_s + c^b_s) + m W_k], sum_s (f_s + b_s) + sum_b (c^f_b +
    c^b_b))``.
    """
    f, b, m = forward_s, backward_s, num_micro_batches
    p, work, cf, cb = _group_work(f, b, num_chunks, p2p_forward_s, p2p_backward_s)
    ramp = [sum(f[:k]) + sum(b[:k]) + sum(cf[:k]) + sum(cb[:k]) for k in range(p)]
    chain = sum(f) + sum(b) + sum(cf) + sum(cb)
    return max(chain, max(r + m * w for r, w in zip(ramp, work)))


__all__ = [
    "bubble_fraction",
    "closed_form_1f1b",
    "closed_form_interleaved",
    "closed_form_interleaved_bubble",
    "closed_form_pipeline",
    "exchange_time",
    "group_sums",
    "last_backward_ends",
    "lower_bound_1f1b",
    "lower_bound_interleaved",
]
