"""Installs megatron_het and builds its fused kernels (csrc/) as the extension megatron_het._C.

The kernels are built with torch.utils.cpp_extension (ninja when installed): the C++ CPU
implementations always, and the CUDA ones where torch is built for CUDA and nvcc is found, or
their HIP conversion (hipify, done by cpp_extension) where torch is built for ROCm and hipcc is
found. A kernel build never fails the install: without a compiler, or when a build fails, the
package installs without (or with fewer) kernels and every op runs its torch reference;
``python -m megatron_het.kernels`` says which implementation each op uses and why.

Environment:
    MEGATRON_HET_KERNELS_BUILD=none|cpu|auto   auto (default): CPU and, where possible, device
    TORCH_CUDA_ARCH_LIST                        CUDA targets (default "8.0;9.0+PTX")
    PYTORCH_ROCM_ARCH                           ROCm targets (default: torch's own list)
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

CUDA_ARCHS = "8.0;9.0+PTX"  # A100 and H100/H200; PTX for newer parts


def _log(message: str) -> None:
    print(f"[megatron_het kernels] {message}", file=sys.stderr)


def _device_toolchain(torch, cpp_extension) -> tuple[str | None, str]:
    """``("cuda" | "rocm" | None, why)`` for the device half of the build."""
    if getattr(torch.version, "hip", None):
        if cpp_extension.ROCM_HOME is None or not shutil.which(
            "hipcc", path=_rocm_bin(cpp_extension)
        ):
            return None, "torch is built for ROCm but hipcc was not found (set ROCM_HOME)"
        return "rocm", f"HIP from {cpp_extension.ROCM_HOME}"
    if torch.version.cuda is None:
        return None, "torch is built without CUDA or ROCm"
    if cpp_extension.CUDA_HOME is None:
        return None, "torch is built for CUDA but nvcc was not found (set CUDA_HOME)"
    return "cuda", f"CUDA from {cpp_extension.CUDA_HOME}"


def _rocm_bin(cpp_extension) -> str:
    return os.pathsep.join([os.path.join(cpp_extension.ROCM_HOME or "", "bin"), os.environ["PATH"]])


def kernel_build() -> tuple[list, dict]:
    """``(ext_modules, cmdclass)`` for the kernels, empty where they cannot be built."""
    mode = os.environ.get("MEGATRON_HET_KERNELS_BUILD", "auto")
    if mode not in ("none", "cpu", "auto"):
        _log(f"MEGATRON_HET_KERNELS_BUILD={mode!r} is not none, cpu or auto; building none")
        return [], {}
    if mode == "none":
        _log("not built (MEGATRON_HET_KERNELS_BUILD=none)")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # torch absent or broken: install the package alone
        _log(f"not built: torch does not import ({exc})")
        return [], {}

    class OptionalBuildExtension(cpp_extension.BuildExtension):
        """Builds the kernels if it can; a failed build leaves the torch references."""

        def build_extension(self, ext) -> None:
            try:
                super().build_extension(ext)
            except Exception as exc:
                _log(f"build failed, the torch references will run: {exc}")

    sources = ["csrc/ops.cpp", *sorted(glob.glob("csrc/*/*_cpu.cpp"))]
    # -g0: the interpreter's build flags ask for debug information, which takes a quarter of
    # the compile time of these template-heavy sources and is not shipped
    cxx = ["-O3", "-g0", "-fopenmp-simd"]
    # at::parallel_for runs its threads only in code built with OpenMP (torch's own libgomp is
    # the one loaded at run time, so there is one OpenMP runtime in the process).
    openmp = sys.platform.startswith("linux")
    if openmp:
        cxx.append("-fopenmp")
    device, why = _device_toolchain(torch, cpp_extension) if mode == "auto" else (None, mode)
    kwargs: dict = {
        "include_dirs": [os.path.abspath("csrc")],
        "extra_link_args": ["-fopenmp"] if openmp else [],
    }
    if device is None:
        _log(f"building the CPU kernels (no device kernels: {why})")
        extension = cpp_extension.CppExtension(
            "megatron_het._C", sources, extra_compile_args={"cxx": cxx}, **kwargs
        )
    else:
        _log(f"building the CPU and device kernels ({why})")
        if device == "cuda":
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", CUDA_ARCHS)
        device_sources = sorted(glob.glob("csrc/*/*_cuda.cu")) + sorted(
            glob.glob("csrc/*/*_cuda.cpp")
        )
        extension = cpp_extension.CUDAExtension(
            "megatron_het._C",
            sources + device_sources,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
            **kwargs,
        )
    return [extension], {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = kernel_build()

setup(
    name="megatron_het",
    version="0.1.0",
    description="Megatron-style Llama pretraining on heterogeneous accelerator clusters",
    packages=find_packages(include=["megatron_het", "megatron_het.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "numpy",
        "sentencepiece",
        "tensorboard",
        "pyyaml",
        "tqdm",
        "matplotlib",
    ],
    extras_require={"hf": ["transformers", "safetensors"], "test": ["pytest", "pytest-xdist"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
