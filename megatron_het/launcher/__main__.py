"""``python -m megatron_het.launcher scripts/<mix>/mix_<size>.yaml [flags]``: launch a mix on
this node (what the mix's ``pretrain_llama_<size>.sh`` runs; ``--help`` lists the modes, flags
and variables). The only place of the per-node launch that reads argv and the environment."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from megatron_het.errors import run_cli
from megatron_het.launcher.node_launch import main

REPO = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    run_cli(
        lambda: sys.exit(
            main(sys.argv[1:], dict(os.environ), REPO, sys.executable, socket.gethostname())
        )
    )
