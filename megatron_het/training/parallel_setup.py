"""Everything a parallel run checks before it starts processes: cluster, plan, batch, model.

:func:`prepare_parallel_run` reuses the single-process checks (:func:`prepare_run`: tokenizer,
model config, data, checkpoint) and adds the cluster, the plan (a file, ``auto`` from the
planner, or Megatron's TP/PP flags) and their consistency with the model, the batch and the
launched world size. It only reads files, so ``--dry-run`` and every rank of a real run fail
the same way with one line before anything is written.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, TextIO

from megatron_het.arguments import ParallelSpec, RunConfig
from megatron_het.cluster import AcceleratorSpec, ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.errors import UserError
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_builders import plan_from_megatron_flags
from megatron_het.parallel.plan_validation import validate
from megatron_het.training.setup import RunSetup, prepare_run

if TYPE_CHECKING:  # pragma: no cover
    from megatron_het.perf.profile import Profile


@dataclass(frozen=True)
class ParallelSetup:
    """The checked inputs of a parallel run.

    ``setup.run`` carries the batch sizes actually used (a plan file's where the command line
    gave none). ``dtype`` is "bf16" or "fp32"; ``use_distributed_optimizer`` is the plan's
    choice where it makes one, else the flag's. ``emulated_device_s`` maps each emulated rank
    to its stage's (forward, backward) seconds per micro-batch on this host from
    ``--emulation-profile`` (empty without the flag), and ``host_profiles`` is that profile as
    :func:`host_profiles` loads it (None without the flag).
    """

    setup: RunSetup
    cluster: ClusterSpec
    plan: ParallelPlan
    dtype: str
    use_distributed_optimizer: bool
    emulated_device_s: Mapping[int, tuple[float, float]] = dataclasses.field(
        default_factory=dict)
    host_profiles: Optional[Mapping[str, "Profile"]] = None

    @property
    def run(self) -> RunConfig:
        return self.setup.run

    def accelerator(self, rank: int) -> AcceleratorSpec:
        return self.cluster.accelerator_of(rank)


def cpu_cluster(world_size: int) -> ClusterSpec:
    """A one-node cluster of ``world_size`` plain "cpu" ranks (the default without --cluster)."""
    return ClusterSpec.from_dict({"name": "cpu", "node_groups": [
        {"name": "cpu", "accelerator": "cpu", "nodes": 1, "devices_per_node": world_size,
         "nic_bandwidth_gbit_per_s": 10}]})


def _adopt_plan_batch(run: RunConfig, plan: ParallelPlan) -> RunConfig:
    """``run`` with the plan's micro/global batch sizes where the command line gave none."""
    mbs_given, gbs_given = run.parallel.batch_given
    train = run.train
    if mbs_given and train.micro_batch_size != plan.micro_batch_size:
        raise UserError(f"--micro-batch-size {train.micro_batch_size} differs from the plan's "
                        f"micro_batch_size {plan.micro_batch_size}; drop the flag or edit the plan")
    if gbs_given and train.global_batch_size != plan.global_batch_size:
        raise UserError(f"--global-batch-size {train.global_batch_size} differs from the plan's "
                        f"{plan.global_batch_size} (micro_batch_size x the pipelines' "
                        f"micro_batches); drop the flag or edit the plan's micro_batches")
    train = dataclasses.replace(train, micro_batch_size=plan.micro_batch_size,
                                global_batch_size=plan.global_batch_size)
    return dataclasses.replace(run, train=train)


def _run_dtype(run: RunConfig, plan: ParallelPlan) -> str:
    if plan.dtype == "fp16":
        raise UserError("the plan's dtype fp16 is not supported (it needs loss scaling); set "
                        "\"dtype\": \"bf16\" or \"fp32\" in the plan")
    if plan.dtype == "fp32" and run.train.bf16:
        raise UserError("--bf16 contradicts the plan's dtype fp32; drop --bf16 or set "
                        "\"dtype\": \"bf16\" in the plan")
    return "bf16" if run.train.bf16 or plan.dtype == "bf16" else "fp32"


def _load_cluster(spec: ParallelSpec, world_size: Optional[int],
                  plan_file: Optional[ParallelPlan]) -> ClusterSpec:
    if spec.cluster is not None:
        cluster = ClusterSpec.load(spec.cluster)
        if world_size is not None and world_size != cluster.world_size:
            raise UserError(f"{world_size} ranks were launched but cluster {cluster.name} has "
                            f"{cluster.world_size}; launch {cluster.world_size} ranks "
                            f"(--nproc_per_node) or fix the cluster file")
        return cluster
    if world_size is None:  # a dry run without a cluster: the layout decides
        world_size = (plan_file.world_size if plan_file is not None else
                      spec.tensor_model_parallel_size * spec.pipeline_model_parallel_size)
    return cpu_cluster(world_size)


def host_profiles(spec: ParallelSpec) -> Optional[dict[str, "Profile"]]:
    """The ``--emulation-profile`` as the host's profile for the planner and the predictor
    (emulated kinds: the host's times x their slowdown), so that an automatic plan and the dry
    run's prediction use the speeds the emulated ranks will run at; None without the flag."""
    if spec.emulation_profile is None:
        return None
    from megatron_het.perf.profile import Profile
    from megatron_het.perf.stage_cost import HOST_PROFILE

    return {HOST_PROFILE: Profile.load(spec.emulation_profile)}


def _build_plan(setup: RunSetup, cluster: ClusterSpec, dtype: str,
                profiles: Optional[Mapping[str, "Profile"]]) -> ParallelPlan:
    spec, train = setup.run.parallel, setup.run.train
    if spec.plan == "auto":
        from megatron_het.planner import search_plan

        result = search_plan(setup.model_config, cluster, train.global_batch_size,
                             setup.run.data.seq_length, profiles, dtype=dtype,
                             with_upper_bound=False)
        return result.plan
    return plan_from_megatron_flags(
        setup.model_config, cluster.world_size, spec.tensor_model_parallel_size,
        spec.pipeline_model_parallel_size, train.micro_batch_size, train.global_batch_size,
        spec.decoder_first_pipeline_num_layers, spec.decoder_last_pipeline_num_layers,
        accelerator_of=cluster)


def prepare_parallel_run(run: RunConfig, world_size: Optional[int]) -> ParallelSetup:
    """Check a parallel run's inputs and resolve its plan (reads files only).

    ``world_size`` is the launched world (None for ``--dry-run``: the cluster's, or the plan's
    without a cluster). Raises UserError with one line on any mismatch between plan, cluster,
    model, batch and world size.
    """
    spec = run.parallel
    plan_file = None
    if spec.plan is not None and spec.plan != "auto":
        plan_file = ParallelPlan.load(spec.plan)
        run = _adopt_plan_batch(run, plan_file)
    cluster = _load_cluster(spec, world_size, plan_file)
    setup = prepare_run(run)
    dtype = _run_dtype(run, plan_file) if plan_file else ("bf16" if run.train.bf16 else "fp32")
    profiles = host_profiles(spec)
    plan = plan_file or _build_plan(setup, cluster, dtype, profiles)
    if spec.plan == "auto" and plan.micro_batch_size != run.train.micro_batch_size:
        train = dataclasses.replace(run.train, micro_batch_size=plan.micro_batch_size)
        setup = dataclasses.replace(setup, run=dataclasses.replace(run, train=train))
    if plan.world_size != cluster.world_size:
        raise UserError(f"the plan places {plan.world_size} ranks but cluster {cluster.name} has "
                        f"{cluster.world_size}; give every rank of the cluster a stage")
    validate(plan, setup.model_config, cluster, setup.run.train.global_batch_size)
    distributed = (plan.use_distributed_optimizer if plan.use_distributed_optimizer is not None
                   else spec.use_distributed_optimizer)
    device_s = emulated_device_times(profiles, spec.emulation_profile, setup.model_config,
                                     plan, cluster, setup.run.data.seq_length, dtype)
    return ParallelSetup(setup, cluster, plan, dtype, distributed, device_s, profiles)


def emulated_device_times(profiles: Optional[Mapping[str, "Profile"]],
                          profile_path: Optional[str], model: ModelConfig, plan: ParallelPlan,
                          cluster: ClusterSpec, seq_length: int,
                          dtype: str) -> dict[int, tuple[float, float]]:
    """EMULATION: each emulated rank's stage (forward, backward) seconds per micro-batch on
    this host from :func:`host_profiles` (read from ``profile_path``; the predictor's figures
    for the stage, TP communication excluded); empty without a profile. UserError when the
    cluster has no emulated rank or the profile lacks the stage's shape or dtype."""
    if not profiles:
        return {}
    from megatron_het.perf.cost_model import LayerShape
    from megatron_het.perf.stage_cost import HOST_PROFILE, ProfileChoice, stage_compute

    profile = profiles[HOST_PROFILE]
    times: dict[int, tuple[float, float]] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            spec = cluster.accelerator_of(stage.ranks[0])
            if not spec.emulated:
                continue
            shape = LayerShape.of(model, seq_length, plan.micro_batch_size, stage.tp)
            compute = stage_compute(model, spec, shape, stage.num_layers, stage.has_embedding,
                                    stage.has_head, stage.recompute, dtype,
                                    ProfileChoice(profile))
            if "roofline" in compute.source:
                raise UserError(f"--emulation-profile {profile_path}: no {dtype} figures for "
                                f"the stage on ranks {list(stage.ranks)} ({compute.source}); "
                                f"profile this model's shape with tools/profile_device.py "
                                f"--threads 1 --dtype {dtype}")
            for rank in stage.ranks:
                times[rank] = (compute.forward_s, compute.backward_s)
    if not times:
        raise UserError(f"--emulation-profile times emulated accelerator kinds, and cluster "
                        f"{cluster.name} has none; drop the flag")
    return times


def describe_plan(psetup: ParallelSetup) -> str:
    """The plan, one line per stage: accelerator (labelled), TP, layers, ranks."""
    plan = psetup.plan
    lines = [f"> plan: dp={plan.dp_size}, micro_batch_size={plan.micro_batch_size}, global "
             f"batch {plan.global_batch_size}"]
    for p, pipeline in enumerate(plan.pipelines):
        lines.append(f"  pipeline {p}: {pipeline.micro_batches} micro-batches per iteration")
        for s, stage in enumerate(pipeline.stages):
            label = psetup.accelerator(stage.ranks[0]).label
            extras = "".join([" +embedding" if stage.has_embedding else "",
                              " +head" if stage.has_head else ""])
            lines.append(f"    stage {s}: {label}, tp={stage.tp}, "
                         f"{stage.num_layers} layer{'s' if stage.num_layers != 1 else ''} "
                         f"[{stage.layers[0]}, {stage.layers[1]})"
                         f"{extras}, ranks {list(stage.ranks)}")
    return "\n".join(lines)


def describe_device_times(psetup: ParallelSetup) -> str:
    """One line: the profile that times the emulated ranks, and each rank's figures."""
    ranks = "; ".join(f"rank {rank} {psetup.accelerator(rank).slowdown:g} x "
                      f"({fwd * 1e3:.1f} + {bwd * 1e3:.1f}) ms"
                      for rank, (fwd, bwd) in sorted(psetup.emulated_device_s.items()))
    return (f"> EMULATION: stage compute of emulated ranks timed from profile "
            f"{psetup.run.parallel.emulation_profile} (slowdown x forward + backward per "
            f"micro-batch): {ranks}")


def dry_run(run: RunConfig, out: TextIO) -> None:
    """Validate everything without processes; print the plan and its predicted iteration time."""
    from megatron_het.perf import predict

    psetup = prepare_parallel_run(run, world_size=None)
    config, train = psetup.setup.model_config, psetup.run.train
    prediction = predict(config, psetup.plan, psetup.cluster, psetup.run.data.seq_length,
                         psetup.host_profiles, dtype=psetup.dtype,
                         use_distributed_optimizer=psetup.use_distributed_optimizer)
    print(f"> dry run: model {config.name} ({config.num_parameters() / 1e6:.2f}M parameters, "
          f"{config.num_layers} layers) on cluster {psetup.cluster.name} "
          f"({psetup.cluster.world_size} ranks), {psetup.dtype}, global batch "
          f"{train.global_batch_size} = {train.micro_batch_size} x "
          f"{train.global_batch_size // train.micro_batch_size} micro-batches", file=out)
    print(describe_plan(psetup), file=out)
    if psetup.emulated_device_s:
        print(describe_device_times(psetup), file=out)
    print("> predicted (roofline/profile estimate):", file=out)
    print(prediction.table(), file=out)
    print(f"> predicted iteration time: {prediction.iteration_time_s:.4f} s; plan, cluster, "
          "model and batch are consistent", file=out, flush=True)
