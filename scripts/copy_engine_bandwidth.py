"""What the GPUs' copy engines move, without rsccl (issue 28, docs/performance.md "Copy
engines"): torch copies between the GPUs of this host in one process (cudaMemcpyPeerAsync on
the source GPU's streams), 5 repeats each:
- one pair, one direction; GPU 0 to its peers at once; the peers into GPU 0 at once;
- every GPU to every other at once (all_gather's pattern), each copy whole or split over
  2, 4 and 8 streams;
- a ring: every GPU to the next one at once (a ring algorithm's steps), each copy whole or
  split over 2 and 4 streams, pushed and pulled;
- the same pattern with every copy issued on the destination GPU's stream (a pull:
  cudaMemcpyPeerAsync through ctypes, as torch always copies on the source's stream), and
  half pushed, half pulled, to see whether the engines of both ends move more than the
  sources' alone.

    NCCL_NVLS_ENABLE=0 python scripts/copy_engine_bandwidth.py [MiB per copy, default 256]
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import time

import torch


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (by soname), else the first one in site-packages."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    root = os.path.dirname(os.path.dirname(torch.__file__))
    for path in sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcudart.so*"), recursive=True)):
        return ctypes.CDLL(path)
    sys.exit("no libcudart found")


def peer_copy(rt: ctypes.CDLL, src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """cudaMemcpyPeerAsync of `src` into `dst` on `stream` (of either GPU)."""
    with torch.cuda.device(stream.device):
        r = rt.cudaMemcpyPeerAsync(
            ctypes.c_void_p(dst.data_ptr()),
            ctypes.c_int(dst.device.index),
            ctypes.c_void_p(src.data_ptr()),
            ctypes.c_int(src.device.index),
            ctypes.c_size_t(src.numel() * src.element_size()),
            ctypes.c_void_p(stream.cuda_stream),
        )
    if r != 0:
        sys.exit(f"cudaMemcpyPeerAsync: error {r}")


def torch_copy(src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """torch's copy (on the source's stream, whatever stream is current)."""
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)


def rate(jobs: list, reps: int = 5, issue=torch_copy) -> float:
    """GB/s of `jobs` ((src, dst, stream) copies, each issued by `issue`) all at once, after
    one untimed round."""
    n = torch.cuda.device_count()

    def once() -> None:
        for s, d, st in jobs:
            issue(s, d, st)

    once()
    for i in range(n):
        torch.cuda.synchronize(i)
    t = time.perf_counter()
    for _ in range(reps):
        once()
    for i in range(n):
        torch.cuda.synchronize(i)
    return sum(s.numel() for s, _, _ in jobs) / ((time.perf_counter() - t) / reps) / 1e9


def main() -> None:
    n = torch.cuda.device_count()
    if n < 2:
        sys.exit("needs 2 GPUs or more")
    size = (int(sys.argv[1]) if len(sys.argv) > 1 else 256) << 20
    src = {i: torch.empty(size, dtype=torch.uint8, device=i) for i in range(n)}
    dst = {(i, j): torch.empty(size, dtype=torch.uint8, device=j) for i in range(n) for j in range(n) if i != j}
    st = {(i, j): torch.cuda.Stream(device=i) for i in range(n) for j in range(n)}
    print(f"{n} GPUs, {size >> 20} MiB per copy")
    print(f"  0 -> 1: {rate([(src[0], dst[(0, 1)], st[(0, 1)])]):.0f} GB/s")
    print(f"  0 -> every peer at once: {rate([(src[0], dst[(0, j)], st[(0, j)]) for j in range(1, n)]):.0f} GB/s")
    print(f"  every peer -> 0 at once: {rate([(src[j], dst[(j, 0)], st[(j, 0)]) for j in range(1, n)]):.0f} GB/s")
    for k in (1, 2, 4, 8):
        part = size // k
        streams = {(i, j, c): torch.cuda.Stream(device=i) for i in range(n) for j in range(n) for c in range(k) if i != j}
        jobs = [
            (src[i][c * part : (c + 1) * part], dst[(i, j)][c * part : (c + 1) * part], streams[(i, j, c)])
            for i in range(n)
            for j in range(n)
            if i != j
            for c in range(k)
        ]
        total = rate(jobs)
        print(f"  every GPU -> every other at once, {k} stream(s) per copy: {total:.0f} GB/s in all, {total / n:.0f} per GPU")
    rt = cudart()
    for i in range(n):
        with torch.cuda.device(i):
            for j in range(n):
                if i != j:
                    rt.cudaDeviceEnablePeerAccess(ctypes.c_int(j), ctypes.c_uint(0))  # 704: already enabled
    rt.cudaGetLastError()
    # The ring: GPU i to GPU i + 1 only, every GPU at once (both directions of each pair at world 2).
    for k in (1, 2, 4):
        part = size // k
        for where in ("pushed", "pulled"):
            streams = {(i, c): torch.cuda.Stream(device=i if where == "pushed" else (i + 1) % n) for i in range(n) for c in range(k)}
            jobs = [
                (src[i][c * part : (c + 1) * part], dst[(i, (i + 1) % n)][c * part : (c + 1) * part], streams[(i, c)])
                for i in range(n)
                for c in range(k)
            ]
            total = rate(jobs, issue=lambda s, d, q: peer_copy(rt, s, d, q))
            print(f"  ring, every GPU -> the next at once, {where}, {k} stream(s) per copy: {total / n:.0f} GB/s per GPU")
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    # A stream of its own per copy in every mode: pushes on the source GPU, pulls on the destination.
    pull = {(i, j): torch.cuda.Stream(device=j) for i, j in pairs}
    modes = {
        "pushed (the source's stream)": lambda i, j: st[(i, j)],
        "pulled (the destination's stream)": lambda i, j: pull[(i, j)],
        "half pushed, half pulled (i < j pushed)": lambda i, j: st[(i, j)] if i < j else pull[(i, j)],
    }
    for what, stream_of in modes.items():
        jobs = [(src[i], dst[(i, j)], stream_of(i, j)) for i, j in pairs]
        total = rate(jobs, issue=lambda s, d, q: peer_copy(rt, s, d, q))
        print(f"  every GPU -> every other at once, cudaMemcpyPeerAsync {what}: {total:.0f} GB/s in all, {total / n:.0f} per GPU")


if __name__ == "__main__":
    main()
