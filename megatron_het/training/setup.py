"""Everything a run checks and resolves before it starts: tokenizer, model, plan, data, checkpoint.

:func:`prepare_run` loads the tokenizer, resolves the model config (completed from the checkpoint
to resume from), chooses the cluster and plan (:mod:`megatron_het.training.plan_setup`), checks
the data against the tokenizer and builds the datasets. It only reads files, so a bad command
line fails here with one line, on every rank alike, and leaves ``--save``, the metrics file and
the tensorboard directory untouched. A single process and a launched world go through it the same
way: only the world size differs.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_het.arguments import ModelSpec, RunConfig, padded_vocab_size, resolve_model_config
from megatron_het.checkpoint.io import (
    TRACKER_FILE,
    load_checkpoint_metadata,
    resolve_checkpoint_dir,
)
from megatron_het.checkpoint.megatron_load import (
    check_megatron_model,
    find_megatron_checkpoint,
    read_megatron_header,
)
from megatron_het.cluster import AcceleratorSpec, ClusterSpec
from megatron_het.config import ModelConfig, RunOptions, TrainConfig
from megatron_het.data import (
    IndexedDataset,
    build_tokenizer,
    build_train_valid_test_datasets,
    max_token_id,
    parse_data_path,
)
from megatron_het.data.mock_dataset import MockDataset, SampleDataset
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.training.plan_setup import choose_plan, host_profiles
from megatron_het.training.profiling import check_profile
from megatron_het.training.wandb_log import check_wandb

if TYPE_CHECKING:  # pragma: no cover
    from megatron_het.perf.estimates import Prediction
    from megatron_het.perf.measure.profile_format import Profile

# ModelConfig fields that do not change what a checkpoint's weights mean.
_FIELDS_FREE_ON_LOAD = ("name", "init_method_std")
# ModelConfig fields without a command-line flag: a resumed run takes them from the checkpoint.
_FIELDS_FROM_CHECKPOINT = ("rope_scaling",)


@dataclass(frozen=True)
class RunSetup:
    """The checked inputs of a run.

    ``train`` is the command line's TrainConfig with the plan's batch sizes (what the run
    uses; ``run.train`` keeps what was asked); ``run`` is the command line as given and
    ``options`` the run's options resolved once from it and the plan
    (:func:`~megatron_het.arguments.options.resolve_run_options`), which the trainer, the
    predictor and the dry run all read. ``load_dir`` is the iteration directory to resume from
    (None: start from scratch); ``valid_data`` is None when the split gives validation no
    documents or ``--eval-iters 0``. ``host_profiles`` is the ``--emulation-profile`` keyed for
    the predictor (None without the flag).
    """

    run: RunConfig
    model_config: ModelConfig
    tokenizer: Any
    cluster: ClusterSpec
    plan: ParallelPlan
    train: TrainConfig
    options: RunOptions
    train_data: SampleDataset
    valid_data: SampleDataset | None
    load_dir: pathlib.Path | None
    host_profiles: Mapping[str, Profile] | None = field(default=None)

    def accelerator(self, rank: int) -> AcceleratorSpec:
        """The accelerator kind of global ``rank``."""
        return self.cluster.accelerator_of(rank)


def check_data_vocab(data_path: tuple[str, ...], tokenizer_vocab_size: int) -> None:
    """Raise UserError if any data file holds an id the tokenizer cannot produce."""
    prefixes, _ = parse_data_path(data_path)
    for prefix in prefixes:
        largest = max_token_id(IndexedDataset(prefix))
        if largest >= tokenizer_vocab_size:
            raise UserError(
                f"data {prefix}.bin holds token id {largest} but the tokenizer has "
                f"{tokenizer_vocab_size} tokens; use the tokenizer the data was "
                "made with (or a larger --vocab-size)"
            )


def build_datasets(
    run: RunConfig, train: TrainConfig, vocab_size: int
) -> tuple[SampleDataset, SampleDataset | None]:
    """Train and valid datasets sized for ``train``'s iterations and global batch."""
    num_train = train.train_iters * train.global_batch_size
    num_valid = train.eval_iters * train.global_batch_size
    if run.data.mock_data:
        seq, seed = run.data.seq_length, run.data.seed
        valid = MockDataset(num_valid, seq, vocab_size, seed, 1) if num_valid else None
        return MockDataset(num_train, seq, vocab_size, seed, 0), valid
    train_data, valid_data, _ = build_train_valid_test_datasets(run.data, (num_train, num_valid, 0))
    if train_data is None:
        raise UserError(
            f"--split {run.data.split} leaves the train split no documents; "
            "give train a share (e.g. 969,30,1)"
        )
    return train_data, valid_data


def checkpoint_to_load(train: TrainConfig) -> pathlib.Path | None:
    """The iteration directory ``--load`` names, ours or Megatron-LM's (None: nothing to load
    yet)."""
    if train.load is None:
        return None
    path = pathlib.Path(train.load)
    megatron = find_megatron_checkpoint(path)
    if megatron is not None:
        return megatron
    same_as_save = train.save is not None and path.resolve() == pathlib.Path(train.save).resolve()
    if (
        same_as_save
        and not (path / TRACKER_FILE).exists()
        and not (path / "metadata.json").exists()
    ):
        return None  # the usual restartable job: --save and --load name one directory
    return resolve_checkpoint_dir(path)


def check_checkpoint_model(load_dir: pathlib.Path, model_config: ModelConfig) -> ModelConfig:
    """``model_config`` completed from the checkpoint at ``load_dir``.

    Fields no flag can set (RoPE scaling, e.g. of converted Llama-3.1 weights) are taken from
    the checkpoint. Raises UserError naming every other field where the two models differ.
    """
    saved_config = ModelConfig.from_dict(load_checkpoint_metadata(load_dir)["model_config"])
    model_config = model_config.replace(
        **{key: getattr(saved_config, key) for key in _FIELDS_FROM_CHECKPOINT}
    )
    saved, ours = saved_config.to_dict(), model_config.to_dict()
    differing = [
        f"{key} (checkpoint {saved[key]}, configured {ours[key]})"
        for key in ours
        if key not in _FIELDS_FREE_ON_LOAD and saved[key] != ours[key]
    ]
    if differing:
        raise UserError(
            f"--load {load_dir}: the checkpoint's model differs from the configured "
            f"one in {', '.join(differing)}; pass the checkpoint's shape flags"
        )
    return model_config


def model_to_load(
    run: RunConfig, load_dir: pathlib.Path | None, tokenizer_vocab_size: int
) -> ModelConfig:
    """The run's model: the flags' (or, with ``--use-checkpoint-args``, the checkpoint's with
    the shape flags given applied), checked against the checkpoint at ``load_dir`` (ours or
    Megatron-LM's); UserError naming what differs."""
    seq_length = run.data.seq_length
    if load_dir is None:
        return resolve_model_config(run.model, tokenizer_vocab_size, seq_length)
    megatron = find_megatron_checkpoint(load_dir) is not None
    if run.train.use_checkpoint_args:
        if run.model.preset is not None:
            raise UserError(
                f"--model {run.model.preset} and --use-checkpoint-args both give the model; "
                "drop one"
            )
        spec = run.model
        run_vocab = spec.vocab_size or padded_vocab_size(
            tokenizer_vocab_size, spec.make_vocab_size_divisible_by
        )
        saved = (
            read_megatron_header(load_dir, run_vocab).config
            if megatron
            else ModelConfig.from_dict(load_checkpoint_metadata(load_dir)["model_config"])
        )
        spec = ModelSpec(
            preset=None,
            overrides={**saved.to_dict(), **spec.overrides},
            vocab_size=spec.vocab_size or saved.vocab_size,
            make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by,
        )
        configured = resolve_model_config(spec, tokenizer_vocab_size, seq_length)
    else:
        configured = resolve_model_config(run.model, tokenizer_vocab_size, seq_length)
    if not megatron:
        return check_checkpoint_model(load_dir, configured)
    header = read_megatron_header(load_dir, configured.vocab_size)
    return check_megatron_model(load_dir, header.config, configured)


def keep_checkpoint_batch(run: RunConfig, load_dir: pathlib.Path) -> RunConfig:
    """``run`` with the checkpoint's global batch where ``--plan auto`` resumes it without
    ``--global-batch-size`` (an elastic restart continues at the same global batch)."""
    if run.parallel.plan != "auto" or run.parallel.batch_given[1]:
        return run
    saved = load_checkpoint_metadata(load_dir).get("plan")
    if not saved:
        return run
    batch = ParallelPlan.from_dict(saved).global_batch_size
    return dataclasses.replace(
        run,
        train=dataclasses.replace(run.train, global_batch_size=batch),
        parallel=dataclasses.replace(run.parallel, batch_given=(run.parallel.batch_given[0], True)),
    )


def prepare_run(run: RunConfig, world_size: int | None = 1, accelerator: str = "cpu") -> RunSetup:
    """Check the run's inputs and resolve model, plan and data (reads files only).

    ``world_size`` is the launched world: 1 for a single process, None for ``--dry-run`` (the
    cluster's, or the plan's without one). ``accelerator`` is the kind of every rank when there
    is no ``--cluster``.
    """
    data = run.data
    check_profile(run.train.profile, world_size, run.train.tensorboard_dir)
    check_wandb(run.train.wandb)
    tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model, data.vocab_size)
    load_dir = checkpoint_to_load(run.train)
    model_config = model_to_load(run, load_dir, tokenizer.vocab_size)
    if (
        load_dir is not None
        and not run.train.finetune
        and find_megatron_checkpoint(load_dir) is None
    ):
        run = keep_checkpoint_batch(run, load_dir)
    profiles = host_profiles(run.parallel)
    choice = choose_plan(run, model_config, world_size, profiles, accelerator)
    if not data.mock_data:
        check_data_vocab(data.data_path, tokenizer.vocab_size)
    train_data, valid_data = build_datasets(run, choice.train, tokenizer.vocab_size)
    return RunSetup(
        run=run,
        model_config=model_config,
        tokenizer=tokenizer,
        cluster=choice.cluster,
        plan=choice.plan,
        train=choice.train,
        options=choice.options,
        train_data=train_data,
        valid_data=valid_data,
        load_dir=load_dir,
        host_profiles=profiles,
    )


def predict_plan(setup: RunSetup, **given: Any) -> Prediction:
    """The predictor on the run's plan with the run's resolved options; ``given`` adds
    :func:`~megatron_het.perf.predict`'s other keyword arguments (a rate model, the pipeline
    model). UserError if the predictor cannot price the plan."""
    from megatron_het.perf import predict

    return predict(
        setup.model_config,
        setup.plan,
        setup.cluster,
        setup.run.data.seq_length,
        setup.host_profiles,
        setup.options,
        **given,
    )
