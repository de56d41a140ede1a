"""The gradient buckets' rule, torch-free: the runtime's buckets
(:func:`megatron_het.optim.data_parallel.plan_buckets`) and the predictor's model of their
overlap (:mod:`megatron_het.perf.cost.dp_sync_overlap`) both cut with it.

Parameters are taken in the order given (the runtime passes reverse registration order, the
order backward produces gradients); a bucket closes once it holds at least
``bucket_size_mb`` MiB of float32 gradients, a parameter is never split, and a bucket's buffer
is padded to a multiple of the DP size. ``--ddp-bucket-size N`` (Megatron-LM's flag, in
parameters) sets the size: :func:`bucket_size_mb` of ``N``.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_BUCKET_SIZE_MB = 25.0
FP32_BYTES = 4


def bucket_ranges(numels: Sequence[int], bucket_size_mb: float) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of ``numels`` (elements per parameter, in bucket order),
    one per bucket."""
    if bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
    limit = max(1, int(bucket_size_mb * 1024 * 1024 / FP32_BYTES))
    ranges, start, filled = [], 0, 0
    for i, n in enumerate(numels):
        filled += n
        if filled >= limit:
            ranges.append((start, i + 1))
            start, filled = i + 1, 0
    if start < len(numels):
        ranges.append((start, len(numels)))
    return ranges


def bucket_size_mb(ddp_bucket_size: int | None) -> float:
    """The bucket size in MiB of float32 gradients for ``--ddp-bucket-size`` (parameters per
    bucket; None: :data:`DEFAULT_BUCKET_SIZE_MB`)."""
    if ddp_bucket_size is None:
        return DEFAULT_BUCKET_SIZE_MB
    if ddp_bucket_size < 1:
        raise ValueError(f"ddp_bucket_size must be at least 1, got {ddp_bucket_size}")
    return ddp_bucket_size * FP32_BYTES / (1024 * 1024)


def megatron_default_bucket_size(dp_size: int) -> int:
    """Megatron-LM's bucket size where ``--ddp-bucket-size`` is not given: ``max(4e7, 1e6 dp)``
    parameters (``megatron/core/distributed/distributed_data_parallel.py``)."""
    return max(40_000_000, 1_000_000 * dp_size)


def padded_elements(elements: int, dp_size: int) -> int:
    """A bucket's buffer: ``elements`` rounded up to a multiple of ``dp_size``."""
    return -(-elements // dp_size) * dp_size


__all__ = [
    "DEFAULT_BUCKET_SIZE_MB",
    "FP32_BYTES",
    "bucket_ranges",
    "bucket_size_mb",
    "megatron_default_bucket_size",
    "padded_elements",
]
