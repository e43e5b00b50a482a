"""all_gather, reduce_scatter, broadcast and send/recv on the copy engines (issues 26, 28).
all_gather and broadcast: every size and dtype, the list form, in place (FSDP2's input:
this rank's block of the output), asynchronous, on the internal stream, every root, in many
rounds through a small staging, under CUDA graph capture mixed with kernel collectives, and
a killed rank; against NCCL's all_gather and broadcast of the same random input (bitwise:
the path moves bytes). reduce_scatter (its reduction in a local kernel per round): every
dtype and op, the list form, in place (the output is this rank's block of the input) and
asynchronous, in many rounds, under CUDA graph capture and a killed rank; against NCCL and
the float64 or exact reference (tests/refs.py). The late, stopped-by-timeout and mismatched cases are in test_gpu_faults.py (ce_*
scenarios). send/recv: every dtype from 1 element to many inbox halves, blocking and both
directions at once, messages matched in order, a batch_isend_irecv ring, kernel and
copy-engine messages back to back between a pair, a CUDA graph of both replayed, size
mismatches with either side on either path, and a killed rank; bit for bit against the
sender's input."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from cases import inputs, my_block
from gpu_harness import capture, case_call, check_killed_rank, die_or_repeat, needs_gpus, rsccl_group, warm_up_aside
from gpu_refs import DTYPES, MOVE_DTYPES, RED, Failures, gather_inputs, ops_for, rand
from refs import assert_equal, check_reduction
from test_gpu_collectives import body_all_gather as body_gather_forms
from test_gpu_collectives import body_broadcast
from test_gpu_collectives import body_reduce_scatter as body_reduce_scatter_forms
from test_gpu_p2p import _peer, body_ring, exchange_with, warmed_up_graph

pytestmark = needs_gpus

CE_CONFIGS = ["copy-engines", "copy-engines-small-buffer"]
# 1 element, odd byte counts, one staging half and more (the small buffer's halves are
# under 2 MiB: 6 MiB of float32 per rank is several rounds), 24 MiB per rank.
SIZES = [1, 7, 1023, 100_003, 1_572_867, 6_291_459]


def body_all_gather(ctx, seed: int, config: str, sizes: list[int]) -> int:
    """Into a tensor and a list (test_gpu_collectives' body, against NCCL), then in place
    and asynchronously."""
    body_gather_forms(ctx, seed, config, sizes)
    g = rsccl_group(ctx, config)
    w, me = ctx.world, ctx.rank
    checks = 0
    for dtype in DTYPES:
        for n in sizes:
            if n > 2_000_000 and dtype.itemsize > 4:
                continue  # the largest size once per element width is enough
            what = f"copy-engine all_gather {dtype} n={n} world={w} group={config}"
            x = rand(seed, me, n, dtype, salt=what)
            xs = gather_inputs(ctx, x)  # NCCL's all_gather: the reference
            # In place: the input is this rank's block of the output (FSDP2's all-gather).
            inplace = torch.full((w * n,), 0, dtype=dtype, device=x.device)
            inplace[me * n : (me + 1) * n].copy_(x)
            dist.all_gather_into_tensor(inplace, inplace[me * n : (me + 1) * n], group=g)
            assert_equal(inplace, xs.reshape(-1), f"{what}: in place")
            # Asynchronous, on the internal stream; the input changed right after wait().
            out = torch.empty(w * n, dtype=dtype, device=x.device)
            work = dist.all_gather_into_tensor(out, x, group=g, async_op=True)
            work.wait()
            x.zero_()
            assert_equal(out, xs.reshape(-1), f"{what}: async_op=True")
            checks += 2
    torch.cuda.synchronize()
    return checks


@pytest.mark.parametrize("config", CE_CONFIGS)
def test_all_gather_on_the_copy_engines(gpus, seed, config):
    checks = gpus.run(body_all_gather, seed, config, SIZES, timeout=400)
    assert all(c > 0 for c in checks), checks


@pytest.mark.parametrize("config", CE_CONFIGS)
def test_broadcast_on_the_copy_engines(gpus, seed, config):
    """Every root, size and dtype against NCCL's broadcast (test_gpu_collectives' body)."""
    gpus.run(body_broadcast, seed, config, SIZES, timeout=400)


# Elements of each rank's output: 1, odd counts (a last pack cut short; blocks of the input
# at any element alignment), and rounds: through the small buffer (staging of about 3.75
# MiB, slots of 1.25 MiB at 2 ranks, 180 KiB at 8), 393_219 float32 (1.5 MiB per rank) is 2
# rounds at 2 ranks and 1_572_867 (6 MiB) 5; through the default one, 6 MiB per rank is one
# round and 6_291_459 float32 (24 MiB) more than one (COPY_MIN_STEP).
RS_SIZES = [1, 7, 1023, 100_003, 393_219, 1_572_867]
RS_SIZES_EXTRA = [6_291_459]


def body_reduce_scatter(ctx, seed: int, config: str, sizes: list[int], extra: list[int]) -> int:
    """Every dtype and op into a tensor (against NCCL and the float64 or exact reference) and
    from a list (test_gpu_collectives' body); then in place (the output is this rank's block
    of the input: the reduction reads that block, no push does) and asynchronously (the
    input changed right after wait()), against the reference, `extra` sizes on float32 only."""
    body_reduce_scatter_forms(ctx, seed, config, sizes)
    w, me = ctx.world, ctx.rank
    checks = 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for n in sizes + (extra if dtype == torch.float32 else []):
                what = f"copy-engine reduce_scatter {op} {dtype} n={n}x{w} group={config}"
                c = case_call(ctx, config, what, dtype, n, op)
                xs = inputs(ctx, seed, c, n * w)
                blocks = [my_block(x, ctx, n) for x in xs]
                x = xs[me].clone()
                dist.reduce_scatter_tensor(my_block(x, ctx, n), x, op=RED[op], group=c.group)
                check_reduction(my_block(x, ctx, n), blocks, op, f"{what}: in place")
                others = torch.cat([x[: me * n], x[(me + 1) * n :]])
                assert_equal(others, torch.cat([xs[me][: me * n], xs[me][(me + 1) * n :]]), f"{what}: in place, the other blocks")
                out = torch.empty(n, dtype=dtype, device=ctx.device)
                y = xs[me].clone()
                work = dist.reduce_scatter_tensor(out, y, op=RED[op], group=c.group, async_op=True)
                work.wait()
                y.zero_()
                check_reduction(out, blocks, op, f"{what}: async_op=True")
                checks += 2
    torch.cuda.synchronize()
    return checks


@pytest.mark.parametrize("config", CE_CONFIGS)
def test_reduce_scatter_on_the_copy_engines(gpus, seed, config):
    checks = gpus.run(body_reduce_scatter, seed, config, RS_SIZES, RS_SIZES_EXTRA, timeout=600)
    assert all(c > 0 for c in checks), checks


def body_graph(ctx, seed: int) -> None:
    """A graph of all_reduce (a kernel) then two all_gathers on the copy engines (one of
    several rounds), a broadcast from the last rank on them, a reduce_scatter of several
    rounds on them (its reduce kernels captured too), then all_reduce again, replayed 3
    times on fresh data: the barrier kernels and the collective kernels keep their counters
    in step under replay."""
    g = rsccl_group(ctx, "copy-engines-small-buffer")
    w, me = ctx.world, ctx.rank
    a = torch.empty(4096, device=ctx.device)
    small = torch.empty(1000, dtype=torch.bfloat16, device=ctx.device)
    big = torch.empty(3_000_001, device=ctx.device)
    out_s = torch.empty(w * small.numel(), dtype=small.dtype, device=ctx.device)
    out_b = torch.empty(w * big.numel(), device=ctx.device)
    bc = torch.empty(2_000_003, dtype=torch.float16, device=ctx.device)
    rs_n = 1_000_003  # float32 elements of each rank's output: 4 MiB, several rounds
    rs_in = torch.empty(w * rs_n, device=ctx.device)
    rs_out = torch.empty(rs_n, device=ctx.device)

    def calls():
        dist.all_reduce(a, group=g)
        dist.all_gather_into_tensor(out_s, small, group=g)
        dist.all_gather_into_tensor(out_b, big, group=g)
        dist.broadcast(bc, src=w - 1, group=g)
        dist.reduce_scatter_tensor(rs_out, rs_in, group=g)
        dist.all_reduce(a, group=g)

    warm_up_aside(calls)
    graph = capture(calls)
    for k in range(3):
        what = f"graph replay {k} world={w}"
        a_in = rand(seed, me, a.numel(), torch.float32, salt=f"{what} a")
        a.copy_(a_in)
        small.copy_(rand(seed, me, small.numel(), torch.bfloat16, salt=f"{what} s"))
        big.copy_(rand(seed, me, big.numel(), torch.float32, salt=f"{what} b"))
        bc.copy_(rand(seed, me, bc.numel(), torch.float16, salt=f"{what} bc"))
        rs_in.copy_(rand(seed, me, rs_in.numel(), torch.float32, salt=f"{what} rs"))
        a_all, s_all, b_all = gather_inputs(ctx, a_in), gather_inputs(ctx, small), gather_inputs(ctx, big)
        rs_all = gather_inputs(ctx, rs_in)
        bc_root = gather_inputs(ctx, bc)[w - 1]
        graph.replay()
        torch.cuda.synchronize()
        assert_equal(out_s, s_all.reshape(-1), f"{what}: small all_gather")
        assert_equal(out_b, b_all.reshape(-1), f"{what}: all_gather of several rounds")
        assert_equal(bc, bc_root, f"{what}: broadcast from rank {w - 1}")
        rs_want = rs_all.double().sum(0)[me * rs_n : (me + 1) * rs_n]
        torch.testing.assert_close(rs_out.double(), rs_want, rtol=1e-4, atol=1e-3, msg=f"{what}: reduce_scatter of several rounds")
        want = a_all.double().sum(0) * w  # reduced twice: the second sums w equal rows
        torch.testing.assert_close(a.double(), want, rtol=1e-4, atol=1e-3, msg=f"{what}: all_reduce around them")


def test_copy_engines_under_cuda_graphs(gpus, seed):
    gpus.run(body_graph, seed, timeout=300)


def body_stats(ctx) -> tuple[int, int, int, int, int, int]:
    """The setting as memory_stats reports it, and the staged collectives and bytes that 3
    all_gathers, then 2 reduce_scatters, on the copy engines add (counted by their last
    barrier, on the GPU; a reduce_scatter's bytes are its input's)."""
    import rsccl

    g = rsccl_group(ctx, "copy-engines")
    x = torch.ones(1000, dtype=torch.float16, device=ctx.device)
    out = torch.empty(ctx.world * x.numel(), dtype=x.dtype, device=ctx.device)
    dist.all_gather_into_tensor(out, x, group=g)  # the group exists and is warm
    torch.cuda.synchronize()
    before = rsccl.memory_stats(g)
    for _ in range(3):
        dist.all_gather_into_tensor(out, x, group=g)
    torch.cuda.synchronize()
    after = rsccl.memory_stats(g)
    for _ in range(2):
        dist.reduce_scatter_tensor(x, out, group=g)  # out: world x 1000 float16, the input
    torch.cuda.synchronize()
    after_rs = rsccl.memory_stats(g)
    return (
        rsccl.memory_stats()["cuda_copy_engine_min_bytes"],
        after["cuda_copy_engine_min_bytes"],
        after["cuda_staged_collectives"] - before["cuda_staged_collectives"],
        after["cuda_staged_bytes"] - before["cuda_staged_bytes"],
        after_rs["cuda_staged_collectives"] - after["cuda_staged_collectives"],
        after_rs["cuda_staged_bytes"] - after["cuda_staged_bytes"],
    )


def test_memory_stats_report_the_copy_engine_setting_and_calls(gpus):
    for default, forced, calls, nbytes, rs_calls, rs_bytes in gpus.run(body_stats, timeout=120):
        assert default == 0 and forced == 1, (default, forced)  # off by default (config.rs)
        assert (calls, nbytes) == (3, 3 * gpus.world * 2000), (calls, nbytes)
        assert (rs_calls, rs_bytes) == (2, 2 * gpus.world * 2000), (rs_calls, rs_bytes)


def body_warm(ctx) -> None:
    x = torch.ones(1 << 20, device=ctx.device)
    out = torch.empty(ctx.world * x.numel(), device=ctx.device)
    dist.all_gather_into_tensor(out, x, group=rsccl_group(ctx, "copy-engines"))
    torch.cuda.synchronize()
    assert out.sum().item() == ctx.world * x.numel()


def body_die_or_keep_calling(ctx, seed: int, victim: int, collective: str, timeout: float):
    x = rand(seed, ctx.rank, 1 << 20, torch.float32)
    out = torch.empty(ctx.world * x.numel(), device=ctx.device)
    g = rsccl_group(ctx, "copy-engines")
    rs_out = torch.empty(x.numel() // ctx.world, device=ctx.device)
    calls = {
        "all_gather": lambda: dist.all_gather_into_tensor(out, x, group=g),
        "broadcast": lambda: dist.broadcast(x, src=0, group=g),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(rs_out, x[: rs_out.numel() * ctx.world], group=g),
    }
    return die_or_repeat(ctx, victim, timeout, calls[collective])


@pytest.mark.parametrize("collective", ["all_gather", "broadcast", "reduce_scatter"])
def test_killed_rank_during_copy_engine_collective(seed, collective):
    """A rank killed while the others run the collective on the copy engines: every
    survivor raises within the timeout, naming it, and its GPU is free."""
    timeout = 10.0
    body = (body_die_or_keep_calling, seed, 1, collective, timeout)
    check_killed_rank((body_warm,), body, timeout, 20.0, f"copy-engine {collective}", name_victim=True)


def body_mixed(ctx, seed: int, rounds: int) -> int:
    """all_gather on the copy engines, then reduce_scatter and all_reduce kernels, then
    all_gather again, then reduce_scatter on the copy engines and a reduce_scatter kernel,
    back to back on one stream, one rank late (a different one each round), every result
    checked: reduce_scatter's kernel pushes into the peers' staging before its first
    barrier, so a copy-engine call must leave no copy-out (nor reduce kernel) running after
    its last barrier (NOTE [Copy engines], X). Seen wrong without it. The group moves 16 MiB
    and more on the copy engines, so that the 4 MiB reduce_scatters run the kernel. Then
    all_reduces, all_gathers and reduce_scatters of decreasing small sizes, on the
    low-latency kernels: the copy engines' one-block barriers move block 0's counters alone,
    so each block must read only words of its own epoch (a region of its own in every slot:
    NOTE [Low latency] in csrc_kernels/low_latency.cuh)."""
    g = rsccl_group(ctx, "copy-engines-from-16MiB")
    w, me = ctx.world, ctx.rank
    n = 8 << 20  # bfloat16: 16 MiB per rank, several rounds through the default staging
    out1 = torch.empty(w * n, dtype=torch.bfloat16, device=ctx.device)
    out2 = torch.empty(w * (n // 2), dtype=torch.bfloat16, device=ctx.device)
    rs_n = n // 4  # the kernel's input: 4 MiB of bfloat16
    rs_out = torch.empty(rs_n // w, dtype=torch.bfloat16, device=ctx.device)
    rs_ce_out = torch.empty(n // w, dtype=torch.bfloat16, device=ctx.device)
    rs_after = torch.empty(rs_n // w, dtype=torch.bfloat16, device=ctx.device)
    checks = 0
    for k in range(rounds):
        what = f"mixed round {k} world={w}"
        x = rand(seed, me, n, torch.bfloat16, salt=f"{what} ag")
        y = rand(seed, me, n, torch.bfloat16, salt=f"{what} rs")
        z = rand(seed, me, 1 << 16, torch.float32, salt=f"{what} ar")
        xs, ys, zs = gather_inputs(ctx, x), gather_inputs(ctx, y), gather_inputs(ctx, z)
        torch.cuda.synchronize()
        if me == k % w:
            torch.cuda._sleep(2_000_000)
        dist.all_gather_into_tensor(out1, x, group=g)
        dist.reduce_scatter_tensor(rs_out, y[:rs_n], group=g)
        dist.all_reduce(z, group=g)
        dist.all_gather_into_tensor(out2, x[: n // 2], group=g)
        dist.reduce_scatter_tensor(rs_ce_out, y, group=g)
        dist.reduce_scatter_tensor(rs_after, y[:rs_n], group=g)
        torch.cuda.synchronize()
        assert_equal(out1, xs.reshape(-1), f"{what}: all_gather")
        assert_equal(out2, xs[:, : n // 2].reshape(-1), f"{what}: the second all_gather")
        want = ys[:, :rs_n].double().sum(0)[me * (rs_n // w) : (me + 1) * (rs_n // w)]
        torch.testing.assert_close(rs_out.double(), want, rtol=2e-2, atol=5e-2, msg=f"{what}: reduce_scatter after it")
        torch.testing.assert_close(z.double(), zs.double().sum(0), rtol=1e-4, atol=1e-4, msg=f"{what}: all_reduce")
        want_ce = ys.double().sum(0)[me * (n // w) : (me + 1) * (n // w)]
        torch.testing.assert_close(rs_ce_out.double(), want_ce, rtol=2e-2, atol=5e-2, msg=f"{what}: reduce_scatter on the copy engines")
        torch.testing.assert_close(rs_after.double(), want, rtol=2e-2, atol=5e-2, msg=f"{what}: reduce_scatter kernel after it")
        checks += 6
        for m in (4096, 1024, 257):  # float32: 16 KiB, 4 KiB, 1028 bytes per rank
            v = rand(seed, me, m, torch.float32, salt=f"{what} small {m}")
            u = rand(seed, me, w * m, torch.float32, salt=f"{what} small rs {m}")
            vs, us = gather_inputs(ctx, v), gather_inputs(ctx, u)
            gathered, shard = torch.empty(w * m, dtype=v.dtype, device=v.device), torch.empty_like(v)
            dist.all_gather_into_tensor(gathered, v, group=g)
            dist.reduce_scatter_tensor(shard, u, group=g)
            dist.all_reduce(v, group=g)
            assert_equal(gathered, vs.reshape(-1), f"{what}: all_gather of {m}")
            want_rs = us.double().sum(0)[me * m : (me + 1) * m]
            torch.testing.assert_close(shard.double(), want_rs, rtol=1e-4, atol=1e-4, msg=f"{what}: reduce_scatter of {m}")
            torch.testing.assert_close(v.double(), vs.double().sum(0), rtol=1e-4, atol=1e-4, msg=f"{what}: all_reduce of {m}")
            checks += 3
    return checks


def test_copy_engine_call_then_kernels_back_to_back(gpus, seed):
    assert all(c > 0 for c in gpus.run(body_mixed, seed, 12, timeout=300))


# -- send/recv on the copy engines (NOTE [Copy-engine send/recv] in csrc_kernels/send_recv.cu) --

P2P_CONFIGS = ["copy-engines", "copy-engines-small-inbox"]
# Elements: 1, odd, and (float32 and wider) several inbox halves of the small inbox, and
# more than one half of the default one at 4 ranks.
P2P_SIZES = [1, 7, 100_003, 1_572_867]


def _settle(works: list) -> None:
    for w in works:
        if w is not None:
            w.wait()
    torch.cuda.synchronize()


def body_p2p_every_dtype(ctx, seed: int, config: str, sizes: list[int]) -> int:
    """Blocking send then recv in each direction, every dtype and size, bit for bit against
    the sender's input (which the receiver makes from the seed); then the same messages
    with isend/irecv in both directions at once."""
    g = rsccl_group(ctx, config)
    peer = _peer(ctx)
    if peer is None:
        return -1
    me, f, checks = ctx.rank, Failures(), 0
    for dtype in MOVE_DTYPES:
        for n in sizes:
            what = f"copy-engine send/recv {dtype} n={n} pair {min(me, peer)}-{max(me, peer)} group={config}"
            for sender in sorted((me, peer)):
                salt = f"{what} from {sender}"
                if me == sender:
                    f.run(f"{what}: send", dist.send, rand(seed, me, n, dtype, salt=salt), dst=peer, group=g)
                    continue
                y = torch.zeros(n, dtype=dtype, device=ctx.device)
                failed = len(f.items)
                f.run(f"{what}: recv", dist.recv, y, src=peer, group=g)
                if len(f.items) == failed:
                    f.run(what, assert_equal, y, rand(seed, peer, n, dtype, salt=salt), f"{what} from rank {peer}")
                    checks += 1
            salt = f"{what} both ways"
            x = rand(seed, me, n, dtype, salt=salt)
            y = torch.zeros(n, dtype=dtype, device=ctx.device)
            works = [f.run(salt, dist.isend, x, dst=peer, group=g), f.run(salt, dist.irecv, y, src=peer, group=g)]
            f.run(salt, _settle, works)
            f.run(salt, assert_equal, y, rand(seed, peer, n, dtype, salt=salt), f"{salt} from rank {peer}")
            checks += 1
    torch.cuda.synchronize()
    f.done()
    return checks


@pytest.mark.parametrize("config", P2P_CONFIGS)
def test_send_recv_on_the_copy_engines(gpus, seed, config):
    checks = gpus.run(body_p2p_every_dtype, seed, config, P2P_SIZES, timeout=400)
    # Per dtype and size: the message from the peer, and the one of both directions at once.
    assert all(c in (-1, 2 * len(MOVE_DTYPES) * len(P2P_SIZES)) for c in checks), checks


def body_p2p_in_order(ctx, seed: int, config: str) -> None:
    """Several messages of different sizes to one peer, received in the order sent, the
    receiver posting its recvs late: a copy-engine send waits for its receiver (a
    rendezvous) on its stream, not on the CPU."""
    g = rsccl_group(ctx, config)
    peer = _peer(ctx)
    if peer is None:
        return
    me, f = ctx.rank, Failures()
    what = f"several messages to one peer, in order, group={config}"
    sizes = [3, 1 << 20, 17, 3 << 20, 1]
    if me < peer:
        works = [
            f.run(what, dist.isend, rand(seed, me, k, torch.int32, salt=f"{what} {i}"), dst=peer, group=g) for i, k in enumerate(sizes)
        ]
    else:
        time.sleep(0.3)  # the sends are queued before any recv is posted
        ys = [torch.zeros(k, dtype=torch.int32, device=ctx.device) for k in sizes]
        works = [f.run(what, dist.irecv, y, src=peer, group=g) for y in ys]
    f.run(what, _settle, works)
    if me > peer:
        for i, (k, y) in enumerate(zip(sizes, ys)):
            f.run(what, assert_equal, y, rand(seed, peer, k, torch.int32, salt=f"{what} {i}"), f"{what}: message {i}")
    f.done()


@pytest.mark.parametrize("config", P2P_CONFIGS)
def test_send_recv_on_the_copy_engines_in_order(gpus, seed, config):
    gpus.run(body_p2p_in_order, seed, config, timeout=120)


@pytest.mark.parametrize("config", P2P_CONFIGS)
def test_send_recv_on_the_copy_engines_ring(gpus, seed, config):
    gpus.run(body_ring, seed, 24 << 20, config, torch.bfloat16, timeout=180)


def body_p2p_mixed(ctx, seed: int, rounds: int) -> int:
    """Between one pair, on a group that moves messages from 64 KiB on on the copy engines:
    kernel then copy-engine messages and the reverse, back to back on one stream, each way,
    the receiver late by turns; every message checked. A copy-engine send first waits until
    every earlier kernel message was read out (DRAIN), and leaves the inbox empty for the
    next kernel message (the rendezvous)."""
    g = rsccl_group(ctx, "copy-engines-from-64KiB")
    peer = _peer(ctx)
    if peer is None:
        return -1
    me, f, checks = ctx.rank, Failures(), 0
    # Elements of float32: on the kernels 4 bytes, 4 KiB and 60,000 bytes (one step over
    # several CUDA blocks' chunks with the small inbox; all eager), on the copy engines 64 KiB (the setting
    # itself) and 3 MiB (several halves), in orders that put each path after each other.
    orders = [[1024, 16384], [16384, 786_432], [786_432, 15_000], [15_000, 1024, 786_432, 1]]
    lo, hi = sorted((me, peer))
    for k in range(rounds):
        for o, sizes in enumerate(orders):
            what = f"mixed paths round {k} order {o} sizes {sizes} pair {lo}-{hi}"
            sender = (lo, hi)[(k + o) % 2]
            if me == sender:
                works = [
                    f.run(what, dist.isend, rand(seed, me, n, torch.float32, salt=f"{what} {i}"), dst=peer, group=g)
                    for i, n in enumerate(sizes)
                ]
            else:
                if k % 2:
                    torch.cuda._sleep(1_000_000)  # the sends run ahead of the recvs on the GPU
                ys = [torch.zeros(n, dtype=torch.float32, device=ctx.device) for n in sizes]
                works = [f.run(what, dist.irecv, y, src=peer, group=g) for y in ys]
            f.run(what, _settle, works)
            if me != sender:
                for i, (n, y) in enumerate(zip(sizes, ys)):
                    f.run(what, assert_equal, y, rand(seed, peer, n, torch.float32, salt=f"{what} {i}"), f"{what}: message {i}")
                    checks += 1
    f.done()
    return checks


def test_kernel_and_copy_engine_messages_back_to_back(gpus, seed):
    checks = gpus.run(body_p2p_mixed, seed, 4, timeout=300)
    assert all(c == -1 or c > 0 for c in checks), checks


def body_p2p_graph(ctx, seed: int) -> None:
    """isend + irecv both ways, of a copy-engine message of several steps and a kernel
    message, captured in one CUDA graph and replayed on fresh data: the signal kernels read
    the sequence from memory, so replays stay in step with each other and with the kernels."""
    g = rsccl_group(ctx, "copy-engines-from-64KiB")
    peer = _peer(ctx)
    if peer is None:
        return
    me, f = ctx.rank, Failures()
    big = torch.zeros(1_500_007, dtype=torch.float16, device=ctx.device)
    small = torch.zeros(1000, dtype=torch.float32, device=ctx.device)
    big_in, small_in = torch.zeros_like(big), torch.zeros_like(small)

    exchange = exchange_with(peer, [(big, big_in), (small, small_in)], group=g)
    graph = warmed_up_graph(f, exchange)
    if graph is not None:
        for rep in range(4):
            what = f"copy-engine send/recv graph replay {rep}"
            big.copy_(rand(seed, me, big.numel(), big.dtype, salt=f"{what} big"))
            small.copy_(rand(seed, me, small.numel(), small.dtype, salt=f"{what} small"))
            graph.replay()
            torch.cuda.synchronize()
            f.run(what, assert_equal, big_in, rand(seed, peer, big.numel(), big.dtype, salt=f"{what} big"), f"{what}: copy engines")
            f.run(what, assert_equal, small_in, rand(seed, peer, small.numel(), small.dtype, salt=f"{what} small"), f"{what}: kernel")
        # And eagerly after the replays, on the same counters.
        what = "copy-engine send/recv after the replays"
        big.copy_(rand(seed, me, big.numel(), big.dtype, salt=what))
        f.run(what, exchange)
        torch.cuda.synchronize()
        f.run(what, assert_equal, big_in, rand(seed, peer, big.numel(), big.dtype, salt=what), what)
    torch.cuda.synchronize()
    f.done()


def test_send_recv_on_the_copy_engines_under_cuda_graphs(gpus, seed):
    gpus.run(body_p2p_graph, seed, timeout=180)


MISMATCH_TIMEOUT_S = 5.0


def body_p2p_size_mismatch(ctx, seed: int, n_send: int, n_recv: int) -> tuple[str, str]:
    """On a group of ranks 0 and 1 of its own (left unusable), with copy engines from 64 KiB:
    rank 0 sends `n_send` float32, rank 1 posts a recv of `n_recv`. Both must raise."""
    import rsccl

    opts = rsccl.Options(cuda_copy_engine_min_bytes=65536, cuda_p2p_bytes="2MiB")
    g = dist.new_group(ranks=[0, 1], backend="rsccl", timeout=timedelta(seconds=MISMATCH_TIMEOUT_S), pg_options=opts)
    if ctx.rank > 1:
        return ("not in the group", "")
    try:
        if ctx.rank == 0:
            work = dist.isend(rand(seed, 0, n_send, torch.float32, salt="mismatch"), dst=1, group=g)
        else:
            work = dist.irecv(torch.zeros(n_recv, device=ctx.device), src=0, group=g)
        work.wait()
        torch.cuda.synchronize()
        work.wait()  # now also raises an error the kernels reported after the first wait
        dist.barrier(group=g)
        outcome = ("no error", "")
    except Exception as e:  # noqa: BLE001 - the parent inspects it
        outcome = (type(e).__name__, str(e))
    torch.cuda.synchronize()  # the GPU is not left waiting
    dist.destroy_process_group(g)
    return outcome


@pytest.mark.parametrize(
    "n_send,n_recv",
    [(1_000_000, 999_999), (1_000_000, 1000), (1000, 1_000_000)],
    ids=["both-on-copy-engines", "send-on-copy-engines", "recv-on-copy-engines"],
)
def test_send_recv_size_mismatch_on_the_copy_engines_raises(gpus, seed, n_send, n_recv):
    """Sizes that differ raise on both ranks, whichever path each side took (the receiver's
    size check, NOTE [Copy-engine send/recv]), within the timeout; nothing hangs."""
    results = gpus.run(body_p2p_size_mismatch, seed, n_send, n_recv, timeout=MISMATCH_TIMEOUT_S * 6 + 40)
    for rank, (kind, msg) in enumerate(results[:2]):
        assert kind not in ("no error", "not in the group"), f"rank {rank}: a send of {n_send} matched a recv of {n_recv} without an error"
        assert kind in ("ValueError", "RuntimeError", "TimeoutError", "PeerFailureError", "GroupAbortedError"), (
            f"rank {rank} raised {kind}: {msg}"
        )


def body_p2p_warm(ctx) -> None:
    body_ring(ctx, 0, 1 << 20, "copy-engines", torch.bfloat16)


def body_die_or_keep_ringing(ctx, seed: int, victim: int, timeout: float):
    """A ring of copy-engine sends (8 MiB each) while rank `victim` dies: each survivor
    waits on a neighbour, directly or through the others."""
    g = rsccl_group(ctx, "copy-engines")
    w, me = ctx.world, ctx.rank
    x = rand(seed, me, 2 << 20, torch.float32)
    y = torch.empty_like(x)

    def step():
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (me + 1) % w, g), dist.P2POp(dist.irecv, y, (me - 1) % w, g)])
        for r in reqs:
            r.wait()

    return die_or_repeat(ctx, victim, timeout, step)


def test_killed_rank_during_copy_engine_send_recv(seed):
    """A rank killed during a ring of copy-engine send/recv: every survivor raises within
    the timeout, naming it, and its GPU is free (the signal kernels' waits are bounded)."""
    timeout = 10.0
    check_killed_rank(
        (body_p2p_warm,), (body_die_or_keep_ringing, seed, 1, timeout), timeout, 20.0, "copy-engine send/recv", name_victim=True
    )
