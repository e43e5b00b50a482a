"""One rank of a GPU fault scenario (tests/gpu/test_gpu_faults.py starts one process per rank,
so that it can read each rank's exit status and stderr: a rank that rsccl ends on purpose
(cuda_error_teardown) must say why there).

    python fault_rank.py SCENARIO RANK WORLD PORT SEED TEARDOWN

Each scenario prints lines `RESULT <name> ok` when a collective's result was checked and
right, `RESULT <name> WRONG <detail>` when it was wrong (the one outcome that must never
happen), and `RAISED <name> <type>: <message>` when a call raised. The parent decides
what each scenario must show.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

import torch
import torch.distributed as dist

TIMEOUT_S = 5.0
LATE_S = 8.0  # past TIMEOUT_S: the peer's wait times out


def say(line: str) -> None:
    print(line, flush=True)


def expect_sum(name: str, got: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """Compare an all_reduce result with the float64 sum of every rank's input."""
    ref = torch.stack([x.double() for x in inputs]).sum(0)
    err = (got.double().cpu() - ref).abs().max().item()
    if err <= 1e-3 * max(1.0, ref.abs().max().item()):
        say(f"RESULT {name} ok")
    else:
        say(f"RESULT {name} WRONG max error {err:.3g}")


def inputs(seed: int, world: int, n: int, salt: int) -> list[torch.Tensor]:
    """Every rank's input (each rank can compute them all: the reference needs no collective)."""
    return [torch.randn(n, generator=torch.Generator().manual_seed(seed * 1000 + salt * 100 + r)) for r in range(world)]


def checked_all_reduce(name: str, x: torch.Tensor, xs: list[torch.Tensor]) -> None:
    """A blocking all_reduce of `x`, its result checked (RESULT) or its error said (RAISED)."""
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize()
        expect_sum(name, x, xs)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        say(f"RAISED {name} {type(e).__name__}: {e}")


def replayed_graph(rank: int, xs: list[torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of an all_reduce of this rank's input, replayed once and checked
    (RESULT replay_before), and the buffer it reduces."""
    buf = xs[rank].cuda()
    graph = capture_all_reduce(buf)
    buf.copy_(xs[rank].cuda())
    graph.replay()
    torch.cuda.synchronize()
    expect_sum("replay_before", buf, xs)
    return graph, buf


def capture_all_reduce(buf: torch.Tensor) -> torch.cuda.CUDAGraph:
    """A CUDA graph of an all_reduce of `buf` (warmed up on a side stream first, as torch
    asks of code it captures)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dist.all_reduce(buf.clone())
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        dist.all_reduce(buf)
    return graph


def late_peer(rank: int, world: int, seed: int) -> None:
    """Rank world-1 calls all_reduce LATE_S after the others, past the group timeout."""
    xs = inputs(seed, world, 4096, 1)
    x = xs[rank].cuda()
    if rank == world - 1:
        time.sleep(LATE_S)
    checked_all_reduce("late_all_reduce", x, xs)
    checked_all_reduce("next_all_reduce", xs[rank].cuda(), xs)


def ring_late_peer(rank: int, world: int, seed: int) -> None:
    """late_peer with every all_reduce on the ring schedule (NOTE [Ring] in
    csrc_kernels/ring.cuh; `main` sets the group's options)."""
    late_peer(rank, world, seed)


def graph_after_failure(rank: int, world: int, seed: int) -> None:
    """A CUDA graph of an all_reduce, captured while the group was healthy, replayed after a
    peer timed out: the replay must not compute (or pass off) a result."""
    xs = inputs(seed, world, 4096, 2)
    graph, buf = replayed_graph(rank, xs)
    late_peer(rank, world, seed)
    for k in range(3):
        buf.fill_(float("nan"))  # a replay that writes nothing leaves NaN; a wrong one, numbers
        try:
            graph.replay()
            torch.cuda.synchronize()
            if torch.isnan(buf).all():
                say(f"RESULT replay_after_{k} untouched")
            else:
                expect_sum(f"replay_after_{k}", buf, xs)
        except Exception as e:  # noqa: BLE001
            say(f"RAISED replay_after_{k} {type(e).__name__}: {e}")
    try:
        dist.barrier()
        say("RESULT barrier_after_replays ok")
    except Exception as e:  # noqa: BLE001
        say(f"RAISED barrier_after_replays {type(e).__name__}: {e}")


def async_then_replay(rank: int, world: int, seed: int) -> None:
    """A user error: an async all_reduce not yet waited for, then a graph replay of the same
    group. The two kernels are not ordered; rsccl must either compute both right or stop
    with a named error, never hand back wrong data."""
    n_big = 64 << 20  # float32: 256 MiB, long enough to overlap the replay
    big = inputs(seed, world, 1 << 16, 3)
    small = inputs(seed, world, 4096, 4)
    g_buf = small[rank].cuda()
    graph = capture_all_reduce(g_buf)
    reps = n_big // big[rank].numel()
    for k in range(4):
        x = big[rank].cuda().repeat(reps)
        g_buf.copy_(small[rank].cuda())
        torch.cuda.synchronize()
        try:
            dist.barrier()  # raises a failure of the round before (cuda_error_teardown = 0)
            # Both launches below wait for this sleep (the async collective's stream joins
            # the current one), so they become ready together and overlap on the GPU.
            torch.cuda._sleep(20_000_000)
            work = dist.all_reduce(x, async_op=True)
            graph.replay()  # not ordered after `work`: the misuse
            work.wait()
            torch.cuda.synchronize()
            expect_sum(f"async_{k}", x[: big[rank].numel()], big)
            expect_sum(f"replay_{k}", g_buf, small)
        except Exception as e:  # noqa: BLE001
            say(f"RAISED round_{k} {type(e).__name__}: {e}")
            return


def checked_all_gather(name: str, x: torch.Tensor, xs: list[torch.Tensor]) -> None:
    """A blocking all_gather_into_tensor of `x` (on the copy engines in the ce_ scenarios),
    its result compared with every rank's input (RESULT) or its error said (RAISED)."""
    try:
        out = torch.full((len(xs) * x.numel(),), float("nan"), device=x.device)
        dist.all_gather_into_tensor(out, x)
        torch.cuda.synchronize()
        want = torch.cat(xs)
        if torch.isnan(out).all():
            say(f"RESULT {name} untouched")
        elif torch.equal(out.cpu(), want):
            say(f"RESULT {name} ok")
        else:
            say(f"RESULT {name} WRONG {(out.cpu() != want).sum().item()} elements differ")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        say(f"RAISED {name} {type(e).__name__}: {e}")


def ce_late_peer(rank: int, world: int, seed: int) -> None:
    """late_peer on the copy engines: rank world-1 calls all_gather LATE_S late."""
    xs = inputs(seed, world, 1 << 18, 7)
    if rank == world - 1:
        time.sleep(LATE_S)
    checked_all_gather("late_all_gather", xs[rank].cuda(), xs)
    checked_all_gather("next_all_gather", xs[rank].cuda(), xs)


def one_more_on_rank_1(xs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """This rank's input on the GPU, with one element more on rank 1 (the mismatch)."""
    return torch.cat([xs[rank], torch.ones(1)]).cuda() if rank == 1 else xs[rank].cuda()


def mismatched_then_barrier(name: str, call) -> None:
    """`call()`, mismatched on rank 1, then a barrier: what each did (RESULT) or raised."""
    try:
        call()
        torch.cuda.synchronize()
        say(f"RESULT {name} returned")
        dist.barrier()
        say("RESULT barrier_after_mismatch returned")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        say(f"RAISED {name} {type(e).__name__}: {e}")


def ce_mismatch(rank: int, world: int, seed: int) -> None:
    """Rank 1 gathers one element more than the others, on the copy engines."""
    xs = inputs(seed, world, 1 << 18, 8)
    x = one_more_on_rank_1(xs, rank)
    out = torch.empty(world * x.numel(), device=x.device)
    mismatched_then_barrier("mismatched_all_gather", lambda: dist.all_gather_into_tensor(out, x))
    checked_all_gather("after_mismatch", xs[rank].cuda(), xs)


def mismatch(rank: int, world: int, seed: int) -> None:
    """Rank 1 passes one element more than the others."""
    xs = inputs(seed, world, 1000, 5)
    x = one_more_on_rank_1(xs, rank)
    mismatched_then_barrier("mismatched_all_reduce", lambda: dist.all_reduce(x))
    checked_all_reduce("after_mismatch", xs[rank].cuda(), xs)


def replay_after_destroy(rank: int, world: int, seed: int) -> None:
    """A graph of an all_reduce replayed after destroy_process_group: the graph keeps the
    group's memory and kernels alive, and its kernels stop the CUDA context with a message
    (a loud failure) instead of touching unmapped memory or returning a result."""
    xs = inputs(seed, world, 4096, 6)
    graph, buf = replayed_graph(rank, xs)
    dist.destroy_process_group()
    say("DESTROYED")
    buf.fill_(float("nan"))
    try:
        graph.replay()
        torch.cuda.synchronize()
        if torch.isnan(buf).all():
            say("RESULT replay_after_destroy untouched")
        else:
            expect_sum("replay_after_destroy", buf, xs)
    except Exception as e:  # noqa: BLE001
        say(f"RAISED replay_after_destroy {type(e).__name__}: {e}")
    os._exit(0)  # the CUDA context is gone: skip the interpreter's CUDA teardown


SCENARIOS = {
    f.__name__: f
    for f in (late_peer, ring_late_peer, graph_after_failure, async_then_replay, mismatch, replay_after_destroy, ce_late_peer, ce_mismatch)
}


def main() -> None:
    scenario, rank, world, port, seed, teardown = sys.argv[1], *map(int, sys.argv[2:7])
    import rsccl

    torch.cuda.set_device(rank % torch.cuda.device_count())
    shared = world > torch.cuda.device_count()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    # ce_ scenarios: every all_gather on the copy engines (issue 28).
    ce = {"cuda_copy_engine_min_bytes": 1} if scenario.startswith("ce_") else {}
    # ring_ scenarios: every all_reduce two-shot, as a ring.
    if scenario.startswith("ring_"):
        ce = {"cuda_ring_min_bytes": 1, "cuda_allreduce_one_shot_max_bytes": 1, "cuda_low_latency_max_bytes": 0}
    opts = rsccl.Options(cuda_error_teardown=teardown, allow_shared_gpu=shared, **ce)
    dist.init_process_group("rsccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S), pg_options=opts)
    say("READY")
    SCENARIOS[scenario](rank, world, seed)
    say("DONE")
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        say(f"RAISED destroy {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
