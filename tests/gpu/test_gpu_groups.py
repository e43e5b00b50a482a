"""rsccl subgroups on CUDA: groups of some ranks ([0, 1]; on 4 ranks also [1, 3] and
[0, 2, 3]) run all_reduce and all_gather among their members; the others skip them; the
world group works afterwards."""

from __future__ import annotations

import rsccl
import torch
import torch.distributed as dist
from gpu_harness import needs_gpus
from gpu_refs import assert_equal, check_reduction, gather_inputs, rand

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
