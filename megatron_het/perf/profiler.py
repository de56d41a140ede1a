"""Measure the costs of the local accelerator and write them as a profile
(:mod:`megatron_het.perf.profile`) for the predictor.

For every (tensor-parallel size, micro-batch, sequence length) of a :class:`Sweep`, on one TP
rank's shard (``heads/tp`` query heads, ``kv_groups/tp`` kv heads, ``ffn/tp`` MLP units, a
``vocab/tp`` slice of the embedding and the output layer, exactly as
:func:`megatron_het.tensor_parallel.apply_tp` shards them):

- one decoder layer's forward and backward time (median over iterations; the timed passes go
  round all shapes of a TP size, so a burst of load from elsewhere does not land on one shape
  only) and its activation bytes;
- the embedding's and the head's (final norm + output layer + loss) forward and backward time.

TP communication is left out on purpose: the shard runs with a :class:`ComputeOnlyGroup`, whose
collectives do nothing, and the predictor adds TP communication from its link model. Also
measured once: the optimizer step (gradient clipping + AdamW) per parameter, and optionally
(:func:`measure_comm`, in :mod:`megatron_het.perf.comm_profiler`) the communicator's p2p and
all-reduce figures between two local gloo ranks.

Timing follows the work (:func:`megatron_het.pipeline.timing.pass_timer`): on an accelerator, whose
kernels the host only enqueues, device events are recorded around each pass's forward and backward
and read after a single synchronisation at the end of the timed passes; on the CPU, the host clock.

Activation bytes are what autograd keeps for the backward of one layer: the distinct storages
of the tensors it saves (counted through ``torch.autograd.graph.saved_tensors_hooks``), leaving
out the parameters and the RoPE tables the layers of a stage share. On CUDA the caching
allocator is asked instead: the bytes still allocated after the forward (its output included,
which stands for the layer's own saved input).

With ``dtype="bf16"`` the shard's parameters are bf16 and the passes run on bf16 inputs without
autocast, as training runs it (Megatron's mixed precision: bf16 weights, with the fp32 master
weights and main gradients in the optimizer, whose step is measured on its own).
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_het.config import ModelConfig, OptimizerConfig
from megatron_het.errors import UserError
from megatron_het.model.compile import compile_layers
from megatron_het.model.llama import LlamaModel, build_model
from megatron_het.optim.clip_grad import clip_grad_norm
from megatron_het.optim.optimizer import build_optimizer

# Re-exported: this module is where callers find the whole profiling API.
from megatron_het.perf.comm_profiler import COMM_SIZES, _fit_alpha_beta, measure_comm  # noqa: F401
from megatron_het.perf.device_kind import accelerator_for_device, default_accelerator, device_name
from megatron_het.perf.profile import CommEntry, EndEntry, LayerEntry, Profile, ProfileConditions
from megatron_het.pipeline.timing import EventTimer, HostTimer, pass_timer, synchronize
from megatron_het.tensor_parallel import apply_tp, check_tp_size, vocab_sizes

PROFILE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The optimizer is timed on up to this many parameters of decoder layers (enough that the
# per-parameter time no longer carries the per-call overhead).
OPTIMIZER_PARAMS = 1 << 24

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


class ComputeOnlyGroup:
    """Stands in for a TP group of ``size`` ranks whose collectives are skipped.

    A shard built with it runs exactly this rank's computation of the tensor-parallel layers
    (the sums they would receive are left as the local partial values), so a timing of it is
    compute only.
    """

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> None:
        """Nothing: the tensor keeps this rank's contribution."""

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Every slot of ``output`` receives this rank's ``input``."""
        output.view(self.size, -1).copy_(input.reshape(1, -1))


class SavedActivations:
    """Context manager counting the bytes autograd saves for backward inside the block.

    Distinct storages are counted once (a saved view keeps its whole storage alive). Left out:
    the storages of ``parameters`` and of ``shared`` tensors. The parameters are used as they
    are (no autocast, so no low-precision weight copies are saved). The graph must stay alive
    until the count is read.
    """

    def __init__(
        self, parameters: Iterable[torch.Tensor], shared: Iterable[torch.Tensor] = ()
    ) -> None:
        self._skip = {_storage_key(t) for t in (*parameters, *shared)}
        self._activations: dict[tuple, int] = {}
        self._hooks: contextlib.AbstractContextManager | None = None

    @property
    def nbytes(self) -> int:
        return sum(self._activations.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._skip:
            self._activations[key] = tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.untyped_storage().data_ptr())


@dataclass
class Case:
    """One thing to time: ``forward()`` and ``backward(its output)``; ``saved`` (optional)
    measures its activation bytes; ``entry(forward_s, backward_s, saved)`` makes the record."""

    forward: Callable[[], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    entry: Callable[[float, float, float], Any]
    saved: Callable[[], float] | None = None


def _one_pass(case: Case, timer: HostTimer | EventTimer) -> tuple[Any, Any, Any]:
    """Marks before the forward, between forward and backward, and after the backward."""
    start = timer.mark()
    out = case.forward()
    middle = timer.mark()
    case.backward(out)
    return start, middle, timer.mark()


def run_cases(
    cases: list[Case],
    device: torch.device,
    warmup: int,
    iters: int,
    timer: HostTimer | EventTimer | None = None,
) -> list[Any]:
    """Each case's entry from the medians of ``iters`` timed passes after ``warmup`` untimed
    ones, timed by ``timer`` (default :func:`pass_timer` of ``device``: on an accelerator, read
    after one synchronisation once every timed pass is enqueued). The timed passes go round the
    cases (one pass of each per round), so a burst of load from elsewhere falls on all of
    them."""
    for case in cases:
        for _ in range(warmup):
            case.backward(case.forward())
    saved = [case.saved() if case.saved else 0.0 for case in cases]
    timer = timer or pass_timer(device)
    marks: list[list[tuple[Any, Any, Any]]] = [[] for _ in cases]
    for _ in range(iters):
        for case, out in zip(cases, marks):
            out.append(_one_pass(case, timer))
    timer.finish()
    times = [[(timer.elapsed_s(a, b), timer.elapsed_s(b, c)) for a, b, c in m] for m in marks]
    return [
        case.entry(statistics.median(f for f, _ in t), statistics.median(b for _, b in t), s)
        for case, t, s in zip(cases, times, saved)
    ]


def activation_bytes(
    forward: Callable[[], torch.Tensor],
    parameters: list[torch.Tensor],
    shared: Iterable[torch.Tensor],
    device: torch.device,
) -> int:
    """Bytes one ``forward()`` keeps for its backward (see the module docstring)."""
    counter = SavedActivations(parameters, shared)
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
    with counter:
        out = forward()
    if device.type == "cuda":
        synchronize(device)
        kept = torch.cuda.memory_allocated(device) - before
        del out
        return max(0, kept)
    del out
    return counter.nbytes


# ---- one TP rank's shard ----------------------------------------------------------------------
def rank_stage(
    config: ModelConfig,
    tp: int,
    layer_range: tuple[int, int],
    has_embedding: bool,
    has_head: bool,
    device: torch.device,
    seed: int,
    dtype: str = "fp32",
) -> LlamaModel:
    """One TP rank's (rank 0's) shard of a stage, built on ``device`` with parameters in
    ``dtype`` (a profile dtype; initialised in fp32, then cast), with TP collectives replaced
    by :class:`ComputeOnlyGroup`'s no-ops."""
    check_tp_size(config, tp)
    vocab_sizes(config.vocab_size, tp)
    stage = build_model(config, seed, layer_range, has_embedding, has_head, device=device)
    if tp > 1:
        apply_tp(stage, ComputeOnlyGroup(tp), config)
    return stage.to(dtype=PROFILE_DTYPES[dtype])


def _check_dtype(module: torch.nn.Module, dtype: str) -> torch.dtype:
    """The torch dtype of ``dtype``; ValueError unless ``module``'s parameters have it."""
    want = PROFILE_DTYPES[dtype]
    found = {p.dtype for p in module.parameters()}
    if found - {want}:
        raise ValueError(
            f"a {dtype} case needs {want} parameters, the stage has "
            f"{sorted(map(str, found))}; build it with rank_stage(..., "
            f"dtype={dtype!r})"
        )
    return want


def layer_case(
    stage: LlamaModel,
    seq: int,
    micro_batch: int,
    tp: int,
    dtype: str,
    device: torch.device,
    compiled: bool = False,
) -> Case:
    """The first decoder layer of ``stage`` (a :func:`rank_stage` shard of ``dtype``) on a
    ``[micro_batch, seq, hidden]`` input of ``dtype`` (the residual stream's dtype in
    training); makes a :class:`LayerEntry` with its activation bytes, marked ``compiled``
    (the caller compiled the stage's layers with
    :func:`~megatron_het.model.compile.compile_layers`)."""
    config = stage.config
    layer = next(iter(stage.layers.values()))
    torch_dtype = _check_dtype(layer, dtype)
    x = torch.randn(
        micro_batch, seq, config.hidden_size, device=device, dtype=torch_dtype, requires_grad=True
    )
    grad = torch.randn_like(x)
    cos, sin = stage.rotary.cos_sin(seq, device, torch_dtype)

    def forward() -> torch.Tensor:
        return layer(x, cos, sin)

    def backward(out: torch.Tensor) -> None:
        out.backward(grad)
        x.grad = None

    def entry(fwd: float, bwd: float, saved: float) -> LayerEntry:
        return LayerEntry(
            config.hidden_size,
            config.ffn_hidden_size,
            config.num_attention_heads,
            config.num_query_groups,
            seq,
            micro_batch,
            tp,
            dtype,
            fwd,
            bwd,
            float(saved),
            compiled,
        )

    return Case(
        forward,
        backward,
        entry,
        lambda: activation_bytes(forward, list(layer.parameters()), (cos, sin), device),
    )


def embedding_case(
    stage: LlamaModel, seq: int, micro_batch: int, tp: int, dtype: str, device: torch.device
) -> Case:
    """The (vocab-parallel) embedding lookup of ``[micro_batch, seq]`` random token ids."""
    config = stage.config
    tokens = torch.randint(0, config.vocab_size, (micro_batch, seq), device=device)
    grad = torch.randn(
        micro_batch,
        seq,
        config.hidden_size,
        device=device,
        dtype=_check_dtype(stage.embedding, dtype),
    )

    def forward() -> torch.Tensor:
        return stage.embedding(tokens)

    return Case(
        forward,
        lambda out: out.backward(grad),
        lambda f, b, _: EndEntry(
            config.hidden_size, config.vocab_size, seq, micro_batch, tp, dtype, f, b
        ),
    )


def head_case(
    stage: LlamaModel, seq: int, micro_batch: int, tp: int, dtype: str, device: torch.device
) -> Case:
    """Final norm + output layer + loss of a head stage without layers (the fused loss computes
    most gradients in its forward, so the split follows the implementation)."""
    config = stage.config
    hidden = torch.randn(
        micro_batch,
        seq,
        config.hidden_size,
        device=device,
        dtype=_check_dtype(stage, dtype),
        requires_grad=True,
    )
    labels = torch.randint(0, config.vocab_size, (micro_batch, seq), device=device)

    def forward() -> torch.Tensor:
        return stage(hidden, labels=labels)

    def backward(loss: torch.Tensor) -> None:
        loss.backward()
        hidden.grad = None

    return Case(
        forward,
        backward,
        lambda f, b, _: EndEntry(
            config.hidden_size, config.vocab_size, seq, micro_batch, tp, dtype, f, b
        ),
    )


def measure_optimizer_step(
    config: ModelConfig,
    device: torch.device,
    warmup: int,
    iters: int,
    seed: int = 1234,
    max_params: int = OPTIMIZER_PARAMS,
) -> float:
    """Seconds per parameter of one optimizer step (global-norm clipping + AdamW, as training
    runs it) over the decoder layers that fit in ``max_params`` (at least one layer)."""
    per_layer = config.replace(num_layers=1).num_parameters(include_embeddings=False)
    layers = max(1, min(config.num_layers, max_params // per_layer))
    model = build_model(config, seed, (0, layers), False, False, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device=device, generator=generator) * 1e-3
    optimizer = build_optimizer(model, OptimizerConfig())

    def step() -> torch.Tensor:
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        return torch.zeros(())

    case = Case(step, lambda _: None, lambda f, b, s: f)
    params = sum(p.numel() for p in model.parameters())
    return run_cases([case], device, warmup, iters)[0] / params


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


@dataclass(frozen=True)
class KernelRow:
    """One kernel (or, on the CPU, one operator) of a breakdown: its name, launches per pass
    and device seconds per pass (self time: its own work, not its children's)."""

    name: str
    calls: float
    seconds: float


def self_time_us(event: Any, on_device: bool) -> float:
    """A ``torch.profiler`` average's own time in microseconds: on the device (its kernels'
    time; ``self_cuda_time_total`` in releases before torch 2.4) or on the CPU."""
    if not on_device:
        return event.self_cpu_time_total
    own = getattr(event, "self_device_time_total", None)
    return own if own is not None else getattr(event, "self_cuda_time_total", 0.0)


def kernel_breakdown(
    case: Case, device: torch.device, iters: int = 3, warmup: int = 1
) -> tuple[list[KernelRow], float]:
    """Where one forward + backward pass of ``case`` spends its device time, from
    ``torch.profiler`` over ``iters`` passes after ``warmup`` untimed ones: every kernel that
    ran on ``device`` (operators on the CPU), most time first, and the pass's time between
    timing marks (:func:`pass_timer`). The kernels' sum below the pass time is time the
    device sat idle (launch latency, host synchronisation)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        case.backward(case.forward())
    on_cpu = device.type == "cpu"
    activities = [ProfilerActivity.CPU] + ([] if on_cpu else [ProfilerActivity.CUDA])
    timer = pass_timer(device)
    with profile(activities=activities) as prof:
        marks = [_one_pass(case, timer) for _ in range(iters)]
        timer.finish()
    pass_s = statistics.median(timer.elapsed_s(a, c) for a, _, c in marks)
    rows = []
    for event in prof.key_averages():
        own_us = self_time_us(event, not on_cpu)
        kernel = (
            not event.key.startswith("[")
            if on_cpu
            else str(getattr(event, "device_type", "")).endswith(("CUDA", "PrivateUse1"))
        )
        if kernel and own_us > 0:
            rows.append(KernelRow(event.key, event.count / iters, own_us / 1e6 / iters))
    rows.sort(key=lambda row: row.seconds, reverse=True)
    return rows, pass_s


__all__ = [
    "COMM_SIZES",
    "PROFILE_DTYPES",
    "Case",
    "ComputeOnlyGroup",
    "EventTimer",
    "HostTimer",
    "SavedActivations",
    "Sweep",
    "accelerator_for_device",
    "activation_bytes",
    "conditions",
    "default_accelerator",
    "device_name",
    "embedding_case",
    "head_case",
    "layer_case",
    "measure_comm",
    "measure_optimizer_step",
    "pass_timer",
    "profile_device",
    "rank_stage",
    "run_cases",
    "KernelRow",
    "kernel_breakdown",
    "self_time_us",
]
