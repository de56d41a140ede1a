"""The names in a save directory: the tracker, iteration directories and their metadata file
(the layout :mod:`megatron_het.checkpoint.io` describes)."""

from __future__ import annotations

import re

TRACKER_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
_ITERATION_DIR = re.compile(r"iter_(\d+)")


def iteration_dir_name(iteration: int) -> str:
    """``iter_0000012`` for iteration 12."""
    return f"iter_{iteration:07d}"


def parse_iteration_dir(name: str) -> int | None:
    """12 for ``iter_0000012``; None for any other name."""
    match = _ITERATION_DIR.fullmatch(name)
    return int(match.group(1)) if match else None
