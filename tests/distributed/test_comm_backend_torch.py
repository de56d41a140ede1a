"""torch.distributed's scenarios for a Python process-group backend, run over "unified".

The scenarios are those torch runs against its own extension backends, written afresh:
identity, membership and collectives here, point-to-point and groups in
test_comm_backend_p2p.py, DDP in test_comm_backend_ddp.py. Each runs once with
``backend="gloo"`` and once with ``backend="unified"`` on the same inputs, in one forked run per
world size (2 and 4 ranks of two kinds). Every scenario gloo passes must give the same result
over "unified" (bitwise on 2 ranks; inputs are small integers, so only float sums of more than
two ranks may round differently), unless the backend refuses the operation with one error that
names it and what to use instead (``REFUSED``).
"""

from __future__ import annotations

import datetime
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from megatron_het.comm.backend import register_unified_backend
from tests.distributed.harness import run_ranks
from tests.distributed.test_comm_backend_ddp import DDP_SCENARIOS
from tests.distributed.test_comm_backend_p2p import P2P_SCENARIOS

KINDS = {2: ["fast", "slow"], 4: ["fast", "fast", "slow", "slow"]}
TIMEOUT = datetime.timedelta(seconds=30)

# Operations the unified backend refuses, and what its error must say.
REFUSED = {"recv_any_source": r"cannot recv from any source.*; pass src"}
# Scenarios gloo itself fails in this torch (on CPU): anything else gloo fails is a broken scenario.
GLOO_FAILS = {"all_reduce_premul_sum", "sync_batch_norm"}


@dataclass(frozen=True)
class Ctx:
    """One scenario's view: ``world`` is a group of ``backend`` over every rank; groups the
    scenario makes with :meth:`group` are destroyed after it (``made``)."""

    backend: str
    rank: int
    world_size: int
    world: dist.ProcessGroup
    made: list[Any] = field(default_factory=list)

    def group(self, ranks: list[int], **kwargs: Any) -> Any:
        group = dist.new_group(ranks, backend=self.backend, timeout=TIMEOUT, **kwargs)
        self.made.append(group)
        return group

    def destroy_made(self) -> None:
        """Destroy this rank's groups of the last scenario: a rank's count of groups names
        the next group made with ``use_local_synchronization``, so counts must stay equal."""
        for group in self.made:
            if group is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
        self.made.clear()

    def ints(self, n: int = 6, offset: int = 0) -> torch.Tensor:
        """A rank-dependent int64 vector."""
        return torch.arange(n, dtype=torch.int64) * (self.rank + 1) + offset + self.rank

    @staticmethod
    def outcome(call: Callable[[], Any]) -> tuple[Any, ...]:
        """("ok", value) or ("error", exception type, first line of its message)."""
        try:
            return ("ok", call())
        except Exception as exc:  # the outcome is what a scenario compares
            text = str(exc).strip()
            return ("error", type(exc).__name__, text.splitlines()[0] if text else "")


# -- identity and membership -----------------------------------------------------------------
def backend_registry(ctx: Ctx) -> Any:
    b = ctx.backend
    config = str(dist.BackendConfig(b)).replace(b, "B")
    return dist.is_backend_available(b), getattr(dist.Backend, b.upper()) == b, config


def group_identity(ctx: Ctx) -> Any:
    w = ctx.world
    names = (dist.get_backend(w), w.name())
    return names == (ctx.backend,) * 2, w.rank(), w.size(), dist.get_rank(w), dist.get_world_size(w)


def rank_membership(ctx: Ctx) -> Any:
    group = ctx.group([1])
    out: list[Any] = [dist.get_process_group_ranks(group) if ctx.rank == 1 else None]
    for call in (lambda: dist.get_group_rank(group, 1), lambda: dist.get_global_rank(group, 0)):
        out.append(call())
    for call in (lambda: dist.get_group_rank(group, 0), lambda: dist.get_global_rank(group, 1)):
        out.append(ctx.outcome(call)[:2])  # the message names the group object
    return out


def sequence_numbers(ctx: Ctx) -> Any:
    seen = []
    for _ in range(3):
        seen.append(ctx.world._get_sequence_number_for_group())
        dist.all_reduce(torch.ones(1), group=ctx.world)
    return [s - seen[0] for s in seen]


# -- collectives -----------------------------------------------------------------------------
def _all_reduce(ctx: Ctx, ops: list[Any], x: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for op in ops:
        y = x.clone()
        dist.all_reduce(y, op=op, group=ctx.world)
        out.append(y)
    return out


def all_reduce_sum_max_min(ctx: Ctx) -> Any:
    R = dist.ReduceOp
    return _all_reduce(ctx, [R.SUM, R.MAX, R.MIN], ctx.ints())


def all_reduce_product(ctx: Ctx) -> Any:
    return _all_reduce(ctx, [dist.ReduceOp.PRODUCT], ctx.ints(4, offset=1))


def all_reduce_bitwise(ctx: Ctx) -> Any:
    R = dist.ReduceOp
    return _all_reduce(ctx, [R.BAND, R.BOR, R.BXOR], ctx.ints(8, offset=3))


def all_reduce_avg(ctx: Ctx) -> Any:
    return _all_reduce(ctx, [dist.ReduceOp.AVG], ctx.ints().double())


def all_reduce_premul_sum(ctx: Ctx) -> Any:
    op = dist._make_nccl_premul_sum(2.0)
    return _all_reduce(ctx, [op], ctx.ints().double())


def all_reduce_shapes(ctx: Ctx) -> Any:
    """A 2-D tensor, a transposed (non-contiguous) view and a bool tensor."""
    x = ctx.ints(12).view(3, 4).float()
    t = ctx.ints(12).view(3, 4).t()
    flags = torch.tensor([ctx.rank % 2 == 0, False, True])
    for tensor in (x, t, flags):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=ctx.world)
    return x, t, flags


def all_reduce_async(ctx: Ctx) -> Any:
    x = ctx.ints()
    work = dist.all_reduce(x, group=ctx.world, async_op=True)
    work.wait()
    value = work.get_future().wait()
    return x, [v.clone() for v in value], work.is_completed()


def all_reduce_coalesced(ctx: Ctx) -> Any:
    tensors = [ctx.ints(3), ctx.ints(5, offset=2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.all_reduce_coalesced(tensors, group=ctx.world)
    return tensors


def all_gather(ctx: Ctx) -> Any:
    out = [torch.zeros(2, 3, dtype=torch.int64) for _ in range(ctx.world_size)]
    dist.all_gather(out, ctx.ints().view(2, 3), group=ctx.world)
    return out


def all_gather_into_tensor(ctx: Ctx) -> Any:
    out = torch.zeros(ctx.world_size * 6, dtype=torch.int64)
    dist.all_gather_into_tensor(out, ctx.ints(), group=ctx.world)
    return out


def all_gather_complex(ctx: Ctx) -> Any:
    x = torch.view_as_complex(ctx.ints(4).double().view(2, 2))
    out = [torch.zeros_like(x) for _ in range(ctx.world_size)]
    dist.all_gather(out, x, group=ctx.world)
    return out


def all_gather_coalesced(ctx: Ctx) -> Any:
    ins = [ctx.ints(2), ctx.ints(3)]
    outs = [[torch.zeros_like(t) for t in ins] for _ in range(ctx.world_size)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.all_gather_coalesced(outs, ins, group=ctx.world)
    return outs


def all_gather_object(ctx: Ctx) -> Any:
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, {"rank": ctx.rank, "word": "x" * ctx.rank}, group=ctx.world)
    return out


def broadcast_each_src(ctx: Ctx) -> Any:
    out = []
    for src in range(ctx.world_size):
        x = ctx.ints()
        dist.broadcast(x, src=src, group=ctx.world, async_op=True).wait()
        out.append(x)
    flags = torch.tensor([1, 0, 0, 1], dtype=torch.bool)
    got = flags if ctx.rank == 0 else torch.zeros(4, dtype=torch.bool)
    dist.broadcast(got, src=0, group=ctx.world)
    return out, got


def broadcast_object_list(ctx: Ctx) -> Any:
    objs: list[Any] = [{"from": ctx.rank}, "text", 7] if ctx.rank == 1 else [None] * 3
    dist.broadcast_object_list(objs, src=1, group=ctx.world)
    return objs


def reduce_each_dst(ctx: Ctx) -> Any:
    out = []
    for dst in range(ctx.world_size):
        x = ctx.ints()
        dist.reduce(x, dst=dst, group=ctx.world)
        out.append(x if ctx.rank == dst else None)
    return out


def reduce_scatter(ctx: Ctx) -> Any:
    out = []
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        got = torch.zeros(3, dtype=torch.int64)
        ins = [ctx.ints(3, offset=10 * i) for i in range(ctx.world_size)]
        dist.reduce_scatter(got, ins, op=op, group=ctx.world)
        out.append(got)
    return out


def reduce_scatter_tensor(ctx: Ctx) -> Any:
    got = torch.zeros(2, dtype=torch.int64)
    dist.reduce_scatter_tensor(got, ctx.ints(2 * ctx.world_size), group=ctx.world)
    return got


def gather(ctx: Ctx) -> Any:
    out = []
    for dst in (0, ctx.world_size - 1):
        bins = [torch.zeros(4, dtype=torch.int64) for _ in range(ctx.world_size)]
        dist.gather(ctx.ints(4), bins if ctx.rank == dst else None, dst=dst, group=ctx.world)
        out.append(bins if ctx.rank == dst else None)
    return out


def gather_object(ctx: Ctx) -> Any:
    out = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(("rank", ctx.rank), out, dst=0, group=ctx.world)
    return out


def scatter(ctx: Ctx) -> Any:
    out = []
    for src in (0, ctx.world_size - 1):
        got = torch.zeros(3, dtype=torch.int64)
        pieces = [ctx.ints(3, offset=100 * i) for i in range(ctx.world_size)]
        dist.scatter(got, pieces if ctx.rank == src else None, src=src, group=ctx.world)
        out.append(got)
    return out


def scatter_object_list(ctx: Ctx) -> Any:
    got: list[Any] = [None]
    objs = [{"for": r} for r in range(ctx.world_size)] if ctx.rank == 0 else None
    dist.scatter_object_list(got, objs, src=0, group=ctx.world)
    return got


def all_to_all(ctx: Ctx) -> Any:
    n = ctx.world_size
    ins = [torch.full((3,), 10 * ctx.rank + i, dtype=torch.int64) for i in range(n)]
    outs = [torch.zeros(3, dtype=torch.int64) for _ in range(n)]
    dist.all_to_all(outs, ins, group=ctx.world)
    return outs


def all_to_all_single(ctx: Ctx) -> Any:
    n = ctx.world_size
    even = torch.zeros(2 * n, dtype=torch.int64)
    dist.all_to_all_single(even, ctx.ints(2 * n), group=ctx.world)
    sizes = [i + 1 for i in range(n)]  # rank r sends sizes[j] elements to rank j
    uneven = torch.zeros(n * sizes[ctx.rank], dtype=torch.int64)
    inp = ctx.ints(sum(sizes))
    dist.all_to_all_single(uneven, inp, [sizes[ctx.rank]] * n, sizes, group=ctx.world)
    return even, uneven


def all_to_all_single_noncontiguous(ctx: Ctx) -> Any:
    n = ctx.world_size
    x = torch.ones(n, 2).t()
    return ctx.outcome(lambda: dist.all_to_all_single(torch.zeros(2, n), x, group=ctx.world))


def barrier(ctx: Ctx) -> Any:
    dist.barrier(group=ctx.world)
    work = dist.barrier(group=ctx.world, async_op=True)
    work.wait()
    return True


def monitored_barrier(ctx: Ctx) -> Any:
    """Called on the group: ``dist.monitored_barrier`` itself accepts gloo groups only."""
    ctx.world.monitored_barrier(TIMEOUT, wait_all_ranks=True)
    return True


def dtype_mismatch(ctx: Ctx) -> Any:
    """torch's own argument checks, before anything reaches the backend."""
    n, w = ctx.world_size, ctx.world
    x, half = torch.ones(2), torch.ones(2).half()
    lst, lst_h = [torch.zeros(2) for _ in range(n)], [torch.zeros(2) for _ in range(n)]
    lst_h[1] = lst_h[1].half()
    calls: list[Callable[[], Any]] = [
        lambda: dist.all_gather(lst_h, x, group=w),
        lambda: dist.all_gather(lst, half, group=w),
        lambda: dist.reduce_scatter(x, lst_h, group=w),
        lambda: dist.all_to_all_single(half, x, group=w),
        lambda: dist.all_to_all(lst_h, lst, group=w),
        lambda: dist.all_to_all(lst, lst_h, group=w),
    ]
    return [ctx.outcome(call) for call in calls]


def not_in_group(ctx: Ctx) -> Any:
    """Non-members get torch's warning; members run the ops."""
    members = list(range(0, ctx.world_size, 2))
    group = ctx.group(members)
    x = ctx.ints(4)
    xs = [torch.zeros_like(x) for _ in members]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.all_gather(xs, x, group=group)
        dist.all_reduce(x, group=group)
        dist.barrier(group=group)
        dist.broadcast(x, src=0, group=group)
    said = sorted(
        {m[0] for w in caught if (m := re.search(r"\w+(?= does not belong)", str(w.message)))}
    )
    return xs, x, said


def coalescing_manager(ctx: Ctx) -> Any:
    """torch's coalescing context (FSDP's): each op kind inside runs as one coalesced call."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    n, out = ctx.world_size, []
    sums = [ctx.ints(3), ctx.ints(5)]
    with _coalescing_manager(ctx.world):
        for t in sums:
            dist.all_reduce(t, group=ctx.world)
    gathered = [torch.zeros(n * 2, dtype=torch.int64) for _ in range(2)]
    with _coalescing_manager(ctx.world):
        for i, t in enumerate(gathered):
            dist.all_gather_into_tensor(t, ctx.ints(2, offset=i), group=ctx.world)
    scattered = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
    with _coalescing_manager(ctx.world):
        for i, t in enumerate(scattered):
            dist.reduce_scatter_tensor(t, ctx.ints(2 * n, offset=i), group=ctx.world)
    out += [sums, gathered, scattered]
    return out


def functional_collectives(ctx: Ctx) -> Any:
    x = ctx.ints(4).float()
    summed = funcol.all_reduce(x, "sum", ctx.world)
    gathered = funcol.all_gather_tensor(x, 0, ctx.world)
    return funcol.wait_tensor(summed), funcol.wait_tensor(gathered)


SCENARIOS: list[Callable[[Ctx], Any]] = [
    backend_registry,
    group_identity,
    rank_membership,
    sequence_numbers,
    all_reduce_sum_max_min,
    all_reduce_product,
    all_reduce_bitwise,
    all_reduce_avg,
    all_reduce_premul_sum,
    all_reduce_shapes,
    all_reduce_async,
    all_reduce_coalesced,
    all_gather,
    all_gather_into_tensor,
    all_gather_complex,
    all_gather_coalesced,
    all_gather_object,
    broadcast_each_src,
    broadcast_object_list,
    reduce_each_dst,
    reduce_scatter,
    reduce_scatter_tensor,
    gather,
    gather_object,
    scatter,
    scatter_object_list,
    all_to_all,
    all_to_all_single,
    all_to_all_single_noncontiguous,
    barrier,
    monitored_barrier,
    dtype_mismatch,
    not_in_group,
    coalescing_manager,
    functional_collectives,
    *P2P_SCENARIOS,
]


def run_scenarios(
    rank: int, world_size: int, scenarios: list[Callable[[Any], Any]]
) -> dict[str, dict[str, Any]]:
    """Every scenario on a gloo world, then on a unified one: {name: {backend: outcome}}."""
    kinds = KINDS[world_size]
    register_unified_backend(kinds, {k: "gloo" for k in kinds})
    results: dict[str, dict[str, Any]] = {}
    for backend in ("gloo", "unified"):
        world = dist.new_group(list(range(world_size)), backend=backend, timeout=TIMEOUT)
        ctx = Ctx(backend, rank, world_size, world)
        for fn in scenarios:
            torch.manual_seed(0)
            results.setdefault(fn.__name__, {})[backend] = ctx.outcome(lambda: fn(ctx))
            ctx.destroy_made()
            dist.barrier()  # the harness's gloo world: a failed scenario stays contained
    return results


def same(a: Any, b: Any, exact: bool = True) -> bool:
    """Equal values; float tensors within rounding unless ``exact`` (a sum of more than two
    floats depends on the order the ranks add in, which differs between the backends)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if exact or not a.is_floating_point():
            return torch.equal(a, b)
        return torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y, exact) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], exact) for k in a)
    return type(a) is type(b) and a == b


def compare(per_rank: list[dict[str, dict[str, Any]]]) -> tuple[list[str], dict[str, int]]:
    """Problems, and how many scenarios each backend passed. A problem: "unified" fails or
    answers differently where gloo passes (bitwise on 2 ranks), a refusal that does not say
    what to use instead, or gloo failing a scenario outside ``GLOO_FAILS``."""
    problems, passed = [], {"gloo": 0, "unified": 0}
    for name in per_rank[0]:
        got = {b: [r[name][b] for r in per_rank] for b in passed}
        ok = {b: all(o[0] == "ok" for o in got[b]) for b in passed}
        for b in passed:
            passed[b] += ok[b]
        if not ok["gloo"] and name not in GLOO_FAILS:
            problems.append(f"{name}: gloo fails it {got['gloo']}")
        if name in REFUSED:
            errors = [o for o in got["unified"] if o[0] == "error"]
            if not errors or any(not re.search(REFUSED[name], o[2]) for o in errors):
                problems.append(f"{name}: not the refusal {REFUSED[name]!r}: {got['unified']}")
        elif ok["gloo"] and not same(got["gloo"], got["unified"], exact=len(per_rank) == 2):
            problems.append(f"{name}: gloo {got['gloo']} unified {got['unified']}")
    return problems, passed


def check_scenarios(world_size: int, scenarios: list[Callable[[Any], Any]]) -> None:
    """Run ``scenarios`` in one forked run of ``world_size`` ranks and compare the backends."""
    problems, passed = compare(run_ranks(run_scenarios, world_size, scenarios, timeout=180))
    print(f"{world_size} ranks: of {len(scenarios)} scenarios {passed}")
    assert problems == []


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_torch_scenarios_match_gloo(world_size: int) -> None:
    # A functional collective's first call imports torch._dynamo (seconds): once here, not in
    # every forked worker.
    import torch._dynamo  # noqa: F401

    # On 4 ranks the DDP scenarios join this forked run; on 2 ranks test_comm_backend_ddp runs
    # them alone, bitwise.
    check_scenarios(world_size, SCENARIOS + (DDP_SCENARIOS if world_size == 4 else []))
