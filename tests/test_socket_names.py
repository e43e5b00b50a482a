"""The local sockets of group set-up: no one can know a rank's socket name before that
rank has bound it, so another process cannot take it first; and two processes started as
the same rank get an error naming that rank, not a socket error."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from harness import fresh_seed
from refs import assert_close, make, reduce_ref


def _rank(rank: int, world: int, port: int, q, seed: int, late_s: float, timeout_s: float) -> None:
    import rsccl  # noqa: F401 - registers the backend
    import torch

    torch.set_num_threads(1)
    try:
        time.sleep(late_s)  # a late rank: its name is the one a squatter would take
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60), wait_for_workers=False)
        dist.init_process_group("rsccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        x = make(seed, rank, 1000, torch.float32)
        dist.all_reduce(x)
        assert_close(x, reduce_ref([make(seed, r, 1000, torch.float32) for r in range(world)], "SUM"), "all_reduce", world)
        dist.destroy_process_group()
        q.put((rank, os.getpid(), "ok", ""))
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put((rank, os.getpid(), type(e).__name__, str(e)))


def _run(ranks: list[int], world: int, late: dict[int, float], timeout_s: float) -> list[tuple[int, int, str, str]]:
    """Start one process per entry of `ranks` (a rank may repeat) and collect each one's
    (rank, pid, outcome, message)."""
    seed = fresh_seed()
    print(f"seed={seed} (rerun with RSCCL_TEST_SEED={seed})")
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, world, store.port, q, seed, late.get(i, 0.0), timeout_s), daemon=True)
        for i, r in enumerate(ranks)
    ]
    for p in procs:
        p.start()
    out = []
    try:
        for _ in procs:
            out.append(q.get(timeout=120))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return sorted(out)


class Squatter:
    """Watches /proc/net/unix (as any local user can) and binds every rsccl socket name
    it can predict from the names it sees: a name ending in -<rank> is taken to be one of
    a family, and the family's other ranks' names are bound first."""

    def __init__(self, world: int):
        self.world = world
        self.seen: set[str] = set()
        self.taken: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.is_set():
            with open("/proc/net/unix") as f:
                names = {line.split()[-1][1:] for line in f if line.rstrip().split()[-1].startswith("@rsccl-")}
            for name in names - self.seen:
                self.seen.add(name)
                m = re.fullmatch(r"(rsccl-.*)-(\d+)", name)
                for r in range(self.world) if m else []:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    try:
                        s.bind(f"\0{m.group(1)}-{r}")
                        s.listen(1)
                        self.taken.append(s)
                    except OSError:
                        s.close()
            time.sleep(0.002)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.taken:
            s.close()


def test_a_squatter_cannot_take_a_late_ranks_socket_name():
    """Rank 2 starts late; a same-user process that reads the others' socket names and
    binds every name it can predict cannot stop the group from forming."""
    squatter = Squatter(world=3)
    try:
        got = _run([0, 1, 2], world=3, late={2: 3.0}, timeout_s=30.0)
    finally:
        squatter.close()
    assert squatter.seen, "the squatter saw no rsccl socket: the test tested nothing"
    assert [g[2:] for g in got] == [("ok", "")] * 3, (got, squatter.seen)


def test_two_processes_with_the_same_rank_get_an_error_naming_it():
    """World 2, three processes: ranks 0, 1 and 1. Whatever the order they arrive in, no
    two processes both run as rank 1, and every process that raises says that rank 1 was
    claimed by two processes (none raises a socket error or a bare timeout)."""
    got = _run([0, 1, 1], world=2, late={}, timeout_s=8.0)
    assert len(got) == 3, got
    ones = [g for g in got if g[0] == 1]
    assert any(g[2] != "ok" for g in ones), f"both rank-1 processes ran as rank 1: {got}"
    for rank, pid, kind, msg in got:
        if kind != "ok":
            assert kind == "ValueError", (rank, pid, kind, msg)
            assert "rank 1 was claimed by two processes" in msg, (rank, pid, msg)
