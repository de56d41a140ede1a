"""The mixed pair's cluster and plan files (``scripts/gpu_check/``) and their validation.

``h200_cpu_pair.yaml`` puts rank 0 on the H200 and rank 1 on the host CPU of the same node.
``pair_pp2.json`` splits a 4-layer model across the kinds (embedding and layers 0-1 on the GPU,
layers 2-3 and the head on the CPU); ``pair_dp2.json`` is two one-stage pipelines of different
kinds, each holding the whole model (data parallelism across the kinds). Both have global batch
8 (micro-batch 2). For another first kind (``cpu``, to exercise the check without a GPU) the
files are rewritten with that kind into a work directory.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig
from megatron_het.fileio import read_yaml_mapping
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.plan_validation import validate
from tools.gpu_check.context import DATA_DIR

CLUSTER_FILE = DATA_DIR / "h200_cpu_pair.yaml"
PP_PLAN_FILE = DATA_DIR / "pair_pp2.json"
DP_PLAN_FILE = DATA_DIR / "pair_dp2.json"
FILE_KIND = "H200"  # the first kind the files name
GLOBAL_BATCH = 8
MICRO_BATCH = 2


@dataclass(frozen=True)
class PairFiles:
    """Paths of the pair's cluster file and its two plans."""

    cluster: pathlib.Path
    pp_plan: pathlib.Path
    dp_plan: pathlib.Path


def pair_files(first_kind: str, work: pathlib.Path) -> PairFiles:
    """The files for a pair whose rank 0 is ``first_kind``: the data files themselves for the
    H200, else copies with the kind replaced, written under ``work``."""
    if first_kind.lower() == FILE_KIND.lower():
        return PairFiles(CLUSTER_FILE, PP_PLAN_FILE, DP_PLAN_FILE)
    work.mkdir(parents=True, exist_ok=True)
    cluster = read_yaml_mapping(CLUSTER_FILE, "cluster file")
    for group in cluster["node_groups"]:
        if str(group["accelerator"]).lower() == FILE_KIND.lower():
            group["accelerator"] = first_kind
    cluster_path = work / f"{first_kind}_cpu_pair.yaml"
    cluster_path.write_text(json.dumps(cluster, indent=1) + "\n")  # JSON is YAML
    paths = [cluster_path]
    for source in (PP_PLAN_FILE, DP_PLAN_FILE):
        plan = json.loads(source.read_text())
        _replace_kind(plan, first_kind)
        target = work / source.name
        target.write_text(json.dumps(plan, indent=1) + "\n")
        paths.append(target)
    return PairFiles(*paths)


def _replace_kind(plan: dict[str, Any], kind: str) -> None:
    for pipeline in plan["pipelines"]:
        for stage in pipeline["stages"]:
            if str(stage["accelerator"]).lower() == FILE_KIND.lower():
                stage["accelerator"] = kind


def load_and_validate(
    files: PairFiles, model: ModelConfig
) -> tuple[ClusterSpec, ParallelPlan, ParallelPlan]:
    """Load the cluster and both plans with the project's loaders and validate each plan
    against ``model``, the cluster and the global batch; UserError names the first problem."""
    cluster = ClusterSpec.load(files.cluster)
    plans = []
    for path in (files.pp_plan, files.dp_plan):
        plan = ParallelPlan.load(path)
        validate(plan, model, cluster, GLOBAL_BATCH)
        plans.append(plan)
    return cluster, plans[0], plans[1]
