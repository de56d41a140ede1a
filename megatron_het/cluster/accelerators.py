"""Accelerator kinds: what one device of a kind can do, and a registry to look kinds up by name.

Units, used everywhere in ``megatron_het.cluster``:

- ``*_gbps`` is **gigabytes** per second (GB/s, 1e9 bytes/s), the unit nccl-tests reports.
  Network cards are sold in gigabits: a 400 Gb/s NIC moves 50 GB/s. YAML files may give a
  network figure in gigabits with a ``*_gbit_per_s`` key instead; it is converted on load.
- ``memory_gib`` is the vendor's nominal device memory read as GiB; what a process can allocate
  is a little lower (the runtime and the driver keep some).
- ``peak_tflops_*`` is dense peak (no structured sparsity) in 1e12 FLOP/s. ``fp32`` is the
  plain FP32 rate, not TF32 tensor-core math.

An *emulated* kind is a CPU rank that pretends to be a slower device: after each timed compute
region it waits ``(slowdown - 1)`` times the measured time (see :mod:`megatron_het.emulation`).
Every emulated spec says "emulated" in its label, ``str`` and ``describe()``.

The registry is a plain object built from :data:`BUILTIN_ACCELERATORS`; YAML entries merge onto it
and return a new registry, so there is no process-wide mutable table.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_het.errors import UserError
from megatron_het.fileio import read_yaml_mapping

VENDORS = ("nvidia", "amd", "huawei", "cpu", "other")
GBIT_PER_GBYTE = 8.0


@dataclass(frozen=True)
class AcceleratorSpec:
    """One device of an accelerator kind (for MI250X: one GCD, which is one torch device).

    ``native_backend`` is the torch.distributed backend name that kind uses inside its own type
    ("nccl" on ROCm builds too, where torch's nccl backend is RCCL); ``collective_library`` is the
    library that actually runs ("nccl", "rccl", "hccl", "gloo").
    """

    name: str
    vendor: str
    native_backend: str
    collective_library: str
    device_type: str
    memory_gib: float
    peak_tflops_bf16: float
    peak_tflops_fp16: float
    peak_tflops_fp32: float
    memory_bandwidth_gbps: float
    intra_node_bandwidth_gbps: float
    emulated: bool = False
    slowdown: float = 1.0
    memory_cap_gib: float | None = None

    def __post_init__(self) -> None:
        where = f"accelerator {self.name!r}"
        if not isinstance(self.name, str) or not self.name.strip():
            raise UserError("accelerator: name must be a non-empty string")
        if self.vendor not in VENDORS:
            raise UserError(
                f"{where}: vendor must be one of {', '.join(VENDORS)}; got {self.vendor!r}"
            )
        for key in ("native_backend", "collective_library", "device_type"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise UserError(f"{where}: {key} must be a non-empty string, got {value!r}")
        for key in (
            "memory_gib",
            "peak_tflops_bf16",
            "peak_tflops_fp16",
            "peak_tflops_fp32",
            "memory_bandwidth_gbps",
            "intra_node_bandwidth_gbps",
        ):
            _check_positive(where, key, getattr(self, key))
        self._validate_emulation(where)

    def _validate_emulation(self, where: str) -> None:
        if not isinstance(self.emulated, bool):
            raise UserError(f"{where}: emulated must be true or false, got {self.emulated!r}")
        _check_number(where, "slowdown", self.slowdown)
        if self.memory_cap_gib is not None:
            _check_positive(where, "memory_cap_gib", self.memory_cap_gib)
        if not self.emulated:
            if self.slowdown != 1.0 or self.memory_cap_gib is not None:
                raise UserError(
                    f"{where}: slowdown and memory_cap_gib apply only to emulated "
                    f"kinds; set emulated: true or remove them"
                )
            return
        if self.slowdown < 1.0:
            raise UserError(
                f"{where}: slowdown must be >= 1.0 (an emulated kind can only be "
                f"slower than the host CPU), got {self.slowdown}"
            )
        if self.device_type != "cpu" or self.native_backend != "gloo":
            raise UserError(
                f"{where}: an emulated kind runs on the CPU; set device_type: cpu "
                f"and native_backend: gloo"
            )

    @property
    def label(self) -> str:
        """The name, marked "(emulated)" for emulated kinds; use it in every printed output."""
        return f"{self.name} (emulated)" if self.emulated else self.name

    def __str__(self) -> str:
        return self.label

    def peak_tflops(self, dtype: Any) -> float:
        """Dense peak TFLOP/s for ``dtype`` ("bf16", "fp16", "fp32" or a torch dtype)."""
        key = str(dtype).replace("torch.", "")
        aliases = {
            "bfloat16": "bf16",
            "float16": "fp16",
            "half": "fp16",
            "float32": "fp32",
            "float": "fp32",
        }
        key = aliases.get(key, key)
        if key not in ("bf16", "fp16", "fp32"):
            raise UserError(f"no peak figure for dtype {dtype!r}; use bf16, fp16 or fp32")
        return float(getattr(self, f"peak_tflops_{key}"))

    def describe(self) -> str:
        """One line with the figures; emulated kinds say how they are emulated."""
        text = (
            f"{self.label}: {self.vendor}, {self.device_type} via {self.native_backend} "
            f"({self.collective_library}), {self.memory_gib:g} GiB, "
            f"{self.peak_tflops_bf16:g} TFLOP/s bf16, {self.memory_bandwidth_gbps:g} GB/s "
            f"memory, {self.intra_node_bandwidth_gbps:g} GB/s intra-node"
        )
        if self.emulated:
            cap = f", memory cap {self.memory_cap_gib:g} GiB" if self.memory_cap_gib else ""
            text += f"; emulated on the host CPU with slowdown x{self.slowdown:g}{cap}"
        return text

    def replace(self, **changes: Any) -> AcceleratorSpec:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain fields; ``AcceleratorSpec(**d)`` rebuilds it."""
        return dataclasses.asdict(self)


def _check_number(where: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where}: {key} must be a number, got {value!r}")


def _check_positive(where: str, key: str, value: Any) -> None:
    _check_number(where, key, value)
    if value <= 0:
        raise UserError(f"{where}: {key} must be positive, got {value}")


# The vendor's identity is fixed; each part's figures are passed by keyword at the call.
_nvidia = functools.partial(
    AcceleratorSpec,
    vendor="nvidia",
    native_backend="nccl",
    collective_library="nccl",
    device_type="cuda",
)

# ROCm builds of torch expose RCCL under the "nccl" backend name and "cuda" device type.
_amd = functools.partial(
    AcceleratorSpec,
    vendor="amd",
    native_backend="nccl",
    collective_library="rccl",
    device_type="cuda",
)


def _host_cpu(name: str, slowdown: float, emulated: bool) -> AcceleratorSpec:
    # Nominal figures for a generic multi-core host, not a specific part: measure the machine
    # with tools/profile_device.py and override them in YAML. An emulated kind's figures are the
    # host's divided by its slowdown, so roofline estimates and emulated runs agree.
    return AcceleratorSpec(
        name=name,
        vendor="cpu",
        native_backend="gloo",
        collective_library="gloo",
        device_type="cpu",
        memory_gib=16,
        peak_tflops_bf16=0.5 / slowdown,
        peak_tflops_fp16=0.5 / slowdown,
        peak_tflops_fp32=0.5 / slowdown,
        memory_bandwidth_gbps=50 / slowdown,
        intra_node_bandwidth_gbps=10,
        emulated=emulated,
        slowdown=slowdown,
    )


BUILTIN_ACCELERATORS: tuple[AcceleratorSpec, ...] = (
    # NVIDIA A100 Tensor Core GPU datasheet (SXM): 312 TFLOP/s BF16/FP16 dense, 19.5 FP32,
    # 40GB HBM2 at 1,555 GB/s, third-generation NVLink 600 GB/s.
    _nvidia(
        "A100-40G",
        memory_gib=40,
        peak_tflops_bf16=312,
        peak_tflops_fp16=312,
        peak_tflops_fp32=19.5,
        memory_bandwidth_gbps=1555,
        intra_node_bandwidth_gbps=600,
    ),
    # Same datasheet, 80GB SXM: HBM2e at 2,039 GB/s.
    _nvidia(
        "A100-80G",
        memory_gib=80,
        peak_tflops_bf16=312,
        peak_tflops_fp16=312,
        peak_tflops_fp32=19.5,
        memory_bandwidth_gbps=2039,
        intra_node_bandwidth_gbps=600,
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s BF16/FP16 dense (1,979 with
    # sparsity), 67 FP32, 80GB HBM3 at 3.35 TB/s, fourth-generation NVLink 900 GB/s.
    _nvidia(
        "H100",
        memory_gib=80,
        peak_tflops_bf16=989,
        peak_tflops_fp16=989,
        peak_tflops_fp32=67,
        memory_bandwidth_gbps=3350,
        intra_node_bandwidth_gbps=900,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): H100 compute, 141GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s.
    _nvidia(
        "H200",
        memory_gib=141,
        peak_tflops_bf16=989,
        peak_tflops_fp16=989,
        peak_tflops_fp32=67,
        memory_bandwidth_gbps=4800,
        intra_node_bandwidth_gbps=900,
    ),
    # AMD Instinct MI250X datasheet, per module: 383 TFLOP/s FP16/BF16, 47.9 FP32 vector, 128GB
    # HBM2e at 3.2 TB/s, up to 800 GB/s aggregate Infinity Fabric. A module holds 2 GCDs, each a
    # separate device, so every figure here is half the module's.
    _amd(
        "MI250X",
        memory_gib=64,
        peak_tflops_bf16=191.5,
        peak_tflops_fp16=191.5,
        peak_tflops_fp32=23.95,
        memory_bandwidth_gbps=1600,
        intra_node_bandwidth_gbps=400,
    ),
    # AMD Instinct MI300X datasheet: 1,307.4 TFLOP/s FP16/BF16 dense, 163.4 FP32, 192GB HBM3 at
    # 5.3 TB/s, 7 Infinity Fabric links of 128 GB/s (896 GB/s aggregate).
    _amd(
        "MI300X",
        memory_gib=192,
        peak_tflops_bf16=1307.4,
        peak_tflops_fp16=1307.4,
        peak_tflops_fp32=163.4,
        memory_bandwidth_gbps=5300,
        intra_node_bandwidth_gbps=896,
    ),
    # Huawei Ascend 910B: Huawei publishes no full datasheet for it; these are published figures
    # as commonly reported: ~320 TFLOP/s FP16 (BF16 the same), ~80 FP32, 64GB HBM2e at ~1.6 TB/s,
    # HCCS 392 GB/s (7 links of 56 GB/s). Override them in YAML with your site's numbers.
    AcceleratorSpec(
        name="Ascend910B",
        vendor="huawei",
        native_backend="hccl",
        collective_library="hccl",
        device_type="npu",
        memory_gib=64,
        peak_tflops_bf16=320,
        peak_tflops_fp16=320,
        peak_tflops_fp32=80,
        memory_bandwidth_gbps=1600,
        intra_node_bandwidth_gbps=392,
    ),
    _host_cpu("cpu", slowdown=1.0, emulated=False),
    # Emulated kinds for dry runs of a mixed cluster on one CPU machine: emu-slow runs at about
    # half the speed of emu-fast.
    _host_cpu("emu-fast", slowdown=1.0, emulated=True),
    _host_cpu("emu-slow", slowdown=2.0, emulated=True),
)

_SPEC_FIELDS = {f.name: f for f in dataclasses.fields(AcceleratorSpec)}
_ENTRY_KEYS = sorted(set(_SPEC_FIELDS) - {"name"} | {"base"})


class AcceleratorRegistry:
    """Accelerator kinds by name; lookups ignore case, names are otherwise exact."""

    def __init__(self, specs: Mapping[str, AcceleratorSpec] | tuple[AcceleratorSpec, ...]):
        values = specs.values() if isinstance(specs, Mapping) else specs
        self._specs: dict[str, AcceleratorSpec] = {}
        for spec in values:
            if spec.name.lower() in self._specs:
                raise UserError(f"accelerator {spec.name!r} is defined twice")
            self._specs[spec.name.lower()] = spec

    @classmethod
    def builtin(cls) -> AcceleratorRegistry:
        """A fresh registry holding the built-in kinds."""
        return cls(BUILTIN_ACCELERATORS)

    def names(self) -> list[str]:
        return [spec.name for spec in self._specs.values()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._specs

    def __iter__(self) -> Iterator[AcceleratorSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def get(self, name: str) -> AcceleratorSpec:
        """The kind called ``name`` (any case); a UserError lists the known names."""
        spec = self._specs.get(str(name).lower())
        if spec is None:
            raise UserError(f"unknown accelerator {name!r}; known: {', '.join(self.names())}")
        return spec

    def with_overrides(self, entries: Mapping[str, Any]) -> AcceleratorRegistry:
        """A new registry with YAML-style ``entries`` merged in (this one is unchanged).

        ``entries`` maps a kind name to its fields. For a built-in name (any case) the given
        fields replace the built-in's; a new name needs every field, or ``base: <kind>`` to start
        from an existing kind's figures.
        """
        if not isinstance(entries, Mapping):
            raise UserError("accelerators: must be a mapping of kind name to its fields")
        specs = dict(self._specs)
        for name, fields in entries.items():
            spec = _merge_entry(self, str(name), fields)
            specs[spec.name.lower()] = spec
        return AcceleratorRegistry(tuple(specs.values()))

    def load_overrides(self, path: str | Path) -> AcceleratorRegistry:
        """Merge the ``accelerators:`` section of a YAML file (or the whole file if it has none)."""
        data = read_yaml_mapping(path, "accelerator file")
        return self.with_overrides(data.get("accelerators", data))


def _merge_entry(registry: AcceleratorRegistry, name: str, fields: Any) -> AcceleratorSpec:
    where = f"accelerator {name!r}"
    if not isinstance(fields, Mapping):
        raise UserError(f"{where}: expected a mapping of fields, got {fields!r}")
    unknown = sorted(set(map(str, fields)) - set(_ENTRY_KEYS))
    if unknown:
        raise UserError(
            f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(_ENTRY_KEYS)}"
        )
    fields = dict(fields)
    base_name = fields.pop("base", None)
    if base_name is not None:
        base = registry.get(str(base_name)).to_dict()
        base["name"] = name
    elif name in registry:
        base = registry.get(name).to_dict()
    else:
        missing = [
            k
            for k, f in _SPEC_FIELDS.items()
            if k != "name" and k not in fields and f.default is dataclasses.MISSING
        ]
        if missing:
            raise UserError(
                f"{where} is not built in, so it needs {', '.join(missing)} "
                f"(or base: <a known kind>)"
            )
        base = {"name": name}
    base.update(fields)
    return AcceleratorSpec(**base)


def get_accelerator(name: str, registry: AcceleratorRegistry | None = None) -> AcceleratorSpec:
    """Look up a kind by name (any case) in ``registry`` or the built-ins."""
    return (registry or AcceleratorRegistry.builtin()).get(name)
