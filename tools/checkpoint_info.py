"""List and verify the checkpoints of a --save directory (or one iter_XXXXXXX directory).

    python tools/checkpoint_info.py checkpoints/            # every iteration, verified
    python tools/checkpoint_info.py checkpoints/ --json     # the same as JSON

Exits 1 when the latest committed iteration does not verify. See
:mod:`megatron_het.checkpoint.info`.
"""

from __future__ import annotations

import sys

from megatron_het.checkpoint.info import main
from megatron_het.errors import run_cli

if __name__ == "__main__":
    run_cli(lambda: sys.exit(main(sys.argv[1:])))
