"""Stream semantics: asynchronous collectives read their input only after the work queued
before them on the caller's stream, and `Work.wait()` / the future order the waiting
stream after them; collectives issued on a side stream; collectives captured in a CUDA
graph and replayed.

To make a missing dependency show up as wrong data rather than pass by luck, the input is
written behind a GPU sleep (`torch.cuda._sleep`), and the last rank issues its collective
late, so that nobody's collective can finish early."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist
from gpu_harness import capture, needs_gpus, warm_up_aside
from gpu_refs import check_vs_nccl, gather_inputs, rand, ref_call, refill
from refs import assert_equal, check_reduction
from rsccl import _profile

pytestmark = needs_gpus

SLEEP_CYCLES = 50_000_000  # ~25 ms of GPU time at H200 clocks
LATE_S = 0.2


def _late(ctx) -> None:
    if ctx.rank == ctx.world - 1:
        time.sleep(LATE_S)


def _input_behind_a_sleep(x: torch.Tensor) -> torch.Tensor:
    """A tensor that holds `x` only once the current stream has slept: a collective that
    does not wait for the current stream reads zeros."""
    t = torch.zeros_like(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t.copy_(x)
    return t


def body_async_current_stream(ctx, seed: int) -> None:
    n = (1 << 20) + 1
    fresh = rand(seed, ctx.rank, n, torch.float32, salt="async")
    xs = gather_inputs(ctx, fresh)
    x = _input_behind_a_sleep(fresh)
    _late(ctx)
    work = dist.all_reduce(x, async_op=True)
    # Unrelated work on the current stream while the collective runs.
    a = torch.randn(2048, 2048, device=ctx.device)
    b = a @ a
    assert work.wait()
    y = x.clone()  # ordered after the collective by wait() alone
    torch.cuda.synchronize()
    assert work.is_completed()
    check_reduction(y, xs, "SUM", "async all_reduce, checked right after wait()")
    torch.testing.assert_close(b, a @ a, msg=lambda m: f"work on the current stream during the collective: {m}")


def test_async_all_reduce_on_the_current_stream(gpus, seed):
    gpus.run(body_async_current_stream, seed, timeout=60)


def body_future(ctx, seed: int) -> None:
    n = 100_003
    fresh = rand(seed, ctx.rank, n, torch.float32, salt="future")
    xs = gather_inputs(ctx, fresh)
    x = _input_behind_a_sleep(fresh)
    _late(ctx)
    fut = dist.all_reduce(x, async_op=True).get_future()
    value = fut.wait()
    y = value[0].clone()
    torch.cuda.synchronize()
    check_reduction(y, xs, "SUM", "value of the all_reduce's future")

    # As DDP comm hooks do: post-process in a callback, wait on the chained future.
    x2 = _input_behind_a_sleep(fresh)
    _late(ctx)
    chained = dist.all_reduce(x2, async_op=True).get_future().then(lambda f: f.value()[0] / ctx.world)
    y2 = chained.wait().clone()
    torch.cuda.synchronize()
    check_reduction(y2, xs, "AVG", "all_reduce future chained with then()")


def test_future_and_then(gpus, seed):
    gpus.run(body_future, seed, timeout=60)


def body_side_stream(ctx, seed: int) -> None:
    w, n = ctx.world, 300_007
    fresh = rand(seed, ctx.rank, n, torch.bfloat16, salt="side stream")
    xs = gather_inputs(ctx, fresh)
    side = torch.cuda.Stream()

    # Asynchronous, FSDP2-style: issued on a side stream, waited on from the default one.
    x = _input_behind_a_sleep(fresh)  # produced on the default stream
    side.wait_stream(torch.cuda.current_stream())
    _late(ctx)
    with torch.cuda.stream(side):
        ar = dist.all_reduce(x, async_op=True)
        gathered = torch.empty(w * n, dtype=fresh.dtype, device=ctx.device)
        ag = dist.all_gather_into_tensor(gathered, fresh, async_op=True)
    ar.wait()
    ag.wait()
    y, z = x.clone(), gathered.clone()  # on the default stream
    torch.cuda.synchronize()
    check_reduction(y, xs, "SUM", "async all_reduce issued on a side stream, waited on from the default stream")
    assert_equal(z, xs.reshape(-1), "async all_gather_into_tensor issued on a side stream")

    # Blocking, on a side stream whose input arrives late: ordered on that stream.
    x = torch.zeros_like(fresh)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.copy_(fresh)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        y = x.clone()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    check_reduction(y, xs, "MAX", "blocking all_reduce on a side stream")


def test_collectives_on_a_side_stream(gpus, seed):
    gpus.run(body_side_stream, seed, timeout=60)


def body_profiled_blocking_all_reduce(ctx, seed: int) -> None:
    """A blocking CUDA all_reduce made while a profiler runs leaves the fast path (which
    records nothing) for the recorded one: one async "rsccl:all_reduce" event per call, and
    the results of both paths are right."""
    n = 4099
    fresh = rand(seed, ctx.rank, n, torch.bfloat16, salt="profiled")
    xs = gather_inputs(ctx, fresh)
    x = fresh.clone()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.all_reduce(x)
        # A CUDA call's record ends on rsccl's closer thread once the GPU finished it:
        # wait for that (the thread takes its queue in order) before the profiler stops.
        torch.cuda.synchronize()
        ended = threading.Event()
        _profile._closer.put(ended.set)
        assert ended.wait(30), "the profiler's closer thread did not end the record"
    y = fresh.clone()
    dist.all_reduce(y)  # the fast path, the profiler off
    torch.cuda.synchronize()
    check_reduction(x, xs, "SUM", "blocking all_reduce while profiling")
    check_reduction(y, xs, "SUM", "blocking all_reduce after profiling")
    names = [e.name for e in prof.events() if e.name.startswith("rsccl:")]
    assert names == ["rsccl:all_reduce"], names


def test_profiled_blocking_all_reduce(gpus, seed):
    gpus.run(body_profiled_blocking_all_reduce, seed, timeout=60)


def body_cuda_graph(ctx, seed: int, replays: int) -> None:
    """Collectives captured in one CUDA graph, replayed on fresh data each time and checked
    against NCCL run eagerly on the same data."""
    w, dev = ctx.world, ctx.device
    sizes = {"ar_small": 1003, "ar_big": (2 << 20) + 5, "ag": 40_001, "rs": 20_011, "bc": 5003}
    ar_small = torch.zeros(sizes["ar_small"], device=dev)  # one-shot sized
    ar_big = torch.zeros(sizes["ar_big"], dtype=torch.bfloat16, device=dev)  # 4 MiB: two-shot sized
    ag_in = torch.zeros(sizes["ag"], device=dev)
    ag_out = torch.empty(w * sizes["ag"], device=dev)
    rs_in = torch.zeros(w * sizes["rs"], dtype=torch.bfloat16, device=dev)
    rs_out = torch.empty(sizes["rs"], dtype=torch.bfloat16, device=dev)
    bc = torch.zeros(sizes["bc"], dtype=torch.int64, device=dev)
    inputs = {"ar_small": ar_small, "ar_big": ar_big, "ag": ag_in, "rs": rs_in, "bc": bc}

    def collectives() -> None:
        dist.all_reduce(ar_small)
        dist.all_reduce(ar_big)
        dist.all_gather_into_tensor(ag_out, ag_in)
        dist.reduce_scatter_tensor(rs_out, rs_in, op=dist.ReduceOp.SUM)
        dist.broadcast(bc, src=w - 1)

    refill(inputs, seed, ctx.rank, "graph", -1)
    warm_up_aside(collectives)
    graph = capture(collectives)

    for i in range(replays):
        fresh = refill(inputs, seed, ctx.rank, "graph", i)
        graph.replay()
        what = f"graph replay {i}"
        ref = fresh["ar_small"].clone()
        ref_call(dist.all_reduce, ref, group=ctx.nccl)
        check_vs_nccl(ar_small, ref, "SUM", f"{what}: all_reduce float32[{ref.numel()}]", w)
        ref = fresh["ar_big"].clone()
        ref_call(dist.all_reduce, ref, group=ctx.nccl)
        check_vs_nccl(ar_big, ref, "SUM", f"{what}: all_reduce bfloat16[{ref.numel()}]", w)
        ref = torch.empty_like(ag_out)
        ref_call(dist.all_gather_into_tensor, ref, fresh["ag"], group=ctx.nccl)
        assert_equal(ag_out, ref, f"{what}: all_gather_into_tensor")
        ref = torch.empty_like(rs_out)
        ref_call(dist.reduce_scatter_tensor, ref, fresh["rs"], group=ctx.nccl)
        check_vs_nccl(rs_out, ref, "SUM", f"{what}: reduce_scatter_tensor", w)
        ref = fresh["bc"].clone()
        ref_call(dist.broadcast, ref, src=w - 1, group=ctx.nccl)
        assert_equal(bc, ref, f"{what}: broadcast")
    torch.cuda.synchronize()


def test_cuda_graph_capture_and_replay(gpus, seed):
    gpus.run(body_cuda_graph, seed, 100, timeout=120)
