"""Coalesced collectives on CUDA tensors, 2 and 4 GPUs: `dist._coalescing_manager` blocks of
all_reduce (mixed sizes and dtypes), all_gather_into_tensor (mixed sizes and dtypes, bool
and float64 included) and reduce_scatter_tensor (mixed sizes and dtypes), blocking and
async, with and without `device=` (torch then calls the group's _start_coalescing and
_end_coalescing), and the deprecated dist.all_reduce_coalesced and dist.all_gather_coalesced.
Reductions are checked against a float64/int64 reference and NCCL's result on the same
input (every NCCL call is made on every rank, whatever rsccl did), data movement bit for bit
against the inputs every rank makes for every other rank. Also a rank that passes a wrong
output size inside a block: every rank raises, and the group works after."""

from __future__ import annotations

import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from gpu_harness import needs_gpus, rsccl_group
from gpu_refs import RED, Failures, check_vs_nccl, gather_inputs, rand, ref_call
from refs import assert_equal, check_reduction

pytestmark = needs_gpus

# (elements, dtype): odd sizes, 1 element, one of several MiB, mixed dtypes; the last is a
# strided view in the all_reduce test.
REDUCE_SPEC = [
    (7, torch.float32),
    (1000, torch.bfloat16),
    (100_003, torch.int32),
    (1, torch.float32),
    (33, torch.int64),
    (1_572_867, torch.float32),
    (65_537, torch.bfloat16),
]
# Data movement: every dtype, 0 elements too.
GATHER_SPEC = [
    (7, torch.float32),
    (0, torch.int64),
    (1000, torch.bfloat16),
    (13, torch.bool),
    (100_003, torch.uint8),
    (1, torch.float64),
    (524_289, torch.float16),
]
MODES = ["blocking", "async", "device"]


def _manager(g, ctx, mode: str):
    """The coalescing block of `mode`: blocking, async (cm.wait() after), or async with
    device= (torch routes it through _start_coalescing/_end_coalescing)."""
    if mode == "blocking":
        return dist._coalescing_manager(group=g)
    if mode == "async":
        return dist._coalescing_manager(group=g, async_ops=True)
    return dist._coalescing_manager(group=g, device=ctx.device, async_ops=True)


def body_all_reduce(ctx, seed: int, config: str, mode: str, op: str) -> None:
    g = rsccl_group(ctx, config)
    me, w, f = ctx.rank, ctx.world, Failures()
    what = f"coalesced all_reduce {op} {mode} world={w} group={config}"
    xs = [rand(seed, me, n, dt, op, salt=f"{what} #{k}") for k, (n, dt) in enumerate(REDUCE_SPEC)]
    refs = [gather_inputs(ctx, x) for x in xs]
    ours = [x.clone() for x in xs]
    home = torch.zeros(2 * xs[-1].numel(), dtype=xs[-1].dtype, device=ctx.device)
    home[::2] = xs[-1]
    ours[-1] = home[::2]  # non-contiguous
    cm = None
    try:
        with _manager(g, ctx, mode) as cm:
            for t in ours:
                dist.all_reduce(t, op=RED[op], group=g)
        if mode != "blocking":
            cm.wait()
    except Exception as e:  # noqa: BLE001 - recorded; the NCCL calls below must still happen
        f.items.append(f"{what}: {type(e).__name__}: {e}")
    theirs = [x.clone() for x in xs]
    for t in theirs:
        ref_call(dist.all_reduce, t, op=RED[op], group=ctx.nccl)
    for k, (o, t, ref) in enumerate(zip(ours, theirs, refs)):
        f.run(what, check_reduction, o, ref, op, f"{what} #{k} {o.dtype}[{o.numel()}]")
        f.run(what, check_vs_nccl, o, t, op, f"{what} #{k} {o.dtype}[{o.numel()}]", w)
    f.run(what, assert_equal, home[1::2], torch.zeros_like(home[1::2]), f"{what}: elements between the strided view's changed")
    torch.cuda.synchronize()
    f.done()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["SUM", "MAX"])
def test_coalesced_all_reduce(gpus, seed, mode, op):
    gpus.run(body_all_reduce, seed, "default", mode, op, timeout=120)


def test_coalesced_all_reduce_small_buffer(gpus, seed):
    gpus.run(body_all_reduce, seed, "small-buffer", "async", "SUM", timeout=120)


def body_all_gather(ctx, seed: int, mode: str) -> None:
    g = dist.group.WORLD
    me, w, f = ctx.rank, ctx.world, Failures()
    what = f"coalesced all_gather_into_tensor {mode} world={w}"
    ins = [rand(seed, me, n, dt, salt=f"{what} #{k}") for k, (n, dt) in enumerate(GATHER_SPEC)]
    outs = [torch.zeros(w * n, dtype=dt, device=ctx.device) for n, dt in GATHER_SPEC]
    n_last, dt_last = GATHER_SPEC[-1]
    outs[-1] = torch.zeros(n_last, w, dtype=dt_last, device=ctx.device).t()  # (w, n), non-contiguous, rank-major
    cm = None
    try:
        with _manager(g, ctx, mode) as cm:
            for o, i in zip(outs, ins):
                dist.all_gather_into_tensor(o, i, group=g)
        if mode != "blocking":
            cm.wait()
    except Exception as e:  # noqa: BLE001 - recorded
        f.items.append(f"{what}: {type(e).__name__}: {e}")
    for k, (n, dt) in enumerate(GATHER_SPEC):
        # Output k is rank-major: rank r's input k at [r * n, (r + 1) * n).
        want = torch.cat([rand(seed, r, n, dt, salt=f"{what} #{k}") for r in range(w)])
        f.run(what, assert_equal, outs[k].reshape(-1), want, f"{what} #{k} {dt}[{n}]")
    torch.cuda.synchronize()
    f.done()


@pytest.mark.parametrize("mode", MODES)
def test_coalesced_all_gather_into_tensor(gpus, seed, mode):
    gpus.run(body_all_gather, seed, mode, timeout=120)


def body_reduce_scatter(ctx, seed: int, mode: str, op: str) -> None:
    g = dist.group.WORLD
    me, w, f = ctx.rank, ctx.world, Failures()
    what = f"coalesced reduce_scatter_tensor {op} {mode} world={w}"
    spec = REDUCE_SPEC[:-1]  # elements of each rank's output
    xs = [rand(seed, me, w * m, dt, op, salt=f"{what} #{k}") for k, (m, dt) in enumerate(spec)]
    refs = [gather_inputs(ctx, x) for x in xs]
    outs = [torch.zeros(m, dtype=dt, device=ctx.device) for m, dt in spec]
    cm = None
    try:
        with _manager(g, ctx, mode) as cm:
            for o, x in zip(outs, xs):
                dist.reduce_scatter_tensor(o, x, op=RED[op], group=g)
        if mode != "blocking":
            cm.wait()
    except Exception as e:  # noqa: BLE001 - recorded; the NCCL calls below must still happen
        f.items.append(f"{what}: {type(e).__name__}: {e}")
    theirs = [torch.zeros_like(o) for o in outs]
    for t, x in zip(theirs, xs):
        ref_call(dist.reduce_scatter_tensor, t, x, op=RED[op], group=ctx.nccl)
    for k, ((m, dt), o, t, ref) in enumerate(zip(spec, outs, theirs, refs)):
        where = f"{what} #{k} {dt}[{m}]"
        f.run(where, check_reduction, o, ref[:, me * m : (me + 1) * m], op, where)
        f.run(where, check_vs_nccl, o, t, op, where, w)
    torch.cuda.synchronize()
    f.done()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["SUM", "MIN"])
def test_coalesced_reduce_scatter_tensor(gpus, seed, mode, op):
    gpus.run(body_reduce_scatter, seed, mode, op, timeout=120)


def body_deprecated_apis(ctx, seed: int) -> None:
    """dist.all_reduce_coalesced (one dtype, mixed sizes; blocking and async) and
    dist.all_gather_coalesced (lists of lists), both deprecated in torch 2.11 but present;
    torch requires one dtype per call for both."""
    me, w, f = ctx.rank, ctx.world, Failures()
    sizes = [5, 100_003, 1, 4096]
    for async_op in (False, True):
        what = f"all_reduce_coalesced async_op={async_op}"
        xs = [rand(seed, me, n, torch.float32, salt=f"{what} {n}") for n in sizes]
        refs = [gather_inputs(ctx, x) for x in xs]
        ours = [x.clone() for x in xs]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fut = f.run(what, dist.all_reduce_coalesced, ours, async_op=async_op)
        if async_op and fut is not None:
            f.run(what, fut.wait)
        for o, ref in zip(ours, refs):
            f.run(what, check_reduction, o, ref, "SUM", f"{what} [{o.numel()}]")

    what = "all_gather_coalesced"
    spec = [(3, torch.bfloat16), (70_001, torch.bfloat16), (1, torch.bfloat16)]  # torch wants one dtype per list
    ins = [rand(seed, me, n, dt, salt=f"{what} {k}") for k, (n, dt) in enumerate(spec)]
    outs = [[torch.zeros(n, dtype=dt, device=ctx.device) for n, dt in spec] for _ in range(w)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f.run(what, dist.all_gather_coalesced, outs, ins)
    for r in range(w):
        for k, (n, dt) in enumerate(spec):
            f.run(what, assert_equal, outs[r][k], rand(seed, r, n, dt, salt=f"{what} {k}"), f"{what}: rank {r}'s #{k}")
    torch.cuda.synchronize()
    f.done()


def test_deprecated_coalesced_apis(gpus, seed):
    gpus.run(body_deprecated_apis, seed, timeout=120)


def body_bad_output(ctx, seed: int) -> tuple[str, str]:
    """Rank 1's second all_gather output is one element short, inside a coalescing block: every
    rank raises, and the group works after."""
    g = dist.new_group(backend="rsccl", timeout=timedelta(seconds=15))
    me, w = ctx.rank, ctx.world
    ins = [rand(seed, me, n, torch.float32, salt=f"bad output {n}") for n in (10, 20)]
    outs = [torch.zeros(w * 10, device=ctx.device), torch.zeros(w * 20 - (1 if me == 1 else 0), device=ctx.device)]

    def block() -> None:
        with dist._coalescing_manager(group=g, async_ops=True) as cm:
            for o, i in zip(outs, ins):
                dist.all_gather_into_tensor(o, i, group=g)
        cm.wait()

    # Every rank makes the same calls whatever raised: the bad rank raises at once, the
    # others when the GPU reports it (here, or at the next call, the barrier).
    errors = []
    for call in (block, lambda: dist.barrier(group=g)):
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the parent inspects it
            errors.append(e)
    result = (type(errors[0]).__name__, str(errors[0])) if errors else ("no error", "")
    x = rand(seed, me, 1001, torch.float32, salt="after")
    out = torch.zeros(w * 1001, device=ctx.device)
    dist.all_gather_into_tensor(out, x, group=g)
    assert_equal(out, torch.cat([rand(seed, r, 1001, torch.float32, salt="after") for r in range(w)]), "all_gather after the error")
    dist.destroy_process_group(g)
    return result


def test_bad_output_in_a_block_raises_on_every_rank(gpus, seed):
    for rank, (kind, msg) in enumerate(gpus.run(body_bad_output, seed, timeout=120)):
        assert kind in ("ValueError", "TypeError", "RuntimeError"), f"rank {rank} raised {kind}: {msg}"
        assert "rank 1" in msg, f"rank {rank}'s message does not name rank 1: {msg}"
