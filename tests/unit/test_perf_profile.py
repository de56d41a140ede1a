"""Profile format: round trip, lookup (exact, linear in tokens, nearest) and errors."""

import json

import pytest

from megatron_het.config import model_preset
from megatron_het.errors import UserError
from megatron_het.perf.cost.roofline import LayerShape, layer_forward_flops
from megatron_het.perf.measure.profile_format import (
    CommEntry,
    EndEntry,
    LayerEntry,
    Profile,
    ProfileConditions,
    load_profiles,
    merge_profiles,
)

CONDITIONS = ProfileConditions("Intel Xeon (host)", "2.13.0", 2, "2026-11-30")
MODEL = model_preset("small")  # h=256, ffn=688, 8 heads, 4 kv groups


def entry(seq, mb, fwd, bwd, act, tp=1, dtype="fp32", hidden=256):
    return LayerEntry(hidden, 688, 8, 4, seq, mb, tp, dtype, fwd, bwd, act)


def profile(*layers, **extra):
    return Profile("cpu", CONDITIONS, layers=tuple(layers), **extra)


def shape(seq, mb, tp=1):
    return LayerShape.of(MODEL, seq, mb, tp)


def test_round_trip(tmp_path):
    p = profile(
        entry(128, 1, 0.01, 0.02, 1e6),
        entry(256, 2, 0.04, 0.08, 4e6),
        embedding=(EndEntry(256, 4096, 128, 1, 1, "fp32", 1e-4, 2e-4),),
        head=(EndEntry(256, 4096, 128, 1, 1, "fp32", 1e-3, 2e-3),),
        optimizer_step_s_per_param=3e-9,
        comm=(CommEntry("p2p", "intra_node", 4.0, 1e-5),),
    )
    path = tmp_path / "cpu.json"
    p.save(path)
    assert json.loads(path.read_text())["format"] == "megatron_het.profile/1"
    assert Profile.load(path) == p
    assert load_profiles([path]) == {"cpu": p}
    with pytest.raises(UserError, match="two profiles"):
        load_profiles([path, path])


def test_exact_and_linear_in_tokens():
    p = profile(entry(128, 1, 0.01, 0.02, 1000.0), entry(128, 4, 0.04, 0.08, 4000.0))
    exact = p.layer(shape(128, 1), "fp32")
    assert (exact.forward_s, exact.source) == (0.01, "profile cpu: exact")
    mid = p.layer(shape(256, 1), "fp32")  # 256 tokens, between 128 and 512
    assert mid.forward_s == pytest.approx(0.02) and mid.activation_bytes == pytest.approx(2000)
    assert "interpolated" in mid.source
    far = p.layer(shape(256, 4), "fp32")  # 1024 tokens, beyond the last point
    assert far.backward_s == pytest.approx(0.16) and "extrapolated" in far.source


def test_one_point_scales_in_proportion():
    p = profile(entry(128, 1, 0.01, 0.02, 1000.0))
    m = p.layer(shape(128, 3), "fp32")
    assert m.forward_s == pytest.approx(0.03) and "proportion" in m.source


def test_nearest_shape_is_scaled_by_work():
    p = profile(entry(128, 1, 0.01, 0.02, 1000.0, tp=1))
    m = p.layer(shape(128, 1, tp=2), "fp32")
    ratio = layer_forward_flops(shape(128, 1, 2)) / layer_forward_flops(shape(128, 1, 1))
    assert m.forward_s == pytest.approx(0.01 * ratio) and "nearest" in m.source
    assert p.layer(shape(128, 1), "bf16") is None  # nothing measured in bf16: roofline


def test_end_lookup_and_comm():
    p = profile(
        head=(
            EndEntry(256, 4096, 128, 1, 1, "fp32", 1e-3, 2e-3),
            EndEntry(256, 4096, 128, 2, 1, "fp32", 2e-3, 4e-3),
        ),
        comm=(CommEntry("collective", "bridge", 2.0, 5e-5),),
    )
    m = p.end("head", shape(192, 1), 4096, "fp32")
    assert m.forward_s == pytest.approx(1.5e-3)
    assert p.end("embedding", shape(128, 1), 4096, "fp32") is None
    assert p.comm_figures("collective", "bridge").bandwidth_gbps == 2.0
    assert p.comm_figures("p2p", "bridge") is None


@pytest.mark.parametrize(
    "data,match",
    [
        ({"format": "other"}, "format must be"),
        ({"format": "megatron_het.profile/1", "accelerator": "cpu", "bogus": 1}, "unknown key"),
        (
            {
                "format": "megatron_het.profile/1",
                "accelerator": "cpu",
                "conditions": {"device_name": "x", "torch_version": "2", "threads": 2},
            },
            "missing key",
        ),
        (
            {
                "format": "megatron_het.profile/1",
                "accelerator": "cpu",
                "conditions": {
                    "device_name": "x",
                    "torch_version": "2",
                    "threads": "two",
                    "date": "d",
                },
            },
            "threads must be an integer",
        ),
        (
            {
                "format": "megatron_het.profile/1",
                "accelerator": "cpu",
                "conditions": {"device_name": "x", "torch_version": "2", "threads": 2, "date": "d"},
                "layers": [
                    {
                        "hidden": 8,
                        "ffn": 8,
                        "heads": 1,
                        "kv_groups": 1,
                        "seq": 4,
                        "micro_batch": 1,
                        "tp": 1,
                        "dtype": "int8",
                        "forward_s": 1,
                        "backward_s": 2,
                        "activation_bytes": 3,
                    }
                ],
            },
            "dtype must be one of",
        ),
    ],
)
def test_bad_profiles_say_what_is_wrong(data, match):
    with pytest.raises(UserError, match=match):
        Profile.from_dict(data)


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        Profile.load(tmp_path / "nope.json")


def test_compiled_entries_are_their_own_mode(tmp_path):
    eager = entry(128, 1, 0.02, 0.04, 1000.0)
    compiled = LayerEntry(256, 688, 8, 4, 128, 1, 1, "fp32", 0.01, 0.03, 900.0, True)
    p = profile(eager, compiled)
    path = tmp_path / "cpu.json"
    p.save(path)
    assert Profile.load(path) == p
    assert p.layer(shape(128, 1), "fp32", compiled=True).forward_s == 0.01
    assert p.layer(shape(128, 1), "fp32", compiled=False).forward_s == 0.02
    assert "compiled exact" in p.layer(shape(128, 1), "fp32", compiled=True).source
    assert profile(eager).layer(shape(128, 1), "fp32", compiled=True) is None
    # a file written before the mode existed holds eager entries
    data = json.loads(path.read_text())
    del data["layers"][0]["compiled"]
    assert Profile.from_dict(data).layers[0].compiled is False
    data["layers"][0]["compiled"] = "yes"
    with pytest.raises(UserError, match="compiled must be true or false, got 'yes'"):
        Profile.from_dict(data)
    # merging keeps both modes of one shape; a new entry of one mode replaces that mode's
    faster = LayerEntry(256, 688, 8, 4, 128, 1, 1, "fp32", 0.005, 0.02, 900.0, True)
    merged = merge_profiles(p, profile(faster))
    assert sorted((e.compiled, e.forward_s) for e in merged.layers) == [
        (False, 0.02),
        (True, 0.005),
    ]
