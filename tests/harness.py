"""Real multi-process test clusters.

A `Cluster` starts `world` processes (spawn), each of which joins an rsccl default group
and a gloo group (the reference) over one TCPStore, then runs test bodies on request:
`cluster.run(body, *args)` calls `body(ctx, *args)` on every rank and returns the per-rank
results, or raises with every failing rank's traceback. Bodies are module-level functions
(they are pickled by reference). Nothing waits forever: every call has a deadline, after
which the cluster is killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_seed() -> int:
    """A new seed per test, overridable with RSCCL_TEST_SEED to reproduce a failure."""
    env = os.environ.get("RSCCL_TEST_SEED")
    return int(env) if env else int.from_bytes(os.urandom(4), "little")


def socket_inodes() -> list[str]:
    """The inodes of this process's open sockets (/proc/self/fd), as /proc/net/unix names them."""
    inodes = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.append(link[8:-1])
    return inodes


@dataclass
class Ctx:
    rank: int
    world: int
    gloo: Any  # the gloo reference group over the same ranks
    state: dict  # per-process scratch that survives between bodies

    def gather_rows(self, x: Any) -> Any:
        """Every rank's `x` (same shape on every rank), through the gloo reference group:
        shape (world, x.numel())."""
        import torch
        import torch.distributed as dist

        flat = x.contiguous().view(-1)
        outs = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(outs, flat, group=self.gloo)
        return torch.stack(outs)


def _worker(rank: int, world: int, port: int, conn: Any, env: dict, init_timeout: float, options: Any) -> None:
    os.environ.update(env)
    import rsccl  # noqa: F401 - registers the backend
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60), wait_for_workers=False)
        dist.init_process_group(
            "rsccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=init_timeout), pg_options=options
        )
        ctx = Ctx(rank, world, dist.new_group(backend="gloo"), {})
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    serve(conn, ctx)


def serve(conn: Any, ctx: Any) -> None:
    """A rank's loop: run the bodies the parent sends until it sends None, then leave the
    default group and say goodbye."""
    import torch.distributed as dist

    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args = msg
        try:
            conn.send(("ok", fn(ctx, *args)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    try:
        dist.destroy_process_group()
    finally:
        conn.send(("bye", None))


class ClusterError(AssertionError):
    pass


class Cluster:
    def __init__(
        self,
        world: int,
        env: dict | None = None,
        init_timeout: float = 60.0,
        options: Any = None,
        start_timeout: float = 180.0,
        rank_env: list[dict] | None = None,
        worker: Callable[..., None] | None = None,
        worker_kwargs: dict | None = None,
    ):
        """`worker` replaces the rank's start-up (default: join rsccl and a gloo reference
        group); it takes the same arguments as `_worker`, then `worker_kwargs`."""
        self.world = world
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        self.conns = []
        self.procs = []
        # The store lives here, not in rank 0, so a rank that fails early (on purpose, in
        # the error tests) does not take the others' rendezvous down with it.
        self.store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=60), wait_for_workers=False)
        port = self.store.port
        for r in range(world):
            parent, child = ctx.Pipe()
            penv = {**(env or {}), **(rank_env[r] if rank_env else {})}
            p = ctx.Process(
                target=worker or _worker, args=(r, world, port, child, penv, init_timeout, options), kwargs=worker_kwargs or {}, daemon=True
            )
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self._collect(start_timeout, "start-up")

    def _collect(self, timeout: float, what: str, may_exit: frozenset = frozenset()) -> list[Any]:
        import time

        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * self.world
        errors = []
        for r, c in enumerate(self.conns):
            while not c.poll(0.1):
                if time.monotonic() > deadline:
                    self.kill()
                    raise ClusterError(f"rank {r} did not answer {what} within {timeout} s")
                if not self.procs[r].is_alive() and not c.poll(0):
                    if r not in may_exit:
                        errors.append(f"rank {r} exited with code {self.procs[r].exitcode} during {what}")
                    break
            else:
                try:
                    status, value = c.recv()
                except EOFError:
                    if r not in may_exit:
                        errors.append(f"rank {r} closed its pipe (exit code {self.procs[r].exitcode}) during {what}")
                    continue
                if status == "err":
                    errors.append(f"--- rank {r}: {value}")
                else:
                    results[r] = value
        if errors:
            raise ClusterError(f"{what} failed:\n" + "\n".join(errors))
        return results

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, may_exit: frozenset = frozenset()) -> list[Any]:
        """Run `fn(ctx, *args)` on every rank; return the per-rank results (None for a
        rank in `may_exit` that exited)."""
        for r, c in enumerate(self.conns):
            if self.procs[r].is_alive():
                c.send((fn, args))
        return self._collect(timeout, fn.__name__, may_exit)

    def run_each(self, fn: Callable[..., Any], per_rank_args: list[tuple], timeout: float = 300.0) -> list[Any]:
        """Like run, with different arguments per rank."""
        for c, a in zip(self.conns, per_rank_args):
            c.send((fn, a))
        return self._collect(timeout, fn.__name__)

    def close(self, timeout: float = 60.0) -> list[int | None]:
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout)
        self.kill()
        return [p.exitcode for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
