"""FSDP2 whose all-gather outputs live in rsccl's symmetric pool.

    python examples/fsdp2_pool.py [--world 2] [--steps 20]      (needs --world GPUs)

Two settings, nothing else changes in the training code:

1. The group has a pool: `cuda_pool_bytes` (rsccl.Options field, or the environment
   variable RSCCL_CUDA_POOL_BYTES). It is allocated at init_process_group and mapped by
   every local rank, next to rsccl's staging buffer. Size it for the all-gather outputs
   alive at once (with FSDP2: the root's and about two layers' in the parameter dtype),
   with room to spare: torch's caching allocator keeps the blocks it took from a pool, per
   stream. A pool that runs out makes rsccl fall back to torch's allocator (with a
   warning), not fail.

2. FSDP2 takes its all-gather outputs from the group: `rsccl.fsdp.use_pool(model)` after
   fully_shard (a custom all-gather on every FSDP module). The reduce-scatter buffers stay
   in torch's allocator, as under NCCL, where their memory is shared with the activations;
   `use_pool(model, comms="both")` puts them in the pool too (docs/memory.md, "FSDP2").

Every rank then allocates the same buffers in the same order, so they sit at the same
offset of every rank's pool, and each all-gather writes the other GPUs' outputs directly
instead of copying through rsccl's staging buffer. The end of the run prints how many
collectives did (`rsccl.memory_stats()["cuda_inplace_collectives"]`).
"""

from __future__ import annotations

import argparse
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model(d: int = 1024, layers: int = 4) -> nn.Module:
    blocks = [nn.TransformerEncoderLayer(d, nhead=8, dim_feedforward=4 * d, batch_first=True) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(d, d))


def rank_main(rank: int, world: int, port: int, steps: int) -> None:
    import rsccl  # registers the "rsccl" backend
    import rsccl.fsdp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.cuda.set_device(rank)  # before init: the group's CUDA engine and pool go on this GPU
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "rsccl",
        store=store,
        rank=rank,
        world_size=world,
        pg_options=rsccl.Options(cuda_pool_bytes="1GiB"),  # setting 1
    )
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")

    torch.manual_seed(0)  # the same initial weights on every rank
    net = model().cuda()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in list(net)[:-1]:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    rsccl.fsdp.use_pool(net)  # setting 2

    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    g = torch.Generator(device="cuda").manual_seed(rank)  # each rank its own data
    for step in range(steps):
        x = torch.randn(8, 256, 1024, device="cuda", generator=g)
        loss = F.mse_loss(net(x).float(), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step % 5 == 0 or step == steps - 1):
            print(f"  step {step:3d}  loss {loss.item():.4f}", flush=True)

    s = rsccl.memory_stats()
    if rank == 0:
        print(
            f"  rank 0: {s['cuda_inplace_collectives']} collectives in place ({s['cuda_inplace_bytes'] >> 20} MiB), "
            f"{s['cuda_staged_collectives']} staged; pool {s['cuda_pool_bytes'] >> 20} MiB, "
            f"at most {s['cuda_pool_peak_bytes'] >> 20} MiB of it handed to torch",
            flush=True,
        )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="local ranks, one GPU each")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    if torch.cuda.device_count() < args.world:
        sys.exit(f"--world {args.world} needs {args.world} GPUs, {torch.cuda.device_count()} visible")
    print(f"FSDP2 over rsccl with the symmetric pool: {args.world} ranks, {args.steps} steps", flush=True)
    mp.spawn(rank_main, args=(args.world, free_port(), args.steps), nprocs=args.world)


if __name__ == "__main__":
    main()
