"""Nothing leaks: no named files in /dev/shm or the filesystem, no abstract sockets left
bound, no descriptors left open after destroy_process_group, a killed rank included.
Also: groups spanning hosts fall back to gloo (host identity overridden per rank)."""

from __future__ import annotations

import gc
import os
import signal

import torch
import torch.distributed as dist
from harness import Cluster, socket_inodes
from refs import assert_close, make, reduce_ref


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def unix_sockets() -> dict[str, str]:
    """inode -> line of /proc/net/unix, for sockets bound to an rsccl name."""
    with open("/proc/net/unix") as f:
        return {line.split()[6]: line for line in f if "@rsccl-" in line}


def body_socket_inodes(ctx) -> list[str]:
    return socket_inodes()


def body_fds_released(ctx, seed: int) -> tuple[int, int, int]:
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    gc.collect()
    before = fds()
    g = dist.new_group(list(range(ctx.world)))
    during = fds()
    x = make(seed, ctx.rank, 5000, torch.float32)
    dist.all_reduce(x, group=g)
    assert_close(x, reduce_ref([make(seed, r, 5000, torch.float32) for r in range(ctx.world)], "SUM"), "new group", ctx.world)
    dist.destroy_process_group(g)
    del g
    gc.collect()
    return before, during, fds()


def test_no_leaks_after_normal_exit_and_after_a_kill():
    shm_before = shm_entries()
    c = Cluster(3)
    try:
        for before, during, after in c.run(body_fds_released, 11):
            assert during > before, "a group holds its region and sockets while alive"
            assert after == before, f"descriptors leaked: {before} before the group, {after} after destroying it"
        ours = {i for per_rank in c.run(body_socket_inodes) for i in per_rank}
        live = {i: line for i, line in unix_sockets().items() if i in ours}
        assert live, "the world group's local connections should be visible"
        # Flags 00010000 (__SO_ACCEPTCON) marks a listening socket: none may outlive set-up.
        assert not [line for line in live.values() if line.split()[3] == "00010000"], live
        c.run(_kill_self_if, 2, may_exit=frozenset({2}), timeout=60)
    finally:
        c.close()
    assert shm_entries() == shm_before, f"/dev/shm changed: {shm_entries() ^ shm_before}"
    left = set(unix_sockets()) & ours
    assert not left, f"abstract sockets outlived the processes: {left}"


def _kill_self_if(ctx, victim: int) -> None:
    if ctx.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)


def body_gloo_fallback(ctx, seed: int) -> dict:
    import rsccl

    w = ctx.world
    x = make(seed, ctx.rank, 3001, torch.float32)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    assert_close(x, reduce_ref([make(seed, r, 3001, torch.float32) for r in range(w)], "MAX"), "gloo-path all_reduce")
    out = torch.empty(w * 10, dtype=torch.int64)
    dist.all_gather_into_tensor(out, make(seed, ctx.rank, 10, torch.int64))
    assert_close(out, torch.cat([make(seed, r, 10, torch.int64) for r in range(w)]), "gloo-path all_gather")
    y = make(seed, ctx.rank, 7, torch.float64)
    dist.broadcast(y, src=w - 1)
    assert_close(y, make(seed, w - 1, 7, torch.float64), "gloo-path broadcast")
    if ctx.rank == 0:
        dist.send(torch.arange(5.0), dst=1)
    elif ctx.rank == 1:
        t = torch.empty(5)
        dist.recv(t, src=0)
        assert_close(t, torch.arange(5.0), "gloo-path send/recv")
    # A subgroup inside one emulated host runs on rsccl's own engine.
    local = dist.new_group([0, 2])
    engine = None
    if ctx.rank in (0, 2):
        z = make(seed, ctx.rank, 100, torch.float32)
        dist.all_reduce(z, group=local)
        assert_close(z, reduce_ref([make(seed, r, 100, torch.float32) for r in (0, 2)], "SUM"), "single-host subgroup", 2)
        engine = rsccl.memory_stats(local)["engine"]
    return {"world": rsccl.memory_stats()["engine"], "local": engine}


def test_groups_spanning_hosts_fall_back_to_gloo():
    # Ranks 0 and 2 on "host a", 1 and 3 on "host b".
    env = [{"RSCCL_HOST_ID": "host-a" if r % 2 == 0 else "host-b"} for r in range(4)]
    c = Cluster(4, rank_env=env)
    try:
        res = c.run(body_gloo_fallback, 5)
    finally:
        assert c.close() == [0, 0, 0, 0]
    assert all(r["world"] == "gloo" for r in res), res
    assert res[0]["local"] == "host" and res[2]["local"] == "host", res
