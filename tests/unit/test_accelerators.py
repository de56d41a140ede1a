"""The accelerator registry: built-in kinds, lookup, YAML overrides, validation messages."""

import pytest
import torch

from megatron_het.cluster.accelerators import (
    BUILTIN_ACCELERATORS,
    AcceleratorRegistry,
    AcceleratorSpec,
    get_accelerator,
)
from megatron_het.errors import UserError

BUILTIN_NAMES = [
    "A100-40G",
    "A100-80G",
    "H100",
    "H200",
    "MI250X",
    "MI300X",
    "Ascend910B",
    "cpu",
    "emu-fast",
    "emu-slow",
]
KNOWN = ", ".join(BUILTIN_NAMES)


def test_builtin_names_and_case_insensitive_lookup():
    registry = AcceleratorRegistry.builtin()
    assert registry.names() == BUILTIN_NAMES
    for name in BUILTIN_NAMES:
        assert registry.get(name.lower()) is registry.get(name.upper()) is registry.get(name)
        assert registry.get(name.swapcase()).name == name
    assert "h100" in registry and "a100" not in registry


def test_unknown_name_lists_known_kinds():
    with pytest.raises(UserError) as exc:
        get_accelerator("a100")
    assert str(exc.value) == f"unknown accelerator 'a100'; known: {KNOWN}"


@pytest.mark.parametrize(
    "name, vendor, backend, library, device",
    [
        ("A100-80G", "nvidia", "nccl", "nccl", "cuda"),
        ("H200", "nvidia", "nccl", "nccl", "cuda"),
        ("MI250X", "amd", "nccl", "rccl", "cuda"),
        ("MI300X", "amd", "nccl", "rccl", "cuda"),
        ("Ascend910B", "huawei", "hccl", "hccl", "npu"),
        ("cpu", "cpu", "gloo", "gloo", "cpu"),
        ("emu-slow", "cpu", "gloo", "gloo", "cpu"),
    ],
)
def test_backends_and_device_types(name, vendor, backend, library, device):
    spec = get_accelerator(name)
    assert (spec.vendor, spec.native_backend, spec.collective_library, spec.device_type) == (
        vendor,
        backend,
        library,
        device,
    )


def test_figures_follow_the_datasheets():
    a100, h100, h200 = (get_accelerator(n) for n in ("A100-80G", "H100", "H200"))
    assert (a100.peak_tflops_bf16, a100.memory_gib, a100.memory_bandwidth_gbps) == (312, 80, 2039)
    assert get_accelerator("A100-40G").memory_bandwidth_gbps == 1555
    assert h100.peak_tflops_bf16 == h200.peak_tflops_bf16 == 989
    assert (h200.memory_gib, h200.memory_bandwidth_gbps) == (141, 4800)
    # MI250X is listed per GCD: half of the module's 383 TFLOP/s, 128 GB and 3.2 TB/s.
    gcd = get_accelerator("MI250X")
    assert (gcd.peak_tflops_bf16 * 2, gcd.memory_gib * 2, gcd.memory_bandwidth_gbps * 2) == (
        383,
        128,
        3200,
    )
    assert get_accelerator("MI300X").memory_gib == 192
    for spec in BUILTIN_ACCELERATORS:
        assert spec.peak_tflops_fp32 <= spec.peak_tflops_bf16


def test_emulated_kinds_are_labelled_and_scaled():
    fast, slow, cpu = (get_accelerator(n) for n in ("emu-fast", "emu-slow", "cpu"))
    assert (fast.emulated, fast.slowdown, slow.emulated, slow.slowdown) == (True, 1.0, True, 2.0)
    assert slow.peak_tflops_bf16 == pytest.approx(fast.peak_tflops_bf16 / 2)
    for spec in (fast, slow):
        assert str(spec) == spec.label == f"{spec.name} (emulated)"
        assert "emulated" in spec.describe() and "slowdown" in spec.describe()
    assert not cpu.emulated and str(cpu) == "cpu" and "emulated" not in cpu.describe()


def test_peak_tflops_by_dtype():
    h100 = get_accelerator("H100")
    assert h100.peak_tflops(torch.bfloat16) == h100.peak_tflops("bf16") == 989
    assert h100.peak_tflops(torch.float16) == 989
    assert h100.peak_tflops(torch.float32) == h100.peak_tflops("fp32") == 67
    with pytest.raises(UserError, match="no peak figure for dtype 'fp8'; use bf16, fp16 or fp32"):
        h100.peak_tflops("fp8")


def test_override_merges_onto_builtin_and_leaves_original():
    base = AcceleratorRegistry.builtin()
    merged = base.with_overrides({"h100": {"memory_gib": 94, "intra_node_bandwidth_gbps": 600}})
    h100 = merged.get("H100")
    assert h100.name == "H100"
    assert (h100.memory_gib, h100.intra_node_bandwidth_gbps, h100.peak_tflops_bf16) == (
        94,
        600,
        989,
    )
    assert base.get("H100").memory_gib == 80
    assert merged.names() == base.names()


def test_new_kind_from_base_and_in_full():
    registry = AcceleratorRegistry.builtin().with_overrides(
        {
            "emu-tiny": {"base": "emu-slow", "slowdown": 4.0, "memory_cap_gib": 0.5},
            "X1": {
                "vendor": "other",
                "native_backend": "xccl",
                "collective_library": "xccl",
                "device_type": "xpu",
                "memory_gib": 32,
                "peak_tflops_bf16": 100,
                "peak_tflops_fp16": 100,
                "peak_tflops_fp32": 25,
                "memory_bandwidth_gbps": 800,
                "intra_node_bandwidth_gbps": 100,
            },
        }
    )
    tiny = registry.get("EMU-TINY")
    assert (tiny.name, tiny.slowdown, tiny.memory_cap_gib, tiny.emulated) == (
        "emu-tiny",
        4.0,
        0.5,
        True,
    )
    assert registry.get("x1").device_type == "xpu"
    assert registry.names()[-2:] == ["emu-tiny", "X1"]


def test_load_overrides_from_file(tmp_path):
    path = tmp_path / "kinds.yaml"
    path.write_text("accelerators:\n  MI300X:\n    memory_gib: 191\n")
    assert AcceleratorRegistry.builtin().load_overrides(path).get("mi300x").memory_gib == 191
    bare = tmp_path / "bare.yaml"
    bare.write_text("cpu: {memory_gib: 8}\n")
    assert AcceleratorRegistry.builtin().load_overrides(bare).get("cpu").memory_gib == 8


FIELDS = (
    "emulated, intra_node_bandwidth_gbps, memory_bandwidth_gbps, memory_cap_gib, memory_gib, "
    "native_backend, peak_tflops_bf16, peak_tflops_fp16, peak_tflops_fp32, slowdown, vendor"
)


@pytest.mark.parametrize(
    "entries, message",
    [
        (
            {"H100": {"memroy_gib": 1}},
            "accelerator 'H100': unknown key 'memroy_gib'; known keys: base, collective_library, "
            "device_type, " + FIELDS,
        ),
        (
            {"X2": {"vendor": "other"}},
            "accelerator 'X2' is not built in, so it needs native_backend, collective_library, "
            "device_type, memory_gib, peak_tflops_bf16, peak_tflops_fp16, peak_tflops_fp32, "
            "memory_bandwidth_gbps, intra_node_bandwidth_gbps (or base: <a known kind>)",
        ),
        ({"X3": {"base": "B200"}}, f"unknown accelerator 'B200'; known: {KNOWN}"),
        (
            {"H100": {"vendor": "intel"}},
            "accelerator 'H100': vendor must be one of nvidia, amd, huawei, cpu, other; got 'intel'",
        ),
        ({"H100": {"memory_gib": 0}}, "accelerator 'H100': memory_gib must be positive, got 0"),
        (
            {"H100": {"peak_tflops_bf16": "fast"}},
            "accelerator 'H100': peak_tflops_bf16 must be a number, got 'fast'",
        ),
        (
            {"H100": {"slowdown": 2.0}},
            "accelerator 'H100': slowdown and memory_cap_gib apply only to emulated kinds; set "
            "emulated: true or remove them",
        ),
        (
            {"emu-slow": {"slowdown": 0.5}},
            "accelerator 'emu-slow': slowdown must be >= 1.0 (an emulated kind can only be slower than "
            "the host CPU), got 0.5",
        ),
        (
            {"H100": {"emulated": True}},
            "accelerator 'H100': an emulated kind runs on the CPU; set device_type: cpu and "
            "native_backend: gloo",
        ),
        (
            {"emu-fast": {"emulated": "yes"}},
            "accelerator 'emu-fast': emulated must be true or false, got 'yes'",
        ),
        ({"H100": 5}, "accelerator 'H100': expected a mapping of fields, got 5"),
    ],
)
def test_override_validation_messages(entries, message):
    with pytest.raises(UserError) as exc:
        AcceleratorRegistry.builtin().with_overrides(entries)
    assert str(exc.value) == message


def test_file_errors(tmp_path):
    with pytest.raises(UserError) as exc:
        AcceleratorRegistry.builtin().load_overrides(tmp_path / "nope.yaml")
    assert (
        str(exc.value) == f"accelerator file '{tmp_path / 'nope.yaml'}' not found; check the path"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("accelerators:\n  H100: [\n")
    with pytest.raises(UserError, match=r"is not valid YAML at line \d+; fix the syntax"):
        AcceleratorRegistry.builtin().load_overrides(bad)


def test_spec_round_trips_through_dict():
    for spec in BUILTIN_ACCELERATORS:
        assert AcceleratorSpec(**spec.to_dict()) == spec
