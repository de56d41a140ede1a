"""The predictor under sequence parallelism: TP collectives (the same bytes, by hand), boundary
messages resharded by positions (against the runtime's peers, and their time by hand), the
activations saved between TP blocks (by hand and against the tensors the model saves), the
norms and residual adds on 1/tp of the positions, and no change at all without it."""

import dataclasses

import pytest

from megatron_het.cluster import ClusterSpec
from megatron_het.config import RunOptions, model_preset
from megatron_het.errors import UserError
from megatron_het.model.rope import rope_table_dtype
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.stage_plan import PipelinePlan, StagePlan
from megatron_het.perf import predict
from megatron_het.perf.cost.boundary_time import position_messages
from megatron_het.perf.cost.calibration import efficiency_for
from megatron_het.perf.cost.comm_time import CommCost
from megatron_het.perf.cost.roofline import (
    LayerShape,
    head_activation_bytes,
    head_forward_ops,
    layer_activation_bytes,
    layer_forward_ops,
    layer_input_bytes,
    op_time,
    ops_time,
)
from megatron_het.perf.cost.tp_collectives import overlapped_layer_tp, ring_exposed, tp_collectives
from megatron_het.training.plan_setup import local_cluster

TINY = model_preset("tiny")
SEQ, MB = 64, 2
ACT = MB * SEQ * TINY.hidden_size * 4  # one micro-batch's fp32 activations, bytes
# cpu_emulated.yaml: ranks of one kind talk over the node (10 GB/s at 80%, 1 us); the kinds
# over the emulated bridge (2 GB/s, 50 us, exact).
NODE_BW, NODE_LAT = 10e9 * 0.8, 1e-6
BRIDGE_BW, BRIDGE_LAT = 2e9, 50e-6


def all_reduce_pair(nbytes):
    """A ring all-reduce over two ranks of one node."""
    return nbytes / NODE_BW + 2 * NODE_LAT


@pytest.fixture(scope="module")
def emulated():
    return ClusterSpec.load("scripts/clusters/cpu_emulated.yaml")


@pytest.fixture(scope="module")
def tp2_pp2():
    return ParallelPlan.load("scripts/plans/cpu_emulated_tp2_pp2.json")


def with_sp(plan, value=True):
    return dataclasses.replace(plan, sequence_parallel=value)


def test_collective_counts_under_sequence_parallelism():
    counts = tp_collectives(2, 3, True, False, 0, sequence_parallel=True)
    assert (counts.forward, counts.backward) == (0, 0)
    assert (counts.forward_gathers, counts.backward_gathers, counts.norm_grads) == (13, 13, 6)
    assert (counts.forward_all, counts.backward_all) == (6.5, 6.5 + 6)
    head = tp_collectives(2, 3, False, True, 3, sequence_parallel=True)
    assert (head.forward_gathers, head.backward_gathers, head.norm_grads) == (13, 25, 7)
    assert head.forward_all == 6.5 + 2  # the cross-entropy's small ones
    plain = tp_collectives(2, 3, True, False, 0)
    assert (plain.forward_all, plain.backward_all) == (7, 6)
    assert tp_collectives(1, 3, True, True, 3, sequence_parallel=True).backward_all == 0


def test_tp_comm_moves_the_same_bytes_and_adds_the_norm_gradients(emulated, tp2_pp2):
    plain = predict(
        TINY, tp2_pp2, emulated, SEQ, options=RunOptions.from_plan(tp2_pp2, dtype="fp32")
    )
    sp = predict(
        TINY,
        with_sp(tp2_pp2),
        emulated,
        SEQ,
        options=RunOptions.from_plan(with_sp(tp2_pp2), dtype="fp32"),
    )
    act, norm = all_reduce_pair(ACT), all_reduce_pair(4 * TINY.hidden_size)
    # Stage 0: embedding + 2 layers; stage 1: 2 layers + head. 9 all-reduces either way.
    assert [s.tp_comm_s for s in plain.stages] == pytest.approx([9 * act, 9 * act], rel=1e-12)
    assert [s.tp_comm_s for s in sp.stages] == pytest.approx(
        [9 * act + 4 * norm, 9 * act + 5 * norm], rel=1e-12
    )
    # The split moves: the embedding's all-reduce becomes a forward reduce-scatter and a
    # backward all-gather, the head's backward one an all-gather forward + reduce-scatter.
    # Besides, each layer's norms and residual adds (and the head's final norm) run on half
    # the positions.
    saved = [
        norms_saving(emulated, stage, has_head=(i == 1))
        for i, stage in enumerate(tp2_pp2.pipelines[0].stages)
    ]
    assert sp.stages[0].forward_s - plain.stages[0].forward_s == pytest.approx(
        -act / 2 - saved[0][0]
    )
    assert sp.stages[1].forward_s - plain.stages[1].forward_s == pytest.approx(
        act / 2 - saved[1][0]
    )
    assert sp.stages[0].backward_s - plain.stages[0].backward_s == pytest.approx(
        act / 2 + 4 * norm - saved[0][1]
    )


def norms_saving(cluster, stage, has_head):
    """(forward, backward) roofline seconds a stage's layers (and head) save when their norms
    and residual adds run on 1/tp of the positions."""
    spec = cluster.accelerator_of(stage.ranks[0])
    shape = LayerShape.of(TINY, SEQ, MB, stage.tp)
    whole, sharded = (
        ops_time(layer_forward_ops(shape, sequence_parallel=sp), spec, "fp32")
        for sp in (False, True)
    )
    head = [(0.0, 0.0), (0.0, 0.0)]
    if has_head:
        head = [
            ops_time(head_forward_ops(shape, TINY.vocab_size, sp), spec, "fp32")
            for sp in (False, True)
        ]
    return tuple(
        stage.num_layers * (w - s) + h_w - h_s
        for w, s, h_w, h_s in zip(whole, sharded, head[0], head[1])
    )


def test_sequence_parallel_runs_the_norms_and_residual_adds_on_its_positions():
    shape = LayerShape.of(TINY, SEQ, MB, 2)
    t, h = MB * SEQ, TINY.hidden_size
    (whole,) = (op for op in layer_forward_ops(shape) if op.name == "elementwise")
    (sharded,) = (
        op for op in layer_forward_ops(shape, sequence_parallel=True) if op.name == "elementwise"
    )
    # 2 norms (read + write h) and 2 residual adds (read 2h, write h): 10 h per position.
    assert whole.elements - sharded.elements == pytest.approx(10 * h * t / 2)
    assert [
        op for op in layer_forward_ops(shape, sequence_parallel=True) if op.name != "elementwise"
    ] == [op for op in layer_forward_ops(shape) if op.name != "elementwise"]
    final = [
        op for op in head_forward_ops(shape, TINY.vocab_size, True) if op.name == "final_norm"
    ][0]
    assert final.elements == 2 * h * t / 2
    # tp 1: nothing to shard.
    one = LayerShape.of(TINY, SEQ, MB, 1)
    assert layer_forward_ops(one, sequence_parallel=True) == layer_forward_ops(one)


def test_an_overlapped_ring_pays_only_its_steps_beyond_the_gemm_blocks():
    # 4 ranks: 3 transfer steps of 1 s each beside GEMM blocks of 1 s: nothing shows; of 2 s
    # each, 1 s per step shows.
    assert ring_exposed(3.0, 4.0, 4) == 0.0
    assert ring_exposed(6.0, 4.0, 4) == 3.0
    assert ring_exposed(5.0, 0.0, 2) == 5.0 and ring_exposed(5.0, 1.0, 1) == 0.0
    gemms = {"qkv": 1.0, "proj": 0.5, "gate_up": 2.0, "down": 1.0}
    # tp 2: one step of a 1.5 s gather beside half the GEMM. Forward: qkv 1.5 - 0.5, proj
    # 1.5 - 0.25, gate/up 1.5 - 1.0, down 1.5 - 0.5. Backward (data + weight gradients, twice
    # the GEMM): proj 1.5 - 0.5, down 1.5 - 1.0; qkv and gate/up move their gradient's
    # reduce-scatter and their input's gather again: 3.0 - 1.0 and 3.0 - 2.0.
    assert overlapped_layer_tp(1.5, gemms, 2) == (3.75, 4.5)


def test_tp_comm_overlap_prices_the_rings_beside_the_layer_gemms(emulated, tp2_pp2):
    sp = predict(
        TINY,
        with_sp(tp2_pp2),
        emulated,
        SEQ,
        options=RunOptions.from_plan(with_sp(tp2_pp2), dtype="fp32"),
    )
    keyed = dataclasses.replace(with_sp(tp2_pp2), tp_comm_overlap=True)
    ov = predict(TINY, keyed, emulated, SEQ, options=RunOptions.from_plan(keyed, dtype="fp32"))
    norm = all_reduce_pair(4 * TINY.hidden_size)
    shape = LayerShape.of(TINY, SEQ, MB, 2)
    # Stage 0 (emu-fast): 2 layers, the embedding's reduce-scatter (forward) and all-gather
    # (backward) whole, 4 norm gradients whole; stage 1 (emu-slow): 2 layers, the head's two,
    # 5 norms. Each kind's GEMMs at its own speed.
    for stage, row, norms in zip(tp2_pp2.pipelines[0].stages, ov.stages, (4, 5)):
        gather = CommCost(emulated, None).tp_gather(stage.ranks, ACT)
        spec = emulated.accelerator_of(stage.ranks[0])
        gemms = {
            op.name: op_time(op, spec, "fp32", efficiency_for(spec))
            for op in layer_forward_ops(shape)
            if op.name in ("qkv", "proj", "gate_up", "down")
        }
        fwd, bwd = overlapped_layer_tp(gather, gemms, 2)
        assert row.tp_comm_s == pytest.approx(
            2 * (fwd + bwd) + 2 * gather + norms * norm, rel=1e-12
        )
    assert all(o.tp_comm_s < s.tp_comm_s for o, s in zip(ov.stages, sp.stages))
    # Without sequence parallelism the plan's key is moot.
    moot = dataclasses.replace(tp2_pp2, tp_comm_overlap=True)
    assert (
        predict(
            TINY, moot, emulated, SEQ, options=RunOptions(dtype="fp32"), validate=False
        ).to_dict()
        == predict(
            TINY, tp2_pp2, emulated, SEQ, options=RunOptions.from_plan(tp2_pp2, dtype="fp32")
        ).to_dict()
    )
    # The GEMMs keep only their rank's input block: per layer qkv's and gate/up's inputs halve.
    t, h = MB * SEQ, TINY.hidden_size
    assert (
        layer_activation_bytes(shape, "fp32", True)
        - layer_activation_bytes(shape, "fp32", True, tp_comm_overlap=True)
        == 2 * h * (t - t // 2) * 4
    )
    drop = [
        a.memory.activation_bytes - b.memory.activation_bytes for a, b in zip(sp.stages, ov.stages)
    ]
    assert drop == [2 * 2 * 2 * h * (t - t // 2) * 4, 2 * 2 * h * (t - t // 2) * 4]


def test_a_boundary_between_tp2_stages_sends_half_per_message(emulated, tp2_pp2):
    plain = predict(
        TINY, tp2_pp2, emulated, SEQ, options=RunOptions.from_plan(tp2_pp2, dtype="fp32")
    )
    sp = predict(
        TINY,
        with_sp(tp2_pp2),
        emulated,
        SEQ,
        options=RunOptions.from_plan(with_sp(tp2_pp2), dtype="fp32"),
    )
    assert position_messages(with_sp(tp2_pp2), *tp2_pp2.pipelines[0].stages, SEQ) == [
        (0, 2, 0.5),
        (1, 3, 0.5),
    ]
    full = BRIDGE_LAT + ACT / BRIDGE_BW
    half = BRIDGE_LAT + ACT / 2 / BRIDGE_BW
    assert (plain.stages[0].p2p_forward_s, plain.stages[0].p2p_backward_s) == pytest.approx(
        (full, full), rel=1e-12
    )
    assert (sp.stages[0].p2p_forward_s, sp.stages[0].p2p_backward_s) == pytest.approx(
        (half, half), rel=1e-12
    )


def test_a_tp_change_sends_the_overlapping_blocks_without_a_broadcast():
    plan = ParallelPlan(
        MB,
        (
            PipelinePlan(
                2, (StagePlan("cpu", 2, (0, 2), (0, 1)), StagePlan("cpu", 1, (2, 4), (2,)))
            ),
        ),
        sequence_parallel=True,
    )
    assert position_messages(plan, *plan.pipelines[0].stages, SEQ) == [(0, 2, 0.5), (1, 2, 0.5)]
    pred = predict(
        TINY, plan, local_cluster(3), SEQ, options=RunOptions.from_plan(plan, dtype="fp32")
    )
    # Rank 2 takes both halves one after the other: the whole activation, one latency.
    both = NODE_LAT + ACT / NODE_BW
    assert (pred.stages[0].p2p_forward_s, pred.stages[0].p2p_backward_s) == pytest.approx(
        (both, both), rel=1e-12
    )
    plain = predict(
        TINY,
        with_sp(plan, None),
        local_cluster(3),
        SEQ,
        options=RunOptions.from_plan(with_sp(plan, None), dtype="fp32"),
    )
    assert plain.stages[0].p2p_backward_s > pred.stages[0].p2p_backward_s  # the broadcast


def test_position_messages_are_the_runtimes():
    from megatron_het.pipeline.stage_boundary import boundary_peers

    def stage(tp, layers, first):
        return StagePlan("cpu", tp, layers, tuple(range(first, first + tp)))

    plan = ParallelPlan(
        MB,
        (
            PipelinePlan(
                2,
                (
                    stage(2, (0, 1), 0),
                    stage(4, (1, 2), 2),
                    stage(1, (2, 3), 6),
                    stage(2, (3, 4), 7),
                ),
            ),
        ),
        sequence_parallel=True,
    )
    stages = plan.pipelines[0].stages
    for b in range(len(stages) - 1):
        expected = position_messages(plan, stages[b], stages[b + 1], SEQ)
        got = [
            (rank, piece.peer, (piece.stop - piece.start) / SEQ if piece.start is not None else 1.0)
            for rank in stages[b].ranks
            for piece in boundary_peers(plan, rank, SEQ).send_forward
        ]
        assert sorted(got) == sorted(expected)
        received = [
            (piece.peer, rank)
            for rank in stages[b + 1].ranks
            for piece in boundary_peers(plan, rank, SEQ).recv_forward
        ]
        assert sorted(received) == sorted((a, c) for a, c, _ in expected)


def test_activations_between_tp_blocks_shrink_by_tp_by_hand(emulated, tp2_pp2):
    t, h = MB * SEQ, TINY.hidden_size
    shape = LayerShape.of(TINY, SEQ, MB, 2)
    # Per layer: both norms' inputs (h each) and their float32 1/rms, now half the positions.
    layer_saved = 2 * h * (t - t // 2) * 4 + 2 * (t - t // 2) * 4
    assert (
        layer_activation_bytes(shape, "fp32") - layer_activation_bytes(shape, "fp32", True)
        == layer_saved
        == 33280
    )
    # The head: the final norm's input and 1/rms.
    head_saved = h * (t - t // 2) * 4 + (t - t // 2) * 4
    vocab = TINY.vocab_size
    assert (
        head_activation_bytes(shape, vocab, "fp32")
        - head_activation_bytes(shape, vocab, "fp32", True)
        == head_saved
        == 16640
    )
    assert layer_input_bytes(shape, "fp32", True) == layer_input_bytes(shape, "fp32") / 2
    plain = predict(
        TINY, tp2_pp2, emulated, SEQ, options=RunOptions.from_plan(tp2_pp2, dtype="fp32")
    )
    sp = predict(
        TINY,
        with_sp(tp2_pp2),
        emulated,
        SEQ,
        options=RunOptions.from_plan(with_sp(tp2_pp2), dtype="fp32"),
    )
    drop = [
        a.memory.activation_bytes - b.memory.activation_bytes
        for a, b in zip(plain.stages, sp.stages)
    ]
    # 1F1B with 4 micro-batches on 2 stages: stage 0 holds 2 in flight, stage 1 one.
    assert drop == [2 * 2 * layer_saved, 2 * layer_saved + head_saved]
    recompute = [
        predict(
            TINY,
            plan,
            emulated,
            SEQ,
            options=RunOptions.from_plan(plan, dtype="fp32"),
            recompute=True,
        )
        for plan in (tp2_pp2, with_sp(tp2_pp2))
    ]
    kept = [r.stages[0].memory.activation_bytes for r in recompute]
    assert kept[0] - kept[1] == 2 * 2 * t * h * 4 / 2  # the layers' inputs, halved
    assert recompute[1].stages[0].memory.transient_bytes == layer_activation_bytes(
        shape, "fp32", True
    )


class _SequenceGroup:
    """A TP group of 2 that runs rank 0's computation with its collectives skipped."""

    size, rank = 2, 0

    def all_reduce(self, tensor, op="sum"):
        pass

    def all_gather_into_tensor(self, output, input):
        output.view(self.size, -1).copy_(input.reshape(1, -1))

    def reduce_scatter_tensor(self, output, input, op="sum"):
        output.copy_(input.view(self.size, *output.shape)[self.rank])


class _Handle:
    def wait(self):
        pass


class _RingGroup(_SequenceGroup):
    """... whose ring steps hand rank 0 its own block again (the ring's shapes, not its
    values, matter for what is saved)."""

    ranks = (0, 1)

    def batch_isend_irecv(self, ops):
        send, recv = ops
        recv.tensor.copy_(send.tensor)
        return [_Handle(), _Handle()]


@pytest.mark.parametrize(
    "dtype, overlap", [("fp32", False), ("bf16", False), ("fp32", True), ("bf16", True)]
)
def test_sequence_parallel_terms_are_the_tensors_the_model_saves(dtype, overlap):
    import torch

    from megatron_het.model.llama import build_model
    from megatron_het.perf.measure.timed_cases import SavedActivations
    from megatron_het.tensor_parallel import apply_tp

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = build_model(TINY, seed=1)
    group = _RingGroup() if overlap else _SequenceGroup()
    apply_tp(model, group, TINY, sequence_parallel=True, tp_comm_overlap=overlap)
    model = model.to(torch_dtype)
    if dtype == "bf16":  # as the optimizer leaves them: float32 main gradients
        for param in model.parameters():
            param.main_grad = torch.zeros(param.shape)
    x = torch.randn(MB, SEQ // 2, TINY.hidden_size, dtype=torch_dtype, requires_grad=True)
    cos, sin = model.rotary.cos_sin(SEQ, x.device, rope_table_dtype(x))  # as the model's
    tokens = torch.randint(0, TINY.vocab_size, (MB, SEQ))
    shape = LayerShape.of(TINY, SEQ, MB, 2)
    with SavedActivations(model.parameters(), (cos, sin)) as layer:
        out = model.layers["0"](x, cos, sin)
    assert out.shape == x.shape and layer.nbytes == layer_activation_bytes(
        shape, dtype, True, tp_comm_overlap=overlap
    )
    with SavedActivations(model.parameters(), (cos, sin)) as head:
        model.head(x, labels=tokens)
    assert head.nbytes == head_activation_bytes(shape, TINY.vocab_size, dtype, True)


def test_without_sequence_parallelism_nothing_changes(emulated, tp2_pp2):
    for plan in (tp2_pp2, ParallelPlan.load("scripts/plans/cpu_emulated_3stage.json")):
        unset = predict(
            TINY,
            plan,
            emulated,
            SEQ,
            options=RunOptions.from_plan(plan, use_distributed_optimizer=True),
        )
        off = predict(
            TINY,
            with_sp(plan, False),
            emulated,
            SEQ,
            options=RunOptions.from_plan(with_sp(plan, False), use_distributed_optimizer=True),
        )
        assert unset.to_dict() == off.to_dict()
        assert predict(TINY, with_sp(plan), emulated, SEQ).to_dict() != unset.to_dict()
    # Every stage at tp=1: sequence parallelism has nothing to shard.
    pp4 = ParallelPlan.load("scripts/plans/cpu_emulated_pp4.json")
    assert (
        predict(TINY, with_sp(pp4), emulated, SEQ).to_dict()
        == predict(TINY, pp4, emulated, SEQ).to_dict()
    )


def test_the_sequence_must_split_over_every_tp(emulated, tp2_pp2):
    with pytest.raises(UserError, match="sequence parallelism"):
        predict(TINY, with_sp(tp2_pp2), emulated, 63)


def _one_kind_cluster(intra_node_gbps: float, tflops: float) -> ClusterSpec:
    """4 devices of one made-up kind on one node whose links move ``intra_node_gbps`` and
    whose compute peaks at ``tflops``."""
    return ClusterSpec.from_dict(
        {
            "name": "links",
            "accelerators": {
                "dev": {
                    "vendor": "other",
                    "native_backend": "gloo",
                    "collective_library": "gloo",
                    "device_type": "cpu",
                    "memory_gib": 64,
                    "peak_tflops_bf16": tflops,
                    "peak_tflops_fp16": tflops,
                    "peak_tflops_fp32": tflops,
                    "memory_bandwidth_gbps": 1000,
                    "intra_node_bandwidth_gbps": intra_node_gbps,
                }
            },
            "node_groups": [
                {
                    "name": "n",
                    "accelerator": "dev",
                    "nodes": 1,
                    "devices_per_node": 4,
                    "nic_bandwidth_gbit_per_s": 100,
                }
            ],
        }
    )


@pytest.mark.parametrize("gbps, tflops, rings_kept", [(300.0, 0.1, True), (0.05, 100.0, False)])
def test_the_planner_keeps_the_rings_only_where_they_are_faster(gbps, tflops, rings_kept):
    from megatron_het.planner.search import _rings_or_collectives

    cluster = _one_kind_cluster(gbps, tflops)
    plan = ParallelPlan(
        MB,
        (
            PipelinePlan(
                4, (StagePlan("dev", 2, (0, 2), (0, 1)), StagePlan("dev", 2, (2, 4), (2, 3)))
            ),
        ),
        dtype="fp32",
        sequence_parallel=True,
        tp_comm_overlap=True,
    )

    class Search:  # what the helper reads of a planner's search
        @staticmethod
        def predict(p):
            return predict(TINY, p, cluster, SEQ)

        @staticmethod
        def fits(prediction):
            return True

    rings = Search.predict(plan)
    whole = Search.predict(dataclasses.replace(plan, tp_comm_overlap=None))
    # Fast links beside slow GEMMs: the rings hide what they move. Slow links beside fast
    # GEMMs: the input's second gather in backward costs more than the rings hide.
    assert (rings.iteration_time_s < whole.iteration_time_s) is rings_kept
    chosen, prediction = _rings_or_collectives(plan, Search, rings)
    assert bool(chosen.tp_comm_overlap) is rings_kept
    assert prediction.iteration_time_s == min(rings.iteration_time_s, whole.iteration_time_s)


def test_scatter_gather_boundaries_shard_the_transfers_alone(emulated, tp2_pp2):
    # Megatron-LM 2021's --scatter-gather-tensors-in-pipeline: the boundary moves 1/tp shares
    # as under sequence parallelism; the layers, their collectives and memory stay whole.
    plain = predict(
        TINY, tp2_pp2, emulated, SEQ, options=RunOptions.from_plan(tp2_pp2, dtype="fp32")
    )
    sp = predict(
        TINY,
        with_sp(tp2_pp2),
        emulated,
        SEQ,
        options=RunOptions.from_plan(with_sp(tp2_pp2), dtype="fp32"),
    )
    sg = predict(
        TINY,
        tp2_pp2,
        emulated,
        SEQ,
        options=RunOptions.from_plan(tp2_pp2, dtype="fp32"),
        scatter_gather_tensors_in_pipeline=True,
    )
    for mine, whole, sharded in zip(sg.stages, plain.stages, sp.stages):
        assert (mine.p2p_forward_s, mine.p2p_backward_s) == (
            sharded.p2p_forward_s,
            sharded.p2p_backward_s,
        )
        assert (mine.forward_s, mine.backward_s, mine.tp_comm_s) == (
            whole.forward_s,
            whole.backward_s,
            whole.tp_comm_s,
        )
        assert mine.memory == whole.memory
    assert sg.stages[0].p2p_forward_s < plain.stages[0].p2p_forward_s
    # A sequence-parallel plan shards its boundaries already: the flag changes nothing there.
    again = predict(
        TINY,
        with_sp(tp2_pp2),
        emulated,
        SEQ,
        options=RunOptions.from_plan(with_sp(tp2_pp2), dtype="fp32"),
        scatter_gather_tensors_in_pipeline=True,
    )
    assert again.iteration_time_s == sp.iteration_time_s
