"""Command line -> configs: flag mapping, preset overrides, vocabulary, and one-line errors."""

from __future__ import annotations

import pytest

from megatron_het.arguments import padded_vocab_size, parse_run_config, resolve_model_config
from megatron_het.config import model_preset
from megatron_het.errors import UserError

DATA = ["--data-path", "corpus", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]


def parse(*flags: str):
    return parse_run_config([*DATA, *flags])


def test_flags_reach_the_configs() -> None:
    run = parse(
        "--model",
        "tiny",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--train-iters",
        "50",
        "--exit-interval",
        "10",
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-5",
        "--lr-decay-style",
        "linear",
        "--lr-decay-iters",
        "40",
        "--lr-warmup-iters",
        "5",
        "--weight-decay",
        "0.05",
        "--adam-beta1",
        "0.8",
        "--adam-beta2",
        "0.99",
        "--adam-eps",
        "1e-6",
        "--clip-grad",
        "0.5",
        "--bf16",
        "--seed",
        "9",
        "--split",
        "8,1,1",
        "--seq-length",
        "64",
        "--save",
        "s",
        "--load",
        "l",
        "--save-interval",
        "5",
        "--eval-interval",
        "7",
        "--eval-iters",
        "3",
        "--log-interval",
        "2",
        "--tensorboard-dir",
        "tb",
        "--metrics-file",
        "m",
    )
    assert run.data.data_path == ("corpus",) and run.data.seq_length == 64
    assert run.data.split == "8,1,1" and run.data.seed == 9 and run.data.vocab_size == 300
    o = run.optimizer
    assert (o.lr, o.min_lr, o.lr_decay_style, o.lr_decay_iters, o.lr_warmup_iters) == (
        1e-3,
        1e-5,
        "linear",
        40,
        5,
    )
    assert (o.weight_decay, o.adam_beta1, o.adam_beta2, o.adam_eps, o.clip_grad) == (
        0.05,
        0.8,
        0.99,
        1e-6,
        0.5,
    )
    t = run.train
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters, t.exit_interval) == (
        2,
        8,
        50,
        10,
    )
    assert (t.bf16, t.seed, t.save, t.load, t.save_interval) == (True, 9, "s", "l", 5)
    assert (t.eval_interval, t.eval_iters, t.log_interval) == (7, 3, 2)
    assert (t.tensorboard_dir, t.metrics_file) == ("tb", "m")
    assert run.model.preset == "tiny" and run.model.overrides == {}
    assert run.parallel.overlap_p2p_comm  # Megatron-LM's default: interleaved transfers overlap
    assert not parse("--model", "tiny", "--no-overlap-p2p-communication").parallel.overlap_p2p_comm
    assert run.parallel.recompute is None
    assert parse(
        "--model",
        "tiny",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "3",
    ).parallel.recompute == ("block", 3)


def test_ddp_bucket_size_is_megatrons_flag_in_parameters() -> None:
    assert parse("--model", "tiny").parallel.ddp_bucket_size is None
    assert (
        parse("--model", "tiny", "--ddp-bucket-size", "40000000").parallel.ddp_bucket_size
        == 40_000_000
    )
    with pytest.raises(UserError, match="--ddp-bucket-size must be at least 1, got 0"):
        parse("--model", "tiny", "--ddp-bucket-size", "0")


def test_global_batch_defaults_to_micro_batch() -> None:
    assert parse("--model", "tiny", "--micro-batch-size", "3").train.global_batch_size == 3


def test_explicit_shape_flags_override_the_preset() -> None:
    run = parse(
        "--model",
        "tiny",
        "--num-layers",
        "2",
        "--hidden-size",
        "128",
        "--num-query-groups",
        "4",
        "--rotary-base",
        "500000",
        "--untie-embeddings-and-output-weights",
    )
    config = resolve_model_config(run.model, tokenizer_vocab_size=301, seq_length=128)
    expected = model_preset("tiny").replace(
        num_layers=2, hidden_size=128, num_query_groups=4, rope_theta=500000.0, tie_embeddings=False
    )
    assert config == expected
    tied = parse("--model", "tiny-tied")
    assert resolve_model_config(tied.model, 301, 128).tie_embeddings
    untied = parse("--model", "tiny-tied", "--untie-embeddings-and-output-weights")
    assert not resolve_model_config(untied.model, 301, 128).tie_embeddings


def test_shape_flags_alone_follow_megatron_defaults() -> None:
    run = parse(
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "96",
        "--group-query-attention",
    )
    config = resolve_model_config(run.model, tokenizer_vocab_size=301, seq_length=96)
    assert (config.ffn_hidden_size, config.num_query_groups, config.tie_embeddings) == (
        256,
        4,
        True,
    )
    assert config.max_position_embeddings == 96 and config.vocab_size == 384
    assert (config.rope_theta, config.norm_eps) == (10000.0, 1e-5)


def test_vocab_padding_matches_megatron() -> None:
    # Megatron pads GPT-2's 50257 tokens to 50304 with the default divisor of 128.
    assert padded_vocab_size(50257, 128) == 50304
    assert padded_vocab_size(32000, 128) == 32000
    assert padded_vocab_size(301, 64) == 320


def test_exact_vocab_size_for_a_real_tokenizer() -> None:
    run = parse_run_config(
        [
            "--data-path",
            "c",
            "--tokenizer-model",
            "t.model",
            "--vocab-size",
            "4096",
            "--model",
            "tiny",
        ]
    )
    assert run.model.vocab_size == 4096
    assert resolve_model_config(run.model, 4000, 128).vocab_size == 4096
    with pytest.raises(
        UserError,
        match="--vocab-size 4096 gives a 4096-token model vocabulary "
        "but the tokenizer has 5000 tokens",
    ):
        resolve_model_config(run.model, 5000, 128)


def test_preset_vocabulary_smaller_than_the_tokenizer() -> None:
    run = parse("--model", "tiny")
    with pytest.raises(UserError, match="--model tiny gives a 512-token model vocabulary"):
        resolve_model_config(run.model, tokenizer_vocab_size=32000, seq_length=128)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--model", "tiny", "--foo"],
            r"^unrecognized arguments: --foo; see pretrain_llama.py --help$",
        ),
        (["--model", "tiny", "--lr-decay-style", "cubic"], "invalid choice: 'cubic'"),
        (["--model", "tiny", "--train-iters", "ten"], "invalid int value: 'ten'"),
        (["--model", "nope"], "unknown --model 'nope'"),
        (["--hidden-size", "64"], "pass --model PRESET or --num-layers, --num-attention-heads"),
        (
            ["--model", "tiny", "--num-attention-heads", "5"],
            "--num-attention-heads 5 does not divide --hidden-size 64",
        ),
        (
            ["--model", "tiny", "--micro-batch-size", "3", "--global-batch-size", "8"],
            "--global-batch-size 8 is not divisible by --micro-batch-size 3",
        ),
        (
            ["--model", "tiny", "--seq-length", "512"],
            "--seq-length 512 exceeds the model's --max-position-embeddings 256",
        ),
        (["--model", "tiny", "--fp16", "--bf16"], "--fp16 and --bf16 both set the training dtype"),
        (["--model", "tiny", "--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
        (["--model", "tiny", "--save-interval", "5"], "--save-interval needs --save"),
        (
            ["--model", "tiny", "--lr-warmup-iters", "20", "--train-iters", "10"],
            "--lr-decay-iters 10 must be larger than --lr-warmup-iters 20",
        ),
        (
            ["--model", "tiny", "--recompute-num-layers", "2"],
            "--recompute-method and --recompute-num-layers need --recompute-granularity full",
        ),
        (
            ["--model", "tiny", "--recompute-granularity", "full"],
            "--recompute-granularity full needs --recompute-method",
        ),
        (
            ["--model", "tiny", "--recompute-granularity", "selective"],
            "selective recomputes the core attention, which the flash attention kernel here never "
            "stores",
        ),
        (
            [
                "--model",
                "tiny",
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "2",
            ],
            "uniform with --recompute-num-layers 2 .* is not supported",
        ),
        (
            [
                "--model",
                "tiny",
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "block",
                "--recompute-num-layers",
                "0",
            ],
            "--recompute-num-layers must be at least 1, got 0",
        ),
    ],
)
def test_bad_command_lines_raise_one_line_user_errors(flags: list[str], message: str) -> None:
    with pytest.raises(UserError, match=message) as info:
        parse(*flags)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model", "tiny", "--mock-data", "--tokenizer-type", "NullTokenizer"],
            "needs --vocab-size",
        ),
        (["--model", "tiny", "--data-path", "c"], "SentencePieceTokenizer needs --tokenizer-model"),
        (
            ["--model", "tiny", "--tokenizer-type", "NullTokenizer", "--vocab-size", "9"],
            "no training data: pass --data-path",
        ),
    ],
)
def test_data_and_tokenizer_are_required(argv: list[str], message: str) -> None:
    with pytest.raises(UserError, match=message):
        parse_run_config(argv)


def test_mock_data_needs_no_data_path() -> None:
    run = parse_run_config(
        [
            "--model",
            "tiny",
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "100",
        ]
    )
    assert run.data.mock_data and run.data.data_path == ()
