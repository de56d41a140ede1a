"""AdamW for one rank of a hybrid (TP x PP x DP) run, with Megatron's mixed precision and
optional ZeRO-1 sharded state.

One iteration on every rank::

    opt.zero_grad()
    ... forward/backward of this rank's micro-batches (loss scaled 1/total micro-batches),
        tied-embedding grad sync between first and last stage ...
    opt.sync_grads()                      # DP SUM over groups.dp, bucketed (data_parallel.py)
    grad_norm = opt.clip_and_step(lr, clip_grad)

Precision: the stage is built in float32; the optimizer moves its parameters into flat buffers
of the training dtype (``param_dtype``: bf16 for ``--bf16``, else float32) laid out like the
gradient buckets (:mod:`megatron_het.optim.flat_params`). Gradients accumulate in float32 main
gradients (the buckets), AdamW steps float32 master weights with float32 moments, and the
updated masters are rounded into the parameters. In float32 the master is the parameter itself,
and the numerics equal the single-process ``torch.optim.AdamW`` (no weight decay on 1-D
parameters, the same clip coefficient).

Without the distributed optimizer every DP replica owns all of each bucket: it holds the full
AdamW state and masters of its stage and steps everything after an all-reduce of the gradients.
With it (ZeRO-1), the buckets are reduce-scattered: DP rank r owns range r of every bucket,
keeps moments and masters only for the parameter elements in it (~1/dp), steps those, and the
updated parameters are all-gathered back over the DP group in the training dtype (with
``--overlap-param-gather`` under the next forward: each layer, the embedding and the head wait
for their own buckets, the first layers' first). Pipelines of
different layouts (heterogeneous DP) sum their gradients over parameter units in the full
shapes instead and, with ZeRO-1, own rows of every parameter
(:mod:`megatron_het.optim.replica_sync`).

Global gradient norm: each distinct parameter element of the whole model counted once: every TP
rank's shard of split parameters, TP-replicated parameters (norm weights) only on tp rank 0, DP
replicas once (pipeline 0 without ZeRO; with ZeRO each DP rank its owned range), and the copy of
a tied embedding held by the last stage not at all. The squared sums are added over
``groups.world``, so every rank clips with the same coefficient.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from megatron_het.config import OptimizerConfig
from megatron_het.errors import UserError
from megatron_het.model.llama import LlamaModel
from megatron_het.optim.clip_grad import clip_coefficient, scale_, tensors_norm_squared
from megatron_het.optim.data_parallel import GradBuckets
from megatron_het.optim.flat_params import FlatParams
from megatron_het.optim.loss_scaler import LossScaler
from megatron_het.optim.optimizer import adamw_implementation
from megatron_het.optim.replica_sync import ReplicaSync
from megatron_het.parallel.buckets import DEFAULT_BUCKET_SIZE_MB
from megatron_het.parallel.process_groups import ProcessGroups
from megatron_het.tensor_parallel.sharding import shard_spec

_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def counts_in_norm(name: str, stage: LlamaModel, tp_size: int, tp_rank: int) -> bool:
    """Whether this rank's ``name`` gradient enters the global norm (before DP dedup)."""
    if name == "embedding.weight" and not getattr(stage, "has_embedding", True):
        return False  # the last stage's copy of a tied embedding; the first stage counts it
    return tp_rank == 0 or not shard_spec(name, stage.config, tp_size).replicated


def _adamw(
    groups: list[dict[str, Any]], config: OptimizerConfig, device: torch.device
) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        **adamw_implementation(device),
    )


def _events_per_backward(stage: LlamaModel, low_precision: bool) -> dict[str, int]:
    """Gradient events per backward pass that differ from one: a low-precision tied embedding
    used by both ends of one stage gets the lookup's ``.grad`` and the fused head's float32
    ``main_grad`` addition (see :mod:`megatron_het.kernels.main_grad`)."""
    both_ends = getattr(stage, "has_embedding", False) and getattr(stage, "has_head", False)
    if low_precision and both_ends and getattr(stage.config, "tie_embeddings", False):
        return {"embedding.weight": 2}
    return {}


class ParallelOptimizer:
    """AdamW over one pipeline stage's (TP-sharded) parameters with DP gradient sync.

    Built by :func:`build_parallel_optimizer`. ``groups`` needs ``dp``, ``tp`` and ``world``
    (see :class:`megatron_het.parallel.process_groups.ProcessGroups`). Every method that
    communicates is collective over the group it names and must be called by all its members.
    """

    def __init__(
        self,
        stage: LlamaModel,
        groups: ProcessGroups,
        config: OptimizerConfig,
        use_distributed_optimizer: bool,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
        overlap_grad_reduce: bool = False,
        param_dtype: torch.dtype = torch.float32,
        grad_reduce_dtype: torch.dtype = torch.float32,
        loss_scaler: LossScaler | None = None,
        overlap_param_gather: bool = False,
    ) -> None:
        self.stage, self.groups, self.config = stage, groups, config
        self.loss_scaler = loss_scaler
        self.skipped_iterations = 0
        self.distributed = use_distributed_optimizer
        self.named = [(n, p) for n, p in stage.named_parameters() if p.requires_grad]
        self.buckets = GradBuckets(self.named, groups.dp, bucket_size_mb, grad_reduce_dtype)
        self.slot_of = {slot.name: slot for slot in self.buckets.slots}
        # Replicas of different layouts sum over parameter units instead (replica_sync.py),
        # and with ZeRO-1 own rows of every parameter rather than ranges of buckets.
        role = groups.role
        self.replica = (
            ReplicaSync(
                [n for n, _ in self.named],
                groups.replica_units,
                stage.config,
                role.stage_plan,
                role.tp_rank,
                role.pipeline,
                groups.plan.dp_size,
                grad_reduce_dtype,
            )
            if groups.replica_units
            else None
        )
        pieces = (
            self._owned_pieces if self.replica is not None and use_distributed_optimizer else None
        )
        self.flat = FlatParams(
            self.buckets, use_distributed_optimizer and pieces is None, param_dtype, pieces
        )
        tp_size, tp_rank = groups.tp.size, groups.tp.rank
        self.counted = {n: counts_in_norm(n, stage, tp_size, tp_rank) for n, _ in self.named}
        # a rank with nothing to train still takes part in the norm's collective, on its device
        self.device = self.named[0][1].device if self.named else groups.comm.device
        self.steps = 0
        decay = [s.master for s in self.flat.shards if s.slot.param.ndim > 1]
        no_decay = [s.master for s in self.flat.shards if s.slot.param.ndim <= 1]
        adam_groups = [
            {"params": ps, "weight_decay": wd}
            for ps, wd in ((decay, config.weight_decay), (no_decay, 0.0))
            if ps
        ]
        # AdamW refuses an empty parameter list; a rank owning nothing keeps no optimizer.
        self.optimizer = _adamw(adam_groups, config, self.device) if adam_groups else None
        if overlap_grad_reduce:
            tied_across_stages = (
                getattr(stage.config, "tie_embeddings", False)
                and getattr(groups, "embedding", None) is not None
            )
            # The pipeline sums the two embedding copies after its last backward; the DP
            # reduction of that bucket must come after, so it waits for sync_grads.
            self.buckets.enable_overlap(
                {"embedding.weight"} if tied_across_stages else (),
                _events_per_backward(stage, self.flat.low_precision),
            )
        # --overlap-param-gather: ZeRO-1's all-gather of the updated parameters runs under the
        # next forward; each part of the stage waits for the buckets it reads (pipelines of
        # different layouts share their pieces in the step instead: nothing to overlap).
        self.overlap_param_gather = overlap_param_gather and self.flat.sharded
        if self.overlap_param_gather:
            _wait_for_gathers(stage, self.flat)
        self.zero_grad()

    def _owned_pieces(self, slot: Any) -> list[tuple[int, int]]:
        """The flat range of ``slot``'s parameter this rank owns across replicas (ZeRO-1)."""
        assert self.replica is not None
        a, b = self.replica.owned_rows(slot.name)
        per_row = slot.numel // slot.param.shape[0] if slot.param.ndim else 1
        return [(a * per_row, b * per_row)] if a < b else []

    def _share_owned(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Complete per-name tensors that hold only this rank's owned pieces (ZeRO-1 across
        replicas of different layouts; collective over the replica units)."""
        if self.replica is not None and self.flat.pieces is not None:
            self.replica.share_owned(values.__getitem__, torch.float32, self.device)
        return values

    # -- iteration ---------------------------------------------------------------------------
    def zero_grad(self, num_micro_batches: int | None = None) -> None:
        """Zero the float32 main gradients (float32 parameters' ``.grad`` become views of them,
        low-precision ones get ``main_grad``).

        With ``overlap_grad_reduce``, ``num_micro_batches`` (this rank's backward passes before
        the next :meth:`sync_grads`) lets each bucket's DP reduction start from the backward
        hooks as soon as its last gradient is in; None reduces everything in sync_grads.
        """
        self.buckets.zero_grad()
        mode = "reduce_scatter" if self.distributed else "all_reduce"
        self.buckets.start_iteration(num_micro_batches, mode)

    def sync_grads(self) -> None:
        """DP SUM of the accumulated gradients over ``groups.dp`` (one collective per bucket):
        all-reduce, or reduce-scatter into this rank's owned ranges with ZeRO-1; pipelines of
        different layouts sum over ``groups.replica_units`` instead. Call once per iteration
        after the last backward (and after the tied-embedding sync)."""
        if self.distributed and self.replica is None:
            self.buckets.reduce_scatter()
        else:
            self.buckets.all_reduce()
        if self.replica is not None:
            self.replica.sum_(lambda name: self.buckets.grad_view(self.slot_of[name]), self.device)

    def grad_norm(self) -> float:
        """Global L2 norm of the synced gradients (collective over ``groups.world``)."""
        counting = self.distributed or self.groups.role.pipeline == 0  # one replica counts
        counted = [s.grad for s in self.flat.shards if counting and self.counted[s.slot.name]]
        squared = tensors_norm_squared(counted, self.device)
        if self.groups.world.size > 1:
            self.groups.world.all_reduce(squared, "sum")
        return float(squared.sqrt())

    def clip_and_step(self, lr: float, clip_grad: float, skip_nonfinite: bool = False) -> float:
        """Clip to global norm ``clip_grad`` (``<= 0``: no clipping), set ``lr``, step AdamW on
        the masters, round them into the parameters and, with ZeRO-1, all-gather the updated
        parameters over ``groups.dp``.

        With a loss scaler (fp16) the gradients are first divided by its scale; a non-finite
        norm then means an overflow: the step is skipped (``skipped_iterations`` counts it)
        and the scaler backs off. Returns the pre-clip global gradient norm. Without a
        scaler, a norm that is not finite (the same on every rank, so all ranks agree) raises
        UserError without stepping, or with ``skip_nonfinite`` returns it without stepping:
        parameters, masters and AdamW state stay as they were, and the caller counts the skip
        (the next :meth:`zero_grad` drops the gradients).
        """
        if self.loss_scaler is not None:
            scale_([s.grad for s in self.flat.shards], 1.0 / self.loss_scaler.scale)
        norm = self.grad_norm()
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=not math.isfinite(norm))
            if not math.isfinite(norm):
                self.skipped_iterations += 1
                return norm
        if not math.isfinite(norm):
            if skip_nonfinite:
                return norm
            raise UserError(
                f"the gradient norm is {norm}; lower --lr (or use --clip-grad) and "
                "resume from the last checkpoint"
            )
        recorder = self.groups.comm.recorder
        with recorder.span("clip", "step"):
            scale_([s.grad for s in self.flat.shards], clip_coefficient(norm, clip_grad))
            self.flat.finish_param_gather()  # nothing may still write the parameters below
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            with recorder.span("AdamW", "step"):
                self.optimizer.step()
        self.steps += 1
        with recorder.span("masters to parameters", "step"):
            self.flat.copy_masters_to_params()
        # ZeRO-1's share of the DP sync: the updated parameters to every DP rank (with
        # --overlap-param-gather its start; the waits fall in the next forward)
        shared = self.replica is not None and self.flat.pieces is not None
        with (
            recorder.span("parameter all-gather", "step")
            if self.flat.sharded or shared
            else contextlib.nullcontext()
        ):
            self.flat.all_gather_params(overlap=self.overlap_param_gather)
            if shared:
                assert self.replica is not None  # (for mypy: shared says so)
                self.replica.share_owned(
                    lambda name: self.slot_of[name].param.data, self.flat.param_dtype, self.device
                )
        return norm

    def params_ready(self) -> None:
        """Wait for the parameter all-gathers ``--overlap-param-gather`` left in flight
        (collective over ``groups.dp`` only in that they complete started ones): call it before
        reading the parameters outside a forward (saves, the end of a run)."""
        self.flat.finish_param_gather()

    def close(self, wait: bool = True) -> None:
        """Wait for started reductions and parameter all-gathers (``wait=False``: abandon
        them) and remove the hooks."""
        self.buckets.close(wait)
        self.flat.finish_param_gather(wait)
        if self.overlap_param_gather:
            self.stage.wait_for = None

    def state_bytes(self) -> int:
        """Bytes of Adam moment tensors this rank holds (~1/dp of the stage's with ZeRO-1)."""
        if self.optimizer is None:
            return 0
        return sum(
            value.numel() * value.element_size()
            for state in self.optimizer.state.values()
            for key, value in state.items()
            if key in _STATE_KEYS
        )

    # -- state by global name ------------------------------------------------------------------
    def state_dict(self, keep: bool = True) -> dict[str, dict[str, Any]]:
        """``{global name: {"step": int, "exp_avg": T, "exp_avg_sq": T}}`` for every parameter
        of this stage, each tensor a float32 CPU copy shaped like this rank's TP shard.

        With ZeRO-1 the owned ranges are all-gathered over ``groups.dp`` first (collective:
        every DP rank must call it), so every DP replica returns the same full state. Before
        the first step the moments are zeros and ``step`` is 0. ``keep=False`` (a DP replica
        that writes no checkpoint piece) takes part in the collective and returns ``{}``, so
        the stage's whole state is not copied to the host on every replica.
        """
        keep = keep or self.flat.pieces is not None  # replica pieces are shared, then kept
        state: dict[str, dict[str, Any]] = {name: {"step": self.steps} for name, _ in self.named}
        for key in _STATE_KEYS:
            values = self._share_owned(
                self.flat.gather(lambda shard: self._moment(shard, key), keep)
            )
            for name, value in values.items():
                state[name][key] = value
        return state if keep else {}

    def _moment(self, shard: Any, key: str) -> torch.Tensor | None:
        if self.optimizer is None:
            return None
        return self.optimizer.state.get(shard.master, {}).get(key)

    def master_weights(self, keep: bool = True) -> dict[str, torch.Tensor] | None:
        """``{global name: float32 CPU tensor}`` of the master weights (this rank's TP-shard
        shapes) when they differ from the parameters (low-precision training), else None.
        Collective over ``groups.dp`` with ZeRO-1; ``keep=False`` as for :meth:`state_dict`."""
        if not self.flat.low_precision:
            return None
        return self._share_owned(self.flat.gather(lambda shard: shard.master.detach(), keep))

    def load_master_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Set parameters and masters from full-precision ``weights`` by global name (every
        parameter of this stage, TP-shard shapes). No communication."""
        self.flat.load_weights(weights)

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Load a :meth:`state_dict`-shaped state (per global name, this rank's TP-shard shape;
        extra names are refused). With ZeRO-1 each rank keeps only its owned ranges. Raises
        UserError when names, keys or shapes do not match this stage. No communication."""
        self._check_state(state)
        self.steps = max((int(entry["step"]) for entry in state.values()), default=0)
        if self.optimizer is None:
            return
        order = [p for group in self.optimizer.param_groups for p in group["params"]]
        index = {id(p): i for i, p in enumerate(order)}
        loaded = {}
        for shard in self.flat.shards:
            entry, part = state[shard.slot.name], slice(shard.lo, shard.hi)
            loaded[index[id(shard.master)]] = {
                "step": torch.tensor(float(entry["step"])),
                **{
                    key: torch.as_tensor(entry[key]).reshape(-1)[part].clone()
                    for key in _STATE_KEYS
                },
            }
        self.optimizer.load_state_dict(
            {"state": loaded, "param_groups": self.optimizer.state_dict()["param_groups"]}
        )

    def _check_state(self, state: dict[str, dict[str, Any]]) -> None:
        names = {n for n, _ in self.named}
        missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
        if missing or unexpected:
            raise UserError(
                "optimizer state does not match this stage's parameters (missing: "
                f"{', '.join(missing[:3]) or 'none'}; unexpected: "
                f"{', '.join(unexpected[:3]) or 'none'}); load it with the plan it was saved "
                "with or reshard the checkpoint"
            )
        for name, param in self.named:
            for key in ("step",) + _STATE_KEYS:
                if key not in state[name]:
                    raise UserError(
                        f"optimizer state of {name} lacks {key!r}; the checkpoint "
                        "is incomplete, load an earlier one"
                    )
            for key in _STATE_KEYS:
                shape = tuple(torch.as_tensor(state[name][key]).shape)
                if shape != tuple(param.shape):
                    raise UserError(
                        f"optimizer state {key} of {name} has shape {shape} but this rank's "
                        f"shard is {tuple(param.shape)}; reshard the checkpoint for this plan"
                    )


def _part_of(name: str) -> str:
    """The part of a stage (as :class:`~megatron_het.model.llama.LlamaModel` announces them
    to ``wait_for``) that reads parameter ``name``."""
    if name.startswith("layers."):
        return ".".join(name.split(".")[:2])
    return "embedding" if name == "embedding.weight" else "head"


def _wait_for_gathers(stage: LlamaModel, flat: FlatParams) -> None:
    """Make ``stage`` wait, right before each part runs, for the all-gathers of the buckets
    holding that part's parameters (the head also for a tied embedding's, which it multiplies
    by), through ``stage.wait_for``."""
    buckets: dict[str, set[int]] = {}
    for slot in flat.buckets.slots:
        buckets.setdefault(_part_of(slot.name), set()).add(slot.bucket)
    if getattr(stage.config, "tie_embeddings", False) and getattr(stage, "has_head", False):
        buckets.setdefault("head", set()).update(buckets.get("embedding", ()))
    ordered = {part: tuple(sorted(indices)) for part, indices in buckets.items()}

    def wait_for(part: str) -> None:
        flat.wait_param_gather(ordered.get(part, ()))

    stage.wait_for = wait_for


def build_parallel_optimizer(
    stage: LlamaModel,
    groups: ProcessGroups,
    optimizer_config: OptimizerConfig,
    use_distributed_optimizer: bool,
    bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
    overlap_grad_reduce: bool = False,
    param_dtype: torch.dtype = torch.float32,
    grad_reduce_dtype: torch.dtype = torch.float32,
    loss_scaler: LossScaler | None = None,
    overlap_param_gather: bool = False,
) -> ParallelOptimizer:
    """The AdamW optimizer of this rank's ``stage`` (a TP-applied :class:`LlamaModel` slice,
    built in float32).

    ``groups`` is this rank's :class:`~megatron_het.parallel.process_groups.ProcessGroups` (``dp``,
    ``tp`` and ``world`` are used). The parameters' storage moves into flat buffers of
    ``param_dtype`` (bf16 for mixed precision; build the optimizer before anything else keeps
    references to ``param.data``). ``use_distributed_optimizer`` (ZeRO-1) shards masters and
    Adam state over ``groups.dp``; ``overlap_grad_reduce`` starts bucket reductions from the
    backward hooks (pass the micro-batch count to :meth:`ParallelOptimizer.zero_grad`);
    ``grad_reduce_dtype`` is the dtype of the DP collectives (accumulation is float32);
    ``loss_scaler`` (fp16) unscales the gradients and skips overflowing steps;
    ``overlap_param_gather`` (ZeRO-1) leaves the step's parameter all-gathers running into the
    next forward, whose parts wait for their own buckets (:meth:`ParallelOptimizer.
    params_ready` waits for all of them). Collective-free.
    """
    return ParallelOptimizer(
        stage,
        groups,
        optimizer_config,
        use_distributed_optimizer,
        bucket_size_mb,
        overlap_grad_reduce,
        param_dtype,
        grad_reduce_dtype,
        loss_scaler,
        overlap_param_gather,
    )
