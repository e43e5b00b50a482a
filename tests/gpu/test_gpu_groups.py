"""rsccl subgroups on CUDA: groups of some ranks ([0, 1]; on 4 ranks also [1, 3] and
[0, 2, 3]) run all_reduce and all_gather among their members; the others skip them; the
world group works afterwards."""

from __future__ import annotations

import pytest
import rsccl
import torch
import torch.distributed as dist
from cases import cuda_roundings
from gpu_harness import needs_gpus, shares_gpus
from gpu_refs import gather_inputs, rand
from refs import assert_equal, check_reduction

pytestmark = needs_gpus


def body_subgroups(ctx, seed: int) -> list[list[int]]:
    specs = [[0, 1]] + ([[1, 3], [0, 2, 3]] if ctx.world >= 4 else [])
    groups = [dist.new_group(ranks, backend="rsccl") for ranks in specs]  # every rank creates every group
    for ranks, g in zip(specs, groups):
        member = ctx.rank in ranks
        if member:
            assert dist.get_group_rank(g, ctx.rank) == ranks.index(ctx.rank)
            assert rsccl.memory_stats(g)["cuda_device"] == torch.cuda.current_device()
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for n in (7, 100_003, 1_572_867):
                what = f"subgroup {ranks} {dtype} n={n}"
                x = rand(seed, ctx.rank, n, dtype, salt=what)
                xs = gather_inputs(ctx, x)[ranks]  # every rank takes part in this NCCL call
                if not member:
                    continue
                ours = x.clone()
                dist.all_reduce(ours, group=g)
                check_reduction(ours, xs, "SUM", f"all_reduce on {what}")
                out = torch.empty(len(ranks) * n, dtype=dtype, device=x.device)
                dist.all_gather_into_tensor(out, x, group=g)
                assert_equal(out, xs.reshape(-1), f"all_gather_into_tensor on {what}")
                outs = [torch.empty_like(x) for _ in ranks]
                dist.all_gather(outs, x, group=g)
                for i, r in enumerate(ranks):
                    assert_equal(outs[i], xs[i], f"all_gather (list) on {what}, block of rank {r}")
    # The world group still works after the subgroups ran.
    what = "world all_reduce after subgroups"
    x = rand(seed, ctx.rank, 5003, torch.float32, salt=what)
    xs = gather_inputs(ctx, x)
    dist.all_reduce(x)
    check_reduction(x, xs, "SUM", what)
    for ranks, g in zip(specs, groups):
        if ctx.rank in ranks:
            dist.destroy_process_group(g)
    torch.cuda.synchronize()
    return specs


def test_subgroups(gpus, seed):
    specs = gpus.run(body_subgroups, seed, timeout=120)
    assert len(specs[0]) == (3 if gpus.world >= 4 else 1)


def all_reduce_on_streams(groups, streams, bufs, inputs) -> None:
    """One round: each input copied into its buffer, then each buffer all_reduced in its group
    on its own stream, all queued at once after the current stream's work, which then waits
    for all of them."""
    for b, x in zip(bufs, inputs):
        b.copy_(x)
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for g, s, b in zip(groups, streams, bufs):
        with torch.cuda.stream(s):
            dist.all_reduce(b, group=g)
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)


def body_concurrent_groups(ctx, seed: int, iterations: int) -> int:
    """Three groups of every rank (the world and two more, as a mesh's dimensions would be
    on a small host), each all_reduce on its own stream, all three queued at once, for
    `iterations` rounds, every 100th checked against a float64 reference: their kernels
    (up to cuda_blocks CTAs each) run at the same time on every GPU and must never wait on
    each other's peers (issue 25, place 4: spin-waiting CTAs that cannot all be resident
    would hold each other until the timeout)."""
    groups = [dist.group.WORLD] + [dist.new_group(list(range(ctx.world)), backend="rsccl") for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in groups]
    n = 4 << 20  # float32, 16 MiB: long enough to overlap
    bufs = [torch.empty(n, device=ctx.device) for _ in groups]
    inputs = [rand(seed, ctx.rank, n, torch.float32, salt=f"concurrent group {i}") for i in range(len(groups))]
    refs = [gather_inputs(ctx, x).double().sum(0).float() for x in inputs]
    torch.cuda.synchronize()
    checked = 0
    for it in range(iterations):
        all_reduce_on_streams(groups, streams, bufs, inputs)
        if it % 100 == 99:
            torch.cuda.synchronize()
            for i, (b, want) in enumerate(zip(bufs, refs)):
                torch.testing.assert_close(b, want, rtol=1e-4, atol=1e-4, msg=f"iteration {it}, group {i}")
            checked += 1
    torch.cuda.synchronize()
    for g in groups[1:]:
        dist.destroy_process_group(g)
    return checked


def test_three_groups_at_once_on_every_gpu(gpus, seed):
    assert all(c == 10 for c in gpus.run(body_concurrent_groups, seed, 1000, timeout=400))


def body_sm_budget(ctx, seed: int, iterations: int, blocks: int | None) -> dict:
    """Issue 25, place 4 (NOTE [SM budget] in rust/core/src/cuda/budget.rs): three new groups
    of every rank (a mesh's dimensions on a small host), each a 64 MiB float32 all_reduce on
    its own stream, all three queued at once, `iterations` rounds; every 10th round and the
    last checked against the float64 sum of every rank's input. Their kernels overlap, and
    where three collectives hold more SMs than the budget (3 x 64 of 132 by default) the
    device's ledger makes a launch wait for another group's kernel to end: memory_stats
    counts those launches (`cuda_sm_budget_waits`). With `blocks` = 32 (96 SMs) all three
    fit, and on a GPU of its own nothing waits."""
    opts = None if blocks is None else rsccl.Options(cuda_blocks=blocks)
    groups = [dist.new_group(list(range(ctx.world)), backend="rsccl", pg_options=opts) for _ in range(3)]
    streams = [torch.cuda.Stream() for _ in groups]
    n = 16 << 20  # float32: 64 MiB per all_reduce
    inputs = [rand(seed, ctx.rank, n, torch.float32, salt=f"SM budget group {i}") for i in range(len(groups))]
    everyone = [gather_inputs(ctx, x) for x in inputs]  # (world, n): every rank's input
    bufs = [torch.empty_like(x) for x in inputs]
    torch.cuda.synchronize()
    checked = 0
    for it in range(iterations):
        all_reduce_on_streams(groups, streams, bufs, inputs)
        if it % 10 == 9 or it == iterations - 1:
            torch.cuda.synchronize()
            for i, (b, xs) in enumerate(zip(bufs, everyone)):
                hops = cuda_roundings(ctx, groups[i], b.device, b.numel() * b.element_size())
                check_reduction(b, xs, "SUM", f"SM budget: round {it}, group {i}, seed {seed}", hops)
            checked += 1
    torch.cuda.synchronize()
    stats = [rsccl.memory_stats(g) for g in groups]
    for g in groups:
        dist.destroy_process_group(g)
    keys = ("cuda_sms", "cuda_sm_budget", "cuda_collective_sms", "cuda_p2p_sms", "cuda_blocks")
    return {"checked": checked, "waits": [s["cuda_sm_budget_waits"] for s in stats], **{k: stats[0][k] for k in keys}}


@pytest.mark.parametrize("blocks", [None, 32], ids=["default-blocks", "32-blocks"])
def test_sm_budget_three_groups_of_64_mib(gpus, seed, blocks):
    iterations = 200
    for rank, r in enumerate(gpus.run(body_sm_budget, seed, iterations, blocks, timeout=400)):
        what = f"rank {rank}, seed {seed}: {r}"
        assert r["checked"] == iterations // 10, what
        assert r["cuda_sm_budget"] <= r["cuda_sms"] and r["cuda_collective_sms"] >= 1, what
        if blocks is not None:
            assert r["cuda_blocks"] <= blocks, what
        if 3 * r["cuda_collective_sms"] > r["cuda_sm_budget"]:
            # The third group's launch finds the other two queued: it must wait.
            assert sum(r["waits"]) > 0, what
        elif not shares_gpus(gpus.world):
            assert sum(r["waits"]) == 0, what
