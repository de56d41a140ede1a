"""compile_layers (torch.compile per decoder layer) and the train-step benchmark's --compile
(and its --kernels, which times our model with and without the fused kernels).

Compiling costs seconds to tens of seconds per graph on a cold inductor cache, so every test
that runs a compiled layer is marked slow; the fast ones check names, options and errors
without compiling (a model on the meta device skips the inductor probe).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron_het.config import model_preset
from megatron_het.errors import UserError
from megatron_het.kernels.graph_break import apply_graph_breaks, graph_break
from megatron_het.model import compile as compile_module
from megatron_het.model.compile import (
    _traceable_apply_rope,
    compile_available,
    compile_layers,
    is_compiled,
)
from megatron_het.model.llama import LlamaModel, build_model
from megatron_het.model.rope import RotaryEmbedding, apply_rope

TWO_LAYERS = model_preset("tiny").replace(num_layers=2)
BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "train_step.py"


def meta_model(layer_range: tuple[int, int] = (0, 2)) -> LlamaModel:
    with torch.device("meta"):
        return LlamaModel(TWO_LAYERS, layer_range)


def test_compile_keeps_names_keys_and_parameters() -> None:
    model = meta_model((1, 2))
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    keys = list(model.state_dict())
    assert not any(is_compiled(layer) for layer in model.layers.values())
    compile_layers(model)
    assert all(is_compiled(layer) for layer in model.layers.values())
    assert list(model.layers) == ["1"]
    assert [name for name, _ in model.named_parameters()] == names
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert list(model.state_dict()) == keys
    assert "layers.1.attention.qkv.weight" in keys


def test_compile_options(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(
        torch.nn.Module,
        "compile",
        lambda self, **kwargs: calls.append((type(self).__name__, kwargs)),
    )
    compile_layers(meta_model(), mode="max-autotune-no-cudagraphs")
    assert (
        calls
        == [
            (
                "DecoderLayer",
                {"mode": "max-autotune-no-cudagraphs", "fullgraph": True, "dynamic": False},
            )
        ]
        * 2
    )
    calls.clear()
    compile_layers(meta_model((2, 2)))  # a stage without layers (embedding and head only)
    assert calls == []


def test_a_gpu_stage_asks_about_flash_attention_before_compiling(monkeypatch) -> None:
    """Inside a compiled graph the attention kernel cannot ask torch what the GPU runs."""
    import megatron_het.model.compile as compile_mod

    events = []
    monkeypatch.setattr(compile_mod, "_layers_device_type", lambda model: "cuda")
    monkeypatch.setattr(compile_mod, "compile_available", lambda device_type: (True, ""))
    monkeypatch.setattr(
        compile_mod,
        "device_runs_flash",
        lambda device, head_dim: events.append(("asked", head_dim)),
    )
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **kwargs: events.append("compiled")
    )
    compile_layers(meta_model())
    head_dim = TWO_LAYERS.hidden_size // TWO_LAYERS.num_attention_heads
    assert events == [("asked", head_dim), "compiled", "compiled"]


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_modes_that_capture_cuda_graphs_are_refused(mode: str) -> None:
    with pytest.raises(UserError, match="captures CUDA graphs.*max-autotune-no-cudagraphs"):
        compile_layers(meta_model(), mode=mode)


def test_a_tensor_parallel_stage_compiles_between_its_collectives(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **kwargs: calls.append(kwargs["fullgraph"])
    )
    model = meta_model()
    model.tp_group = type("Group", (), {"size": 2})()  # as apply_tp leaves it
    compile_layers(model)
    assert calls == [False, False]  # the TP collectives break each layer's graph


@pytest.mark.slow  # compiles (dynamo's eager backend)
def test_a_marked_function_runs_outside_the_compiled_graph() -> None:
    seen = []

    @graph_break
    def outside(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return x + 1

    assert outside.__name__ == "outside" and torch.equal(outside(torch.zeros(1)), torch.ones(1))
    apply_graph_breaks()
    compiled = torch.compile(lambda x: outside(x * 2) * 3, backend="eager", dynamic=False)
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 9.0))
    assert seen == [False, False]  # eager both times: dynamo did not trace into it


@pytest.mark.slow  # a process of its own
def test_a_process_that_does_not_compile_never_imports_dynamo() -> None:
    code = (
        "import sys; from megatron_het.training import entry; "
        "from megatron_het.model.llama import build_model; "
        "from megatron_het.config import model_preset; "
        "build_model(model_preset('tiny'), seed=1); "
        "sys.exit(3 if 'torch._dynamo' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_unknown_mode_is_a_user_error() -> None:
    with pytest.raises(UserError, match="unknown torch.compile mode 'fastest'.*default"):
        compile_layers(meta_model(), mode="fastest")


def test_unavailable_compiler_is_a_one_line_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        compile_module,
        "compile_available",
        lambda device_type: (False, "InvalidCxxCompiler: no working C++ compiler"),
    )
    model = LlamaModel(TWO_LAYERS)  # real CPU parameters: the probe is consulted
    with pytest.raises(UserError) as caught:
        compile_layers(model)
    message = str(caught.value)
    assert "\n" not in message and "cpu" in message and "no working C++ compiler" in message
    assert not any(is_compiled(layer) for layer in model.layers.values())


def test_compile_available_reports_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("inductor is broken here\nsecond line")

    monkeypatch.setattr(torch, "compile", broken)
    # __wrapped__: the uncached probe, so the real answer cached for this process is untouched.
    assert compile_available.__wrapped__("cpu") == (False, "RuntimeError: inductor is broken here")


@pytest.mark.slow  # the full suite runs it; the quick loop leaves it out
def test_compile_available_on_this_machine() -> None:
    ok, reason = compile_available("cpu")
    assert ok, reason
    assert reason == ""


def test_traceable_rope_matches_the_fused_one() -> None:
    """The form dynamo traces in place of apply_rope: same values and same gradient."""
    rotary = RotaryEmbedding(TWO_LAYERS)
    cos, sin = rotary.cos_sin(8, torch.device("cpu"), torch.float32)
    x = torch.randn(2, 8, 3, 16, dtype=torch.float32, requires_grad=True)
    strided = x[:, :, 1:]  # a strided view, as the qkv split gives
    grad_out = torch.randn(2, 8, 2, 16)
    fused = apply_rope(strided, cos, sin)
    (fused_grad,) = torch.autograd.grad(fused, x, grad_out)
    plain = _traceable_apply_rope(strided, cos, sin)
    (plain_grad,) = torch.autograd.grad(plain, x, grad_out)
    torch.testing.assert_close(plain, fused, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(plain_grad, fused_grad, rtol=1e-6, atol=1e-6)
    assert fused_grad[:, :, 0].abs().max() == 0 and plain_grad[:, :, 1:].abs().min() > 0


def loss_and_grads(
    model: LlamaModel, tokens: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(tokens, tokens)
    loss.backward()
    return loss.detach().double(), {name: p.grad.double() for name, p in model.named_parameters()}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute", [False, True])
def test_compiled_layers_match_eager(dtype: torch.dtype, recompute: bool) -> None:
    from torch._dynamo.utils import counters

    tokens = torch.randint(
        0, TWO_LAYERS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    eager = build_model(TWO_LAYERS, seed=3, recompute=recompute).to(dtype).train()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()  # compile afresh (inductor's disk cache keeps it quick)
    counters.clear()
    compile_layers(compiled)
    compiled_loss, compiled_grads = loss_and_grads(compiled, tokens)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    eager_loss, eager_grads = loss_and_grads(eager, tokens)
    assert list(compiled_grads) == list(eager_grads)
    if dtype == torch.float32:
        assert relative_error(compiled_loss, eager_loss) < 1e-5
        for name, grad in eager_grads.items():
            assert relative_error(compiled_grads[name], grad) < 1e-5, name
        return
    # bf16: fusion rounds differently; the compiled step must be no further from a float32
    # reference than the eager bf16 step is (plus a margin of bf16 resolution).
    reference = build_model(TWO_LAYERS, seed=3).train()
    reference_loss, reference_grads = loss_and_grads(reference, tokens)
    assert abs(compiled_loss - reference_loss) <= 2 * abs(eager_loss - reference_loss) + 1e-2
    for name, grad in reference_grads.items():
        eager_error = relative_error(eager_grads[name], grad)
        assert relative_error(compiled_grads[name], grad) <= 2 * eager_error + 1e-2, name


def load_bench():
    spec = importlib.util.spec_from_file_location("train_step_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_arguments() -> None:
    bench = load_bench()
    args = bench.parse_args(["--model", "tiny", "--compile", "--compile-mode", "default"])
    assert args.compile and args.compile_mode == "default" and args.model == "tiny"
    assert not bench.parse_args([]).compile
    for bad in (["--compile-mode", "default"], ["--rounds", "0"], ["--warmup", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_bench_report_shape() -> None:
    bench = load_bench()
    args = bench.parse_args(
        [
            "--model",
            "tiny",
            "--micro-batch-size",
            "2",
            "--seq-length",
            "8",
            "--rounds",
            "3",
            "--compile",
        ]
    )
    seconds = {"ours": [0.5, 0.1, 0.2], "hf": [0.3, 0.3, 0.4]}
    ratios = [0.6, 3.0, 2.0]
    record = bench.report(args, seconds, ratios, {"ours": 6.1, "hf": 6.1}, {"ours": 4.2, "hf": 0.5})
    assert json.loads(json.dumps(record)) == record
    assert record["ratio_vs_hf"] == 2.0 and record["median_step_s"] == {"ours": 0.2, "hf": 0.3}
    assert record["ours_tokens_per_s"] == 80.0 and record["hf_tokens_per_s"] == round(16 / 0.3, 1)
    assert record["compile"] is True and record["compile_s"] == 4.0
    assert record["first_step_s"] == {"ours": 4.2, "hf": 0.5}
    assert record["config"]["hidden_size"] == 64 and record["threads"] == torch.get_num_threads()
    assert record["torch"] == torch.__version__
    args.compile = False
    assert bench.report(args, seconds, ratios, {}, {"ours": 1.0, "hf": 1.0})["compile_s"] is None


def test_bench_kernels_option_rotates_three_models() -> None:
    bench = load_bench()
    assert bench.parse_args([]).kernels == "auto"
    with pytest.raises(SystemExit):
        bench.parse_args(["--kernels", "fused"])
    calls: list[str] = []
    names = ("ours", "hf", "reference")
    steps = {name: (lambda name=name: calls.append(name) or 1.0) for name in names}
    args = bench.parse_args(["--model", "tiny", "--rounds", "3", "--iters", "1", "--warmup", "0"])
    seconds, ratios = bench.measure(steps, args)
    rotations = ("ours hf reference", "hf reference ours", "reference ours hf")
    assert calls == " ".join(rotations).split()  # each model first, between and last once
    assert set(ratios) == {"hf", "reference"} and len(ratios["reference"]) == 3
    assert all(len(s) == 3 for s in seconds.values())
    args.kernels = "both"
    seconds = {"ours": [0.2, 0.2, 0.2], "hf": [0.3, 0.3, 0.4], "reference": [0.3, 0.2, 0.25]}
    record = bench.report(
        args, seconds, [1.5, 1.5, 2.0], {}, {"ours": 1.0, "hf": 1.0}, [1.5, 1.0, 1.25]
    )
    assert record["kernels"] == "both" and record["ratio_kernels_vs_reference"] == 1.25
    assert record["reference_tokens_per_s"] == round(args.micro_batch_size * 256 / 0.25, 1)
    assert record["ratio_vs_hf"] == 1.5 and record["median_step_s"]["reference"] == 0.25


def test_bench_reference_model_runs_every_torch_reference() -> None:
    from megatron_het.kernels.selection import KernelChoice

    bench = load_bench()
    args = bench.parse_args(["--model", "tiny", "--kernels", "reference"])
    model = bench.build_ours(args, KernelChoice.references())
    choices = [vars(m)["kernels"] for m in model.modules() if "kernels" in vars(m)]
    assert choices and all(c == KernelChoice.references() for c in choices)
    assert not any("kernels" in vars(m) for m in bench.build_ours(args, None).modules())


def test_bench_kernels_both_on_a_tiny_config(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    bench = load_bench()
    flags = ["--model", "tiny", "--micro-batch-size", "1", "--seq-length", "8", "--threads", "1"]
    flags += ["--rounds", "2", "--iters", "1", "--warmup", "0", "--kernels", "both"]
    record = bench.main(flags)
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == record
    assert set(record["median_step_s"]) == {"ours", "hf", "reference"}
    assert len(record["reference_round_ratios"]) == 2 and record["ratio_kernels_vs_reference"] > 0
    # the same weights and batch on both of ours: the first losses agree
    losses = record["first_step_loss"]
    assert losses["reference"] == pytest.approx(losses["ours"], rel=1e-4)


def test_bench_gemm_rate_counts_the_products_flops() -> None:
    """``gemm_tflops`` times ``gemm_s`` is the flop count of the step's matrix products, the
    in-place ``addmm_`` among them."""
    bench = load_bench()
    a, b, c = torch.randn(128, 64), torch.randn(64, 32), torch.zeros(128, 32)
    weight, bias = torch.randn(32, 64), torch.randn(32)
    batched = torch.randn(3, 16, 8), torch.randn(3, 8, 4)
    added = torch.randn(3, 16, 4)

    def step() -> float:
        c.addmm_(a, b)  # in place, as the fused head accumulates its weight gradient
        products = (
            torch.mm(a, b),
            F.linear(a, weight, bias),  # addmm with a 1-D bias
            torch.bmm(*batched),
            torch.baddbmm(added, *batched),
            torch.baddbmm(added.bfloat16(), *(t.bfloat16() for t in batched)),
        )
        return float(sum(p.float().sum() for p in products) + torch.softmax(a, dim=-1).sum())

    kernels = bench.kernel_seconds(step, steps=2)
    assert kernels["gemm_s"] > 0 and kernels["attention_s"] == 0
    # bf16 baddbmm runs as addmm_ per batch entry on the CPU: counted once
    flops = 3 * 2 * 128 * 64 * 32 + 3 * 2 * 3 * 16 * 8 * 4
    assert kernels["gemm_tflops"] * 1e12 * kernels["gemm_s"] == pytest.approx(flops)
    assert bench.matmul_peak_tflops("cpu", torch.float32, repeats=1) > 0


@pytest.mark.slow
def test_bench_runs_compiled_on_a_tiny_config(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    bench = load_bench()
    record = bench.main(
        [
            "--model",
            "tiny",
            "--micro-batch-size",
            "1",
            "--seq-length",
            "16",
            "--rounds",
            "2",
            "--iters",
            "1",
            "--warmup",
            "1",
            "--threads",
            "1",
            "--loss",
            "logits",
            "--compile",
        ]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record
    assert record["compile"] is True and len(record["round_ratios"]) == 2
    # Same weights, batch and loss function: the compiled model's first loss is Hugging Face's.
    assert abs(record["first_step_loss"]["ours"] - record["first_step_loss"]["hf"]) < 1e-4
    assert record["ours_tokens_per_s"] > 0 and record["hf_tokens_per_s"] > 0


@pytest.mark.slow
def test_training_with_compile_matches_eager(tmp_path) -> None:
    import io
    import json

    from megatron_het.arguments import parse_run_config
    from megatron_het.training import pretrain

    flags = [
        "--model",
        "tiny",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "300",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        "3",
        "--lr",
        "3e-3",
        "--eval-iters",
        "0",
        "--log-interval",
        "1",
    ]
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        path = tmp_path / f"{name}.jsonl"
        pretrain(parse_run_config([*flags, *extra, "--metrics-file", str(path)]), out=io.StringIO())
        losses[name] = [json.loads(line)["loss"] for line in path.read_text().splitlines()]
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5)
