"""Groups that span hosts, emulated on one machine: each rank sets RSCCL_HOST_ID to
"emul-host-{rank // per_host}" while it creates the group, so rsccl sees two hosts. With 4
GPUs: 2 hosts x 2 GPUs (the flat NCCL communicator, rsccl's engine inside each host and
the cross-host communicators: flat and hierarchical all_reduce, all_gather and
reduce_scatter; the ranks are host-major); with 2 GPUs: 2 hosts x 1 GPU (flat NCCL only).
all_to_all (single, even and uneven splits, and the list form) runs on NCCL in both.
CUDA send/recv across hosts (batch_isend_irecv rings, isend/irecv, "both send first")
run on the pair communicators and are checked bit for bit against the sender's data,
which the receiver makes itself from the seed; the first one must allocate no device
memory; a killed rank must make the others raise within the timeout.

Every CUDA collective is checked against backend="nccl" (ctx.nccl, over the same ranks)
on random inputs. Harness rule: a body that mixes rsccl and NCCL calls must let every rank
reach every NCCL call, or the ranks that did wait for the others forever. Bodies collect
their failures and raise at the end; the emulated groups have a short timeout, so a rank
that does fall out of step only delays its peers by that much.
"""

from __future__ import annotations

import os
import random
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from gpu_harness import (
    check_killed_rank,
    die_or_repeat,
    gpu_cluster,
    gpu_count,
    needs_gpus,
    needs_own_gpus,
    selected_worlds,
)
from gpu_refs import DTYPES, RED, check_vs_nccl, gather_inputs, ops_for, rand
from harness import ClusterError
from refs import assert_equal, assert_identical_across_ranks, check_reduction

pytestmark = needs_gpus


@pytest.fixture(autouse=True)
def _own_gpus(request):
    """The emulated hosts run on NCCL, which refuses two ranks on one GPU."""
    if "gpus" in request.fixturenames:
        needs_own_gpus(request.getfixturevalue("gpus").world)


GROUP_TIMEOUT = 60.0
# Sizes in elements: 1 and odd counts (flat in every config: shards would not align);
# 262144 and 1.5 Mi (even, 16-byte-aligned shards: hierarchical where the config allows).
SIZES = [1, 7, 100_003, 262_144, 1_572_864]
CONFIGS = {
    "flat": {},  # the default threshold (16 MiB): every size above runs flat
    "hierarchical": {"nccl_hierarchical_min_bytes": 0},  # every eligible all_reduce runs hierarchically
    "few-ctas": {"nccl_max_ctas": 2, "nccl_hierarchical_min_bytes": "1MiB"},
    # Hierarchical from any size, but a reduce_scatter's partial sums (2 hosts x output
    # bytes) must fit in 1 MiB: larger ones run flat.
    "small-scratch": {"nccl_hierarchical_min_bytes": 0, "nccl_hierarchical_scratch_bytes": "1MiB"},
}
# Configs of groups for send/recv only (not in CONFIGS: the collective tests run over those).
P2P_CONFIGS = {
    "p2p": {},  # the defaults: nccl_p2p = 1
    "p2p-mem": {},  # the same, a group of its own whose first send/recv the memory test sees
    "no-p2p": {"nccl_p2p": 0},
}
DEFAULT_MIN_BYTES = 16 << 20
DEFAULT_SCRATCH_BYTES = 32 << 20


def _bytes(v) -> int:
    """An rsccl.Options size as bytes ("1MiB", 0)."""
    if isinstance(v, int):
        return v
    for unit, mult in (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30)):
        if v.endswith(unit):
            return int(v[: -len(unit)]) * mult
    return int(v)


def expect_hierarchical(kind: str, n: int, dtype: torch.dtype, op: str | None, world: int, config: str) -> bool:
    """Whether an all_gather (n elements per rank) or reduce_scatter (n output elements)
    should run hierarchically on the emulated 2 hosts x world/2 GPUs, host-major: the rules
    of all_gather_path / reduce_scatter_path (rust/core/src/cuda/nccl_engine/choice.rs), restated."""
    if world < 4:
        return False  # one GPU per host
    opts = CONFIGS[config]
    min_bytes = _bytes(opts.get("nccl_hierarchical_min_bytes", DEFAULT_MIN_BYTES))
    scratch = _bytes(opts.get("nccl_hierarchical_scratch_bytes", DEFAULT_SCRATCH_BYTES))
    piece = n * dtype.itemsize
    if piece == 0 or piece % 16 or piece * world < min_bytes:
        return False
    if kind == "all_gather":
        return True
    return op in ("SUM", "PRODUCT", "MIN", "MAX") and 2 * piece <= scratch


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
            options = CONFIGS[config] if config in CONFIGS else P2P_CONFIGS[config]
            groups[key] = dist.new_group(ranks, backend="rsccl", pg_options=rsccl.Options(**options), timeout=timedelta(seconds=timeout))
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
        "p2p_communicators": stats.get("nccl_p2p_communicators", -1),
        "p2p_bytes": stats.get("nccl_p2p_bytes", -1),
        "sum": x[0].item(),
    }


def test_group_sees_two_hosts_and_reports_nccl_memory(gpus):
    res = _cluster(gpus).run(body_group_facts, "flat")
    world = gpus.world
    for rank, r in enumerate(res):
        assert r["engine"] == "gloo" and r["cuda_engine"] == "nccl", f"rank {rank}: {r}"
        assert len(r["hosts"]) == 2, f"rank {rank}: hosts {r['hosts']}"
        assert r["nccl_bytes"] > 0, f"rank {rank}: memory_stats has no nccl_bytes: {r}"
        # One pair communicator per direction with every rank of the other host: 2 x 2 GPUs:
        # 2 peers, 4 communicators; 2 x 1: 1 peer, 2.
        pairs = 2 * (world // 2)
        assert r["p2p_communicators"] == pairs, f"rank {rank}: {r}"
        assert r["communicators"] == (2 if world >= 4 else 1) + pairs, f"rank {rank}: {r}"
        assert 0 < r["p2p_bytes"] < r["nccl_bytes"], f"rank {rank}: {r}"
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
                f.check(what + " (same bits on every rank)", assert_identical_across_ranks, ctx, ours, what)
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


# Dtypes NCCL reduces and rsccl's kernels do not: across hosts they run on NCCL (flat).
NCCL_ONLY_DTYPES = [torch.float64, torch.int8, torch.uint8]


def _check_sum_or_max(ours: torch.Tensor, xs: torch.Tensor, op: str, what: str) -> None:
    """`ours` is the `op` (SUM or MAX) of the rows of `xs`: float64 within a few ulps of the
    sum in rank order (NCCL's order may differ), integers exact (wrapping, as NCCL's do)."""
    if ours.dtype == torch.float64 and op == "SUM":
        want = xs.sum(0)
        torch.testing.assert_close(ours, want, rtol=xs.shape[0] * 2.0**-52, atol=xs.shape[0] * 8 * 2.0**-52, msg=lambda m: f"{what}: {m}")
    else:
        check_reduction(ours, xs, op, what)


def body_reductions_only_nccl_runs(ctx, seed: int, config: str) -> dict:
    """float64, int8 and uint8 all_reduce, reduce_scatter and reduce (SUM, MAX) on the NCCL
    engine: NCCL's result, on every rank, and the group stays usable (int64, int32 and
    float32 all_reduces after them right too). Before: rsccl's kernel table refused them
    with a TypeError and aborted the group, so every later call raised GroupAbortedError.
    Then a reduction NCCL does not run either (bool) raises TypeError on every rank, before
    anything is exchanged, and the group goes on working."""
    g = emulated_group(ctx, config)
    f = Failures(ctx.rank)
    W, me = ctx.world, ctx.rank
    for dtype in NCCL_ONLY_DTYPES:
        # 262144 elements: 16-byte-aligned shards, so with rsccl's kernels for the dtype the
        # "hierarchical" config would take the hierarchical path; it must run flat.
        for n in [7, 262_144]:
            for op in ("SUM", "MAX"):
                what = f"{dtype} {op} n={n} world={W} config={config}"
                x = rand(seed, me, n, dtype, op, salt=what)
                xs = gather_inputs(ctx, x)
                ours = x.clone()
                f.check("all_reduce " + what, dist.all_reduce, ours, RED[op], g)
                f.check("all_reduce " + what, _check_sum_or_max, ours, xs, op, "all_reduce " + what)
                big = rand(seed, me, W * n, dtype, op, salt="rs " + what)
                bigs = gather_inputs(ctx, big)
                ours = torch.empty(n, dtype=dtype, device=ctx.device)
                f.check("reduce_scatter " + what, dist.reduce_scatter_tensor, ours, big, RED[op], g)
                mine = bigs[:, me * n : (me + 1) * n]
                f.check("reduce_scatter " + what, _check_sum_or_max, ours, mine, op, "reduce_scatter " + what)
                ours = x.clone()
                f.check("reduce " + what, dist.reduce, ours, W - 1, RED[op], g)
                if me == W - 1:
                    f.check("reduce " + what, _check_sum_or_max, ours, xs, op, "reduce " + what)
    refused = "no error"
    try:
        dist.all_reduce(torch.ones(8, dtype=torch.bool, device=ctx.device), group=g)
    except TypeError as e:
        refused = f"TypeError: {e}"
    except Exception as e:  # noqa: BLE001 - reported: only a TypeError is right
        refused = f"{type(e).__name__}: {e}"
    for dtype in (torch.int64, torch.int32, torch.float32):
        what = f"{dtype} SUM after the others world={W} config={config}"
        x = rand(seed, me, 100_003, dtype, salt=what)
        xs = gather_inputs(ctx, x)
        ours = x.clone()
        f.check("all_reduce " + what, dist.all_reduce, ours, dist.ReduceOp.SUM, g)
        f.check("all_reduce " + what, check_reduction, ours, xs, "SUM", "all_reduce " + what)
    torch.cuda.synchronize()
    f.raise_any()
    return {"bool": refused}


@pytest.mark.parametrize("config", ["flat", "hierarchical"])
def test_reductions_only_nccl_runs_use_nccl_and_leave_the_group_usable(gpus, seed, config):
    """Issue 25, place 8: each engine answers for what it can run (cuda::decide::can_run)."""
    res = _cluster(gpus).run(body_reductions_only_nccl_runs, seed, config, timeout=600)
    for rank, r in enumerate(res):
        assert r["bool"].startswith("TypeError: ") and "passed bool; NCCL" in r["bool"], f"rank {rank}: {r}"
        assert f"rank {rank}" in r["bool"], f"rank {rank}'s error does not name it: {r}"


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
    x = rand(seed, ctx.rank, 1 << 20, torch.float32)
    return die_or_repeat(ctx, victim, timeout, lambda: dist.all_reduce(x, op=dist.ReduceOp.MAX, group=g))


def test_killed_rank_fails_the_survivors(seed):
    check_killed_rank(
        (body_emulated_warm, KILL_TIMEOUT),
        (body_die_or_keep_reducing, seed, 1, KILL_TIMEOUT),
        KILL_TIMEOUT,
        KILL_SLACK,
        "all_reduce",
        own_gpus=True,
    )


# -- hierarchical all_gather and reduce_scatter --------------------------------------------

# Elements per rank (all_gather) or output elements (reduce_scatter): 8 (32 bytes in
# float32: aligned, small), 4099 (unaligned: always flat), 65536 and 262144 (aligned), and
# 1 Mi + 8 (4 MiB + 32 bytes in float32: at world 4 the call reaches the default 16 MiB
# threshold, so "flat" takes the hierarchical path there; the reduce_scatter's 2 x 4 MiB
# partial sums do not fit "small-scratch"'s 1 MiB).
GATHER_SIZES = [8, 4099, 65_536, 262_144, (1 << 20) + 8]


def _hier_calls(pg) -> int:
    return int(pg.memory_stats().get("nccl_hierarchical_collectives", 0))


def _check_path(took: int, expect: bool, what: str) -> None:
    assert took == int(expect), (
        f"{what}: took the {'hierarchical' if took else 'flat'} path, expected {'hierarchical' if expect else 'flat'}"
    )


def body_hier_gather_scatter(ctx, seed: int, config: str) -> dict:
    g = emulated_group(ctx, config)
    pg = _backend(g)
    f = Failures(ctx.rank)
    W, me = ctx.world, ctx.rank
    start = _hier_calls(pg)
    for dtype in DTYPES:
        for n in GATHER_SIZES:
            what = f"{dtype} n={n} world={W} config={config}"
            x = rand(seed, me, n, dtype, salt="ag " + what)
            theirs = torch.empty(W * n, dtype=dtype, device=ctx.device)
            dist.all_gather_into_tensor(theirs, x, group=ctx.nccl)
            expect = expect_hierarchical("all_gather", n, dtype, None, W, config)
            # all_gather_into_tensor, out of place
            ours = torch.empty(W * n, dtype=dtype, device=ctx.device)
            before = _hier_calls(pg)
            f.check("all_gather_into_tensor " + what, dist.all_gather_into_tensor, ours, x, g)
            f.check("all_gather_into_tensor path " + what, _check_path, _hier_calls(pg) - before, expect, what)
            f.check("all_gather_into_tensor " + what, assert_equal, ours, theirs, "all_gather_into_tensor " + what)
            # in place: the input is this rank's block of the output (as FSDP2 calls it)
            buf = torch.full((W * n,), 7, dtype=dtype, device=ctx.device)
            buf.view(W, n)[me].copy_(x)
            f.check("all_gather_into_tensor in place " + what, dist.all_gather_into_tensor, buf, buf.view(W, n)[me], g)
            f.check("all_gather_into_tensor in place " + what, assert_equal, buf, theirs, "in-place all_gather " + what)
            # the list form
            outs = [torch.empty(n, dtype=dtype, device=ctx.device) for _ in range(W)]
            f.check("all_gather " + what, dist.all_gather, outs, x, g)
            f.check("all_gather " + what, assert_equal, torch.cat(outs), theirs, "all_gather " + what)
            for op in ops_for(dtype):
                rs_what = f"reduce_scatter {op} " + what
                big = rand(seed, me, W * n, dtype, op, salt="rs " + rs_what)
                theirs_rs = torch.empty(n, dtype=dtype, device=ctx.device)
                dist.reduce_scatter_tensor(theirs_rs, big, op=RED[op], group=ctx.nccl)
                ours_rs = torch.empty(n, dtype=dtype, device=ctx.device)
                before = _hier_calls(pg)
                f.check(rs_what, dist.reduce_scatter_tensor, ours_rs, big, RED[op], g)
                expect_rs = expect_hierarchical("reduce_scatter", n, dtype, op, W, config)
                f.check(rs_what + " path", _check_path, _hier_calls(pg) - before, expect_rs, rs_what)
                # NCCL rounds in its order, rsccl inside the host then NCCL across: both sides' roundings.
                f.check(rs_what, check_vs_nccl, ours_rs, theirs_rs, op, rs_what, 2 * W)
                f.check(rs_what + " (input unchanged)", assert_equal, big, rand(seed, me, W * n, dtype, op, salt="rs " + rs_what), rs_what)
    # async, issued from a side stream (FSDP2's pattern), aligned sizes
    side = torch.cuda.Stream(device=ctx.device)
    n = 262_144
    x = rand(seed, me, n, torch.bfloat16, salt="async ag")
    big = rand(seed, me, W * n, torch.float32, salt="async rs")
    ag_ref = torch.empty(W * n, dtype=x.dtype, device=ctx.device)
    dist.all_gather_into_tensor(ag_ref, x, group=ctx.nccl)
    rs_ref = torch.empty(n, device=ctx.device)
    dist.reduce_scatter_tensor(rs_ref, big, group=ctx.nccl)
    ag_out = torch.empty_like(ag_ref)
    rs_out = torch.empty_like(rs_ref)
    side.wait_stream(torch.cuda.current_stream())
    works = []
    with torch.cuda.stream(side):
        f.check("async all_gather", lambda: works.append(dist.all_gather_into_tensor(ag_out, x, group=g, async_op=True)))
        f.check("async reduce_scatter", lambda: works.append(dist.reduce_scatter_tensor(rs_out, big, group=g, async_op=True)))
    for w in works:
        f.check("async wait", w.wait)
    f.check("async all_gather", assert_equal, ag_out, ag_ref, "async all_gather")
    f.check("async reduce_scatter", check_vs_nccl, rs_out, rs_ref, "SUM", "async reduce_scatter", 2 * W)
    torch.cuda.synchronize()
    stats = pg.memory_stats()
    f.raise_any()
    return {"hierarchical": _hier_calls(pg) - start, "scratch": int(stats.get("nccl_scratch_bytes", -1))}


@pytest.mark.parametrize("config", ["flat", "hierarchical", "small-scratch"])
def test_hierarchical_all_gather_and_reduce_scatter_match_nccl(gpus, seed, config):
    res = _cluster(gpus).run(body_hier_gather_scatter, seed, config, timeout=900)
    hier = {r["hierarchical"] for r in res}
    assert len(hier) == 1, f"ranks took different paths: {hier}"
    if gpus.world >= 4:
        assert hier.pop() > 0, "no all_gather or reduce_scatter took the hierarchical path"
        want = _bytes(CONFIGS[config].get("nccl_hierarchical_scratch_bytes", DEFAULT_SCRATCH_BYTES))
    else:
        assert hier.pop() == 0, "a hierarchical collective with one GPU per host"
        want = 0  # no hierarchical path: no scratch
    for rank, r in enumerate(res):
        assert r["scratch"] == want, f"rank {rank}: nccl_scratch_bytes {r['scratch']}, expected {want}"


# -- all_to_all across hosts (NCCL send/recv in one group) ---------------------------------

A2A_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.int8, torch.bool]


def _splits(seed: int, salt: str, world: int, kind: str, rows: int) -> list[list[int]]:
    """S[i][j] = elements rank i sends to rank j, alike on every rank. even: `rows` each;
    uneven: random in [0, rows], a quarter of them 0 (the diagonal too, now and then)."""
    rng = random.Random(f"{seed}/{salt}")
    if kind == "even":
        return [[rows] * world for _ in range(world)]
    return [[0 if rng.random() < 0.25 else rng.randint(1, rows) for _ in range(world)] for _ in range(world)]


def body_all_to_all(ctx, seed: int, config: str) -> int:
    g = emulated_group(ctx, config)
    f = Failures(ctx.rank)
    W, me = ctx.world, ctx.rank
    checks = 0
    for dtype in A2A_DTYPES:
        for kind, rows in [("even", 1), ("even", 1000), ("even", 262_144), ("uneven", 7), ("uneven", 300_000)]:
            what = f"all_to_all_single {kind} rows={rows} {dtype} world={W} config={config}"
            s = _splits(seed, what, W, kind, rows)
            in_splits, out_splits = s[me], [s[i][me] for i in range(W)]
            x = rand(seed, me, sum(in_splits), dtype, salt=what)
            ours = torch.empty(sum(out_splits), dtype=dtype, device=ctx.device)
            theirs = torch.empty_like(ours)
            if kind == "even":
                f.check(what, dist.all_to_all_single, ours, x, None, None, g)
                dist.all_to_all_single(theirs, x, group=ctx.nccl)
            else:
                f.check(what, dist.all_to_all_single, ours, x, out_splits, in_splits, g)
                dist.all_to_all_single(theirs, x, out_splits, in_splits, group=ctx.nccl)
            f.check(what, assert_equal, ours, theirs, what)
            checks += 1
        # the list form, uneven (empty tensors included)
        what = f"all_to_all list {dtype} world={W} config={config}"
        s = _splits(seed, what, W, "uneven", 5000)
        ins = [rand(seed, me, s[me][j], dtype, salt=f"{what}/{j}") for j in range(W)]
        outs = [torch.empty(s[i][me], dtype=dtype, device=ctx.device) for i in range(W)]
        refs = [torch.empty_like(o) for o in outs]
        f.check(what, dist.all_to_all, outs, ins, g)
        dist.all_to_all(refs, ins, group=ctx.nccl)
        f.check(what, assert_equal, torch.cat(outs), torch.cat(refs), what)
        checks += 1
    # async on a side stream, then in place (input and output one tensor)
    what = f"async all_to_all_single world={W} config={config}"
    x = rand(seed, me, W * 65_536, torch.float32, salt=what)
    ref = torch.empty_like(x)
    dist.all_to_all_single(ref, x, group=ctx.nccl)
    out = torch.empty_like(x)
    side = torch.cuda.Stream(device=ctx.device)
    side.wait_stream(torch.cuda.current_stream())
    works = []
    with torch.cuda.stream(side):
        f.check(what, lambda: works.append(dist.all_to_all_single(out, x, group=g, async_op=True)))
    for w in works:
        f.check(what + " wait", w.wait)
    f.check(what, assert_equal, out, ref, what)
    y = x.clone()
    f.check("in-place all_to_all_single", dist.all_to_all_single, y, y, None, None, g)
    f.check("in-place all_to_all_single", assert_equal, y, ref, "in-place all_to_all_single")
    torch.cuda.synchronize()
    f.raise_any()
    return checks + 2


@pytest.mark.parametrize("config", ["flat", "hierarchical"])
def test_all_to_all_across_hosts_matches_nccl(gpus, seed, config):
    res = _cluster(gpus).run(body_all_to_all, seed, config, timeout=900)
    assert len(set(res)) == 1 and res[0] > 0, res


def body_first_p2p_calls_allocate_nothing(ctx, seed: int) -> dict:
    """On a fresh group spanning the emulated hosts: the device memory taken by the first
    all_to_all_single, gather and scatter, beyond what torch's caching allocator reserved
    meanwhile (the warm-up at creation connected NCCL's point-to-point channels with
    every peer, so NCCL allocates nothing now)."""
    # A timeout of its own makes this a group no other body has used (emulated_group keys).
    g = emulated_group(ctx, "flat", timeout=GROUP_TIMEOUT + 1)
    W, me = ctx.world, ctx.rank
    x = rand(seed, me, W * 4096, torch.float32, salt="first calls")
    out = torch.empty_like(x)
    piece = x[:4096].clone()
    pieces = [torch.empty_like(piece) for _ in range(W)]
    got = torch.empty_like(piece)
    torch.cuda.synchronize()
    free0, reserved0 = torch.cuda.mem_get_info(ctx.device)[0], torch.cuda.memory_reserved(ctx.device)
    dist.all_to_all_single(out, x, group=g)
    dist.gather(piece, pieces if me == 0 else None, dst=0, group=g)
    dist.scatter(got, pieces if me == 0 else None, src=0, group=g)
    torch.cuda.synchronize()
    free1, reserved1 = torch.cuda.mem_get_info(ctx.device)[0], torch.cuda.memory_reserved(ctx.device)
    ref = torch.empty_like(x)
    dist.all_to_all_single(ref, x, group=ctx.nccl)
    assert_equal(out, ref, "first all_to_all_single")
    return {"taken": (free0 - free1) - (reserved1 - reserved0), "nccl_bytes": g.memory_stats().get("nccl_bytes", 0)}


def test_first_p2p_calls_across_hosts_allocate_nothing(gpus, seed):
    res = _cluster(gpus).run(body_first_p2p_calls_allocate_nothing, seed, timeout=300)
    for rank, r in enumerate(res):
        # cuMemGetInfo moves in 2 MiB pages; NCCL's lazy connection took several MiB per peer.
        assert r["taken"] <= 2 << 20, f"rank {rank}: the first all_to_all/gather/scatter took {r['taken']} bytes: {r}"


def body_send_without_pair_communicators(ctx) -> dict:
    g = emulated_group(ctx, "no-p2p")
    pg = _backend(g)
    x = torch.zeros(4, device=ctx.device)
    stats = pg.memory_stats()
    res = {"p2p_communicators": stats.get("nccl_p2p_communicators", -1), "communicators": stats.get("nccl_communicators", -1)}
    try:
        if ctx.rank == 0:
            dist.send(x, ctx.world - 1, group=g)
        elif ctx.rank == ctx.world - 1:
            dist.recv(x, 0, group=g)
        else:
            return {**res, "error": "not involved"}
    except TypeError as e:
        return {**res, "error": f"TypeError: {e}"}
    return {**res, "error": "no error"}


def test_send_recv_across_hosts_without_nccl_p2p_are_a_type_error(gpus):
    """nccl_p2p = 0: no pair communicators, and a CUDA send/recv across hosts raises a
    TypeError naming the setting (on both ranks, before anything is queued)."""
    res = _cluster(gpus).run(body_send_without_pair_communicators)
    for rank, r in enumerate(res):
        assert r["p2p_communicators"] == 0 and r["communicators"] == (2 if gpus.world >= 4 else 1), f"rank {rank}: {r}"
    for rank in (0, gpus.world - 1):
        assert res[rank]["error"].startswith("TypeError") and "nccl_p2p" in res[rank]["error"], f"rank {rank}: {res[rank]}"


# -- send/recv across hosts (pair communicators) ------------------------------------------

P2P_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.bool]
MiB = 1 << 20
# Bytes: empty, one byte's worth, odd, 1 MiB, 64 MiB (rounded down to whole elements).
P2P_BYTES = [0, 1, 4099 * 8 + 3, MiB, 64 * MiB]


def _elems(nbytes: int, dtype: torch.dtype) -> int:
    return nbytes // torch.empty(0, dtype=dtype).element_size() if nbytes > 1 else nbytes


def _cross_peer(ctx) -> int:
    """This rank's partner on the other emulated host: r <-> r + W/2."""
    return (ctx.rank + ctx.world // 2) % ctx.world


def _wait_all(works) -> None:
    for w in works:
        w.wait()


def _batch(works: list, ops: list) -> None:
    works.extend(dist.batch_isend_irecv(ops))


def _post(works: list, op, t: torch.Tensor, peer: int, g) -> None:
    """dist.isend or dist.irecv of `t` with `peer`, its Work appended to `works`."""
    works.append(op(t, peer, group=g))


def _assert_completed(works) -> None:
    assert all(w.is_completed() for w in works), "an isend/irecv pair did not complete within 30 s"


def body_p2p_ring(ctx, seed: int) -> dict:
    """batch_isend_irecv over a ring of every rank, both directions at once: rank r sends
    one tensor to r + 1 and one to r - 1 and receives one from each (on 2 x 2 GPUs, 0-1
    and 2-3 are on one host: rsccl's kernels; 1-2 and 3-0 cross: pair communicators).
    torch issues the four ops one at a time; they must not deadlock. Exact comparison
    with what the sender made (the receiver makes it from the seed)."""
    g = emulated_group(ctx, "p2p")
    pg = _backend(g)
    f = Failures(ctx.rank)
    W, me = ctx.world, ctx.rank
    right, left = (me + 1) % W, (me - 1) % W
    before = pg.memory_stats().get("nccl_p2p_messages", 0)
    checks = 0
    for dtype in P2P_DTYPES:
        for nbytes in P2P_BYTES:
            n = _elems(nbytes, dtype)
            what = f"ring {dtype} n={n} world={W}"
            mine_r = rand(seed, me, n, dtype, salt=what + " rightward")
            mine_l = rand(seed, me, n, dtype, salt=what + " leftward")
            from_l = torch.empty(n, dtype=dtype, device=ctx.device)
            from_r = torch.empty(n, dtype=dtype, device=ctx.device)
            # With W = 2 both neighbours are one rank: messages between two ranks match
            # in the order sent, so every rank sends rightward first and receives from
            # the left first (the rightward message of its left neighbour).
            ops = [
                dist.P2POp(dist.isend, mine_r, right, g),
                dist.P2POp(dist.isend, mine_l, left, g),
                dist.P2POp(dist.irecv, from_l, left, g),
                dist.P2POp(dist.irecv, from_r, right, g),
            ]
            works = []
            f.check(what, _batch, works, ops)
            f.check(what + " wait", _wait_all, works)
            f.check(what + " from the left", assert_equal, from_l, rand(seed, left, n, dtype, salt=what + " rightward"), what)
            f.check(what + " from the right", assert_equal, from_r, rand(seed, right, n, dtype, salt=what + " leftward"), what)
            checks += 1
            del mine_r, mine_l, from_l, from_r
    torch.cuda.synchronize()
    after = pg.memory_stats().get("nccl_p2p_messages", 0)
    torch.cuda.empty_cache()
    f.raise_any()
    return {"checks": checks, "pair_messages": after - before}


def test_batch_isend_irecv_ring_across_hosts(gpus, seed):
    res = _cluster(gpus).run(body_p2p_ring, seed, timeout=900)
    want = len(P2P_DTYPES) * len(P2P_BYTES)
    for rank, r in enumerate(res):
        assert r["checks"] == want, f"rank {rank}: {r}"
        # Every message to or from the other host ran on a pair communicator: 2 of the 4
        # per call on 2 x 2 GPUs, all 4 on 2 x 1.
        per_call = 2 if gpus.world >= 4 else 4
        assert r["pair_messages"] == per_call * want, f"rank {rank}: {r}"


def body_both_send_first(ctx, seed: int) -> int:
    """Each rank and its partner on the other host both isend first, then irecv, then wait
    (lone calls, not a batch): each direction has its own communicator and stream, so
    neither receive waits behind its own rank's send. Then, several messages in a row to
    one peer match the peer's receives in order, posted late (after a sleep) and waited for
    in reverse order, from a side stream."""
    g = emulated_group(ctx, "p2p")
    f = Failures(ctx.rank)
    me, peer = ctx.rank, _cross_peer(ctx)
    checks = 0
    for dtype in [torch.float32, torch.int8]:
        for nbytes in [4, MiB, 16 * MiB]:
            n = _elems(nbytes, dtype)
            what = f"both send first {dtype} n={n}"
            x = rand(seed, me, n, dtype, salt=what)
            y = torch.empty(n, dtype=dtype, device=ctx.device)
            works = []
            f.check(what + " isend", _post, works, dist.isend, x, peer, g)
            f.check(what + " irecv", _post, works, dist.irecv, y, peer, g)
            f.check(what + " wait", _wait_all, works)
            f.check(what, assert_equal, y, rand(seed, peer, n, dtype, salt=what), what)
            checks += 1
    # Several messages to one peer, received late, waited for in reverse order.
    sizes = [7, 262_144, 4 * MiB + 5]
    side = torch.cuda.Stream(device=ctx.device)
    xs = [rand(seed, me, n, torch.bfloat16, salt=f"in order {i}") for i, n in enumerate(sizes)]
    ys = [torch.empty(n, dtype=torch.bfloat16, device=ctx.device) for n in sizes]
    side.wait_stream(torch.cuda.current_stream())
    sends, recvs = [], []
    with torch.cuda.stream(side):
        for x in xs:
            f.check("isend in order", _post, sends, dist.isend, x, peer, g)
    time.sleep(0.2)
    for y in ys:
        f.check("irecv in order", _post, recvs, dist.irecv, y, peer, g)
    for w in reversed(recvs + sends):
        f.check("wait in reverse order", w.wait)
    for i, (y, n) in enumerate(zip(ys, sizes)):
        f.check(f"in order {i}", assert_equal, y, rand(seed, peer, n, torch.bfloat16, salt=f"in order {i}"), f"message {i} of {len(sizes)}")
        checks += 1
    # Completion seen from the CPU, and a blocking send/recv pair (the lower rank first).
    x = rand(seed, me, 1000, torch.float32, salt="completed")
    y = torch.empty(1000, device=ctx.device)
    w = [dist.isend(x, peer, group=g), dist.irecv(y, peer, group=g)]
    deadline = time.monotonic() + 30
    while not all(v.is_completed() for v in w) and time.monotonic() < deadline:
        time.sleep(0.01)
    f.check("is_completed", _assert_completed, w)
    f.check("wait after completion", _wait_all, w)
    f.check("completed", assert_equal, y, rand(seed, peer, 1000, torch.float32, salt="completed"), "completed")
    z = rand(seed, me, 5000, torch.float32, salt="blocking")
    got = torch.empty_like(z)
    for sender in sorted((me, peer)):
        if sender == me:
            f.check("blocking send", dist.send, z, peer, g)
        else:
            f.check("blocking recv", dist.recv, got, peer, g)
    f.check("blocking", assert_equal, got, rand(seed, peer, 5000, torch.float32, salt="blocking"), "blocking send/recv")
    torch.cuda.synchronize()
    f.raise_any()
    return checks + 2


def test_isend_irecv_across_hosts_both_send_first(gpus, seed):
    res = _cluster(gpus).run(body_both_send_first, seed, timeout=300)
    assert len(set(res)) == 1 and res[0] == 6 + 3 + 2, res


# What the first send/recv may add to the device memory in use: cuMemGetInfo counts whole
# 2 MiB pages, and the CUDA driver may map a page for a kernel's first launch on a new
# stream. A pair communicator that was not warmed up allocates its connection's buffers
# (NCCL_BUFFSIZE-sized, per channel) at the first message: several MiB, well above this.
FIRST_P2P_SLACK = 4 * MiB


def body_first_p2p_allocates_nothing(ctx, seed: int) -> dict:
    """The first cross-host send/recv of a fresh group: device memory in use before and
    after (torch.cuda.mem_get_info, the device-wide figure, so NCCL's own allocations
    count), with the tensors allocated before the first reading and the checks made after
    the second."""
    g = emulated_group(ctx, "p2p-mem")
    pg = _backend(g)
    f = Failures(ctx.rank)
    me, peer = ctx.rank, _cross_peer(ctx)
    n = 16 * MiB // 4
    x = rand(seed, me, n, torch.float32, salt="first p2p")
    y = torch.empty(n, device=ctx.device)
    x2 = rand(seed, me, 1000, torch.float32, salt="first p2p small")
    y2 = torch.empty(1000, device=ctx.device)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(ctx.device)[0]
    works = []
    f.check("first isend/irecv", lambda: works.extend([dist.isend(x, peer, group=g), dist.irecv(y, peer, group=g)]))
    f.check("first isend/irecv (small)", lambda: works.extend([dist.isend(x2, peer, group=g), dist.irecv(y2, peer, group=g)]))
    f.check("first wait", _wait_all, works)
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info(ctx.device)[0]
    f.check("first p2p data", assert_equal, y, rand(seed, peer, n, torch.float32, salt="first p2p"), "first p2p")
    f.check("first p2p data (small)", assert_equal, y2, rand(seed, peer, 1000, torch.float32, salt="first p2p small"), "first p2p small")
    stats = pg.memory_stats()
    f.raise_any()
    return {"grew": free_before - free_after, "nccl_bytes": stats.get("nccl_bytes", 0), "p2p_bytes": stats.get("nccl_p2p_bytes", 0)}


def test_first_send_recv_across_hosts_allocates_nothing(gpus, seed):
    res = _cluster(gpus).run(body_first_p2p_allocates_nothing, seed, timeout=300)
    for rank, r in enumerate(res):
        print(
            f"rank {rank}: nccl_bytes {r['nccl_bytes'] / MiB:.1f} MiB, of which pair communicators {r['p2p_bytes'] / MiB:.1f} MiB; first send/recv took {r['grew'] / MiB:.1f} MiB"
        )
        assert r["nccl_bytes"] > 0 and r["p2p_bytes"] > 0, f"rank {rank}: {r}"
        assert r["grew"] <= FIRST_P2P_SLACK, (
            f"rank {rank}: the first send/recv across hosts took {r['grew'] / MiB:.1f} MiB of device memory: {r}"
        )


def body_emulated_warm_p2p(ctx, timeout: float) -> None:
    g = emulated_group(ctx, "p2p", timeout=timeout)
    x = torch.ones(1 << 20, device=ctx.device)
    dist.all_reduce(x, group=g)
    y = torch.empty_like(x)
    _wait_all(
        dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, x, (ctx.rank + 1) % ctx.world, g), dist.P2POp(dist.irecv, y, (ctx.rank - 1) % ctx.world, g)]
        )
    )
    torch.cuda.synchronize()
    assert y[0].item() == ctx.world


def body_die_or_keep_exchanging(ctx, seed: int, victim: int, timeout: float):
    """A ring of batch_isend_irecv until an error: the victim's neighbours wait on it, the
    others on them; every survivor must raise within the timeout (plus slack: the rank
    opposite the victim waits on a neighbour that waits on the victim, and both stop at
    about the same time)."""
    g = emulated_group(ctx, "p2p", timeout=timeout)
    W, me = ctx.world, ctx.rank
    x = rand(seed, me, 1 << 20, torch.float32)
    y = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, (me + 1) % W, g), dist.P2POp(dist.irecv, y, (me - 1) % W, g)]
    return die_or_repeat(ctx, victim, timeout, lambda: _wait_all(dist.batch_isend_irecv(ops)))


def test_killed_rank_fails_the_survivors_of_send_recv(seed):
    check_killed_rank(
        (body_emulated_warm_p2p, KILL_TIMEOUT),
        (body_die_or_keep_exchanging, seed, 1, KILL_TIMEOUT),
        KILL_TIMEOUT,
        KILL_SLACK,
        "a send/recv ring",
        own_gpus=True,
    )


A2A_MISMATCH_TIMEOUT = 15.0


def body_a2a_mismatch(ctx, seed: int, timeout: float):
    """Rank 0 sends rank W-1 fewer bytes than W-1 expects: NCCL cannot tell, so the call
    hangs until the watchdog's timeout aborts the group; every rank must then raise."""
    g = emulated_group(ctx, "flat", timeout=timeout)
    W, me = ctx.world, ctx.rank
    dist.all_reduce(torch.ones(4, device=ctx.device), group=g)  # created and working
    torch.cuda.synchronize()
    # Large enough that the receiver waits for steps the sender never sends (a few bytes
    # short could fit one NCCL step on both sides and go unnoticed).
    rows = 1 << 18
    s = [[rows] * W for _ in range(W)]
    s[0][W - 1] = 16  # what rank 0 sends; rank W-1 still expects `rows` from it
    in_splits = s[me]
    out_splits = [rows] * W
    x = rand(seed, me, sum(in_splits), torch.float32)
    out = torch.empty(sum(out_splits), device=ctx.device)
    start = time.monotonic()
    error = None
    try:
        dist.all_to_all_single(out, x, out_splits, in_splits, group=g)
        while time.monotonic() - start < 3 * timeout:
            torch.cuda.synchronize()
            dist.all_reduce(torch.ones(4, device=ctx.device), group=g)
            torch.cuda.synchronize()
            time.sleep(0.5)
    except Exception as e:  # noqa: BLE001 - the parent inspects it
        error = (type(e).__name__, str(e), time.monotonic() - start)
    torch.cuda.synchronize()
    assert (torch.arange(10, device=ctx.device) * 2).sum().item() == 90, "the GPU computes wrong results after the abort"
    return error


def test_all_to_all_split_mismatch_aborts_the_group_after_the_timeout(seed):
    worlds = [w for w in selected_worlds() if w <= gpu_count()]
    if not worlds:
        pytest.skip(f"none of the world sizes {selected_worlds()} fits on {gpu_count()} GPUs")
    world = max(worlds)
    c = gpu_cluster(world, timeout=A2A_MISMATCH_TIMEOUT, nccl_ref=False)  # a fresh cluster: this group ends aborted
    try:
        try:
            res = c.run(body_a2a_mismatch, seed, A2A_MISMATCH_TIMEOUT, timeout=3 * A2A_MISMATCH_TIMEOUT + 90)
        except ClusterError as e:
            pytest.fail(f"an all_to_all with splits that disagree left ranks hung past the group timeout:\n{e}")
    finally:
        c.close(timeout=30)
    for rank, error in enumerate(res):
        assert error is not None, f"rank {rank} ran on for {3 * A2A_MISMATCH_TIMEOUT:.0f} s after a mismatched all_to_all"
        kind, msg, took = error
        assert kind in ("TimeoutError", "GroupAbortedError", "PeerFailureError", "RuntimeError"), f"rank {rank} raised {kind}: {msg}"
        assert took < A2A_MISMATCH_TIMEOUT + KILL_SLACK, f"rank {rank} raised only after {took:.1f} s: {kind}: {msg}"
