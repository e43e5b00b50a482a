"""Rooted CUDA collectives (reduce, gather, scatter) on 2 and 4 GPUs: every dtype (and op,
for reduce), every root, sizes from 1 element through odd counts to multi-step messages,
on the default group and on the small-buffer group (pipelined through staging), against
NCCL on the same random input and, for reduce, a float64/int64 reference. Also async Works,
a non-contiguous tensor, a CUDA graph, and a rank that passes another root."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cases import CASES, my_input
from gpu_harness import capture, case_call, needs_gpus, warm_up_aside
from gpu_refs import DTYPES, RED, check_vs_nccl, gather_inputs, nccl_result, ops_for, rand, ref_call
from refs import assert_equal, check_reduction

pytestmark = needs_gpus

# 1 element; 7 x 2 bytes (not a multiple of 16); 100_003 (odd); 1.5 Mi + 3 elements: 3 to
# 12 MiB by dtype, several steps of the small-buffer group's staging.
SIZES = [1, 7, 100_003, 1_572_867]
CONFIGS = ["default", "small-buffer"]


def body_reduce(ctx, seed: int, config: str, sizes: list[int]) -> int:
    checks = 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for n in sizes if op == "SUM" else sizes[:3]:
                for root in range(ctx.world):
                    what = f"reduce {op} {dtype} n={n} root={root} world={ctx.world} group={config}"
                    c = case_call(ctx, config, what, dtype, n, op, root)
                    ours = CASES["reduce"](ctx, seed, c)  # the root's result against the exact one
                    x = my_input(seed, ctx.rank, c)
                    theirs = x.clone()
                    nccl_ok = nccl_result(dist.reduce, theirs, dst=root, op=RED[op], group=ctx.nccl)
                    if ctx.rank == root:
                        if nccl_ok:
                            check_vs_nccl(ours, theirs, op, what, ctx.world)
                    else:
                        # Not the root: NCCL leaves the input as it was, so does rsccl.
                        assert_equal(ours, x, f"{what}: a non-root rank's tensor changed")
                    checks += 1
    torch.cuda.synchronize()
    return checks


@pytest.mark.parametrize("config", CONFIGS)
def test_reduce(gpus, seed, config):
    checks = gpus.run(body_reduce, seed, config, SIZES, timeout=300)
    assert min(checks) > 0


def body_gather_scatter(ctx, seed: int, config: str, sizes: list[int]) -> None:
    w, me = ctx.world, ctx.rank
    for dtype in DTYPES:
        for n in sizes:
            for root in range(w):
                what = f"gather {dtype} n={n} root={root} world={w} group={config}"
                c = case_call(ctx, config, what, dtype, n, root=root)
                ours = CASES["gather"](ctx, seed, c)  # the root's slot j: rank j's input
                theirs = [torch.empty(n, dtype=dtype, device=ctx.device) for _ in range(w)] if me == root else None
                ref_call(dist.gather, my_input(seed, me, c), theirs, dst=root, group=ctx.nccl)
                if me == root:
                    for j in range(w):
                        assert_equal(ours[j], theirs[j], f"{what}: slot {j} vs NCCL")

                what = f"scatter {dtype} n={n} root={root} world={w} group={config}"
                c = case_call(ctx, config, what, dtype, n, root=root)
                ours = CASES["scatter"](ctx, seed, c)  # this rank's chunk
                chunks = [my_input(seed, j, c) for j in range(w)] if me == root else None
                theirs = torch.empty_like(ours)
                ref_call(dist.scatter, theirs, chunks, src=root, group=ctx.nccl)
                assert_equal(ours, theirs, f"{what} vs NCCL")
    torch.cuda.synchronize()


@pytest.mark.parametrize("config", CONFIGS)
def test_gather_scatter(gpus, seed, config):
    gpus.run(body_gather_scatter, seed, config, SIZES, timeout=300)


def body_rooted_async_views_graph(ctx, seed: int) -> None:
    """Async Works waited on a side stream, a non-contiguous tensor, and the three rooted
    collectives captured in one CUDA graph and replayed on fresh data."""
    w, me, n = ctx.world, ctx.rank, 65_537
    root = w - 1
    # async, on a side stream, waited on the current stream
    x = rand(seed, me, n, torch.float32, salt="async reduce")
    xs = gather_inputs(ctx, x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ours = x.clone()
        work = dist.reduce(ours, dst=root, async_op=True)
    work.wait()
    if me == root:
        check_reduction(ours, xs, "SUM", "async reduce on a side stream")
    outs = [torch.empty_like(x) for _ in range(w)] if me == root else None
    dist.gather(x, outs, dst=root, async_op=True).wait()
    if me == root:
        for j in range(w):
            assert_equal(outs[j], xs[j].to(x.dtype), f"async gather slot {j}")
    # non-contiguous: every other element of a 2n buffer
    big = rand(seed, me, 2 * n, torch.bfloat16, salt="strided")
    view = big[::2]
    ref = view.clone()
    dist.reduce(view, dst=0)
    ref_call(dist.reduce, ref, dst=0, group=ctx.nccl)
    if me == 0:
        check_vs_nccl(view, ref, "SUM", "reduce of a strided view", w)
    else:
        assert_equal(big, rand(seed, me, 2 * n, torch.bfloat16, salt="strided"), "a non-root's strided tensor changed")
    out = torch.empty(n, dtype=torch.bfloat16, device=ctx.device)[::1]
    dist.scatter(out, [c.contiguous() for c in rand(seed, 0, w * n, torch.bfloat16, salt="scatter").chunk(w)] if me == 0 else None, src=0)
    assert_equal(out, rand(seed, 0, w * n, torch.bfloat16, salt="scatter").chunk(w)[me], "scatter into a fresh tensor")
    # CUDA graph: reduce, gather, scatter captured once, replayed on fresh data
    a = torch.zeros(n, dtype=torch.float32, device=ctx.device)
    gout = [torch.zeros(n, dtype=torch.float32, device=ctx.device) for _ in range(w)] if me == root else None
    sin = [torch.zeros(n, dtype=torch.float32, device=ctx.device) for _ in range(w)] if me == root else None
    sout = torch.zeros(n, dtype=torch.float32, device=ctx.device)
    gin = torch.zeros(n, dtype=torch.float32, device=ctx.device)

    def calls() -> None:
        dist.reduce(a, dst=root)
        dist.gather(gin, gout, dst=root)
        dist.scatter(sout, sin, src=root)

    warm_up_aside(calls)
    graph = capture(calls)
    for rep in range(4):
        what = f"graph replay {rep}"
        xa = rand(seed, me, n, torch.float32, salt=what + "a")
        xg = rand(seed, me, n, torch.float32, salt=what + "g")
        a.copy_(xa)
        gin.copy_(xg)
        if me == root:
            for j in range(w):
                sin[j].copy_(rand(seed, j, n, torch.float32, salt=what + "s"))
        graph.replay()
        torch.cuda.synchronize()
        xas = gather_inputs(ctx, xa)
        xgs = gather_inputs(ctx, xg)
        if me == root:
            check_reduction(a, xas, "SUM", f"{what}: reduce")
            for j in range(w):
                assert_equal(gout[j], xgs[j].to(torch.float32), f"{what}: gather slot {j}")
        assert_equal(sout, rand(seed, me, n, torch.float32, salt=what + "s"), f"{what}: scatter")
    torch.cuda.synchronize()


def test_rooted_async_views_and_graph(gpus, seed):
    gpus.run(body_rooted_async_views_graph, seed, timeout=180)


def body_root_mismatch(ctx, seed: int) -> str:
    """Rank 1 passes another root: every rank raises, naming the ranks, and the group
    still works after."""
    g = dist.new_group(backend="rsccl")
    x = rand(seed, ctx.rank, 1000, torch.float32, salt="mismatch")
    err = "no error"
    # A rank may raise at the reduce itself or at the barrier (the GPU reports the mismatch
    # asynchronously): every rank makes both calls either way, so the group's kernels stay
    # in step (see test_gpu_errors.body_mismatch).
    for call in (
        lambda: dist.reduce(x.clone(), dst=1 if ctx.rank == 1 else 0, group=g),
        torch.cuda.synchronize,
        lambda: dist.barrier(group=g),
    ):
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the parent inspects it
            if err == "no error":
                err = f"{type(e).__name__}: {e}"
    xs = gather_inputs(ctx, x)
    y = x.clone()
    dist.reduce(y, dst=0, group=g)
    if ctx.rank == 0:
        check_reduction(y, xs, "SUM", "reduce after a mismatch")
    dist.destroy_process_group(g)
    return err


def test_root_mismatch_raises_on_every_rank(gpus, seed):
    errs = gpus.run(body_root_mismatch, seed, timeout=120)
    for rank, e in enumerate(errs):
        assert e != "no error", f"rank {rank} did not raise when rank 1 passed another root"
        assert "reduce" in e and "rank" in e, f"rank {rank}: {e}"
