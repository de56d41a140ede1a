"""Performance prediction: what one training iteration of a plan costs on a cluster.

:func:`predict` (:mod:`~megatron_het.perf.predictor`) estimates a plan's iteration time,
throughput and memory per device and returns a :class:`Prediction`
(:mod:`~megatron_het.perf.estimates`); :func:`fits` checks the memory against the devices.
Inside, three groups and the glue between them:

- ``measure/``: measuring a device into a :class:`Profile` (the profiler, the communicator's
  figures, the device's kind, the profile file format);
- ``cost/``: the cost model: what a layer, a stage, a transfer, a DP sync, a device's memory
  cost (roofline or profile, calibrated per kind), and the optional :class:`RateModel` for
  ranks that share their compute (CPU emulation provides one);
- ``schedule/``: how the pipeline schedule turns per-stage costs into a pipeline time (the
  event-driven simulator, the closed forms, the search loop's :class:`SimulationCache`);
- :mod:`~megatron_het.perf.stage_pricing` prices every stage of a plan through ``cost/``, and
  the predictor times the pipelines through ``schedule/`` and assembles the iteration.
"""

from megatron_het.perf.cost.memory import MemoryBreakdown
from megatron_het.perf.cost.memory_fit import MemoryFit, check_fits, fits
from megatron_het.perf.cost.rate_model import RateModel, SharedIteration
from megatron_het.perf.estimates import PipelinePrediction, Prediction, StagePrediction
from megatron_het.perf.measure.profile_format import Profile, ProfileConditions, load_profiles
from megatron_het.perf.predictor import predict
from megatron_het.perf.schedule.closed_forms import (
    closed_form_1f1b,
    closed_form_interleaved,
    lower_bound_interleaved,
)
from megatron_het.perf.schedule.simulation_cache import SimulationCache
from megatron_het.perf.schedule.simulator import (
    CoreSharing,
    Region,
    SimulationResult,
    StageTiming,
    simulate,
    simulate_1f1b,
    simulate_pipelines,
)

__all__ = [
    "CoreSharing",
    "MemoryBreakdown",
    "MemoryFit",
    "PipelinePrediction",
    "Prediction",
    "Profile",
    "ProfileConditions",
    "RateModel",
    "Region",
    "SharedIteration",
    "SimulationCache",
    "SimulationResult",
    "StagePrediction",
    "StageTiming",
    "check_fits",
    "closed_form_1f1b",
    "closed_form_interleaved",
    "fits",
    "load_profiles",
    "lower_bound_interleaved",
    "predict",
    "simulate",
    "simulate_1f1b",
    "simulate_pipelines",
]
