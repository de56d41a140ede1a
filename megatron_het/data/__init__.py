"""The data path: tokenizers, Megatron-format indexed token files, GPT samples and blending."""

from megatron_het.data.blended_dataset import BlendedDataset
from megatron_het.data.dataset_builder import (
    build_train_valid_test_datasets,
    data_max_token_id,
    parse_data_path,
)
from megatron_het.data.gpt_dataset import GPTDataset, parse_split
from megatron_het.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    max_token_id,
    optimal_dtype,
)
from megatron_het.data.tokenizer import build_tokenizer

__all__ = [
    "BlendedDataset",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "build_tokenizer",
    "build_train_valid_test_datasets",
    "data_max_token_id",
    "max_token_id",
    "optimal_dtype",
    "parse_data_path",
    "parse_split",
]
