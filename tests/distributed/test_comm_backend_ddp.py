"""DDP over the "unified" backend against DDP over gloo, feature by feature.

Each scenario trains a small model for a few steps with DDP features as torch's own DDP tests
exercise them (bucket views, static graph, ``no_sync``, ``init_sync=False``, communication
hooks, PowerSGD, ``Join`` with uneven inputs, unused parameters, checkpointing, buffers,
SyncBatchNorm) over ``ctx.world``, and returns what a user compares: losses and parameters.
The test here runs them on 2 ranks, one of each kind, where every result must agree bitwise;
test_comm_backend_torch.py runs them again on 4 ranks (2 + 2), where float sums may round
differently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default_hooks
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from tests.distributed.test_comm_backend_torch import Ctx

BATCH = 4  # samples per rank and step


class Net(nn.Module):
    """Three bias-free layers and a softmax; layer sizes make several buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = (
            nn.Linear(2, 10, False),
            nn.Linear(10, 48, False),
            nn.Linear(48, 4, False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))), dim=1)


def data(ctx: Ctx, step: int, width: int = 2, out: int = 4) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1000 * step + ctx.rank)
    return torch.randn(BATCH, width, generator=gen), torch.randn(BATCH, out, generator=gen)


def wrap(ctx: Ctx, model: nn.Module, **kwargs: Any) -> DDP:
    kwargs.setdefault("bucket_cap_mb", 0.001)  # several buckets, of uneven sizes
    return DDP(model, process_group=ctx.world, **kwargs)


def train(ctx: Ctx, ddp: nn.Module, steps: int = 3, lr: float = 0.5) -> list[Any]:
    """``steps`` SGD steps on per-rank data; returns the losses and the final parameters."""
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = data(ctx, step)
        opt.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [losses, [p.detach().clone() for p in ddp.parameters()]]


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Net()


def ddp_plain(ctx: Ctx) -> Any:
    return train(ctx, wrap(ctx, net()))


def ddp_bucket_view(ctx: Ctx) -> Any:
    return train(ctx, wrap(ctx, net(), gradient_as_bucket_view=True))


def ddp_static_graph(ctx: Ctx) -> Any:
    return train(ctx, wrap(ctx, net(), static_graph=True, gradient_as_bucket_view=True))


def ddp_no_init_sync(ctx: Ctx) -> Any:
    """Different initial weights per rank stay different without the initial broadcast."""
    ddp = wrap(ctx, net(seed=ctx.rank), init_sync=False)
    return train(ctx, ddp, steps=1)


def ddp_no_sync(ctx: Ctx) -> Any:
    """Two micro-batches accumulate locally under ``no_sync``; the third syncs all three."""
    ddp = wrap(ctx, net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    for step in range(2):
        opt.zero_grad()
        for micro in range(3):
            x, y = data(ctx, 10 * step + micro)
            if micro < 2:
                with ddp.no_sync():
                    F.mse_loss(ddp(x), y).backward()
            else:
                F.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.parameters()]


def _hooked(ctx: Ctx, register: Callable[[DDP], None], steps: int = 3, **kwargs: Any) -> Any:
    ddp = wrap(ctx, net(), **kwargs)
    register(ddp)
    return train(ctx, ddp, steps=steps)


def ddp_allreduce_hooks(ctx: Ctx) -> Any:
    """torch's allreduce hook and its built-in C++ twin."""
    return [
        _hooked(ctx, lambda d: d.register_comm_hook(ctx.world, default_hooks.allreduce_hook)),
        _hooked(ctx, lambda d: d._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)),
    ]


def ddp_compress_hooks(ctx: Ctx) -> Any:
    """The fp16 compression hook and its built-in twin (torch's bf16 one needs NCCL)."""
    fp16 = dist.BuiltinCommHookType.FP16_COMPRESS
    return [
        _hooked(ctx, lambda d: d.register_comm_hook(ctx.world, default_hooks.fp16_compress_hook)),
        _hooked(ctx, lambda d: d._register_builtin_comm_hook(fp16)),
    ]


def ddp_python_hook(ctx: Ctx) -> Any:
    """A user's hook: an asynchronous all_reduce whose future divides by the world size."""

    def hook(group, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
        work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0] / ctx.world_size)

    return _hooked(ctx, lambda d: d.register_comm_hook(ctx.world, hook))


def ddp_powersgd(ctx: Ctx) -> Any:
    """PowerSGD past its start iteration, with error feedback and warm start, on one bucket:
    with several, gloo receives the all-reduces that the hook's callbacks start in different
    orders on different ranks and aborts (torch's batched variant fails its own shape check
    in this torch, on any backend)."""
    state = powersgd.PowerSGDState(
        process_group=ctx.world,
        matrix_approximation_rank=1,
        start_powerSGD_iter=2,
        min_compression_rate=0.5,
        random_seed=7,
    )
    register = lambda d: d.register_comm_hook(state, powersgd.powerSGD_hook)  # noqa: E731
    return _hooked(ctx, register, steps=5, bucket_cap_mb=25)


def ddp_join_uneven(ctx: Ctx) -> Any:
    """Rank r has 2 + r batches; ``Join`` shadows the all-reduces of ranks done early."""
    ddp = wrap(ctx, net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    with Join([ddp]):
        for step in range(2 + ctx.rank):
            x, y = data(ctx, step)
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            opt.step()
    return [p.detach().clone() for p in ddp.parameters()]


@dataclass
class Branches:
    o1: torch.Tensor | None
    o2: dict[str, torch.Tensor]


class TwoBranch(nn.Module):
    """Returns a dataclass holding a dict; ``skip`` leaves the first branch unused."""

    def __init__(self, skip: bool) -> None:
        super().__init__()
        self.skip = skip
        self.a, self.b = nn.Linear(2, 4), nn.Linear(2, 4)

    def forward(self, x: torch.Tensor) -> Branches:
        return Branches(None if self.skip else self.a(x), {"b": self.b(x), "c": self.b(x).relu()})


def ddp_unused_parameters(ctx: Ctx) -> Any:
    out = []
    for skip in (False, True):
        torch.manual_seed(0)
        ddp = wrap(ctx, TwoBranch(skip), find_unused_parameters=True)
        for step in range(2):
            x, y = data(ctx, step)
            got = ddp(x)
            pred = got.o2["b"] + got.o2["c"] + (0 if got.o1 is None else got.o1)
            F.mse_loss(pred, y).backward()
        out.append([None if p.grad is None else p.grad.clone() for p in ddp.parameters()])
    return out


class Checkpointed(nn.Module):
    """The same (shared-weight) layer checkpointed twice, non-reentrant."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.l1.weight = self.l2.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.l1(x)
        x = checkpoint(self.l2, x, use_reentrant=False)
        return checkpoint(self.l2, x, use_reentrant=False)


def ddp_checkpointing(ctx: Ctx) -> Any:
    out = []
    for static_graph in (False, True):
        torch.manual_seed(0)
        ddp = wrap(ctx, Checkpointed(), static_graph=static_graph, bucket_cap_mb=1)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            x, y = data(ctx, step, width=4, out=4)
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            opt.step()
        out.append([p.detach().clone() for p in ddp.parameters()])
    return out


def ddp_batchnorm_buffers(ctx: Ctx) -> Any:
    """Buffers broadcast from rank 0 before each of two forwards in one step."""
    torch.manual_seed(0)
    ddp = wrap(ctx, nn.Sequential(nn.Linear(2, 6), nn.BatchNorm1d(6)), broadcast_buffers=True)
    x, _ = data(ctx, 0)
    (ddp(x).mean() + ddp(x * 2).mean()).backward()
    return [t.detach().clone() for t in ddp.module.state_dict().values()]


def sync_batch_norm(ctx: Ctx) -> Any:
    torch.manual_seed(0)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3)), ctx.world)
    ddp = wrap(ctx, model)
    x = data(ctx, 0, width=3)[0]
    ddp(x).sum().backward()
    return [p.grad for p in ddp.parameters()]


DDP_SCENARIOS: list[Callable[[Any], Any]] = [
    ddp_plain,
    ddp_bucket_view,
    ddp_static_graph,
    ddp_no_init_sync,
    ddp_no_sync,
    ddp_allreduce_hooks,
    ddp_compress_hooks,
    ddp_python_hook,
    ddp_powersgd,
    ddp_join_uneven,
    ddp_unused_parameters,
    ddp_checkpointing,
    ddp_batchnorm_buffers,
    sync_batch_norm,
]


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_matches_gloo_bitwise_on_two_ranks() -> None:
    """One rank of each kind: a sum of two gradients is the same in either order, so every
    loss and parameter must agree bitwise with DDP over gloo."""
    # imported here: that module imports this one's scenarios
    from tests.distributed.test_comm_backend_torch import check_scenarios

    check_scenarios(2, DDP_SCENARIOS)
