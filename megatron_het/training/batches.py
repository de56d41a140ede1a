"""Which samples an iteration reads, and which micro-batches go to which pipeline.

Data position: iteration ``k`` (1-based) reads train samples
``[consumed_samples, consumed_samples + global_batch_size)``, micro-batch ``m`` row ``r`` being
sample ``consumed_samples + m * micro_batch_size + r``; resuming only needs ``consumed_samples``.
The global batch's micro-batches go to the plan's pipelines in consecutive blocks, in pipeline
order, so every plan (one process included) sees the same samples in the same micro-batches.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_het.data.mock_dataset import SampleDataset
from megatron_het.parallel.plan import ParallelPlan

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # tokens [b, s], labels [b, s]


def get_micro_batches(
    dataset: SampleDataset,
    first_sample: int,
    num_samples: int,
    micro_batch_size: int,
    device: torch.device,
) -> list[MicroBatch]:
    """The ``num_samples // micro_batch_size`` micro-batches starting at ``first_sample``."""
    rows = np.stack(
        [np.asarray(dataset[first_sample + i], dtype=np.int64) for i in range(num_samples)]
    )
    samples = torch.from_numpy(rows).to(device)
    return [(chunk[:, :-1], chunk[:, 1:]) for chunk in samples.split(micro_batch_size)]


def pipeline_micro_batches(
    dataset: SampleDataset,
    first_sample: int,
    plan: ParallelPlan,
    pipeline: int,
    device: torch.device,
) -> list[MicroBatch]:
    """Pipeline ``pipeline``'s micro-batches of the global batch starting at ``first_sample``:
    its consecutive block, after the blocks of the pipelines before it."""
    mbs = plan.micro_batch_size
    before = sum(p.micro_batches for p in plan.pipelines[:pipeline]) * mbs
    count = plan.pipelines[pipeline].micro_batches * mbs
    return get_micro_batches(dataset, first_sample + before, count, mbs, device)
