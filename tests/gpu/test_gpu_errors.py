"""Errors on CUDA tensors: ranks that disagree raise on every rank, naming the rank, and the
group works afterwards; what rsccl does not run on CUDA (recv from any source) raises
rather than hangs; a killed rank makes the survivors raise within the group's timeout and
leaves their GPUs usable (no kernel left spinning on a dead peer)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from gpu_harness import (
    check_killed_rank,
    die_or_repeat,
    gpu_cluster,
    needs_gpus,
    needs_own_gpus,
)
from gpu_refs import gather_inputs, rand
from harness import ClusterError
from refs import check_reduction

pytestmark = needs_gpus


def _own_group():
    """A group of its own for a test that provokes errors, so that a failure that aborts it
    leaves the shared world group alone."""
    return dist.new_group(backend="rsccl", timeout=timedelta(seconds=15))


def _still_works(ctx, g, seed: int) -> None:
    """A small all_reduce (the small grid) and a 4 MiB one (every block of the group's grid:
    blocks beyond the small grid must still be in step after a mismatch, NOTE [Grids])."""
    for n in (10_007, 1 << 20):
        x = rand(seed, ctx.rank, n, torch.float32, salt=f"after the error {n}")
        xs = gather_inputs(ctx, x)
        dist.all_reduce(x, group=g)
        check_reduction(x, xs, "SUM", f"all_reduce of {n} elements on the group after the error")


def body_mismatch(ctx, seed: int, case: str) -> tuple[str, str]:
    g = _own_group()
    n, w = 1000, ctx.world
    x = None
    call = lambda: dist.all_reduce(x, group=g)  # noqa: E731
    if case in ("ll_kinds", "ll_gather_count", "ll_gather_across_grids"):
        # The low-latency kernels (NOTE [Low latency] in csrc_kernels/low_latency.cuh): rank 1 a
        # reduce_scatter against the others' all_reduce, both low-latency; an all_gather
        # of another size, both low-latency; a 128 KiB all_gather input (above every
        # group's low-latency bound: the barrier kernel on the group's grid) against 4 KB
        # ones (the low-latency kernel on 16 blocks).
        x = rand(seed, ctx.rank, n, torch.float32)
        if case == "ll_kinds" and ctx.rank == 1:
            xin = rand(seed, ctx.rank, w * n // 4, torch.float32)
            call = lambda: dist.reduce_scatter_tensor(torch.empty(n // 4, device=xin.device), xin, group=g)  # noqa: E731
        elif case != "ll_kinds":
            m = {"ll_gather_count": n + 4, "ll_gather_across_grids": 32 << 10}[case] if ctx.rank == 1 else n
            xg = rand(seed, ctx.rank, m, torch.float32)
            call = lambda: dist.all_gather_into_tensor(torch.empty(w * m, device=xg.device), xg, group=g)  # noqa: E731
    elif case == "dtype":
        x = rand(seed, ctx.rank, n, torch.bfloat16 if ctx.rank == 1 else torch.float32)
    elif case == "count":
        x = rand(seed, ctx.rank, n + (1 if ctx.rank == 1 else 0), torch.float32)
    elif case == "count_across_grids":
        # 4 KB against 4 MiB: the calls run on different grids (16 and the group's 64
        # blocks), and the small call's rank stands in for the blocks it does not run
        # (NOTE [Grids] in csrc_kernels/protocol.cuh), so the group stays usable.
        x = rand(seed, ctx.rank, (1 << 20) if ctx.rank == 1 else n, torch.float32)
    elif case == "unrunnable_dtype":
        # A dtype the kernels do not reduce, on one rank: it refuses the call (TypeError)
        # by joining it as invalid (Engine::refuse), so the others raise the mismatch
        # instead of running their all_reduce with its next call (issue 25, place 8).
        x = rand(seed, ctx.rank, n, torch.float64 if ctx.rank == 1 else torch.float32)
    elif case == "unrunnable_large":
        # The same with a 4 MiB call: the invalid kernel (no bytes: the small grid) against
        # the others' full grid.
        x = rand(seed, ctx.rank, 1 << 20, torch.float64 if ctx.rank == 1 else torch.float32)
    else:
        raise AssertionError(case)
    # The kernels find the disagreement on the GPU, asynchronously: a rank raises it at
    # the call itself (if its kernel already ran when the launch returned) or at the
    # group's next call (here a barrier, which also waits for the GPU). Every rank makes
    # both calls whichever raised, as a program that handles the error and goes on must:
    # a rank that skipped the barrier would leave the group's kernels out of step (seen
    # on 4 H200s, 2026-11-22 01:08, when one rank raised at the all_reduce).
    result = ("no error", "")
    for c in (call, lambda: dist.barrier(group=g)):
        try:
            c()
        except Exception as e:  # noqa: BLE001 - the parent inspects it
            if result[0] == "no error":
                result = (type(e).__name__, str(e))
    _still_works(ctx, g, seed)
    dist.destroy_process_group(g)
    return result


@pytest.mark.parametrize(
    "case",
    [
        "dtype",
        "count",
        "count_across_grids",
        "unrunnable_dtype",
        "unrunnable_large",
        "ll_kinds",
        "ll_gather_count",
        "ll_gather_across_grids",
    ],
)
def test_mismatched_arguments_raise_on_every_rank(gpus, seed, case):
    results = gpus.run(body_mismatch, seed, case, timeout=90)
    for rank, (kind, msg) in enumerate(results):
        assert kind in ("ValueError", "TypeError", "RuntimeError"), f"rank {rank} raised {kind}: {msg}"
        assert "rank 1" in msg, f"rank {rank}'s message does not name rank 1, whose {case} differs: {msg}"


def body_unsupported(ctx, seed: int) -> dict[str, str]:
    """What rsccl does not run on CUDA tensors in a single-host group: recv from any source,
    the bitwise reductions (as NCCL has neither; every other standard collective and
    send/recv run) and reductions of a dtype its kernels do not reduce (float64). It must
    raise at once, on the calling rank (a recv involves nobody else; a reduction the
    engine cannot run is refused by each rank that asks for it: Engine::can_run, then
    Engine::refuse), and leave the group working, with no stale error at the next call
    (_still_works)."""
    g = _own_group()
    x = rand(seed, ctx.rank, 4 * ctx.world, torch.float32)
    ints = torch.randint(0, 1 << 30, (4 * ctx.world,), generator=torch.Generator().manual_seed(seed + ctx.rank)).to(ctx.device)
    calls = {
        "recv_anysource": lambda: dist.recv(torch.empty_like(x), group=g),
        "all_reduce_band_int64": lambda: dist.all_reduce(ints, op=dist.ReduceOp.BAND, group=g),
        "all_reduce_float64": lambda: dist.all_reduce(x.double(), group=g),
        "reduce_scatter_float64": lambda: dist.reduce_scatter_tensor(
            torch.empty(4, dtype=torch.float64, device=ctx.device), x.double(), group=g
        ),
    }
    results = {}
    for name, call in calls.items():
        try:
            call()
            torch.cuda.synchronize()
            results[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the parent inspects it
            results[name] = f"{type(e).__name__}: {e}"
    _still_works(ctx, g, seed)
    dist.destroy_process_group(g)
    return results


def test_unsupported_cuda_calls_raise(gpus, seed):
    results = gpus.run(body_unsupported, seed, timeout=120)
    for rank, per_call in enumerate(results):
        for name, outcome in per_call.items():
            assert outcome != "no error", f"rank {rank}: {name} on CUDA tensors returned; rsccl must raise"
            says = {
                "recv_anysource": "src",
                "all_reduce_band_int64": f"all_reduce: rank {rank} passed ReduceOp.BAND on int64",
                "all_reduce_float64": f"all_reduce: rank {rank} passed float64; rsccl's CUDA reductions take",
                "reduce_scatter_float64": f"reduce_scatter: rank {rank} passed float64; rsccl's CUDA reductions take",
            }[name]
            assert outcome.startswith("TypeError") and says in outcome, f"rank {rank}: {name}'s error does not say {says!r}: {outcome}"


KILL_TIMEOUT = 20.0  # the fresh cluster's group timeout
KILL_SLACK = 20.0


def body_warm(ctx) -> None:
    x = torch.ones(1000, device=ctx.device)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    assert x[0].item() == ctx.world


def body_die_or_keep_reducing(ctx, seed: int, victim: int, timeout: float) -> tuple[tuple[str, str, float] | None, float]:
    x = rand(seed, ctx.rank, 1 << 20, torch.float32)
    return die_or_repeat(ctx, victim, timeout, lambda: dist.all_reduce(x, op=dist.ReduceOp.MAX))


def test_two_ranks_on_one_gpu_are_refused_without_allow_shared_gpu():
    """Without the option, two ranks on one GPU (usually a missing set_device) fail at
    creation on both ranks, naming both and the option; nothing hangs."""
    with pytest.raises(ClusterError) as e:
        gpu_cluster(2, nccl_ref=False, env={"CUDA_VISIBLE_DEVICES": "0", "RSCCL_ALLOW_SHARED_GPU": "0"}, start_timeout=120).close()
    msg = str(e.value)
    for rank in (0, 1):
        assert f"--- rank {rank}: ValueError" in msg, f"rank {rank} did not raise ValueError at creation:\n{msg}"
    assert "group ranks 0 and 1 both use the GPU" in msg and "RSCCL_ALLOW_SHARED_GPU" in msg, msg


def test_gpus_without_peer_access_are_refused_at_creation_naming_both():
    """GPUs that cannot reach each other (PCIe without P2P; here rank 1 pretends its driver
    said so, RSCCL_TEST_NO_PEER_ACCESS, since these machines all have P2P) fail creation
    before anything is mapped, on every rank, with an error naming both ranks and GPUs and
    the way out (NCCL), not a bare cuMemSetAccess error; nothing hangs (issue 25, place 6)."""
    needs_own_gpus(2)
    with pytest.raises(ClusterError) as e:
        gpu_cluster(2, nccl_ref=False, env={"RSCCL_TEST_NO_PEER_ACCESS": "1"}, start_timeout=120).close()
    msg = str(e.value)
    for rank in (0, 1):
        assert f"--- rank {rank}: ValueError" in msg, f"rank {rank} did not raise ValueError at creation:\n{msg}"
    assert "the GPU of rank 1 (cuda:1, PCI " in msg and "cannot access the memory of the GPU of rank 0 (cuda:0, PCI " in msg, msg
    assert 'backend="cpu:rsccl,cuda:nccl"' in msg and "cuMemSetAccess" not in msg, msg


def body_sum_of_ranks(ctx) -> float:
    x = torch.full((1000,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(x)
    return x[0].item()


def test_ranks_sharing_a_gpu_need_no_peer_access():
    """Ranks on one GPU (allow_shared_gpu) are not asked about peer access: the same hook
    that fails the test above changes nothing here, and the group works."""
    env = {"CUDA_VISIBLE_DEVICES": "0", "RSCCL_ALLOW_SHARED_GPU": "1", "RSCCL_TEST_NO_PEER_ACCESS": "1"}
    c = gpu_cluster(2, nccl_ref=False, env=env, start_timeout=120)
    try:
        assert c.run(body_sum_of_ranks) == [3.0, 3.0]
    finally:
        c.close()


def test_killed_rank_fails_the_survivors_and_frees_their_gpus(seed):
    check_killed_rank(
        (body_warm,), (body_die_or_keep_reducing, seed, 1, KILL_TIMEOUT), KILL_TIMEOUT, KILL_SLACK, "all_reduce", name_victim=True
    )
