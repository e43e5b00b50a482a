"""Groups that span hosts, emulated on one machine: each rank sets RSCCL_HOST_ID to
"emul-host-{rank // per_host}" while it creates the group, so rsccl sees two hosts. With 4
GPUs: 2 hosts x 2 GPUs (the flat NCCL communicator, rsccl's engine inside each host and
the cross-host communicators: flat and hierarchical all_reduce); with 2 GPUs: 2 hosts x 1
GPU (flat NCCL only).

Every CUDA collective is checked against backend="nccl" (ctx.nccl, over the same ranks)
on random inputs. Harness rule: a body that mixes rsccl and NCCL calls must let every rank
reach every NCCL call, or the ranks that did wait for the others forever. Bodies collect
their failures and raise at the end; the emulated groups have a short timeout, so a rank
that does fall out of step only delays its peers by that much.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from gpu_harness import gpu_cluster, gpu_count, needs_gpus, selected_worlds
from gpu_refs import (
    DTYPES,
    RED,
    assert_equal,
    assert_same_on_all_ranks,
    check_vs_nccl,
    ops_for,
    rand,
)
from harness import ClusterError

pytestmark = needs_gpus

GROUP_TIMEOUT = 60.0
# Sizes in elements: 1 and odd counts (flat in every config: shards would not align);
# 262144 and 1.5 Mi (even, 16-byte-aligned shards: hierarchical where the config allows).
SIZES = [1, 7, 100_003, 262_144, 1_572_864]
CONFIGS = {
    "flat": {},  # the default threshold (16 MiB): every size above runs flat
    "hierarchical": {"nccl_hierarchical_min_bytes": 0},  # every eligible all_reduce runs hierarchically
    "few-ctas": {"nccl_max_ctas": 2, "nccl_hierarchical_min_bytes": "1MiB"},
}


def _cluster(gpus):
    """A cluster of its own (the world group's options only make it distinct): the groups
    made here stay alive in it, and must not weigh on other modules' memory readings."""
    return gpus.with_options({"spin_count": 2001})


def emulated_group(ctx, config: str, ranks: list[int] | None = None, timeout: float = GROUP_TIMEOUT):
    """An rsccl group over `ranks` (default: all) whose members see two hosts, created on
    first use (every rank calls this in the same body) and kept in ctx.state."""
    import rsccl

    key = ("emulated", config, tuple(ranks or []), timeout)
    groups = ctx.state.setdefault("groups", {})
    if key not in groups:
        per_host = max(ctx.world // 2, 1)
        old = os.environ.get("RSCCL_HOST_ID")
        os.environ["RSCCL_HOST_ID"] = f"emul-host-{ctx.rank // per_host}"
        try:
            groups[key] = dist.new_group(
                ranks, backend="rsccl", pg_options=rsccl.Options(**CONFIGS[config]), timeout=timedelta(seconds=timeout)
            )
        finally:
            if old is None:
                os.environ.pop("RSCCL_HOST_ID", None)
            else:
                os.environ["RSCCL_HOST_ID"] = old
    return groups[key]


def _backend(g):
    """The ProcessGroupRsccl (new_group returns it as is)."""
    return g


class Failures:
    """Checks that record their failure and let the body go on to its next NCCL call."""

    def __init__(self, rank: int):
        self.rank = rank
        self.errors: list[str] = []

    def check(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - reported at the end of the body
            self.errors.append(f"rank {self.rank}: {what}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")

    def raise_any(self) -> None:
        if self.errors:
            raise AssertionError(f"{len(self.errors)} failure(s):\n" + "\n".join(self.errors[:10]))


def body_group_facts(ctx, config: str) -> dict:
    g = emulated_group(ctx, config)
    pg = _backend(g)
    x = torch.ones(1024, device=ctx.device)
    dist.all_reduce(x, group=g)
    torch.cuda.synchronize()
    stats = pg.memory_stats()
    return {
        "engine": pg.engine,
        "cuda_engine": pg._cuda_engine,
        "hosts": pg._comm.hosts,
        "nccl_bytes": stats.get("nccl_bytes", 0),
        "communicators": stats.get("nccl_communicators", 0),
        "sum": x[0].item(),
    }


def test_group_sees_two_hosts_and_reports_nccl_memory(gpus):
    res = _cluster(gpus).run(body_group_facts, "flat")
    world = gpus.world
    for rank, r in enumerate(res):
        assert r["engine"] == "gloo" and r["cuda_engine"] == "nccl", f"rank {rank}: {r}"
        assert len(r["hosts"]) == 2, f"rank {rank}: hosts {r['hosts']}"
        assert r["nccl_bytes"] > 0, f"rank {rank}: memory_stats has no nccl_bytes: {r}"
        assert r["communicators"] == (2 if world >= 4 else 1), f"rank {rank}: {r}"
        assert r["sum"] == world


def body_all_reduce(ctx, seed: int, config: str) -> dict:
    g = emulated_group(ctx, config)
    pg = _backend(g)
    f = Failures(ctx.rank)
    before = pg.memory_stats().get("nccl_hierarchical_collectives", 0)
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for n in SIZES:
                what = f"all_reduce {op} {dtype} n={n} world={ctx.world} config={config}"
                x = rand(seed, ctx.rank, n, dtype, op, salt=what)
                ours = x.clone()
                f.check(what, dist.all_reduce, ours, RED[op], g)
                theirs = x.clone()
                dist.all_reduce(theirs, op=RED[op], group=ctx.nccl)
                # Both are NCCL-rounded (or rsccl's inside a host): allow both sides' roundings.
                f.check(what, check_vs_nccl, ours, theirs, op, what, 2 * ctx.world)
                f.check(what + " (same bits on every rank)", assert_same_on_all_ranks, ctx, ours, what)
    torch.cuda.synchronize()
    hier = pg.memory_stats().get("nccl_hierarchical_collectives", 0) - before
    f.raise_any()
    return {"hierarchical": hier}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_all_reduce_matches_nccl(gpus, seed, config):
    res = _cluster(gpus).run(body_all_reduce, seed, config, timeout=900)
    hier = {r["hierarchical"] for r in res}
    assert len(hier) == 1, f"ranks took different paths: {hier}"
    if gpus.world >= 4 and config != "flat":
        assert hier.pop() > 0, "no all_reduce took the hierarchical path"
    if gpus.world < 4 or config == "flat":
        assert hier.pop() == 0, "a hierarchical all_reduce with one GPU per host, or under the threshold"


def body_other_collectives(ctx, seed: int, config: str) -> None:
    g = emulated_group(ctx, config)
    f = Failures(ctx.rank)
    W = ctx.world
    for dtype in DTYPES:
        for n in [1, 7, 4099, 262_144]:
            what = f"{dtype} n={n} world={W} config={config}"
            x = rand(seed, ctx.rank, n, dtype, salt=what)
            # all_gather (into a tensor, and into a list)
            ours = torch.empty(W * n, dtype=dtype, device=ctx.device)
            f.check("all_gather_into_tensor " + what, dist.all_gather_into_tensor, ours, x, g)
            theirs = torch.empty_like(ours)
            dist.all_gather_into_tensor(theirs, x, group=ctx.nccl)
            f.check("all_gather_into_tensor " + what, assert_equal, ours, theirs, "all_gather_into_tensor " + what)
            outs = [torch.empty(n, dtype=dtype, device=ctx.device) for _ in range(W)]
            f.check("all_gather " + what, dist.all_gather, outs, x, g)
            f.check("all_gather " + what, assert_equal, torch.cat(outs), theirs, "all_gather " + what)
            # reduce_scatter
            for op in ops_for(dtype):
                big = rand(seed, ctx.rank, W * n, dtype, op, salt="rs " + what)
                ours = torch.empty(n, dtype=dtype, device=ctx.device)
                f.check(f"reduce_scatter {op} " + what, dist.reduce_scatter_tensor, ours, big, RED[op], g)
                theirs = torch.empty_like(ours)
                dist.reduce_scatter_tensor(theirs, big, op=RED[op], group=ctx.nccl)
                f.check(f"reduce_scatter {op} " + what, check_vs_nccl, ours, theirs, op, f"reduce_scatter {op} " + what, 2 * W)
            # broadcast from the first and the last rank
            for root in (0, W - 1):
                ours = x.clone()
                f.check(f"broadcast root={root} " + what, dist.broadcast, ours, root, g)
                theirs = x.clone()
                dist.broadcast(theirs, src=root, group=ctx.nccl)
                f.check(f"broadcast root={root} " + what, assert_equal, ours, theirs, f"broadcast root={root} " + what)
            # reduce to rank 1 (on the first host with 4 GPUs, the second with 2)
            ours = x.clone()
            f.check("reduce " + what, dist.reduce, ours, 1, dist.ReduceOp.SUM, g)
            theirs = x.clone()
            dist.reduce(theirs, dst=1, op=dist.ReduceOp.SUM, group=ctx.nccl)
            if ctx.rank == 1:
                f.check("reduce " + what, check_vs_nccl, ours, theirs, "SUM", "reduce " + what, 2 * W)
            # gather / scatter to and from the last rank (NCCL send/recv inside one group)
            root = W - 1
            gl = [torch.empty_like(x) for _ in range(W)] if ctx.rank == root else None
            f.check("gather " + what, dist.gather, x, gl, root, g)
            allx = torch.empty(W * n, dtype=dtype, device=ctx.device)
            dist.all_gather_into_tensor(allx, x, group=ctx.nccl)
            if ctx.rank == root:
                f.check("gather " + what, assert_equal, torch.cat(gl), allx, "gather " + what)
            sl = list(allx.chunk(W)) if ctx.rank == root else None
            got = torch.empty_like(x)
            # The root scatters every rank's own input back to it.
            f.check("scatter " + what, dist.scatter, got, sl, root, g)
            mine = allx.view(W, n)[ctx.rank] if ctx.rank == root else x
            f.check("scatter " + what, assert_equal, got, mine, "scatter " + what)
    f.check("barrier", dist.barrier, g)
    torch.cuda.synchronize()
    f.raise_any()


@pytest.mark.parametrize("config", ["flat", "hierarchical"])
def test_other_collectives_match_nccl(gpus, seed, config):
    _cluster(gpus).run(body_other_collectives, seed, config, timeout=900)


def _start_async(works: list, t: torch.Tensor, g) -> None:
    works.append(dist.all_reduce(t, group=g, async_op=True))


def body_async(ctx, seed: int) -> None:
    g = emulated_group(ctx, "hierarchical")
    f = Failures(ctx.rank)
    side = torch.cuda.Stream(device=ctx.device)
    for n in [1000, 1 << 20]:
        what = f"async all_reduce n={n}"
        x = rand(seed, ctx.rank, n, torch.float32, salt=what)
        ours, ours2 = x.clone(), x.clone()
        works = []
        f.check(what, _start_async, works, ours, g)
        # Another one, issued from a side stream (as FSDP2 does).
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            f.check(what + " (side stream)", _start_async, works, ours2, g)
        for w in works:
            f.check(what + " wait", w.wait)
        theirs = x.clone()
        dist.all_reduce(theirs, group=ctx.nccl)
        f.check(what, check_vs_nccl, ours, theirs, "SUM", what, 2 * ctx.world)
        f.check(what + " (side stream)", check_vs_nccl, ours2, theirs, "SUM", what, 2 * ctx.world)
    torch.cuda.synchronize()
    f.raise_any()


def test_async_work_and_side_streams(gpus, seed):
    _cluster(gpus).run(body_async, seed)


def body_subgroup(ctx) -> float | None:
    # The first and the last rank: one on each emulated host (flat NCCL).
    ranks = [0, ctx.world - 1]
    g = emulated_group(ctx, "flat", ranks)
    if ctx.rank not in ranks:
        return None
    x = torch.full((4096,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(x, group=g)
    torch.cuda.synchronize()
    return x[0].item()


def test_subgroup_across_hosts(gpus):
    res = _cluster(gpus).run(body_subgroup)
    want = 1 + gpus.world
    for rank, got in enumerate(res):
        if rank in (0, gpus.world - 1):
            assert got == want, f"rank {rank}: {got}, expected {want}"


KILL_TIMEOUT = 20.0
KILL_SLACK = 25.0


def body_emulated_warm(ctx, timeout: float) -> None:
    g = emulated_group(ctx, "hierarchical", timeout=timeout)
    x = torch.ones(1 << 20, device=ctx.device)
    dist.all_reduce(x, group=g)
    torch.cuda.synchronize()
    assert x[0].item() == ctx.world


def body_die_or_keep_reducing(ctx, seed: int, victim: int, timeout: float):
    g = emulated_group(ctx, "hierarchical", timeout=timeout)
    if ctx.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    x = rand(seed, ctx.rank, 1 << 20, torch.float32)
    start = time.monotonic()
    error = None
    try:
        while time.monotonic() - start < 3 * timeout:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=g)
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the parent inspects it
        error = (type(e).__name__, str(e), time.monotonic() - start)
    t0 = time.monotonic()
    torch.cuda.synchronize()
    assert (torch.arange(10, device=ctx.device) * 2).sum().item() == 90, "the GPU computes wrong results after the failure"
    return error, time.monotonic() - t0


def test_killed_rank_fails_the_survivors(seed):
    worlds = [w for w in selected_worlds() if w <= gpu_count()]
    if not worlds:
        pytest.skip(f"none of the world sizes {selected_worlds()} fits on {gpu_count()} GPUs")
    world, victim = max(worlds), 1
    c = gpu_cluster(world, timeout=KILL_TIMEOUT, nccl_ref=False)  # a fresh cluster: this one ends broken
    try:
        c.run(body_emulated_warm, KILL_TIMEOUT, timeout=120)
        try:
            res = c.run(body_die_or_keep_reducing, seed, victim, KILL_TIMEOUT, timeout=3 * KILL_TIMEOUT + 90, may_exit=frozenset({victim}))
        except ClusterError as e:
            pytest.fail(f"with rank {victim} killed, the survivors did not come back (hung in NCCL or on the GPU?):\n{e}")
    finally:
        c.close(timeout=30)
    for rank, got in enumerate(res):
        if rank == victim:
            continue
        error, sync_s = got
        assert error is not None, f"rank {rank} kept running all_reduce for {3 * KILL_TIMEOUT:.0f} s with rank {victim} dead, without an error"
        kind, msg, took = error
        assert kind in ("PeerFailureError", "GroupAbortedError", "TimeoutError", "RuntimeError"), f"rank {rank} raised {kind}: {msg}"
        assert took < KILL_TIMEOUT + KILL_SLACK, f"rank {rank} raised only after {took:.1f} s (group timeout {KILL_TIMEOUT:.0f} s): {kind}: {msg}"
        assert sync_s < 10, f"rank {rank}: torch.cuda.synchronize() took {sync_s:.1f} s after the failure"
