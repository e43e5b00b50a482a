"""The CUDA bench's constants, its Config, and the rsccl options it derives (the
rsccl-pool rows' pool and VA cap, the one-shot limit).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ... import _rsccl
from ..common import GRANULE, POOL_VA_FLOOR, Sweep, human, resolved, round_up
from ..fsdp import FsdpConfig
from .overlap_config import OverlapConfig

# NVLink multicast can take a shared host's GPUs down: off in NCCL, torch's symmetric memory
# and NVSHMEM. Set in this process before it spawns the ranks, so that they have it from their
# first instruction (before they import torch); torch reads these when it uses them.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


os.environ.update(GPU_ENV)


MiB = 1 << 20


PROBE_BYTES = 1 * MiB  # the first collectives' message, for the memory measurements


GRAPH_CALLS = 20  # calls captured in one graph


GRAPH_REPLAYS = 5  # replays of it per repeat


# Small messages take 1000 calls per repeat: a start-up skew between ranks of ~100 us then
# adds 0.1 us per call, and a host hiccup of a few ms (eager calls are bound by the host)
# a few us. With 300 calls and 3 repeats, each of five runs had an eager rsccl row that took
# 1.6-10x the next larger size's time, at sizes that changed from run to run (the "64 KiB
# cliff" of issue 27); with 1000 calls and 5 repeats, every size up to 4 MiB took at most
# 1.19x the next one's (4 H100s, 2026-11-27 19:26-19:40 UTC, docs/performance.md).
ITERS_MAX, ITERS_MIN, ITERS_FULL_UP_TO = 1000, 5, 4 * MiB


SMALL_PLOT_BYTES = 1 << 20  # the latency panels show sizes up to this (or --graph-max-bytes)


DONE_GRACE_S = 30.0  # after rank 0 wrote its results, how long the ranks may take to exit


SYMM_BACKENDS = ("symm-1shot", "symm-2shot")


SWEEP: dict[str, int | str] = {"rsccl-2shot": 1, "rsccl-1shot": "1GiB"}  # cuda_allreduce_one_shot_max_bytes per extra group


BACKEND_ORDER = ("rsccl", "rsccl-pool", "rsccl-2shot", "rsccl-1shot", "nccl", "symm-1shot", "symm-2shot")


SHORT = {
    "rsccl": "rsccl",
    "rsccl-pool": "rs-pool",
    "rsccl-2shot": "rs-2shot",
    "rsccl-1shot": "rs-1shot",
    "nccl": "nccl",
    "symm-1shot": "symm1",
    "symm-2shot": "symm2",
}


COLORS = {
    "rsccl": "tab:blue",
    "rsccl-pool": "tab:brown",
    "rsccl-2shot": "tab:purple",
    "rsccl-1shot": "tab:cyan",
    "nccl": "tab:orange",
    "symm-1shot": "tab:green",
    "symm-2shot": "tab:red",
}


# rsccl-pool: the default rsccl group again, on buffers from rsccl.mem_pool() (in place).
POOL_BACKEND = "rsccl-pool"


POOL_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


POOL_MIN_BYTES = 1 * MiB  # rsccl-pool rows from this message size on (rsccl's default cuda_inplace_min_bytes)


POOL_SPEEDUP_MIN_BYTES = 16 * MiB  # the in-place/staged target is read from this size on


POOL_SPEEDUP_TARGET = 1.1


# all_to_all_single and send/recv: the sizes they run at, and their targets.
A2A = "all_to_all_single"


P2P = "send_recv"


A2A_MAX_BYTES = 256 * MiB


P2P_SIZES = (1 * MiB, 16 * MiB, 256 * MiB)


A2A_BUSBW_FROM_BYTES = 16 * MiB  # target: rsccl busbw >= NCCL's from here on


A2A_LATENCY_UP_TO_BYTES = 256 * 1024  # target: rsccl eager latency <= A2A_LATENCY_TARGET x NCCL's up to here


A2A_LATENCY_TARGET = 0.5


P2P_TARGET_BYTES = 256 * MiB


P2P_TARGET_GBPS = 340.0  # ~0.91 x the 373 GB/s P2P copy of an NV18 H200 pair (DESIGN.md)


EXACT_COLLECTIVES = ("all_gather_into_tensor", "broadcast", A2A, P2P)  # data movement: checked bit for bit


@dataclass(frozen=True)
class Config(Sweep):
    """What every rank runs: the sweep and the CUDA bench's own fields; picklable, so it
    travels to spawned ranks."""

    graph: bool
    graph_max_bytes: int
    check_max_bytes: int
    symm_max_bytes: int
    sweep_one_shot: bool
    rsccl_options: dict[str, int | str] = field(default_factory=dict)
    timeout_s: float = 300.0
    pool: bool = True  # rsccl-pool rows (and a pool on the default rsccl group)
    fsdp: FsdpConfig | None = None  # the FSDP2 section, or None
    overlap: OverlapConfig | None = None  # the overlap section, or None
    ctas_profile: bool = False  # the kernels' grids read from a torch.profiler trace, last


def iters_for(nbytes: int, cfg: Config) -> int:
    if cfg.iters:
        return cfg.iters
    return max(ITERS_MIN, min(ITERS_MAX, ITERS_MAX * ITERS_FULL_UP_TO // max(nbytes, 1)))


def options_text(options: dict[str, int | str]) -> str:
    return ", ".join(f"{k}={human(v) if isinstance(v, int) else v}" for k, v in options.items())


def one_shot_limit(world: int, options: dict[str, int | str]) -> int | None:
    """The all_reduce size up to which rsccl runs one-shot (staged even on pool buffers: in
    place applies to two-shot only), as rsccl resolves it (rust/core/src/cuda/decide.rs,
    auto_one_shot_max); None where rsccl would refuse the options."""
    r = resolved(options)
    if r is None:
        return None
    return r["cuda_allreduce_one_shot_max_bytes"] or _rsccl.cuda_auto_one_shot_max(world)


def pool_sizes(cfg: Config) -> list[int]:
    """The message sizes that get rsccl-pool rows (none without --no-pool's opposite or a pool collective)."""
    if not cfg.pool or not any(c in POOL_COLLECTIVES for c in cfg.collectives):
        return []
    return [s for s in cfg.sizes if s >= POOL_MIN_BYTES]


def pool_options(cfg: Config, world: int) -> dict[str, int | str]:
    """What the bench adds to the default rsccl group's options for the rsccl-pool rows: a pool
    of 2 x the largest message + 64 MiB (one message-sized buffer is live at a time, plus what
    torch's caching allocator keeps of earlier sizes), plus the overlap section's pool
    buffers when it runs (all live at once, OverlapConfig.pool_bytes), and a VA cap that fits world x (buffer +
    pool) with a margin, never below rsccl's default. Empty when there are no rsccl-pool rows.
    Fields the user set with --rsccl-options are left as given."""
    sizes = pool_sizes(cfg)
    if not sizes:
        return {}
    user = cfg.rsccl_options
    out: dict[str, int | str] = {}
    if "cuda_pool_bytes" not in user:
        need = 2 * max(sizes)
        if cfg.overlap is not None:  # its rsccl-pool run holds every size's buffers at once
            need += cfg.overlap.pool_bytes()
        out["cuda_pool_bytes"] = round_up(need + 64 * MiB, GRANULE)
    if "max_cuda_va_bytes" not in user:
        r = resolved({**user, **out})
        # Options rsccl would refuse: assume 4 GiB for what cannot be read (creation fails anyway).
        pool = r["cuda_pool_bytes"] if r else int(out.get("cuda_pool_bytes", 4 << 30))
        buf = r["cuda_buffer_bytes"] if r else 4 << 30
        need = world * round_up(pool + buf, GRANULE)
        out["max_cuda_va_bytes"] = max(POOL_VA_FLOOR, need + (1 << 30))
    return out
