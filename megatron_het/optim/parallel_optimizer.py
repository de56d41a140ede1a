"""AdamW for one rank of a hybrid (TP x PP x DP) run, optionally with ZeRO-1 sharded state.

One iteration on every rank::

    opt.zero_grad()
    ... forward/backward of this rank's micro-batches (loss scaled 1/total micro-batches),
        tied-embedding grad sync between first and last stage ...
    opt.sync_grads()                      # DP SUM over groups.dp, bucketed (data_parallel.py)
    grad_norm = opt.clip_and_step(lr, clip_grad)

Numerics equal the single-process optimizer (:func:`megatron_het.optim.optimizer.build_optimizer`:
``torch.optim.AdamW``, no weight decay on 1-D parameters, the same clip coefficient).

Without the distributed optimizer every DP replica holds the full AdamW state of its stage and
steps all its parameters after an all-reduce of the gradients. With it (ZeRO-1), the gradient
buckets are reduce-scattered: DP rank r owns range r of every bucket, keeps Adam state only for
the parameter elements in it (~1/dp of the state), steps those elements, and the updated
parameters are all-gathered back over the DP group. For that the parameters' storage is moved
into flat float32 buffers laid out like the gradient buckets (``param.data`` becomes a view);
only float32 parameters are supported there (the project keeps fp32 parameters and uses bf16
autocast).

Global gradient norm: each distinct parameter element of the whole model counted once: every TP
rank's shard of split parameters, TP-replicated parameters (norm weights) only on tp rank 0, DP
replicas once (DP rank 0 without ZeRO; with ZeRO each DP rank its owned range), and the copy of
a tied embedding held by the last stage not at all. The squared sums are added over
``groups.world``, so every rank clips with the same coefficient.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_het.config import OptimizerConfig
from megatron_het.errors import UserError
from megatron_het.optim.clip_grad import clip_coefficient, scale_, tensors_norm_squared
from megatron_het.optim.data_parallel import GradBuckets, ParamSlot
from megatron_het.optim.optimizer import param_groups
from megatron_het.parallel.groups import ProcessGroups
from megatron_het.tensor_parallel.sharding import shard_spec

_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def counts_in_norm(name: str, stage: nn.Module, tp_size: int, tp_rank: int) -> bool:
    """Whether this rank's ``name`` gradient enters the global norm (before DP dedup)."""
    if name == "embedding.weight" and not getattr(stage, "has_embedding", True):
        return False  # the last stage's copy of a tied embedding; the first stage counts it
    return tp_rank == 0 or not shard_spec(name, stage.config, tp_size).replicated


@dataclass
class _Shard:
    """The part ``[lo, hi)`` (flat, within the parameter) of ``slot`` that this rank owns."""

    slot: ParamSlot
    lo: int
    hi: int
    param: nn.Parameter  # view of the bucket's parameter buffer
    grad: torch.Tensor  # view of the bucket's gradient buffer


def _adamw(groups: list[dict[str, Any]], config: OptimizerConfig,
           on_cuda: bool) -> torch.optim.AdamW:
    kind = {"fused": True} if on_cuda else {"foreach": True}
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                             eps=config.adam_eps, **kind)


class ParallelOptimizer:
    """AdamW over one pipeline stage's (TP-sharded) parameters with DP gradient sync.

    Built by :func:`build_parallel_optimizer`. ``groups`` needs ``dp``, ``tp`` and ``world``
    (see :class:`megatron_het.parallel.groups.ProcessGroups`). Every method that communicates is
    collective over the group it names and must be called by all its members.
    """

    def __init__(self, stage: nn.Module, groups: ProcessGroups, config: OptimizerConfig,
                 use_distributed_optimizer: bool, bucket_size_mb: float = 25.0,
                 overlap_grad_reduce: bool = False) -> None:
        self.stage, self.groups, self.config = stage, groups, config
        self.distributed = use_distributed_optimizer
        self.named = [(n, p) for n, p in stage.named_parameters() if p.requires_grad]
        self.buckets = GradBuckets(self.named, groups.dp, bucket_size_mb)
        tp_size, tp_rank = groups.tp.size, groups.tp.rank
        self.counted = {n: counts_in_norm(n, stage, tp_size, tp_rank) for n, _ in self.named}
        self.device = self.named[0][1].device if self.named else torch.device("cpu")
        self.steps = 0
        on_cuda = self.device.type == "cuda"
        if use_distributed_optimizer:
            self.param_buffers = self._move_params_into_buffers()
            self.shards = self._owned_shards()
            decay = [s.param for s in self.shards if s.slot.param.ndim > 1]
            no_decay = [s.param for s in self.shards if s.slot.param.ndim <= 1]
            adam_groups = [{"params": ps, "weight_decay": wd}
                           for ps, wd in ((decay, config.weight_decay), (no_decay, 0.0)) if ps]
        else:
            adam_groups = param_groups(stage, config.weight_decay)
        # AdamW refuses an empty parameter list; a rank owning nothing keeps no optimizer.
        self.optimizer = _adamw(adam_groups, config, on_cuda) if adam_groups else None
        if overlap_grad_reduce:
            tied_across_stages = (getattr(stage.config, "tie_embeddings", False)
                                  and getattr(groups, "embedding", None) is not None)
            # The pipeline sums the two embedding copies after its last backward; the DP
            # reduction of that bucket must come after, so it waits for sync_grads.
            self.buckets.enable_overlap({"embedding.weight"} if tied_across_stages else ())
        self.zero_grad()

    # -- layout (ZeRO-1) ---------------------------------------------------------------------
    def _move_params_into_buffers(self) -> list[torch.Tensor]:
        buffers = []
        for bucket in self.buckets.buckets:
            buffer = torch.zeros(bucket.numel, dtype=torch.float32, device=self.device)
            for slot in bucket.slots:
                if slot.param.dtype != torch.float32:
                    raise ValueError(f"{slot.name}: the distributed optimizer needs float32 "
                                     f"parameters, got {slot.param.dtype}")
                view = buffer[slot.start:slot.stop]
                view.copy_(slot.param.detach().reshape(-1))
                slot.param.data = view.view(slot.param.shape)
            buffers.append(buffer)
        return buffers

    def _owned_shards(self) -> list[_Shard]:
        shards = []
        for bucket, buffer in zip(self.buckets.buckets, self.param_buffers):
            start, stop = self.buckets.owned_range(bucket)
            for slot in bucket.slots:
                a, b = max(slot.start, start), min(slot.stop, stop)
                if a < b:
                    shards.append(_Shard(slot, a - slot.start, b - slot.start,
                                         nn.Parameter(buffer[a:b]), bucket.grad[a:b]))
        for shard in shards:
            shard.param.grad = shard.grad
        return shards

    # -- iteration ---------------------------------------------------------------------------
    def zero_grad(self, num_micro_batches: int | None = None) -> None:
        """Zero the gradient buckets; float32 parameters' ``.grad`` become views of them.

        With ``overlap_grad_reduce``, ``num_micro_batches`` (this rank's backward passes before
        the next :meth:`sync_grads`) lets each bucket's DP reduction start on a background
        thread as soon as its last gradient is in; None reduces everything in sync_grads.
        """
        self.buckets.zero_grad()
        mode = "reduce_scatter" if self.distributed else "all_reduce"
        self.buckets.start_iteration(num_micro_batches, mode)

    def sync_grads(self) -> None:
        """DP SUM of the accumulated gradients over ``groups.dp`` (one collective per bucket):
        all-reduce, or reduce-scatter into this rank's owned ranges with ZeRO-1. Call once per
        iteration after the last backward (and after the tied-embedding sync)."""
        if self.distributed:
            self.buckets.reduce_scatter()
        else:
            self.buckets.all_reduce()

    def _stepped_grads(self) -> list[torch.Tensor]:
        if self.distributed:
            return [s.grad for s in self.shards]
        return [p.grad for _, p in self.named if p.grad is not None]

    def grad_norm(self) -> float:
        """Global L2 norm of the synced gradients (collective over ``groups.world``)."""
        if self.distributed:
            counted = [s.grad for s in self.shards if self.counted[s.slot.name]]
        elif self.buckets.dp_rank == 0:
            counted = [p.grad for n, p in self.named if self.counted[n] and p.grad is not None]
        else:
            counted = []
        squared = tensors_norm_squared(counted, self.device)
        if self.groups.world.size > 1:
            self.groups.world.all_reduce(squared, "sum")
        return float(squared.sqrt())

    def clip_and_step(self, lr: float, clip_grad: float) -> float:
        """Clip to global norm ``clip_grad`` (``<= 0``: no clipping), set ``lr``, step AdamW and,
        with ZeRO-1, all-gather the updated parameters over ``groups.dp``.

        Returns the pre-clip global gradient norm. Raises UserError without stepping when it
        is not finite (the same on every rank, so all ranks raise).
        """
        norm = self.grad_norm()
        if not math.isfinite(norm):
            raise UserError(f"the gradient norm is {norm}; lower --lr (or use --clip-grad) and "
                            "resume from the last checkpoint")
        scale_(self._stepped_grads(), clip_coefficient(norm, clip_grad))
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.steps += 1
        if self.distributed:
            self._all_gather_params()
        return norm

    def _all_gather_params(self) -> None:
        if self.buckets.dp_size == 1:
            return
        for bucket, buffer in zip(self.buckets.buckets, self.param_buffers):
            start, stop = self.buckets.owned_range(bucket)
            self.buckets.dp_group.all_gather_into_tensor(buffer, buffer[start:stop].clone())

    def close(self) -> None:
        """Stop the overlap worker thread and remove the backward hooks (if any)."""
        self.buckets.close()

    def state_bytes(self) -> int:
        """Bytes of Adam moment tensors this rank holds (~1/dp of the stage's with ZeRO-1)."""
        if self.optimizer is None:
            return 0
        return sum(value.numel() * value.element_size()
                   for state in self.optimizer.state.values()
                   for key, value in state.items() if key in _STATE_KEYS)

    # -- state by global name ------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, Any]]:
        """``{global name: {"step": int, "exp_avg": T, "exp_avg_sq": T}}`` for every parameter
        of this stage, each tensor a CPU copy shaped like this rank's TP shard.

        With ZeRO-1 the owned ranges are all-gathered over ``groups.dp`` first (collective:
        every DP rank must call it), so every DP replica returns the same full state. Before
        the first step the moments are zeros and ``step`` is 0.
        """
        if self.distributed:
            return self._gathered_state()
        state: dict[str, dict[str, Any]] = {}
        for name, param in self.named:
            entry = self.optimizer.state.get(param, {}) if self.optimizer is not None else {}
            state[name] = {"step": int(entry["step"]) if "step" in entry else 0}
            for key in _STATE_KEYS:
                value = entry.get(key)
                state[name][key] = (value.detach().cpu().clone() if value is not None else
                                    torch.zeros(param.shape, dtype=torch.float32))
        return state

    def _gathered_state(self) -> dict[str, dict[str, Any]]:
        state: dict[str, dict[str, Any]] = {name: {"step": self.steps} for name, _ in self.named}
        for key in _STATE_KEYS:
            for bucket in self.buckets.buckets:
                start, stop = self.buckets.owned_range(bucket)
                local = torch.zeros(stop - start, dtype=torch.float32, device=self.device)
                for shard in self.shards:
                    value = self.optimizer.state.get(shard.param, {}).get(key)
                    if shard.slot.bucket == bucket.index and value is not None:
                        offset = shard.slot.start + shard.lo - start
                        local[offset:offset + shard.hi - shard.lo].copy_(value)
                full = local
                if self.buckets.dp_size > 1:
                    full = torch.empty(bucket.numel, dtype=torch.float32, device=self.device)
                    self.buckets.dp_group.all_gather_into_tensor(full, local)
                for slot in bucket.slots:
                    state[slot.name][key] = (full[slot.start:slot.stop].view(slot.param.shape)
                                             .cpu().clone())
        return state

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Load a :meth:`state_dict`-shaped state (per global name, this rank's TP-shard shape;
        extra names are refused). With ZeRO-1 each rank keeps only its owned ranges. Raises
        UserError when names, keys or shapes do not match this stage. No communication."""
        self._check_state(state)
        self.steps = max((int(entry["step"]) for entry in state.values()), default=0)
        if self.optimizer is None:
            return
        if self.distributed:
            entries = [(s.param, state[s.slot.name], slice(s.lo, s.hi)) for s in self.shards]
        else:
            entries = [(p, state[n], slice(None)) for n, p in self.named]
        order = [p for group in self.optimizer.param_groups for p in group["params"]]
        index = {id(p): i for i, p in enumerate(order)}
        loaded = {}
        for param, entry, part in entries:
            loaded[index[id(param)]] = {"step": torch.tensor(float(entry["step"])), **{
                key: torch.as_tensor(entry[key]).reshape(-1)[part].reshape(param.shape).clone()
                for key in _STATE_KEYS}}
        self.optimizer.load_state_dict({
            "state": loaded, "param_groups": self.optimizer.state_dict()["param_groups"]})

    def _check_state(self, state: dict[str, dict[str, Any]]) -> None:
        names = {n for n, _ in self.named}
        missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
        if missing or unexpected:
            raise UserError(
                "optimizer state does not match this stage's parameters (missing: "
                f"{', '.join(missing[:3]) or 'none'}; unexpected: "
                f"{', '.join(unexpected[:3]) or 'none'}); load it with the plan it was saved "
                "with or reshard the checkpoint")
        for name, param in self.named:
            for key in ("step",) + _STATE_KEYS:
                if key not in state[name]:
                    raise UserError(f"optimizer state of {name} lacks {key!r}; the checkpoint "
                                    "is incomplete, load an earlier one")
            for key in _STATE_KEYS:
                shape = tuple(torch.as_tensor(state[name][key]).shape)
                if shape != tuple(param.shape):
                    raise UserError(
                        f"optimizer state {key} of {name} has shape {shape} but this rank's "
                        f"shard is {tuple(param.shape)}; reshard the checkpoint for this plan")


def build_parallel_optimizer(stage: nn.Module, groups: ProcessGroups,
                             optimizer_config: OptimizerConfig,
                             use_distributed_optimizer: bool, bucket_size_mb: float = 25.0,
                             overlap_grad_reduce: bool = False) -> ParallelOptimizer:
    """The AdamW optimizer of this rank's ``stage`` (a TP-applied :class:`LlamaModel` slice).

    ``groups`` is this rank's :class:`~megatron_het.parallel.groups.ProcessGroups` (``dp``,
    ``tp`` and ``world`` are used). With ``use_distributed_optimizer`` (ZeRO-1) the Adam state is
    sharded over ``groups.dp`` and the parameters' storage moves into flat buckets (build it
    before anything else keeps references to ``param.data``). ``overlap_grad_reduce`` starts
    bucket reductions from backward hooks on a worker thread (pass the micro-batch count to
    :meth:`ParallelOptimizer.zero_grad`). Collective-free.
    """
    return ParallelOptimizer(stage, groups, optimizer_config, use_distributed_optimizer,
                             bucket_size_mb, overlap_grad_reduce)
