"""Performance prediction: per-layer cost model, memory, communication, pipeline simulation.

:func:`predict` estimates a plan's iteration time, throughput and memory per device (plain or
interleaved pipelines) from profiles (:class:`Profile`, measured per accelerator kind) or
roofline estimates of the cluster's accelerator specs; :func:`fits` checks the memory against
the devices. Pipelines may differ in layout (heterogeneous data parallelism) and plans may
use sequence parallelism. An optional :class:`RateModel` models ranks that share their compute (CPU
emulation provides one).
"""

from megatron_het.perf.closed_forms import closed_form_interleaved, lower_bound_interleaved
from megatron_het.perf.fit import MemoryFit, check_fits, fits
from megatron_het.perf.memory import MemoryBreakdown
from megatron_het.perf.prediction import PipelinePrediction, Prediction, StagePrediction
from megatron_het.perf.predictor import predict
from megatron_het.perf.profile import Profile, ProfileConditions, load_profiles
from megatron_het.perf.rate_model import RateModel, SharedIteration
from megatron_het.perf.simulator import (
    CoreSharing,
    Region,
    SimulationCache,
    SimulationResult,
    StageTiming,
    closed_form_1f1b,
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
