"""Adam's state across Megatron-LM's torch_dist format, against megatron-core's own optimizer
code: a GPTModel trained two steps with megatron-core's param groups and torch's AdamW (the
optimizer megatron-core runs without Apex or Transformer Engine), saved through megatron-core's
``FP32Optimizer.sharded_state_dict`` as Megatron-LM's trainer saves it, converts here with
``--with-optimizer``; the third step taken here from that state moves the model exactly as
megatron-core's third step does, and a fresh optimizer would not. Ours exported with its
optimizer loads back into megatron-core's optimizer (strict) and takes the same next step.

megatron-core's optimizer classes allocate CUDA tensors in their constructors, so the test
builds ``FP32Optimizer`` around the AdamW without calling its constructor: its state-dict
methods, the code under test, only use the wrapped optimizer.
"""

from __future__ import annotations

import argparse
import pathlib
import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (requirements.txt)")
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.optimizer import OptimizerConfig, _get_param_groups
from megatron.core.optimizer.optimizer import FP32Optimizer

from megatron_het import load_pretrained
from megatron_het.checkpoint.io import resolve_checkpoint_dir
from megatron_het.checkpoint.megatron_lm import write_megatron_checkpoint
from megatron_het.checkpoint.megatron_lm_files import load_pickled
from megatron_het.checkpoint.megatron_lm_optim import (
    MegatronOptimizerState,
    TrainingRun,
    dist_optimizer_extras,
)
from megatron_het.checkpoint.reader import full_optimizer_state, load_train_state
from megatron_het.errors import UserError
from megatron_het.model.llama import build_model
from tests.unit.test_megatron_lm_dist import convert, mcore_save
from tests.unit.test_megatron_lm_parity import (
    TOKENS,
    VOCAB,
    _cpu_rope,
    cpu_forward,
    megatron_args,
    megatron_model,
    our_config,
)
from tests.unit.test_megatron_lm_parity import megatron_world as megatron_world  # a fixture

pytestmark = pytest.mark.slow  # megatron-core takes seconds to import

LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8
ITERATION = 2


def megatron_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of megatron-core's model on CPU (see test_megatron_lm_parity)."""
    model.rotary_pos_emb.get_emb = types.MethodType(_cpu_rope, model.rotary_pos_emb)
    seq = tokens.shape[1]
    positions = torch.arange(seq).expand_as(tokens)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    logits = model(tokens, positions, attention_mask=mask)[:, :-1, :VOCAB]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def our_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)[:, :-1, :VOCAB]  # a run's model may hold padded rows
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def adamw(groups: list[dict]) -> torch.optim.AdamW:
    """torch's AdamW over megatron-core's param groups, each group's weight decay and LR set
    as Megatron-LM's scheduler sets them (``wd_mult``, ``lr_mult``)."""
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for group in optimizer.param_groups:
        group["weight_decay"] = WD * group["wd_mult"]
        group["lr"] = LR * group["lr_mult"]
    return optimizer


def megatron_optimizer(model) -> FP32Optimizer:
    config = OptimizerConfig(optimizer="adam", lr=LR, min_lr=LR, weight_decay=WD, bf16=False)
    wrapper = FP32Optimizer.__new__(FP32Optimizer)
    wrapper.optimizer = adamw(_get_param_groups([model], config, None))
    wrapper.config = config

    def init_state(opt, config=None) -> None:  # megatron-core's Adam init_state_fn
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    wrapper.init_state_fn = init_state
    return wrapper


def step(model, optimizer: torch.optim.Optimizer, loss_of) -> None:
    optimizer.zero_grad()
    loss_of(model, TOKENS).backward()
    optimizer.step()


def trainer_state(model, optimizer: FP32Optimizer, tied: bool, loading: bool = False) -> dict:
    """The state dict Megatron-LM's trainer saves (or loads) as torch_dist."""
    args = megatron_args(tied)
    args.ckpt_format, args.consumed_train_samples = "torch_dist", 2 * ITERATION
    vars(args).update(  # the run's optimizer flags, as Megatron-LM records them
        lr=LR,
        min_lr=LR,
        lr_decay_style="constant",
        lr_warmup_iters=0,
        train_iters=10,
        global_batch_size=2,
        weight_decay=WD,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_eps=EPS,
    )
    model_state = model.sharded_state_dict()
    return {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=loading),
        "opt_param_scheduler": {"max_lr": LR, "num_steps": 2 * ITERATION},
        "num_floating_point_operations_so_far": 0,
    }


@pytest.fixture
def trained(tmp_path, megatron_world):
    """A GPTModel after two steps, saved with its optimizer at iteration 2."""
    torch.manual_seed(5)
    model = megatron_model(tied=False).train()
    optimizer = megatron_optimizer(model)
    for _ in range(ITERATION):
        step(model, optimizer.optimizer, megatron_loss)
    root = tmp_path / "mlm"
    mcore_save(trainer_state(model, optimizer, tied=False), root / f"iter_{ITERATION:07d}")
    (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    return model, optimizer, root


def next_logits_ours(directory: pathlib.Path, fresh: bool = False) -> torch.Tensor:
    """Our model from ``directory`` after one AdamW step on the test loss, from the saved
    optimizer state (or a fresh one)."""
    model = load_pretrained(str(directory)).train()
    named = dict(model.named_parameters())
    decay = [p for p in named.values() if p.ndim > 1]
    no_decay = [p for p in named.values() if p.ndim <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
    )
    if not fresh:
        saved = full_optimizer_state(resolve_checkpoint_dir(directory))["state"]
        for name, param in named.items():
            optimizer.state[param] = {k: v.clone() for k, v in saved[name].items()}
    step(model, optimizer, our_loss)
    with torch.no_grad():
        return model.eval()(TOKENS)[..., :VOCAB]


def test_megatron_optimizer_continues_here(tmp_path, trained) -> None:
    model, optimizer, root = trained
    convert("megatron", "megatron_het", root, tmp_path / "ours", "--with-optimizer")
    state = load_train_state(tmp_path / "ours")
    assert state is not None
    assert state["iteration"] == ITERATION and state["consumed_samples"] == 2 * ITERATION
    assert state["megatron_opt_param_scheduler"]["num_steps"] == 2 * ITERATION
    directory = resolve_checkpoint_dir(tmp_path / "ours")
    assert directory.name == f"iter_{ITERATION:07d}"
    steps = {int(e["step"]) for e in full_optimizer_state(directory)["state"].values()}
    assert steps == {ITERATION}

    step(model, optimizer.optimizer, megatron_loss)  # megatron-core's third step
    logits = cpu_forward(model.eval(), TOKENS)[..., :VOCAB]
    got = next_logits_ours(tmp_path / "ours")
    torch.testing.assert_close(got, logits, rtol=0, atol=2e-5)
    # A fresh optimizer moves the model elsewhere, so the comparison above can fail.
    assert (next_logits_ours(tmp_path / "ours", fresh=True) - logits).abs().max() > 1e-3


def test_optimizer_state_by_buffer_is_refused(tmp_path, megatron_world) -> None:
    # The distributed optimizer's default dp_reshardable layout: one tensor per gradient bucket
    # (its keys as megatron-core names them), the sharding type among the common values.
    model = megatron_model(tied=False)
    bucket = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32)"
    state = trainer_state(model, megatron_optimizer(model), tied=False)
    state["optimizer"] = {
        "param_state": {
            "exp_avg": ShardedTensor.from_rank_offsets(
                f"{bucket}.bucket_idx_0.exp_avg", torch.ones(8)
            )
        },
        "param_state_sharding_type": "dp_reshardable",
    }
    root = tmp_path / "mlm"
    mcore_save(state, root / f"iter_{ITERATION:07d}")
    (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    with pytest.raises(UserError) as info:
        convert("megatron", "megatron_het", root, tmp_path / "ours", "--with-optimizer")
    assert "gradient buckets (dp_reshardable)" in str(info.value)
    assert "--dist-ckpt-optim-fully-reshardable" in str(info.value)
    assert not (tmp_path / "ours").exists()
    # Without --with-optimizer the weights still convert.
    convert("megatron", "megatron_het", root, tmp_path / "weights")


def test_legacy_optimizer_is_refused(tmp_path) -> None:
    ours = build_model(our_config(False), seed=1)
    write_megatron_checkpoint(tmp_path / "mlm", ours.config, ours.state_dict(), 3)
    with pytest.raises(UserError) as info:
        convert("megatron", "megatron_het", tmp_path / "mlm", tmp_path / "ours", "--with-optimizer")
    assert "indexed by position" in str(info.value) and "torch_dist" in str(info.value)
    assert not (tmp_path / "ours").exists()


# Our run of megatron_model()'s shape and megatron_optimizer()'s hyperparameters (constant LR).
OUR_RUN = [
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    *("--vocab-size", str(VOCAB), "--num-layers", "2", "--hidden-size", "64"),
    *("--ffn-hidden-size", "96", "--num-attention-heads", "4", "--num-query-groups", "2"),
    *("--seq-length", "12", "--max-position-embeddings", "64", "--rotary-base", "10000"),
    *("--norm-epsilon", "1e-5", "--untie-embeddings-and-output-weights"),
    *("--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", str(ITERATION)),
    *("--lr", str(LR), "--min-lr", str(LR), "--lr-decay-style", "constant"),
    *("--lr-warmup-iters", "0", "--weight-decay", str(WD), "--adam-beta1", str(BETAS[0])),
    *("--adam-beta2", str(BETAS[1]), "--adam-eps", str(EPS), "--seed", "3", "--eval-iters", "0"),
]


def megatron_load(directory: pathlib.Path) -> tuple:
    """A fresh GPTModel and megatron-core optimizer loaded from the torch_dist ``directory``
    strictly, as Megatron-LM's trainer loads (its common values included)."""
    model = megatron_model(tied=False).train()
    optimizer = megatron_optimizer(model)
    model_state = model.sharded_state_dict()
    request = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True),
    }
    with torch.serialization.safe_globals([argparse.Namespace]):
        loaded = dist_checkpointing.load(request, str(directory), strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(loaded["model"], strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    return model, optimizer, loaded


def test_ours_with_optimizer_continues_in_megatron_core(tmp_path, megatron_world) -> None:
    import io

    from megatron_het.arguments import parse_run_config
    from megatron_het.training.run import pretrain_on_world

    # The one-rank gloo world megatron-core uses is the world our run trains on too.
    run = parse_run_config([*OUR_RUN, "--save", str(tmp_path / "ours")])
    pretrain_on_world(run, world_size=1, out=io.StringIO())
    convert(
        "megatron_het",
        "megatron",
        tmp_path / "ours",
        tmp_path / "mlm",
        *("--ckpt-format", "torch_dist", "--with-optimizer"),
    )
    model, optimizer, loaded = megatron_load(tmp_path / f"mlm/iter_{ITERATION:07d}")
    assert loaded["iteration"] == ITERATION
    assert loaded["args"].consumed_train_samples == 2 * ITERATION
    assert loaded["opt_param_scheduler"]["num_steps"] == 2 * ITERATION
    adam = optimizer.optimizer
    assert {float(s["step"]) for s in adam.state.values()} == {float(ITERATION)}
    for group in adam.param_groups:  # the hyperparameters came from our run, through the file
        assert (group["lr"], group["betas"], group["eps"]) == (LR, BETAS, EPS)
        assert group["weight_decay"] == WD * group["wd_mult"]
    step(model, adam, megatron_loss)
    want = cpu_forward(model.eval(), TOKENS)[..., :VOCAB]
    torch.testing.assert_close(next_logits_ours(tmp_path / "ours"), want, rtol=0, atol=2e-5)
    assert (next_logits_ours(tmp_path / "ours", fresh=True) - want).abs().max() > 1e-3


def test_our_optimizer_common_values_are_megatron_cores(trained) -> None:
    """The optimizer's common values we write (param groups, step) equal megatron-core's own,
    for the same run: the same groups in the same order with the same keys and values."""
    _, _, root = trained
    theirs = load_pickled(root / f"iter_{ITERATION:07d}/common.pt", "test")["optimizer"]
    run = TrainingRun(
        iteration=ITERATION,
        consumed_samples=2 * ITERATION,
        global_batch_size=2,
        train_iters=10,
        lr=LR,
        min_lr=LR,
        lr_warmup_iters=0,
        lr_decay_iters=None,
        lr_decay_style="constant",
        weight_decay=WD,
        betas=BETAS,
        eps=EPS,
    )
    ours = build_model(our_config(False), seed=1)
    weights = {n: t.detach() for n, t in ours.state_dict().items()}
    moments = {n: {"exp_avg": t, "exp_avg_sq": t} for n, t in weights.items()}
    state = MegatronOptimizerState(ITERATION, moments, None, None, None, "test")
    extras = dist_optimizer_extras(
        state, weights, ours.config, 128, torch.float32, run, LR, distributed=False
    )
    assert extras.common["optimizer"].keys() == theirs.keys()
    assert extras.common["optimizer"]["param_groups"] == theirs["param_groups"]
    assert torch.equal(
        extras.common["optimizer"]["state"]["common_step"], theirs["state"]["common_step"]
    )


def test_megatron_round_trip_keeps_the_optimizer(tmp_path, trained) -> None:
    """Megatron-LM -> ours -> Megatron-LM with the optimizer, no training here in between:
    megatron-core loads the result strictly with the same moments, step and hyperparameters
    (the export takes the schedule from the source's args, recorded at import)."""
    model, optimizer, root = trained
    convert("megatron", "megatron_het", root, tmp_path / "ours", "--with-optimizer")
    convert(
        "megatron_het",
        "megatron",
        tmp_path / "ours",
        tmp_path / "back",
        *("--ckpt-format", "torch_dist", "--with-optimizer"),
    )
    loaded_model, loaded, common = megatron_load(tmp_path / f"back/iter_{ITERATION:07d}")
    assert common["opt_param_scheduler"]["num_steps"] == 2 * ITERATION
    before = dict(model.named_parameters())
    for name, param in loaded_model.named_parameters():
        # The vocabulary's padding rows are dropped on import and written as zeros.
        rows = slice(0, VOCAB) if "embedding" in name or "output_layer" in name else slice(None)
        assert torch.equal(param[rows], before[name][rows]), name
        want, got = optimizer.optimizer.state[before[name]], loaded.optimizer.state[param]
        assert float(got["step"]) == float(want["step"]) == ITERATION
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[moment][rows], want[moment][rows]), (name, moment)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in loaded.optimizer.param_groups]
    assert groups == [
        {k: v for k, v in g.items() if k != "params"} for g in optimizer.optimizer.param_groups
    ]
