"""Parity with megatron-core itself at TP 2 and at PP 2, in a two-rank gloo world: megatron-core's
GPTModel (local spec, RMSNorm, SwiGLU, RoPE, GQA, untied head), split over the ranks and moved
off its init, saves its own files, Megatron-LM's legacy ``mp_rank_*`` folders (one file per
rank) and megatron-core's ``dist_checkpointing`` torch_dist directory; each converts to a model
of ours with megatron-core's full-vocabulary logits. Ours exported at that TP or PP degree loads
into megatron-core's split model, legacy files by ``load_state_dict(strict=True)`` on each rank
and torch_dist by ``dist_checkpointing.load`` (strict), with our logits.

One launch of the workers runs megatron-core for every layout and format and returns its
logits; the conversions and our models run in the test process. The workers gather the logits
themselves (megatron-core's own gather allocates on CUDA) and pass a pipeline stage's output to
the next stage by a gloo send.
"""

from __future__ import annotations

import argparse
import pathlib

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (requirements.txt)")
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.models.gpt import GPTModel

from megatron_het import load_pretrained
from megatron_het.checkpoint.megatron_lm import RANK_FILE, load_rank_file, rank_dir_name
from tests.distributed.harness import run_ranks
from tests.unit.test_megatron_lm_dist import convert, mcore_save, save_ours
from tests.unit.test_megatron_lm_parity import (
    PADDED,
    SEQ,
    TOKENS,
    VOCAB,
    H,
    cpu_forward,
    megatron_args,
    megatron_model,
    model_parallel,
)

# layout name -> (TP, PP) over the two ranks
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
FORMATS = ("torch", "torch_dist")
MCORE_ITERATION, OUR_ITERATION = 20, 4  # OUR_ITERATION: the one save_ours writes


def _perturb(model: GPTModel, seed: int) -> None:
    """Moves every weight off its init: TP-split weights by different noise on each TP rank,
    replicated ones (the norms) by the same noise on every TP rank of a stage."""
    stage = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    replicated = torch.Generator().manual_seed(seed + 100 * stage)
    split = torch.Generator().manual_seed(seed + 100 * stage + 1 + tp_rank)
    with torch.no_grad():
        for param in model.parameters():
            noise = split if getattr(param, "tensor_model_parallel", False) else replicated
            param.add_(torch.randn(param.shape, generator=noise) * 0.05)


def _full_logits(model: GPTModel) -> torch.Tensor | None:
    """megatron-core's logits ``[B, S, VOCAB]`` on TOKENS on the first TP rank of the last
    stage, None elsewhere. Collective over the world: a stage receives its input from the
    previous stage and sends its output ``[S, B, H]`` to the next; the last stage all-gathers
    its vocabulary shards over the TP group."""
    if not parallel_state.is_pipeline_first_stage():
        hidden = torch.empty(SEQ, TOKENS.shape[0], H)
        dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = cpu_forward(model, TOKENS)
    if not parallel_state.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    group = parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, out.contiguous(), group=group)
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return None
    return torch.cat(shards, dim=-1)[..., :VOCAB]


def _args(tp: int, pp: int, ckpt_format: str) -> argparse.Namespace:
    args = megatron_args(tied=False)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.padded_vocab_size = PADDED * tp
    args.ckpt_format = ckpt_format
    return args


def _rank_dir(pp: int) -> str:
    """This rank's ``mp_rank_*`` folder name in a legacy save at PP ``pp``."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return rank_dir_name(tp_rank, parallel_state.get_pipeline_model_parallel_rank(), pp)


def _save_legacy(model: GPTModel, root: pathlib.Path, tp: int, pp: int) -> None:
    """Each rank writes its own ``iter_*/mp_rank_*/model_optim_rng.pt``; rank 0 the tracker."""
    rank_dir = root / f"iter_{MCORE_ITERATION:07d}" / _rank_dir(pp)
    rank_dir.mkdir(parents=True)
    payload = {
        "args": _args(tp, pp, "torch"),
        "checkpoint_version": 3.0,
        "iteration": MCORE_ITERATION,
        "model": model.state_dict_for_save_checkpoint(),
    }
    torch.save(payload, rank_dir / RANK_FILE)
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(MCORE_ITERATION))


def _save_dist(model: GPTModel, root: pathlib.Path, tp: int, pp: int) -> None:
    state = {
        "args": _args(tp, pp, "torch_dist"),
        "checkpoint_version": 3.0,
        "iteration": MCORE_ITERATION,
        "model": model.sharded_state_dict(),
    }
    mcore_save(state, root / f"iter_{MCORE_ITERATION:07d}")
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(MCORE_ITERATION))


def _load_ours(root: pathlib.Path, pp: int, ckpt_format: str) -> GPTModel:
    """A fresh megatron-core model of this rank holding our export under ``root``."""
    model = megatron_model(tied=False)
    directory = root / f"iter_{OUR_ITERATION:07d}"
    if ckpt_format == "torch":
        state = load_rank_file(directory / _rank_dir(pp) / RANK_FILE)["model"]
    else:
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = dist_checkpointing.load(
                {"model": model.sharded_state_dict()},
                str(directory),
                strict=StrictHandling.RAISE_ALL,
            )["model"]
    model.load_state_dict(state, strict=True)
    return model


def _megatron_core_worker(rank: int, world_size: int, root: pathlib.Path) -> dict:
    """For every layout: megatron-core's logits (``LAYOUT/mcore``) and its saves, and its logits
    with our exports loaded (``LAYOUT/back_FORMAT``), keyed where this rank holds them."""
    logits = {}
    for layout, (tp, pp) in LAYOUTS.items():
        with model_parallel(tp, pp):
            torch.manual_seed(5)  # the same init on every rank, split by megatron-core
            model = megatron_model(tied=False)
            _perturb(model, seed=5)
            logits[f"{layout}/mcore"] = _full_logits(model)
            _save_legacy(model, root / layout / "mcore_torch", tp, pp)
            _save_dist(model, root / layout / "mcore_torch_dist", tp, pp)
            for fmt in FORMATS:
                loaded = _load_ours(root / layout / f"ours_{fmt}", pp, fmt)
                logits[f"{layout}/back_{fmt}"] = _full_logits(loaded)
    return {key: value for key, value in logits.items() if value is not None}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[pathlib.Path, dict[str, torch.Tensor], torch.nn.Module]:
    """(the run's directory, megatron-core's logits by key, our model) after our model's
    exports at every layout and one launch of the workers."""
    root = tmp_path_factory.mktemp("megatron_core")
    ours = save_ours(root, tied=False)
    for layout, (tp, pp) in LAYOUTS.items():
        degrees = ["--target-tensor-parallel-size", str(tp)]
        degrees += ["--target-pipeline-parallel-size", str(pp)]
        for fmt in FORMATS:
            target = root / layout / f"ours_{fmt}"
            convert(
                "megatron_het", "megatron", root / "ours", target, "--ckpt-format", fmt, *degrees
            )
    # Spawned: megatron-core hangs or crashes setting up its model-parallel state in a fork of
    # a process that set it up before (the unit tests' one-rank world, in the same worker).
    per_rank = run_ranks(_megatron_core_worker, 2, root, timeout=60, start_method="spawn")
    logits = {key: value for held in per_rank for key, value in held.items()}
    return root, logits, ours


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_core_save_converts_to_ours(runs, layout: str, fmt: str) -> None:
    root, logits, _ = runs
    convert("megatron", "megatron_het", root / layout / f"mcore_{fmt}", root / layout / f"to_{fmt}")
    ours = load_pretrained(str(root / layout / f"to_{fmt}"))
    assert ours.config.vocab_size == VOCAB and not ours.config.tie_embeddings
    with torch.no_grad():
        got = ours(TOKENS)
    torch.testing.assert_close(got, logits[f"{layout}/mcore"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ours_loads_into_split_megatron_core(runs, layout: str, fmt: str) -> None:
    _, logits, ours = runs
    with torch.no_grad():
        want = ours(TOKENS)
    torch.testing.assert_close(logits[f"{layout}/back_{fmt}"], want, rtol=0, atol=1e-4)
