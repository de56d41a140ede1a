"""torchrun's command lines: one host (``--standalone``), or one node of a job with a static
rendezvous.

Static rendezvous, even where a ``PET_RDZV_BACKEND`` in the site's environment says otherwise
(a flag outranks torchrun's variables): node 0's agent serves the job's store at
``master_addr:master_port`` and no agent calls it while training. A c10d agent calls its store
every monitor tick, and when the store's node dies without closing its connections each call
waits out the store's read timeout (60 s), so the nodes left would not end within
``--distributed-timeout-minutes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TorchrunNode:
    """One node's place in a job of ``nnodes`` nodes: its ``nproc`` ranks, its node rank, the
    job's master (node 0, whose agent serves the store) and the job id (``run_id``; "":
    torchrun's default)."""

    nnodes: int
    node_rank: int
    nproc: int
    master_addr: str
    master_port: int
    run_id: str = ""


def node_torchrun(python: str, node: TorchrunNode, script: str, flags: Sequence[str]) -> list[str]:
    """The command that starts ``node``'s torchrun agent of ``script`` (and its ``flags``)
    under ``python``, with a static rendezvous (module docstring)."""
    command = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(node.nnodes),
        "--nproc_per_node",
        str(node.nproc),
        "--node_rank",
        str(node.node_rank),
        "--master_addr",
        node.master_addr,
        "--master_port",
        str(node.master_port),
        "--rdzv_backend",
        "static",
    ]
    if node.run_id:
        command += ["--rdzv_id", node.run_id]
    return [*command, script, *flags]


def standalone_torchrun(python: str, nproc: int, script: str, flags: Sequence[str]) -> list[str]:
    """The command that runs ``script`` on ``nproc`` ranks of this one host."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        script,
        *flags,
    ]
