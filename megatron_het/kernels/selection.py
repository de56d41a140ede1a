"""Which implementation each fused op runs: our compiled kernels (``csrc/``), apex's or liger's,
or the torch reference.

:class:`KernelChoice` is what a run allows (Megatron's flags: ``--no-rope-fusion``,
``--no-bias-swiglu-fusion``, ``--no-gradient-accumulation-fusion``, and ours:
``--no-rms-norm-fusion``, ``--no-cross-entropy-loss-fusion``, ``--reference-kernels`` for every
op's torch reference);
:func:`implementation` is what then runs for one op family on one device type, in this order of
preference: csrc (C++ on CPU, CUDA or HIP on an accelerator), apex, liger, torch. Under
``torch.compile`` every op runs its torch code, which inductor fuses with its neighbours.
"""

from __future__ import annotations

import dataclasses

from megatron_het.kernels.apex_norm import apex_rms_norm_available
from megatron_het.kernels.extension import EXTENSION, KernelExtension
from megatron_het.kernels.liger import LIGER, LigerKernels

FAMILIES = ("rms_norm", "rope", "cross_entropy", "swiglu")
TORCH = "torch"


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The fused kernels a run allows; every field off runs the torch references.

    ``libraries``: apex's and liger's kernels may run where installed (on CUDA/ROCm tensors).
    ``gradient_accumulation_fusion``: linear layers add their weight gradient into ``main_grad``
    or ``.grad`` in their backward GEMM (:mod:`megatron_het.kernels.wgrad_fusion`).
    """

    rms_norm: bool = True
    rope: bool = True
    cross_entropy: bool = True
    swiglu: bool = True
    libraries: bool = True
    gradient_accumulation_fusion: bool = True

    @classmethod
    def references(cls) -> KernelChoice:
        """Every op on its torch reference (``--reference-kernels``), for comparisons."""
        return cls(*(False for _ in dataclasses.fields(cls)))

    @classmethod
    def from_flags(
        cls,
        rope: bool = True,
        rms_norm: bool = True,
        cross_entropy: bool = True,
        swiglu: bool = True,
        reference: bool = False,
        gradient_accumulation_fusion: bool = True,
    ) -> KernelChoice:
        """From the flags ``--no-rope-fusion``, ``--no-rms-norm-fusion``,
        ``--no-cross-entropy-loss-fusion``, ``--no-bias-swiglu-fusion``,
        ``--no-gradient-accumulation-fusion`` (each False when given) and
        ``--reference-kernels`` (``reference``: all off)."""
        if reference:
            return cls.references()
        return cls(
            rms_norm=rms_norm,
            rope=rope,
            cross_entropy=cross_entropy,
            swiglu=swiglu,
            gradient_accumulation_fusion=gradient_accumulation_fusion,
        )

    def allows(self, family: str) -> bool:
        return bool(getattr(self, family))


ALL_FUSED = KernelChoice()


@dataclasses.dataclass(frozen=True)
class Implementation:
    """What runs for one op family on one device type: ``name`` ("csrc C++", "csrc CUDA",
    "csrc HIP", "apex", "liger" or "torch") and ``why`` (the reason for a torch fallback)."""

    family: str
    device_type: str
    name: str
    why: str = ""

    @property
    def compiled(self) -> bool:
        """Whether this is one of our csrc kernels."""
        return self.name.startswith("csrc")


def csrc_name(device_type: str, extension: KernelExtension = EXTENSION) -> str:
    return "csrc C++" if device_type == "cpu" else f"csrc {extension.device_flavour()}"


def implementation(
    family: str,
    device_type: str,
    choice: KernelChoice = ALL_FUSED,
    extension: KernelExtension = EXTENSION,
    liger: LigerKernels = LIGER,
    apex_rms_norm: bool | None = None,
) -> Implementation:
    """The implementation of ``family`` (one of :data:`FAMILIES`) on ``device_type`` in eager
    mode. ``apex_rms_norm`` overrides whether apex's norm is installed (default: asked)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown op family {family!r}; one of {', '.join(FAMILIES)}")
    if not choice.allows(family):
        return Implementation(family, device_type, TORCH, "turned off by its flag")
    if extension.supports(family, device_type):
        return Implementation(family, device_type, csrc_name(device_type, extension))
    fallback = _library(family, device_type, choice, liger, apex_rms_norm)
    if fallback is not None:
        return Implementation(family, device_type, fallback)
    return Implementation(family, device_type, TORCH, _why_not_csrc(device_type, extension))


def _library(
    family: str,
    device_type: str,
    choice: KernelChoice,
    liger: LigerKernels,
    apex_rms_norm: bool | None,
) -> str | None:
    if not choice.libraries or device_type != "cuda":
        return None
    if family == "rms_norm":
        if apex_rms_norm is None:
            apex_rms_norm = apex_rms_norm_available()
        if apex_rms_norm:
            return "apex"
    kernel = {
        "rms_norm": liger.rms_norm,
        "swiglu": liger.swiglu,
        "cross_entropy": liger.linear_cross_entropy,
    }.get(family)
    return "liger" if kernel is not None else None


def _why_not_csrc(device_type: str, extension: KernelExtension) -> str:
    if not extension.loaded:
        return extension.why
    if device_type == "cpu":
        return "the extension has no CPU kernel for it (rebuild: make setup)"
    return f"the extension was built without {extension.device_flavour()} kernels"


def implementation_table(
    device_types: tuple[str, ...] = ("cpu", "cuda"),
    choice: KernelChoice = ALL_FUSED,
    extension: KernelExtension = EXTENSION,
) -> list[Implementation]:
    """:func:`implementation` of every family on every one of ``device_types``."""
    return [
        implementation(family, device, choice, extension)
        for family in FAMILIES
        for device in device_types
    ]


def describe(implementations: list[Implementation]) -> str:
    """One line for a run's start-up: ``family=name`` per family (device types joined)."""
    by_family: dict[str, list[str]] = {}
    for impl in implementations:
        by_family.setdefault(impl.family, []).append(impl.name)
    return ", ".join(
        f"{family}: {'/'.join(dict.fromkeys(names))}" for family, names in by_family.items()
    )
