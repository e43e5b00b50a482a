"""rsccl subgroups on CUDA: groups of some ranks ([0, 1]; on 4 ranks also [1, 3] and
[0, 2, 3]) run all_reduce and all_gather among their members; the others skip them; the
world group works afterwards."""

from __future__ import annotations

import rsccl
import torch
import torch.distributed as dist
from gpu_harness import needs_gpus
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
        for b, x in zip(bufs, inputs):
            b.copy_(x)
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        for g, s, b in zip(groups, streams, bufs):
            with torch.cuda.stream(s):
                dist.all_reduce(b, group=g)
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
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
