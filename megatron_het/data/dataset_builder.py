"""Train, valid and test datasets from a :class:`~megatron_het.config.DataConfig`.

``data_path`` is Megatron's list: one prefix, several prefixes, or weight/prefix pairs. Each
prefix's documents are split in file order by ``--split``; each split is a GPTDataset per
prefix, blended by weight when there are several. The result depends only on the files, the
split, the seed, the sequence length and the sample counts, so resuming at ``consumed_samples``
reproduces the data order exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from megatron_het.config import DataConfig
from megatron_het.data.blended_dataset import (
    BlendedDataset,
    build_blending_indices,
    normalize_weights,
)
from megatron_het.data.gpt_dataset import GPTDataset, parse_split, split_documents
from megatron_het.data.indexed_dataset import IndexedDataset, max_token_id
from megatron_het.errors import UserError

# Megatron asks each blended component for this fraction more samples than its share.
_BLEND_SURPLUS = 0.005

TrainingDataset = GPTDataset | BlendedDataset


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """``(prefixes, weights)`` from Megatron's ``--data-path`` list.

    ``["a"]`` and ``["a", "b"]`` give no weights (None); ``["0.3", "a", "0.7", "b"]`` gives
    ``[0.3, 0.7]`` (not yet normalised).
    """
    items = [str(p) for p in data_path]
    if not items:
        raise UserError(
            "no --data-path given; pass one or more dataset prefixes "
            "(optionally as weight prefix pairs)"
        )
    numeric = [_is_number(item) for item in items]
    if not any(numeric):
        return items, None
    if len(items) % 2 or not all(numeric[0::2]) or any(numeric[1::2]):
        raise UserError(
            f"--data-path {' '.join(items)} mixes weights and prefixes; give "
            "either prefixes only or weight prefix pairs like 0.3 a 0.7 b"
        )
    return items[1::2], [float(w) for w in items[0::2]]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def data_max_token_id(data_config: DataConfig) -> int:
    """Largest token id over every ``--data-path`` prefix (-1 when there are no tokens).

    Training compares it with the tokenizer's vocabulary before it starts.
    """
    prefixes, _ = parse_data_path(data_config.data_path)
    return max(max_token_id(IndexedDataset(prefix)) for prefix in prefixes)


def build_train_valid_test_datasets(
    data_config: DataConfig,
    train_valid_test_num_samples: tuple[int, int, int],
) -> tuple[TrainingDataset | None, TrainingDataset | None, TrainingDataset | None]:
    """The train, valid and test datasets for the requested sample counts.

    A returned dataset holds at least the requested number of samples; one is None when its
    count is 0 or its split has no documents in any prefix. ``data_config.mock_data`` is not
    handled here (the training setup makes its own synthetic samples). Missing files, bad splits
    and bad weights raise UserError.
    """
    split = parse_split(data_config.split)
    prefixes, weights = parse_data_path(data_config.data_path)
    indexed = [IndexedDataset(prefix) for prefix in prefixes]
    documents_per_prefix = [split_documents(len(ds), split) for ds in indexed]
    if weights is not None:
        weights = list(normalize_weights(weights))
    results: list[TrainingDataset | None] = []
    for split_id, num_samples in enumerate(train_valid_test_num_samples):
        documents = [docs[split_id] for docs in documents_per_prefix]
        split_weights = weights
        if split_weights is None:
            # Prefixes without weights blend in proportion to their tokens in this split.
            split_weights = [
                float(ds.sequence_lengths[docs].sum(dtype=np.int64))
                for ds, docs in zip(indexed, documents)
            ]
        results.append(
            _build_split(indexed, documents, split_weights, int(num_samples), data_config)
        )
    return results[0], results[1], results[2]


def _build_split(
    indexed: list[IndexedDataset],
    documents: list[np.ndarray],
    weights: Sequence[float],
    num_samples: int,
    data_config: DataConfig,
) -> TrainingDataset | None:
    """One split: a GPTDataset, or a blend over the prefixes that have documents in it."""
    seq_length, seed = data_config.seq_length, data_config.seed
    non_empty = [i for i, docs in enumerate(documents) if len(docs)]
    if num_samples <= 0 or not non_empty:
        return None
    kept = [i for i in non_empty if weights[i] > 0] or non_empty[:1]
    if len(kept) == 1:
        i = kept[0]
        return GPTDataset(indexed[i], documents[i], num_samples, seq_length, seed)
    kept_weights = normalize_weights([weights[i] for i in kept])
    dataset_index, sample_index = build_blending_indices(kept_weights, num_samples)
    taken = np.bincount(dataset_index, minlength=len(kept))
    components = []
    for position, i in enumerate(kept):
        share = math.ceil(math.ceil(num_samples * kept_weights[position]) * (1 + _BLEND_SURPLUS))
        component_samples = max(share, int(taken[position]), 1)
        components.append(GPTDataset(indexed[i], documents[i], component_samples, seq_length, seed))
    return BlendedDataset(
        components, kept_weights, num_samples, blending_indices=(dataset_index, sample_index)
    )
