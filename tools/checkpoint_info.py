"""List and verify the checkpoints of a --save directory (or one iter_XXXXXXX directory).

    python tools/checkpoint_info.py checkpoints/            # every iteration, verified
    python tools/checkpoint_info.py checkpoints/ --json     # the same as JSON

Exits 1 when the latest committed iteration does not verify. What is checked:
:mod:`megatron_het.checkpoint.info`.
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Sequence
from typing import TextIO

from megatron_het.arguments.parser import ArgParser
from megatron_het.checkpoint.info import format_text, inspect_checkpoints, verdict
from megatron_het.errors import run_cli


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    """``checkpoint_info.py DIR [--json]``: print the listing; 0 when the latest committed
    iteration verifies, 1 when it does not or nothing is committed."""
    parser = ArgParser(prog="checkpoint_info.py", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("dir", help="a --save directory or one of its iter_XXXXXXX directories")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(list(argv))
    out = out or sys.stdout
    listing = inspect_checkpoints(pathlib.Path(args.dir))
    target = listing.latest_committed()
    ok = target is not None and target.verified
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(listing.path),
                    "tracker": listing.tracker,
                    "latest_committed": None if target is None else target.iteration,
                    "latest_verified": ok,
                    "verdict": verdict(target),
                    "iterations": [i.to_json() for i in listing.iterations],
                },
                indent=2,
            ),
            file=out,
        )
    else:
        print(format_text(listing), file=out)
        print(verdict(target), file=out)
    return 0 if ok else 1


if __name__ == "__main__":
    run_cli(lambda: sys.exit(main(sys.argv[1:])))
