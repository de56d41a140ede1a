"""The parallel plan: which ranks run which layers, with which TP degree, on which accelerator.

A plan is a list of pipelines. Each pipeline is one data-parallel (DP) replica of the whole model
with its own share of the micro-batches of every iteration; its stages run in order, each holding
a half-open range ``[start, end)`` of global decoder-layer indices. The embedding sits on the
first stage of every pipeline and the output head on the last. The ranks of a stage are its
tensor-parallel (TP) group, listed in tp_rank order, so ``ranks[t]`` has tp_rank ``t``.

A bound may also fall inside a layer, between its attention block (input norm, attention) and
its MLP block (post-attention norm, MLP): ``x.5`` is that point of layer ``x``. A stage
``[20, 21.5)`` holds layer 20 and the attention block of layer 21; the next stage
``[21.5, 24)`` holds layer 21's MLP block and layers 22 and 23. Such half-layer bounds let
stages of devices with different speeds balance more finely than whole layers allow.

Interleaving (virtual pipeline stages, as Megatron-LM's): the same ``ranks`` may appear on several
stages of a pipeline. Those stages are model chunks of one DEVICE GROUP, which runs them with the
interleaved 1F1B schedule. Device groups are numbered in order of first appearance (the pipeline
rank, 0 .. pp_size-1) and host the chunks round-robin: stage ``i`` runs on group ``i % pp_size``,
and every group holds ``num_chunks`` stages. Layer counts may differ per chunk, kind and TP per
group. A pipeline whose stages all have distinct ranks is the plain (non-interleaved) case,
``num_chunks == 1``.

JSON form ("megatron_het.plan/1")::

    {"format": "megatron_het.plan/1", "micro_batch_size": 2,
     "pipelines": [{"micro_batches": 4, "stages": [
         {"accelerator": "emu-fast", "tp": 2, "layers": [0, 1], "ranks": [0, 1]},
         {"accelerator": "emu-slow", "tp": 1, "layers": [1, 3], "ranks": [2]},
         {"accelerator": "emu-slow", "tp": 1, "layers": [3, 4], "ranks": [3]}]}]}

Optional keys: ``description``, ``dtype`` (fp32 | bf16 | fp16), ``use_distributed_optimizer``,
``sequence_parallel``, ``tp_comm_overlap``, ``overlap_grad_reduce``, ``overlap_param_gather``,
``grad_reduce_in_bf16`` and ``overlap_p2p_comm`` on the plan (true or false, like Megatron's
flags of those names; absent: the command line decides; a flag given that says otherwise is an
error, :mod:`megatron_het.arguments.options`), ``recompute`` on a stage (true:
every decoder layer's activations are recomputed in backward, only its input kept) and with
it ``recompute_num_layers`` (Megatron-LM's block method: only the stage's first N layers
are). Unknown keys are refused.

Loading checks types only (and that ``grad_reduce_in_bf16`` does not come with a dtype other
than bf16); :func:`megatron_het.parallel.plan_validation.validate` checks that the
plan is consistent and fits a model and a cluster. The queries below assume a validated plan.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_het.errors import UserError
from megatron_het.fileio import read_json_file
from megatron_het.parallel.stage_plan import (
    LayerBound,
    PipelinePlan,
    RankRole,
    StagePlan,
)

PLAN_FORMAT = "megatron_het.plan/1"
PLAN_DTYPES = ("fp32", "bf16", "fp16")
_PLAN_KEYS = (
    "format",
    "micro_batch_size",
    "pipelines",
    "description",
    "dtype",
    "use_distributed_optimizer",
    "sequence_parallel",
    "tp_comm_overlap",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "grad_reduce_in_bf16",
    "overlap_p2p_comm",
)
_PIPELINE_KEYS = ("micro_batches", "stages")
_STAGE_KEYS = ("accelerator", "tp", "layers", "ranks", "recompute", "recompute_num_layers")


@dataclass(frozen=True)
class ParallelPlan:
    """The whole plan: micro-batch size and the pipelines (DP replicas).

    ``dtype``, ``use_distributed_optimizer``, ``sequence_parallel``, ``tp_comm_overlap``,
    ``overlap_grad_reduce``, ``overlap_param_gather``, ``grad_reduce_in_bf16`` and
    ``overlap_p2p_comm`` (interleaved pipelines overlap their transfers with compute;
    Megatron-LM's default, on) are None when the plan leaves them to
    the command line (a run resolves ``sequence_parallel`` and ``tp_comm_overlap`` into its
    plan). The global batch is
    ``micro_batch_size`` times the sum of the pipelines' micro-batch counts.
    """

    micro_batch_size: int
    pipelines: tuple[PipelinePlan, ...]
    dtype: str | None = None
    use_distributed_optimizer: bool | None = None
    description: str = ""
    sequence_parallel: bool | None = None
    overlap_grad_reduce: bool | None = None
    grad_reduce_in_bf16: bool | None = None
    overlap_p2p_comm: bool | None = None
    overlap_param_gather: bool | None = None
    tp_comm_overlap: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "pipelines", tuple(self.pipelines))

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """The number of ranks the plan places (each rank once in a valid plan)."""
        return sum(len(p.ranks) for p in self.pipelines)

    @property
    def dp_size(self) -> int:
        return len(self.pipelines)

    @property
    def global_batch_size(self) -> int:
        """Sequences per iteration over all pipelines."""
        return self.micro_batch_size * sum(p.micro_batches for p in self.pipelines)

    def pp_size(self, pipeline: int = 0) -> int:
        return self.pipelines[pipeline].pp_size

    def ranks(self) -> tuple[int, ...]:
        """Every rank the plan places, ascending."""
        return tuple(sorted(rank for p in self.pipelines for rank in p.ranks))

    # ---- rank queries ---------------------------------------------------------------------
    def rank_role(self, rank: int) -> RankRole:
        """The pipeline, stage and tp_rank of ``rank``; UserError if the plan does not place it."""
        for p, pipeline in enumerate(self.pipelines):
            for g, ranks in enumerate(pipeline.device_groups):
                if rank in ranks:
                    chunks = pipeline.group_stages(g)
                    plans = tuple(pipeline.stages[s] for s in chunks)
                    return RankRole(p, chunks[0], ranks.index(rank), plans[0], chunks, plans)
        raise UserError(
            f"rank {rank} is on no stage of the plan; add it to a stage's ranks or "
            f"launch {self.world_size} ranks"
        )

    def describe(self) -> str:
        """A few human-readable lines: one per stage, with its ranks and layers."""
        lines = [
            f"plan: dp={self.dp_size} micro_batch_size={self.micro_batch_size} "
            f"global_batch_size={self.global_batch_size}"
            + (" sequence_parallel" if self.sequence_parallel else "")
            + (" tp_comm_overlap" if self.tp_comm_overlap else "")
        ]
        for p, pipeline in enumerate(self.pipelines):
            interleave = (
                f", {pipeline.num_chunks} interleaved chunks on each of "
                f"{pipeline.pp_size} device groups"
                if pipeline.interleaved
                else ""
            )
            lines.append(f"  pipeline {p}: {pipeline.micro_batches} micro-batches{interleave}")
            for s, st in enumerate(pipeline.stages):
                extras = "".join(
                    [
                        " +embedding" if st.has_embedding else "",
                        " +head" if st.has_head else "",
                        f" {st.recompute_label}" if st.recompute else "",
                    ]
                )
                lines.append(
                    f"    stage {s}: {st.accelerator} tp={st.tp} ranks="
                    f"{list(st.ranks)} layers {st.layers_label}{extras}"
                )
        return "\n".join(lines)

    # ---- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON form; optional keys appear only when set."""
        out: dict[str, Any] = {"format": PLAN_FORMAT}
        if self.description:
            out["description"] = self.description
        out["micro_batch_size"] = self.micro_batch_size
        if self.dtype is not None:
            out["dtype"] = self.dtype
        if self.use_distributed_optimizer is not None:
            out["use_distributed_optimizer"] = self.use_distributed_optimizer
        if self.sequence_parallel is not None:
            out["sequence_parallel"] = self.sequence_parallel
        if self.tp_comm_overlap is not None:
            out["tp_comm_overlap"] = self.tp_comm_overlap
        if self.overlap_grad_reduce is not None:
            out["overlap_grad_reduce"] = self.overlap_grad_reduce
        if self.overlap_param_gather is not None:
            out["overlap_param_gather"] = self.overlap_param_gather
        if self.grad_reduce_in_bf16 is not None:
            out["grad_reduce_in_bf16"] = self.grad_reduce_in_bf16
        if self.overlap_p2p_comm is not None:
            out["overlap_p2p_comm"] = self.overlap_p2p_comm
        out["pipelines"] = [
            {"micro_batches": p.micro_batches, "stages": [_stage_to_dict(s) for s in p.stages]}
            for p in self.pipelines
        ]
        return out

    def save(self, path: str | Path) -> None:
        """Write the JSON form to ``path`` (overwrites)."""
        Path(path).write_text(dumps_plan(self) + "\n")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ParallelPlan:
        """Parse the JSON form; wrong keys or types raise a one-line UserError."""
        return _parse_plan(d)

    @classmethod
    def load(cls, source: str | Path | Mapping[str, Any]) -> ParallelPlan:
        """Load a plan from a JSON file path or from an already-parsed mapping."""
        if isinstance(source, Mapping):
            return _parse_plan(source)
        path = Path(source)
        data = read_json_file(path, f"plan file {path}", "pass an existing --plan path")
        try:
            return _parse_plan(data)
        except UserError as exc:
            raise UserError(f"{path}: {exc}") from None


def dumps_plan(plan: ParallelPlan) -> str:
    """The JSON text of a plan: one key or stage per line (diff-friendly)."""
    d = plan.to_dict()
    pipelines = d.pop("pipelines")
    lines = [f"  {json.dumps(key)}: {json.dumps(value)}," for key, value in d.items()]
    blocks = []
    for p in pipelines:
        stages = ",\n      ".join(json.dumps(s) for s in p["stages"])
        blocks.append(f'{{"micro_batches": {p["micro_batches"]}, "stages": [\n      {stages}]}}')
    lines.append('  "pipelines": [\n    ' + ",\n    ".join(blocks) + "]")
    return "{\n" + "\n".join(lines) + "\n}"


def _stage_to_dict(stage: StagePlan) -> dict[str, Any]:
    out: dict[str, Any] = {
        "accelerator": stage.accelerator,
        "tp": stage.tp,
        "layers": list(stage.layers),
        "ranks": list(stage.ranks),
    }
    if stage.recompute:
        out["recompute"] = True
    if stage.recompute_num_layers is not None:
        out["recompute_num_layers"] = stage.recompute_num_layers
    return out


# ---- parsing (types and keys only) -------------------------------------------------------
def _check_keys(where: str, d: Any, known: Sequence[str], required: Sequence[str]) -> None:
    if not isinstance(d, Mapping):
        raise UserError(f"{where}: expected a JSON object with keys {', '.join(required)}")
    unknown = [str(k) for k in d if k not in known]
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(known)}")
    missing = [k for k in required if k not in d]
    if missing:
        raise UserError(f"{where}: missing key {missing[0]!r}")


def _int(where: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{where}: {key} must be an integer, got {value!r}")
    return value


def _layer_bound(where: str, value: Any) -> LayerBound:
    """A layer bound: an integer, or a number ending in .5 (a half-layer bound)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or 2 * value != int(2 * value)
    ):
        raise UserError(
            f"{where}: layers must be [first, end) as two integers, or numbers "
            f"ending in .5 for a bound between a layer's attention and MLP blocks; "
            f"got {value!r}"
        )
    return value  # StagePlan keeps a whole bound as an int


def _bool(where: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _parse_stage(where: str, d: Any) -> StagePlan:
    _check_keys(where, d, _STAGE_KEYS, ("accelerator", "tp", "layers", "ranks"))
    if not isinstance(d["accelerator"], str) or not d["accelerator"]:
        raise UserError(
            f'{where}: accelerator must be a kind name such as "H100", got {d["accelerator"]!r}'
        )
    layers = d["layers"]
    if not isinstance(layers, list) or len(layers) != 2:
        raise UserError(
            f"{where}: layers must be [first, end) as two integers (or numbers "
            f"ending in .5), got {layers!r}"
        )
    ranks = d["ranks"]
    if not isinstance(ranks, list):
        raise UserError(f"{where}: ranks must be a list of integers, got {ranks!r}")
    recompute = _bool(where, "recompute", d.get("recompute", False))
    count = d.get("recompute_num_layers")
    if count is not None:
        count = _int(where, "recompute_num_layers", count)
        if count < 1 or not recompute:
            raise UserError(
                f"{where}: recompute_num_layers (the first N layers recomputed) "
                f'needs "recompute": true and N >= 1, got {count} with recompute '
                f"{str(recompute).lower()}"
            )
    return StagePlan(
        accelerator=d["accelerator"],
        tp=_int(where, "tp", d["tp"]),
        layers=(_layer_bound(where, layers[0]), _layer_bound(where, layers[1])),
        ranks=tuple(_int(where, "ranks", r) for r in ranks),
        recompute=recompute,
        recompute_num_layers=count,
    )


def _parse_pipeline(index: int, d: Any) -> PipelinePlan:
    where = f"pipeline {index}"
    _check_keys(where, d, _PIPELINE_KEYS, _PIPELINE_KEYS)
    stages = d["stages"]
    if not isinstance(stages, list) or not stages:
        raise UserError(f"{where}: stages must be a non-empty list of stages")
    return PipelinePlan(
        micro_batches=_int(where, "micro_batches", d["micro_batches"]),
        stages=tuple(_parse_stage(f"stage {s} of {where}", st) for s, st in enumerate(stages)),
    )


def _parse_plan(d: Any) -> ParallelPlan:
    _check_keys("plan", d, _PLAN_KEYS, ("format", "micro_batch_size", "pipelines"))
    if d["format"] != PLAN_FORMAT:
        raise UserError(f"plan: format must be {PLAN_FORMAT!r}, got {d['format']!r}")
    pipelines = d["pipelines"]
    if not isinstance(pipelines, list) or not pipelines:
        raise UserError("plan: pipelines must be a non-empty list (one per data-parallel replica)")
    dtype = d.get("dtype")
    if dtype is not None and dtype not in PLAN_DTYPES:
        raise UserError(f"plan: dtype must be one of {', '.join(PLAN_DTYPES)}, got {dtype!r}")
    options = {
        key: None if d.get(key) is None else _bool("plan", key, d[key])
        for key in (
            "use_distributed_optimizer",
            "sequence_parallel",
            "tp_comm_overlap",
            "overlap_grad_reduce",
            "overlap_param_gather",
            "grad_reduce_in_bf16",
            "overlap_p2p_comm",
        )
    }
    if options["grad_reduce_in_bf16"] and dtype not in (None, "bf16"):
        raise UserError(
            f"plan: grad_reduce_in_bf16 needs bf16 training but dtype is {dtype}; "
            'set "dtype": "bf16" or drop grad_reduce_in_bf16'
        )
    if options["tp_comm_overlap"] and options["sequence_parallel"] is False:
        raise UserError(
            "plan: tp_comm_overlap overlaps sequence parallelism's all-gathers and "
            "reduce-scatters but sequence_parallel is false; set it true or drop "
            "tp_comm_overlap"
        )
    if options["overlap_param_gather"] and options["use_distributed_optimizer"] is False:
        raise UserError(
            "plan: overlap_param_gather overlaps the distributed optimizer's "
            "all-gather but use_distributed_optimizer is false; set it true or drop "
            "overlap_param_gather"
        )
    description = d.get("description", "")
    if not isinstance(description, str):
        raise UserError(f"plan: description must be a string, got {description!r}")
    return ParallelPlan(
        micro_batch_size=_int("plan", "micro_batch_size", d["micro_batch_size"]),
        pipelines=tuple(_parse_pipeline(i, p) for i, p in enumerate(pipelines)),
        dtype=dtype,
        description=description,
        **options,
    )
