"""A quick end-to-end check of rsccl's CUDA engine on the GPUs of this machine: every
CUDA collective against NCCL on random data, a few sizes, sync and async, a CUDA graph,
and a small latency/bandwidth table. Used as the first step of scripts/gpu_suite.sh.

    python3 scripts/gpu_smoke.py [WORLD]
"""

import os
import sys
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def rank_main(rank, world, port, q):
    import rsccl
    import torch
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.time()
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        dist.init_process_group("rsccl", store=store, rank=rank, world_size=world)
        t_init = time.time() - t0
        torch.cuda.synchronize()
        free1 = torch.cuda.mem_get_info()[0]
        nccl = dist.new_group(backend="nccl")
        seed = int(os.environ.get("SEED", "1234"))
        g = torch.Generator(device="cuda").manual_seed(seed + rank)
        errors = []

        def check(name, got, ref, exact=False):
            ok = (
                torch.equal(got, ref)
                if exact
                else torch.allclose(got.double(), ref.double(), rtol=2e-2, atol=1e-2 * max(ref.double().abs().max().item(), 1.0))
            )
            if not ok:
                d = (got.double() - ref.double()).abs()
                errors.append(f"{name}: max err {d.max().item():.3g} at {d.argmax().item()} of {got.numel()}")

        rnd = lambda n, dt: (
            (torch.randn(n, device="cuda", generator=g) * 4).to(dt)
            if dt.is_floating_point
            else torch.randint(-100, 100, (n,), device="cuda", generator=g, dtype=dt)
        )
        sizes = [1, 7, 1000, 4099, 65536 + 3, 1 << 20, (8 << 20) + 5]
        for dt in [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64]:
            for op in [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT, dist.ReduceOp.AVG]:
                if op == dist.ReduceOp.AVG and not dt.is_floating_point:
                    continue
                for n in sizes if op == dist.ReduceOp.SUM else sizes[:4]:
                    x = rnd(n, dt)
                    if op == dist.ReduceOp.PRODUCT:
                        x = (
                            (1 + 0.01 * torch.randn(n, device="cuda", generator=g)).to(dt)
                            if dt.is_floating_point
                            else torch.randint(-2, 3, (n,), device="cuda", generator=g, dtype=dt)
                        )
                    a, b = x.clone(), x.clone()
                    dist.all_reduce(a, op=op)
                    dist.all_reduce(b, op=op, group=nccl)
                    check(f"all_reduce {dt} {op} n={n}", a, b, exact=not dt.is_floating_point)
                    if n % world == 0 or True:
                        m = max(n // world, 1)
                        inp = (
                            rnd(m * world, dt)
                            if op != dist.ReduceOp.PRODUCT
                            else x[: m * world].clone()
                            if n >= m * world
                            else rnd(m * world, dt)
                        )
                        o1 = torch.empty(m, device="cuda", dtype=dt)
                        o2 = torch.empty(m, device="cuda", dtype=dt)
                        dist.reduce_scatter_tensor(o1, inp, op=op)
                        dist.reduce_scatter_tensor(o2, inp, op=op, group=nccl)
                        check(f"reduce_scatter {dt} {op} m={m}", o1, o2, exact=not dt.is_floating_point)
        for n in [1, 13, 4096, 100003, 3 << 20]:
            x = rnd(n, torch.bfloat16)
            o1 = torch.empty(n * world, device="cuda", dtype=x.dtype)
            o2 = torch.empty_like(o1)
            dist.all_gather_into_tensor(o1, x)
            dist.all_gather_into_tensor(o2, x, group=nccl)
            check(f"all_gather n={n}", o1, o2, exact=True)
            for root in range(world):
                a = x.clone()
                b = x.clone()
                dist.broadcast(a, root)
                dist.broadcast(b, root, group=nccl)
                check(f"broadcast n={n} root={root}", a, b, exact=True)
        # async + wait on a side stream
        x = rnd(1 << 20, torch.float32)
        ref = x.clone()
        dist.all_reduce(ref, group=nccl)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            w = dist.all_reduce(x, async_op=True)
        w.wait()
        check("async all_reduce", x, ref)
        # graph capture
        static = torch.zeros(4096, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            dist.all_reduce(static)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dist.all_reduce(static)
        for i in range(20):
            x = rnd(4096, torch.float32)
            static.copy_(x)
            graph.replay()
            ref = x.clone()
            dist.all_reduce(ref, group=nccl)
            check(f"graph replay {i}", static, ref)
        dist.barrier()
        torch.cuda.synchronize()
        # timing
        rows = []
        for nbytes in [1024, 65536, 262144, 1 << 20, 16 << 20, 64 << 20, 256 << 20]:
            x = torch.randn(nbytes // 2, device="cuda").bfloat16()
            res = {}
            for name, grp in (("rsccl", None), ("nccl", nccl)):
                iters = 50 if nbytes <= (1 << 20) else 10
                for _ in range(5):
                    dist.all_reduce(x, group=grp)
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(iters):
                    dist.all_reduce(x, group=grp)
                e1.record()
                torch.cuda.synchronize()
                res[name] = e0.elapsed_time(e1) * 1000 / iters
            rows.append((nbytes, res["rsccl"], res["nccl"]))
        torch.cuda.synchronize()
        q.put((rank, errors, t_init, (free0 - free1) >> 20, rows, dict(rsccl.memory_stats())))
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, [traceback.format_exc()], 0, 0, [], {}))


def main():
    import multiprocessing as mp
    import socket

    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, world, port, q)) for r in range(world)]
    for p in ps:
        p.start()
    results = []
    deadline = time.time() + 240
    while len(results) < world and time.time() < deadline:
        try:
            results.append(q.get(timeout=5))
        except Exception:
            if not any(p.is_alive() for p in ps):
                break
    for p in ps:
        p.join(10)
        if p.is_alive():
            p.kill()
    ok = len(results) == world
    for rank, errors, t_init, mem, rows, stats in sorted(results, key=lambda r: r[0]):
        print(f"rank {rank}: init {t_init:.2f}s, device memory added by init {mem} MiB, stats {stats}")
        for e in errors[:15]:
            print("  ERROR", e)
        ok = ok and not errors
        if rank == 0:
            for nbytes, r, n in rows:
                bw = lambda t: 2 * (world - 1) / world * nbytes / (t * 1e-6) / 1e9
                print(f"  AR bf16 {nbytes:>10} B: rsccl {r:8.1f} us ({bw(r):6.1f} GB/s)  nccl {n:8.1f} us ({bw(n):6.1f} GB/s)")
    print(f"SMOKE world={world}: {'PASS' if ok else 'FAIL'} ({len(results)}/{world} ranks reported)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
