"""Measure the costs of the local accelerator and write them as a profile
(:mod:`megatron_het.perf.measure.profile_format`) for the predictor.

For every (tensor-parallel size, micro-batch, sequence length) of a :class:`Sweep`, on one TP
rank's shard (:mod:`megatron_het.perf.measure.shard_cases`, TP communication left out):

- one decoder layer's forward and backward time (median over iterations; the timed passes go
  round all shapes of a TP size, so a burst of load from elsewhere does not land on one shape
  only) and its activation bytes (:mod:`megatron_het.perf.measure.timed_cases`);
- the embedding's and the head's (final norm + output layer + loss) forward and backward time.

Also measured once: the optimizer step (gradient clipping + AdamW) per parameter, and
optionally (:func:`~megatron_het.perf.measure.communicator_figures.measure_comm`) the
communicator's p2p and all-reduce figures between two local gloo ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.model.compile import compile_layers
from megatron_het.model.llama import LlamaModel
from megatron_het.perf.measure.communicator_figures import measure_comm
from megatron_het.perf.measure.device_kind import device_name
from megatron_het.perf.measure.profile_format import (
    CommEntry,
    EndEntry,
    LayerEntry,
    Profile,
    ProfileConditions,
)
from megatron_het.perf.measure.shard_cases import (
    PROFILE_DTYPES,
    embedding_case,
    head_case,
    layer_case,
    measure_optimizer_step,
    rank_stage,
)
from megatron_het.perf.measure.timed_cases import run_cases
from megatron_het.tensor_parallel import check_tp_size, vocab_sizes

Progress = Callable[[str], None] | None


@dataclass(frozen=True)
class Sweep:
    """What to measure: every combination of the three lists, in ``dtype``."""

    seq_lengths: tuple[int, ...] = (128, 256)
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    tp_sizes: tuple[int, ...] = (1, 2)
    dtype: str = "fp32"
    warmup: int = 2
    iters: int = 5
    seed: int = 1234
    compile: bool = False  # the decoder layer compiled, as training's --compile runs it

    def __post_init__(self) -> None:
        for name in ("seq_lengths", "micro_batch_sizes", "tp_sizes"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values):
                raise UserError(
                    f"{name} must be a non-empty list of positive integers, got {list(values)}"
                )
        if self.dtype not in PROFILE_DTYPES:
            raise UserError(f"dtype must be one of {', '.join(PROFILE_DTYPES)}, got {self.dtype!r}")
        if self.warmup < 0 or self.iters < 1:
            raise UserError(f"need warmup >= 0 and iters >= 1, got {self.warmup} and {self.iters}")
        if self.compile and self.warmup < 1:
            raise UserError(
                "a compiled layer compiles on its first pass of each shape; give "
                "at least one warmup pass"
            )

    def check_model(self, config: ModelConfig) -> None:
        """Raise UserError unless every size of the sweep fits ``config``."""
        if max(self.seq_lengths) > config.max_position_embeddings:
            raise UserError(
                f"sequence length {max(self.seq_lengths)} exceeds the model's "
                f"{config.max_position_embeddings} positions; lower --seq-lengths"
            )
        for tp in self.tp_sizes:
            check_tp_size(config, tp)
            vocab_sizes(config.vocab_size, tp)


@contextlib.contextmanager
def shapes_compiled(sweep: Sweep) -> Iterator[None]:
    """Under ``sweep.compile``, let dynamo keep a compiled variant of the layers' code for
    every shard and shape of ``sweep`` (past the recompile limit a layer would run eager,
    unmarked); nothing otherwise."""
    if not sweep.compile:
        yield
        return
    from torch._dynamo import config

    count = (
        len(set(sweep.seq_lengths)) * len(set(sweep.micro_batch_sizes)) * len(set(sweep.tp_sizes))
        + 1
    )
    with config.patch(recompile_limit=max(config.recompile_limit, count)):
        yield


# ---- the whole profile -------------------------------------------------------------------------
def profile_device(
    config: ModelConfig,
    sweep: Sweep,
    accelerator: str,
    device: torch.device,
    comm: bool = False,
    progress: Progress = None,
    layer_stages: dict[int, LlamaModel] | None = None,
) -> Profile:
    """Measure everything of ``sweep`` for ``config`` on ``device`` and return the profile of
    kind ``accelerator``. With ``comm``, also the communicator's figures (2 local gloo ranks,
    see :func:`measure_comm`). ``progress`` receives one line per measured shape. A
    ``layer_stages`` dict receives each TP size's one-layer stage as measured (compiled under
    ``sweep.compile``), for a later look at its kernels."""
    sweep.check_model(config)
    say = progress or (lambda line: None)
    comm_entries: tuple[CommEntry, ...] = ()
    if comm:  # first: the workers are forked before this process touches the device
        comm_entries = measure_comm(warmup=sweep.warmup, iters=sweep.iters)
        for entry in comm_entries:
            say(f"comm {entry.op}: {entry.bandwidth_gbps:.3f} GB/s, {entry.latency_s * 1e6:.1f} us")
    layers, embedding, head = [], [], []
    n = config.num_layers
    shapes = [
        (seq, mb)
        for mb in sorted(set(sweep.micro_batch_sizes))
        for seq in sorted(set(sweep.seq_lengths))
    ]
    for tp in sorted(set(sweep.tp_sizes)):
        stages = tuple(
            rank_stage(config, tp, layers, embedding, head, device, sweep.seed, sweep.dtype)
            for layers, embedding, head in (
                ((0, 1), False, False),
                ((0, 0), True, False),
                ((n, n), False, True),
            )
        )
        if sweep.compile:
            compile_layers(stages[0])  # as training's --compile does
        if layer_stages is not None:
            layer_stages[tp] = stages[0]
        cases = [
            case
            for seq, mb in shapes
            for case in (
                layer_case(stages[0], seq, mb, tp, sweep.dtype, device, sweep.compile),
                embedding_case(stages[1], seq, mb, tp, sweep.dtype, device),
                head_case(stages[2], seq, mb, tp, sweep.dtype, device),
            )
        ]
        with shapes_compiled(sweep):
            entries = run_cases(cases, device, sweep.warmup, sweep.iters)
        for i in range(0, len(entries), 3):
            layers.append(entries[i])
            embedding.append(entries[i + 1])
            head.append(entries[i + 2])
            say(_progress_line(*entries[i : i + 3]))
        del stages, cases
    step = measure_optimizer_step(config, device, sweep.warmup, sweep.iters, sweep.seed)
    say(f"optimizer step: {step * 1e9:.3f} ns per parameter")
    return Profile(
        accelerator,
        conditions(device, sweep.dtype),
        tuple(layers),
        tuple(embedding),
        tuple(head),
        step,
        tuple(comm_entries),
    )


def _progress_line(layer: LayerEntry, embedding: EndEntry, head: EndEntry) -> str:
    return (
        f"tp={layer.tp} mb={layer.micro_batch} seq={layer.seq}: layer fwd "
        f"{layer.forward_s * 1e3:.3f} ms bwd {layer.backward_s * 1e3:.3f} ms act "
        f"{layer.activation_bytes / 2**20:.2f} MiB; embedding {embedding.forward_s * 1e3:.3f}"
        f"/{embedding.backward_s * 1e3:.3f} ms; head {head.forward_s * 1e3:.3f}/"
        f"{head.backward_s * 1e3:.3f} ms"
    )


def conditions(device: torch.device, dtype: str) -> ProfileConditions:
    """Device name, torch version, CPU threads, dtype, UTC date and host of this run."""
    return ProfileConditions(
        device_name(device),
        torch.__version__,
        torch.get_num_threads(),
        datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        dtype,
        socket.gethostname(),
    )


__all__ = ["Sweep", "conditions", "profile_device", "shapes_compiled"]
