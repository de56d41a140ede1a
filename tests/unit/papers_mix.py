"""The HETHUB mix's homogeneous baseline, computed once for every test that needs it (the
per-kind searches over 768 devices take tens of seconds)."""

from __future__ import annotations

import functools
import pathlib

from megatron_het.cluster import ClusterSpec
from megatron_het.config import ModelConfig, model_preset
from megatron_het.planner.baseline import homogeneous_baseline
from megatron_het.planner.result import HomogeneousBaseline

REPO = pathlib.Path(__file__).resolve().parents[2]


def papers_cluster() -> ClusterSpec:
    return ClusterSpec.load(REPO / "scripts/clusters/hethub_llama140b.yaml")


def papers_model() -> ModelConfig:
    return model_preset("llama-140b")


@functools.lru_cache(maxsize=1)
def papers_baseline() -> HomogeneousBaseline:
    """The baseline of Llama-140B at global batch 1024, sequence 4096 (per-kind top 2)."""
    return homogeneous_baseline(papers_model(), papers_cluster(), 1024, 4096, top_k=2)
