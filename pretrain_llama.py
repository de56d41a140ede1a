"""Pretrain a Llama model with Megatron-style flags; see ``python pretrain_llama.py --help``.

SIGTERM makes the run save a checkpoint at the end of the current iteration (with --save) and exit
with status 0; resume it with --load.
"""
from __future__ import annotations

import sys

from megatron_het.arguments import parse_run_config
from megatron_het.errors import run_cli


def main() -> None:
    run = parse_run_config(sys.argv[1:])
    # Imported after parsing so --help and command-line mistakes answer without loading torch.
    from megatron_het.training import StopRequest, pretrain

    stop = StopRequest()
    stop.install()
    pretrain(run, stop=stop)


if __name__ == "__main__":
    run_cli(main)
