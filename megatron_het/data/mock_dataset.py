"""Synthetic training samples, for smoke tests and throughput runs without data files."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class SampleDataset(Protocol):
    """What training reads from a dataset: ``ds[i]`` is ``np.int64[seq_length + 1]``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...


class MockDataset:
    """Uniformly random ids in ``[0, vocab_size)``, a pure function of
    ``(seed, split_id, index)`` (``--mock-data``)."""

    def __init__(
        self, num_samples: int, seq_length: int, vocab_size: int, seed: int, split_id: int
    ) -> None:
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.split_id = split_id

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"mock sample {index} outside [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, self.split_id, int(index)])
        return rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)
