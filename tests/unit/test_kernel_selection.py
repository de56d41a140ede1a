"""Which implementation each fused op runs (selection.py), from what the extension provides and
what the flags allow, and how the run and ``python -m megatron_het.kernels`` say so."""

from __future__ import annotations

import json

import pytest

from megatron_het.arguments import parse_run_config
from megatron_het.kernels.__main__ import main as kernels_main
from megatron_het.kernels.extension import FAMILY_OPS, KernelExtension, load_extension
from megatron_het.kernels.liger import LigerKernels
from megatron_het.kernels.selection import (
    FAMILIES,
    KernelChoice,
    describe,
    implementation,
)


def extension_with(*keys: str, missing: tuple[str, ...] = ()) -> KernelExtension:
    """A loaded extension whose ops all have kernels for the dispatch ``keys`` (but ``missing``)."""
    return KernelExtension(True, has_kernel=lambda op, key: key in keys and op not in missing)


NO_LIBRARIES = LigerKernels()


def _fake_kernel(*tensors):
    return tensors[0]


EVERY_LIGER = LigerKernels(_fake_kernel, _fake_kernel, _fake_kernel)  # every kernel "installed"
TINY_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_kernels_are_preferred_where_built(family):
    ext = extension_with("CPU", "CUDA")
    assert implementation(family, "cpu", extension=ext).name == "csrc C++"
    impl = implementation(family, "cuda", extension=ext, liger=NO_LIBRARIES, apex_rms_norm=True)
    assert impl.name in ("csrc CUDA", "csrc HIP") and impl.compiled
    # before apex and liger alike, where they are installed
    impl = implementation(family, "cuda", extension=ext, liger=EVERY_LIGER, apex_rms_norm=True)
    assert impl.compiled


def test_liger_runs_swiglu_on_the_device_where_ours_is_not_built():
    impl = implementation("swiglu", "cuda", extension=extension_with("CPU"), liger=EVERY_LIGER)
    assert impl.name == "liger"
    off = KernelChoice.from_flags(swiglu=False)
    assert implementation("swiglu", "cuda", off, extension_with("CPU"), EVERY_LIGER).name == "torch"


def test_a_cpu_only_build_falls_back_on_the_device():
    ext = extension_with("CPU")
    impl = implementation("rope", "cuda", extension=ext, liger=NO_LIBRARIES)
    assert (impl.name, impl.compiled) == ("torch", False)
    assert "built without" in impl.why
    apex = implementation("rms_norm", "cuda", extension=ext, liger=NO_LIBRARIES, apex_rms_norm=True)
    assert apex.name == "apex"


def test_a_family_missing_one_op_is_not_compiled():
    ext = extension_with("CPU", missing=(FAMILY_OPS["cross_entropy"][1],))
    assert implementation("cross_entropy", "cpu", extension=ext).name == "torch"
    assert implementation("rms_norm", "cpu", extension=ext).name == "csrc C++"


def test_an_unbuilt_extension_says_why():
    def fail(name):
        raise ImportError(f"No module named {name!r}")

    ext = load_extension(fail)
    assert not ext.loaded and "megatron_het._C is not built" in ext.why
    assert implementation("rms_norm", "cpu", extension=ext).why == ext.why
    broken = load_extension(lambda name: (_ for _ in ()).throw(OSError("undefined symbol: x")))
    assert "does not load: undefined symbol" in broken.why


def test_flags_turn_families_off():
    ext = extension_with("CPU")
    choice = KernelChoice.from_flags(rope=False)
    assert implementation("rope", "cpu", choice, ext).why == "turned off by its flag"
    assert implementation("rms_norm", "cpu", choice, ext).compiled
    assert KernelChoice.from_flags(reference=True) == KernelChoice.references()
    refs = [implementation(f, "cpu", KernelChoice.references(), ext) for f in FAMILIES]
    assert {r.name for r in refs} == {"torch"}
    assert describe(refs) == "rms_norm: torch, rope: torch, cross_entropy: torch, swiglu: torch"


def test_unknown_family_is_an_error():
    with pytest.raises(ValueError, match="unknown op family 'gelu'"):
        implementation("gelu", "cpu")


@pytest.mark.parametrize(
    "flag,field",
    [
        ("--no-rope-fusion", "rope_fusion"),
        ("--no-rms-norm-fusion", "rms_norm_fusion"),
        ("--no-cross-entropy-loss-fusion", "cross_entropy_loss_fusion"),
        ("--no-bias-swiglu-fusion", "bias_swiglu_fusion"),
        ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"),
    ],
)
def test_megatron_style_flags_reach_the_run(flag, field):
    base = ["--model", "tiny", *TINY_DATA]
    assert getattr(parse_run_config(base).train, field) is True
    assert getattr(parse_run_config([*base, flag]).train, field) is False


def test_reference_kernels_flag_reaches_the_choice():
    from megatron_het.training.trainer import kernel_choice

    class Setup:
        train = parse_run_config(
            ["--model", "tiny", *TINY_DATA, "--reference-kernels", "--no-rope-fusion"]
        ).train

    assert kernel_choice(Setup()) == KernelChoice.references()  # type: ignore[arg-type]


def test_the_table_lists_every_family_and_device(capsys):
    assert kernels_main([]) == 0
    text = capsys.readouterr().out
    assert "megatron_het._C:" in text
    for family in FAMILIES:
        assert text.count(f"\n{family} ") == 2
    assert kernels_main(["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["family"], r["device_type"]) for r in rows} == {
        (f, d) for f in FAMILIES for d in ("cpu", "cuda")
    }
