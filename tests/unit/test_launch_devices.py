"""Selecting a rank's local device (launcher/rank_device.py, launcher/world.py) with fake
accelerator modules: CUDA and Ascend ranks select theirs, a CPU rank never touches torch.cuda
and hides the GPUs from itself (no CUDA context on GPU hosts)."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
import torch.distributed as dist

from megatron_het.launcher.rank_device import select_local_device
from megatron_het.launcher.world import init_world, shutdown_world
from megatron_het.perf.measure.worker_processes import HIDING_VARIABLES


class Untouchable:
    """Stands in for torch.cuda where nothing may be called: any attribute fails the test."""

    def __getattr__(self, name: str):
        if name.startswith("__"):  # introspection (pytest's ids, repr), not a CUDA call
            raise AttributeError(name)
        raise AssertionError(f"torch.cuda.{name} used on a rank that must not touch CUDA")


class FakeAccelerator:
    """A torch.cuda / torch.npu of ``devices`` devices whose generator state ``i`` is
    ``tensor([10 + i])``; records the calls that change anything."""

    def __init__(
        self, devices: int, initialised: bool = True, name: str = "", memory_gib: float = 80.0
    ) -> None:
        self.devices, self.initialised = devices, initialised
        self.name, self.memory_gib = name, memory_gib
        self.states = [torch.tensor([10 + i], dtype=torch.uint8) for i in range(devices)]
        self.calls: list[tuple] = []
        self.current = 0

    def is_initialized(self) -> bool:
        return self.initialised

    def device_count(self) -> int:
        return self.devices

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))
        self.current = index

    def current_device(self) -> int:
        return self.current

    def is_available(self) -> bool:
        return self.devices > 0

    def get_device_name(self, index: int) -> str:
        assert index < self.devices
        return self.name

    def get_device_properties(self, index: int) -> types.SimpleNamespace:
        assert index < self.devices
        return types.SimpleNamespace(total_memory=int(self.memory_gib * 2**30))

    def get_rng_state(self, device: int) -> torch.Tensor:
        return self.states[device].clone()

    def set_rng_state(self, state: torch.Tensor, device: int) -> None:
        self.calls.append(("set_rng_state", device, int(state[0])))
        self.states[device] = state.clone()


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "cuda", Untouchable())


def install_npu(monkeypatch: pytest.MonkeyPatch, npu: object) -> None:
    """torch_npu importable (a stub module) and ``torch.npu`` the fake, as torch_npu makes it."""
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", npu, raising=False)


def test_a_cpu_rank_leaves_torch_cuda_alone_and_hides_the_gpus(
    no_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # restored after the test
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    environ = {"CUDA_VISIBLE_DEVICES": "0,1"}
    select_local_device("cpu", 3, environ)
    assert environ == dict.fromkeys(HIDING_VARIABLES, "")
    select_local_device(None, 3)  # a run that chose no kind: nothing changes
    select_local_device("cpu", 3, hide_gpus=False)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    init_world(None, device_type="cpu")  # a single process keeps the GPUs visible
    try:
        assert dist.get_world_size() == 1
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    finally:
        shutdown_world()


@pytest.mark.parametrize(
    "devices, index, expected", [(4, 2, [("set_device", 2)]), (2, 3, []), (0, 1, [])]
)
def test_a_cuda_rank_selects_its_device_and_never_shares_one(
    monkeypatch: pytest.MonkeyPatch, devices: int, index: int, expected: list
) -> None:
    """A rank whose device is not visible selects none (device_problem reports it): it must
    not wrap around onto another rank's device."""
    cuda = FakeAccelerator(devices)
    monkeypatch.setattr(torch, "cuda", cuda)
    select_local_device("cuda", index)
    assert cuda.calls == expected


def test_an_ascend_rank_selects_its_npu(monkeypatch: pytest.MonkeyPatch, no_cuda: None) -> None:
    npu = FakeAccelerator(8)
    install_npu(monkeypatch, npu)
    select_local_device("npu", 3)
    assert npu.calls == [("set_device", 3)]


@pytest.mark.parametrize(
    "types_, local_rank, expected",
    [
        (["cuda"] * 8, 5, 5),
        (["cuda", "cpu"], 1, 0),  # the GPU check's pair: the CPU rank counts its own kind
        (["cpu", "cpu", "cuda", "cuda"], 3, 1),  # GPU ranks after CPU ranks drive GPUs 0 and 1
        (["cuda", "cpu", "cuda"], 2, 1),
    ],
)
def test_a_rank_drives_the_device_of_its_place_among_its_kind_on_the_node(
    types_: list, local_rank: int, expected: int
) -> None:
    from megatron_het.launcher.rank_device import local_device_index

    assert local_device_index(types_[: local_rank + 1], local_rank) == expected


def test_an_ascend_rank_without_torch_npu_selects_nothing(
    monkeypatch: pytest.MonkeyPatch, no_cuda: None
) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    monkeypatch.setattr(torch, "npu", Untouchable(), raising=False)
    select_local_device("npu", 0)


# ---- a rank's hardware against the kind the cluster file gives it --------------------------
def _kind(name: str):
    from megatron_het.cluster.accelerators import get_accelerator

    return get_accelerator(name)


@pytest.mark.parametrize("name", ["cpu", "emu-slow"])
def test_cpu_and_emulated_kinds_fit_any_process(monkeypatch, name: str) -> None:
    from megatron_het.launcher.rank_device import device_problem

    monkeypatch.setattr(torch, "cuda", Untouchable())
    assert device_problem(_kind(name)) is None


@pytest.mark.parametrize(
    "name, hip, devices, problem",
    [
        ("MI300X", None, 8, "an AMD kind on a torch built without ROCm"),
        ("H100", "6.2", 8, "an NVIDIA kind on a torch built for ROCm"),
        ("H100", None, 0, "no GPU is visible"),
        ("MI300X", "6.2", 0, "no GPU is visible"),
        ("H100", None, 8, None),
        ("MI250X", "6.2", 8, None),
    ],
)
def test_a_gpu_kind_needs_its_vendors_build_and_a_gpu(
    monkeypatch, name, hip, devices, problem
) -> None:
    from megatron_het.launcher.rank_device import device_problem

    fake = FakeAccelerator(devices, name="", memory_gib=192)
    monkeypatch.setattr(torch, "cuda", fake)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert device_problem(_kind(name)) == problem


def test_an_ascend_kind_needs_torch_npu_and_a_device(monkeypatch) -> None:
    from megatron_het.launcher.rank_device import device_problem

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    assert device_problem(_kind("Ascend910B")) == "torch_npu is not importable here"
    install_npu(monkeypatch, FakeAccelerator(0))
    assert device_problem(_kind("Ascend910B")) == "no Ascend device is visible"
    install_npu(monkeypatch, FakeAccelerator(8))
    assert device_problem(_kind("Ascend910B"), 7) is None
    assert device_problem(_kind("Ascend910B"), 8).startswith(
        "it is the node's rank 9 of its kind but only 8 Ascend devices are visible (set "
        "ASCEND_RT_VISIBLE_DEVICES"
    )


@pytest.mark.parametrize(
    "kind, name, memory_gib, index, problem",
    [
        ("H100", "NVIDIA H100 80GB HBM3", 79.1, 3, None),
        ("H200", "NVIDIA H200", 139.8, 0, None),
        ("A100-40G", "NVIDIA A100-SXM4-80GB", 79.2, 0, None),  # more memory than planned fits
        ("A100-80G", "NVIDIA A100-SXM4-80GB", 79.2, 0, None),
        # nodes of one vendor started in another order than the cluster file's
        (
            "H100",
            "NVIDIA A100-SXM4-80GB",
            79.2,
            0,
            "GPU 0 is 'NVIDIA A100-SXM4-80GB', not kind H100",
        ),
        (
            "H200",
            "NVIDIA H100 80GB HBM3",
            79.1,
            2,
            "GPU 2 is 'NVIDIA H100 80GB HBM3', not kind H200",
        ),
        (
            "A100-80G",
            "NVIDIA A100-SXM4-40GB",
            39.4,
            0,
            "GPU 0 (NVIDIA A100-SXM4-40GB) has 39.4 GiB, kind A100-80G 80 GiB",
        ),
        # a kind of the site's own: judged by its memory only
        ("site-gpu", "NVIDIA A100-SXM4-80GB", 79.2, 0, None),
        (
            "site-gpu",
            "NVIDIA A100-SXM4-40GB",
            39.4,
            0,
            "GPU 0 (NVIDIA A100-SXM4-40GB) has 39.4 GiB, kind site-gpu 80 GiB",
        ),
        (
            "H100",
            "NVIDIA H100 80GB HBM3",
            79.1,
            4,
            "it is the node's rank 5 of its kind but only 4 GPUs are visible (set "
            "CUDA_VISIBLE_DEVICES; under Slurm request the node's devices, e.g. sbatch "
            "--gpus-per-node)",
        ),
    ],
)
def test_a_gpu_rank_needs_its_own_device_of_its_kind(
    monkeypatch, kind, name, memory_gib, index, problem
) -> None:
    import dataclasses

    from megatron_het.launcher.rank_device import device_problem

    spec = (
        dataclasses.replace(_kind("H100"), name="site-gpu", memory_gib=80)
        if kind == "site-gpu"
        else _kind(kind)
    )
    monkeypatch.setattr(torch, "cuda", FakeAccelerator(4, name=name, memory_gib=memory_gib))
    monkeypatch.setattr(torch.version, "hip", None)
    assert device_problem(spec, index) == problem
    # without a cluster file the kind was named after this device: only the count is judged
    assert device_problem(spec, index, identity=False) == (
        problem if problem and problem.startswith("it is the node's") else None
    )


# ---- the address gloo listens on, for ranks on other nodes ---------------------------------
def _env(world_size: int, local_world_size: int, ifname: str = ""):
    from megatron_het.launcher.launch_env import LaunchEnv

    return LaunchEnv(
        0,
        world_size,
        0,
        "node0",
        29500,
        local_world_size=local_world_size,
        gloo_socket_ifname=ifname,
    )


def _resolves_to(address: str):
    """This host's name resolves to ``address``; node 0 (the master) to 10.0.0.1."""
    return lambda name: "10.0.0.1" if name == "node0" else address


def test_node_0_itself_is_checked() -> None:
    """On node 0 the master is this host's own name: it must not exempt the check."""
    import dataclasses

    from megatron_het.launcher.launch_env import gloo_address_problem

    env = dataclasses.replace(_env(16, 8), master_addr="gpu-07")
    assert "127.0.1.1" in gloo_address_problem(env, lambda name: "127.0.1.1", lambda: "gpu-07")


def test_a_multi_node_job_fails_when_the_hostname_resolves_to_loopback() -> None:
    from megatron_het.launcher.launch_env import gloo_address_problem

    problem = gloo_address_problem(_env(16, 8), _resolves_to("127.0.1.1"), lambda: "gpu-07")
    assert problem.startswith(
        "this host's name 'gpu-07' resolves to the loopback address "
        "127.0.1.1, where gloo would listen for ranks on the other nodes; "
        "set GLOO_SOCKET_IFNAME"
    )


def test_an_unresolvable_hostname_is_named() -> None:
    from megatron_het.launcher.launch_env import gloo_address_problem

    def fail(name: str) -> str:
        raise OSError("Name or service not known")

    assert "'gpu-07' does not resolve (Name or service not known)" in gloo_address_problem(
        _env(16, 8), fail, lambda: "gpu-07"
    )


@pytest.mark.parametrize(
    "env, address",
    [
        (_env(16, 8), "10.1.2.3"),  # a routable address
        (_env(16, 8, ifname="ib0"), "127.0.1.1"),  # the interface is named
        (_env(8, 8), "127.0.1.1"),  # one node: loopback is right
        (_env(8, 0), "127.0.1.1"),  # node size unknown (not torchrun)
    ],
)
def test_gloo_addresses_that_work(env, address: str) -> None:
    from megatron_het.launcher.launch_env import gloo_address_problem

    assert gloo_address_problem(env, _resolves_to(address), lambda: "gpu-07") is None


def test_nodes_on_one_host_may_use_loopback() -> None:
    """A master on a loopback address: every "node" of the job runs on this host."""
    import dataclasses

    from megatron_het.launcher.launch_env import gloo_address_problem

    for master in ("127.0.0.1", "localhost", "::1"):
        env = dataclasses.replace(_env(4, 2), master_addr=master)
        assert gloo_address_problem(env, lambda name: "127.0.1.1", lambda: "gpu-07") is None


def test_read_launch_env_takes_the_gloo_interface() -> None:
    from megatron_het.launcher.launch_env import read_launch_env

    env = read_launch_env(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "a",
            "MASTER_PORT": "1",
            "GLOO_SOCKET_IFNAME": "eth1",
        }
    )
    assert env.gloo_socket_ifname == "eth1" and env.local_rank == 1


def test_read_launch_env_takes_the_store_settings_and_checks_the_port() -> None:
    from megatron_het.errors import UserError
    from megatron_het.launcher.launch_env import read_launch_env

    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "29500"}
    env = read_launch_env(base)
    assert not env.agent_store and env.use_libuv
    env = read_launch_env({**base, "TORCHELASTIC_USE_AGENT_STORE": "True", "USE_LIBUV": "0"})
    assert env.agent_store and not env.use_libuv
    with pytest.raises(UserError, match="MASTER_PORT 70000 is not a TCP port"):
        read_launch_env({**base, "MASTER_PORT": "70000"})


def test_a_launched_cpu_rank_hides_the_gpus_before_joining(
    no_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What init_world does on a torchrun rank of a cpu kind: the variables are empty before
    the rendezvous (the world itself is not built here)."""
    import megatron_het.launcher.world as world

    for name in HIDING_VARIABLES:
        monkeypatch.setenv(name, "0")  # restored after the test
    seen = {}

    def join(env, timeout, problem):
        seen.update({name: os.environ[name] for name in HIDING_VARIABLES})

    monkeypatch.setattr(world, "join_world", join)
    monkeypatch.setattr(world, "gloo_address_problem", lambda env: None)
    world.init_world(types.SimpleNamespace(rank=1, world_size=2), device_type="cpu")
    assert seen == dict.fromkeys(HIDING_VARIABLES, "")
