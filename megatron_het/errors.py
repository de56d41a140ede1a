"""User-facing errors.

A ``UserError`` is something the user can fix (a bad flag, a missing file, a plan that does not
fit). Entry points catch it through :func:`run_cli` and print one line, exiting non-zero without a
traceback. A ``PeerFailure`` is a run that lost a peer (dead, hung, unreachable): one line too,
exit status 1, and the process ends at once so that no teardown waits on the lost peer. Bugs
raise any other exception and keep their traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn


class UserError(Exception):
    """An error caused by user input; its message is one line that says how to fix it."""


class RanksError(UserError):
    """A UserError that every rank of a launched run raises alike: its message names the ranks
    it concerns (``ranks``; empty: every rank)."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class PeerFailure(Exception):
    """A peer of a parallel run died, hung or became unreachable; the message is one line."""


EXIT_USER_ERROR = 2
EXIT_PEER_FAILURE = 1


def fail(message: str) -> NoReturn:
    """Print ``error: message`` to stderr and exit with status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USER_ERROR)


def run_cli(main: Callable[[], object]) -> None:
    """Run an entry point, turning a UserError into one line on stderr and exit status 2."""
    try:
        main()
    except UserError as exc:
        fail(str(exc))
    except PeerFailure as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_PEER_FAILURE)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
