"""Soak: many mixed collectives on CPU tensors, each result checked against a float64 (or
exact integer) reference, then many new_group/destroy cycles, watching every rank's RSS,
open descriptors and threads, and what is left in /dev/shm and among abstract Unix
sockets afterwards. Not in CI (minutes to hours); figures in docs/errors.md.

    python scripts/soak_errors.py --world 4 --calls 100000 --groups 300

Prints one line per report interval and a summary; exits non-zero on a wrong result, a
leak past the slack below, or anything left behind.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import sys
import time
from datetime import timedelta


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rank(rank: int, world: int, port: int, calls: int, groups: int, every: int, q) -> None:
    import rsccl  # noqa: F401
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=120), wait_for_workers=False)
    dist.init_process_group("rsccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    g = torch.Generator().manual_seed(1234)  # the same stream on every rank: each rank derives every rank's input
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
    ops = {"SUM": dist.ReduceOp.SUM, "MAX": dist.ReduceOp.MAX, "MIN": dist.ReduceOp.MIN, "PRODUCT": dist.ReduceOp.PRODUCT}

    def inputs(n: int, dt: torch.dtype, salt: int) -> list[torch.Tensor]:
        base = torch.randint(-3, 4, (world, n), generator=g) if not dt.is_floating_point else torch.randn(world, n, generator=g)
        if dt == torch.uint8:
            base = base.abs()
        return [(base[r] + salt).to(dt) for r in range(world)]

    start = time.monotonic()
    base = None
    for i in range(calls):
        kind = i % 7
        n = int(torch.randint(1, 5000, (1,), generator=g))
        if kind == 0:
            dt = dtypes[int(torch.randint(0, len(dtypes), (1,), generator=g))]
            name = list(ops)[int(torch.randint(0, len(ops), (1,), generator=g))]
            if name == "PRODUCT":
                n = min(n, 8)
            xs = inputs(n, dt, 0)
            x = xs[rank].clone()
            dist.all_reduce(x, op=ops[name])
            wide = torch.stack([t.double() for t in xs])
            ref = {"SUM": wide.sum(0), "MAX": wide.max(0).values, "MIN": wide.min(0).values, "PRODUCT": wide.prod(0)}[name]
            tol = 0.0 if not dt.is_floating_point else (1e-5 if dt != torch.bfloat16 else 5e-2) * world * 8
            if dt.is_floating_point:
                ok = torch.allclose(x.double(), ref.to(dt).double(), rtol=tol, atol=tol)
            else:
                ok = torch.equal(x, ref.to(dt))
        elif kind == 1:
            xs = inputs(n, torch.float32, 1)
            out = torch.empty(world * n)
            dist.all_gather_into_tensor(out, xs[rank])
            ok = torch.equal(out, torch.cat(xs))
        elif kind == 2:
            xs = inputs(world * n, torch.float64, 2)
            out = torch.empty(n, dtype=torch.float64)
            dist.reduce_scatter_tensor(out, xs[rank])
            ok = torch.allclose(out, torch.stack(xs).sum(0)[rank * n : (rank + 1) * n])
        elif kind == 3:
            root = i % world
            xs = inputs(n, torch.int64, 3)
            x = xs[rank].clone()
            dist.broadcast(x, src=root)
            ok = torch.equal(x, xs[root])
        elif kind == 4:
            xs = inputs(n, torch.float32, 4)
            out = torch.empty(n)
            nxt, prv = (rank + 1) % world, (rank - 1) % world
            ws = [dist.isend(xs[rank], nxt, tag=i % 1000), dist.irecv(out, prv, tag=i % 1000)]
            for w in ws:
                w.wait()
            ok = torch.equal(out, xs[prv])
        elif kind == 5:
            xs = [inputs(n, torch.float32, 5 + k) for k in range(3)]
            bufs = [x[rank].clone() for x in xs]
            works = [dist.all_reduce(b, async_op=True) for b in bufs]
            for w in works:
                w.wait()
            ok = all(
                torch.allclose(b.double(), torch.stack([t.double() for t in x]).sum(0), rtol=1e-5, atol=1e-4) for b, x in zip(bufs, xs)
            )
        else:
            xs = inputs(world * 4, torch.int32, 6)
            out = torch.empty(world * 4, dtype=torch.int32)
            dist.all_to_all_single(out, xs[rank])
            ok = torch.equal(out, torch.cat([xs[s][rank * 4 : (rank + 1) * 4] for s in range(world)]))
        if not ok:
            q.put(("wrong", rank, i, kind))
            return
        if i == min(2000, calls // 10):
            base = (_rss_kib(), _fds(), _threads())
        if (i + 1) % every == 0:
            q.put(("at", rank, i + 1, _rss_kib(), _fds(), _threads(), time.monotonic() - start))
    for k in range(groups):
        pg = dist.new_group(list(range(world)), backend="rsccl")
        x = torch.full((17,), float(k + rank))
        dist.all_reduce(x, group=pg)
        if not torch.equal(x, torch.full((17,), float(world * k + world * (world - 1) / 2))):
            q.put(("wrong", rank, calls + k, "new_group"))
            return
        dist.destroy_process_group(pg)
    end = (_rss_kib(), _fds(), _threads())
    dist.destroy_process_group()
    q.put(("done", rank, base, end, time.monotonic() - start, _own_rsccl_sockets()))


def _own_rsccl_sockets() -> list[str]:
    """Names of this process's Unix sockets on rsccl's abstract names (/proc/net/unix lists
    every process's: other jobs on the machine must not count)."""
    from harness import socket_inodes  # tests/, on the path main() sets (spawned ranks inherit it)

    inodes = set(socket_inodes())
    with open("/proc/net/unix") as f:
        return [ln.split()[-1] for ln in f if "@rsccl-" in ln and ln.split()[6] in inodes]


def _leftovers() -> list[str]:
    return [f for f in os.listdir("/dev/shm") if "rsccl" in f]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--groups", type=int, default=300)
    ap.add_argument("--every", type=int, default=10_000)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = dist.TCPStore("127.0.0.1", 0, args.world, True, timeout=timedelta(seconds=120), wait_for_workers=False)
    procs = [
        ctx.Process(target=_rank, args=(r, args.world, server.port, args.calls, args.groups, args.every, q)) for r in range(args.world)
    ]
    for p in procs:
        p.start()
    done, failed = {}, False
    while len(done) < args.world:
        m = q.get(timeout=3600)
        if m[0] == "wrong":
            print(f"WRONG RESULT: rank {m[1]} call {m[2]} ({m[3]})", flush=True)
            failed = True
            break
        if m[0] == "at":
            _, r, i, rss, fds, thr, t = m
            print(f"rank {r}: {i} calls, RSS {rss / 1024:.0f} MiB, {fds} fds, {thr} threads, {t:.0f} s", flush=True)
        else:
            done[m[1]] = m
    for p in procs:
        p.join(120)
    shm = _leftovers()
    socks = [n for m in done.values() for n in m[5]]
    for r, (_, _, base, end, t, _) in sorted(done.items()):
        print(
            f"rank {r}: after warm-up RSS {base[0] / 1024:.0f} MiB, {base[1]} fds, {base[2]} threads; at the end "
            f"RSS {end[0] / 1024:.0f} MiB, {end[1]} fds, {end[2]} threads; {t:.0f} s"
        )
        # Slack: rsccl's completion threads start on demand (up to 4), torch's allocator
        # keeps some memory cached.
        if end[1] > base[1] or end[2] > base[2] + 4 or end[0] > base[0] + 64 * 1024:
            print(f"rank {r}: LEAK (over 64 MiB more RSS, more fds, or over 4 more threads)")
            failed = True
    print(
        f"rsccl entries in /dev/shm: {shm or 'none'}; rsccl sockets a rank held after destroying its groups: "
        f"{socks or 'none'}; exit codes {[p.exitcode for p in procs]}"
    )
    failed |= bool(shm or socks) or any(p.exitcode != 0 for p in procs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
