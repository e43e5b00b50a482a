"""Smoke run of the CUDA bench's overlap section (rsccl/bench/cuda/overlap.py) where the bench
itself cannot run: on a machine with one GPU.

    python3 scripts/gpu_overlap_smoke.py [--world 2] [--overlap-matmul 2048] [--overlap-bytes 1MiB,4MiB] [--seed N]

With fewer GPUs than --world the ranks share them (rsccl's allow_shared_gpu). NCCL refuses two
ranks on one GPU, so there only rsccl runs, and its check compares rsccl's collectives under
the matmuls with rsccl's alone on the same seeded inputs. Timings of ranks that share a GPU
mean nothing: this shows that the section runs end to end and gets right results, and prints
its Markdown; its figures must not be quoted. With a GPU per rank NCCL runs too, as in
`python -m rsccl.bench --device cuda --quick`. Exit status 0 when the section finished with
no failure and no wrong result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta
from types import SimpleNamespace

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def rank_main(rank: int, world: int, port: int, oc, seed: int, path: str) -> None:
    import rsccl
    import torch
    import torch.distributed as dist
    from rsccl.bench.cuda.backends import Agree, Backend
    from rsccl.bench.cuda.overlap import run_overlap

    gpus = torch.cuda.device_count()
    shared = world > gpus
    if shared:
        os.environ["RSCCL_ALLOW_SHARED_GPU"] = "1"
    dev = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(dev)
    timeout = timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout, wait_for_workers=False)
    dist.init_process_group("rsccl", store=store, rank=rank, world_size=world, timeout=timeout)
    agree = Agree(dist.new_group(backend="gloo", timeout=timeout))
    backends = [Backend("rsccl")]
    if not shared:
        backends.append(Backend("nccl", dist.new_group(backend="nccl", timeout=timeout, device_id=dev)))

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[overlap smoke] {msg}", flush=True)

    r = SimpleNamespace(
        rank=rank,
        world=world,
        dev=dev,
        cfg=SimpleNamespace(overlap=oc, seed=seed),
        agree=agree,
        backends=backends,
        meta={},
        log=log,
        save=lambda: None,
    )
    run_overlap(r)
    stats = agree.gather(dict(rsccl.memory_stats()))
    if rank == 0:
        meta = dict(r.meta, rsccl_memory_stats=stats, nccl_cta_env={}, shared=shared, gpus=gpus)
        with open(path, "w") as f:
            json.dump(meta, f)
    torch.cuda.synchronize()
    dist.destroy_process_group()


def main() -> int:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from rsccl.bench.cli import parse_byte_list
    from rsccl.bench.cuda.overlap_config import QUICK, config_problems
    from rsccl.bench.cuda.overlap_report import overlap_markdown, overlap_problems

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--overlap-matmul", dest="matmul", type=int, default=QUICK.matmul)
    p.add_argument("--overlap-bytes", dest="bytes", type=parse_byte_list, default=QUICK.sizes)
    p.add_argument("--overlap-rounds", dest="rounds", type=int, default=QUICK.rounds)
    p.add_argument("--overlap-repeats", dest="repeats", type=int, default=QUICK.repeats)
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args()
    oc = type(QUICK)(matmul=a.matmul, matmuls=QUICK.matmuls, sizes=tuple(a.bytes), rounds=a.rounds, repeats=a.repeats)
    if problems := config_problems(oc):
        p.error("; ".join(problems))
    if a.world < 2 or not torch.cuda.is_available():
        p.error(f"needs --world >= 2 (got {a.world}) and a CUDA GPU (torch.cuda.is_available() = {torch.cuda.is_available()})")
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(2), "little")
    print(f"overlap smoke: world {a.world} on {torch.cuda.device_count()} GPU(s), seed {seed}, {oc.describe()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rsccl-overlap-smoke-") as tmp:
        path = os.path.join(tmp, "meta.json")
        store = dist.TCPStore("127.0.0.1", 0, a.world, True, timeout=timedelta(seconds=300), wait_for_workers=False)
        mp.spawn(rank_main, args=(a.world, store.port, oc, seed, path), nprocs=a.world, join=True)
        with open(path) as f:
            meta = json.load(f)
    if meta["shared"]:
        print(f"NOTE: {a.world} ranks share {meta['gpus']} GPU(s): the timings below are NOT valid figures", flush=True)
    ov = meta.get("overlap")
    print("\n".join(overlap_markdown(ov, meta)), flush=True)
    problems = overlap_problems(a.world, ov)
    for line in problems:
        print(f"FAILED: {line}", flush=True)
    ran = bool(ov and ov.get("runs", {}).get("rsccl"))
    if not ran:
        print("FAILED: no rsccl run finished", flush=True)
    return 0 if ran and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
