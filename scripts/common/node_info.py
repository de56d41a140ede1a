"""Print, as shell assignments, what a launch script needs to know about one node of a cluster.

Used by scripts/common/launch.sh: ``eval "$(python scripts/common/node_info.py --cluster C.yaml
--node-rank N)"`` sets

    HET_NNODES          nodes in the cluster (torchrun --nnodes)
    HET_WORLD_SIZE      ranks in the cluster
    HET_NODE_NPROC      ranks on this node (torchrun --nproc_per_node)
    HET_NODE_FIRST_RANK global rank of this node's local rank 0
    HET_NODE_GROUPS     node groups on this node (space separated)
    HET_NODE_VENDORS    vendors of those groups' accelerators, without repeats (nvidia, amd,
                        huawei, cpu, other)
    HET_NODE_ACCELERATORS accelerator kinds on this node
    HET_NODE_GPUS       ranks on this node that drive a CUDA/ROCm GPU (Slurm's GPU count)
    HET_NODE_NPUS       ranks on this node that drive an Ascend NPU
    HET_KIND_RUNS       node counts of the runs of consecutive nodes with the same accelerator
                        kinds, in node order ("4 8": 4 nodes of one kind, then 8 of another);
                        a Slurm heterogeneous job's components must not split a run

Node ranks follow the cluster file: the nodes of its first node group come first. A bad cluster
file or node rank prints one ``error:`` line and exits with status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_het.cluster import ClusterSpec
from megatron_het.errors import UserError, run_cli


def node_assignments(cluster: ClusterSpec, node_rank: int) -> dict[str, str]:
    """The HET_* variables of node ``node_rank`` of ``cluster`` (values as strings)."""
    nodes = cluster.nodes()
    if not 0 <= node_rank < len(nodes):
        raise UserError(
            f"NODE_RANK {node_rank} is outside cluster {cluster.name}'s "
            f"{len(nodes)} nodes; use 0..{len(nodes) - 1}"
        )
    node = nodes[node_rank]
    infos = [cluster.rank_info(r) for r in range(node.first_rank, node.first_rank + node.nproc)]
    vendors = list(dict.fromkeys(info.accelerator.vendor for info in infos))
    kinds = list(dict.fromkeys(info.accelerator.name for info in infos))
    return {
        "HET_NNODES": str(len(nodes)),
        "HET_WORLD_SIZE": str(cluster.world_size),
        "HET_NODE_NPROC": str(node.nproc),
        "HET_NODE_FIRST_RANK": str(node.first_rank),
        "HET_NODE_GROUPS": " ".join(node.groups),
        "HET_NODE_VENDORS": " ".join(vendors),
        "HET_NODE_ACCELERATORS": " ".join(kinds),
        "HET_NODE_GPUS": str(_driving(infos, "cuda")),
        "HET_NODE_NPUS": str(_driving(infos, "npu")),
        "HET_KIND_RUNS": " ".join(str(n) for n in kind_runs(cluster)),
    }


def kind_runs(cluster: ClusterSpec) -> list[int]:
    """How many consecutive nodes share each run of accelerator kinds, in node order."""
    runs: list[int] = []
    last = None
    for node in cluster.nodes():
        kinds = tuple(
            sorted(
                {
                    cluster.rank_info(r).accelerator.name
                    for r in range(node.first_rank, node.first_rank + node.nproc)
                }
            )
        )
        if kinds == last:
            runs[-1] += 1
        else:
            runs.append(1)
            last = kinds
    return runs


def _driving(infos: list, device_type: str) -> int:
    """How many of ``infos``' ranks drive a device of ``device_type`` (emulated kinds run on
    the CPU)."""
    return sum(
        1
        for info in infos
        if info.accelerator.device_type == device_type and not info.accelerator.emulated
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="cluster YAML")
    parser.add_argument("--node-rank", type=int, required=True)
    args = parser.parse_args()
    if not Path(args.cluster).is_file():
        raise UserError(f"cluster file {args.cluster} not found; pass an existing YAML")
    values = node_assignments(ClusterSpec.load(args.cluster), args.node_rank)
    for name, value in values.items():
        print(f"{name}={shlex.quote(value)}")


if __name__ == "__main__":
    run_cli(main)
