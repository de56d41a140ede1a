"""``python -m megatron_het.gpucheck``: see :mod:`megatron_het.gpucheck.cli`."""

from megatron_het.gpucheck.cli import entry

if __name__ == "__main__":
    entry()
