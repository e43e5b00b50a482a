"""Where an eager CUDA all_reduce and all_to_all_single spend their CPU time: wall time per
call of each layer (torch.distributed, the ProcessGroup method, the Rust launch), 2 ranks,
1 KiB bf16; all_gather_into_tensor and reduce_scatter_tensor through torch.distributed; and,
with a GPU per rank, what single driver calls, an empty kernel's launch and torch's
symmetric-memory all_reduce cost on the same machine.

    python3 scripts/gpu_cpu_cost.py

On one GPU both ranks share it (rsccl's allow_shared_gpu; start MPS first for a fair GPU
column), and the NCCL rows are left out (NCCL refuses two ranks on one GPU). Each row is the
median of 7 blocks of 500 timed calls (a block is fewer calls than CUDA's launch queue
holds, so the CPU column is the CPU's time even where the GPU is slower than the launches).
"""

import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def rank_main(rank, world, port, q):
    import rsccl  # noqa: F401 - registers the backend
    import torch
    import torch.distributed as dist
    from rsccl._ops import ALL_REDUCE, ALL_TO_ALL, DTYPE_CODES, SUM, UINT8

    BF16 = DTYPE_CODES[torch.bfloat16]

    dev = rank % torch.cuda.device_count()
    shared = world > torch.cuda.device_count()
    if shared:
        os.environ["RSCCL_ALLOW_SHARED_GPU"] = "1"
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("rsccl", store=store, rank=rank, world_size=world)
    nccl = dist.new_group(backend="gloo") if shared else dist.new_group(backend="nccl", device_id=torch.device("cuda", dev))
    pg = dist.group.WORLD
    x = torch.randn(512, device="cuda").bfloat16()
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    p = x.data_ptr()
    comm = pg._comm
    cases = {
        "python loop only": lambda: None,
        "comm.run (Rust launch)": lambda: comm.run(
            ALL_REDUCE, p, 1024, p, 1024, BF16, SUM, 0, torch._C._cuda_getCurrentRawStream(dev), True
        ),
        "pg.allreduce([x], opts)": lambda: pg.allreduce([x], opts),
        "dist.all_reduce(x)": lambda: dist.all_reduce(x),
        "dist.all_reduce(x, group=nccl)": lambda: dist.all_reduce(x, group=nccl),
        "dist.all_reduce(x, async_op=True).wait()": lambda: dist.all_reduce(x, async_op=True).wait(),
        "dist.all_reduce(x, group=nccl, async_op=True).wait()": lambda: dist.all_reduce(x, group=nccl, async_op=True).wait(),
        "x.add_(0) (torch launch)": lambda: x.add_(0),
    }
    o = torch.empty_like(x)
    gathered = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    shard = torch.empty(x.numel() // world, dtype=x.dtype, device=x.device)
    cases.update(
        {
            "dist.all_gather_into_tensor(g, x)": lambda: dist.all_gather_into_tensor(gathered, x),
            "dist.reduce_scatter_tensor(s, x)": lambda: dist.reduce_scatter_tensor(shard, x),
            "dist.all_gather_into_tensor(g, x, async_op=True).wait()": lambda: dist.all_gather_into_tensor(
                gathered, x, async_op=True
            ).wait(),
            "dist.reduce_scatter_tensor(s, x, async_op=True).wait()": lambda: dist.reduce_scatter_tensor(shard, x, async_op=True).wait(),
        }
    )
    a2a_opts = dist.AllToAllOptions()
    a2a_opts.asyncOp = False
    half = x.nbytes // world
    sp, sb, rp = [p, p + half], [half, half], [o.data_ptr(), o.data_ptr() + half]
    cases.update(
        {
            "comm.run all_to_all (Rust launch)": lambda: comm.run(
                ALL_TO_ALL, 0, 0, 0, 0, UINT8, SUM, 0, torch._C._cuda_getCurrentRawStream(dev), True, (sp, sb, rp, sb)
            ),
            "pg.alltoall_base(o, x, [], [], opts)": lambda: pg.alltoall_base(o, x, [], [], a2a_opts),
            "dist.all_to_all_single(o, x)": lambda: dist.all_to_all_single(o, x),
            "dist.all_to_all_single(o, x, group=nccl)": lambda: dist.all_to_all_single(o, x, group=nccl),
        }
    )
    if shared:
        cases = {k: v for k, v in cases.items() if "group=nccl" not in k}
    else:
        cases.update(_baselines(dev, nccl.group_name))
    cases = {k: v for k, v in cases.items() if "(Rust launch)" not in k or hasattr(comm, k.split(".")[1].split(" ")[0])}
    out = {}
    for name, fn in cases.items():
        for _ in range(50):
            fn()
        # Seven blocks of 500 calls, the median block reported (one-off stalls of a shared
        # machine do not move it).
        rows = []
        for _ in range(7):
            torch.cuda.synchronize()
            dist.barrier(group=nccl)
            n = 500
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            e0.record()
            for _ in range(n):
                fn()
            cpu = (time.perf_counter() - t) / n * 1e6
            e1.record()
            torch.cuda.synchronize()
            rows.append((cpu, e0.elapsed_time(e1) * 1000 / n))
        rows.sort()
        out[name] = rows[len(rows) // 2]
    q.put((rank, out))
    dist.destroy_process_group()


def _baselines(dev, group_name):
    """What a launch itself costs here, for reading the rows above: single driver calls
    through ctypes (cuCtxGetCurrent is about ctypes' own cost), an empty kernel launched
    with cuLaunchKernel (compiled by CuPy, where it is installed), and torch's
    symmetric-memory two-shot all_reduce (a torch op, no ProcessGroup), 1 KiB bf16."""
    import ctypes

    import torch

    cases = {}
    cu = ctypes.CDLL("libcuda.so.1")
    vp = ctypes.c_void_p
    ctx, ev, st = vp(), vp(), ctypes.c_int()
    cu.cuCtxGetCurrent(ctypes.byref(ctx))
    cu.cuEventCreate(ctypes.byref(ev), 2)  # CU_EVENT_DISABLE_TIMING
    stream = vp(torch._C._cuda_getCurrentRawStream(dev))
    get_ctx, record, capturing = cu.cuCtxGetCurrent, cu.cuEventRecord, cu.cuStreamIsCapturing
    record.argtypes = capturing.argtypes = [vp, vp]
    ctx_ref, st_ref = ctypes.byref(ctx), ctypes.byref(st)
    cases["ctypes cuCtxGetCurrent (ctypes' own cost)"] = lambda: get_ctx(ctx_ref)
    cases["ctypes cuEventRecord"] = lambda: record(ev, stream)
    cases["ctypes cuStreamIsCapturing"] = lambda: capturing(stream, st_ref)
    try:
        import cupy

        kernel = cupy.RawKernel('extern "C" __global__ void k() {}', "k")
        kernel((1,), (32,), ())
        func, launch = vp(kernel.kernel.ptr), cu.cuLaunchKernel
        launch.argtypes = [vp] + [ctypes.c_uint] * 7 + [vp, vp, vp]
        cases["ctypes cuLaunchKernel, empty kernel, 16 x 512"] = lambda: launch(func, 16, 1, 1, 512, 1, 1, 0, stream, None, None)
    except Exception as e:  # noqa: BLE001 - a row less
        print(f"no empty-kernel row (CuPy: {e})", flush=True)
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(512, dtype=torch.bfloat16, device=dev)
        symm_mem.rendezvous(buf, group_name)
        cases["torch symm-mem two_shot_all_reduce_"] = lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name)
    except Exception as e:  # noqa: BLE001 - a row less
        print(f"no symmetric-memory row: {e}", flush=True)
    return cases


def main():
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, 2, port, q)) for r in range(2)]
    for p in ps:
        p.start()
    res = dict(q.get(timeout=180) for _ in ps)
    for p in ps:
        p.join(30)
    print(f"{'per call, 1 KiB bf16, 2 ranks':58s} {'CPU us':>8s} {'GPU-stream us':>14s}")
    for name, (cpu, gpu) in res[0].items():
        print(f"{name:58s} {cpu:8.2f} {gpu:14.2f}")


if __name__ == "__main__":
    sys.exit(main())
