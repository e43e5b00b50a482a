"""GPU test clusters: rank processes placed round-robin over the visible GPUs, long-lived,
reused across tests.

Each rank process sets its device (GPU = rank % GPUs), joins the rsccl default group (whose
CUDA engine is created eagerly on that device) and a reference group over the same ranks,
which every result is compared with: NCCL where each rank has a GPU of its own; where ranks
share GPUs (a world larger than the GPUs: rsccl's `allow_shared_gpu`, which NCCL refuses),
gloo on CPU copies of the tensors (`gpu_refs.ref_call`), besides the float64 and exact
references of tests/refs.py. Bodies are module-level functions `body(ctx, *args)` run on every rank, as in
tests/harness.py, whose Cluster (deadline per call, tracebacks of every failing rank)
starts and drives these processes too.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import torch
from harness import Cluster, serve

# NVLink multicast can put a shared host's GPUs out of service: keep it off in NCCL, torch's
# symmetric memory and NVSHMEM. Set here, in the parent, so that the spawned ranks have it
# from their first instruction (they import torch while unpickling their arguments, before
# any code of ours runs).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(GPU_ENV)

# Each all-rank group config the collective tests run on, as rsccl.Options fields.
GROUP_CONFIGS: dict[str, dict | None] = {
    "default": None,  # the world group, default settings
    "small-buffer": {"cuda_buffer_bytes": "4MiB"},  # multi-MiB messages take the pipelined (multi-chunk) path
    "two-shot": {"cuda_allreduce_one_shot_max_bytes": 0},  # every all_reduce reduce-scatters then all-gathers
    "one-shot": {"cuda_allreduce_one_shot_max_bytes": "1GiB"},  # every all_reduce is one-shot
    # all_gather of every size on the copy engines (issue 28), and in many rounds through a
    # small staging; and never, so that the kernel keeps its tests at every size.
    "copy-engines": {"cuda_copy_engine_min_bytes": 1},
    "copy-engines-small-buffer": {"cuda_copy_engine_min_bytes": 1, "cuda_buffer_bytes": "4MiB"},
    # send/recv on the copy engines in many steps through a small inbox (halves of 1 MiB /
    # (local ranks - 1)); and from 64 KiB on only, so that kernel and copy-engine messages
    # follow each other between a pair.
    "copy-engines-small-inbox": {"cuda_copy_engine_min_bytes": 1, "cuda_p2p_bytes": "2MiB"},
    "copy-engines-from-64KiB": {"cuda_copy_engine_min_bytes": 65536, "cuda_p2p_bytes": "2MiB"},
    # Copy-engine calls of 16 MiB and more beside kernel calls of the same collective (a
    # reduce_scatter of 4 MiB runs the kernel, one of 16 MiB the copy engines).
    "copy-engines-from-16MiB": {"cuda_copy_engine_min_bytes": "16MiB"},
    "no-copy-engines": {"cuda_copy_engine_min_bytes": 0},
    # Small all_reduce, reduce_scatter and all_gather on the barrier kernels, as above the
    # low-latency kernels' bound (NOTE [Low latency] in csrc_kernels/low_latency.cuh).
    "no-low-latency": {"cuda_low_latency_max_bytes": 0},
    # reduce_scatter and all_reduce as a ring at every size (NOTE [Ring] in csrc_kernels/ring.cuh:
    # by default from 64 MiB), every all_reduce two-shot and no low-latency kernel, so that
    # odd, tiny and empty blocks and chunks take it; and through a small staging, whose
    # slots of a few KiB wrap around many times per call.
    "ring": {"cuda_ring_min_bytes": 1, "cuda_allreduce_one_shot_max_bytes": 1, "cuda_low_latency_max_bytes": 0},
    "ring-small-buffer": {
        "cuda_ring_min_bytes": 1,
        "cuda_allreduce_one_shot_max_bytes": 1,
        "cuda_low_latency_max_bytes": 0,
        "cuda_buffer_bytes": "4MiB",
    },
}


def warm_up_aside(calls: Any) -> None:
    """`calls()` once on a side stream that waits for the current one, then joined back and
    synchronized: the warm-up before a CUDA graph capture, outside it, as torch's docs ask."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture(calls: Any) -> torch.cuda.CUDAGraph:
    """`calls()` captured into a CUDA graph, then synchronized. "thread_local", as vLLM and
    Megatron capture: in the default "global" mode, CUDA calls of other threads (NCCL's
    watchdog for the reference group, say) void the capture."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        calls()
    torch.cuda.synchronize()
    return graph


def gpu_count() -> int:
    return torch.cuda.device_count()


def selected_worlds() -> list[int]:
    """World sizes to test: RSCCL_GPU_WORLDS ("2,4", "8"), else 2, 4 and 8, on whatever GPUs
    there are (ranks placed round-robin; where they outnumber the GPUs, they share them)."""
    env = os.environ.get("RSCCL_GPU_WORLDS", "").replace(" ", "")
    if env:
        worlds = sorted({int(w) for w in env.split(",") if w})
        if not worlds or worlds[0] < 2:
            raise ValueError(f"RSCCL_GPU_WORLDS={env!r}: expected world sizes >= 2, such as '2,4'")
        return worlds
    return [2, 4, 8]


def shares_gpus(world: int) -> bool:
    """Whether a cluster of `world` ranks puts several ranks on one GPU."""
    return world > gpu_count()


needs_gpus = pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU")


def needs_own_gpus(world: int) -> None:
    """Skip (inside a test) where ranks of a `world` share GPUs: for what only makes sense on
    separate GPUs (NCCL itself, peer access, timing, device-wide memory counters)."""
    if shares_gpus(world):
        pytest.skip(f"{world} ranks share {gpu_count()} GPU(s): this test needs a GPU per rank")


@dataclass
class GpuCtx:
    rank: int
    world: int
    device: torch.device
    # The reference group over the same ranks: NCCL, or gloo where ranks share GPUs (call it
    # through gpu_refs.ref_call); None where the cluster was started without it.
    nccl: Any
    state: dict  # per-process scratch that survives between bodies
    shared: bool = False  # several ranks on this rank's GPU (rsccl's allow_shared_gpu)

    def gather_rows(self, x: Any) -> Any:
        """Every rank's `x` through the reference group (refs.assert_identical_across_ranks)."""
        from gpu_refs import gather_inputs

        return gather_inputs(self, x)


def _gpu_worker(
    rank: int, world: int, port: int, conn: Any, env: dict, init_timeout: float, options: Any, *, nccl_ref: bool = True
) -> None:
    os.environ.update(env)
    import rsccl  # noqa: F401 - registers the backend
    import torch.distributed as dist

    try:
        # Before init_process_group: rsccl creates its CUDA engine on the current device.
        shared = world > torch.cuda.device_count()
        torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60), wait_for_workers=False)
        dist.init_process_group(
            "rsccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=init_timeout), pg_options=options
        )
        nccl = None
        if nccl_ref and shared:
            nccl = dist.new_group(backend="gloo")  # NCCL refuses two ranks on one GPU
        elif nccl_ref:
            nccl = dist.new_group(backend="nccl")
            # NCCL creates its communicator at first use: now, not inside a test's measurement.
            warm = torch.ones(1, device="cuda")
            dist.all_reduce(warm, group=nccl)
            torch.cuda.synchronize()
            if rank == 0:
                from rsccl._cuda import nccl_baseline

                # torch 2.15's "nccl" is ProcessGroupNCCL2; say which one the checks compare with.
                print(f'GPU tests: reference backend "nccl" is {nccl_baseline(nccl)}', file=sys.stderr, flush=True)
        ctx = GpuCtx(rank, world, torch.device("cuda", torch.cuda.current_device()), nccl, {}, shared)
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    serve(conn, ctx)


def gpu_cluster(
    world: int, *, timeout: float = 60.0, options: Any = None, nccl_ref: bool = True, start_timeout: float = 240.0, env: dict | None = None
) -> Cluster:
    """`world` rank processes on the GPUs, round-robin (sharing them, with rsccl's
    allow_shared_gpu, where there are fewer GPUs than ranks); `timeout` is the rsccl default
    group's; `env` is added to the ranks' environment."""
    shared = {"RSCCL_ALLOW_SHARED_GPU": "1"} if shares_gpus(world) else {}
    return Cluster(
        world,
        # These clusters live across tests, several of which provoke failures and check
        # what is raised: they run with failures raised (cuda_error_teardown = 0);
        # test_gpu_faults.py checks the default, which ends the process.
        env={**GPU_ENV, "RSCCL_CUDA_ERROR_TEARDOWN": "0", **shared, **(env or {})},
        init_timeout=timeout,
        options=options,
        start_timeout=start_timeout,
        worker=_gpu_worker,
        worker_kwargs={"nccl_ref": nccl_ref},
    )


def alive(cluster: Cluster) -> bool:
    return all(p.is_alive() for p in cluster.procs)


def rsccl_group(ctx: GpuCtx, config: str) -> Any:
    """The group of GROUP_CONFIGS[config] over all ranks, created on first use (a collective
    call: every rank asks for it in the same body) and kept for later bodies."""
    import torch.distributed as dist

    fields = GROUP_CONFIGS[config]
    if fields is None:
        return dist.group.WORLD
    groups = ctx.state.setdefault("groups", {})
    if config not in groups:
        import rsccl

        groups[config] = dist.new_group(backend="rsccl", pg_options=rsccl.Options(**fields))
    return groups[config]


def case_call(ctx: GpuCtx, config: str, what: str, dtype: Any, n: int, op: str = "SUM", root: int = 0, **more: Any) -> Any:
    """A tests/cases.py call on this rank's GPU and the group of GROUP_CONFIGS[config], its
    inputs salted by `what`; `more`: the other fields of cases.Call (rows, splits)."""
    from cases import Call

    group = rsccl_group(ctx, config)
    return Call(dtype, n, op, root, salt=what, device=ctx.device, group=group, label=f"group={config}", **more)


def die_or_repeat(ctx: GpuCtx, victim: int, timeout: float, step: Any) -> tuple[tuple[str, str, float] | None, float]:
    """In a rank body: the victim kills itself; every other rank calls `step()` and
    synchronizes the device until that raises or 3 x `timeout` pass. Returns the error
    (type name, message, seconds until it came; None if none came) and how long a device
    synchronize took after it: the GPU must not be left running a kernel that waits for
    the dead rank, nor compute wrong results."""
    import signal
    import time

    if ctx.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    error = None
    try:
        while time.monotonic() - start < 3 * timeout:
            step()
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the parent inspects it
        error = (type(e).__name__, str(e), time.monotonic() - start)
    t0 = time.monotonic()
    torch.cuda.synchronize()
    assert (torch.arange(10, device=ctx.device) * 2).sum().item() == 90, "the GPU computes wrong results after the failure"
    return error, time.monotonic() - t0


def check_killed_rank(
    warm: tuple, body: tuple, timeout: float, slack: float, what: str, name_victim: bool = False, own_gpus: bool = False
) -> None:
    """A fresh cluster of the largest selected world (it ends broken; of the largest that
    gives each rank its own GPU if `own_gpus`, for bodies that run NCCL), with
    group timeout `timeout`: run `warm` = (body, *args), then `body` = (body, *args), whose
    last argument must be the timeout and which kills rank 1 (die_or_repeat). Every
    survivor must come back with an error of a failed group within the timeout plus
    `slack` (naming rank 1 if `name_victim`), and a working GPU."""
    from harness import ClusterError

    worlds = [w for w in selected_worlds() if not own_gpus or not shares_gpus(w)]
    if not worlds:
        pytest.skip(f"none of the world sizes {selected_worlds()} gives each rank its own GPU ({gpu_count()} visible)")
    world, victim = max(worlds), 1
    c = gpu_cluster(world, timeout=timeout, nccl_ref=False)
    try:
        c.run(warm[0], *warm[1:], timeout=120)
        try:
            res = c.run(body[0], *body[1:], timeout=3 * timeout + 90, may_exit=frozenset({victim}))
        except ClusterError as e:
            pytest.fail(f"with rank {victim} killed, the survivors of {what} did not come back (hung in a kernel or NCCL?):\n{e}")
    finally:
        c.close(timeout=30)
    for rank, got in enumerate(res):
        if rank == victim:
            continue
        error, sync_s = got
        assert error is not None, f"rank {rank} kept running {what} for {3 * timeout:.0f} s with rank {victim} dead, without an error"
        kind, msg, took = error
        assert kind in ("PeerFailureError", "GroupAbortedError", "TimeoutError", "RuntimeError"), f"rank {rank} raised {kind}: {msg}"
        if name_victim:
            assert f"rank {victim}" in msg, f"rank {rank}'s error does not name rank {victim}: {kind}: {msg}"
        assert took < timeout + slack, f"rank {rank} raised only after {took:.1f} s (group timeout {timeout:.0f} s): {kind}: {msg}"
        assert sync_s < 10, f"rank {rank}: torch.cuda.synchronize() took {sync_s:.1f} s after the failure"
