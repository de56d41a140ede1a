"""What a check process gets: where to write rows and files, how long it has, the options."""

from __future__ import annotations

import os
import pathlib
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tools.gpu_check.report import RowWriter
from tools.gpu_check.runner import GRACE_S, CommandResult, run_command

REPO = pathlib.Path(__file__).resolve().parents[2]
DATA_DIR = REPO / "scripts" / "gpu_check"


def loopback_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with gloo on the loopback interface unless it names one (every rank of the
    check runs on this host, whose name need not resolve to a usable address)."""
    env = dict(environ)
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _torchrun_has(option: str) -> bool:
    """Whether this torch's torchrun takes ``option``."""
    from torch.distributed.run import get_args_parser

    return option in get_args_parser()._option_string_actions


@dataclass(frozen=True)
class Options:
    """The command line's settings that checks read.

    ``cpu_only``: the GPU is hidden on purpose, so a missing device is a SKIP, not a FAIL.
    ``pair_kind`` is the accelerator of the pair's first rank (H200 on the GPU host; "cpu" runs
    the pair's logic without a GPU, for development). ``mfu_micro_batch`` is the first
    micro-batch size the MFU runs try (halved on out-of-memory); ``mfu_flags`` are extra
    ``pretrain_llama.py`` flags for both (``--compile`` among them leaves the compiled run
    alone).
    """

    cpu_only: bool = False
    pair_kind: str = "H200"
    mfu_micro_batch: int = 4
    mfu_iters: int = 10
    mfu_flags: tuple[str, ...] = ()


@dataclass
class CheckContext:
    """One check's process: ``rows`` records results, ``work`` holds its files, ``deadline``
    is the monotonic time its budget ends (the runner kills it then)."""

    rows: RowWriter
    work: pathlib.Path
    deadline: float
    options: Options = field(default_factory=Options)
    python: str = sys.executable
    env: Mapping[str, str] = field(default_factory=lambda: loopback_env(os.environ))

    def remaining(self) -> float:
        """Seconds left of this check's budget."""
        return self.deadline - time.monotonic()

    def sub_timeout(self, wanted_s: float, reserve_s: float = GRACE_S + 4.0) -> float:
        """A sub-run's timeout: ``wanted_s``, cut to what the budget leaves after ``reserve_s``
        (a timed-out sub-run's grace before SIGKILL, then time to compare and report)."""
        return max(1.0, min(wanted_s, self.remaining() - reserve_s))

    def run(
        self,
        argv: Sequence[str],
        wanted_s: float,
        log_name: str,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run a sub-command in the repository root under :meth:`sub_timeout`; its log is
        ``work/log_name``."""
        return run_command(
            argv,
            self.sub_timeout(wanted_s),
            self.work / log_name,
            env=self.env if env is None else env,
            cwd=str(REPO),
        )

    def torchrun(self, nproc: int) -> list[str]:
        """The launcher prefix for ``nproc`` local ranks (a free port of its own), on the
        loopback address: this host's name need not resolve."""
        return [
            self.python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            *(["--local-addr", "127.0.0.1"] if _torchrun_has("--local-addr") else []),
            "--nproc_per_node",
            str(nproc),
        ]
