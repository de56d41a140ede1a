"""GPT samples, splits, blending and the train/valid/test builder.

Token ids in these datasets are unique per (document, offset), so a sample's tokens say exactly
which stream positions it covers.
"""

import numpy as np
import pytest

from megatron_het.config import DataConfig
from megatron_het.data import (
    BlendedDataset,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    build_train_valid_test_datasets,
    data_max_token_id,
    parse_data_path,
    parse_split,
)
from megatron_het.data.blended_dataset import build_blending_indices
from megatron_het.data.gpt_dataset import split_document_ranges
from megatron_het.errors import UserError


def unique_token_dataset(
    prefix: str, num_docs: int, seed: int = 0, max_len: int = 30, first_token: int = 0
) -> IndexedDataset:
    """Documents of random lengths (some empty) whose tokens count up from ``first_token``."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    next_token = first_token
    for length in rng.integers(0, max_len, size=num_docs):
        builder.add_document(np.arange(next_token, next_token + length))
        next_token += int(length)
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


@pytest.fixture
def indexed(tmp_path):
    return unique_token_dataset(str(tmp_path / "u"), 40)


def reference_sample_index(lengths, document_index, seq_length):
    """Megatron's sample-index walk, one token budget at a time (a plain-loop reference)."""
    total = sum(int(lengths[d]) for d in document_index)
    out = [(0, 0)]
    position, offset = 0, 0
    for _ in range((total - 1) // seq_length):
        remaining = seq_length + 1
        while remaining:
            available = int(lengths[document_index[position]]) - offset
            remaining -= available
            if remaining <= 0:
                offset += remaining + available - 1  # the next window starts on the extra token
                remaining = 0
            else:
                position, offset = position + 1, 0
        out.append((position, offset))
    return np.array(out)


@pytest.mark.parametrize("num_samples, seq_length", [(5, 16), (60, 16), (200, 7), (33, 64)])
def test_samples_are_windows_of_the_document_stream(indexed, num_samples, seq_length):
    docs = np.arange(5, 35)
    ds = GPTDataset(indexed, docs, num_samples, seq_length, seed=3)
    assert len(ds) >= num_samples
    np.testing.assert_array_equal(
        ds.sample_index,
        reference_sample_index(indexed.sequence_lengths, ds.document_index, seq_length),
    )
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
    stream = np.concatenate([indexed[int(d)] for d in ds.document_index]).astype(np.int64)
    first_token = {int(indexed[int(d)][0]) for d in docs if indexed.sequence_lengths[d]}
    last_token = {int(indexed[int(d)][-1]) for d in docs if indexed.sequence_lengths[d]}
    for i in range(len(ds)):
        sample = ds[i]
        assert sample.dtype == np.int64 and sample.shape == (seq_length + 1,)
        j = int(ds.shuffle_index[i])
        np.testing.assert_array_equal(sample, stream[j * seq_length : (j + 1) * seq_length + 1])
        # Independent of the indices: tokens run on within a document and jump only from a
        # document's last token to another document's first.
        for a, b in zip(sample[:-1], sample[1:]):
            assert b == a + 1 or (a in last_token and b in first_token)


@pytest.mark.parametrize("num_samples", [10, 60, 95, 300])
def test_every_epoch_covers_each_token_once(indexed, num_samples):
    docs = np.arange(0, 40)
    seq_length = 16
    ds = GPTDataset(indexed, docs, num_samples, seq_length, seed=7)
    tokens = np.concatenate([indexed[int(d)] for d in docs])
    per_epoch = len(tokens)
    assert ds.num_epochs == -(-(num_samples * seq_length + 1) // per_epoch)
    # The document index holds every document once per epoch (epochs shuffled together, as
    # Megatron does, unless the final epoch is shuffled apart).
    assert np.array_equal(np.bincount(ds.document_index, minlength=40), np.full(40, ds.num_epochs))
    counts = np.zeros(tokens.max() + 1, dtype=np.int64)
    for i in range(len(ds)):
        np.add.at(counts, ds[i][:-1], 1)
    # Input positions partition the stream: each token once per epoch, except the dropped tail.
    assert counts.sum() == len(ds) * seq_length
    assert set(np.unique(counts[tokens])) <= {ds.num_epochs - 1, ds.num_epochs}
    assert (counts[tokens] == ds.num_epochs - 1).sum() < seq_length + 1


def test_partial_final_epoch_is_shuffled_apart(indexed):
    docs = np.arange(0, 40)
    tokens = int(indexed.sequence_lengths[docs].sum())
    seq_length = 16
    per_epoch = (tokens - 1) // seq_length
    ds = GPTDataset(indexed, docs, per_epoch + 2, seq_length, seed=1)  # 2 samples into epoch 2
    assert ds.num_epochs == 2
    head = (tokens - 1) // seq_length
    # Samples of the full epoch come first in shuffled order, then the partial epoch's.
    assert sorted(ds.shuffle_index[:head].tolist()) == list(range(head))
    assert sorted(ds.document_index[:40].tolist()) == list(docs)


def test_determinism(indexed):
    docs = np.arange(0, 40)
    a = GPTDataset(indexed, docs, 50, 16, seed=5)
    b = GPTDataset(indexed, docs, 50, 16, seed=5)
    c = GPTDataset(indexed, docs, 50, 16, seed=6)
    same = [np.array_equal(a[i], b[i]) for i in range(50)]
    other = [np.array_equal(a[i], c[i]) for i in range(50)]
    assert all(same)
    assert sum(other) < 10


def test_too_few_tokens(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "t.bin"), np.uint16)
    for doc in ([5], [], [7, 8]):
        builder.add_document(doc)
    builder.finalize(str(tmp_path / "t.idx"))
    tiny = IndexedDataset(str(tmp_path / "t"))
    with pytest.raises(UserError, match="too few"):
        GPTDataset(tiny, np.array([0, 1]), 4, 8, seed=1)
    assert len(GPTDataset(tiny, np.array([0, 1, 2]), 1, 2, seed=1)) == 1


def test_parse_split():
    assert parse_split("949,50,1") == pytest.approx((0.949, 0.05, 0.001))
    assert parse_split("98/2") == pytest.approx((0.98, 0.02, 0.0))
    assert parse_split("1") == (1.0, 0.0, 0.0)
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2", ""):
        with pytest.raises(UserError, match="--split"):
            parse_split(bad)
    assert split_document_ranges(1000, parse_split("949,50,1")) == [
        (0, 949),
        (949, 999),
        (999, 1000),
    ]
    assert split_document_ranges(10, parse_split("969,30,1")) == [(0, 10), (10, 10), (10, 10)]
    assert split_document_ranges(10, parse_split("8,1,1")) == [(0, 8), (8, 9), (9, 10)]


def reference_blend(weights, n):
    counts = np.zeros(len(weights))
    chosen = []
    for i in range(n):
        errors = np.asarray(weights) * max(i, 1) - counts
        d = int(np.argmax(errors))  # first maximum
        chosen.append(d)
        counts[d] += 1
    return np.array(chosen)


def test_blending_shares():
    weights = [0.2, 0.3, 0.5]
    datasets = [
        [("a", i) for i in range(400)],
        [("b", i) for i in range(400)],
        [("c", i) for i in range(600)],
    ]
    blend = BlendedDataset(datasets, [2, 3, 5], 1000)  # unnormalised weights are normalised
    np.testing.assert_array_equal(blend.dataset_index, reference_blend(weights, 1000))
    for n in (10, 97, 500, 1000):
        counts = np.bincount(blend.dataset_index[:n], minlength=3)
        assert np.all(np.abs(counts - np.array(weights) * n) <= 1.0)
    seen = {name: [] for name in "abc"}
    for i in range(len(blend)):
        name, k = blend[i]
        seen[name].append(k)
    for ks in seen.values():
        assert ks == list(range(len(ks)))  # each component read in order, none skipped
    with pytest.raises(ValueError, match="only"):
        BlendedDataset([[0] * 10, [0] * 10], [0.5, 0.5], 100)
    with pytest.raises(UserError, match="weights"):
        BlendedDataset([[0], [0]], [-1.0, 2.0], 1)
    np.testing.assert_array_equal(build_blending_indices(np.array([1.0]), 3)[1], [0, 1, 2])


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    for bad in (["0.3", "a", "b"], ["a", "0.3"], ["0.3", "a", "0.7"], []):
        with pytest.raises(UserError, match="data-path"):
            parse_data_path(bad)


def test_train_valid_test_from_one_prefix(tmp_path):
    prefix = str(tmp_path / "one")
    unique_token_dataset(prefix, 100, max_len=20)
    config = DataConfig(data_path=(prefix,), split="8,1,1", seq_length=8, seed=11)
    train, valid, test = build_train_valid_test_datasets(config, (200, 10, 3))
    assert train.document_ids.tolist() == list(range(80))
    assert valid.document_ids.tolist() == list(range(80, 90))
    assert test.document_ids.tolist() == list(range(90, 100))
    assert len(train) >= 200 and len(valid) >= 10 and len(test) >= 3
    again, _, _ = build_train_valid_test_datasets(config, (200, 10, 3))
    for i in (0, 17, 199):
        np.testing.assert_array_equal(train[i], again[i])
    no_valid = DataConfig(data_path=(prefix,), split="1,0,0", seq_length=8)
    train, valid, test = build_train_valid_test_datasets(no_valid, (20, 5, 0))
    assert train is not None and valid is None and test is None


def test_train_valid_test_blended(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    unique_token_dataset(a, 60, seed=1, max_len=20)
    unique_token_dataset(b, 60, seed=2, max_len=20, first_token=100000)
    config = DataConfig(data_path=("0.3", a, "0.7", b), split="90,10,0", seq_length=8, seed=2)
    train, valid, test = build_train_valid_test_datasets(config, (500, 20, 5))
    assert isinstance(train, BlendedDataset) and len(train) == 500 and test is None
    from_b = sum(int(train[i][0] >= 100000) for i in range(len(train)))
    assert abs(from_b - 350) <= 1
    assert len(valid) == 20
    unweighted = DataConfig(data_path=(a, b), split="1", seq_length=8)
    train, _, _ = build_train_valid_test_datasets(unweighted, (100, 0, 0))
    tokens_a, tokens_b = (IndexedDataset(p).num_tokens for p in (a, b))
    assert np.allclose(
        train.weights, [tokens_a / (tokens_a + tokens_b), tokens_b / (tokens_a + tokens_b)]
    )


def test_missing_prefix_names_the_file(tmp_path):
    config = DataConfig(data_path=(str(tmp_path / "nowhere"),), seq_length=8)
    with pytest.raises(UserError, match="nowhere.idx"):
        build_train_valid_test_datasets(config, (10, 0, 0))


def test_max_token_id_over_prefixes(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    unique_token_dataset(a, 10, seed=1)
    last_b = unique_token_dataset(b, 10, seed=2, first_token=5000)
    expected = int(max(last_b[i].max() for i in range(10) if last_b.sequence_lengths[i]))
    assert data_max_token_id(DataConfig(data_path=("1", a, "2", b))) == expected
