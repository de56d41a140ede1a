"""``pretrain_llama.py``'s command line and every tool's shared flags -> frozen configs.

The only place that reads argv. Flag names follow Megatron-LM where it has one.

- :mod:`~megatron_het.arguments.parser`: the parser class every entry point uses (its errors
  are one UserError line) and the model-shape flags in one table;
- :mod:`~megatron_het.arguments.pretrain_flags`: ``pretrain_llama.py``'s flags
  (:func:`build_parser`), with :mod:`~megatron_het.arguments.io_flags` for checkpoints,
  logging and faults;
- :mod:`~megatron_het.arguments.model_flags`: the model's shape (:class:`ModelSpec`,
  :func:`resolve_model_config`), also for the tools that take a model;
- :mod:`~megatron_het.arguments.run_config`: argv -> :class:`RunConfig` (:func:`parse_run_config`).
"""

from megatron_het.arguments.model_flags import ModelSpec, padded_vocab_size, resolve_model_config
from megatron_het.arguments.pretrain_flags import BRIDGES, PROG, build_parser
from megatron_het.arguments.run_config import ParallelSpec, RunConfig, parse_run_config

__all__ = [
    "BRIDGES",
    "PROG",
    "ModelSpec",
    "ParallelSpec",
    "RunConfig",
    "build_parser",
    "padded_vocab_size",
    "parse_run_config",
    "resolve_model_config",
]
