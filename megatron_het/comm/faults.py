"""Errors raised by the unified communicator.

A failed collective (a dead or hung peer, a broken connection) surfaces as :class:`CommError`
naming the unified group, the operation and the backend group it was running on, instead of a
bare backend message or a hang. The timeout is the one given to the communicator; every backend
group it creates is created with it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


class CommError(RuntimeError):
    """A collective or transfer failed; ``group`` and ``op`` say which."""

    def __init__(self, group: str, op: str, detail: str) -> None:
        super().__init__(f"unified group '{group}': {op} failed: {detail}")
        self.group = group
        self.op = op


class CollectiveMismatchError(CommError):
    """Debug mode found that ranks called an operation with different shapes or dtypes."""


_SOURCE_PREFIX = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
_BOILERPLATE = re.compile(r"\s*This is typically caused by .*$")


def line_to_bytes(text: str, size: int) -> torch.Tensor:
    """``text`` as a uint8 CPU tensor of ``size`` bytes (UTF-8, cut at ``size``, zero-padded),
    to carry a one-line message across ranks in a collective; :func:`line_from_bytes` reads
    it back."""
    import torch

    out = torch.zeros(size, dtype=torch.uint8)
    encoded = text.encode()[:size]
    if encoded:
        out[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    return out


def line_from_bytes(tensor: torch.Tensor) -> str:
    """The text :func:`line_to_bytes` wrote (any integer dtype and device)."""
    import torch

    return bytes(tensor.to("cpu", torch.uint8).tolist()).rstrip(b"\0").decode(errors="replace")


def first_line(exc: BaseException | str) -> str:
    """The first non-empty line of an exception message (backend messages run long), or of a
    text, without the C++ source locations backends put in front of their messages."""
    for line in str(exc).splitlines():
        if line.strip():
            return _BOILERPLATE.sub("", _SOURCE_PREFIX.sub("", line)).strip()
    return type(exc).__name__


def guarded(group: str, op: str, where: str, fn: Callable[[], T]) -> T:
    """Run ``fn``; turn a backend ``RuntimeError`` into a :class:`CommError` naming group and op."""
    try:
        return fn()
    except CommError:
        raise
    except RuntimeError as exc:
        raise CommError(group, op, f"{where}: {first_line(exc)}") from exc
