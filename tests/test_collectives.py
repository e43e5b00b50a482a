"""Every collective x dtype x op on 2, 3 and 4 real processes, against gloo's result and
a float64/int64 reference, on random data with a printed seed. Sizes cover the one-shot
and two-phase all_reduce, empty tensors, odd element counts, and (on the small-buffer
clusters) messages many times larger than the staging region. Each collective's call and
check is its entry in tests/cases.py; the bodies here pick the matrix and add the
comparisons with gloo, the coalesced forms and the rest."""

from __future__ import annotations

import torch
import torch.distributed as dist
from cases import CASES, Call, a2a_inputs, barrier_held, inputs
from refs import DTYPES, OPS, assert_close, make, reduce_ref, valid_ops

SIZES = [0, 1, 7, 1000, 5003, 300_001]


def _gloo_supports(fn) -> bool:
    try:
        fn()
        return True
    except (RuntimeError, ValueError, TypeError):
        return False


def body_all_reduce(ctx, seed: int, sizes: list[int]) -> int:
    checks = 0
    for dtype in DTYPES:
        for op in valid_ops(dtype):
            for n in sizes:
                c = Call(dtype, n, op)
                ours = CASES["all_reduce"](ctx, seed, c)
                theirs = inputs(ctx, seed, c)[ctx.rank]
                if op != "AVG" and dtype not in (torch.float16, torch.bfloat16, torch.bool):
                    if _gloo_supports(lambda: dist.all_reduce(theirs, op=OPS[op], group=ctx.gloo)):
                        assert_close(ours, theirs, c.what("all_reduce", ctx) + " vs gloo", ctx.world)
                checks += 1
    return checks


def test_all_reduce(cluster, seed):
    checks = cluster.run(body_all_reduce, seed, SIZES)
    assert checks[0] > 100


def body_all_reduce_noncontiguous_and_async(ctx, seed: int) -> None:
    base = make(seed, ctx.rank, 64 * 33, torch.float32).view(64, 33)
    view = base.t()  # not contiguous
    ref = reduce_ref([make(seed, r, 64 * 33, torch.float32).view(64, 33).t() for r in range(ctx.world)], "MAX")
    work = dist.all_reduce(view, op=dist.ReduceOp.MAX, async_op=True)
    assert work.wait()
    assert work.is_completed()
    assert_close(view, ref, "non-contiguous all_reduce")
    x = make(seed, ctx.rank, 4096, torch.float64, salt=1)
    fut = dist.all_reduce(x, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2).wait()
    ref = reduce_ref([make(seed, r, 4096, torch.float64, salt=1) for r in range(ctx.world)], "SUM")
    assert_close(doubled, ref * 2, "future of all_reduce", ctx.world)


def body_collectives_inside_future_callbacks(ctx, seed: int) -> None:
    """As PowerSGD's comm hook does: a future's callback issues collectives and waits."""
    w = ctx.world
    a = make(seed, ctx.rank, 1000, torch.float32)
    b = make(seed, ctx.rank, 500, torch.float32, salt=1)
    c = make(seed, ctx.rank, 300, torch.float32, salt=2)

    def then(fut):
        dist.all_reduce(b, async_op=True).get_future().wait()  # async, waited in the callback
        dist.all_reduce(c)  # blocking, in the callback
        return fut.value()[0] + 1

    out = dist.all_reduce(a, async_op=True).get_future().then(then).wait()
    ref = lambda n, salt: reduce_ref([make(seed, r, n, torch.float32, salt=salt) for r in range(w)], "SUM")  # noqa: E731
    assert_close(out, ref(1000, 0) + 1, "chained future", w)
    assert_close(b, ref(500, 1), "collective waited inside a callback", w)
    assert_close(c, ref(300, 2), "blocking collective inside a callback", w)


def test_collectives_inside_future_callbacks(cluster, seed):
    cluster.run(body_collectives_inside_future_callbacks, seed, timeout=120)


def test_non_contiguous_async_and_future(cluster, seed):
    cluster.run(body_all_reduce_noncontiguous_and_async, seed)


def body_broadcast_reduce(ctx, seed: int, sizes: list[int]) -> None:
    for dtype in DTYPES:
        for n in sizes:
            for root in range(ctx.world):
                CASES["broadcast"](ctx, seed, Call(dtype, n, root=root, salt=root))
            for op in valid_ops(dtype)[:4]:
                CASES["reduce"](ctx, seed, Call(dtype, n, op, root=(n + len(op)) % ctx.world, salt=3))


def test_broadcast_and_reduce(cluster, seed):
    cluster.run(body_broadcast_reduce, seed, [0, 1, 999, 200_003])


def body_all_gather(ctx, seed: int, sizes: list[int]) -> None:
    for dtype in DTYPES:
        for n in sizes:
            c = Call(dtype, n)
            CASES["all_gather_into_tensor"](ctx, seed, c)
            outs = CASES["all_gather"](ctx, seed, c)
            ref = [torch.empty(n, dtype=dtype) for _ in range(ctx.world)]
            dist.all_gather(ref, inputs(ctx, seed, c)[ctx.rank], group=ctx.gloo)
            for r in range(ctx.world):
                assert_close(outs[r], ref[r], f"all_gather vs gloo {dtype} n={n}")
    # Coalesced: several tensors of different sizes in one call.
    ins = [make(seed, ctx.rank, k, torch.float32, salt=k) for k in (3, 1000, 17)]
    outs = [torch.empty(ctx.world * t.numel()) for t in ins]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    for o, k in zip(outs, (3, 1000, 17)):
        assert_close(o, torch.cat([make(seed, r, k, torch.float32, salt=k) for r in range(ctx.world)]), "coalesced all_gather")


def body_all_gather_coalesced_mixed_dtypes(ctx, seed: int) -> None:
    specs = [(torch.int8, 3), (torch.float32, 2), (torch.bool, 5), (torch.float64, 1), (torch.bfloat16, 0), (torch.int64, 7)]
    ins = [make(seed, ctx.rank, n, dt, salt=k) for k, (dt, n) in enumerate(specs)]
    outs = [torch.empty(ctx.world * n, dtype=dt) for dt, n in specs]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    for k, (o, (dt, n)) in enumerate(zip(outs, specs)):
        ref = torch.cat([make(seed, r, n, dt, salt=k) for r in range(ctx.world)])
        assert_close(o, ref, f"coalesced all_gather of mixed dtypes, {dt}[{n}]")


def test_all_gather_coalesced_mixed_dtypes(cluster, seed):
    cluster.run(body_all_gather_coalesced_mixed_dtypes, seed)


def test_all_gather(cluster, seed):
    cluster.run(body_all_gather, seed, [0, 1, 33, 70_001])


def body_reduce_scatter(ctx, seed: int, sizes: list[int]) -> None:
    for dtype in DTYPES:
        for op in valid_ops(dtype):
            for n in sizes:
                CASES["reduce_scatter_tensor"](ctx, seed, Call(dtype, n, op))
        c = Call(dtype, 501, "MAX", salt=9)
        out = CASES["reduce_scatter"](ctx, seed, c)
        if dtype in (torch.float32, torch.int64):
            ref = torch.empty(c.n, dtype=dtype)
            mine = inputs(ctx, seed, c, n=c.n * ctx.world)[ctx.rank]
            dist.reduce_scatter(ref, list(mine.chunk(ctx.world)), op=dist.ReduceOp.MAX, group=ctx.gloo)
            assert_close(out, ref, f"reduce_scatter vs gloo {dtype}")
    ins = [make(seed, ctx.rank, k * ctx.world, torch.float64, salt=k) for k in (5, 4000)]
    outs = [torch.empty(k, dtype=torch.float64) for k in (5, 4000)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.reduce_scatter_tensor(o, i)
    cm.wait()
    for o, k in zip(outs, (5, 4000)):
        full = reduce_ref([make(seed, r, k * ctx.world, torch.float64, salt=k) for r in range(ctx.world)], "SUM")
        assert_close(o, full[ctx.rank * k : (ctx.rank + 1) * k], "coalesced reduce_scatter", ctx.world)


def test_reduce_scatter(cluster, seed):
    cluster.run(body_reduce_scatter, seed, [0, 1, 129, 40_000])


def body_coalesced_all_reduce(ctx, seed: int) -> None:
    shapes = (10, 3000, 7, 50_000)
    ts = [make(seed, ctx.rank, k, torch.float32, salt=k) for k in shapes]
    dist.all_reduce_coalesced(ts, op=dist.ReduceOp.SUM)
    for t, k in zip(ts, shapes):
        ref = reduce_ref([make(seed, r, k, torch.float32, salt=k) for r in range(ctx.world)], "SUM")
        assert_close(t, ref, f"all_reduce_coalesced float32[{k}]", ctx.world)
    # The coalescing manager (as FSDP/DDP use it), with mixed dtypes.
    mixed = [(33, torch.float64), (9, torch.int64), (4000, torch.bfloat16)]
    ts = [make(seed, ctx.rank, k, dt, salt=k) for k, dt in mixed]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
    cm.wait()
    for t, (k, dt) in zip(ts, mixed):
        ref = reduce_ref([make(seed, r, k, dt, salt=k) for r in range(ctx.world)], "MAX")
        assert_close(t, ref, f"coalesced all_reduce MAX {dt}[{k}]")


def test_all_reduce_coalesced(cluster, seed):
    cluster.run(body_coalesced_all_reduce, seed)


def body_all_to_all(ctx, seed: int, scale: int, row: int) -> None:
    me = ctx.rank
    for dtype in DTYPES:
        c = Call(dtype, row, rows=scale)
        out = CASES["all_to_all_single"](ctx, seed, c)
        send, xs = a2a_inputs(ctx, seed, c)
        ref = torch.empty_like(out)
        dist.all_to_all_single(ref, xs[me], [send[i][me] for i in range(ctx.world)], send[me], group=ctx.gloo)
        assert_close(out, ref, f"all_to_all_single vs gloo {dtype}")
    # Even split without sizes, and the list form.
    x = make(seed, me, ctx.world * 10, torch.int32, salt=5)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    ref = torch.empty_like(x)
    dist.all_to_all_single(ref, x, group=ctx.gloo)
    assert_close(out, ref, "all_to_all_single even split")
    CASES["all_to_all"](ctx, seed, Call(torch.float32, 3))


def test_all_to_all(cluster, seed):
    cluster.run(body_all_to_all, seed, 50, 3)
    cluster.run(body_all_to_all, seed + 1, 4000, 17)  # windows far beyond the staging size


def body_gather_scatter(ctx, seed: int) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float64):
        for n in (0, 5, 30_001):
            for root in range(ctx.world):
                CASES["gather"](ctx, seed, Call(dtype, n, root=root, salt=root))
                CASES["scatter"](ctx, seed, Call(dtype, n, root=root, salt=root))


def test_gather_and_scatter(cluster, seed):
    cluster.run(body_gather_scatter, seed)


def body_barrier(ctx) -> tuple[float, float]:
    return CASES["barrier"](ctx, 0, Call(torch.float32, 0))


def test_barrier_waits_for_the_last_rank(cluster):
    times = cluster.run(body_barrier)
    assert barrier_held(times), times


def body_send_recv(ctx, seed: int) -> None:
    me, w = ctx.rank, ctx.world
    for n in (0, 1, 1000, 200_000):
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
            CASES["send_recv"](ctx, seed, Call(dtype, n, salt=n))
    # Tags received in another order than sent: a message whose tag no recv matches yet
    # must not hold back the messages behind it (gloo delivers these too).
    if me == 0:
        works = [dist.isend(make(seed, 0, 1000, torch.float32, salt=t), dst=w - 1, tag=t) for t in (1, 2, 3)]
        for wk in works:
            wk.wait()
    elif me == w - 1:
        for t in (3, 2, 1):
            got = torch.empty(1000)
            dist.recv(got, src=0, tag=t)
            assert_close(got, make(seed, 0, 1000, torch.float32, salt=t), f"recv of tag {t} posted out of order")
    dist.barrier()
    # Blocking send/recv in a fixed order, several messages queued on one pair.
    if me == 0:
        for k in range(3):
            dist.send(make(seed, 0, 100 + k, torch.float64, salt=k), dst=w - 1, tag=k)
    elif me == w - 1:
        for k in range(3):
            t = torch.empty(100 + k, dtype=torch.float64)
            dist.recv(t, src=0, tag=k)
            assert_close(t, make(seed, 0, 100 + k, torch.float64, salt=k), f"send/recv message {k}")
    dist.barrier()


def test_send_recv(cluster, seed):
    cluster.run(body_send_recv, seed)


def body_functional(ctx, seed: int) -> None:
    import torch.distributed._functional_collectives as fc

    pg = dist.group.WORLD
    assert pg.group_name, "the group name must be set for functional collectives"
    x = make(seed, ctx.rank, 1000, torch.float32)
    xs = [make(seed, r, 1000, torch.float32) for r in range(ctx.world)]
    assert_close(fc.all_reduce(x, "sum", pg).wait(), reduce_ref(xs, "SUM"), "fc.all_reduce", ctx.world)
    assert_close(fc.all_gather_tensor(x, 0, pg).wait(), torch.cat(xs), "fc.all_gather_tensor")
    full = reduce_ref(xs, "SUM")
    n = 1000 // ctx.world
    rs = fc.reduce_scatter_tensor(x[: n * ctx.world], "sum", 0, pg).wait()
    full = reduce_ref([t[: n * ctx.world] for t in xs], "SUM")
    assert_close(rs, full[ctx.rank * n : (ctx.rank + 1) * n], "fc.reduce_scatter_tensor", ctx.world)
    a2a = fc.all_to_all_single(x[: n * ctx.world], None, None, pg).wait()
    assert_close(a2a, torch.cat([t[ctx.rank * n : (ctx.rank + 1) * n] for t in xs]), "fc.all_to_all_single")
    assert_close(fc.broadcast(x, 0, pg).wait(), xs[0], "fc.broadcast")
    out = [t.wait() for t in fc.all_reduce_coalesced([x, x * 2], "max", pg)]
    assert_close(out[0], reduce_ref(xs, "MAX"), "fc.all_reduce_coalesced [0]")
    assert_close(out[1], reduce_ref(xs, "MAX") * 2, "fc.all_reduce_coalesced [1]")
    if ctx.world == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh.get_group("tp")
        assert tp.getBackendName() == "rsccl" if hasattr(tp, "getBackendName") else True
        y = fc.all_reduce(x, "sum", (mesh, 1)).wait()
        peers = [r for r in range(4) if r // 2 == ctx.rank // 2]
        assert_close(y, reduce_ref([xs[r] for r in peers], "SUM"), "fc.all_reduce on mesh dim tp", 2)
        from torch.distributed.tensor import DTensor, Replicate, Shard

        d = DTensor.from_local(x.view(10, 100), mesh, [Shard(0), Shard(1)])
        full = d.redistribute(mesh, [Replicate(), Replicate()]).to_local()
        expect = torch.cat([torch.cat([xs[2 * i].view(10, 100), xs[2 * i + 1].view(10, 100)], 1) for i in range(2)], 0)
        assert_close(full, expect, "DTensor redistribute to Replicate")


def test_functional_collectives_and_device_mesh(cluster, seed):
    cluster.run(body_functional, seed)


def body_subgroups(ctx, seed: int) -> None:
    w = ctx.world
    evens = list(range(0, w, 2))
    tail = list(range(1, w))
    g_even = dist.new_group(evens)
    g_tail = dist.new_group(tail, backend="rsccl")
    x = make(seed, ctx.rank, 777, torch.float32)
    if ctx.rank in evens:
        y = x.clone()
        dist.all_reduce(y, group=g_even)
        assert_close(y, reduce_ref([make(seed, r, 777, torch.float32) for r in evens], "SUM"), "all_reduce on evens", len(evens))
        dist.broadcast(y, src=evens[-1], group=g_even)
    if ctx.rank in tail:
        out = torch.empty(len(tail) * 777)
        dist.all_gather_into_tensor(out, x, group=g_tail)
        assert_close(out, torch.cat([make(seed, r, 777, torch.float32) for r in tail]), "all_gather on ranks 1..")
        assert dist.get_group_rank(g_tail, ctx.rank) == ctx.rank - 1
    # The world group still works after subgroups ran.
    dist.all_reduce(x)
    assert_close(x, reduce_ref([make(seed, r, 777, torch.float32) for r in range(w)], "SUM"), "world after subgroups", w)
    for g in (g_even, g_tail):
        if ctx.rank in (evens if g is g_even else tail):
            dist.destroy_process_group(g)


def test_subgroups(cluster, seed):
    cluster.run(body_subgroups, seed)


def body_region_is_populated_at_init(ctx, seed: int) -> dict:
    """The shared region is fully allocated and mapped at init; collectives of every kind
    add nothing to it (what the engine could allocate is the region)."""
    import rsccl

    def region_rss() -> tuple[int, int]:
        size = rss = 0
        cur = None
        with open("/proc/self/smaps") as f:
            for line in f:
                if "rsccl-host-region" in line:
                    cur = True
                elif line[:1].isalnum() and "-" in line.split()[0]:
                    cur = None
                elif cur and line.startswith("Size:"):
                    size += int(line.split()[1])
                elif cur and line.startswith("Rss:"):
                    rss += int(line.split()[1])
        return size, rss

    stats0 = rsccl.memory_stats()
    size0, rss0 = region_rss()
    x = make(seed, ctx.rank, 200_000, torch.float32)
    dist.all_reduce(x)
    dist.broadcast(x, 0)
    out = torch.empty(ctx.world * x.numel())
    dist.all_gather_into_tensor(out, x)
    dist.reduce_scatter_tensor(x, out)
    dist.all_to_all_single(out, out)
    dist.barrier()
    stats1 = rsccl.memory_stats()
    size1, rss1 = region_rss()
    assert size0 * 1024 >= stats0["host_region_bytes"] > 0, (size0, stats0)
    assert rss0 == size0, f"region not fully populated at init: {rss0} of {size0} KiB resident"
    assert (size1, rss1) == (size0, rss0), "collectives changed the region mapping"
    assert stats1["host_region_bytes"] == stats0["host_region_bytes"]
    assert stats1["collectives"] > stats0["collectives"]
    return stats1


def test_region_allocated_at_init(cluster, seed):
    stats = cluster.run(body_region_is_populated_at_init, seed)
    assert all(s["engine"] == "host" for s in stats)
