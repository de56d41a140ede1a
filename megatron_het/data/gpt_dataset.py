"""GPT pretraining samples cut from an indexed dataset, following Megatron-LM's construction.

A split's documents are repeated for as many epochs as ``num_samples`` needs and shuffled into
the *document index*; their tokens, concatenated in that order, form one stream. Sample ``j`` of
the stream is the window ``stream[j * seq_length : (j + 1) * seq_length + 1]`` (inputs plus the
one-token shift for labels), so consecutive samples share one token and samples cross document
boundaries. The *sample index* stores, per window start, (position in the document index, offset
in that document). The *shuffle index* permutes the samples. When the last epoch is only partly
used (below 80% of an epoch's samples), it is shuffled separately from the full epochs, so the
samples of the full epochs keep covering every token once per epoch.

Everything is a pure function of (files, documents, num_samples, seq_length, seed): numpy's
``RandomState(seed)`` shuffles the document index and then the samples.
"""

from __future__ import annotations

import re

import numpy as np

from megatron_het.data.indexed_dataset import IndexedDataset
from megatron_het.errors import UserError

# A final epoch contributing fewer than this share of an epoch's samples is shuffled apart.
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


class GPTDataset:
    """``num_samples`` (or more) windows of ``seq_length + 1`` tokens over ``document_ids``.

    ``len(ds)`` is the number of samples in the epochs built (at least ``num_samples``);
    ``ds[i]`` is an ``np.int64`` array ``[seq_length + 1]``: inputs are ``[:-1]``, labels
    ``[1:]``. Attributes ``document_index``, ``sample_index`` ``[len + 1, 2]`` and
    ``shuffle_index`` expose the construction.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        document_ids: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
    ) -> None:
        if seq_length <= 0:
            raise UserError(f"--seq-length must be positive, got {seq_length}")
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self.indexed = indexed
        self.document_ids = np.asarray(document_ids, dtype=np.int64)
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.tokens_per_epoch = int(indexed.sequence_lengths[self.document_ids].sum(dtype=np.int64))
        if self.tokens_per_epoch <= 1:
            raise UserError(
                f"data {indexed.path_prefix}: the split's {len(self.document_ids)} "
                f"documents hold {self.tokens_per_epoch} tokens, too few for a "
                "sample; use more data or change --split"
            )
        self._build_indices()

    def _build_indices(self) -> None:
        L, per_epoch = self.seq_length, self.tokens_per_epoch
        needed = self.num_samples * L + 1  # one extra token for the last label
        self.num_epochs = max(1, -(-needed // per_epoch))
        separate_final_epoch = False
        samples_before_final = 0
        if self.num_epochs > 1:
            samples_before_final = ((self.num_epochs - 1) * per_epoch - 1) // L
            samples_per_epoch = (per_epoch - 1) // L
            from_final = self.num_samples - samples_before_final
            separate_final_epoch = from_final < int(
                _SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch
            )
        rng = np.random.RandomState(self.seed)
        if separate_final_epoch:
            self.document_index = np.concatenate(
                [
                    _shuffled_epochs(self.document_ids, self.num_epochs - 1, rng),
                    _shuffled_epochs(self.document_ids, 1, rng),
                ]
            )
        else:
            self.document_index = _shuffled_epochs(self.document_ids, self.num_epochs, rng)
        self.sample_index = _build_sample_index(
            self.indexed.sequence_lengths[self.document_index], L
        )
        total = len(self.sample_index) - 1
        first = samples_before_final if separate_final_epoch else total
        self.shuffle_index = _shuffled_range(first, total, rng)

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, idx: int) -> np.ndarray:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        j = int(self.shuffle_index[idx])
        doc_begin, offset_begin = (int(v) for v in self.sample_index[j])
        doc_end, offset_end = (int(v) for v in self.sample_index[j + 1])
        if doc_begin == doc_end:
            seq = int(self.document_index[doc_begin])
            window = self.indexed.get(seq, offset_begin, offset_end - offset_begin + 1)
            return window.astype(np.int64)
        parts = [self.indexed.get(int(self.document_index[doc_begin]), offset_begin)]
        for position in range(doc_begin + 1, doc_end):
            parts.append(self.indexed.get(int(self.document_index[position])))
        parts.append(self.indexed.get(int(self.document_index[doc_end]), 0, offset_end + 1))
        return np.concatenate(parts).astype(np.int64)


def _shuffled_epochs(
    document_ids: np.ndarray, num_epochs: int, rng: np.random.RandomState
) -> np.ndarray:
    """``document_ids`` repeated ``num_epochs`` times, shuffled in place by ``rng`` (int32)."""
    index = np.tile(document_ids.astype(np.int32), num_epochs)
    rng.shuffle(index)
    return index


def _shuffled_range(first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of ``range(total)`` that shuffles ``[0, first)`` and ``[first, total)``
    separately."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(first, dtype=dtype)
    rng.shuffle(head)
    if first == total:
        return head
    tail = np.arange(first, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate([head, tail])


def _build_sample_index(lengths_in_order: np.ndarray, seq_length: int) -> np.ndarray:
    """``[num_samples + 1, 2]`` int64: (position in the document index, token offset) of the
    stream position ``j * seq_length`` for every sample ``j``, plus the final window's end.

    Windows overlap by one token and the last partial window is dropped. Positions land in the
    document that contains them, so empty documents are skipped.
    """
    ends = np.cumsum(lengths_in_order, dtype=np.int64)
    total_tokens = int(ends[-1])
    num_samples = (total_tokens - 1) // seq_length
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_position = np.searchsorted(ends, positions, side="right")
    starts = ends - lengths_in_order
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int64)
    sample_index[:, 0] = doc_position
    sample_index[:, 1] = positions - starts[doc_position]
    return sample_index


def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's ``--split``: up to three comma- or slash-separated weights, normalised.

    ``"949,50,1"`` -> ``(0.949, 0.05, 0.001)``; missing weights are 0.
    """
    fields = [f for f in re.split(r"[,/]", split.strip()) if f.strip()]
    try:
        weights = [float(f) for f in fields]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise UserError(
            f"--split {split!r} is not valid; give up to three non-negative weights "
            "for train,valid,test such as 949,50,1"
        )
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return weights[0] / total, weights[1] / total, weights[2] / total


def split_document_ranges(
    num_documents: int, split: tuple[float, float, float]
) -> list[tuple[int, int]]:
    """``[begin, end)`` of the train, valid and test documents, in file order (Megatron's
    rounding of the cumulative split fractions)."""
    bounds = [0.0]  # cumulative fractions
    for fraction in split:
        bounds.append(bounds[-1] + fraction)
    cuts = [int(round(b * num_documents)) for b in bounds]
    cuts[-1] = num_documents
    return [(cuts[i], cuts[i + 1]) for i in range(3)]


def split_documents(num_documents: int, split: tuple[float, float, float]) -> list[np.ndarray]:
    """The document ids of each split as int32 arrays."""
    return [
        np.arange(begin, end, dtype=np.int32)
        for begin, end in split_document_ranges(num_documents, split)
    ]
