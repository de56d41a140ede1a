"""ParallelOptimizer: norm counting rules, state by global name, resume, errors (gloo, 4 ranks).

Same kinds and layouts as test_data_parallel.py, plus, in Megatron rank order, PP 2 x TP 2 and
PP 2 x DP 2 with tied embeddings (the head stage holds a copy of the embedding). Gradients are
set to known values so the expected global norm is exact: each distinct element of the
single-process model counted once. PP 2 x DP 2 trains through the pipeline executor with the
DP reduction overlapped with backward (and with ZeRO-1's parameter all-gather overlapped with
the next forward) and must match the single-process run.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_het.errors import UserError
from megatron_het.model.llama import build_model
from megatron_het.optim.parallel_optimizer import build_parallel_optimizer
from megatron_het.parallel.process_groups import ProcessGroups
from megatron_het.pipeline.executor import PipelineExecutor
from megatron_het.pipeline.stage import build_stage as build_pipeline_stage
from megatron_het.tensor_parallel import apply_tp, parameter_shape, shard_tensor
from tests.distributed.harness import run_ranks
from tests.distributed.test_data_parallel import (
    BUCKET_MB,
    CLIP,
    CONFIG,
    ITERS,
    LR,
    MICRO_BATCH,
    OPT,
    SEED,
    SEQ,
    TOTAL_MICRO_BATCHES,
    WORLD,
    build_stage,
    check_against_reference,
    check_replicas_identical,
    global_batch,
    make_groups,
    reference_run,
    rel_err,
    train_iteration,
)

TIED = CONFIG.replace(tie_embeddings=True, name="dp-test-tied")


def known_grad(name: str, config=CONFIG) -> torch.Tensor:
    """A full-size gradient for ``name``, different in scale per parameter."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    scale = 1.0 + zlib.crc32(name.encode()) % 7
    return torch.randn(parameter_shape(name, config), generator=gen) * scale


def set_known_grads(stage, optimizer, groups: ProcessGroups, config) -> None:
    """Give DP replica d the share (d + 1) / sum of the known gradient's TP shard, so the DP
    sum is exactly the known gradient up to rounding."""
    optimizer.zero_grad()
    dp, d = groups.dp.size, groups.dp.rank
    share = (d + 1) / (dp * (dp + 1) / 2)
    for name, param in stage.named_parameters():
        full = known_grad(name, config)
        param.grad.copy_(shard_tensor(name, full, config, groups.tp.size, groups.tp.rank) * share)


def expected_norm(config, names) -> float:
    return float(torch.stack([known_grad(n, config).square().sum() for n in names]).sum().sqrt())


def _check_norm_counting(rank: int, layouts: dict[str, ProcessGroups]) -> None:
    all_names = [n for n, _ in build_model(CONFIG, SEED).named_parameters()]
    for layout in ("dp4", "dp2xtp2"):
        for zero in (False, True):
            groups = layouts[layout]
            stage = build_stage(groups)
            optimizer = build_parallel_optimizer(stage, groups, OPT, zero, bucket_size_mb=BUCKET_MB)
            set_known_grads(stage, optimizer, groups, CONFIG)
            optimizer.sync_grads()
            got, want = optimizer.grad_norm(), expected_norm(CONFIG, all_names)
            assert abs(got - want) <= 1e-5 * want, f"{layout} zero={zero}: norm {got} vs {want}"
    # PP 2 x TP 2, tied embeddings: the head stage's embedding copy is not counted again.
    groups = layouts["pp2xtp2"]
    stage_plan = groups.role.stage_plan
    assert groups.dp.size == 1 and groups.tp.size == 2
    stage = build_model(
        TIED,
        SEED,
        layer_range=(stage_plan.layers[0], stage_plan.layers[1]),
        has_embedding=stage_plan.has_embedding,
        has_head=stage_plan.has_head,
    )
    apply_tp(stage, groups.tp, TIED)
    assert "embedding.weight" in dict(stage.named_parameters())
    optimizer = build_parallel_optimizer(stage, groups, OPT, False)
    set_known_grads(stage, optimizer, groups, TIED)
    tied_names = [n for n, _ in build_model(TIED, SEED).named_parameters()]
    got, want = optimizer.grad_norm(), expected_norm(TIED, tied_names)
    assert abs(got - want) <= 1e-5 * want, f"pp2xtp2 tied: norm {got} vs {want}"


def _resume(rank: int, groups: ProcessGroups) -> None:
    """Train 3 iterations, save, train 3 more; a fresh optimizer loading the saved state (in
    either ZeRO mode) must continue to the same weights."""
    finals, saved = {}, {}
    for zero in (False, True):
        stage = build_stage(groups)
        optimizer = build_parallel_optimizer(stage, groups, OPT, zero, bucket_size_mb=BUCKET_MB)
        for it in range(3):
            train_iteration(stage, optimizer, groups, it)
        state = optimizer.state_dict()
        # A replica that writes no checkpoint piece joins the gather but keeps no host copy;
        # the replica that writes gets the same whole state.
        writes = groups.role.pipeline == 0
        kept = optimizer.state_dict(keep=writes)
        assert (kept == {}) != writes
        for name in kept:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(kept[name][key], state[name][key])
        params = {n: p.detach().clone() for n, p in stage.named_parameters()}
        for name, param in stage.named_parameters():
            assert state[name]["step"] == 3
            for key in ("exp_avg", "exp_avg_sq"):
                assert state[name][key].shape == param.shape, f"{name} {key} not TP-shard shaped"
        for it in range(3, 6):
            train_iteration(stage, optimizer, groups, it)
        finals[zero] = {n: p.detach().clone() for n, p in stage.named_parameters()}
        saved[zero] = (params, state)
    for name in saved[False][1]:  # both modes hold the same state, name for name
        for key in ("exp_avg", "exp_avg_sq"):
            err = rel_err(saved[True][1][name][key], saved[False][1][name][key])
            assert err <= 1e-5, f"ZeRO and plain state differ for {name} {key}: {err:.1e}"
    for saved_zero in (False, True):
        for zero in (False, True):
            params, state = saved[saved_zero]
            stage = build_stage(groups)
            with torch.no_grad():
                for name, param in stage.named_parameters():
                    param.copy_(params[name])
            optimizer = build_parallel_optimizer(stage, groups, OPT, zero, bucket_size_mb=BUCKET_MB)
            optimizer.load_state_dict(state)
            for it in range(3, 6):
                train_iteration(stage, optimizer, groups, it)
            for name, param in stage.named_parameters():
                err = rel_err(param.detach(), finals[saved_zero][name])
                limit = 0.0 if zero == saved_zero else 1e-5
                assert err <= limit, (
                    f"resume saved zero={saved_zero} into zero={zero}: {name} off by {err:.1e}"
                )


def _errors(rank: int, groups: ProcessGroups) -> None:
    stage = build_stage(groups)
    optimizer = build_parallel_optimizer(stage, groups, OPT, True, bucket_size_mb=BUCKET_MB)
    state = optimizer.state_dict()
    name = next(iter(state))
    with pytest.raises(UserError, match="missing: " + name.replace(".", r"\.")):
        optimizer.load_state_dict({n: v for n, v in state.items() if n != name})
    bad = dict(state, **{name: dict(state[name], exp_avg=torch.zeros(3))})
    with pytest.raises(UserError, match="reshard"):
        optimizer.load_state_dict(bad)
    # A non-finite gradient on one rank: every rank refuses to step, weights stay as they were.
    before = {n: p.detach().clone() for n, p in stage.named_parameters()}
    set_known_grads(stage, optimizer, groups, CONFIG)
    if rank == 3:
        next(stage.parameters()).grad.view(-1)[0] = float("nan")
    optimizer.sync_grads()
    with pytest.raises(UserError, match="gradient norm is nan"):
        optimizer.clip_and_step(1e-2, 1.0)
    for n, p in stage.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"{n} changed despite the non-finite norm"


class _Deferred:
    """A handle whose all-gather runs only once it is waited on."""

    def __init__(self, run) -> None:
        self.run = run

    def wait(self) -> None:
        if self.run is not None:
            self.run()
            self.run = None


def _defer_async_gathers(group):
    """Make ``group``'s asynchronous all-gathers run only when waited on: a forward that read a
    parameter before its module waited for the bucket would see the pre-step values. Returns a
    function that undoes it."""
    real = group.all_gather_into_tensor

    def deferred(output, input, async_op=False):
        if not async_op:
            return real(output, input)
        return _Deferred(lambda: real(output, input))

    group.all_gather_into_tensor = deferred
    return lambda: delattr(group, "all_gather_into_tensor")


def _pipeline_with_overlap(rank: int, groups: ProcessGroups) -> None:
    """PP 2 x DP 2, tied embeddings, through the pipeline executor, with overlapped DP
    reduction: the embedding bucket waits for the executor's cross-stage sum, the rest start
    from backward hooks. Must match the single-process run."""
    ref = reference_run(TIED)
    plan = groups.plan
    role = groups.role
    per_pipeline = plan.pipelines[role.pipeline].micro_batches
    first_mb = sum(p.micro_batches for p in plan.pipelines[: role.pipeline])
    for zero, gather in ((False, False), (True, False), (True, True)):
        what = f"pp2xdp2 tied zero={zero} overlap param gather={gather} rank {rank}"
        stage = build_pipeline_stage(TIED, plan, groups, SEED)
        optimizer = build_parallel_optimizer(
            stage,
            groups,
            OPT,
            zero,
            bucket_size_mb=BUCKET_MB,
            overlap_grad_reduce=True,
            overlap_param_gather=gather,
        )
        executor = PipelineExecutor(stage, groups, TIED, SEQ, MICRO_BATCH)
        losses, norms, in_flight = [], [], []
        undo = _defer_async_gathers(groups.dp) if gather else (lambda: None)
        for it in range(ITERS):
            optimizer.zero_grad(num_micro_batches=per_pipeline)
            mine = global_batch(it)[first_mb : first_mb + per_pipeline]
            stats = executor.run(mine, loss_scale=1.0 / TOTAL_MICRO_BATCHES)
            optimizer.sync_grads()
            norms.append(optimizer.clip_and_step(LR, CLIP))
            # --overlap-param-gather: the step returns with every bucket's all-gather in
            # flight; the next forward's modules wait for theirs (the losses prove they did).
            in_flight.append(len(optimizer.flat.gathering))
            loss = torch.tensor(stats.loss_sum)
            groups.world.all_reduce(loss, "sum")
            losses.append(float(loss) / TOTAL_MICRO_BATCHES)
        held_back = 1 if "embedding.weight" in dict(stage.named_parameters()) else 0
        assert optimizer.buckets.launched_early == len(optimizer.buckets.buckets) - held_back
        assert in_flight == [len(optimizer.buckets.buckets) if gather else 0] * ITERS, what
        optimizer.params_ready()
        assert optimizer.flat.gathering == ()
        undo()
        optimizer.close()
        check_against_reference(stage, groups, ref, losses, norms, what, TIED)
        check_replicas_identical(stage, groups, what)


def _all_checks(rank: int, world_size: int) -> None:
    layouts = make_groups(world_size)
    _pipeline_with_overlap(rank, layouts["pp2xdp2"])
    _check_norm_counting(rank, layouts)
    _resume(rank, layouts["dp2xtp2"])
    _errors(rank, layouts["dp2xtp2"])


@pytest.mark.slow
def test_norm_counting_state_resume_and_errors() -> None:
    run_ranks(_all_checks, WORLD, timeout=120)


DEEP = CONFIG.replace(num_layers=4, name="dp-test-deep")


def _interleaved_buckets_go_out_per_chunk(rank: int, world_size: int) -> None:
    """PP 2 x DP 2 with 2 interleaved chunks per device group and --overlap-grad-reduce: the
    buckets of a group's later chunk go out once that chunk's last backward is done, while
    chunk 0 still has backward passes to run (what the predictor's DP overlap assumes)."""
    import datetime

    from megatron_het.comm import UnifiedCommunicator
    from megatron_het.parallel.plan_builders import plan_from_megatron_flags
    from megatron_het.parallel.process_groups import build_process_groups

    comm = UnifiedCommunicator(
        ["cpu"] * world_size,
        {"cpu": "gloo"},
        {"cpu": "cpu"},
        timeout=datetime.timedelta(seconds=60),
    )
    plan = plan_from_megatron_flags(
        DEEP,
        world_size,
        1,
        2,
        MICRO_BATCH,
        TOTAL_MICRO_BATCHES * MICRO_BATCH,
        accelerator_of=lambda r: "cpu",
        virtual_stages=2,
    )
    groups = build_process_groups(comm, plan, tie_embeddings=False, num_layers=4)
    role = groups.role
    chunk_of = {}  # layer index -> chunk of this device group
    for chunk, stage in enumerate(role.chunk_plans):
        chunk_of.update({i: chunk for i in stage.layer_indices})
    stage = build_pipeline_stage(DEEP, plan, groups, SEED)
    optimizer = build_parallel_optimizer(
        stage, groups, OPT, False, bucket_size_mb=BUCKET_MB, overlap_grad_reduce=True
    )
    executor = PipelineExecutor(stage, groups, DEEP, SEQ, MICRO_BATCH)
    buckets = optimizer.buckets

    def chunks(bucket) -> set[int]:
        return {
            chunk_of[int(s.name.split(".")[1])]
            for s in bucket.slots
            if s.name.startswith("layers.")
        }

    launched = []
    real = buckets._launch

    def record(bucket, mode):
        if buckets._overlap.expected is not None:  # launched early, from a backward hook
            pending = [
                b.index
                for b in buckets.buckets
                if 0 in chunks(b)
                and buckets._overlap.counts[b.index]
                < buckets._overlap.expected * buckets._overlap.per_backward[b.index]
            ]
            launched.append((chunks(bucket), pending))
        real(bucket, mode)

    buckets._launch = record
    per_pipeline = plan.pipelines[role.pipeline].micro_batches
    first_mb = sum(p.micro_batches for p in plan.pipelines[: role.pipeline])
    optimizer.zero_grad(num_micro_batches=per_pipeline)
    executor.run(
        global_batch(0)[first_mb : first_mb + per_pipeline], loss_scale=1.0 / TOTAL_MICRO_BATCHES
    )
    optimizer.sync_grads()
    later = [pending for held, pending in launched if held == {1}]
    assert later and all(later), (rank, launched)  # chunk 0 gradients were still coming
    assert {0} in [held for held, _ in launched]
    optimizer.close()


def test_interleaved_buckets_go_out_per_chunk() -> None:
    run_ranks(_interleaved_buckets_go_out_per_chunk, WORLD, timeout=120)
