"""Stragglers: ranks that compute slower than the other ranks of their accelerator kind.

Every ``--log-interval`` the logging rank sums each rank's compute seconds over the interval
(the ``compute_s`` column every iteration's gathered table already carries), divides it by the
rank's expected compute (its stages' predicted forward + backward seconds times its pipeline's
micro-batches, or, where the predictor cannot price the plan, its layers times micro-batches
over its TP degree) and compares that with the median of its kind's ranks. A rank above
``(1 + threshold) x`` its kind's median is a straggler. Ranks are compared only with ranks of
their own kind, so a kind that is slower by design is never one; a kind with a single rank has
no peer to be compared with and is never named (the first report says so once).

With two ranks of a kind the median is their mean, so the slower one is named only when it is
more than ``(1 + threshold) / (1 - threshold)`` times the faster (1.5 x at the default 0.2).

Torch-free: plain numbers in, a :class:`StragglerReport` out; :class:`StragglerMonitor` keeps
the interval's sums on the logging rank. No communication.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_het.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from megatron_het.cluster import ClusterSpec
    from megatron_het.parallel.plan import ParallelPlan
    from megatron_het.perf import Prediction

PREDICTED, LAYERS = "predicted compute", "layer"  # the normalisation bases, as lines name them
MAX_LISTED_RANKS = 64  # past this many ranks the compact line summarises each kind


@dataclass(frozen=True)
class RankPlace:
    """Where one rank computes: its pipeline, the stage indices it runs (several when its
    pipeline interleaves), its kind's label ("(emulated)" for emulated kinds) and its expected
    compute per iteration (seconds, or layer units: only ratios between ranks matter)."""

    rank: int
    pipeline: int
    stages: tuple[int, ...]
    kind: str
    expected: float

    @property
    def where(self) -> str:
        """ "pipeline 1 stage 1", or "pipeline 0 stages 0,2" for an interleaved rank."""
        noun = "stage" if len(self.stages) == 1 else "stages"
        return f"pipeline {self.pipeline} {noun} {','.join(map(str, self.stages))}"


@dataclass(frozen=True)
class Straggler:
    """A rank whose normalised compute is ``ratio`` x its kind's median (> 1 + threshold)."""

    place: RankPlace
    ratio: float


@dataclass(frozen=True)
class StragglerReport:
    """One interval: per-rank compute seconds summed over iterations ``first``-``last``,
    ``ratio`` (rank -> normalised compute over its kind's median, for every compared rank),
    the stragglers (slowest first) and the kinds with one rank (never compared)."""

    first: int
    last: int
    compute_s: tuple[float, ...]
    ratio: Mapping[int, float]
    stragglers: tuple[Straggler, ...]
    lone_kinds: tuple[str, ...]


def median(values: Sequence[float]) -> float:
    """The median (the mean of the middle two for an even count); ValueError when empty."""
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[middle])
    return (ordered[middle - 1] + ordered[middle]) / 2.0


def compare_ranks(
    compute_s: Sequence[float], places: Sequence[RankPlace], threshold: float
) -> tuple[dict[int, float], tuple[Straggler, ...], tuple[str, ...]]:
    """(ratio per compared rank, stragglers slowest first, kinds with one rank).

    ``compute_s`` is indexed by rank; ``places`` names the ranks to compare. A rank with no
    expected compute, and the ranks of a kind whose median is zero, are not compared.
    """
    if not threshold > 0:
        raise ValueError(f"threshold must be positive, got {threshold}")
    by_kind: dict[str, list[tuple[RankPlace, float]]] = {}
    for place in places:
        if place.expected > 0:
            by_kind.setdefault(place.kind, []).append(
                (place, compute_s[place.rank] / place.expected)
            )
    ratios: dict[int, float] = {}
    stragglers: list[Straggler] = []
    lone: list[str] = []
    for kind, members in by_kind.items():
        if len(members) == 1:
            lone.append(kind)
            continue
        middle = median([value for _, value in members])
        if not middle > 0:
            continue
        for place, value in members:
            ratios[place.rank] = value / middle
            if value > (1.0 + threshold) * middle:
                stragglers.append(Straggler(place, value / middle))
    stragglers.sort(key=lambda s: (-s.ratio, s.place.rank))
    return dict(sorted(ratios.items())), tuple(stragglers), tuple(sorted(lone))


class StragglerMonitor:
    """Sums each rank's compute over a log interval and reports its stragglers.

    ``places`` lists every rank of the run; ``basis`` is :data:`PREDICTED` or :data:`LAYERS`
    (what ``expected`` measures, named in the lines).
    """

    def __init__(
        self, places: Sequence[RankPlace], threshold: float, basis: str = PREDICTED
    ) -> None:
        if not threshold > 0:
            raise ValueError(f"threshold must be positive, got {threshold}")
        self.places = sorted(places, key=lambda p: p.rank)
        self.threshold, self.basis = float(threshold), basis
        self._sums: list[float] = []
        self._first: int | None = None
        self._last = 0
        self._lone_told = False

    def add(self, iteration: int, compute_s: Sequence[float]) -> None:
        """One iteration's compute seconds, indexed by rank."""
        if not self._sums:
            self._sums = [0.0] * len(compute_s)
            self._first = iteration
        self._sums = [total + float(value) for total, value in zip(self._sums, compute_s)]
        self._last = iteration

    def close(self) -> StragglerReport | None:
        """The report of the iterations added since the last close (None: none added)."""
        if self._first is None:
            return None
        ratio, stragglers, lone = compare_ranks(self._sums, self.places, self.threshold)
        report = StragglerReport(
            self._first, self._last, tuple(self._sums), ratio, stragglers, lone
        )
        self._sums, self._first = [], None
        return report

    def lines(self, report: StragglerReport) -> list[str]:
        """The log lines of ``report``: one per straggler, the note on kinds with one rank
        (the first time only), and a compact per-rank compute line."""
        span = (
            f"iteration {report.first}"
            if report.first == report.last
            else f"iterations {report.first}-{report.last}"
        )
        out = [
            f" straggler: rank {s.place.rank} ({s.place.where}, {s.place.kind}) computed "
            f"{s.ratio:.2f} x the median of its kind per {self.basis} over {span} "
            f"({100 * (s.ratio - 1):.0f}% slower; threshold {100 * self.threshold:g}%)"
            for s in report.stragglers
        ]
        if report.lone_kinds and not self._lone_told:
            self._lone_told = True
            out.append(
                " straggler check: "
                + ", ".join(report.lone_kinds)
                + (" has" if len(report.lone_kinds) == 1 else " have")
                + " a single rank, with no peer of its kind to be compared with; "
                "never named a straggler"
            )
        out.append(
            f"   compute s per rank over {span} (x its kind's median per "
            f"{self.basis}): " + " | ".join(self._compact(report))
        )
        return out

    def _compact(self, report: StragglerReport) -> list[str]:
        """Each rank's seconds and ratio; per kind (its slowest rank) past
        :data:`MAX_LISTED_RANKS` ranks."""
        if len(self.places) <= MAX_LISTED_RANKS:
            parts = []
            for place in self.places:
                ratio = report.ratio.get(place.rank)
                mark = f" x{ratio:.2f}" if ratio is not None else ""
                parts.append(f"r{place.rank} {report.compute_s[place.rank]:.3f}{mark}")
            return parts
        kinds: dict[str, list[RankPlace]] = {}
        for place in self.places:
            kinds.setdefault(place.kind, []).append(place)
        parts = []
        for kind, members in kinds.items():
            slowest = max(members, key=lambda p: (report.ratio.get(p.rank, 0.0), -p.rank))
            seconds = median([report.compute_s[p.rank] for p in members])
            ratio = report.ratio.get(slowest.rank)
            parts.append(
                f"{kind} {len(members)} ranks, median {seconds:.3f}"
                + (f", slowest r{slowest.rank} x{ratio:.2f}" if ratio else "")
            )
        return parts


def report_fields(report: StragglerReport) -> dict[str, Any]:
    """The metrics-file figures of ``report`` (JSON-able; lists indexed by rank, None for a
    rank that was not compared)."""
    return {
        "first_iteration": report.first,
        "rank_compute_s": list(report.compute_s),
        "ratio_to_kind_median": [report.ratio.get(rank) for rank in range(len(report.compute_s))],
        "stragglers": [s.place.rank for s in report.stragglers],
    }


def report_scalars(report: StragglerReport) -> dict[str, float]:
    """Tensorboard scalars of ``report``: each rank's interval compute and its ratio."""
    out = {f"straggler/compute_s/rank{rank}": value for rank, value in enumerate(report.compute_s)}
    out.update({f"straggler/ratio/rank{rank}": value for rank, value in report.ratio.items()})
    out["straggler/count"] = float(len(report.stragglers))
    return out


# -- expected compute --------------------------------------------------------------------------
def predicted_compute(prediction: Prediction, plan: ParallelPlan) -> dict[int, float]:
    """Each rank's predicted compute seconds per iteration: over its stages' rows, forward +
    backward per micro-batch (TP communication and recompute included, as the executor's
    compute regions include them) times its pipeline's micro-batches."""
    expected: dict[int, float] = {}
    for row in prediction.stages:
        micro_batches = plan.pipelines[row.pipeline].micro_batches
        for rank in row.ranks:
            expected[rank] = expected.get(rank, 0.0) + micro_batches * (
                row.forward_s + row.backward_s
            )
    return expected


def layer_compute(plan: ParallelPlan) -> dict[int, float]:
    """Each rank's layers x its pipeline's micro-batches / its stage's TP degree, summed over
    its stages (where no prediction is possible)."""
    expected: dict[int, float] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            for rank in stage.ranks:
                expected[rank] = expected.get(rank, 0.0) + (
                    stage.num_layers * pipeline.micro_batches / stage.tp
                )
    return expected


def rank_places(
    plan: ParallelPlan, cluster: ClusterSpec, expected: Mapping[int, float]
) -> list[RankPlace]:
    """Every rank of ``plan`` with its pipeline, stages, kind label and ``expected`` compute."""
    places = []
    for rank in plan.ranks():
        role = plan.rank_role(rank)
        places.append(
            RankPlace(
                rank,
                role.pipeline,
                tuple(role.chunks),
                cluster.accelerator_of(rank).label,
                expected.get(rank, 0.0),
            )
        )
    return places


def build_monitor(setup: Any, threshold: float) -> StragglerMonitor:
    """The monitor of a run's ``setup`` (a :class:`~megatron_het.training.setup.RunSetup`):
    expectations from the predictor on the run's plan (its per-stage rows; the pipeline model
    does not change them), or per layer when the predictor cannot price the plan."""
    from megatron_het.training.setup import predict_plan

    plan = setup.plan
    try:
        prediction = predict_plan(setup, pipeline_model="closed_form")
        expected, basis = predicted_compute(prediction, plan), PREDICTED
    except UserError:
        expected, basis = layer_compute(plan), LAYERS
    return StragglerMonitor(rank_places(plan, setup.cluster, expected), threshold, basis)


__all__ = [
    "LAYERS",
    "MAX_LISTED_RANKS",
    "PREDICTED",
    "RankPlace",
    "Straggler",
    "StragglerMonitor",
    "StragglerReport",
    "build_monitor",
    "compare_ranks",
    "layer_compute",
    "median",
    "predicted_compute",
    "rank_places",
    "report_fields",
    "report_scalars",
]
