"""A request to stop the run at the end of the current iteration (SIGTERM by default)."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any


class StopRequest:
    """Set by a signal handler; the trainer saves and stops at the end of the current iteration
    (every rank agrees on that iteration, see :mod:`megatron_het.training.trainer`)."""

    def __init__(self) -> None:
        self.requested = False
        self.reason = ""

    def request(self, signum: int, _frame: Any = None) -> None:
        """Signal-handler signature: remember that ``signum`` asked the run to stop."""
        self.requested = True
        self.reason = signal.Signals(signum).name

    def install(self, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        """Route ``signals`` to :meth:`request` (process-wide; call from the entry point)."""
        for signum in signals:
            signal.signal(signum, self.request)
