"""Entry points ask torch for huge pages unless the user chose otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

from megatron_het.launcher.host_memory import THP_VARIABLE, prefer_huge_pages


def test_sets_the_variable_when_absent() -> None:
    environ: dict[str, str] = {}
    assert prefer_huge_pages(environ) is True
    assert environ == {THP_VARIABLE: "1"}


def test_keeps_the_users_choice() -> None:
    environ = {THP_VARIABLE: "0"}
    assert prefer_huge_pages(environ) is False
    assert environ == {THP_VARIABLE: "0"}


def test_pretrain_entry_sets_it_before_parsing() -> None:
    """``pretrain_llama.py`` sets the variable in its own process, where torch reads it: a
    command line the parser refuses still runs the entry point's first lines, and the
    variable set there is visible to a probe run the same way."""
    probe = (
        "import os, runpy, sys; sys.argv = ['pretrain_llama.py', '--help'];\n"
        "try:\n    runpy.run_path('pretrain_llama.py', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        f"print(os.environ.get('{THP_VARIABLE}'), file=sys.stderr)"
    )
    env = {k: v for k, v in os.environ.items() if k != THP_VARIABLE}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stderr.strip().splitlines()[-1] == "1"
