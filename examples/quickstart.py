"""Start a few local ranks and run collectives over rsccl, checked against gloo.

    python examples/quickstart.py [--world-size 4]

Each rank joins two groups over the same TCP store: the default group on backend
"rsccl", and a gloo group for reference. Every result is compared with gloo's.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, seed: int) -> None:
    import rsccl  # registers the "rsccl" backend

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("rsccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    gloo = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(seed * 100 + rank)

    def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
        ok = torch.allclose(ours, ref, rtol=1e-5, atol=1e-5)
        if rank == 0:
            print(f"  {name:<28} {'ok' if ok else 'MISMATCH'}  {tuple(ours.shape)}", flush=True)
        if not ok:
            raise SystemExit(f"rank {rank}: {name} differs from gloo (seed {seed})")

    x = torch.randn(1 << 16, generator=g)
    a, b = x.clone(), x.clone()
    dist.all_reduce(a)
    dist.all_reduce(b, group=gloo)
    check("all_reduce (sum, 256 KiB)", a, b)

    out, ref = torch.empty(world * 1000), torch.empty(world * 1000)
    inp = torch.randn(1000, generator=g)
    dist.all_gather_into_tensor(out, inp)
    dist.all_gather_into_tensor(ref, inp, group=gloo)
    check("all_gather_into_tensor", out, ref)

    big = torch.randn(world * 4096, generator=g)
    o1, o2 = torch.empty(4096), torch.empty(4096)
    dist.reduce_scatter_tensor(o1, big, op=dist.ReduceOp.MAX)
    dist.reduce_scatter_tensor(o2, big, op=dist.ReduceOp.MAX, group=gloo)
    check("reduce_scatter_tensor (max)", o1, o2)

    t1 = torch.randn(777, generator=g)
    t2 = t1.clone()
    dist.broadcast(t1, src=world - 1)
    dist.broadcast(t2, src=world - 1, group=gloo)
    check("broadcast", t1, t2)

    w = dist.all_reduce(x, async_op=True)
    w.wait()
    if rank == 0:
        stats = rsccl.memory_stats()
        print(f"  memory: {stats['host_region_bytes'] >> 20} MiB shared region, {stats['collectives']} collectives", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(2), "little"))
    args = p.parse_args()
    print(f"rsccl quickstart: {args.world_size} local ranks, seed {args.seed}", flush=True)
    mp.spawn(rank_main, args=(args.world_size, free_port(), args.seed), nprocs=args.world_size)
    print("all collectives matched gloo", flush=True)


if __name__ == "__main__":
    sys.exit(main())
