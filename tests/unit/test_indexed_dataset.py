"""Megatron MMIDIDX .bin/.idx files: byte-exact golden files built from the spec, round trips,
and corrupt-file errors."""

import pickle
import re
import struct

import numpy as np
import pytest

from megatron_het.data import IndexedDataset, IndexedDatasetBuilder, max_token_id, optimal_dtype
from megatron_het.errors import UserError


def golden_files(
    prefix: str, code: int, fmt: str, sequences: list[list[int]], document_indices: list[int]
) -> tuple[bytes, bytes]:
    """Write ``prefix.bin/.idx`` byte by byte from the format description; return the bytes."""
    itemsize = struct.calcsize("<" + fmt)
    lengths = [len(s) for s in sequences]
    pointers = [sum(lengths[:i]) * itemsize for i in range(len(lengths))]
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(sequences)) + struct.pack("<Q", len(document_indices))
    idx += struct.pack(f"<{len(lengths)}i", *lengths)
    idx += struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(document_indices)}q", *document_indices)
    flat = [t for s in sequences for t in s]
    data = struct.pack(f"<{len(flat)}{fmt}", *flat)
    with open(prefix + ".idx", "wb") as f:
        f.write(idx)
    with open(prefix + ".bin", "wb") as f:
        f.write(data)
    return idx, data


def write_dataset(prefix: str, documents, dtype=np.uint16) -> IndexedDataset:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in documents:
        builder.add_document(doc)
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


DOCS = [[1, 2, 3], [4, 5], [], [65000, 0, 7, 8]]


def test_builder_writes_the_golden_bytes(tmp_path):
    golden_idx, golden_bin = golden_files(str(tmp_path / "golden"), 8, "H", DOCS, [0, 1, 2, 3, 4])
    write_dataset(str(tmp_path / "ours"), DOCS, np.uint16)
    assert (tmp_path / "ours.idx").read_bytes() == golden_idx
    assert (tmp_path / "ours.bin").read_bytes() == golden_bin


def test_reads_golden_multi_sequence_documents(tmp_path):
    # Sentence-split data: document 0 = sequences 0-1, document 1 = sequence 2; int32 tokens.
    sequences = [[10, 11], [12], [70000, 3, 4]]
    golden_files(str(tmp_path / "g"), 4, "i", sequences, [0, 2, 3])
    ds = IndexedDataset(str(tmp_path / "g"))
    assert ds.dtype == np.int32
    assert len(ds) == 3 and ds.num_documents == 2 and ds.num_tokens == 6
    assert ds.sequence_lengths.tolist() == [2, 1, 3]
    assert ds.document_indices.tolist() == [0, 2, 3]
    for i, seq in enumerate(sequences):
        assert ds[i].tolist() == seq
    assert ds[-1].tolist() == sequences[-1]
    assert ds.get(2, offset=1, length=2).tolist() == [3, 4]
    assert ds.get(2, offset=1).tolist() == [3, 4]
    assert [a.tolist() for a in ds[0:2]] == sequences[:2]
    assert max_token_id(ds) == 70000


def test_round_trip_and_pickle(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, size=int(n)) for n in rng.integers(0, 40, size=50)]
    ds = write_dataset(str(tmp_path / "rt"), docs, optimal_dtype(50000))
    assert ds.dtype == np.uint16 and len(ds) == 50 and ds.num_documents == 50
    for doc, got in zip(docs, ds[:]):
        np.testing.assert_array_equal(got, doc)
    assert max_token_id(ds) == max(int(d.max()) for d in docs if len(d))
    assert max_token_id(ds, chunk_tokens=7) == max_token_id(ds)
    copy = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(copy[3], ds[3])
    with pytest.raises(IndexError):
        ds.get(0, offset=0, length=len(docs[0]) + 1)
    with pytest.raises(IndexError):
        ds[50]


def test_optimal_dtype_and_range_checks(tmp_path):
    assert optimal_dtype(32000) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(128256) == np.int32
    assert optimal_dtype(None) == np.int32
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16)
    with pytest.raises(ValueError, match="fit"):
        builder.add_document([70000])
    builder.close()
    empty = write_dataset(str(tmp_path / "empty"), [])
    assert len(empty) == 0 and max_token_id(empty) == -1


def _corrupt(tmp_path, mutate_idx=None, mutate_bin=None) -> str:
    prefix = str(tmp_path / "c")
    idx, data = golden_files(prefix, 8, "H", DOCS, [0, 1, 2, 3, 4])
    if mutate_idx:
        (tmp_path / "c.idx").write_bytes(mutate_idx(bytearray(idx)))
    if mutate_bin:
        (tmp_path / "c.bin").write_bytes(mutate_bin(bytearray(data)))
    return prefix


def _set(offset, packed):
    def mutate(buf):
        buf[offset : offset + len(packed)] = packed
        return bytes(buf)

    return mutate


@pytest.mark.parametrize(
    "mutate_idx, mutate_bin, file, what",
    [
        (_set(0, b"XXIDIDX"), None, "idx", "bad header"),
        (_set(9, struct.pack("<Q", 2)), None, "idx", "version 2"),
        (_set(17, struct.pack("<B", 9)), None, "idx", "dtype code 9"),
        (lambda b: bytes(b[:-8]), None, "idx", "truncated or corrupt"),
        (lambda b: bytes(b[:20]), None, "idx", "truncated"),
        (_set(18, struct.pack("<Q", 5)), None, "idx", "implies"),
        (lambda b: bytes(b[:-8]) + struct.pack("<q", 3), None, "idx", "document index"),
        (_set(34 + 16 + 8, struct.pack("<q", 1000)), None, "bin", "sequence 1"),
        (None, lambda b: bytes(b[:-2]), "bin", "truncated"),
    ],
)
def test_corrupt_files_name_the_file(tmp_path, mutate_idx, mutate_bin, file, what):
    prefix = _corrupt(tmp_path, mutate_idx, mutate_bin)
    with pytest.raises(UserError) as info:
        IndexedDataset(prefix)
    message = str(info.value)
    assert f"{prefix}.{file}" in message and what in message and "\n" not in message


def test_missing_files(tmp_path):
    prefix = _corrupt(tmp_path)
    (tmp_path / "c.bin").unlink()
    with pytest.raises(UserError, match=re.escape(prefix + ".bin")):
        IndexedDataset(prefix)
    with pytest.raises(UserError, match=re.escape(str(tmp_path / "absent.idx"))):
        IndexedDataset(str(tmp_path / "absent"))
