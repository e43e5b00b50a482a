"""A quick end-to-end check of rsccl's pool (rsccl.mem_pool) on the GPUs of this machine:
in-place collectives against NCCL on random data, the staged fallback when offsets differ,
the memory_stats counters, and in-place vs staged timings. Prints a table; exits non-zero
on any wrong result.

    python3 scripts/gpu_pool_smoke.py [WORLD]      (SEED=... to replay)
"""

import os
import sys
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

MiB = 1 << 20


def rank_main(rank, world, port, q):
    import rsccl
    import torch
    import torch.distributed as dist
    from rsccl.bench.common import event_us

    try:
        torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        opts = rsccl.Options(cuda_pool_bytes="2GiB", max_cuda_va_bytes="32GiB")
        dist.init_process_group("rsccl", store=store, rank=rank, world_size=world, pg_options=opts)
        nccl = dist.new_group(backend="nccl")
        seed = int(os.environ.get("SEED", "4321"))
        if rank == 0:
            print(f"seed {seed}", flush=True)
        g = torch.Generator(device="cuda").manual_seed(seed + rank)
        pool = rsccl.mem_pool()
        errors = []
        stats = rsccl.memory_stats
        free0 = torch.cuda.mem_get_info()[0]

        def check(name, got, ref, exact):
            ok = (
                torch.equal(got, ref)
                if exact
                else torch.allclose(got.double(), ref.double(), rtol=2e-2, atol=1e-2 * max(ref.double().abs().max().item(), 1.0))
            )
            if not ok:
                d = (got.double() - ref.double()).abs()
                errors.append(f"rank {rank} {name}: max err {d.max().item():.3g} at {d.argmax().item()} of {got.numel()}")

        def rnd(n, dt):
            if dt.is_floating_point:
                return (torch.randn(n, device="cuda", generator=g) * 4).to(dt)
            return torch.randint(-100, 100, (n,), device="cuda", generator=g, dtype=dt)

        def in_pool(n, dt):
            with torch.cuda.use_mem_pool(pool):
                return torch.empty(n, dtype=dt, device="cuda")

        def run_all(n, dt, op, where, label, expect_inplace):
            """all_reduce, all_gather, reduce_scatter, broadcast with pool buffers."""
            s0 = stats()
            x = rnd(n, dt)
            a = where(n, dt)
            a.copy_(x)
            ref = x.clone()
            dist.all_reduce(a, op=op)
            dist.all_reduce(ref, op=op, group=nccl)
            check(
                f"{label} all_reduce {dt} {op} n={n}",
                a,
                ref,
                exact=not dt.is_floating_point or op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN),
            )
            # all_gather: output in the pool, input = this rank's slot of it (FSDP's layout)
            out = where(n * world, dt)
            out.narrow(0, rank * n, n).copy_(x)
            ref = torch.empty(n * world, dtype=dt, device="cuda")
            dist.all_gather_into_tensor(out, out.narrow(0, rank * n, n))
            dist.all_gather_into_tensor(ref, x, group=nccl)
            check(f"{label} all_gather {dt} n={n}", out, ref, exact=True)
            # reduce_scatter: input in the pool
            big = rnd(n * world, dt)
            inp = where(n * world, dt)
            inp.copy_(big)
            o = torch.empty(n, dtype=dt, device="cuda")
            r = torch.empty(n, dtype=dt, device="cuda")
            dist.reduce_scatter_tensor(o, inp, op=op)
            dist.reduce_scatter_tensor(r, big, op=op, group=nccl)
            check(
                f"{label} reduce_scatter {dt} {op} n={n}",
                o,
                r,
                exact=not dt.is_floating_point or op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN),
            )
            # broadcast from the last rank
            b = where(n, dt)
            b.copy_(x)
            rb = x.clone()
            dist.broadcast(b, src=world - 1)
            dist.broadcast(rb, src=world - 1, group=nccl)
            check(f"{label} broadcast {dt} n={n}", b, rb, exact=True)
            s1 = stats()
            dn = s1["cuda_inplace_collectives"] - s0["cuda_inplace_collectives"]
            ds = s1["cuda_staged_collectives"] - s0["cuda_staged_collectives"]
            if dn != expect_inplace or dn + ds != 4:
                errors.append(f"rank {rank} {label} {dt} n={n}: {dn} in place, {ds} staged; expected {expect_inplace} in place of 4")
            del a, out, inp, b

        two_shot_min = 2 * MiB if world <= 2 else 512 * 1024
        for dt in [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64]:
            ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN] + ([dist.ReduceOp.AVG] if dt.is_floating_point else [])
            for op in ops:
                for n in [(4 * MiB) // dt.itemsize, (3 * MiB) // dt.itemsize + 7, 1000]:
                    nbytes = n * dt.itemsize
                    # in place: all_reduce two-shot and >= 1 MiB; all_gather output and
                    # reduce_scatter input (world x n) >= 1 MiB; broadcast >= 1 MiB.
                    expect = int(nbytes >= MiB and nbytes > two_shot_min) + 2 * int(nbytes * world >= MiB) + int(nbytes >= MiB)
                    run_all(n, dt, op, in_pool, "pool", expect)

        # Unequal offsets: rank r's buffer starts r x 4 KiB into a pool block -> staged.
        def shifted(n, dt):
            k = 4096 // dt.itemsize
            return in_pool(n + world * k, dt)[rank * k : rank * k + n]

        run_all((8 * MiB) // 4, torch.float32, dist.ReduceOp.SUM, shifted, "unequal", 0)
        # Pool on some ranks only.
        mixed = in_pool if rank % 2 == 0 else (lambda n, dt: torch.empty(n, dtype=dt, device="cuda"))
        run_all((8 * MiB) // 4, torch.float32, dist.ReduceOp.SUM, mixed, "mixed", 0)
        torch.cuda.synchronize()
        free1 = torch.cuda.mem_get_info()[0]

        # Timings: in place (pool) vs staged (regular memory), bf16.
        def timeit(fn, iters):
            for _ in range(3):
                fn()
            return event_us(fn, iters, dist.barrier)

        rows = []
        for nbytes in [4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]:
            n = nbytes // 2
            iters = 50 if nbytes <= 16 * MiB else 10
            dt = torch.bfloat16
            for coll in ["all_reduce", "all_gather", "reduce_scatter"]:
                res = {}
                for label, alloc in [("pool", in_pool), ("staged", lambda k, d: torch.empty(k, dtype=d, device="cuda")), ("nccl", None)]:
                    grp = nccl if label == "nccl" else None
                    mk = alloc or (lambda k, d: torch.empty(k, dtype=d, device="cuda"))
                    if coll == "all_reduce":
                        t = mk(n, dt).normal_()
                        fn = lambda t=t, grp=grp: dist.all_reduce(t, group=grp)
                    elif coll == "all_gather":
                        o = mk(n, dt)
                        i = o.narrow(0, rank * (n // world), n // world)
                        fn = lambda o=o, i=i, grp=grp: dist.all_gather_into_tensor(o, i, group=grp)
                    else:
                        i = mk(n, dt).normal_()
                        o = torch.empty(n // world, dtype=dt, device="cuda")
                        fn = lambda o=o, i=i, grp=grp: dist.reduce_scatter_tensor(o, i, group=grp)
                    res[label] = timeit(fn, iters)
                    del fn
                rows.append((coll, nbytes, res["pool"], res["staged"], res["nccl"]))
        q.put((rank, errors, rows, stats(), free0 - free1))
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, [f"rank {rank}: {traceback.format_exc()}"], [], {}, 0))


def main():
    import torch.multiprocessing as mp

    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    port = 29700 + world
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world):
        rank, errors, rows, st, grown = q.get(timeout=900)
        results[rank] = (errors, rows, st, grown)
    for p in procs:
        p.join(timeout=60)
    bad = [e for r in sorted(results) for e in results[r][0]]
    print(f"## pool smoke, world {world}")
    print("| collective | MiB | in place us | staged us | nccl us | in place / staged | in place / nccl |")
    print("|---|---|---|---|---|---|---|")
    for coll, nbytes, p, s, n in results[0][1]:
        print(f"| {coll} | {nbytes // MiB} | {p:.1f} | {s:.1f} | {n:.1f} | {s / p:.2f}x | {n / p:.2f}x |")
    print("rank 0 memory_stats:", {k: v for k, v in results[0][2].items() if k.startswith("cuda")})
    print("device memory taken by pool use (free before - after), per rank:", [results[r][3] for r in sorted(results)])
    for e in bad[:40]:
        print("ERROR", e)
    print("pool smoke", "FAILED" if bad else "passed", f"({len(bad)} errors)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
