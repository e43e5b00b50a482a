"""monitored_barrier on rsccl groups, with torch's semantics and messages (gloo's): rank 0
names the ranks that did not arrive within the timeout, the ranks that did arrive raise
too, and the group's later monitored_barriers work. torch >= 2.15 sends
dist.monitored_barrier to any group that serves CPU tensors; torch 2.11 only to gloo's,
so there the test calls the group's method, as torch would."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from harness import Cluster
from refs import assert_close, make, reduce_ref

TORCH_SENDS_IT = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15)


@pytest.fixture(scope="module")
def trio():
    c = Cluster(3, init_timeout=30.0)
    yield c
    assert c.close() == [0, 0, 0]


def _mb(seconds: float, wait_all: bool = False, group=None) -> str:
    """One monitored_barrier; "ok" or the exception's type and text."""
    timeout = timedelta(seconds=seconds)
    try:
        if TORCH_SENDS_IT:
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all)
        else:
            (group or dist.group.WORLD).monitored_barrier(timeout, wait_all_ranks=wait_all)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return f"{type(e).__name__}: {e}"
    return "ok"


def body_devices(ctx) -> list[str]:
    return [d.type for d in dist.group.WORLD._device_types]


def body_all_arrive(ctx, seed: int) -> list[str]:
    out = [_mb(30), _mb(30, wait_all=True)]
    x = make(seed, ctx.rank, 100, torch.float32)
    dist.all_reduce(x)  # the group's other traffic is untouched
    assert_close(x, reduce_ref([make(seed, r, 100, torch.float32) for r in range(ctx.world)], "SUM"), "all_reduce", ctx.world)
    return out


def body_absent(ctx, absent: list[int], seconds: float, wait_all: bool) -> list[str]:
    """On a group of its own (a failed monitored_barrier leaves rank 0's receives for the
    absent ranks posted, and an absent rank's next arrival could be taken for a late one:
    as with gloo, whose tags would then disagree, a group whose ranks skipped a
    monitored_barrier is not one to reuse), then the world group's, which all ranks pass."""
    g = dist.new_group(backend="rsccl")
    first = "absent" if ctx.rank in absent else _mb(seconds, wait_all, group=g)
    return [first, _mb(30, wait_all)]


def body_late(ctx) -> list[str]:
    """Rank 1 arrives after rank 0 gave up; rank 0's next monitored_barrier tells it so,
    and the one after that passes for everyone (a group of its own: see body_absent)."""
    g = dist.new_group(backend="rsccl")
    if ctx.rank == 0:
        first = _mb(2.0, group=g)
        dist.barrier(group=ctx.gloo)  # rank 1 goes in now
        g._monitored_arrivals[1].wait()  # its arrival was taken by the barrier that failed
        return [first, _mb(30, group=g), _mb(30, group=g)]
    if ctx.rank == 1:
        dist.barrier(group=ctx.gloo)
        return [_mb(30, group=g), _mb(30, group=g), _mb(30, group=g)]
    out = [_mb(30, group=g)]
    dist.barrier(group=ctx.gloo)
    return [*out, _mb(30, group=g), _mb(30, group=g)]


def body_subgroup(ctx) -> str:
    sub = dist.new_group([0, 1])
    if ctx.rank == 1:
        return "absent"
    if ctx.rank == 2:
        return "not a member"
    return _mb(0.3, group=sub)


def test_groups_declare_cpu_and_cuda(trio):
    assert trio.run(body_devices) == [["cpu", "cuda"]] * 3


def test_monitored_barrier_passes_when_all_arrive(trio, seed):
    assert trio.run(body_all_arrive, seed) == [["ok", "ok"]] * 3


def test_rank_0_names_the_first_absent_rank_and_the_others_are_told(trio):
    res = trio.run(body_absent, [1], 0.5, False, timeout=120)
    assert res[0][0].startswith("RuntimeError: rsccl: [Rank 0]: Rank 1 failed to pass monitoredBarrier in 500 ms"), res
    assert res[1][0] == "absent"
    assert res[2][0].startswith("RuntimeError: rsccl: Rank 2 successfully reached monitoredBarrier, but received errors"), res
    assert "rank 0 reported that rank 1 failed to pass it" in res[2][0], res
    assert [r[1] for r in res] == ["ok"] * 3, f"another group's monitored_barrier: {res}"


def test_wait_all_ranks_names_every_absent_rank(trio):
    res = trio.run(body_absent, [1, 2], 0.5, True, timeout=120)
    assert res[0][0] == "RuntimeError: rsccl: [Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 500 ms", res
    assert [r[1] for r in res] == ["ok"] * 3, f"another group's monitored_barrier: {res}"


def test_rank_0_that_runs_out_of_time_says_so(trio):
    res = trio.run(body_absent, [1, 2], 0.0, False, timeout=120)
    assert res[0][0].startswith("RuntimeError: rsccl: Rank 0 timed out in monitoredBarrier after 0 ms."), res
    assert "No ranks successfully processed in monitoredBarrier." in res[0][0], res
    assert [r[1] for r in res] == ["ok"] * 3, f"another group's monitored_barrier: {res}"


def test_a_rank_that_arrives_after_rank_0_gave_up_is_told(trio):
    res = trio.run(body_late, timeout=120)
    assert res[0][0].startswith("RuntimeError: rsccl: [Rank 0]: Rank 1 failed to pass monitoredBarrier"), res
    assert res[0][1:] == ["ok", "ok"], res
    assert res[1][0].startswith("RuntimeError: rsccl: Rank 1 successfully reached monitoredBarrier"), res
    assert "arrived after rank 0 had given up" in res[1][0], res
    assert res[1][1:] == ["ok", "ok"], res
    assert "rank 0 reported that rank 1 failed to pass it" in res[2][0] and res[2][1:] == ["ok", "ok"], res


def test_subgroup(trio):
    res = trio.run(body_subgroup, timeout=120)
    assert res[0].startswith("RuntimeError: rsccl: [Rank 0]: Rank 1 failed to pass monitoredBarrier"), res
    assert res[1:] == ["absent", "not a member"], res
