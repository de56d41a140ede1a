"""Measure the costs of the local accelerator and write them as a profile
(:mod:`megatron_het.perf.profile`) for the predictor.

For every (tensor-parallel size, micro-batch, sequence length) of a :class:`Sweep`, on one TP
rank's shard (``heads/tp`` query heads, ``kv_groups/tp`` kv heads, ``ffn/tp`` MLP units, a
``vocab/tp`` slice of the embedding and the output layer, exactly as
:func:`megatron_het.tensor_parallel.apply_tp` shards them):

- one decoder layer's forward and backward time (median over iterations, the device
  synchronised around each pass; the timed passes go round all shapes of a TP size, so a burst
  of load from elsewhere does not land on one shape only) and its activation bytes;
- the embedding's and the head's (final norm + output layer + loss) forward and backward time.

TP communication is left out on purpose: the shard runs with a :class:`ComputeOnlyGroup`, whose
collectives do nothing, and the predictor adds TP communication from its link model. Also
measured once: the optimizer step (gradient clipping + AdamW) per parameter, and optionally
(:func:`measure_comm`) the communicator's p2p and all-reduce figures between two local gloo
ranks.

Activation bytes are what autograd keeps for the backward of one layer: the distinct storages
of the tensors it saves (counted through ``torch.autograd.graph.saved_tensors_hooks``), leaving
out the parameters, their low-precision copies made by autocast and the RoPE tables the layers
of a stage share. On CUDA the caching allocator is asked instead: the bytes still allocated
after the forward (its output included, which stands for the layer's own saved input) minus the
parameter copies.

With ``dtype="bf16"`` passes run under bf16 autocast with fp32 parameters, as training does.
"""
from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import platform
import re
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from megatron_het.cluster.accelerators import AcceleratorRegistry
from megatron_het.config import ModelConfig, OptimizerConfig
from megatron_het.errors import UserError
from megatron_het.model.llama import LlamaModel, build_model
from megatron_het.optim.clip_grad import clip_grad_norm
from megatron_het.optim.optimizer import build_optimizer
from megatron_het.perf.profile import (CommEntry, EndEntry, LayerEntry, Profile,
                                       ProfileConditions)
from megatron_het.tensor_parallel import apply_tp, check_tp_size, vocab_sizes

PROFILE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The optimizer is timed on up to this many parameters of decoder layers (enough that the
# per-parameter time no longer carries the per-call overhead).
OPTIMIZER_PARAMS = 1 << 24

Progress = Optional[Callable[[str], None]]


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

    def __post_init__(self) -> None:
        for name in ("seq_lengths", "micro_batch_sizes", "tp_sizes"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values):
                raise UserError(f"{name} must be a non-empty list of positive integers, "
                                f"got {list(values)}")
        if self.dtype not in PROFILE_DTYPES:
            raise UserError(f"dtype must be one of {', '.join(PROFILE_DTYPES)}, got "
                            f"{self.dtype!r}")
        if self.warmup < 0 or self.iters < 1:
            raise UserError(f"need warmup >= 0 and iters >= 1, got {self.warmup} and "
                            f"{self.iters}")

    def check_model(self, config: ModelConfig) -> None:
        """Raise UserError unless every size of the sweep fits ``config``."""
        if max(self.seq_lengths) > config.max_position_embeddings:
            raise UserError(f"sequence length {max(self.seq_lengths)} exceeds the model's "
                            f"{config.max_position_embeddings} positions; lower --seq-lengths")
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
    the storages of ``parameters`` and of ``shared`` tensors, and tensors computed from a single
    parameter alone (autocast's low-precision weight copies), whose bytes go to
    ``parameter_copy_bytes`` instead. The graph must stay alive until the counts are read.
    """

    def __init__(self, parameters: Iterable[torch.Tensor],
                 shared: Iterable[torch.Tensor] = ()) -> None:
        self._params = {_storage_key(p) for p in parameters}
        self._skip = self._params | {_storage_key(t) for t in shared}
        self._activations: dict[tuple, int] = {}
        self._copies: dict[tuple, int] = {}
        self._hooks: Optional[contextlib.AbstractContextManager] = None

    @property
    def nbytes(self) -> int:
        return sum(self._activations.values())

    @property
    def parameter_copy_bytes(self) -> int:
        return sum(self._copies.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._skip:
            target = self._copies if self._from_parameter(tensor) else self._activations
            target[key] = tensor.untyped_storage().nbytes()
        return tensor

    def _from_parameter(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is computed from one parameter through single-input ops."""
        fn = tensor.grad_fn
        while fn is not None:
            variable = getattr(fn, "variable", None)  # AccumulateGrad: a leaf
            if variable is not None:
                return _storage_key(variable) in self._params
            inputs = [f for f, _ in fn.next_functions if f is not None]
            if len(inputs) != 1:
                return False
            fn = inputs[0]
        return False

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.untyped_storage().data_ptr())


# ---- timing ---------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=PROFILE_DTYPES[dtype])


@dataclass
class Case:
    """One thing to time: ``forward()`` and ``backward(its output)``; ``saved`` (optional)
    measures its activation bytes; ``entry(forward_s, backward_s, saved)`` makes the record."""

    forward: Callable[[], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    entry: Callable[[float, float, float], Any]
    saved: Optional[Callable[[], float]] = None


def _one_pass(case: Case, device: torch.device) -> tuple[float, float]:
    _sync(device)
    start = time.perf_counter()
    out = case.forward()
    _sync(device)
    middle = time.perf_counter()
    case.backward(out)
    _sync(device)
    return middle - start, time.perf_counter() - middle


def run_cases(cases: list[Case], device: torch.device, warmup: int, iters: int) -> list[Any]:
    """Each case's entry from the medians of ``iters`` timed passes after ``warmup`` untimed
    ones, the device synchronised around every pass. The timed passes go round the cases
    (one pass of each per round), so a burst of load from elsewhere falls on all of them."""
    for case in cases:
        for _ in range(warmup):
            _one_pass(case, device)
    saved = [case.saved() if case.saved else 0.0 for case in cases]
    times: list[list[tuple[float, float]]] = [[] for _ in cases]
    for _ in range(iters):
        for case, out in zip(cases, times):
            out.append(_one_pass(case, device))
    return [case.entry(statistics.median(f for f, _ in t), statistics.median(b for _, b in t),
                       s) for case, t, s in zip(cases, times, saved)]


def activation_bytes(forward: Callable[[], torch.Tensor], parameters: list[torch.Tensor],
                     shared: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes one ``forward()`` keeps for its backward (see the module docstring)."""
    counter = SavedActivations(parameters, shared)
    if device.type == "cuda":
        _sync(device)
        before = torch.cuda.memory_allocated(device)
    with counter:
        out = forward()
    if device.type == "cuda":
        _sync(device)
        kept = torch.cuda.memory_allocated(device) - before - counter.parameter_copy_bytes
        del out
        return max(0, kept)
    del out
    return counter.nbytes


# ---- one TP rank's shard ----------------------------------------------------------------------
def rank_stage(config: ModelConfig, tp: int, layer_range: tuple[int, int], has_embedding: bool,
               has_head: bool, device: torch.device, seed: int) -> LlamaModel:
    """One TP rank's (rank 0's) shard of a stage, built on ``device``, with TP collectives
    replaced by :class:`ComputeOnlyGroup`'s no-ops."""
    check_tp_size(config, tp)
    vocab_sizes(config.vocab_size, tp)
    stage = build_model(config, seed, layer_range, has_embedding, has_head, device=device)
    if tp > 1:
        apply_tp(stage, ComputeOnlyGroup(tp), config)
    return stage


def layer_case(stage: LlamaModel, seq: int, micro_batch: int, tp: int, dtype: str,
               device: torch.device) -> Case:
    """The first decoder layer of ``stage`` (a :func:`rank_stage` shard) on a
    ``[micro_batch, seq, hidden]`` fp32 input (the residual stream stays fp32 under autocast);
    makes a :class:`LayerEntry` with its activation bytes."""
    config = stage.config
    layer = next(iter(stage.layers.values()))
    x = torch.randn(micro_batch, seq, config.hidden_size, device=device, requires_grad=True)
    grad = torch.randn_like(x)
    table_dtype = torch.float32 if dtype == "fp32" else PROFILE_DTYPES[dtype]
    cos, sin = stage.rotary.cos_sin(seq, device, table_dtype)

    def forward() -> torch.Tensor:
        with _autocast(device, dtype):
            return layer(x, cos, sin)

    def backward(out: torch.Tensor) -> None:
        out.backward(grad)
        x.grad = None

    def entry(fwd: float, bwd: float, saved: float) -> LayerEntry:
        return LayerEntry(config.hidden_size, config.ffn_hidden_size,
                          config.num_attention_heads, config.num_query_groups, seq, micro_batch,
                          tp, dtype, fwd, bwd, float(saved))

    return Case(forward, backward, entry, lambda: activation_bytes(
        forward, list(layer.parameters()), (cos, sin), device))


def embedding_case(stage: LlamaModel, seq: int, micro_batch: int, tp: int, dtype: str,
                   device: torch.device) -> Case:
    """The (vocab-parallel) embedding lookup of ``[micro_batch, seq]`` random token ids."""
    config = stage.config
    tokens = torch.randint(0, config.vocab_size, (micro_batch, seq), device=device)
    grad = torch.randn(micro_batch, seq, config.hidden_size, device=device)

    def forward() -> torch.Tensor:
        with _autocast(device, dtype):
            return stage.embedding(tokens)

    return Case(forward, lambda out: out.backward(grad), lambda f, b, _: EndEntry(
        config.hidden_size, config.vocab_size, seq, micro_batch, tp, dtype, f, b))


def head_case(stage: LlamaModel, seq: int, micro_batch: int, tp: int, dtype: str,
              device: torch.device) -> Case:
    """Final norm + output layer + loss of a head stage without layers (the fused loss computes
    most gradients in its forward, so the split follows the implementation)."""
    config = stage.config
    hidden = torch.randn(micro_batch, seq, config.hidden_size, device=device,
                         requires_grad=True)
    labels = torch.randint(0, config.vocab_size, (micro_batch, seq), device=device)

    def forward() -> torch.Tensor:
        with _autocast(device, dtype):
            return stage(hidden, labels=labels)

    def backward(loss: torch.Tensor) -> None:
        loss.backward()
        hidden.grad = None

    return Case(forward, backward, lambda f, b, _: EndEntry(
        config.hidden_size, config.vocab_size, seq, micro_batch, tp, dtype, f, b))


def measure_optimizer_step(config: ModelConfig, device: torch.device, warmup: int, iters: int,
                           seed: int = 1234, max_params: int = OPTIMIZER_PARAMS) -> float:
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


# ---- the whole profile -------------------------------------------------------------------------
def profile_device(config: ModelConfig, sweep: Sweep, accelerator: str, device: torch.device,
                   comm: bool = False, progress: Progress = None) -> Profile:
    """Measure everything of ``sweep`` for ``config`` on ``device`` and return the profile of
    kind ``accelerator``. With ``comm``, also the communicator's figures (2 local gloo ranks,
    see :func:`measure_comm`). ``progress`` receives one line per measured shape."""
    sweep.check_model(config)
    say = progress or (lambda line: None)
    comm_entries: tuple[CommEntry, ...] = ()
    if comm:  # first: the workers are forked before this process touches the device
        comm_entries = measure_comm(warmup=sweep.warmup, iters=sweep.iters)
        for entry in comm_entries:
            say(f"comm {entry.op}: {entry.bandwidth_gbps:.3f} GB/s, "
                f"{entry.latency_s * 1e6:.1f} us")
    layers, embedding, head = [], [], []
    n = config.num_layers
    for tp in sorted(set(sweep.tp_sizes)):
        stages = (rank_stage(config, tp, (0, 1), False, False, device, sweep.seed),
                  rank_stage(config, tp, (0, 0), True, False, device, sweep.seed),
                  rank_stage(config, tp, (n, n), False, True, device, sweep.seed))
        shapes = [(seq, mb) for mb in sorted(set(sweep.micro_batch_sizes))
                  for seq in sorted(set(sweep.seq_lengths))]
        cases = [make(stage, seq, mb, tp, sweep.dtype, device)
                 for seq, mb in shapes
                 for make, stage in zip((layer_case, embedding_case, head_case), stages)]
        entries = run_cases(cases, device, sweep.warmup, sweep.iters)
        for i in range(0, len(entries), 3):
            layers.append(entries[i])
            embedding.append(entries[i + 1])
            head.append(entries[i + 2])
            say(_progress_line(*entries[i:i + 3]))
        del stages, cases
    step = measure_optimizer_step(config, device, sweep.warmup, sweep.iters, sweep.seed)
    say(f"optimizer step: {step * 1e9:.3f} ns per parameter")
    return Profile(accelerator, conditions(device, sweep.dtype), tuple(layers),
                   tuple(embedding), tuple(head), step, tuple(comm_entries))


def _progress_line(layer: LayerEntry, embedding: EndEntry, head: EndEntry) -> str:
    return (f"tp={layer.tp} mb={layer.micro_batch} seq={layer.seq}: layer fwd "
            f"{layer.forward_s * 1e3:.3f} ms bwd {layer.backward_s * 1e3:.3f} ms act "
            f"{layer.activation_bytes / 2**20:.2f} MiB; embedding {embedding.forward_s * 1e3:.3f}"
            f"/{embedding.backward_s * 1e3:.3f} ms; head {head.forward_s * 1e3:.3f}/"
            f"{head.backward_s * 1e3:.3f} ms")


def conditions(device: torch.device, dtype: str) -> ProfileConditions:
    """Device name, torch version, CPU threads, dtype, UTC date and host of this run."""
    return ProfileConditions(device_name(device), torch.__version__, torch.get_num_threads(),
                             datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
                             dtype, socket.gethostname())


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def accelerator_for_device(name: str, memory_gib: Optional[float] = None,
                           registry: Optional[AcceleratorRegistry] = None) -> Optional[str]:
    """The registry kind a device name stands for ("NVIDIA H100 80GB HBM3" -> "H100"), or None.

    A kind matches when a word of the name starts with the kind's model ("A100" of
    "A100-80G"); between several, the one whose memory is closest to ``memory_gib`` (else to
    the name's "<N>GB"), else the first.
    """
    registry = registry or AcceleratorRegistry.builtin()
    words = re.findall(r"[A-Z0-9]+", name.upper())
    matches = [spec for spec in registry
               if spec.vendor != "cpu" and not spec.emulated
               and any(w.startswith(spec.name.split("-")[0].upper()) for w in words)]
    if not matches:
        return None
    if memory_gib is None:
        sizes = [int(w[:-2]) for w in words if re.fullmatch(r"\d+GB", w)]
        memory_gib = float(sizes[0]) if sizes else None
    if memory_gib is None:
        return matches[0].name
    return min(matches, key=lambda spec: abs(spec.memory_gib - memory_gib)).name


def default_accelerator(device: torch.device) -> str:
    """"cpu" on a CPU; on a GPU its registry kind, else its name with non-word characters
    replaced by "_"."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    memory = torch.cuda.get_device_properties(device).total_memory / 2**30
    return accelerator_for_device(name, memory) or re.sub(r"\W+", "_", name).strip("_")


# ---- communicator figures ----------------------------------------------------------------------
COMM_SIZES = tuple(4 ** k * 1024 for k in range(7))  # 1 KiB .. 4 MiB


def measure_comm(sizes: tuple[int, ...] = COMM_SIZES, warmup: int = 2, iters: int = 5,
                 timeout_s: float = 120.0) -> tuple[CommEntry, ...]:
    """p2p and all-reduce figures of the communicator between 2 gloo ranks on this host.

    Starts two worker processes (one thread each) on a free loopback port; each builds a
    :class:`~megatron_het.comm.communicator.UnifiedCommunicator` of two "cpu" ranks. p2p is
    timed as half a ping-pong, the all-reduce directly (median over ``iters``, per message
    size in bytes). ``time = latency + bytes / bandwidth`` is fitted to p2p and ``time =
    2 latency + bytes / bandwidth`` to the all-reduce (the predictor's 2-rank ring), through
    the smallest and the largest size. Returned with link kind "intra_node".
    """
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    ctx = multiprocessing.get_context(method)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    parent, child = ctx.Pipe(duplex=False)
    workers = [ctx.Process(target=_comm_worker, daemon=True,
                           args=(rank, port, sizes, warmup, iters, timeout_s,
                                 child if rank == 0 else None)) for rank in range(2)]
    for w in workers:
        w.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise RuntimeError(f"the communicator measurement did not finish in {timeout_s} s")
        status, payload = parent.recv()
    except EOFError:
        raise RuntimeError("a communicator measurement worker died before reporting") from None
    finally:
        for w in workers:
            w.join(5.0)
            if w.is_alive():
                w.kill()
                w.join()
    if status != "ok":
        raise RuntimeError(f"communicator measurement failed:\n{payload}")
    p2p, reduce = payload
    entries = []
    for op, times, latencies in (("p2p", p2p, 1), ("collective", reduce, 2)):
        latency, seconds_per_byte = _fit_alpha_beta(sizes, times)
        entries.append(CommEntry(op, "intra_node", 1e-9 / seconds_per_byte,
                                 latency / latencies))
    return tuple(entries)


def _fit_alpha_beta(sizes: tuple[int, ...], times: list[float]) -> tuple[float, float]:
    """``(a, b)`` of ``t = a + b n`` through the smallest and the largest message (robust to a
    noisy middle); ``b`` from the largest message alone when the two do not grow."""
    (n0, t0), (n1, t1) = (sizes[0], times[0]), (sizes[-1], times[-1])
    if n1 > n0 and t1 > t0:
        b = (t1 - t0) / (n1 - n0)
        return max(t0 - b * n0, 0.0), b
    return min(t0, t1), t1 / n1


def _comm_worker(rank: int, port: int, sizes: tuple[int, ...], warmup: int, iters: int,
                 timeout_s: float, conn: Any) -> None:
    import traceback

    import torch.distributed as dist

    from megatron_het.comm.communicator import UnifiedCommunicator

    torch.set_num_threads(1)
    result: tuple[str, Any]
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=timeout_s))
        try:
            comm = UnifiedCommunicator(["cpu", "cpu"], {"cpu": "gloo"}, {"cpu": "cpu"})
            result = ("ok", _comm_times(comm, sizes, warmup, iters))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    if conn is not None:
        conn.send(result)
        conn.close()


def _comm_times(comm: Any, sizes: tuple[int, ...], warmup: int,
                iters: int) -> tuple[list[float], list[float]]:
    """Median one-way p2p and all-reduce seconds per size, as rank 0 sees them."""
    p2p, reduce = [], []
    peer = 1 - comm.rank
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4))
        one_way, collective = [], []
        for i in range(warmup + iters):
            comm.barrier()
            start = time.perf_counter()
            if comm.rank == 0:
                comm.send(buf, peer)
                comm.recv(buf, peer)
            else:
                comm.recv(buf, peer)
                comm.send(buf, peer)
            middle = time.perf_counter()
            comm.barrier()
            before = time.perf_counter()
            comm.world.all_reduce(buf)
            end = time.perf_counter()
            if i >= warmup:
                one_way.append((middle - start) / 2)
                collective.append(end - before)
        p2p.append(statistics.median(one_way))
        reduce.append(statistics.median(collective))
    return p2p, reduce


__all__ = ["COMM_SIZES", "PROFILE_DTYPES", "Case", "ComputeOnlyGroup", "SavedActivations",
           "Sweep", "accelerator_for_device", "activation_bytes", "conditions",
           "default_accelerator", "device_name", "embedding_case", "head_case", "layer_case",
           "measure_comm", "measure_optimizer_step", "profile_device", "rank_stage",
           "run_cases"]
