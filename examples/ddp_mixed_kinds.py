"""DDP over ranks of two accelerator kinds, through the "unified" torch.distributed backend.

    torchrun --standalone --nproc_per_node 4 examples/ddp_mixed_kinds.py

The cluster file scripts/clusters/cpu_emulated.yaml makes ranks 0-1 "emu-fast" and ranks 2-3
"emu-slow": CPU ranks standing in for two accelerator kinds (emulated). The communicator built
from it registers the backend; a group made with ``backend="unified"`` then carries DDP's
gradient all-reduces inside each kind on its native backend and between kinds over the bridge.
Every rank trains on its own batches; rank 0 prints the mean loss over all ranks per step.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_het.cluster import ClusterSpec
from megatron_het.comm import UnifiedCommunicator
from megatron_het.errors import run_cli

CLUSTER = Path(__file__).resolve().parent.parent / "scripts" / "clusters" / "cpu_emulated.yaml"
STEPS = 5


def main() -> None:
    dist.init_process_group("gloo")  # torchrun's rendezvous (env://)
    cluster = ClusterSpec.load(CLUSTER)
    comm = UnifiedCommunicator.from_cluster(cluster)  # one kind per rank, from the file
    comm.register_torch_backend()
    group = dist.new_group(backend="unified")  # every rank, both kinds
    rank = dist.get_rank()
    if rank == 0:
        for info in cluster.rank_map():
            print(f"rank {info.rank}: {info.accelerator.label}", flush=True)

    torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    ddp = DDP(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)  # each rank its own samples
    for step in range(STEPS):
        x = torch.randn(32, 16, generator=data)
        y = x.sum(dim=1, keepdim=True)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # gradients averaged over all 4 ranks of both kinds
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=group)
        if rank == 0:
            print(f"step {step}: mean loss {mean.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
