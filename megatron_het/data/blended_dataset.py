"""Weighted blending of several datasets, following Megatron-LM's deterministic rule.

Sample ``i`` of the blend comes from the dataset whose achieved count is furthest below its
target share: ``argmax_d(weight_d * max(i, 1) - count_d)``, ties to the lowest index. The d-th
dataset's samples are consumed in order, so after ``n`` samples every dataset has
contributed ``weight_d * n`` samples up to about one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_het.errors import UserError


def normalize_weights(weights: Sequence[float] | np.ndarray) -> np.ndarray:
    """Weights as float64 summing to 1; UserError if any is negative or all are zero."""
    array = np.asarray([float(w) for w in weights], dtype=np.float64)
    if array.size == 0 or np.any(array < 0) or not np.all(np.isfinite(array)) or array.sum() <= 0:
        raise UserError(
            f"blend weights {list(weights)} are not valid; give non-negative "
            "weights with a positive sum in --data-path"
        )
    return array / array.sum()


def build_blending_indices(weights: np.ndarray, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index[num_samples] int16, dataset_sample_index[num_samples] int64)``.

    ``weights`` must be normalised. The greedy rule depends on the running counts, so this is a
    plain loop over Python floats (about a second per million samples for a few datasets).
    """
    num_datasets = len(weights)
    dataset_index = np.empty(num_samples, dtype=np.int16)
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    counts = [0] * num_datasets
    w = [float(x) for x in weights]
    others = range(1, num_datasets)
    for i in range(num_samples):
        scale = float(max(i, 1))
        best, best_error = 0, w[0] * scale - counts[0]
        for d in others:
            error = w[d] * scale - counts[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """``num_samples`` samples drawn from ``datasets`` in proportion to ``weights``.

    ``ds[i]`` is ``datasets[dataset_index[i]][dataset_sample_index[i]]``. Raises ValueError when a
    component holds fewer samples than the blend takes from it (build each component with at
    least ``ceil(weight * num_samples)`` samples plus a margin). ``blending_indices``, when
    given, must be ``build_blending_indices(normalised weights, num_samples)`` (saves recomputing).
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float] | np.ndarray,
        num_samples: int,
        blending_indices: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) > np.iinfo(np.int16).max:
            raise UserError(f"cannot blend {len(datasets)} datasets; at most 32767")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.num_samples = int(num_samples)
        if blending_indices is None:
            blending_indices = build_blending_indices(self.weights, self.num_samples)
        self.dataset_index, self.dataset_sample_index = blending_indices
        taken = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, dataset in enumerate(self.datasets):
            if taken[d] > len(dataset):
                raise ValueError(
                    f"blend takes {taken[d]} samples from dataset {d} which has only {len(dataset)}"
                )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> np.ndarray:
        if not -self.num_samples <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]
