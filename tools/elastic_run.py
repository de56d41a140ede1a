"""Run pretrain_llama.py under torchrun and continue on the devices left when one is lost.

    python tools/elastic_run.py [--max-restarts 3] -- --cluster C.yaml --save DIR \\
        --plan P.json ... (the other flags of pretrain_llama.py)

    # a multi-node job: on node K of the cluster file (DIR on a shared filesystem)
    python tools/elastic_run.py --node-rank K --master-addr NODE0 --master-port 29500 -- ...

After a lost peer the run is relaunched on the cluster without the lost devices, with
``--plan auto`` and ``--load DIR`` (one host: torchrun --standalone; several: every node's
supervisor relaunches its node at its place in the cluster left). See
:mod:`megatron_het.launcher.supervisor`.
"""

from __future__ import annotations

import os
import sys

from megatron_het.errors import run_cli
from megatron_het.launcher.supervisor import main

if __name__ == "__main__":
    run_cli(lambda: sys.exit(main(sys.argv[1:], os.environ)))
