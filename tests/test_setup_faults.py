"""A rank that dies while a group is being created: every survivor raises a named error
(PeerFailureError or TimeoutError naming the victim's rank, and its pid once it has
published one) within the group timeout, releases what was built, and exits cleanly.

The victim kills itself through the test-only hook RSCCL_TEST_EXIT_AT
(bootstrap/setup.rs) at a named phase of its first (init_process_group) or second
(new_group) group creation, after a random delay. The outer deadline asserts that
nothing hangs. CI runs every phase x {init_process_group, new_group} with a random victim
and delay (8 trials, about a minute on 2 cores); RSCCL_FAULT_MATRIX=full runs every
victim and several delays (72 trials).
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import random
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from harness import free_port, fresh_seed

WORLD = 3
TIMEOUT_S = 3.0
# Phases a CPU group goes through (cuda and nccl are in tests/gpu/test_gpu_setup_faults.py).
PHASES = ["rendezvous", "mesh", "region", "engine"]
FULL = os.environ.get("RSCCL_FAULT_MATRIX") == "full"


def _fd_kinds() -> dict[str, int]:
    """This process's descriptors that rsccl's set-up opens (pidfds, memfd regions, Unix
    sockets), counted by kind."""
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        kind = "pidfd" if "pidfd" in link else "memfd" if link.startswith("/memfd:") else "socket" if link.startswith("socket:") else None
        if kind:
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _rank(rank: int, port: int, q, second: bool, exit_at: str, store_in_rank0: bool, world: int = WORLD, cuda: bool = False) -> None:
    os.environ["RSCCL_TEST_EXIT_AT"] = exit_at
    if cuda:
        os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
        # A victim that dies just after the group was made can be met by a survivor's kernel
        # (the GPU watchdog sees the peer gone) rather than at a launch: with the default
        # cuda_error_teardown = 1 that survivor's process would end instead of raising, and
        # this trial checks what it raises (teardown is tests/gpu/test_gpu_faults.py's).
        os.environ["RSCCL_CUDA_ERROR_TEARDOWN"] = "0"
    # A survivor that hangs shows where (the parent's deadline comes later).
    faulthandler.dump_traceback_later(60, exit=False)
    import rsccl  # noqa: F401 - registers the backend
    import torch

    if cuda:
        # rsccl builds its CUDA engine at creation (phase "cuda"); ranks go round-robin over
        # the GPUs, sharing them (allow_shared_gpu) where they outnumber them.
        gpus = torch.cuda.device_count()
        if world > gpus:
            os.environ["RSCCL_ALLOW_SHARED_GPU"] = "1"
        torch.cuda.set_device(rank % gpus)
    start = None
    result: tuple = ("no error", "", 0.0, {}, {})
    before = _fd_kinds()
    group = None
    try:
        master = store_in_rank0 and rank == 0
        store = dist.TCPStore("127.0.0.1", port, world, master, timeout=timedelta(seconds=30), wait_for_workers=False)
        # Every rank has connected to the store before any can die: a client that connects
        # after the server's process died waits out torch's own store timeout, which is
        # torch's set-up, not rsccl's.
        store.add("connected", 1)
        while int(store.add("connected", 0)) < world:
            time.sleep(0.005)
        before = _fd_kinds()
        start = time.monotonic()
        dist.init_process_group("rsccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
        if second:
            before = _fd_kinds()
            start = time.monotonic()
            group = dist.new_group(list(range(world)), backend="rsccl", timeout=timedelta(seconds=TIMEOUT_S))
        # A rank that dies after its group was made shows at the next collective: run
        # them until one fails (the victim dies within a few hundred ms at most).
        x = torch.ones(1000, device="cuda" if cuda else "cpu")
        until = time.monotonic() + 10
        while time.monotonic() < until:
            dist.all_reduce(x, group=group)
            time.sleep(0.001)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        took = time.monotonic() - start if start is not None else 0.0
        # A group that was made, then failed, is destroyed; one that failed while being
        # made is gone already. Either way what it built must be released (the default
        # group, when the new_group failed, still holds its own: it is in `before` too).
        if group is not None:
            dist.destroy_process_group(group)
        elif not second and dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        result = (type(e).__name__, str(e), took, before, _fd_kinds())
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        q.put((rank, os.getpid(), result))


def _trial(phase: str, victim: int, second: bool, delay_ms: int, store_in_rank0: bool, world: int = WORLD, cuda: bool = False) -> None:
    """One trial; `cuda`: every rank sets its device (GPU = rank) first, so that its groups
    have a CUDA engine (tests/gpu/test_gpu_setup_faults.py)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = None
    if store_in_rank0:
        port = free_port()
    else:
        server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=30), wait_for_workers=False)
        port = server.port
    exit_at = f"phase={phase},rank={victim},group={2 if second else 1},delay_ms={delay_ms}"
    where = "rank 0" if store_in_rank0 else "the parent"
    exit_at_msg = f"{exit_at} (store in {where})"
    procs = [ctx.Process(target=_rank, args=(r, port, q, second, exit_at, store_in_rank0, world, cuda)) for r in range(world)]
    for p in procs:
        p.start()
    # The outer deadline: start-up (imports on a loaded 2-core machine) plus twice the
    # timeout per creation; far below what a hang would take.
    deadline = time.monotonic() + 90
    got = {}
    try:
        while len(got) < world - 1:
            left = deadline - time.monotonic()
            assert left > 0, f"{exit_at_msg}: survivors {sorted(set(range(world)) - {victim} - set(got))} hung"
            try:
                rank, _pid, res = q.get(timeout=min(left, 1.0))
            except Exception:  # noqa: BLE001 - queue.Empty: poll again
                if procs[victim].exitcode is not None and procs[victim].exitcode != -signal.SIGKILL:
                    raise AssertionError(f"{exit_at_msg}: the victim exited with {procs[victim].exitcode}, not by its hook") from None
                continue
            assert rank != victim, f"{exit_at_msg}: the victim reported {res}: its hook did not fire"
            got[rank] = res
        for r, p in enumerate(procs):
            p.join(max(deadline - time.monotonic(), 1))
            assert p.exitcode is not None, f"{exit_at_msg}: rank {r} did not exit"
        assert procs[victim].exitcode == -signal.SIGKILL, f"{exit_at_msg}: victim exit code {procs[victim].exitcode}"
        victim_pid = procs[victim].pid
        for r, (kind, msg, took, before, after) in sorted(got.items()):
            print(f"{exit_at_msg}: rank {r}: {kind} after {took:.2f} s: {msg}")
            assert procs[r].exitcode == 0, f"{exit_at_msg}: survivor {r} exited with {procs[r].exitcode}"
            if store_in_rank0 and victim == 0 and kind.startswith("Dist"):
                # torch's init_process_group used the dead store itself, before rsccl's part:
                # rsccl's own store calls turn every store error into PeerFailureError or
                # TimeoutError (rust/bindings/src/store.rs), so a Dist* error is torch's. Its
                # wording varies ("Did the remote server shutdown or crash?", "Connection
                # reset by peer" on torch 2.15).
                continue
            assert kind in ("PeerFailureError", "TimeoutError"), f"{exit_at_msg}: rank {r} raised {kind}: {msg}"
            if store_in_rank0 and victim == 0 and "the c10d store failed" in msg:
                # The store died with its host: nothing tells the survivors which process
                # hosted it (docs/errors.md), so the message says that much.
                assert "has probably exited" in msg, msg
                continue
            assert f"rank {victim} " in msg, f"{exit_at_msg}: rank {r}'s message does not name rank {victim}: {msg}"
            # Its pid is known once it published its record; a victim that died before
            # publishing is named by rank alone ("did not join").
            assert f"pid {victim_pid}" in msg or "did not join" in msg or "did not start the group" in msg, (
                f"{exit_at_msg}: rank {r}'s message does not name pid {victim_pid}: {msg}"
            )
            assert took < 3 * TIMEOUT_S + 2, f"{exit_at_msg}: rank {r} took {took:.1f} s with a {TIMEOUT_S} s timeout: {msg}"
            for k in ("pidfd", "memfd", "socket"):
                assert after.get(k, 0) <= before.get(k, 0), f"{exit_at_msg}: rank {r} kept {k}s: before {before}, after {after}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def _cases() -> list[tuple[str, int, bool, int, bool]]:
    if mp.parent_process() is not None:
        return []  # a rank importing this module to find _rank
    seed = fresh_seed()
    rng = random.Random(seed)
    print(f"setup fault matrix seed={seed} (RSCCL_TEST_SEED={seed} reproduces it)")
    cases = []
    for phase in PHASES:
        for second in (False, True):
            victims = range(WORLD) if FULL else [rng.randrange(WORLD)]
            for v in victims:
                # Set-up phases take milliseconds: delays past a few land after creation.
                delays = [0, rng.randrange(1, 5), rng.randrange(5, 50)] if FULL else [rng.choice([0, rng.randrange(1, 5)])]
                for d in delays:
                    for in_rank0 in (False, True) if FULL else (rng.random() < 0.5,):
                        cases.append((phase, v, second, d, in_rank0))
    return cases


@pytest.mark.parametrize("phase,victim,second,delay_ms,store_in_rank0", _cases())
def test_rank_dying_during_set_up_is_named(phase, victim, second, delay_ms, store_in_rank0):
    _trial(phase, victim, second, delay_ms, store_in_rank0)
