"""Token files in Megatron-LM's ``MMIDIDX`` format: ``{prefix}.bin`` plus ``{prefix}.idx``.

The ``.bin`` file is every sequence's tokens back to back in one dtype. The ``.idx`` file is,
all little-endian:

====================  ==========================================================
9 bytes               magic ``b"MMIDIDX\\x00\\x00"``
uint64                format version, always 1
uint8                 dtype code of the ``.bin`` tokens (see ``DTYPE_CODES``)
uint64                sequence count ``S``
uint64                document count ``D`` (entries of the document index, documents + 1)
int32[S]              tokens per sequence
int64[S]              byte offset of each sequence in ``.bin``
int64[D]              document index: document ``d`` is sequences
                      ``[document_indices[d], document_indices[d + 1])``; starts at 0, ends at S
====================  ==========================================================

Files written here read in Megatron-LM and the other way round. Each document written by
:class:`IndexedDatasetBuilder` is one sequence, so ``len(dataset)`` counts documents too.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

import numpy as np

from megatron_het.errors import UserError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# Header: magic, version <Q, dtype code <B, sequence count <Q, document count <Q.
_HEADER = struct.Struct("<9sQBQQ")

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}


def bin_path(prefix: str) -> str:
    """The token file of a dataset prefix."""
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    """The index file of a dataset prefix."""
    return prefix + ".idx"


def optimal_dtype(vocab_size: int | None) -> type:
    """Token dtype Megatron picks for a vocabulary: uint16 below 65500 ids, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


class IndexedDataset:
    """Read-only, memory-mapped view of ``{prefix}.bin``/``{prefix}.idx``.

    ``ds[i]`` is sequence ``i``'s tokens as a read-only 1-D array of ``ds.dtype`` (a view into the
    memory map; copy before writing). Opening validates the index against both file sizes and
    raises UserError naming the file and the inconsistency. Pickles by path, so dataloader
    workers re-open the files instead of copying them.
    """

    def __init__(self, path_prefix: str) -> None:
        self._open(path_prefix)

    # ---- opening and validation ----------------------------------------------------------------
    def _open(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        for path in (idx_path(path_prefix), bin_path(path_prefix)):
            if not os.path.isfile(path):
                raise UserError(
                    f"data file {path} does not exist; check --data-path (a prefix "
                    "without .bin/.idx) or run tools/preprocess_data.py"
                )
        self._read_index(idx_path(path_prefix))
        self._open_bin(bin_path(path_prefix))

    def _read_index(self, path: str) -> None:
        size = os.path.getsize(path)
        if size < _HEADER.size:
            raise UserError(
                f"index file {path} is truncated: {size} bytes, shorter than the "
                f"{_HEADER.size}-byte header; re-run preprocessing"
            )
        with open(path, "rb") as f:
            magic, version, code, seq_count, doc_count = _HEADER.unpack(f.read(_HEADER.size))
        if magic != INDEX_MAGIC:
            raise UserError(
                f"index file {path} has a bad header {magic!r} (expected "
                f"{INDEX_MAGIC!r}); it is not a Megatron MMIDIDX index"
            )
        if version != INDEX_VERSION:
            raise UserError(
                f"index file {path} has version {version}; only version "
                f"{INDEX_VERSION} is supported"
            )
        if code not in DTYPE_CODES:
            raise UserError(
                f"index file {path} has unknown dtype code {code}; known codes: "
                f"{sorted(DTYPE_CODES)}"
            )
        expected = _HEADER.size + seq_count * (4 + 8) + doc_count * 8
        if size != expected:
            raise UserError(
                f"index file {path} is {size} bytes but its header ({seq_count} "
                f"sequences, {doc_count} document entries) implies {expected}; "
                "the file is truncated or corrupt"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(mm, np.int32, seq_count, offset)
        offset += 4 * seq_count
        self.sequence_pointers = np.frombuffer(mm, np.int64, seq_count, offset)
        offset += 8 * seq_count
        self.document_indices = np.frombuffer(mm, np.int64, doc_count, offset)
        self._idx_mmap = mm
        self._check_document_indices(path, seq_count)

    def _check_document_indices(self, path: str, seq_count: int) -> None:
        doc = self.document_indices
        if doc.size == 0 or doc[0] != 0 or doc[-1] != seq_count:
            raise UserError(
                f"index file {path} is corrupt: the document index must run from 0 "
                f"to the sequence count {seq_count}"
            )
        if doc.size > 1 and np.any(np.diff(doc) < 0):
            raise UserError(f"index file {path} is corrupt: the document index decreases")
        if seq_count and self.sequence_lengths.min() < 0:
            raise UserError(f"index file {path} is corrupt: a sequence length is negative")

    def _open_bin(self, path: str) -> None:
        size = os.path.getsize(path)
        if len(self.sequence_lengths):
            nbytes = self.sequence_lengths.astype(np.int64) * self.dtype.itemsize
            ends = self.sequence_pointers + nbytes
            bad = np.flatnonzero((self.sequence_pointers < 0) | (ends > size))
            if bad.size:
                i = int(bad[0])
                raise UserError(
                    f"data file {path} is {size} bytes but sequence {i} of "
                    f"{idx_path(self.path_prefix)} "
                    f"points to bytes [{int(self.sequence_pointers[i])}, {int(ends[i])}); "
                    "the .bin is truncated or does not belong to this .idx"
                )
            if np.any(self.sequence_pointers % self.dtype.itemsize):
                raise UserError(
                    f"index file {idx_path(self.path_prefix)} is corrupt: a sequence "
                    f"pointer is not a multiple of the {self.dtype} item size"
                )
        # np.memmap refuses empty files; an empty dataset needs no mapping.
        self._bin = (
            np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, dtype=np.uint8)
        )

    def __getstate__(self) -> str:
        return self.path_prefix

    def __setstate__(self, state: str) -> None:
        self._open(state)

    # ---- access --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int | np.integer | slice) -> np.ndarray | list[np.ndarray]:
        """One sequence's tokens, or a list of them for a slice."""
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end if no length)."""
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {n} sequences")
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence "
                f"{idx} of length {seq_len}"
            )
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


def max_token_id(dataset: IndexedDataset, chunk_tokens: int = 1 << 26) -> int:
    """Largest token id over every sequence of ``dataset`` (-1 when it holds no tokens).

    Reads the memory map in chunks of ``chunk_tokens``, covering the byte ranges the index points
    to (the whole token area when sequences are packed back to back, as writers do).
    """
    if dataset.num_tokens == 0:
        return -1
    itemsize = dataset.dtype.itemsize
    lengths = dataset.sequence_lengths.astype(np.int64)
    pointers = dataset.sequence_pointers
    packed = pointers[0] == 0 and np.array_equal(pointers[1:], np.cumsum(lengths)[:-1] * itemsize)
    if packed:
        ranges = [(0, int(lengths.sum()))]
    else:
        ranges = [
            (int(p) // itemsize, int(p) // itemsize + int(n))
            for p, n in zip(pointers, lengths)
            if n
        ]
    tokens = np.frombuffer(dataset._bin, dataset.dtype, len(dataset._bin) // itemsize)
    best = None
    for begin, end in ranges:
        for start in range(begin, end, chunk_tokens):
            value = tokens[start : min(end, start + chunk_tokens)].max()
            best = value if best is None else max(best, value)
    assert best is not None  # the dataset holds tokens, so some range is non-empty
    return int(best)


class IndexedDatasetBuilder:
    """Writes ``.bin`` tokens as documents arrive, and the ``.idx`` on :meth:`finalize`.

    One ``add_document`` call makes one document holding one sequence. The ``.bin`` file is open
    for writing until ``finalize``; callers that need atomic outputs pass temporary paths and
    rename afterwards.
    """

    def __init__(self, bin_path: str, dtype: type = np.int32) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no MMIDIDX code")
        self.bin_path = bin_path
        self._bin_file = open(bin_path, "wb")
        self._sequence_lengths: list[int] = []
        self._document_indices: list[int] = [0]

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document (one sequence) of token ids; ids must fit the dtype."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a document is a 1-D token list, got shape {array.shape}")
        converted = array.astype(self.dtype)
        if array.size and not np.array_equal(converted, array):
            raise ValueError(
                f"token ids do not fit {self.dtype} (range {array.min()}..{array.max()})"
            )
        self._bin_file.write(converted.tobytes(order="C"))
        self._sequence_lengths.append(int(array.size))
        self._document_indices.append(len(self._sequence_lengths))

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin`` file and write the index to ``idx_path``."""
        self._bin_file.close()
        lengths = np.asarray(self._sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.asarray(self._document_indices, dtype=np.int64)
        with open(idx_path, "wb") as f:
            f.write(
                _HEADER.pack(
                    INDEX_MAGIC,
                    INDEX_VERSION,
                    _CODE_OF_DTYPE[self.dtype],
                    len(lengths),
                    len(documents),
                )
            )
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(documents.tobytes(order="C"))

    def close(self) -> None:
        """Close the ``.bin`` file without writing an index (after a failure)."""
        self._bin_file.close()
