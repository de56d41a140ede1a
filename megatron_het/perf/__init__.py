"""Performance prediction: per-layer cost model, memory, communication, pipeline simulation.

:func:`predict` estimates a plan's iteration time, throughput and memory per device from
profiles (:class:`Profile`, measured per accelerator kind) or roofline estimates of the cluster's
accelerator specs; :func:`fits` checks the memory against the devices.
"""
from megatron_het.perf.memory import MemoryBreakdown, MemoryFit, check_fits, fits
from megatron_het.perf.predictor import (PipelinePrediction, Prediction, StagePrediction,
                                         predict)
from megatron_het.perf.profile import Profile, ProfileConditions, load_profiles
from megatron_het.perf.simulator import (SimulationCache, SimulationResult, closed_form_1f1b,
                                         simulate, simulate_1f1b)

__all__ = ["MemoryBreakdown", "MemoryFit", "PipelinePrediction", "Prediction", "Profile",
           "ProfileConditions", "SimulationCache", "SimulationResult", "StagePrediction",
           "check_fits", "closed_form_1f1b", "fits", "load_profiles", "predict", "simulate",
           "simulate_1f1b"]
