"""The start-up check of each rank's hardware against its kind (training.run.check_devices),
two gloo ranks: a rank the cluster file calls an AMD GPU, on this CPU build of torch, stops
every rank with the same line naming it, before any device group exists."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_het.cluster.accelerators import get_accelerator
from tests.distributed.harness import run_ranks


def _setup(kinds: list[str]) -> SimpleNamespace:
    specs = [get_accelerator(kind) for kind in kinds]
    plan = SimpleNamespace(rank_role=lambda r: SimpleNamespace(pipeline=0, stage=r))
    run = SimpleNamespace(parallel=SimpleNamespace(cluster="cluster.yaml"))
    return SimpleNamespace(accelerator=lambda r: specs[r], plan=plan, run=run)


def _check(rank: int, world_size: int, kinds: list[str]) -> str:
    from megatron_het.errors import UserError
    from megatron_het.training.run import check_devices

    try:
        check_devices(_setup(kinds), rank, 0)
    except UserError as error:
        return str(error)
    return "ok"


def test_a_rank_on_the_wrong_hardware_stops_every_rank_with_its_name() -> None:
    lines = run_ranks(_check, 2, ["cpu", "MI300X"], timeout=60)
    assert lines[0] == lines[1]
    assert lines[0].startswith(
        "ranks do not match the kinds the cluster file gives them: "
        "rank 1 (MI300X, pipeline 0 stage 1): an AMD kind on a torch "
        "built without ROCm"
    )
    assert "rank 0" not in lines[0]


def test_ranks_that_fit_pass() -> None:
    assert run_ranks(_check, 2, ["cpu", "emu-slow"], timeout=60) == ["ok", "ok"]
