"""A shell file's exported variables: source it through bash and read the environment it leaves.

Sites describe their node settings as shell files (HET_EXTRA_ENV, Ascend's CANN ``set_env.sh``):
they may compute values, append to PATH or unset a variable. Rather than parse shell, the
launcher runs ``bash`` to source the file in the environment built so far and takes the
environment bash then exports, as a launch script that sourced the file would have had.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

from megatron_het.errors import UserError

# Variables bash sets for itself, not the file's doing: kept as they were.
_BASH_OWN = ("_", "SHLVL", "PWD", "OLDPWD")
# Source the file (its arguments: none), then print the environment, NUL-separated.
_SCRIPT = 'source "$1" && exec env -0'


def source_shell_file(path: str | Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment ``environ`` becomes once bash has sourced ``path`` in it: the file's
    exported variables set or changed, those it unset removed (plain shell variables, not
    exported, are not part of it, as in a script that sources the file). UserError when the
    file is missing or fails (its status and last line of error output)."""
    if not Path(path).is_file():
        raise UserError(f"{path} not found; point the variable that names it at a shell file")
    result = subprocess.run(
        ["bash", "-c", _SCRIPT, "bash", str(path)],
        env=dict(environ),
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        lines = result.stderr.decode(errors="replace").strip().splitlines()
        why = f": {lines[-1]}" if lines else ""
        raise UserError(f"sourcing {path} failed with status {result.returncode}{why}")
    entries = (entry.partition("=") for entry in result.stdout.decode().split("\0") if entry)
    sourced = {name: value for name, _, value in entries if name not in _BASH_OWN}
    for name in _BASH_OWN:
        if name in environ:
            sourced[name] = environ[name]
    return sourced
