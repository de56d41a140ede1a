"""Search the best parallel plan for a Llama model on a mixed cluster, or evaluate a given one.

    python tools/plan.py --cluster scripts/clusters/hethub_llama140b.yaml --model llama-140b \\
        --global-batch-size 1024 --seq-length 4096 --out plan.json --report plan.md --json

See ``python tools/plan.py --help`` and :mod:`megatron_het.planner.cli`.
"""

from __future__ import annotations

import sys

from megatron_het.errors import run_cli
from megatron_het.planner.cli import run

if __name__ == "__main__":
    run_cli(lambda: run(sys.argv[1:]))
