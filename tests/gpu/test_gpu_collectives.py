"""Every CUDA collective x dtype x op on 2 and 4 GPUs, against NCCL's result on the same
random input and a float64/int64 reference built from every rank's input. Sizes: 1
element, odd counts, byte sizes that are not multiples of 16, several MiB, and a few
messages up to 1 GiB. Group configs force the pipelined, one-shot and two-shot paths.
all_reduce results must be bitwise identical on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cases import CASES, Call, barrier_held, my_input
from gpu_harness import case_call, needs_gpus, shares_gpus
from gpu_refs import DTYPES, OPS, RED, check_vs_nccl, gather_inputs, nccl_result, ops_for, rand, ref_call
from refs import assert_equal, check_reduction

pytestmark = needs_gpus

# 1 element; odd counts (7 x 2 bytes = 14 bytes: not a multiple of 16); 1.5 Mi + 3
# elements = 3 to 12 MiB by dtype, several times the small-buffer config's staging.
SIZES = [1, 7, 1023, 100_003, 1_572_867]
ALL_REDUCE_CONFIGS = ["default", "small-buffer", "two-shot", "one-shot", "ring", "ring-small-buffer"]
OTHER_CONFIGS = ["default", "small-buffer"]  # the all_reduce algorithm choice does not apply


def body_all_reduce(ctx, seed: int, config: str, sizes: list[int]) -> int:
    checks = 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for n in sizes:
                what = f"all_reduce {op} {dtype} n={n} world={ctx.world} group={config}"
                c = case_call(ctx, config, what, dtype, n, op)
                ours = CASES["all_reduce"](ctx, seed, c)  # against the exact result, bitwise the same on every rank
                theirs = my_input(seed, ctx.rank, c)
                if nccl_result(dist.all_reduce, theirs, op=RED[op], group=ctx.nccl):
                    check_vs_nccl(ours, theirs, op, what, ctx.world)
                checks += 1
    torch.cuda.synchronize()
    return checks


@pytest.mark.parametrize("config", ALL_REDUCE_CONFIGS)
def test_all_reduce(gpus, seed, config):
    checks = gpus.run(body_all_reduce, seed, config, SIZES, timeout=200)
    assert checks[0] == sum(len(ops_for(d)) for d in DTYPES) * len(SIZES)


def body_reduce_scatter(ctx, seed: int, config: str, sizes: list[int]) -> None:
    w = ctx.world
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for n in sizes:  # elements of each rank's output
                what = f"reduce_scatter_tensor {op} {dtype} n={n}x{w} group={config}"
                c = case_call(ctx, config, what, dtype, n, op)
                ours = CASES["reduce_scatter_tensor"](ctx, seed, c)
                theirs = torch.empty_like(ours)
                if nccl_result(dist.reduce_scatter_tensor, theirs, my_input(seed, ctx.rank, c, n * w), op=RED[op], group=ctx.nccl):
                    check_vs_nccl(ours, theirs, op, what, w)
        # The list form, once per dtype, each dtype with another op.
        n, op = 100_003, OPS[DTYPES.index(dtype)]
        what = f"reduce_scatter (list) {op} {dtype} n={n}x{w} group={config}"
        CASES["reduce_scatter"](ctx, seed, case_call(ctx, config, what, dtype, n, op))
    torch.cuda.synchronize()


@pytest.mark.parametrize("config", [*OTHER_CONFIGS, "ring", "ring-small-buffer"])
def test_reduce_scatter(gpus, seed, config):
    # The largest per-rank output, x world, is a multi-MiB input.
    gpus.run(body_reduce_scatter, seed, config, [1, 7, 1023, 100_003, 393_219], timeout=200)


def body_all_gather(ctx, seed: int, config: str, sizes: list[int]) -> None:
    for dtype in DTYPES:
        for n in sizes:
            what = f"all_gather {dtype} n={n} group={config}"
            c = case_call(ctx, config, what, dtype, n)
            ours = CASES["all_gather_into_tensor"](ctx, seed, c)
            theirs = torch.empty_like(ours)
            ref_call(dist.all_gather_into_tensor, theirs, my_input(seed, ctx.rank, c), group=ctx.nccl)
            assert_equal(ours, theirs, f"{what}: all_gather_into_tensor vs NCCL")
            CASES["all_gather"](ctx, seed, c)
    torch.cuda.synchronize()


@pytest.mark.parametrize("config", OTHER_CONFIGS)
def test_all_gather(gpus, seed, config):
    gpus.run(body_all_gather, seed, config, SIZES, timeout=200)


def ll_bound(ctx) -> int:
    """The low-latency kernels' bound in the default group (cuda_low_latency_max_bytes per
    rank: the all_reduce message, the reduce_scatter output, the all_gather input): what
    their slots hold at this many ranks (ll_max_bytes in rust/core/src/cuda/kernels/mod.rs)."""
    import rsccl

    got = rsccl.memory_stats()["cuda_low_latency_max_bytes"]
    want = (64 << 10) if ctx.world <= 4 else (32 << 10) if ctx.world <= 8 else (16 << 10)
    assert got == want, f"the default group's low-latency bound at {ctx.world} ranks is {got}, not {want}"
    return got


# At the low-latency kernels' bound: 1 element, an odd count, and one element under, at and
# over the bound, per element size; with the kernels on (default) and off (the barrier
# kernels at the same sizes).
def body_small_bounds(ctx, seed: int, config: str) -> int:
    checks = 0
    bound = ll_bound(ctx)
    for dtype, op in ((torch.bfloat16, "SUM"), (torch.float32, "AVG"), (torch.int64, "MAX")):
        at = bound // dtype.itemsize
        for n in (1, 7, at - 1, at, at + 1):
            for kind in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"):
                what = f"{kind} {op} {dtype} n={n} (low-latency bound) group={config}"
                CASES[kind](ctx, seed, case_call(ctx, config, what, dtype, n, op))  # checked against the exact result
                checks += 1
    torch.cuda.synchronize()
    return checks


@pytest.mark.parametrize("config", ["default", "no-low-latency"])
def test_small_collectives_at_the_low_latency_bound(gpus, seed, config):
    assert gpus.run(body_small_bounds, seed, config, timeout=120)[0] == 3 * 5 * 3


def body_epoch_wrap(ctx, seed: int) -> int:
    """The low-latency kernels 2^32 epochs after a call, and across the wrap of the 32-bit
    barrier epochs, with every rank's epochs set by a test hook: calls at epochs from S0 on;
    twice, a barrier-kernel call 2^31 epochs later, then the same calls again at S0 + 2^32,
    which reads S0 as 32 bits, with one rank late to each call (a different one each round)
    so that the others poll their slots while its stores are in flight. Words of the first
    calls are still in the slots, with the same epochs: a reader that took one would return
    the first calls' data (NOTE [Low latency epochs] in csrc_kernels/protocol.cuh). A race,
    not a certainty: a call's header goes first, so only words read between a late rank's
    header and its data can be stale (on 2 H200s without the rewrite the body hung,
    2026-11-27). Then the calls through the wrap itself (epochs from 2^32 - 5). Every result
    is checked against float64 or the inputs."""
    g = dist.new_group(backend="rsccl")
    w, me, f32 = ctx.world, ctx.rank, torch.float32
    checks = 0
    bound = ll_bound(ctx)

    def set_epochs(epoch: int) -> None:
        torch.cuda.synchronize()
        g._comm._set_cuda_epochs_for_test(epoch % 2**32)
        ref_call(dist.barrier, group=ctx.nccl)  # no rank launches before every rank set its flags
        torch.cuda.synchronize()

    def large(tag: str) -> None:
        nonlocal checks
        y = rand(seed, me, 1 << 20, f32, salt=f"{tag} large")  # 4 MiB: the barrier kernels
        ys = gather_inputs(ctx, y)
        dist.all_reduce(y, group=g)
        check_reduction(y, ys, "SUM", f"{tag}: all_reduce of 4 MiB")
        checks += 1

    def calls(tag: str, late: int | None = None) -> None:
        nonlocal checks

        def wait() -> None:
            if me == late:
                torch.cuda._sleep(1_000_000)  # about 0.5 ms of the GPU: the others start first

        for n in (bound // 4, 1000, 7):  # float32 per rank: the bound, 4000 and 28 bytes
            x = rand(seed, me, n, f32, salt=f"{tag} ar {n}")
            xs = gather_inputs(ctx, x)
            wait()
            dist.all_reduce(x, group=g)
            check_reduction(x, xs, "SUM", f"{tag}: all_reduce of {n}")
            u = rand(seed, me, w * n, f32, salt=f"{tag} rs {n}")
            us = gather_inputs(ctx, u)
            shard = torch.empty(n, dtype=f32, device=ctx.device)
            wait()
            dist.reduce_scatter_tensor(shard, u, group=g)
            check_reduction(shard, [r[me * n : (me + 1) * n] for r in us], "SUM", f"{tag}: reduce_scatter of {n}")
            v = rand(seed, me, n, f32, salt=f"{tag} ag {n}")
            vs = gather_inputs(ctx, v)
            gathered = torch.empty(w * n, dtype=f32, device=ctx.device)
            wait()
            dist.all_gather_into_tensor(gathered, v, group=g)
            assert_equal(gathered, vs.reshape(-1), f"{tag}: all_gather of {n}")
            checks += 3

    s0 = 1000
    set_epochs(s0)
    calls("first")
    for r in range(2):  # each round passes 2^31 epochs later on its way, as real epochs do
        set_epochs(s0 + 2**31)
        large(f"2^31 epochs later, round {r}")
        set_epochs(s0)  # s0 + 2^32
        calls(f"2^32 epochs later, round {r}", late=r % w)
    set_epochs(2**32 - 5)
    for r in range(6):
        calls(f"across the wrap, round {r}", late=r % w)
        large(f"across the wrap, round {r}")
    torch.cuda.synchronize()
    dist.destroy_process_group(g)
    return checks


def test_collectives_across_the_epoch_wrap(gpus, seed):
    assert gpus.run(body_epoch_wrap, seed, timeout=180)[0] == 9 * 9 + 8


def body_broadcast(ctx, seed: int, config: str, sizes: list[int]) -> None:
    for dtype in DTYPES:
        for n in sizes:
            for root in range(ctx.world):
                what = f"broadcast {dtype} n={n} root={root} group={config}"
                c = case_call(ctx, config, what, dtype, n, root=root)
                ours = CASES["broadcast"](ctx, seed, c)  # x_root on every rank, the root's own unchanged
                theirs = my_input(seed, ctx.rank, c)
                ref_call(dist.broadcast, theirs, src=root, group=ctx.nccl)
                assert_equal(ours, theirs, f"{what} vs NCCL")
    torch.cuda.synchronize()


@pytest.mark.parametrize("config", OTHER_CONFIGS)
def test_broadcast(gpus, seed, config):
    gpus.run(body_broadcast, seed, config, SIZES, timeout=200)


def body_barrier(ctx) -> tuple[float, float]:
    return CASES["barrier"](ctx, 0, Call(torch.float32, 0))


def test_barrier_waits_for_the_last_rank(gpus):
    times = gpus.run(body_barrier, timeout=60)
    assert barrier_held(times), times


def body_large(ctx, seed: int, config: str, elements: list[int]) -> None:
    """bfloat16 messages of up to 1 GiB: all_reduce SUM, all_gather_into_tensor (that much
    output) and reduce_scatter_tensor (that much input)."""
    w, me, bf16 = ctx.world, ctx.rank, torch.bfloat16
    for n in elements:
        what = f"large all_reduce SUM bfloat16 n={n} group={config}"
        c = case_call(ctx, config, what, bf16, n)
        ours = CASES["all_reduce"](ctx, seed, c)
        x = my_input(seed, me, c)
        ref_call(dist.all_reduce, x, group=ctx.nccl)  # x is NCCL's result from here on
        check_vs_nccl(ours, x, "SUM", what, w)
        del ours, x

        what = f"large all_gather_into_tensor bfloat16 {n // w}x{w} group={config}"
        c = case_call(ctx, config, what, bf16, n // w)
        out = CASES["all_gather_into_tensor"](ctx, seed, c)
        ref = torch.empty_like(out)
        ref_call(dist.all_gather_into_tensor, ref, my_input(seed, me, c), group=ctx.nccl)
        assert_equal(out, ref, f"{what} vs NCCL")
        del out, ref

        m = n // w
        what = f"large reduce_scatter_tensor SUM bfloat16 {m}x{w} group={config}"
        c = case_call(ctx, config, what, bf16, m)
        ours = CASES["reduce_scatter_tensor"](ctx, seed, c)
        theirs = torch.empty_like(ours)
        ref_call(dist.reduce_scatter_tensor, theirs, my_input(seed, me, c, m * w), group=ctx.nccl)
        check_vs_nccl(ours, theirs, "SUM", what, w)
        del ours, theirs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # give the GiBs back to the tests that read device memory


# bfloat16 elements: 64 MiB + 6 bytes, and 1 GiB.
LARGE = {"default": [(32 << 20) + 3, 1 << 29], "small-buffer": [(32 << 20) + 3]}


@pytest.mark.parametrize("config", list(LARGE))
def test_large_messages(gpus, seed, config):
    sizes = LARGE[config]
    if shares_gpus(gpus.world):
        # Every rank's input, output and gathered reference (world x the message) on one GPU,
        # and gloo's CPU copies of them: 1 GiB messages would not fit with 8 ranks.
        sizes = [n for n in sizes if n < 1 << 29]
    gpus.run(body_large, seed, config, sizes, timeout=240)


def body_views(ctx, seed: int) -> None:
    """Inputs that are not plain contiguous tensors: a transposed view, and slices whose
    storage starts one element (2, 4 or 8 bytes) in; the elements around a slice must stay
    untouched."""
    w, me = ctx.world, ctx.rank
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        what = f"all_reduce of a transposed {dtype} view"
        base = rand(seed, me, 700 * 333, dtype, salt=what).view(700, 333)
        view = base.t()
        assert not view.is_contiguous()
        xs = gather_inputs(ctx, view)
        dist.all_reduce(view)
        check_reduction(view, xs, "SUM", what)

        what = f"all_reduce of a {dtype} slice at storage offset 1"
        n = 100_003
        padded = rand(seed, me, n + 2, dtype, salt=what)
        edges = padded[[0, -1]].clone()
        x = padded[1:-1]
        xs = gather_inputs(ctx, x)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        check_reduction(x, xs, "MAX", what)
        assert_equal(padded[[0, -1]], edges, f"{what}: elements outside the slice changed")

        what = f"all_gather_into_tensor and reduce_scatter_tensor on {dtype} slices at offset 1"
        out_padded = torch.zeros(w * n + 2, dtype=dtype, device=x.device)
        dist.all_gather_into_tensor(out_padded[1:-1], padded[1:-1])
        ref = torch.empty(w * n, dtype=dtype, device=x.device)
        ref_call(dist.all_gather_into_tensor, ref, padded[1:-1].contiguous(), group=ctx.nccl)
        assert_equal(out_padded[1:-1], ref, what)
        assert_equal(
            out_padded[[0, -1]], torch.zeros(2, dtype=dtype, device=x.device), f"{what}: elements outside the output slice changed"
        )
        rs_in = torch.cat([padded[:1], rand(seed, me, w * 1001, dtype, salt=what)])[1:]
        xs = gather_inputs(ctx, rs_in)
        rs_out = torch.zeros(1001 + 2, dtype=dtype, device=x.device)
        dist.reduce_scatter_tensor(rs_out[1:-1], rs_in)
        check_reduction(rs_out[1:-1], xs[:, me * 1001 : (me + 1) * 1001], "SUM", what)
        assert_equal(rs_out[[0, -1]], torch.zeros(2, dtype=dtype, device=x.device), f"{what}: elements outside the output slice changed")
    torch.cuda.synchronize()


def test_non_contiguous_and_unaligned(gpus, seed):
    gpus.run(body_views, seed, timeout=120)


def body_integer_avg(ctx, seed: int) -> list[str]:
    """AVG on integers is refused, as on CPU tensors (an integer mean would silently
    truncate): a TypeError naming the op on every rank, and the group keeps working."""
    errors = []
    for dtype in (torch.int32, torch.int64):
        x = rand(seed, ctx.rank, 1000, dtype, salt="int avg")
        try:
            dist.all_reduce(x, op=dist.ReduceOp.AVG)
            errors.append("no error")
        except TypeError as e:
            errors.append(str(e))
    y = rand(seed, ctx.rank, 1000, torch.float32, salt="after int avg")
    ys = gather_inputs(ctx, y)
    dist.all_reduce(y)
    check_reduction(y, ys, "SUM", "all_reduce after the refused AVG")
    return errors


def test_integer_avg_is_refused(gpus, seed):
    for rank, errs in enumerate(gpus.run(body_integer_avg, seed, timeout=60)):
        for e in errs:
            assert "AVG" in e, f"rank {rank}: {e}"
