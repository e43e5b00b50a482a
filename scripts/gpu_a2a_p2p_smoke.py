"""A quick check of rsccl's CUDA all_to_all and send/recv kernels through the group's
bindings (below the Python ProcessGroup methods): random uneven splits against NCCL's
all_to_all_single, a send/recv ring with async calls on both directions at once, sizes
from 0 bytes to 256 MiB, a split mismatch that every rank must report, and rough timings.
Exits non-zero on any wrong result.

    python3 scripts/gpu_a2a_p2p_smoke.py [WORLD]      (SEED=... to replay)

P2P_SWEEP="cuda_p2p_blocks=16,cuda_p2p_bytes=16MiB;..." also times send/recv 0 -> 1 in a
new group per setting (16 and 256 MiB).
"""

import os
import sys
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

MiB = 1 << 20


def rank_main(rank, world, port, q):
    import torch
    import torch.distributed as dist
    from rsccl import _rsccl_pg
    from rsccl.bench.common import event_us

    errors = []
    try:
        torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        dist.init_process_group("rsccl", store=store, rank=rank, world_size=world)
        nccl = dist.new_group(backend="nccl")
        pg = _rsccl_pg(None)
        comm = pg._comm
        from rsccl._ops import ALL_TO_ALL, RECV, SEND, SUM, UINT8

        def cuda_all_to_all(send_ptrs, send_bytes, recv_ptrs, recv_bytes, stream, asynchronous):
            splits = (send_ptrs, send_bytes, recv_ptrs, recv_bytes)
            return comm.run(ALL_TO_ALL, 0, 0, 0, 0, UINT8, SUM, 0, stream, not asynchronous, splits)

        def cuda_p2p(send, ptr, nbytes, peer, stream, asynchronous):
            return comm.run(SEND if send else RECV, ptr, nbytes, ptr, nbytes, UINT8, SUM, peer, stream, not asynchronous)

        seed = int(os.environ.get("SEED", "1234"))
        if rank == 0:
            print(f"seed {seed}", flush=True)
        g = torch.Generator().manual_seed(seed)  # same on every rank: splits agree
        gl = torch.Generator(device="cuda").manual_seed(seed + rank)
        stream = lambda: torch.cuda.current_stream().cuda_stream

        def a2a(inp, out, send_rows, recv_rows, asynchronous=False):
            row = inp[0].numel() * inp.element_size() if inp.dim() > 1 else inp.element_size()
            so = [0]
            for s in send_rows[:-1]:
                so.append(so[-1] + s)
            ro = [0]
            for s in recv_rows[:-1]:
                ro.append(ro[-1] + s)
            ev = cuda_all_to_all(
                [inp.data_ptr() + o * row for o in so],
                [s * row for s in send_rows],
                [out.data_ptr() + o * row for o in ro],
                [s * row for s in recv_rows],
                stream(),
                asynchronous,
            )
            return ev

        # 1. all_to_all_single, uneven, vs NCCL
        for total_rows, dt, zeros in [
            (1, torch.float32, True),
            (4096, torch.bfloat16, True),
            (1 << 20, torch.float32, False),
            (123457, torch.int64, True),
            (16 << 20, torch.bfloat16, False),
            (64 << 20, torch.uint8, False),
        ]:
            # splits[i][j]: rows rank i sends to rank j
            splits = torch.randint(0, max(1, 2 * total_rows // (world * world)) + 1, (world, world), generator=g)
            if zeros:
                splits[0, world - 1] = 0
            send = splits[rank].tolist()
            recv = splits[:, rank].tolist()
            x = (
                torch.randint(-1000, 1000, (sum(send),), generator=None, device="cuda").to(dt)
                if not dt.is_floating_point
                else torch.randn(sum(send), device="cuda", generator=gl).to(dt)
            )
            out = torch.full((sum(recv),), 7, device="cuda").to(dt)
            ref = torch.empty_like(out)
            a2a(x, out, send, recv)
            dist.all_to_all_single(ref, x, recv, send, group=nccl)
            torch.cuda.synchronize()
            if not torch.equal(out, ref):
                bad = (out != ref).nonzero()
                errors.append(f"rank {rank} a2a rows={total_rows} {dt}: {bad.numel()} wrong, first at {bad[0].item()}")
        # 2. async on a side stream, then wait
        n = 8 << 20
        x = torch.randn(n, device="cuda", generator=gl)
        out = torch.empty_like(x)
        ref = torch.empty_like(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ev = a2a(x, out, [n // world] * world, [n // world] * world, asynchronous=True)
        ev.wait_on(torch.cuda.current_stream().cuda_stream)
        dist.all_to_all_single(ref, x, group=nccl)
        torch.cuda.synchronize()
        if not torch.equal(out, ref):
            errors.append(f"rank {rank} async a2a wrong")
        # 3. split mismatch: rank 0 sends one row more to rank 1 than rank 1 expects
        send = [4] * world
        recv = [4] * world
        if rank == 0:
            send[1] = 5
        x = torch.zeros(sum(send), device="cuda")
        out = torch.zeros(sum(recv), device="cuda")
        try:
            a2a(x, out, send, recv)
            torch.cuda.synchronize()
            comm.cuda_health()
            errors.append(f"rank {rank}: split mismatch not reported")
        except Exception as e:  # noqa: BLE001
            if "rank 0 sends 20 bytes to rank 1, which expects 16" not in str(e):
                errors.append(f"rank {rank}: split mismatch reported as {e!r}")
        # group still usable
        x = torch.randn(world * 1000, device="cuda", generator=gl)
        out = torch.empty_like(x)
        ref = torch.empty_like(x)
        a2a(x, out, [1000] * world, [1000] * world)
        dist.all_to_all_single(ref, x, group=nccl)
        torch.cuda.synchronize()
        if not torch.equal(out, ref):
            errors.append(f"rank {rank}: a2a after mismatch wrong")
        # 4. send/recv ring both ways at once (async), sizes 0..256 MiB
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        for nbytes in [0, 1, 4097, 1 << 20, 3 * (1 << 20) + 5, 64 << 20, 256 << 20]:
            a = torch.randint(0, 255, (nbytes,), device="cuda", dtype=torch.uint8, generator=gl)
            b = torch.randint(0, 255, (nbytes,), device="cuda", dtype=torch.uint8, generator=gl)
            ra = torch.zeros(nbytes, device="cuda", dtype=torch.uint8)
            rb = torch.zeros(nbytes, device="cuda", dtype=torch.uint8)
            evs = [
                cuda_p2p(True, a.data_ptr(), nbytes, nxt, stream(), True),
                cuda_p2p(False, ra.data_ptr(), nbytes, prv, stream(), True),
                cuda_p2p(True, b.data_ptr(), nbytes, prv, stream(), True),
                cuda_p2p(False, rb.data_ptr(), nbytes, nxt, stream(), True),
            ]
            for ev in evs:
                ev.wait_on(stream())
            # reference: NCCL ring
            ea = torch.empty_like(ra)
            eb = torch.empty_like(rb)
            ops = [
                dist.P2POp(dist.isend, a, nxt, nccl),
                dist.P2POp(dist.irecv, ea, prv, nccl),
                dist.P2POp(dist.isend, b, prv, nccl),
                dist.P2POp(dist.irecv, eb, nxt, nccl),
            ]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            torch.cuda.synchronize()
            comm.cuda_health()
            if not (torch.equal(ra, ea) and torch.equal(rb, eb)):
                errors.append(f"rank {rank} p2p {nbytes} B wrong")

        # 5. timings: a2a even, send/recv 0 -> 1
        def timeit(fn, iters):
            for _ in range(3):
                fn()
            return event_us(fn, iters, lambda: dist.barrier(group=nccl))

        rows = []
        for size in [64 << 10, 256 << 10, 16 << 20, 64 << 20, 256 << 20]:
            x = torch.empty(size // 4, device="cuda")
            o = torch.empty_like(x)
            k = size // 4 // world
            t_rs = timeit(lambda: a2a(x, o, [k] * world, [k] * world), 20)
            t_nc = timeit(lambda: dist.all_to_all_single(o, x, group=nccl), 20)
            bus = size * (world - 1) / world
            rows.append(
                f"a2a {size >> 10:>7} KiB: rsccl {t_rs:8.1f} us {bus / t_rs / 1e3:6.1f} GB/s | nccl {t_nc:8.1f} us {bus / t_nc / 1e3:6.1f} GB/s"
            )
        for size in [1 << 20, 16 << 20, 256 << 20]:
            x = torch.empty(size, dtype=torch.uint8, device="cuda")
            if rank in (0, 1):

                def rs():
                    cuda_p2p(rank == 0, x.data_ptr(), size, 1 - rank, stream(), False)

                def nc():
                    (dist.send if rank == 0 else dist.recv)(x, 1 - rank, group=nccl)
            else:
                rs = nc = lambda: None
            t_rs = timeit(rs, 10)
            t_nc = timeit(nc, 10)
            rows.append(
                f"p2p {size >> 20:>4} MiB: rsccl {t_rs:8.1f} us {size / t_rs / 1e3:6.1f} GB/s | nccl {t_nc:8.1f} us {size / t_nc / 1e3:6.1f} GB/s"
            )
        if rank == 0:
            print("\n".join(rows), flush=True)
        # 6. optional: send/recv 0 -> 1 for inbox sizes and block counts, each its own group
        for spec in filter(None, os.environ.get("P2P_SWEEP", "").split(";")):
            opts = dict(kv.split("=") for kv in spec.split(","))
            sub = dist.new_group(backend="rsccl", pg_options=opts)
            sc = _rsccl_pg(sub)._comm
            line = []
            for size in [16 << 20, 256 << 20]:
                x = torch.empty(size, dtype=torch.uint8, device="cuda")
                fn = (
                    (
                        lambda: sc.run(
                            SEND if rank == 0 else RECV, x.data_ptr(), size, x.data_ptr(), size, UINT8, SUM, 1 - rank, stream(), True
                        )
                    )
                    if rank < 2
                    else (lambda: None)
                )
                t = timeit(fn, 10)
                line.append(f"{size >> 20} MiB {size / t / 1e3:6.1f} GB/s")
            if rank == 0:
                used = _rsccl_pg(sub).memory_stats().get("cuda_p2p_blocks", "?")
                print(f"p2p sweep {spec} (blocks used: {used}): " + " | ".join(line), flush=True)
            dist.destroy_process_group(sub)
        dist.barrier(group=nccl)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        errors.append(f"rank {rank}: {traceback.format_exc()}")
    q.put((rank, errors))


def main():
    import socket

    import torch.multiprocessing as mp

    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    errs = []
    for _ in range(world):
        try:
            _, e = q.get(timeout=240)
            errs += e
        except Exception:  # noqa: BLE001
            errs.append("a rank did not report within 240 s")
            break
    for p in procs:
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
    print("\n".join(errs) if errs else f"world {world}: all checks passed", flush=True)
    sys.exit(1 if errs else 0)


if __name__ == "__main__":
    main()
