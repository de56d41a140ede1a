"""Everything a run checks and builds before it writes anything.

:func:`prepare_run` loads the tokenizer, resolves the model config, checks the data against the
tokenizer, builds the datasets and finds the checkpoint to resume from. It only reads files, so a
bad command line fails here with one line and leaves ``--save``, the metrics file and the
tensorboard directory untouched.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np

from megatron_het.arguments import RunConfig, resolve_model_config
from megatron_het.checkpoint.io import (TRACKER_FILE, load_checkpoint_metadata,
                                        resolve_checkpoint_dir)
from megatron_het.config import ModelConfig
from megatron_het.data import (IndexedDataset, build_tokenizer, build_train_valid_test_datasets,
                               max_token_id, parse_data_path)
from megatron_het.errors import UserError

# ModelConfig fields that do not change what a checkpoint's weights mean.
_FIELDS_FREE_ON_LOAD = ("name", "init_method_std")
# ModelConfig fields without a command-line flag: a resumed run takes them from the checkpoint.
_FIELDS_FROM_CHECKPOINT = ("rope_scaling",)


class SampleDataset(Protocol):
    """What the loop needs from a dataset: ``ds[i]`` is ``np.int64[seq_length + 1]``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...


class MockDataset:
    """Synthetic samples: uniformly random ids in ``[0, vocab_size)``, a pure function of
    ``(seed, split_id, index)``; for smoke tests and throughput runs without data files."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int,
                 split_id: int) -> None:
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


@dataclass(frozen=True)
class RunSetup:
    """The checked inputs of a run.

    ``load_dir`` is the iteration directory to resume from (None: start from scratch);
    ``valid_data`` is None when the split gives validation no documents or ``--eval-iters 0``.
    """

    run: RunConfig
    model_config: ModelConfig
    tokenizer: Any
    train_data: SampleDataset
    valid_data: Optional[SampleDataset]
    load_dir: Optional[pathlib.Path]


def check_data_vocab(data_path: tuple[str, ...], tokenizer_vocab_size: int) -> None:
    """Raise UserError if any data file holds an id the tokenizer cannot produce."""
    prefixes, _ = parse_data_path(data_path)
    for prefix in prefixes:
        largest = max_token_id(IndexedDataset(prefix))
        if largest >= tokenizer_vocab_size:
            raise UserError(f"data {prefix}.bin holds token id {largest} but the tokenizer has "
                            f"{tokenizer_vocab_size} tokens; use the tokenizer the data was "
                            "made with (or a larger --vocab-size)")


def _build_datasets(run: RunConfig, vocab_size: int
                    ) -> tuple[SampleDataset, Optional[SampleDataset]]:
    train = run.train
    num_train = train.train_iters * train.global_batch_size
    num_valid = train.eval_iters * train.global_batch_size
    if run.data.mock_data:
        seq, seed = run.data.seq_length, run.data.seed
        valid = MockDataset(num_valid, seq, vocab_size, seed, 1) if num_valid else None
        return MockDataset(num_train, seq, vocab_size, seed, 0), valid
    train_data, valid_data, _ = build_train_valid_test_datasets(run.data,
                                                                (num_train, num_valid, 0))
    if train_data is None:
        raise UserError(f"--split {run.data.split} leaves the train split no documents; "
                        "give train a share (e.g. 969,30,1)")
    return train_data, valid_data


def _checkpoint_to_load(run: RunConfig) -> Optional[pathlib.Path]:
    load = run.train.load
    if load is None:
        return None
    path = pathlib.Path(load)
    same_as_save = run.train.save is not None and path.resolve() == pathlib.Path(
        run.train.save).resolve()
    if same_as_save and not (path / TRACKER_FILE).exists() and not (
            path / "metadata.json").exists():
        return None  # the usual restartable job: --save and --load name one directory
    return resolve_checkpoint_dir(path)


def check_checkpoint_model(load_dir: pathlib.Path, model_config: ModelConfig) -> ModelConfig:
    """``model_config`` completed from the checkpoint at ``load_dir``.

    Fields no flag can set (RoPE scaling, e.g. of converted Llama-3.1 weights) are taken from
    the checkpoint. Raises UserError naming every other field where the two models differ.
    """
    saved_config = ModelConfig.from_dict(load_checkpoint_metadata(load_dir)["model_config"])
    model_config = model_config.replace(**{key: getattr(saved_config, key)
                                           for key in _FIELDS_FROM_CHECKPOINT})
    saved, ours = saved_config.to_dict(), model_config.to_dict()
    differing = [f"{key} (checkpoint {saved[key]}, configured {ours[key]})"
                 for key in ours if key not in _FIELDS_FREE_ON_LOAD and saved[key] != ours[key]]
    if differing:
        raise UserError(f"--load {load_dir}: the checkpoint's model differs from the configured "
                        f"one in {', '.join(differing)}; pass the checkpoint's shape flags")
    return model_config


def prepare_run(run: RunConfig) -> RunSetup:
    """Check the run's inputs and build tokenizer, model config and datasets (reads only)."""
    data = run.data
    tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model, data.vocab_size)
    model_config = resolve_model_config(run.model, tokenizer.vocab_size, data.seq_length)
    if not data.mock_data:
        check_data_vocab(data.data_path, tokenizer.vocab_size)
    load_dir = _checkpoint_to_load(run)
    if load_dir is not None:
        model_config = check_checkpoint_model(load_dir, model_config)
    train_data, valid_data = _build_datasets(run, tokenizer.vocab_size)
    return RunSetup(run=run, model_config=model_config, tokenizer=tokenizer,
                    train_data=train_data, valid_data=valid_data, load_dir=load_dir)
