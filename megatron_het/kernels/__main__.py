"""``python -m megatron_het.kernels``: which implementation each fused op runs here, and why.

One row per op family and device type (the CPU, and "cuda", which is CUDA or ROCm as torch is
built): our compiled kernel (csrc C++ / CUDA / HIP), apex's, liger's, or the torch reference,
with the reason where a compiled one is missing. ``--json`` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from megatron_het.kernels.extension import EXTENSION
from megatron_het.kernels.selection import FAMILIES, implementation_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_het.kernels", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    rows = implementation_table()
    if args.json:
        print(json.dumps([dataclasses.asdict(row) for row in rows], indent=1))
        return 0
    device = "none"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    built = "loaded" if EXTENSION.loaded else EXTENSION.why
    print(f"torch {torch.__version__}; accelerator: {device}; megatron_het._C: {built}")
    width = max(len(f) for f in FAMILIES) + 2
    print(f"{'op':<{width}}{'device':<8}{'implementation':<16}why not compiled")
    for row in rows:
        print(f"{row.family:<{width}}{row.device_type:<8}{row.name:<16}{row.why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
