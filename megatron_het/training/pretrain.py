"""A whole single-device pretraining run: check, build, resume, train, evaluate, save.

Order matters for the user: every input is checked (and a checkpoint to resume from is read)
before the first file is written, so a failing run leaves ``--save``, the metrics file and the
tensorboard directory as they were.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Optional, TextIO

import torch

from megatron_het.arguments import RunConfig
from megatron_het.checkpoint.io import load_model_state, load_train_state, save_checkpoint
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.model.init import init_weights
from megatron_het.model.llama import LlamaModel
from megatron_het.optim.lr_schedule import LRSchedule
from megatron_het.optim.optimizer import build_optimizer
from megatron_het.training.loop import (StopRequest, evaluate, get_micro_batches, run_iterations,
                                        train_step)
from megatron_het.training.metrics import TrainingLogger
from megatron_het.training.setup import RunSetup, prepare_run
from megatron_het.training.state import (Progress, capture_train_state, restore_train_state,
                                         seed_everything)


def default_device() -> torch.device:
    """The first CUDA/ROCm device when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class Trainer:
    """The live objects of a run (model on ``device``, fp32 weights and AdamW state)."""

    setup: RunSetup
    model: LlamaModel
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    progress: Progress
    device: torch.device
    logger: Optional[TrainingLogger] = None


def build_trainer(setup: RunSetup, device: torch.device) -> Trainer:
    """Seeded model + optimizer, restored from ``setup.load_dir`` when there is one.

    A checkpoint without training state (model-only, e.g. converted weights) loads its weights
    and starts a fresh optimizer at iteration 0.
    """
    run = setup.run
    seed_everything(run.train.seed)
    model = LlamaModel(setup.model_config).to(device)
    init_weights(model, run.train.seed)
    optimizer = build_optimizer(model, run.optimizer)
    schedule = LRSchedule.from_config(run.optimizer, run.train.train_iters)
    progress = Progress()
    if setup.load_dir is not None:
        _, state = load_model_state(setup.load_dir, map_location=device)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise UserError(f"--load {setup.load_dir}: checkpoint tensors do not match the "
                            f"model (missing: {', '.join(missing[:3]) or 'none'}; unexpected: "
                            f"{', '.join(unexpected[:3]) or 'none'})")
        train_state = load_train_state(setup.load_dir)
        if train_state is not None:
            progress = restore_train_state(train_state, optimizer)
    return Trainer(setup, model, optimizer, schedule, progress, device)


def save(trainer: Trainer) -> Optional[pathlib.Path]:
    """Checkpoint the trainer's state as its current iteration (no-op without ``--save``)."""
    run, progress = trainer.setup.run, trainer.progress
    if run.train.save is None:
        return None
    start = time.perf_counter()
    metadata = {"argv": list(run.argv), "consumed_samples": progress.consumed_samples,
                "run_config": dataclasses.asdict(run)}
    path = save_checkpoint(run.train.save, progress.iteration, trainer.setup.model_config,
                           trainer.model.state_dict(),
                           capture_train_state(trainer.optimizer, trainer.schedule, progress),
                           metadata)
    trainer.logger.print(f" saved checkpoint at iteration {progress.iteration} to {path} "
                         f"({time.perf_counter() - start:.2f} s)")
    return path


def _evaluate_and_log(trainer: Trainer) -> None:
    train = trainer.setup.run.train
    if trainer.setup.valid_data is None or train.eval_iters == 0:
        return
    loss = evaluate(trainer.model, trainer.setup.valid_data, train, trainer.device)
    trainer.logger.log_eval(trainer.progress.iteration, trainer.progress.consumed_samples, loss)


def _one_iteration(trainer: Trainer) -> None:
    train, progress = trainer.setup.run.train, trainer.progress
    start = time.perf_counter()
    iteration = progress.iteration + 1
    batches = get_micro_batches(trainer.setup.train_data, progress.consumed_samples,
                                train.global_batch_size, train.micro_batch_size, trainer.device)
    result = train_step(trainer.model, trainer.optimizer, batches,
                        trainer.schedule.lr_at(iteration), trainer.setup.run.optimizer.clip_grad,
                        train.bf16, iteration)
    progress.iteration = iteration
    progress.consumed_samples += train.global_batch_size
    elapsed = time.perf_counter() - start
    trainer.logger.log_train(iteration, progress.consumed_samples, result.loss, result.lr,
                             result.grad_norm, elapsed)


def train_loop(trainer: Trainer, stop: StopRequest) -> str:
    """Iterate to ``--train-iters``; returns why it stopped ("done", "exit-interval", a signal).

    Evaluates every ``--eval-interval`` and at the end; saves every ``--save-interval``, on
    ``--exit-interval``, on a stop request and at the end (each iteration at most once).
    """
    def step() -> str:
        _one_iteration(trainer)
        return stop.reason if stop.requested else ""

    return run_iterations(trainer.setup.run.train, lambda: trainer.progress.iteration, step,
                          lambda: _evaluate_and_log(trainer),
                          lambda: save(trainer) is not None, trainer.logger.print)


def _describe(config: ModelConfig, trainer: Trainer) -> str:
    train = trainer.setup.run.train
    accumulation = train.global_batch_size // train.micro_batch_size
    return (f"> model {config.name}: {config.num_layers} layers, hidden {config.hidden_size}, "
            f"heads {config.num_attention_heads}/{config.num_query_groups} kv, vocab "
            f"{config.vocab_size}, {config.num_parameters() / 1e6:.2f}M parameters\n"
            f"> training on {trainer.device.type} ({'bf16' if train.bf16 else 'fp32'}): "
            f"iterations {trainer.progress.iteration + 1}..{train.train_iters}, global batch "
            f"{train.global_batch_size} = {train.micro_batch_size} x {accumulation} micro-batches,"
            f" seq {trainer.setup.run.data.seq_length}, from sample "
            f"{trainer.progress.consumed_samples}")


def pretrain(run: RunConfig, stop: Optional[StopRequest] = None,
             device: Optional[torch.device] = None, out: TextIO = sys.stdout) -> Progress:
    """Run ``run`` to completion (or until ``--exit-interval``/``stop``); returns the progress.

    Raises UserError for any bad input before writing anything.
    """
    stop = stop or StopRequest()
    setup = prepare_run(run)
    trainer = build_trainer(setup, device or default_device())
    trainer.logger = TrainingLogger(run.train, setup.model_config, run.data.seq_length,
                                    start_iteration=trainer.progress.iteration, out=out)
    try:
        if setup.load_dir is not None:
            trainer.logger.print(f"> loaded {setup.load_dir} (iteration "
                                 f"{trainer.progress.iteration}, consumed samples "
                                 f"{trainer.progress.consumed_samples})")
        elif run.train.load is not None:
            trainer.logger.print(f"> no checkpoint in {run.train.load} yet; starting from "
                                 "scratch")
        trainer.logger.print(_describe(setup.model_config, trainer))
        if trainer.progress.iteration >= run.train.train_iters:
            trainer.logger.print(f" already at iteration {trainer.progress.iteration}; raise "
                                 "--train-iters to train further")
            return trainer.progress
        train_loop(trainer, stop)
    finally:
        trainer.logger.close()
    return trainer.progress
