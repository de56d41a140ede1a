"""Debug mode: check that every rank calls the same operation with matching tensors.

Before each collective, every rank all-gathers a small int64 descriptor (op, dtype, shape and one
op argument such as the reduce op or the broadcast source) over the group's bridge link. If the
descriptors differ, every rank raises :class:`CollectiveMismatchError` saying which ranks passed
what, instead of hanging or silently reducing mismatched buffers. It costs one tiny all-gather
per operation, so it is off by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_het.comm.faults import CollectiveMismatchError
from megatron_het.comm.links import Link

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier")
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.float64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
)
REDUCE_OPS = ("sum", "avg", "max", "min")  # codes of the reduce-op argument
MAX_DIMS = 8
_WIDTH = 4 + MAX_DIMS  # op, dtype code, ndim, argument, shape...
NO_SHAPE = -2  # the op allows a different shape on every rank (e.g. all_to_all)


def describe(
    op: str, tensor: torch.Tensor | None, argument: int = 0, check_shape: bool = True
) -> torch.Tensor:
    """The descriptor row for ``op`` on ``tensor`` (int64, CPU, ``[4 + MAX_DIMS]``)."""
    row = torch.full((_WIDTH,), -1, dtype=torch.int64)
    row[0] = OPS.index(op)
    row[3] = argument
    if tensor is not None:
        row[1] = DTYPES.index(tensor.dtype) if tensor.dtype in DTYPES else len(DTYPES)
        if not check_shape:
            row[2] = NO_SHAPE
        elif tensor.dim() > MAX_DIMS:
            row[2] = tensor.dim()
            row[4] = tensor.numel()
        else:
            row[2] = tensor.dim()
            row[4 : 4 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return row


def _render(row: Sequence[int], argument_name: str) -> str:
    op = OPS[row[0]]
    if row[1] < 0:
        what = "no tensor"
    else:
        dtype = str(DTYPES[row[1]]).replace("torch.", "") if row[1] < len(DTYPES) else "other"
        if row[2] == NO_SHAPE:
            what = dtype
        elif row[2] > MAX_DIMS:
            what = f"{dtype}[{row[2]} dims, {row[4]} elements]"
        else:
            what = f"{dtype}[{', '.join(str(d) for d in row[4 : 4 + row[2]])}]"
    value = REDUCE_OPS[row[3]] if argument_name == "op" else row[3]
    arg = f" {argument_name}={value}" if argument_name else ""
    return f"{op} with {what}{arg}"


def check_matching(
    link: Link,
    op: str,
    tensor: torch.Tensor | None,
    argument: int = 0,
    argument_name: str = "",
    check_shape: bool = True,
) -> None:
    """All-gather descriptors on ``link`` and raise on any difference between ranks.

    Collective over ``link``; every rank raises the same error, listing each distinct call and
    the global ranks that made it.
    """
    row = describe(op, tensor, argument, check_shape)
    rows = torch.empty(link.size * _WIDTH, dtype=torch.int64)
    link.all_gather_tensor(rows, row, name=f"{op} (debug check)")
    table = [tuple(r) for r in rows.view(link.size, _WIDTH).tolist()]
    if len(set(table)) == 1:
        return
    calls: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(table):
        calls.setdefault(r, []).append(link.ranks[i])
    parts = [
        f"rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]} called "
        f"{_render(r, argument_name)}"
        for r, rs in calls.items()
    ]
    raise CollectiveMismatchError(link.group_name, op, "ranks disagree: " + "; ".join(parts))
