"""The start-of-run text: model, cluster, plan and iterations, as the logging rank prints them."""

from __future__ import annotations

from megatron_het.config import ModelConfig
from megatron_het.parallel.stage_plan import format_bound
from megatron_het.pipeline.schedules import interleaved_group_size
from megatron_het.training.setup import RunSetup
from megatron_het.training.state import Progress
from megatron_het.training.throughput import devices_per_label


def describe_model(config: ModelConfig) -> str:
    """One line: the model's shape and parameter count."""
    return (
        f"> model {config.name}: {config.num_layers} layers, hidden {config.hidden_size}, "
        f"heads {config.num_attention_heads}/{config.num_query_groups} kv, vocab "
        f"{config.vocab_size}, {config.num_parameters() / 1e6:.2f}M parameters"
    )


def describe_cluster(setup: RunSetup) -> str:
    """One line: where the run trains (ranks by kind), precision, DP and optimizer layout."""
    plan = setup.plan
    kinds = ", ".join(
        f"{count} x {label}" for label, count in devices_per_label(setup.cluster).items()
    )
    ranks = f"{plan.world_size} rank{'s' if plan.world_size != 1 else ''}"
    return (
        f"> run on cluster {setup.cluster.name}: {ranks} ({kinds}), {setup.options.dtype}, "
        f"dp={plan.dp_size}, distributed optimizer "
        f"{'on' if setup.options.use_distributed_optimizer else 'off'}, bridge "
        f"{setup.run.parallel.bridge}"
    )


def describe_plan(setup: RunSetup) -> str:
    """The plan, one line per stage: accelerator (labelled), TP, layers, ranks."""
    plan = setup.plan
    lines = [
        f"> plan: dp={plan.dp_size}, micro_batch_size={plan.micro_batch_size}, global "
        f"batch {plan.global_batch_size}"
        + (", sequence parallel" if plan.sequence_parallel else "")
        + (" with TP communication overlapped" if plan.tp_comm_overlap else "")
    ]
    for p, pipeline in enumerate(plan.pipelines):
        interleave = ""
        if pipeline.interleaved:
            interleave = (
                f", interleaved: {pipeline.num_chunks} chunks on each of "
                f"{pipeline.pp_size} device groups"
            )
            group = interleaved_group_size(pipeline.pp_size, pipeline.micro_batches)
            if group != pipeline.pp_size:
                interleave += f", in micro-batch groups of {group}"
        lines.append(
            f"  pipeline {p}: {pipeline.micro_batches} micro-batches per iteration{interleave}"
        )
        for s, stage in enumerate(pipeline.stages):
            label = setup.accelerator(stage.ranks[0]).label
            extras = "".join(
                [
                    " +embedding" if stage.has_embedding else "",
                    " +head" if stage.has_head else "",
                    f", {stage.recompute_label}" if stage.recompute else "",
                ]
            )
            lines.append(
                f"    stage {s}: {label}, tp={stage.tp}, "
                f"{format_bound(stage.num_layers)} "
                f"layer{'s' if stage.num_layers != 1 else ''} {stage.layers_label}"
                f"{extras}, ranks {list(stage.ranks)}"
            )
    mixed = replicas_across_vendors(setup)
    if mixed and not setup.options.use_distributed_optimizer:
        lines.append(
            f"  note: parameters have replicas on {' and '.join(mixed)}, each stepping "
            "its own optimizer copy; their kernels may round differently, so the "
            "copies can drift apart in the last bits (--use-distributed-optimizer "
            "steps each element once and keeps them equal)"
        )
    tied = tied_copies_across_vendors(setup)
    if tied:
        lines.append(
            f"  note: the tied embedding's copies (the first stages' embedding, the "
            f"last stages' head) sit on {' and '.join(tied)}, each stepping its own "
            "optimizer copy from the same gradient sum; their kernels may round "
            "differently, so the copies can drift apart in the last bits"
        )
    return "\n".join(lines)


def _platform(setup: RunSetup, rank: int) -> str:
    """``nvidia cuda``, ``amd cuda``, ``cpu`` ...: whose kernels step a rank's parameters
    (emulated kinds all run on this host's CPU)."""
    spec = setup.accelerator(rank)
    return (
        "cpu"
        if spec.emulated or spec.device_type == "cpu"
        else (f"{spec.vendor} {spec.device_type}")
    )


def _holders(setup: RunSetup) -> dict[str, set[str]]:
    """Each parameter unit (a layer's block, the embedding, the head) -> the platforms of the
    ranks holding a replica of it."""
    holders: dict[str, set[str]] = {}
    for pipeline in setup.plan.pipelines:
        for stage in pipeline.stages:
            where = {_platform(setup, r) for r in stage.ranks}
            units = [
                f"layer {i} {part}" for i in stage.layer_indices for part in stage.layer_parts(i)
            ]
            units += ["embedding"] * stage.has_embedding + ["head"] * stage.has_head
            for unit in units:
                holders.setdefault(unit, set()).update(where)
    return holders


def replicas_across_vendors(setup: RunSetup) -> list[str]:
    """The platforms (:func:`_platform`) holding data-parallel replicas of one parameter, where
    some parameter's replicas sit on more than one; empty otherwise."""
    mixed: set[str] = set()
    for where in _holders(setup).values():
        if len(where) > 1:
            mixed |= where
    return sorted(mixed)


def tied_copies_across_vendors(setup: RunSetup) -> list[str]:
    """With tied embeddings, the platforms of the embedding's and the head's copies where they
    differ (each steps its own copy, ZeRO-1 or not); empty otherwise."""
    if not setup.model_config.tie_embeddings:
        return []
    holders = _holders(setup)
    where = holders.get("embedding", set()) | holders.get("head", set())
    return sorted(where) if len(where) > 1 else []


def describe_iterations(setup: RunSetup, progress: Progress) -> str:
    """One line: the iterations to run, the batch and where in the data they start."""
    train = setup.train
    return (
        f"> iterations {progress.iteration + 1}..{train.train_iters}, global batch "
        f"{train.global_batch_size} = {train.micro_batch_size} x "
        f"{train.global_batch_size // train.micro_batch_size} micro-batches, seq "
        f"{setup.run.data.seq_length}, from sample {progress.consumed_samples}"
    )


def describe_rank(setup: RunSetup, rank: int) -> str:
    """``rank 3 (emu-slow (emulated), pipeline 1 stage 1)``: a rank as fault reports name it."""
    role = setup.plan.rank_role(rank)
    return (
        f"rank {rank} ({setup.accelerator(rank).label}, pipeline {role.pipeline} stage "
        f"{role.stage})"
    )
