"""The CUDA side of rsccl's ProcessGroup: device choice at group creation, NVRTC loading,
argument checks, and the Work of an asynchronous CUDA collective.

Tensor lifetime without marking tensors on streams: a CudaWork keeps the tensors a collective reads
and writes until the consumer is ordered after it: `wait()` makes the caller's current
stream wait on the collective's end event, and from then on the caching allocator can
reuse the memory safely (later work on that stream runs after the collective). A Work
nobody waits on stays in its group's pending list until its end event has completed.
"""

from __future__ import annotations

import collections
import ctypes
import glob
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_NVRTC_LOADED = False

# dtypes rsccl's CUDA kernels reduce; gathers and broadcasts move bytes of any dtype.
REDUCE_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int32: "int32", torch.int64: "int64"}
REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")


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


def raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


class CudaWork(dist._Work):
    """An asynchronous CUDA collective: its end event, and the tensors it uses."""

    def __init__(
        self, pg: Any, device: int, event: Any, result: Any, keep: Any, post: Callable[[], None] | None = None, stream: int | None = None
    ):
        super().__init__()
        self._pg = pg
        self._device = device
        # The stream current at launch: its allocations (staging copies) are in `keep`.
        self._stream = stream
        self._event = event
        self._result = [result] if isinstance(result, torch.Tensor) else (result if result is not None else [])
        self._keep = keep
        self._post = post
        self._ordered = False

    def _order_current_stream(self) -> None:
        if not self._ordered:
            current = raw_stream(self._device)
            self._event.wait_on(current)
            if self._stream is not None and self._stream != current:
                # Temporaries made at launch belong to the launch stream's pool: order it too.
                self._event.wait_on(self._stream)
            self._ordered = True
            if self._post is not None:
                post, self._post = self._post, None
                post()
                if self._stream is not None and self._stream != current and not torch.cuda.is_current_stream_capturing():
                    # The copies just queued on the current stream read temporaries from the
                    # launch stream's pool: that stream waits for them before it can reuse
                    # the memory (freed below).
                    done = torch.cuda.Event()
                    done.record()
                    torch.cuda.ExternalStream(self._stream, device=torch.device("cuda", self._device)).wait_event(done)
            # The consumer stream now runs after the collective: the memory may be reused.
            self._keep = None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self._order_current_stream()
        self._pg._comm.cuda_health()
        return True

    def is_completed(self) -> bool:
        return bool(self._event.query())

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> BaseException | None:
        try:
            self._pg._comm.cuda_health()
        except Exception as e:  # noqa: BLE001 - reported, not raised
            return e
        return None

    def result(self) -> Any:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self._order_current_stream()
        self._event.synchronize()
        self._pg._comm.cuda_health()

    def get_future(self) -> torch.futures.Future:
        # A CUDA-aware future: set_result records the current stream, which now waits on
        # the collective, and consumers of the value wait on that.
        self._order_current_stream()
        fut: torch.futures.Future = torch.futures.Future(devices=[torch.device("cuda", self._device)])
        fut.set_result(self._result)
        return fut

    def _release_if_done(self) -> bool:
        """Drop the tensors once the collective finished on the GPU; True if released."""
        if self._keep is None:
            return True
        if self._event.query():
            self._keep = None
            return True
        return False


class Pending:
    """Asynchronous Works not yet known to be finished, oldest first."""

    def __init__(self) -> None:
        self.works: collections.deque[CudaWork] = collections.deque()

    def add(self, w: CudaWork) -> None:
        self.works.append(w)
        if len(self.works) > 1 and not torch.cuda.is_current_stream_capturing():
            # Works on one stream finish in order: stop at the first one still running.
            while self.works and self.works[0]._release_if_done():
                self.works.popleft()
