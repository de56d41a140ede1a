"""A run's timeline: the spans each rank records (:mod:`~megatron_het.trace.recorder`) and
the Chrome trace they are merged into (:mod:`~megatron_het.trace.chrome`), which Perfetto,
``chrome://tracing`` and TensorBoard's trace viewer open."""

from megatron_het.trace.recorder import CATEGORIES, Recorder, Span

__all__ = ["CATEGORIES", "Recorder", "Span"]
