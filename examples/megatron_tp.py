"""Megatron-style tensor parallelism and FSDP-style sharding with rsccl's symmetric pool.

    python examples/megatron_tp.py [--world 2] [--steps 10]      (needs --world GPUs)

Megatron-LM and Megatron-FSDP take the buffers of their collectives from the
communication library's own memory (NCCL user buffers / symmetric memory, allocated
through a torch.cuda.MemPool), so that a collective moves data between the GPUs' buffers
directly. rsccl offers the same: `rsccl.mem_pool()` is a MemPool over the group's
symmetric pool (`cuda_pool_bytes`, mapped by every local rank when the group is created).
Buffers allocated under `with torch.cuda.use_mem_pool(pool):` in the same order on every
rank sit at the same offset of every rank's pool, and an all_reduce, all-gather,
reduce-scatter or broadcast of at least 1 MiB on them runs in place: no copy through
rsccl's staging buffer.

This example, on one group of --world ranks:
1. a tensor-parallel MLP (Megatron's column-parallel then row-parallel linear): the
   row-parallel output and the input gradient are written by their matmuls straight into
   pool buffers, which are then all-reduced in place;
2. FSDP-style data parallelism: a flat bf16 parameter bucket all-gathered into a pool
   buffer and a flat fp32 gradient bucket reduce-scattered out of one, both allocated
   once and reused every step (as Megatron-FSDP's buckets are);
and prints rsccl.memory_stats()'s in-place and staged counts at the end.
"""

from __future__ import annotations

import argparse
import math
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

TOKENS, DIM, FFN = 4096, 2048, 8192  # activations of 16 MiB in bf16
FLAT = 8 << 20  # elements of the FSDP-style flat parameter (16 MiB bf16, 32 MiB fp32 gradients)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pool_empty(pool: torch.cuda.MemPool, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor in rsccl's symmetric pool."""
    with torch.cuda.use_mem_pool(pool):
        return torch.empty(*shape, dtype=dtype, device="cuda")


class ColumnParallelLinear(torch.autograd.Function):
    """x @ w.T, w split by output rows. x is the same on every rank, so its gradient is
    the all_reduce of every rank's part (Megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, w, pool):
        ctx.save_for_backward(x, w)
        ctx.pool = pool
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        grad_x = pool_empty(ctx.pool, grad_out.shape[0], w.shape[1], dtype=grad_out.dtype)
        torch.matmul(grad_out, w, out=grad_x)  # the matmul writes into the pool buffer,
        dist.all_reduce(grad_x)  # and the all_reduce works on it in place
        return grad_x, grad_out.t() @ x, None


class RowParallelLinear(torch.autograd.Function):
    """all_reduce(h @ w.T), w split by input columns (Megatron's
    reduce_from_tensor_model_parallel_region); its backward needs no collective."""

    @staticmethod
    def forward(ctx, h, w, pool):
        ctx.save_for_backward(h, w)
        y = pool_empty(pool, h.shape[0], w.shape[0], dtype=h.dtype)
        torch.matmul(h, w.t(), out=y)
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        h, w = ctx.saved_tensors
        return grad_y @ w, grad_y.t() @ h, None


def rank_main(rank: int, world: int, port: int, steps: int) -> None:
    import rsccl  # registers the "rsccl" backend

    torch.cuda.set_device(rank)  # before init: the group's CUDA engine and pool go on this GPU
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("rsccl", store=store, rank=rank, world_size=world, pg_options=rsccl.Options(cuda_pool_bytes="512MiB"))
    pool = rsccl.mem_pool()

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    # 1. Tensor parallel. Every rank builds the same full weights, then keeps its part.
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(TOKENS, DIM, device="cuda", generator=g, dtype=torch.bfloat16)
    w1_full = (torch.randn(FFN, DIM, device="cuda", generator=g) / math.sqrt(DIM)).bfloat16()
    w2_full = (torch.randn(DIM, FFN, device="cuda", generator=g) / math.sqrt(FFN)).bfloat16()
    w1 = w1_full.chunk(world, 0)[rank].clone().requires_grad_(True)
    w2 = w2_full.chunk(world, 1)[rank].contiguous().requires_grad_(True)
    for _ in range(steps):
        xx = x.detach().requires_grad_(True)
        y = RowParallelLinear.apply(F.gelu(ColumnParallelLinear.apply(xx, w1, pool)), w2, pool)
        y.float().square().mean().backward()
    ref = F.gelu(x.float() @ w1_full.float().t()) @ w2_full.float().t()  # the unsharded MLP
    err = (y.float() - ref).abs().max().item()
    say(f"  tensor parallel: {steps} forward+backward steps, output vs the unsharded MLP: max |diff| {err:.3f}")
    assert err < 0.1, f"rank {rank}: tensor-parallel output differs from the unsharded MLP by {err}"

    # 2. FSDP style. Each rank owns 1/world of a flat fp32 parameter; the buckets the
    #    collectives use come from the pool, allocated once, in the same order everywhere.
    shard = FLAT // world
    master = torch.randn(shard, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rank))
    ag_bucket = pool_empty(pool, FLAT, dtype=torch.bfloat16)  # all-gather output: every rank's bf16 parameters
    rs_bucket = pool_empty(pool, FLAT, dtype=torch.float32)  # reduce-scatter input: the full gradient
    grad_shard = torch.empty(shard, device="cuda")
    for step in range(steps):
        mine = ag_bucket.narrow(0, rank * shard, shard)
        mine.copy_(master)  # cast this rank's shard into its slot of the bucket,
        dist.all_gather_into_tensor(ag_bucket, mine)  # and gather the others' around it (in place)
        # Forward and backward would use views of ag_bucket and write their gradients into
        # rs_bucket; a stand-in gradient, different on every rank:
        torch.mul(ag_bucket, 1e-3 * (rank + 1), out=rs_bucket)
        if step == 0:
            want = torch.empty_like(ag_bucket)
            dist.all_gather_into_tensor(want, master.bfloat16())  # the same, from regular tensors (staged)
            torch.testing.assert_close(ag_bucket, want, rtol=0, atol=0)
            want = torch.empty_like(grad_shard)
            dist.reduce_scatter_tensor(want, rs_bucket.clone(), op=dist.ReduceOp.AVG)
        dist.reduce_scatter_tensor(grad_shard, rs_bucket, op=dist.ReduceOp.AVG)  # in place
        if step == 0:
            torch.testing.assert_close(grad_shard, want)
        master.sub_(grad_shard, alpha=0.1)
    say(f"  FSDP style: {steps} steps of all-gather ({FLAT * 2 >> 20} MiB) and reduce-scatter ({FLAT * 4 >> 20} MiB) on pool buckets")

    s = rsccl.memory_stats()  # this rank's figures for the world group
    say(
        f"  rank 0: {s['cuda_inplace_collectives']} collectives in place ({s['cuda_inplace_bytes'] >> 20} MiB), "
        f"{s['cuda_staged_collectives']} staged (among them the checks on regular tensors); "
        f"pool {s['cuda_pool_bytes'] >> 20} MiB, at most {s['cuda_pool_peak_bytes'] >> 20} MiB of it handed to torch"
    )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="local ranks, one GPU each")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    if torch.cuda.device_count() < args.world:
        sys.exit(f"--world {args.world} needs {args.world} GPUs, {torch.cuda.device_count()} visible")
    print(f"Megatron-style tensor parallelism and FSDP-style buckets over rsccl's pool: {args.world} ranks", flush=True)
    mp.spawn(rank_main, args=(args.world, free_port(), args.steps), nprocs=args.world)


if __name__ == "__main__":
    main()
