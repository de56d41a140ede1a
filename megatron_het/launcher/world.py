"""torchrun's world (or a single process) -> the world process group.

A single process gets a world of one rank in this process (:func:`init_world` without an env),
so it runs the same trainer as a launched job. A launched rank selects its device
(:mod:`~megatron_het.launcher.rank_device`), agrees with the others at start-up
(:mod:`~megatron_het.launcher.start_agreement`) and joins the gloo world group. Everything
after the world group is built goes through the unified communicator.
"""

from __future__ import annotations

import datetime

from megatron_het.launcher.launch_env import LaunchEnv, gloo_address_problem
from megatron_het.launcher.rank_device import select_local_device
from megatron_het.launcher.start_agreement import agree_at_start, rendezvous_store

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def init_world(
    env: LaunchEnv | None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    device_type: str | None = None,
    device_index: int = 0,
) -> None:
    """Initialise torch.distributed's default (world) group with gloo: over
    ``env.init_method``, or, without an env, a world of this one process (an in-memory store).

    The world group only bootstraps the unified communicator, which builds each kind's native
    groups itself; gloo works for every kind. The rank's local device (visible device
    ``device_index``) is selected first (see :func:`select_local_device`; a "cpu" rank leaves
    torch.cuda alone). Side effect: global
    torch.distributed state; raises RuntimeError when a world is already initialised.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised; train on that world with "
            "megatron_het.training.pretrain_on_world"
        )
    # a single process may be someone's Python session: its GPUs stay visible
    select_local_device(device_type, device_index, hide_gpus=env is not None)
    if env is None:
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    join_world(env, timeout, gloo_address_problem(env))


def join_world(env: LaunchEnv, timeout: datetime.timedelta, problem: str | None) -> None:
    """Join the job's rendezvous, agree at start-up (:func:`agree_at_start`), then build the
    gloo world group.

    Every rank posts ``problem`` (why it cannot take part, e.g. :func:`gloo_address_problem`;
    None when it can) to the rendezvous store and waits for every other rank's (the
    rendezvous itself, within ``timeout``). Where any rank has one, every rank raises the same
    :class:`~megatron_het.errors.RanksError` naming the ranks and their problems (a problem
    of every rank alone), instead of the others waiting out the timeout for a rank that left;
    ranks missing at the timeout are named by every rank.
    Side effect: global torch.distributed state.
    """
    import torch.distributed as dist

    store = rendezvous_store(env, timeout)
    error = agree_at_start(store, env, problem, timeout)
    if error is not None:
        raise error
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("default_pg", store),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )


def shutdown_world() -> None:
    """Destroy the world group if one is initialised."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
