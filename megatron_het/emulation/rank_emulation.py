"""The emulation of one rank, built once from cluster, plan and profile by the run's composition
root, and handed to the product through its two hooks.

:func:`build_emulation` gives a :class:`RankEmulation`: the pipeline executor's region timer
(an :class:`~megatron_het.emulation.emulator.Emulator`, None when this rank's kind is not
emulated), the communicator's wire hooks
(:func:`~megatron_het.emulation.emulated_links.emulated_wires`, None without emulated links), the
fixed device times from a host profile, a one-line description for the log and, after the run, the
warning about compute regions that outran the emulated kind. Ranks named by
``--emulation-extra-slowdown`` get a timer that many times slower than their kind (stragglers, for
``--log-straggler`` to find), and the description says so. A composition root wires it as::

    emulation = build_emulation(cluster, plan, rank, model, seq_length, dtype, profiles, path)
    comm = UnifiedCommunicator.from_cluster(cluster, wire_hooks=emulation.wire_hooks)
    executor = PipelineExecutor(..., region_timer=emulation.region_timer)

Everything here is emulation, and its outputs say so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.emulation.device_times import (
    describe_device_times,
    emulated_device_times,
    fixed_reference_times,
)
from megatron_het.emulation.emulated_links import EmulatedWires, emulated_wires
from megatron_het.emulation.emulator import Emulator
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.perf.cost.compute_time import HOST_PROFILE
from megatron_het.perf.measure.profile_format import Profile

# Profiled device times: a rank still owing more than this share of its kind's compute time at
# the end of the run is reported (its figures are that much slower than the kind).
BEHIND_TOLERANCE = 0.01


@dataclass(frozen=True)
class RankEmulation:
    """What emulation adds to one rank of a run (see the module docstring).

    ``device_times`` maps every emulated rank to its stages' (forward, backward) seconds (one
    pair per interleaved chunk) from the host profile (empty without one); ``description`` is
    one log line about the run's emulation, the same on every rank ("" when nothing is
    emulated)."""

    rank: int
    region_timer: Emulator | None
    wire_hooks: EmulatedWires | None
    device_times: Mapping[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    description: str = ""

    @property
    def emulated(self) -> bool:
        """Whether this rank's kind is emulated."""
        return self.region_timer is not None

    def late_warning(self) -> str | None:
        """After the run: a warning when this rank ran measurably slower than its kind (the
        host's cores were too shared to emulate it there), saying what that means for the
        figures and what to do; else None. With profiled device times, overruns the following
        regions made up do not count: only what was still owed at the end, if over
        :data:`BEHIND_TOLERANCE` of the kind's compute time."""
        emulator = self.region_timer
        if emulator is None:
            return None
        stats = emulator.stats()
        if not stats.late:
            return None
        advice = (
            "raise the emulated kinds' slowdowns (the demo's --dilation), launch fewer "
            "ranks per host core, or use a host with more cores"
        )
        if emulator.fixed_reference_s:
            if stats.behind_s <= BEHIND_TOLERANCE * stats.scheduled_s:
                return None
            share = stats.behind_s / stats.scheduled_s if stats.scheduled_s else 0.0
            return (
                f"warning: rank {self.rank} ({emulator.name}): {stats.late} of "
                f"{stats.regions} compute regions overran {emulator.slowdown:g} x their "
                f"profiled time and {stats.behind_s:.2f} s ({100 * share:.1f}% of the "
                f"kind's compute time) could not be made up (EMULATION: the host's cores "
                f"are shared by too many ranks); its throughput figures are about that much "
                f"lower than the emulated kind's; {advice}"
            )
        return (
            f"warning: rank {self.rank} ({emulator.name}): {stats.late} of "
            f"{stats.regions} compute regions took longer than {emulator.slowdown:g} x "
            f"their CPU time (EMULATION: the host's cores are shared by too many ranks); "
            f"its times are slower than the emulated kind; {advice}"
        )


def build_emulation(
    cluster: ClusterSpec,
    plan: ParallelPlan,
    rank: int,
    model_config: ModelConfig,
    seq_length: int,
    dtype: str,
    profile: Profile | Mapping[str, Profile] | None = None,
    profile_source: str | None = None,
    threads: int | None = None,
    extra_slowdown: Sequence[tuple[int, float]] = (),
    fused_elementwise: bool = False,
) -> RankEmulation:
    """The emulation of global ``rank`` of a run of ``plan`` on ``cluster``.

    ``profile`` is the host profile of ``--emulation-profile`` (a :class:`Profile`, or the
    predictor's profile map with it under ``"cpu"``), read from ``profile_source`` (named in
    messages); with it every emulated stage's regions last ``slowdown x`` its figures.
    ``extra_slowdown`` (``--emulation-extra-slowdown``) lists (rank, factor) pairs: those ranks'
    regions last ``factor x`` their kind's time. ``fused_elementwise`` (the run's ``--compile``)
    picks the profile's compiled or eager layer entries. Raises UserError when the profile lacks a
    stage's shape or dtype, when the cluster has no emulated kind for it to time, when this
    rank computes on more than one thread (``threads``, default ``torch.get_num_threads()``)
    with a profile, or when an extra slowdown names a rank outside the cluster, one that is not
    emulated, or one rank twice. Reads nothing, starts nothing."""
    extra = check_extra_slowdown(cluster, extra_slowdown)
    profiles = {HOST_PROFILE: profile} if isinstance(profile, Profile) else profile
    times = emulated_device_times(
        profiles, profile_source, model_config, plan, cluster, seq_length, dtype, fused_elementwise
    )
    spec = cluster.accelerator_of(rank)
    timer = None
    if spec.emulated:
        timer = Emulator.from_spec(
            spec,
            threads=threads,
            fixed_reference_s=fixed_reference_times(times.get(rank)),
            extra_slowdown=extra.get(rank, 1.0),
        )
    wires = emulated_wires(cluster)
    description = _describe(cluster, plan, times, wires, profile_source)
    if extra:
        description += "; stragglers (--emulation-extra-slowdown): " + ", ".join(
            f"rank {r} x{factor:g} its kind's time" for r, factor in sorted(extra.items())
        )
    return RankEmulation(rank, timer, wires, times, description)


def check_extra_slowdown(
    cluster: ClusterSpec, pairs: Sequence[tuple[int, float]]
) -> dict[int, float]:
    """``--emulation-extra-slowdown``'s (rank, factor) pairs as ``{rank: factor}``; UserError
    (one line) for a rank outside ``cluster``, a rank whose kind is not emulated (only an
    emulated rank's compute can be padded), a rank named twice or a factor below 1."""
    extra: dict[int, float] = {}
    for rank, factor in pairs:
        flag = f"--emulation-extra-slowdown {rank}={factor:g}"
        if not 0 <= rank < cluster.world_size:
            raise UserError(
                f"{flag}: rank {rank} is outside the world of cluster {cluster.name} "
                f"(ranks 0-{cluster.world_size - 1})"
            )
        spec = cluster.accelerator_of(rank)
        if not spec.emulated:
            raise UserError(
                f"{flag}: rank {rank} is {spec.label}, which is not emulated; only "
                f"an emulated rank can be slowed (EMULATION)"
            )
        if rank in extra:
            raise UserError(f"{flag}: rank {rank} is named twice; give each rank one factor")
        if not factor >= 1.0:
            raise UserError(f"{flag}: the factor must be >= 1 (a rank can only be slowed)")
        extra[rank] = float(factor)
    return extra


def _describe(
    cluster: ClusterSpec,
    plan: ParallelPlan,
    times: Mapping[int, tuple[tuple[float, float], ...]],
    wires: EmulatedWires | None,
    profile_source: str | None,
) -> str:
    """One line about the run's emulation ("" when no rank is emulated)."""
    if times:
        line = describe_device_times(times, cluster, profile_source)
    else:
        kinds: dict[str, list[int]] = {}
        for rank in plan.ranks():
            spec = cluster.accelerator_of(rank)
            if spec.emulated:
                kinds.setdefault(spec.name, []).append(rank)
        if not kinds:
            return ""
        line = (
            "> EMULATION: emulated ranks pad each compute region to slowdown x its CPU "
            "time: "
            + ", ".join(
                f"{cluster.accelerator_of(ranks[0]).label} x"
                f"{cluster.accelerator_of(ranks[0]).slowdown:g} on ranks {sorted(ranks)}"
                for ranks in kinds.values()
            )
        )
    if wires is not None:
        line += f"; emulated links: {wires.describe()}"
    return line


__all__ = ["RankEmulation", "build_emulation", "check_extra_slowdown"]
