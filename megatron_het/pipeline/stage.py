"""Build the part of the model that one rank holds: its stage's layers, sharded over its TP group.

The stage is a :class:`~megatron_het.model.llama.LlamaModel` restricted to the stage's layer
range (with the embedding on the first stage and the head on the last, as the plan says), built
on the meta device and then given its values: each parameter (or TP shard of it) is drawn from
the layout-independent initialisation, so it equals the matching slice of the single-process
model of the same seed, whatever the plan. Nothing here communicates.
"""

from __future__ import annotations

import torch

from megatron_het.config import ModelConfig
from megatron_het.model.init import init_weights
from megatron_het.model.llama import LlamaModel
from megatron_het.parallel.plan import ParallelPlan
from megatron_het.parallel.process_groups import ProcessGroups
from megatron_het.tensor_parallel.apply import apply_tp


def build_stage(
    model_config: ModelConfig,
    plan: ParallelPlan,
    groups: ProcessGroups,
    seed: int,
    device: torch.device | str = "cpu",
) -> LlamaModel:
    """This rank's stage: layers ``role.stage_plan.layers`` with TP applied over ``groups.tp``
    (an interleaved pipeline's device group: the layers of all its stages, one model chunk each).

    Args:
        model_config: the whole model's shape.
        plan: the parallel plan (the stage comes from ``plan.rank_role(groups.rank)``).
        groups: this rank's groups; ``groups.tp`` must be the stage's TP group.
        seed: the run seed of the layout-independent initialisation.
        device: where the parameters live (float32: the optimizer keeps these values as
            master weights and casts the parameters to the training dtype).

    Returns a :class:`LlamaModel` (a ``TensorParallelLlamaModel`` when the stage's tp > 1)
    with global parameter names; with tied embeddings the last stage holds its own copy of
    (its TP slice of) ``embedding.weight``, kept equal to the first stage's copy by
    :func:`megatron_het.pipeline.stage_boundary.sync_tied_embedding_grads`.
    """
    role = plan.rank_role(groups.rank)
    stage = role.stage_plan
    if groups.tp.size != stage.tp or tuple(groups.tp.ranks) != tuple(sorted(stage.ranks)):
        raise ValueError(
            f"groups.tp has ranks {list(groups.tp.ranks)} but stage {role.stage} "
            f"of pipeline {role.pipeline} has ranks {list(stage.ranks)}"
        )
    chunks = [
        (
            c.layers[0],
            c.layers[1],
            c.recompute if c.recompute_num_layers is None else c.recompute_num_layers,
        )
        for c in role.chunk_plans
    ]
    with torch.device("meta"):
        model = LlamaModel(
            model_config,
            has_embedding=role.is_first_stage,
            has_head=role.is_last_stage,
            chunks=chunks,
        )
    if stage.tp == 1:
        model.to_empty(device=device)
        init_weights(model, seed)
        return model
    # Shards drawn from the seed land on the CPU (the meta model has no device of its own).
    apply_tp(
        model,
        groups.tp,
        model_config,
        seed=seed,
        sequence_parallel=bool(plan.sequence_parallel),
        tp_comm_overlap=bool(plan.tp_comm_overlap),
    )
    return model.to(device)
