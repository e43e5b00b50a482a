"""all_gather and broadcast on the copy engines (issue 28): every size and dtype, the list
form, in place (FSDP2's input: this rank's block of the output), asynchronous, on the
internal stream, every root, in many rounds through a small staging, under CUDA graph
capture mixed with kernel collectives, and a killed rank; against NCCL's all_gather and
broadcast of the same random input (bitwise: the path moves bytes). The late, stopped-by-timeout and mismatched cases are in
test_gpu_faults.py (ce_* scenarios)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_harness import capture, check_killed_rank, die_or_repeat, needs_gpus, rsccl_group, warm_up_aside
from gpu_refs import DTYPES, gather_inputs, rand
from refs import assert_equal
from test_gpu_collectives import body_all_gather as body_gather_forms
from test_gpu_collectives import body_broadcast

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


def body_graph(ctx, seed: int) -> None:
    """A graph of all_reduce (a kernel) then two all_gathers on the copy engines (one of
    several rounds), a broadcast from the last rank on them, then all_reduce again,
    replayed 3 times on fresh data: the barrier kernels and the collective kernels keep
    their counters in step under replay."""
    g = rsccl_group(ctx, "copy-engines-small-buffer")
    w, me = ctx.world, ctx.rank
    a = torch.empty(4096, device=ctx.device)
    small = torch.empty(1000, dtype=torch.bfloat16, device=ctx.device)
    big = torch.empty(3_000_001, device=ctx.device)
    out_s = torch.empty(w * small.numel(), dtype=small.dtype, device=ctx.device)
    out_b = torch.empty(w * big.numel(), device=ctx.device)
    bc = torch.empty(2_000_003, dtype=torch.float16, device=ctx.device)

    def calls():
        dist.all_reduce(a, group=g)
        dist.all_gather_into_tensor(out_s, small, group=g)
        dist.all_gather_into_tensor(out_b, big, group=g)
        dist.broadcast(bc, src=w - 1, group=g)
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
        a_all, s_all, b_all = gather_inputs(ctx, a_in), gather_inputs(ctx, small), gather_inputs(ctx, big)
        bc_root = gather_inputs(ctx, bc)[w - 1]
        graph.replay()
        torch.cuda.synchronize()
        assert_equal(out_s, s_all.reshape(-1), f"{what}: small all_gather")
        assert_equal(out_b, b_all.reshape(-1), f"{what}: all_gather of several rounds")
        assert_equal(bc, bc_root, f"{what}: broadcast from rank {w - 1}")
        want = a_all.double().sum(0) * w  # reduced twice: the second sums w equal rows
        torch.testing.assert_close(a.double(), want, rtol=1e-4, atol=1e-3, msg=f"{what}: all_reduce around them")


def test_copy_engines_under_cuda_graphs(gpus, seed):
    gpus.run(body_graph, seed, timeout=300)


def body_stats(ctx) -> tuple[int, int, int, int]:
    """The setting as memory_stats reports it, and the staged collectives and bytes that 3
    all_gathers on the copy engines add (counted by their last barrier, on the GPU)."""
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
    return (
        rsccl.memory_stats()["cuda_copy_engine_min_bytes"],
        after["cuda_copy_engine_min_bytes"],
        after["cuda_staged_collectives"] - before["cuda_staged_collectives"],
        after["cuda_staged_bytes"] - before["cuda_staged_bytes"],
    )


def test_memory_stats_report_the_copy_engine_setting_and_calls(gpus):
    for default, forced, calls, nbytes in gpus.run(body_stats, timeout=120):
        assert default == 0 and forced == 1, (default, forced)  # off by default (config.rs)
        assert (calls, nbytes) == (3, 3 * gpus.world * 2000), (calls, nbytes)


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
    calls = {
        "all_gather": lambda: dist.all_gather_into_tensor(out, x, group=g),
        "broadcast": lambda: dist.broadcast(x, src=0, group=g),
    }
    return die_or_repeat(ctx, victim, timeout, calls[collective])


@pytest.mark.parametrize("collective", ["all_gather", "broadcast"])
def test_killed_rank_during_copy_engine_collective(seed, collective):
    """A rank killed while the others run the collective on the copy engines: every
    survivor raises within the timeout, naming it, and its GPU is free."""
    timeout = 10.0
    body = (body_die_or_keep_calling, seed, 1, collective, timeout)
    check_killed_rank((body_warm,), body, timeout, 20.0, f"copy-engine {collective}", name_victim=True)


def body_mixed(ctx, seed: int, rounds: int) -> int:
    """all_gather on the copy engines, then reduce_scatter and all_reduce kernels, then
    all_gather again, back to back on one stream, one rank late (a different one each
    round), every result checked: reduce_scatter's kernel pushes into the peers' staging
    before its first barrier, so a copy-engine call must leave no copy-out running after
    its last barrier (NOTE [Copy engines], X). Seen wrong without it."""
    g = rsccl_group(ctx, "copy-engines")
    w, me = ctx.world, ctx.rank
    n = 8 << 20  # bfloat16: 16 MiB per rank, several rounds through the default staging
    out1 = torch.empty(w * n, dtype=torch.bfloat16, device=ctx.device)
    out2 = torch.empty(w * (n // 2), dtype=torch.bfloat16, device=ctx.device)
    rs_out = torch.empty(n // w, dtype=torch.bfloat16, device=ctx.device)
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
        dist.reduce_scatter_tensor(rs_out, y, group=g)
        dist.all_reduce(z, group=g)
        dist.all_gather_into_tensor(out2, x[: n // 2], group=g)
        torch.cuda.synchronize()
        assert_equal(out1, xs.reshape(-1), f"{what}: all_gather")
        assert_equal(out2, xs[:, : n // 2].reshape(-1), f"{what}: the second all_gather")
        want = ys.double().sum(0)[me * (n // w) : (me + 1) * (n // w)]
        torch.testing.assert_close(rs_out.double(), want, rtol=2e-2, atol=5e-2, msg=f"{what}: reduce_scatter after it")
        torch.testing.assert_close(z.double(), zs.double().sum(0), rtol=1e-4, atol=1e-4, msg=f"{what}: all_reduce")
        checks += 4
    return checks


def test_copy_engine_call_then_kernels_back_to_back(gpus, seed):
    assert all(c > 0 for c in gpus.run(body_mixed, seed, 12, timeout=300))
