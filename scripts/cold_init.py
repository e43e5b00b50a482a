"""The first init_process_group on a fresh machine: rsccl (empty kernel cache, default
settings: the prebuilt kernels) against NCCL, at world 1 and at world N, each in fresh
processes, one per rank. Prints a table; the target (issue 15) is at most 2 s.

    python scripts/cold_init.py [--worlds 1,8] [--nvrtc] [--repeats 1]

World N defaults to the number of GPUs. A world larger than that puts several ranks on a
GPU (RSCCL_ALLOW_SHARED_GPU=1; NCCL does not run there, so its row says n/a). --nvrtc adds
rows for RSCCL_KERNELS=nvrtc, again with an empty cache: the fallback's cold cost.

Every process creates its CUDA context (torch.cuda.init + a tensor) before the clock starts,
so the figures are the backends' own: `init` is init_process_group alone (rsccl creates its
CUDA engine and loads its kernels there; NCCL's ProcessGroup is lazy), `+1st` adds the first
all_reduce of one float and a synchronize (where NCCL creates its communicator). A rank's
figures are the largest over the ranks. The cache directory is a fresh temporary one per
row; the `cache` column counts the NVRTC files the row left in it (0: nothing compiled);
`image MB` is memory_stats()["cuda_kernel_image_bytes"]: the device code rank 0 loaded.
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import sys
import tempfile
import time
from datetime import timedelta

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def rank_main(rank: int, world: int, port: int, backend: str, env: dict, conn) -> None:
    os.environ.update(env)
    try:
        import rsccl
        import torch
        import torch.distributed as dist

        dev = rank % torch.cuda.device_count()
        torch.cuda.set_device(dev)
        torch.zeros(1, device="cuda")  # the CUDA context, outside the measurement
        p = torch.cuda.get_device_properties(dev)
        expected = rsccl._rsccl.kernel_choice(p.major, p.minor)[:2] if backend == "rsccl" else ("-", "")
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=600))
        # Start together: every rank's clock starts once all are ready.
        store.add("ready", 1)
        while store.add("ready", 0) < world:
            time.sleep(0.001)
        t0 = time.perf_counter()
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world, timeout=timedelta(seconds=600))
        t1 = time.perf_counter()
        image = rsccl.memory_stats().get("cuda_kernel_image_bytes", 0) if backend == "rsccl" else 0
        x = torch.ones(1, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        assert x.item() == world, f"all_reduce gave {x.item()}, expected {world}"
        dist.destroy_process_group()
        conn.send(("ok", t1 - t0, t2 - t0, f"sm_{p.major}{p.minor}", expected, image))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        conn.send(("err", f"{type(e).__name__}: {e}"))


def run_row(world: int, backend: str, env: dict, timeout: float) -> dict:
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=600), wait_for_workers=False)
    procs, conns = [], []
    for r in range(world):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=rank_main, args=(r, world, store.port, backend, env, child), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
    results = []
    deadline = time.monotonic() + timeout
    for r, c in enumerate(conns):
        if not c.poll(max(0.0, deadline - time.monotonic())):
            results.append(("err", f"rank {r}: no answer within {timeout:.0f} s"))
            continue
        results.append(c.recv())
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    errors = [r[1] for r in results if r[0] != "ok"]
    if errors:
        return {"error": "; ".join(errors)}
    return {
        "init": max(r[1] for r in results),
        "first": max(r[2] for r in results),
        "arch": results[0][3],
        "kernels": results[0][4],
        "image": results[0][5],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default=None, help="comma-separated world sizes (default: 1 and the number of GPUs)")
    ap.add_argument("--nvrtc", action="store_true", help="also time RSCCL_KERNELS=nvrtc with an empty cache")
    ap.add_argument("--repeats", type=int, default=1, help="rows per configuration (each with fresh processes and cache)")
    ap.add_argument("--timeout", type=float, default=900.0)
    a = ap.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("cold_init: no GPU visible", file=sys.stderr)
        return 2
    worlds = [int(w) for w in a.worlds.split(",")] if a.worlds else sorted({1, gpus})
    configs = [("rsccl", {}), ("nccl", {})] + ([("rsccl", {"RSCCL_KERNELS": "nvrtc"})] if a.nvrtc else [])
    print(f"# cold_init on {torch.cuda.get_device_name(0)} x{gpus}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"{'world':>5}  {'backend':<8} {'kernels':<44} {'init s':>8} {'+1st s':>8} {'cache':>5} {'image MB':>8}")
    failed = False
    for world in worlds:
        shared = world > gpus
        for backend, extra in configs:
            for _ in range(a.repeats):
                if backend == "nccl" and shared:
                    print(f"{world:>5}  {'nccl':<8} {'n/a: ranks share a GPU':<44} {'-':>8} {'-':>8} {'-':>5}")
                    continue
                with tempfile.TemporaryDirectory(prefix="rsccl-cold-") as cache:
                    env = {**MULTICAST_OFF, "RSCCL_CACHE_DIR": cache, **extra}
                    if shared:
                        env["RSCCL_ALLOW_SHARED_GPU"] = "1"
                    r = run_row(world, backend, env, a.timeout)
                    files = len(glob.glob(os.path.join(cache, "kernels-*.cubin")))
                if "error" in r:
                    failed = True
                    print(f"{world:>5}  {backend:<8} FAILED: {r['error']}")
                    continue
                src, what = r["kernels"]
                label = "-" if backend == "nccl" else f"{extra.get('RSCCL_KERNELS', 'auto')}: {src} {what}"[:44]
                image = f"{r['image'] / 1e6:.1f}" if backend == "rsccl" else "-"
                print(
                    f"{world:>5}  {backend:<8} {label:<44} {r['init']:>8.2f} {r['first']:>8.2f} {files if backend == 'rsccl' else '-':>5} {image:>8}"
                )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
