"""Start a few local ranks and run collectives over rsccl, checked against gloo.

    python examples/quickstart.py [--world-size 4]

Each rank joins two groups over the same TCP store: the default group on backend
"rsccl", and a gloo group for reference. Every result is compared with gloo's. On a
machine with at least as many GPUs as ranks (default there: one rank per GPU), the
collectives run again on CUDA tensors and are compared with gloo on CPU copies.
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


def rank_main(rank: int, world: int, port: int, seed: int, use_cuda: bool) -> None:
    import rsccl  # registers "rsccl" (torch >= 2.15 finds it without the import, by its entry point)

    if use_cuda:
        torch.cuda.set_device(rank)  # one rank per GPU, set before the group is made
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("rsccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    gloo = dist.new_group(backend="gloo")
    for device in ["cpu", "cuda"] if use_cuda else ["cpu"]:
        if rank == 0:
            print(f" on {device} tensors" + (" (one rank per GPU)" if device == "cuda" else ""), flush=True)
        run_checks(rank, world, seed, device, gloo)
    if rank == 0:
        stats = rsccl.memory_stats()
        print(f"  memory: {stats['host_region_bytes'] >> 20} MiB shared region, {stats['collectives']} collectives", flush=True)
    dist.destroy_process_group()


def run_checks(rank: int, world: int, seed: int, device: str, gloo: dist.ProcessGroup) -> None:
    """Each collective on rsccl with tensors on `device`, against gloo on CPU copies."""
    g = torch.Generator().manual_seed(seed * 100 + rank)

    def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
        ok = torch.allclose(ours.cpu(), ref, rtol=1e-5, atol=1e-5)
        if rank == 0:
            print(f"  {name:<28} {'ok' if ok else 'MISMATCH'}  {tuple(ours.shape)}", flush=True)
        if not ok:
            raise SystemExit(f"rank {rank}: {name} on {device} differs from gloo (seed {seed})")

    x = torch.randn(1 << 16, generator=g)
    a, b = x.to(device, copy=True), x.clone()
    dist.all_reduce(a)
    dist.all_reduce(b, group=gloo)
    check("all_reduce (sum, 256 KiB)", a, b)

    inp = torch.randn(1000, generator=g)
    out, ref = torch.empty(world * 1000, device=device), torch.empty(world * 1000)
    dist.all_gather_into_tensor(out, inp.to(device, copy=True))
    dist.all_gather_into_tensor(ref, inp, group=gloo)
    check("all_gather_into_tensor", out, ref)

    big = torch.randn(world * 4096, generator=g)
    o1, o2 = torch.empty(4096, device=device), torch.empty(4096)
    dist.reduce_scatter_tensor(o1, big.to(device, copy=True), op=dist.ReduceOp.MAX)
    dist.reduce_scatter_tensor(o2, big, op=dist.ReduceOp.MAX, group=gloo)
    check("reduce_scatter_tensor (max)", o1, o2)

    t = torch.randn(777, generator=g)
    t1, t2 = t.to(device, copy=True), t.clone()
    dist.broadcast(t1, src=world - 1)
    dist.broadcast(t2, src=world - 1, group=gloo)
    check("broadcast", t1, t2)

    y = x.to(device, copy=True)
    w = dist.all_reduce(y, async_op=True)
    w.wait()
    check("all_reduce (async)", y, b)


def main() -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=gpus if gpus >= 2 else 4, help="default: one rank per GPU, or 4 without GPUs")
    p.add_argument("--cpu-only", action="store_true", help="skip the CUDA-tensor checks on a machine with GPUs")
    p.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(2), "little"))
    args = p.parse_args()
    use_cuda = not args.cpu_only and gpus >= args.world_size
    print(f"rsccl quickstart: {args.world_size} local ranks, seed {args.seed}", flush=True)
    if not args.cpu_only and 0 < gpus < args.world_size:
        print(f" (CUDA tensors skipped: {gpus} GPU(s) for {args.world_size} ranks; the CUDA checks run one rank per GPU)", flush=True)
    mp.spawn(rank_main, args=(args.world_size, free_port(), args.seed, use_cuda), nprocs=args.world_size)
    print("all collectives matched gloo" + (" on CPU and CUDA tensors" if use_cuda else " (CPU tensors)"), flush=True)


if __name__ == "__main__":
    sys.exit(main())
