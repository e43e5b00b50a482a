"""A stopped rank (SIGSTOP: alive, never answering): the ranks that wait on it directly
name it and say it is stopped; a rank that waits on a peer that itself waits says so
("rank 0 sent nothing matching, which waits for rank 3 (pid ...), which is stopped"), as
far as the engine can know it (each rank publishes whom its oldest send or recv waits
for; ControlBlock::waits_for)."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
from harness import Cluster


def body_ring(ctx, stopped: int) -> tuple[str, str]:
    """Two rounds of a ring in which each rank receives from its left before sending to
    its right (rank 0 starts each round by sending); the stopped rank never takes part."""
    r, n = ctx.rank, ctx.world
    if r == stopped:
        os.kill(os.getpid(), signal.SIGSTOP)
        return ("resumed", "")
    left, right = (r - 1) % n, (r + 1) % n
    x = torch.full((64,), float(r))
    try:
        for _ in range(2):
            if r == 0:
                dist.send(x, right)
                dist.recv(x, left)
            else:
                dist.recv(x, left)
                dist.send(x, right)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return (type(e).__name__, str(e))
    return ("no error", "")


def test_stopped_rank_is_named_through_the_ranks_that_wait_for_it():
    world, stopped = 4, 3
    c = Cluster(world, init_timeout=3.0)
    try:
        for r in range(world):
            c.conns[r].send((body_ring, (stopped,)))
        results = {}
        for r in range(world):
            if r == stopped:
                continue
            assert c.conns[r].poll(60), f"rank {r} did not answer within 60 s"
            status, value = c.conns[r].recv()
            assert status == "ok", value
            results[r] = value
        pid = c.procs[stopped].pid
        for r, (kind, msg) in sorted(results.items()):
            print(f"rank {r}: {kind}: {msg}")
        for r, (kind, msg) in results.items():
            assert kind == "TimeoutError", (r, kind, msg)
            assert f"rank {stopped} (pid {pid}), which is stopped" in msg or (
                f"rank {stopped} posted no matching recv, which is stopped" in msg
                or f"rank {stopped} sent nothing matching, which is stopped" in msg
            ), f"rank {r}'s message does not lead to the stopped rank {stopped}: {msg}"
        # Rank 1 waits for rank 0, which itself waits for the stopped rank 3.
        assert "rank 0 sent nothing matching, which waits for rank 3" in results[1][1], results[1]
    finally:
        os.kill(c.procs[stopped].pid, signal.SIGCONT)
        c.kill()
