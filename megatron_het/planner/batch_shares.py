"""The global batch shared by speed over replicas of different kinds (heterogeneous DP).

Each kind offers layouts whose replica takes ``fixed + per_micro_batch * m`` seconds for ``m``
micro-batches and ``sync`` seconds for its cross-kind gradient sum; :func:`allocate` picks a
layout and a share per kind so that the shares add up to the batch and the slowest replica
plus the largest sync is least (:func:`shares_by_speed` for one cap on the sync,
:func:`exact_shares` for shares that add up exactly). Pure arithmetic: the heterogeneous-DP
search (:mod:`megatron_het.planner.kind_replicas`) brings the layouts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol, TypeVar

# Bisection steps on the slowest replica's time (relative precision far below the predictor's).
BISECTION_STEPS = 60

# Per kind, how many of its roomiest layouts the exact batch shares may choose among.
SHARE_CHOICES = 4

# How many times the budget is widened to the next layout's next micro-batch where no exact
# shares add up at the least budget.
WIDENINGS = 64


class _Layout(Protocol):
    @property
    def dp(self) -> int: ...


class ShareOption(Protocol):
    """A kind's layout as the sharing sees it (the heterogeneous-DP search's options)."""

    @property
    def layout(self) -> _Layout: ...

    @property
    def fixed(self) -> float: ...

    @property
    def per_micro_batch(self) -> float: ...

    @property
    def sync(self) -> float: ...

    def most_micro_batches(self, budget: float) -> int: ...


_O = TypeVar("_O", bound=ShareOption)


def allocate(
    options: Sequence[Sequence[_O]], total: int
) -> tuple[list[tuple[_O, int]], float] | None:
    """The layouts and shares (:func:`shares_by_speed`) with the least slowest pipeline +
    largest sync (the iteration waits for both), over every cap on the sync: ((option,
    micro-batches) per kind, that time); None when no choice adds up."""
    best: tuple[list[tuple[_O, int]], float] | None = None
    for cap in sorted({o.sync for opts in options for o in opts}):
        within = [[o for o in opts if o.sync <= cap] for opts in options]
        if not all(within):
            continue
        picks = shares_by_speed(within, total)
        if picks is None:
            continue
        time = max(o.fixed + o.per_micro_batch * m for o, m in picks) + max(
            o.sync for o, _ in picks
        )
        if best is None or time < best[1]:
            best = (picks, time)
    return best


def shares_by_speed(options: Sequence[Sequence[_O]], total: int) -> list[tuple[_O, int]] | None:
    """Per kind, a layout and the micro-batches of each of its replicas, summing to ``total``
    over all replicas (``dp_k`` of kind k) and making the slowest replica's time least; None
    when no choice adds up.

    Bisection on that time finds the least budget within which the kinds' roomiest layouts
    hold the batch; the shares are then made exact (:func:`exact_shares`) over the
    :data:`SHARE_CHOICES` roomiest layouts of each kind (replica counts that cannot add up to
    the batch give way to others), the budget widened (to where a layout holds one more
    micro-batch) where none adds up."""

    def room(option: _O, budget: float) -> int:
        return min(option.most_micro_batches(budget), total)

    def fits(budget: float) -> bool:
        held = [
            max(o.layout.dp * room(o, budget) for o in opts if room(o, budget) >= 1)
            if any(room(o, budget) >= 1 for o in opts)
            else 0
            for opts in options
        ]
        return all(held) and sum(held) >= total

    lo = max(min(o.fixed + o.per_micro_batch for o in opts) for opts in options)
    hi = max(max(o.fixed + o.per_micro_batch * total for o in opts) for opts in options)
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if fits(mid):
            hi = mid
        else:
            lo = mid
    for _ in range(WIDENINGS):
        choices = [
            sorted((o for o in opts if room(o, hi) >= 1), key=lambda o: -o.layout.dp * room(o, hi))[
                :SHARE_CHOICES
            ]
            for opts in options
        ]
        best: tuple[float, list[tuple[_O, int]]] | None = None
        for pick in itertools.product(*choices):
            shares = exact_shares([o.layout.dp for o in pick], [room(o, hi) for o in pick], total)
            if shares is not None:
                time = max(o.fixed + o.per_micro_batch * m for o, m in zip(pick, shares))
                if best is None or time < best[0]:
                    best = (time, list(zip(pick, shares)))
        if best is not None:
            return best[1]
        # the next budget at which some layout holds one more micro-batch
        later = [
            o.fixed + o.per_micro_batch * (room(o, hi) + 1)
            for opts in options
            for o in opts
            if room(o, hi) < total
        ]
        if not later:
            return None
        hi = min(later) * (1 + 1e-12)
    return None


def exact_shares(dps: Sequence[int], caps: Sequence[int], total: int) -> list[int] | None:
    """Micro-batches ``m_k`` in ``1 .. caps[k]`` with ``sum dps[k] m_k == total``, each as
    large as it can be in kind order (the first kinds are filled first); None if none."""
    if not dps:
        return [] if total == 0 else None
    rest_min = sum(dps[1:])
    rest_max = sum(d * c for d, c in zip(dps[1:], caps[1:]))
    top = min(caps[0], (total - rest_min) // dps[0])
    for m in range(top, 0, -1):
        left = total - dps[0] * m
        if left > rest_max:
            break
        tail = exact_shares(dps[1:], caps[1:], left)
        if tail is not None:
            return [m, *tail]
    return None
