"""Pretrain a Llama model with Megatron-style flags; see ``python pretrain_llama.py --help``.

One process trains on one device, as the one-stage, one-rank plan. Under torchrun
(``python -m torch.distributed.run --nproc_per_node N pretrain_llama.py ...``) the run is spread
over the ranks as the plan says (``--plan``, ``--plan auto``, or Megatron's TP/PP flags).
``--dry-run`` checks plan, cluster, model and batch and prints the plan's predicted iteration
time without starting processes.

SIGTERM makes the run save a checkpoint at the end of the current iteration (with --save; every
rank agrees on that iteration) and exit with status 0; resume it with --load.
"""

from __future__ import annotations

import os
import sys

from megatron_het.errors import run_cli
from megatron_het.launcher.host_memory import prefer_huge_pages
from megatron_het.training.entry import main

if __name__ == "__main__":
    prefer_huge_pages(os.environ)  # before torch allocates: see host_memory
    run_cli(lambda: main(sys.argv[1:], os.environ))
