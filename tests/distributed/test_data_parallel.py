"""Data-parallel training with and without ZeRO-1 against single-process AdamW (gloo, 4 ranks).

Ranks 0-1 are accelerator kind "fast" and 2-3 kind "slow". Layouts:

* DP 4 (tp 1): the DP group is the whole, mixed world (hierarchical collectives).
* DP 2 x TP 2: TP groups {0, 1} and {2, 3} (native), DP groups {0, 2} and {1, 3} (mixed).

Every run trains the same tiny Llama for 8 iterations on the same global batches as the
single-process reference (micro-batch j of an iteration goes to DP rank j // per_rank, each
micro-batch's loss scaled by 1/total before backward) and must match the reference's losses,
grad norms and final parameters within 2e-4 relative; DP replicas must hold identical weights.
Small buckets force several buckets per stage; each layout also runs with the bucket reductions
started from backward hooks on a worker thread (overlap).
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch

from megatron_het.comm import UnifiedCommunicator
from megatron_het.config import ModelConfig, OptimizerConfig
from megatron_het.model.llama import build_model
from megatron_het.optim.optimizer import build_optimizer
from megatron_het.optim.parallel_optimizer import build_parallel_optimizer
from megatron_het.parallel.plan_builders import plan_from_megatron_flags
from megatron_het.parallel.process_groups import ProcessGroups, build_process_groups
from megatron_het.tensor_parallel import apply_tp, shard_tensor
from tests.distributed.harness import run_ranks
from tests.reference import forward_backward, optimizer_step

WORLD = 4
SEED = 1234
ITERS = 8
TOTAL_MICRO_BATCHES = 4
MICRO_BATCH, SEQ = 2, 8
LR, CLIP = 1e-2, 0.3  # the clip threshold is below most norms here, so clipping is exercised
BUCKET_MB = 0.004  # ~1000 fp32 elements: several buckets per stage
TOL = 2e-4
CONFIG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=67,
    name="dp-test",
)
OPT = OptimizerConfig(lr=LR, weight_decay=0.1, clip_grad=CLIP)


def make_groups(world_size: int) -> dict[str, ProcessGroups]:
    """{layout: this rank's ProcessGroups} for "dp4", "dp2xtp2", "pp2xtp2" and "pp2xdp2"
    (Megatron rank order; collective)."""
    kinds = ["fast", "fast", "slow", "slow"][:world_size]
    comm = UnifiedCommunicator(
        kinds,
        {"fast": "gloo", "slow": "gloo"},
        {"fast": "cpu", "slow": "cpu"},
        timeout=datetime.timedelta(seconds=60),
    )
    layouts = {"dp4": (1, 1), "dp2xtp2": (2, 1), "pp2xtp2": (2, 2), "pp2xdp2": (1, 2)}
    return {
        name: build_process_groups(
            comm,
            plan_from_megatron_flags(
                CONFIG,
                world_size,
                tp,
                pp,
                MICRO_BATCH,
                TOTAL_MICRO_BATCHES * MICRO_BATCH,
                accelerator_of=lambda rank: kinds[rank],
            ),
        )
        for name, (tp, pp) in layouts.items()
    }


def global_batch(iteration: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The iteration's TOTAL_MICRO_BATCHES micro-batches (tokens, labels)."""
    gen = torch.Generator().manual_seed(100 + iteration)
    rows = torch.randint(
        0, CONFIG.vocab_size, (TOTAL_MICRO_BATCHES * MICRO_BATCH, SEQ + 1), generator=gen
    )
    return [(chunk[:, :-1], chunk[:, 1:]) for chunk in rows.split(MICRO_BATCH)]


def reference_run(config: ModelConfig = CONFIG, iters: int = ITERS) -> dict[str, Any]:
    """Single-process AdamW on the whole global batch: per-iteration losses and grad norms,
    final parameters by name."""
    model = build_model(config, SEED)
    optimizer = build_optimizer(model, OPT)
    losses, norms = [], []
    for it in range(iters):
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(forward_backward(model, global_batch(it))))
        norms.append(optimizer_step(model, optimizer, LR, CLIP, it + 1))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


def build_stage(groups: ProcessGroups):
    stage = build_model(CONFIG, SEED)
    if groups.tp.size > 1:
        apply_tp(stage, groups.tp, CONFIG)
    return stage


def train_iteration(stage, optimizer, groups: ProcessGroups, iteration: int) -> tuple[float, float]:
    """One data-parallel iteration; returns (global mean loss, pre-clip grad norm)."""
    per_rank = TOTAL_MICRO_BATCHES // groups.dp.size
    mine = global_batch(iteration)[groups.dp.rank * per_rank : (groups.dp.rank + 1) * per_rank]
    optimizer.zero_grad(num_micro_batches=len(mine))  # used when overlap is on
    loss_sum = torch.zeros(())
    for tokens, labels in mine:
        loss = stage(tokens, labels=labels)
        (loss / TOTAL_MICRO_BATCHES).backward()
        loss_sum += loss.detach()
    optimizer.sync_grads()
    norm = optimizer.clip_and_step(LR, CLIP)
    if groups.dp.size > 1:
        groups.dp.all_reduce(loss_sum, "sum")
    return float(loss_sum) / TOTAL_MICRO_BATCHES, norm


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def check_against_reference(
    stage,
    groups: ProcessGroups,
    ref: dict[str, Any],
    losses: list[float],
    norms: list[float],
    what: str,
    config: ModelConfig = CONFIG,
) -> None:
    for it, (loss, norm) in enumerate(zip(losses, norms)):
        assert abs(loss - ref["losses"][it]) <= TOL * abs(ref["losses"][it]), (
            f"{what} iteration {it}: loss {loss} vs reference {ref['losses'][it]}"
        )
        assert abs(norm - ref["norms"][it]) <= TOL * ref["norms"][it], (
            f"{what} iteration {it}: grad norm {norm} vs reference {ref['norms'][it]}"
        )
    for name, param in stage.named_parameters():
        want = shard_tensor(name, ref["params"][name], config, groups.tp.size, groups.tp.rank)
        err = rel_err(param.detach(), want)
        assert err <= TOL, f"{what}: {name} differs from the reference by {err:.2e} (relative)"


def check_replicas_identical(stage, groups: ProcessGroups, what: str) -> None:
    """Every DP replica holds bitwise the same weights."""
    flat = torch.cat([p.detach().reshape(-1) for p in stage.parameters()])
    gathered = torch.empty(groups.dp.size * flat.numel())
    groups.dp.all_gather_into_tensor(gathered, flat)
    for replica in gathered.view(groups.dp.size, -1):
        assert torch.equal(replica, flat), f"{what}: DP replicas hold different weights"


def _train_and_compare(rank: int, world_size: int) -> dict[str, int]:
    torch.manual_seed(0)
    ref = reference_run()
    state_bytes = {}
    layouts = make_groups(world_size)
    for layout in ("dp4", "dp2xtp2"):
        groups = layouts[layout]
        for zero, overlap in ((False, False), (True, False), (False, True), (True, True)):
            what = f"{layout} zero={zero} overlap={overlap} rank {rank}"
            stage = build_stage(groups)
            optimizer = build_parallel_optimizer(
                stage, groups, OPT, zero, bucket_size_mb=BUCKET_MB, overlap_grad_reduce=overlap
            )
            assert len(optimizer.buckets.buckets) > 1, "the test wants several buckets"
            results = [train_iteration(stage, optimizer, groups, it) for it in range(ITERS)]
            early = optimizer.buckets.launched_early
            optimizer.close()
            # With overlap every bucket's reduction started from the backward hooks.
            assert early == (len(optimizer.buckets.buckets) if overlap else 0), f"{what}: {early}"
            check_against_reference(
                stage, groups, ref, [r[0] for r in results], [r[1] for r in results], what
            )
            check_replicas_identical(stage, groups, what)
            if not overlap:
                state_bytes[f"{layout} zero={zero}"] = optimizer.state_bytes()
    return state_bytes


@pytest.mark.slow
def test_data_parallel_matches_single_process_and_zero1_shards_state() -> None:
    per_rank = run_ranks(_train_and_compare, WORLD, timeout=120)
    # ZeRO-1 keeps ~1/dp of the Adam state per rank; the shards add up to the full state.
    for layout, dp, replicas in (("dp4", 4, [[0, 1, 2, 3]]), ("dp2xtp2", 2, [[0, 2], [1, 3]])):
        for ranks in replicas:
            full = [per_rank[r][f"{layout} zero=False"] for r in ranks]
            sharded = [per_rank[r][f"{layout} zero=True"] for r in ranks]
            assert len(set(full)) == 1, f"{layout}: replicas hold different state sizes {full}"
            assert sum(sharded) == full[0], f"{layout}: shards {sharded} do not sum to {full[0]}"
            # Balanced flat ranges: within a few elements per bucket of an equal split.
            assert max(sharded) <= full[0] / dp * 1.05, f"{layout}: unbalanced {sharded}"
