"""The cluster and the plan of a run: a plan file, ``auto`` from the planner, or Megatron's flags.

Every run has a plan. A single process is the one-stage, one-rank plan that Megatron's default
flags (tp = pp = 1) describe on a one-rank cluster; a launched world of N ranks spreads as the
plan says. Everything here only reads files, so ``--dry-run`` and every rank of a real run fail
the same way with one line before anything is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_het.arguments import ParallelSpec, RunConfig
from megatron_het.arguments.options import flag_options, resolve_run_options
from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, RunOptions, TrainConfig
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_builders import plan_from_megatron_flags
from megatron_het.parallel.plan_validation import validate

if TYPE_CHECKING:  # pragma: no cover
    from megatron_het.perf.measure.profile_format import Profile


def local_cluster(world_size: int, accelerator: str = "cpu") -> ClusterSpec:
    """One node of ``world_size`` ranks of kind ``accelerator`` (the default without
    ``--cluster``: "cpu", or the local GPU's kind where the launcher found one)."""
    name = accelerator.lower()
    return ClusterSpec.from_dict(
        {
            "name": name,
            "node_groups": [
                {
                    "name": name,
                    "accelerator": accelerator,
                    "nodes": 1,
                    "devices_per_node": world_size,
                    "nic_bandwidth_gbit_per_s": 10,
                }
            ],
        }
    )


@dataclass(frozen=True)
class PlanChoice:
    """The layout of a run and what it implies: the cluster, the plan (its layout options
    settled), ``train`` (the run's TrainConfig with the plan's micro and global batch sizes; a
    plan file may supply them) and the run's resolved :class:`RunOptions`."""

    cluster: ClusterSpec
    plan: ParallelPlan
    train: TrainConfig
    options: RunOptions


def read_plan_file(run: RunConfig) -> ParallelPlan | None:
    """The ``--plan`` file (None for ``auto`` or no plan)."""
    spec = run.parallel
    if spec.plan is None or spec.plan == "auto":
        return None
    return ParallelPlan.load(spec.plan)


def plan_batch(train: TrainConfig, spec: ParallelSpec, plan: ParallelPlan) -> TrainConfig:
    """``train`` with the plan's batch sizes; UserError where the command line says otherwise."""
    mbs_given, gbs_given = spec.batch_given
    if mbs_given and train.micro_batch_size != plan.micro_batch_size and spec.plan != "auto":
        raise UserError(
            f"--micro-batch-size {train.micro_batch_size} differs from the plan's "
            f"micro_batch_size {plan.micro_batch_size}; drop the flag or edit the plan"
        )
    if gbs_given and train.global_batch_size != plan.global_batch_size:
        raise UserError(
            f"--global-batch-size {train.global_batch_size} differs from the plan's "
            f"{plan.global_batch_size} (micro_batch_size x the pipelines' "
            f"micro_batches); drop the flag or edit the plan's micro_batches"
        )
    return dataclasses.replace(
        train, micro_batch_size=plan.micro_batch_size, global_batch_size=plan.global_batch_size
    )


def load_cluster(
    spec: ParallelSpec,
    world_size: int | None,
    plan_file: ParallelPlan | None,
    accelerator: str = "cpu",
) -> ClusterSpec:
    """The ``--cluster`` file, else :func:`local_cluster` of the launched world (of the plan's
    or the TP x PP layout's size for a dry run)."""
    if spec.cluster is not None:
        cluster = ClusterSpec.load(spec.cluster)
        if world_size is not None and world_size != cluster.world_size:
            raise UserError(
                f"{world_size} ranks were launched but cluster {cluster.name} has "
                f"{cluster.world_size}; launch {cluster.world_size} ranks "
                f"(--nproc_per_node) or fix the cluster file"
            )
        return cluster
    if world_size is None:  # a dry run without a cluster: the layout decides
        world_size = (
            plan_file.world_size
            if plan_file is not None
            else spec.tensor_model_parallel_size * spec.pipeline_model_parallel_size
        )
    return local_cluster(world_size, accelerator)


def host_profiles(spec: ParallelSpec) -> dict[str, Profile] | None:
    """The ``--emulation-profile`` as the host's profile for the planner and the predictor
    (emulated kinds: the host's times x their slowdown), so that an automatic plan and the dry
    run's prediction use the speeds the emulated ranks will run at; None without the flag."""
    if spec.emulation_profile is None:
        return None
    from megatron_het.perf.cost.compute_time import HOST_PROFILE
    from megatron_het.perf.measure.profile_format import Profile

    return {HOST_PROFILE: Profile.load(spec.emulation_profile)}


def _search_or_flags(
    run: RunConfig,
    model: ModelConfig,
    cluster: ClusterSpec,
    profiles: Mapping[str, Profile] | None,
) -> ParallelPlan:
    spec, train = run.parallel, run.train
    if spec.plan == "auto":
        from megatron_het.planner import search_plan

        options = flag_options(spec, train)
        return search_plan(
            model, cluster, train.global_batch_size, run.data.seq_length, profiles, options
        ).plan
    return plan_from_megatron_flags(
        model,
        cluster.world_size,
        spec.tensor_model_parallel_size,
        spec.pipeline_model_parallel_size,
        train.micro_batch_size,
        train.global_batch_size,
        spec.decoder_first_pipeline_num_layers,
        spec.decoder_last_pipeline_num_layers,
        accelerator_of=cluster,
        virtual_stages=virtual_stages(spec, model.num_layers),
        layout=spec.pipeline_model_parallel_layout,
    )


def virtual_stages(spec: ParallelSpec, num_layers: int) -> int | None:
    """Model chunks per pipeline rank from Megatron's interleaving flags (None: not given)."""
    per_stage = spec.num_layers_per_virtual_pipeline_stage
    if per_stage is not None and spec.virtual_pipeline_model_parallel_size is not None:
        raise UserError(
            "give --num-layers-per-virtual-pipeline-stage or "
            "--virtual-pipeline-model-parallel-size, not both"
        )
    if per_stage is None:
        return spec.virtual_pipeline_model_parallel_size
    pp = spec.pipeline_model_parallel_size
    if num_layers % (per_stage * pp):
        raise UserError(
            f"--num-layers {num_layers} is not a multiple of "
            f"--num-layers-per-virtual-pipeline-stage {per_stage} x "
            f"--pipeline-model-parallel-size {pp} = {per_stage * pp}"
        )
    return num_layers // (per_stage * pp)


def choose_plan(
    run: RunConfig,
    model: ModelConfig,
    world_size: int | None,
    profiles: Mapping[str, Profile] | None = None,
    accelerator: str = "cpu",
) -> PlanChoice:
    """Resolve and validate the run's cluster and plan (reads files only).

    ``world_size`` is the launched world (None for ``--dry-run``). Raises UserError with one
    line on any mismatch between plan, cluster, model, batch and world size.
    """
    spec = run.parallel
    plan_file = read_plan_file(run)
    cluster = load_cluster(spec, world_size, plan_file, accelerator)
    plan = plan_file or _search_or_flags(run, model, cluster, profiles)
    train = plan_batch(run.train, spec, plan)
    if plan.world_size != cluster.world_size:
        raise UserError(
            f"the plan places {plan.world_size} ranks but cluster {cluster.name} has "
            f"{cluster.world_size}; give every rank of the cluster a stage"
        )
    plan, options = resolve_run_options(spec, run.train, plan)
    validate(plan, model, cluster, train.global_batch_size, run.data.seq_length)
    return PlanChoice(cluster, plan, train, options)
