"""The CUDA side of rsccl's ProcessGroup: device choice at group creation, NVRTC loading,
the dtypes and ops the CUDA kernels reduce, and the current stream. The Work of an
asynchronous CUDA collective (CudaWork) lives with the other Works in _work.py.
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Callable
from typing import Any

import torch

from . import _rsccl

_NVRTC_LOADED = False

# dtypes (torch dtype -> name) and ops rsccl's CUDA kernels reduce, from the kernel table
# (rust/core/src/cuda/kernels/mod.rs); gathers and broadcasts move bytes of any dtype.
REDUCE_DTYPES = {getattr(torch, name): name for name in _rsccl.CUDA_REDUCE_DTYPES}
REDUCE_OPS = tuple(_rsccl.CUDA_REDUCE_OPS)

# Why a group has no CUDA engine, and what to do: every message that says so ends with it.
NO_CUDA_AT_CREATION = (
    "CUDA was not initialized when it was created: call torch.cuda.set_device(local_rank) before init_process_group/new_group"
)


def load_nvrtc() -> None:
    """Load NVRTC (and its builtins) from torch's CUDA packages, globally, so the Rust core
    finds it by its soname. A no-op once done or if the library is elsewhere on the path."""
    global _NVRTC_LOADED
    if _NVRTC_LOADED:
        return
    dirs = []
    try:
        import nvidia  # torch's CUDA wheels (nvidia-cuda-nvrtc)

        for base in nvidia.__path__:
            dirs += glob.glob(os.path.join(base, "cu*", "lib")) + glob.glob(os.path.join(base, "cuda_nvrtc", "lib"))
    except ImportError:
        pass
    for d in dirs:
        builtins = sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so.*")))
        lib = sorted(glob.glob(os.path.join(d, "libnvrtc.so.*")))
        if lib:
            for path in [b for b in builtins if ".alt." not in b][:1] + [p for p in lib if ".alt." not in p][:1]:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            break
    _NVRTC_LOADED = True


def nccl_library_path() -> str | None:
    """The libnccl.so.2 of torch's nvidia-nccl package (what torch itself uses), or None."""
    try:
        import nvidia  # torch's CUDA wheels

        for base in nvidia.__path__:
            for path in sorted(glob.glob(os.path.join(base, "nccl", "lib", "libnccl.so.*"))):
                return path
    except ImportError:
        pass
    return None


def device_for_new_group() -> int | None:
    """The GPU a new group's CUDA engine uses: the current device, if the process has
    initialized CUDA (torch.cuda.set_device does); else None (a CPU-only job on a GPU
    machine pays nothing)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    load_nvrtc()
    return torch.cuda.current_device()


def mapped_va_bytes() -> int:
    """Total size of this process's mappings, as /proc/self/maps lists them (CUDA's virtual
    address reservations included): what the bench and the GPU suite compare with
    memory_stats()."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = line.split(None, 1)[0].split("-")
            total += int(hi, 16) - int(lo, 16)
    return total


def nccl_baseline(group: Any) -> str:
    """Which NCCL `group` (made with backend="nccl") runs: torch 2.15 builds
    ProcessGroupNCCL2 (communicators made eagerly) for "nccl", and the old ProcessGroupNCCL
    for "nccl-legacy" (or with TORCH_DIST_USE_NCCL2=0); torch 2.11 has only the old one.
    Benches and GPU tests print it beside every comparison with NCCL."""
    try:
        impl = type(group._get_backend(torch.device("cuda", torch.cuda.current_device()))).__name__
    except Exception:  # noqa: BLE001 - a description, never a failure
        impl = "unknown ProcessGroup"
    return f"{impl} (NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, torch {torch.__version__})"


def _no_cuda_stream(device: int) -> int:
    raise RuntimeError(f"rsccl: this torch has no CUDA, so no current stream on cuda:{device}")


# The caller's current stream on `device`, a raw handle: torch's own function, bound once
# (a Python wrapper around it costs every eager call a frame, issue 27).
raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", _no_cuda_stream)
