"""`python -m rsccl.bench --device cuda`: rsccl, NCCL and torch's symmetric memory side by
side on the GPUs of one host, in one run.

What runs: for each world size (--world-sizes, default 2,4, those above the number of
visible GPUs left out), the parent hosts a TCPStore and spawns one process per GPU; rank r
uses GPU r. Each rank joins the default group on rsccl (`init_process_group("rsccl")`,
with --rsccl-options as its rsccl.Options), a gloo group (the harness's own barriers and
agreements, CPU only), an NCCL group (`new_group(backend="nccl", device_id=...)`, created
after rsccl's memory was measured, so NCCL connects eagerly as in the baseline), and for
all_reduce torch's symmetric memory on the NCCL group's name (one_shot_all_reduce_out and
two_shot_all_reduce_, never the multicast variants). With --sweep-one-shot, all_reduce
also runs on two more rsccl groups whose one-shot threshold is 1 byte (rsccl-2shot) and 1 GiB
(rsccl-1shot).

In place (unless --no-pool): all_reduce, all_gather_into_tensor and reduce_scatter_tensor at
the sizes >= 1 MiB also run as "rsccl-pool": the same default rsccl group, on buffers from
rsccl.mem_pool() (the all_reduce tensor, the all_gather OUTPUT, the reduce_scatter INPUT;
the other buffer from torch's allocator), allocated in the same order on every rank so that
their offsets agree, next to "rsccl" (torch's buffers: the staged path) and NCCL. For that
the default group is created with cuda_pool_bytes = 2 x the largest message + 64 MiB and
max_cuda_va_bytes = world x (cuda_buffer_bytes + pool) + 1 GiB, at least rsccl's default
16 GiB (fields given with --rsccl-options are kept; nothing else about the group changes; if
rsccl refuses these options the group is created without them and the rows are left out).

FSDP2 (--fsdp, the default for --device cuda unless --quick; --no-fsdp skips it): after the
collectives, a transformer (--fsdp-layers 8, --fsdp-dim 2048, seq 1024, batch 4 per rank,
bf16 params and float32 reductions) is trained --fsdp-warmup 5 + --fsdp-steps 20 steps with
fully_shard over a new NCCL group, then over a new rsccl group whose pool
(--fsdp-pool-bytes, default sized from the model) holds FSDP's communication buffers
(set_allocate_memory_from_process_group_for_comm(True) on every FSDP module); same seed and
data for both. Details: rsccl/_bench_fsdp.py.

all_to_all_single (even splits) runs from --min-bytes to 256 MiB per rank; send_recv (rank 0
sends with dist.send, rank 1 receives with dist.recv, the other ranks idle; async: isend/
irecv + wait) at 1 MiB, 16 MiB and 256 MiB. Both on the default rsccl group and on NCCL, as
the other collectives; their targets (all_to_all_single busbw >= NCCL's from 16 MiB, eager
latency <= 0.5x NCCL's up to 256 KiB, send_recv >= 340 GB/s at 256 MiB) get their own
lines in the summary and a "Targets" section in the Markdown.

Message size: the bytes of the all_reduce (and broadcast) tensor = the all_gather_into_tensor
OUTPUT = the reduce_scatter_tensor INPUT = the all_to_all_single input = the message sent,
per rank, as nccl-tests define it.

Method, per (backend, collective, size):
- check (sizes <= --check-max-bytes): the collective on the same seeded random data, on
  each rsccl group and symmetric-memory op and on NCCL; results must match NCCL's (exactly
  for gathers and broadcast, within a bf16 tolerance for reductions); a mismatch is printed
  loudly and the row says WRONG.
- eager: --warmup calls, then per repeat: synchronize, gloo barrier, CUDA events around N
  back-to-back blocking calls (async_op=False); N is 50 up to 16 MiB, then fewer (at least
  5) or --iters. A repeat's time is the slowest rank's; the median of --repeats is reported
  per call. async: the same with async_op=True and wait() on each call.
- graph (sizes <= --graph-max-bytes, unless --no-graph; run after every eager measurement,
  so a failed capture cannot disturb them): warm-up on a side stream, capture 20 calls into
  one torch.cuda.CUDAGraph (capture_error_mode="thread_local"), replay it 5 times per repeat,
  timed with events, per call. A capture that fails on any rank is recorded as "fail" (the
  reason in the log), and that backend is not captured again.
- busbw from the eager time: all_reduce 2(n-1)/n * bytes / t; all_gather, reduce_scatter,
  all_to_all (n-1)/n * bytes / t; broadcast and send_recv bytes / t.
- memory per rank: device memory used (total - free from torch.cuda.mem_get_info, after
  torch.cuda.synchronize(); device-wide) and mapped virtual address space (/proc/self/maps),
  before any group (after a CUDA context and the probe tensors exist), after rsccl's init,
  after its first all_reduce, all_gather and reduce_scatter (1 MiB probes), then the same for
  NCCL, then after the symmetric-memory buffer's rendezvous. rsccl.memory_stats() is logged.
  rsccl's figures include the default group's pool when there are rsccl-pool rows (the
  Markdown says how much).
- in place vs staged: every rsccl-pool row is checked against NCCL like the others, and
  rsccl.memory_stats() is read before and after each of its checks and measurements: the
  deltas of cuda_inplace_collectives and cuda_staged_collectives give its note, "inplace",
  "STAGED" or "MIXED", so a fallback to the staged path is visible. The summary gives rsccl
  eager time / rsccl-pool eager time per size >= 16 MiB (target >= 1.1x).
- FSDP2 step: CUDA events around each step (forward, backward, optimizer step, zero_grad),
  slowest rank's mean; per backend torch.cuda.max_memory_reserved() (peak stats reset before
  its run), device memory in use (mem_get_info; device-wide, so rsccl's whole pool and NCCL's
  own buffers count, which torch's reserved figure leaves out) and what the run added to it,
  the final loss (both must agree within 2%), and for rsccl the in-place/staged counts.
  Targets: step time rsccl <= NCCL, peak reserved rsccl <= NCCL. The section gets 300 s
  on top of --timeout; a failure there is recorded, and everything else is still written.

Outputs in --out-dir: bench_cuda_w<world>.md per world size (tables, memory, stats, the
in-place table, the FSDP2 table), bench_cuda.csv (all worlds; rsccl-pool rows' note column
says inplace/STAGED), bench_cuda.png when matplotlib imports. The last lines printed
are a compact summary (one line per size), since only the tail of a GPU run's output may
come back.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

# NVLink multicast can take a shared host's GPUs down: off in NCCL, torch's symmetric memory
# and NVSHMEM. Set in this process before it spawns the ranks, so that they have it from their
# first instruction (before they import torch); torch reads these when it uses them.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(GPU_ENV)

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from . import _rsccl
from ._bench_fsdp import (
    FSDP_ALLOWANCE_S,
    FsdpConfig,
    fsdp_markdown,
    fsdp_problems,
    fsdp_summary_lines,
    run_fsdp,
)
from ._cuda import mapped_va_bytes, nccl_baseline
from .bench import TOLERANCES, bus_factor, human, message_sizes, numels
from .options import as_items

MiB = 1 << 20
PROBE_BYTES = 1 * MiB  # the first collectives' message, for the memory measurements
GRAPH_CALLS = 20  # calls captured in one graph
GRAPH_REPLAYS = 5  # replays of it per repeat
# Small messages take 300 calls per repeat: a start-up skew between ranks of ~100 us
# then adds well under 1 us per call.
ITERS_MAX, ITERS_MIN, ITERS_FULL_UP_TO = 300, 5, 4 * MiB
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
POOL_VA_FLOOR = 16 << 30  # rsccl's default max_cuda_va_bytes: the bench never sets a lower cap
GRANULE = 2 * MiB
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
CSV_COLUMNS = (
    "device",
    "world_size",
    "collective",
    "bytes",
    "backend",
    "eager_us",
    "async_us",
    "graph_us",
    "algbw_GBps",
    "busbw_GBps",
    "vs_nccl",
    "iters",
    "check",
    "note",
)


@dataclass(frozen=True)
class Config:
    """What every rank runs; picklable, so it travels to spawned ranks."""

    collectives: tuple[str, ...]
    sizes: tuple[int, ...]
    dtype: str
    iters: int | None
    warmup: int
    repeats: int
    seed: int
    graph: bool
    graph_max_bytes: int
    check_max_bytes: int
    symm_max_bytes: int
    sweep_one_shot: bool
    rsccl_options: dict[str, int | str] = field(default_factory=dict)
    timeout_s: float = 300.0
    pool: bool = True  # rsccl-pool rows (and a pool on the default rsccl group)
    fsdp: FsdpConfig | None = None  # the FSDP2 section, or None


def describe(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its message, shortened."""
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first}"[:400]


def iters_for(nbytes: int, cfg: Config) -> int:
    if cfg.iters:
        return cfg.iters
    return max(ITERS_MIN, min(ITERS_MAX, ITERS_MAX * ITERS_FULL_UP_TO // max(nbytes, 1)))


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def resolved(options: dict[str, int | str]) -> dict[str, int] | None:
    """Every setting as rsccl resolves it (the Options field, else the RSCCL_* variable, else
    the default; rsccl's own parser), or None where rsccl would refuse the options (the
    group's creation then fails and says why)."""
    try:
        return dict(_rsccl.resolve_options(as_items(options)))
    except ValueError:
        return None


def options_text(options: dict[str, int | str]) -> str:
    return ", ".join(f"{k}={human(v) if isinstance(v, int) else v}" for k, v in options.items())


def one_shot_limit(world: int, options: dict[str, int | str]) -> int | None:
    """The all_reduce size up to which rsccl runs one-shot (staged even on pool buffers: in
    place applies to two-shot only), as rsccl resolves it (rust/core/src/cuda/engine.rs,
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
    torch's caching allocator keeps of earlier sizes), and a VA cap that fits world x (buffer +
    pool) with a margin, never below rsccl's default. Empty when there are no rsccl-pool rows.
    Fields the user set with --rsccl-options are left as given."""
    sizes = pool_sizes(cfg)
    if not sizes:
        return {}
    user = cfg.rsccl_options
    out: dict[str, int | str] = {}
    if "cuda_pool_bytes" not in user:
        out["cuda_pool_bytes"] = round_up(2 * max(sizes) + 64 * MiB, GRANULE)
    if "max_cuda_va_bytes" not in user:
        r = resolved({**user, **out})
        # Options rsccl would refuse: assume 4 GiB for what cannot be read (creation fails anyway).
        pool = r["cuda_pool_bytes"] if r else int(out.get("cuda_pool_bytes", 4 << 30))
        buf = r["cuda_buffer_bytes"] if r else 4 << 30
        need = world * round_up(pool + buf, GRANULE)
        out["max_cuda_va_bytes"] = max(POOL_VA_FLOOR, need + (1 << 30))
    return out


# -- inside a rank ---------------------------------------------------------------------------


def snapshot(label: str) -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"label": label, "used": total - free, "total": total, "va": mapped_va_bytes(), "torch_reserved": torch.cuda.memory_reserved()}


class Agree:
    """Barriers and agreements among the ranks over gloo (CPU): they never touch a GPU."""

    def __init__(self, gloo: dist.ProcessGroup):
        self.gloo = gloo

    def barrier(self) -> None:
        dist.barrier(group=self.gloo)

    def first_error(self, err: str) -> str:
        """The empty string if no rank had an error, else the first failing rank's, naming it."""
        errs = self.gather(err)
        bad = [(r, e) for r, e in enumerate(errs) if e]
        if not bad:
            return ""
        r, e = bad[0]
        more = f" (and {len(bad) - 1} more ranks)" if len(bad) > 1 else ""
        return f"rank {r}{more}: {e}"

    def max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.gloo)
        return t.tolist()

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size(self.gloo)
        dist.all_gather_object(out, obj, group=self.gloo)
        return out


Call = Callable[[], Any]


@dataclass
class Bufs:
    """One (collective, size)'s tensors, shared by the backends (zeros: repeated in-place
    sums of zeros stay finite)."""

    collective: str
    inp: torch.Tensor
    out: torch.Tensor


def make_bufs(collective: str, counts: tuple[int, int], dtype: torch.dtype, dev: torch.device) -> Bufs:
    inp = torch.zeros(counts[0], dtype=dtype, device=dev)
    in_place = collective in ("all_reduce", "broadcast")
    return Bufs(collective, inp, inp if in_place else torch.zeros(counts[1], dtype=dtype, device=dev))


def make_pool_bufs(collective: str, counts: tuple[int, int], dtype: torch.dtype, dev: torch.device, pool: Any) -> Bufs:
    """The buffer rsccl uses in place comes from the pool (all_reduce: the tensor, all_gather:
    the output, reduce_scatter: the input), the other from torch's allocator as usual. Every
    rank allocates the same sizes in the same order, so the pool buffers have the same offset
    on every rank."""
    pooled = counts[1] if collective == "all_gather_into_tensor" else counts[0]
    with torch.cuda.use_mem_pool(pool):
        big = torch.zeros(pooled, dtype=dtype, device=dev)
    if collective in ("all_reduce", "broadcast"):
        return Bufs(collective, big, big)
    if collective == "all_gather_into_tensor":
        return Bufs(collective, torch.zeros(counts[0], dtype=dtype, device=dev), big)
    return Bufs(collective, big, torch.zeros(counts[1], dtype=dtype, device=dev))


class Backend:
    """A way to run the benchmarked collectives: a process group, or a symmetric-memory op."""

    def __init__(self, name: str, group: Any = None, symm: Any = None, pool: Any = None):
        self.name = name
        self.group = group  # None: the default group (rsccl)
        self.symm = symm  # SymmSetup for the symm-* backends
        self.pool = pool  # rsccl-pool: the default group's rsccl.mem_pool(), where its buffers come from
        self.graph_failed = ""  # why capture failed once (then it is not tried again)

    @property
    def is_symm(self) -> bool:
        return self.symm is not None

    def supports(self, collective: str, nbytes: int) -> bool:
        if self.is_symm:
            return collective == "all_reduce" and nbytes <= self.symm.max_bytes
        if self.pool is not None:
            return collective in POOL_COLLECTIVES and nbytes >= POOL_MIN_BYTES
        if self.name in SWEEP:
            return collective == "all_reduce"
        return True

    def call(self, b: Bufs, async_op: bool = False) -> Call:
        if self.is_symm:
            n = b.inp.numel()
            buf, name = self.symm.buf[:n], self.symm.group_name
            if self.name == "symm-1shot":
                out = self.symm.out[:n]
                return lambda: torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", name, out)
            return lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name)
        g, inp, out = self.group, b.inp, b.out
        if b.collective == P2P:
            me = dist.get_rank()
            if me > 1:
                return lambda: None  # only ranks 0 and 1 take part
            if me == 0:
                return (lambda: dist.isend(inp, dst=1, group=g).wait()) if async_op else (lambda: dist.send(inp, dst=1, group=g))
            return (lambda: dist.irecv(out, src=0, group=g).wait()) if async_op else (lambda: dist.recv(out, src=0, group=g))
        if b.collective == "all_reduce":
            fn: Call = lambda: dist.all_reduce(inp, group=g, async_op=async_op)
        elif b.collective == "broadcast":
            fn = lambda: dist.broadcast(inp, src=0, group=g, async_op=async_op)
        elif b.collective == "all_gather_into_tensor":
            fn = lambda: dist.all_gather_into_tensor(out, inp, group=g, async_op=async_op)
        elif b.collective == A2A:
            fn = lambda: dist.all_to_all_single(out, inp, group=g, async_op=async_op)
        else:
            fn = lambda: dist.reduce_scatter_tensor(out, inp, group=g, async_op=async_op)
        if async_op:
            return lambda: fn().wait()
        return fn

    def bufs(self, collective: str, counts: tuple[int, int], dtype: torch.dtype, dev: torch.device) -> Bufs:
        if self.pool is not None:
            return make_pool_bufs(collective, counts, dtype, dev, self.pool)
        return make_bufs(collective, counts, dtype, dev)

    def run_on(self, collective: str, x: torch.Tensor, counts: tuple[int, int], dev: torch.device) -> torch.Tensor:
        """The collective's result on input `x` (for the correctness check)."""
        if self.is_symm:
            n = x.numel()
            self.symm.buf[:n].copy_(x)
            self.call(Bufs(collective, x, x))()
            res = self.symm.out[:n] if self.name == "symm-1shot" else self.symm.buf[:n]
            return res.clone()
        b = self.bufs(collective, counts, x.dtype, dev)
        b.inp.copy_(x)
        self.call(b)()
        return b.out


@dataclass
class SymmSetup:
    group_name: str
    buf: torch.Tensor  # symmetric memory, rendezvoused on the NCCL group
    out: torch.Tensor  # one-shot's output
    max_bytes: int


def setup_symm(nccl: Any, max_bytes: int, dtype: torch.dtype, dev: torch.device, agree: Agree) -> tuple[SymmSetup | None, str]:
    """Torch's symmetric memory for all_reduce on the NCCL group's ranks, or (None, why not).
    Every step is agreed among the ranks, so that none waits in a rendezvous another left."""
    import torch.distributed._symmetric_memory as symm_mem

    err = ""
    if dtype not in (torch.bfloat16, torch.float32):
        err = f"its all_reduce ops take bfloat16 and float32, not {dtype}"
    elif not all(hasattr(torch.ops.symm_mem, op) for op in ("one_shot_all_reduce_out", "two_shot_all_reduce_")):
        err = "torch.ops.symm_mem lacks one_shot_all_reduce_out or two_shot_all_reduce_"
    if err := agree.first_error(err):
        return None, err
    name = nccl.group_name
    elem = torch.empty(0, dtype=dtype).element_size()
    n = max_bytes // elem
    buf = out = torch.empty(0, dtype=dtype, device=dev)
    try:
        buf = symm_mem.empty(n, dtype=dtype, device=dev)
        out = torch.empty(n, dtype=dtype, device=dev)
    except Exception as e:  # noqa: BLE001 - reported, the benchmark goes on without it
        err = f"symm_mem.empty: {describe(e)}"
    if err := agree.first_error(err):
        return None, err
    try:
        try:
            symm_mem.rendezvous(buf, name)
        except RuntimeError as e:
            # torch 2.11 finds the group by its name; older versions need it enabled first.
            if "group info" not in str(e):
                raise
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(name)
            symm_mem.rendezvous(buf, name)
    except Exception as e:  # noqa: BLE001
        err = f"rendezvous: {describe(e)}"
    if err := agree.first_error(err):
        return None, err
    setup = SymmSetup(name, buf, out, max_bytes)
    try:
        buf.zero_()
        small = Bufs("all_reduce", buf[:1024], buf[:1024])
        Backend("symm-1shot", symm=setup).call(small)()
        Backend("symm-2shot", symm=setup).call(small)()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        err = f"first call: {describe(e)}"
    if err := agree.first_error(err):
        return None, err
    return setup, ""


def timed(call: Call, n: int, cfg: Config, agree: Agree) -> float:
    """Median over repeats of the slowest rank's seconds per call, n calls per repeat."""
    return event_timed(call, n, cfg, agree)


def event_timed(step: Call, per_step: int, cfg: Config, agree: Agree, steps: int | None = None) -> float:
    """Median over repeats of the slowest rank's seconds per call: CUDA events around
    `steps` runs of `step` (default: `per_step` runs, one call each), the time divided by
    `per_step`, the number of calls those runs make."""
    runs = steps if steps is not None else per_step
    times = []
    for _ in range(cfg.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        agree.barrier()
        start.record()
        for _ in range(runs):
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_step)
    return statistics.median(agree.max(times))


def graph_timed(call: Call, cfg: Config, agree: Agree) -> tuple[float | None, str]:
    """(seconds per call replaying a graph of GRAPH_CALLS calls, "") or (None, why it failed)."""
    err = ""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        err = f"warm-up on a side stream: {describe(e)}"
    if err := agree.first_error(err):
        return None, err
    agree.barrier()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(GRAPH_CALLS):
                call()
    except Exception as e:  # noqa: BLE001
        err = f"capture: {describe(e)}"
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        err += f"; synchronize after capture: {describe(e)}"
    if err := agree.first_error(err):
        return None, err
    torch.cuda.synchronize()
    agree.barrier()
    graph.replay()  # the first replay uploads the graph
    per_call = event_timed(graph.replay, GRAPH_REPLAYS * GRAPH_CALLS, cfg, agree, steps=GRAPH_REPLAYS)
    del graph
    return per_call, ""


def close(got: torch.Tensor, ref: torch.Tensor, collective: str, dtype: str, world: int) -> tuple[bool, float]:
    """(matches, max |difference|). Gathers, broadcast, all_to_all and send/recv move bytes: exact. Reductions may
    add in another order (and round once or at every step): TOLERANCES, atol scaled by world."""
    diff = (got.float() - ref.float()).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    if collective in EXACT_COLLECTIVES:
        return bool(torch.equal(got, ref)), worst
    rtol, atol = TOLERANCES[dtype]
    ok = bool(torch.allclose(got.float(), ref.float(), rtol=rtol, atol=atol * world / 2))
    return ok and math.isfinite(worst), worst


class Rank:
    """Everything one rank does; rank 0 also records the results."""

    def __init__(self, rank: int, world: int, cfg: Config, result_path: str):
        self.rank, self.world, self.cfg, self.result_path = rank, world, cfg, result_path
        self.dev = torch.device("cuda", rank)
        self.dtype = getattr(torch, cfg.dtype)
        self.rows: dict[str, dict] = {}
        self.meta: dict[str, Any] = {}
        self.t0 = time.perf_counter()

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[w{self.world} {time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)

    def save(self, done: bool = False) -> None:
        if self.rank != 0:
            return
        tmp = self.result_path + ".tmp"
        Path(tmp).write_text(json.dumps({"meta": self.meta, "rows": list(self.rows.values()), "done": done}))
        os.replace(tmp, self.result_path)

    def row(self, collective: str, nbytes: int, backend: str) -> dict:
        key = f"{collective}|{nbytes}|{backend}"
        if key not in self.rows:
            self.rows[key] = {
                "world_size": self.world,
                "collective": collective,
                "bytes": nbytes,
                "backend": backend,
                "eager_s": None,
                "async_s": None,
                "graph_s": None,
                "graph_note": "",
                "iters": 0,
                "check": "-",
                "note": "",
                # rsccl-pool: calls memory_stats() counted in place / staged (None: not counted)
                "inplace_calls": None,
                "staged_calls": None,
            }
            if backend == POOL_BACKEND and collective == "all_reduce":
                limit = one_shot_limit(self.world, self.cfg.rsccl_options)
                if limit is not None and nbytes <= limit:
                    self.rows[key]["one_shot"] = True  # staged by design: in place is two-shot only
        return self.rows[key]

    def path_counts(self) -> tuple[int, int] | None:
        """(in-place, staged) CUDA collectives of the default rsccl group so far, or None if
        rsccl.memory_stats() does not report them. Synchronizes the device."""
        import rsccl

        try:
            st = rsccl.memory_stats()
            return int(st["cuda_inplace_collectives"]), int(st["cuda_staged_collectives"])
        except Exception:  # noqa: BLE001 - the row then says the path is unknown
            return None

    def add_path(self, row: dict, before: tuple[int, int] | None) -> None:
        """Add the calls made since `before` (path_counts()) to the row's in-place/staged counts."""
        after = self.path_counts()
        if before is None or after is None:
            row["note"] = (
                row["note"]
                if "path n/a" in row["note"]
                else "; ".join(filter(None, (row["note"], "path n/a (memory_stats has no cuda_inplace_collectives)")))
            )
            return
        row["inplace_calls"] = (row["inplace_calls"] or 0) + after[0] - before[0]
        row["staged_calls"] = (row["staged_calls"] or 0) + after[1] - before[1]

    # -- setup and memory ---------------------------------------------------------------------

    def setup(self, port: int) -> None:
        import rsccl
        from rsccl import Options

        cfg, dev, dt = self.cfg, self.dev, self.dtype
        torch.cuda.set_device(self.rank)
        torch.zeros(1, device=dev)  # the CUDA context
        elem = torch.empty(0, dtype=dt).element_size()
        n = PROBE_BYTES // elem
        n -= n % self.world
        # The probes exist before the first snapshot, so that no delta counts them.
        probes = {
            "all_reduce": make_bufs("all_reduce", (n, n), dt, dev),
            "all_gather": make_bufs("all_gather_into_tensor", (n // self.world, n), dt, dev),
            "reduce_scatter": make_bufs("reduce_scatter_tensor", (n, n // self.world), dt, dev),
        }
        mem = [snapshot("before init")]
        timeout = timedelta(seconds=cfg.timeout_s)
        store = dist.TCPStore("127.0.0.1", port, self.world, False, timeout=timeout, wait_for_workers=False)
        user: dict[str, Any] = dict(cfg.rsccl_options)
        # The default group gets a pool for the rsccl-pool rows; nothing else differs from --rsccl-options.
        extra = pool_options(cfg, self.world)
        pool_note = (
            ""
            if pool_sizes(cfg)
            else ("none (--no-pool)" if not cfg.pool else f"none (no pooled collective, or no size >= {human(POOL_MIN_BYTES)})")
        )
        try:
            opts = Options(**{**user, **extra}) if (user or extra) else None
            dist.init_process_group("rsccl", store=store, rank=self.rank, world_size=self.world, timeout=timeout, pg_options=opts)
        except Exception as e:  # retried below without the pool, so the rest still runs
            if not extra:
                raise
            pool_note = f"n/a: the default group with {extra} failed: {describe(e)}"
            print(
                f"rank {self.rank}: rsccl.bench: {pool_note}; creating it without a pool (no rsccl-pool rows)", file=sys.stderr, flush=True
            )
            extra = {}
            opts = Options(**user) if user else None
            dist.init_process_group("rsccl", store=store, rank=self.rank, world_size=self.world, timeout=timeout, pg_options=opts)
        mem.append(snapshot("rsccl: after init"))
        self.log(f"rsccl initialized ({human(mem[-1]['used'] - mem[0]['used'])} more device memory)")
        # The harness's own group (CPU only), before rsccl's first collectives so that their
        # failures can be agreed on; the deltas of those start from the snapshot after it.
        self.gloo = dist.new_group(backend="gloo", timeout=timeout)
        self.agree = Agree(self.gloo)
        mem.append(snapshot("gloo group created"))
        pool_backend = None
        if pool_sizes(cfg) and not pool_note:
            err = ""
            try:
                pool_backend = Backend(POOL_BACKEND, pool=rsccl.mem_pool())
            except Exception as e:  # noqa: BLE001 - agreed and reported; the rows are left out
                err = f"rsccl.mem_pool(): {describe(e)}"
            if err := self.agree.first_error(err):
                pool_backend, pool_note = None, f"n/a: {err}"
                self.log(f"rsccl-pool rows left out: {err}")
            else:
                given = {**user, **extra}
                pool_note = options_text({k: v for k, v in given.items() if k in ("cuda_pool_bytes", "max_cuda_va_bytes")})
                pool_note = f"default group with {pool_note or 'the pool from the environment'}"
                self.log(f"rsccl-pool rows on the default group's pool ({pool_note})")
        rs = Backend("rsccl")
        for what, b in probes.items():
            failed = " (FAILED)" if self.guarded(rs, f"first {what} ({human(PROBE_BYTES)})", rs.call(b)) else ""
            mem.append(snapshot(f"rsccl: after first {what}{failed}"))
        stats = dict(rsccl.memory_stats())
        mem.append(snapshot("nccl: before init"))
        self.nccl = dist.new_group(backend="nccl", timeout=timeout, device_id=dev)
        mem.append(snapshot("nccl: after init"))
        nc = Backend("nccl", self.nccl)
        for what, b in probes.items():
            nc.call(b)()
            mem.append(snapshot(f"nccl: after first {what}"))
        self.log(f"nccl initialized: {nccl_baseline(self.nccl)}")
        del probes
        self.backends = [rs] + ([pool_backend] if pool_backend is not None else [])
        if cfg.sweep_one_shot and "all_reduce" in cfg.collectives:
            for name, threshold in SWEEP.items():
                g = dist.new_group(
                    backend="rsccl", timeout=timeout, pg_options=Options(**{**user, "cuda_allreduce_one_shot_max_bytes": threshold})
                )
                self.backends.append(Backend(name, g))
        self.backends.append(nc)
        symm_note = "all_reduce not benchmarked"
        ar_sizes = [s for s in cfg.sizes if s <= cfg.symm_max_bytes]
        if "all_reduce" in cfg.collectives and ar_sizes:
            mem.append(snapshot("symm: before setup"))
            symm, why = setup_symm(self.nccl, max(ar_sizes), dt, dev, self.agree)
            if symm is None:
                symm_note = f"n/a: {why}"
                self.log(f"torch symmetric memory: {symm_note}")
            else:
                mem.append(snapshot(f"symm: after setup ({human(max(ar_sizes))} buffer)"))
                symm_note = f"buffer {human(max(ar_sizes))}, group {symm.group_name}"
                self.backends += [Backend(name, symm=symm) for name in SYMM_BACKENDS]
                self.log(f"torch symmetric memory ready ({symm_note})")
        elif "all_reduce" in cfg.collectives:
            symm_note = f"n/a: no all_reduce size <= --symm-max-bytes {human(cfg.symm_max_bytes)}"
        mems = self.agree.gather(mem)
        all_stats = self.agree.gather(stats)
        self.meta = {
            "gpu": torch.cuda.get_device_name(dev),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "nccl_backend": nccl_baseline(self.nccl),
            "rsccl": rsccl.__version__,
            "python": platform.python_version(),
            "memory": mems,
            "rsccl_memory_stats": all_stats,
            "symm": symm_note,
            "backends": [b.name for b in self.backends],
            "graph_failures": {},
            "pool": pool_note,
        }
        if self.rank == 0:
            print(f"rsccl.memory_stats() per rank: {json.dumps(all_stats)}", flush=True)
        self.save()

    # -- measurements -------------------------------------------------------------------------

    def guarded(self, b: Backend, what: str, fn: Call) -> str:
        """Run fn on every rank; "" if it worked on all, else the first failing rank's error,
        which every rank gets (so that all skip together). NCCL is the reference: its
        failure ends the run."""
        err = ""
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - agreed, recorded and reported below
            err = describe(e)
        err = self.agree.first_error(err)
        if err:
            if b.name == "nccl":
                raise RuntimeError(f"nccl failed ({what}): {err}")
            self.log(f"FAILED: {b.name} {what}: {err}")
        return err

    def check(self, collective: str, counts: tuple[int, int], nbytes: int, gen: torch.Generator) -> None:
        x = torch.randn(counts[0], generator=gen, device=self.dev, dtype=torch.float32).to(self.dtype)
        ref = Backend("nccl", self.nccl).run_on(collective, x, counts, self.dev)
        for b in self.backends:
            if b.name == "nccl" or not b.supports(collective, nbytes):
                continue
            row = self.row(collective, nbytes, b.name)
            got: list[torch.Tensor] = []

            def run(b: Backend = b, got: list[torch.Tensor] = got) -> None:
                got.append(b.run_on(collective, x, counts, self.dev))

            before = self.path_counts() if b.pool is not None else None
            err = self.guarded(b, f"{collective} {human(nbytes)} (check)", run)
            if b.pool is not None:
                self.add_path(row, before)
            if err:
                row["check"], row["note"] = "fail", f"check: {err}"
                continue
            ok, worst = close(got[0], ref, collective, self.cfg.dtype, self.world)
            oks = self.agree.gather((ok, worst))
            if all(o for o, _ in oks):
                row["check"] = "ok"
                continue
            row["check"] = "WRONG"
            bad = ", ".join(f"rank {r}: max |diff| {w:.3g}" for r, (o, w) in enumerate(oks) if not o)
            row["note"] = f"differs from nccl ({bad})"
            if self.rank == 0:
                bar = "!" * 100
                print(
                    f"{bar}\nWRONG RESULT: {b.name} {collective} {human(nbytes)} world {self.world}: differs from "
                    f"nccl on the same input, seed {self.cfg.seed} ({bad})\n{bar}",
                    flush=True,
                )
        self.row(collective, nbytes, "nccl")["check"] = "ref"

    def eager(self, collective: str, counts: tuple[int, int], nbytes: int) -> None:
        cfg = self.cfg
        bufs = make_bufs(collective, counts, self.dtype, self.dev)
        n = iters_for(nbytes, cfg)
        self.zero_symm()
        what = f"{collective} {human(nbytes)}"
        for b in self.backends:
            if not b.supports(collective, nbytes):
                continue
            row = self.row(collective, nbytes, b.name)
            if b.pool is None:
                self.eager_one(b, row, bufs, n, what)
                continue
            own = self.pool_bufs(b, row, collective, counts, f"{what} (eager)", "eager")
            if own is not None:
                before = self.path_counts()
                self.eager_one(b, row, own, n, what)
                self.add_path(row, before)
            del own

    def pool_bufs(self, b: Backend, row: dict, collective: str, counts: tuple[int, int], what: str, key: str) -> Bufs | None:
        """rsccl-pool's buffers (every rank allocates them, in the same order), or None when that
        failed on any rank (a full pool: recorded in the row under `key`)."""
        got: list[Bufs] = []
        if err := self.guarded(b, f"{what}: pool buffers", lambda: got.append(b.bufs(collective, counts, self.dtype, self.dev))):
            row["note"] = "; ".join(filter(None, (row["note"], f"{key}: pool buffers: {err}")))
            return None
        return got[0]

    def eager_one(self, b: Backend, row: dict, bufs: Bufs, n: int, what: str) -> None:
        cfg = self.cfg
        sync = b.call(bufs)

        def warm(call: Call = sync) -> None:
            for _ in range(cfg.warmup):
                call()

        if err := self.guarded(b, f"{what} (eager)", warm):
            row["note"] = "; ".join(filter(None, (row["note"], f"eager: {err}")))
            return
        row["eager_s"] = timed(sync, n, cfg, self.agree)
        row["iters"] = n * cfg.repeats
        if b.is_symm:
            return
        calls = b.call(bufs, async_op=True)
        if err := self.guarded(b, f"{what} (async)", calls):
            row["note"] = "; ".join(filter(None, (row["note"], f"async: {err}")))
            return
        row["async_s"] = timed(calls, n, cfg, self.agree)

    def zero_symm(self) -> None:
        """The check left random data in the symmetric buffer, which two-shot sums in place
        at every call: back to zeros, which stay finite."""
        for b in self.backends:
            if b.is_symm:
                b.symm.buf.zero_()
                return

    def graphs(self, collective: str, counts: tuple[int, int], nbytes: int) -> None:
        bufs = make_bufs(collective, counts, self.dtype, self.dev)
        self.zero_symm()
        for b in self.backends:
            if not b.supports(collective, nbytes):
                continue
            row = self.row(collective, nbytes, b.name)
            if b.graph_failed:
                row["graph_note"] = "fail (capture failed before)"
                continue
            own, before = bufs, None
            if b.pool is not None:
                pooled = self.pool_bufs(b, row, collective, counts, f"{collective} {human(nbytes)} (graph)", "graph")
                if pooled is None:
                    row["graph_note"] = "fail (pool buffers)"
                    continue
                own, before = pooled, self.path_counts()
            t, why = graph_timed(b.call(own), self.cfg, self.agree)
            if b.pool is not None:
                self.add_path(row, before)
            del own
            if t is None:
                b.graph_failed = why
                row["graph_note"] = "fail"
                self.meta["graph_failures"][b.name] = f"{collective} {human(nbytes)}: {why}"
                self.log(f"CUDA graph capture FAILED for {b.name} ({collective}, {human(nbytes)}): {why}")
            else:
                row["graph_s"] = t

    def run(self) -> None:
        cfg = self.cfg
        gen = torch.Generator(device=self.dev).manual_seed(cfg.seed * 1009 + self.rank)
        elem = torch.empty(0, dtype=self.dtype).element_size()
        cases: list[tuple[str, tuple[int, int], int]] = []
        for collective in cfg.collectives:
            sizes = cfg.sizes
            if collective == A2A:
                sizes = tuple(x for x in cfg.sizes if x <= A2A_MAX_BYTES)
            elif collective == P2P:
                sizes = tuple(x for x in P2P_SIZES if cfg.sizes[0] <= x <= cfg.sizes[-1])
            for size in sizes:
                counts = numels(collective, size, self.world, elem)
                if counts is not None:
                    nbytes = (counts[1] if collective == "all_gather_into_tensor" else counts[0]) * elem
                    cases.append((collective, counts, nbytes))
        for collective, counts, nbytes in cases:
            start = time.perf_counter()
            if nbytes <= cfg.check_max_bytes:
                self.check(collective, counts, nbytes, gen)
            self.eager(collective, counts, nbytes)
            cells = []
            for b in self.backends:
                r = self.rows.get(f"{collective}|{nbytes}|{b.name}")
                if r:
                    flag = " WRONG" if r["check"] == "WRONG" else (" check FAILED" if r["check"] == "fail" else "")
                    path = f" {path_label(r).split(' (')[0]}" if b.pool is not None and path_label(r) else ""
                    cells.append(f"{SHORT[b.name]} {time_cell(r, 'eager_s')}{path}{flag}")
            self.log(f"{collective:<22} {human(nbytes):>9}: {' | '.join(cells)} us  ({time.perf_counter() - start:.1f} s)")
            self.save()
            torch.cuda.empty_cache()
        if cfg.graph:
            for collective, counts, nbytes in cases:
                if nbytes <= cfg.graph_max_bytes:
                    self.graphs(collective, counts, nbytes)
            self.log("CUDA graph measurements done")
            self.save()
        if cfg.fsdp is not None:
            self.fsdp()

    def fsdp(self) -> None:
        """The FSDP2 section, last (a failure there cannot disturb the measurements above).
        Its phases are agreed among the ranks; anything else that escapes is recorded too."""
        torch.cuda.empty_cache()
        try:
            run_fsdp(self)
        except Exception as e:  # noqa: BLE001 - recorded; the results above are already saved
            print(f"rank {self.rank}: FSDP2 section failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            config = asdict(self.cfg.fsdp) if self.cfg.fsdp is not None else {}
            fsdp = self.meta.setdefault("fsdp", {"config": config, "runs": {}, "errors": {}})
            fsdp.setdefault("errors", {})["section"] = describe(e)
            self.log(f"FSDP2 section FAILED: {describe(e)}")
        self.save()


def rank_main(rank: int, world: int, port: int, cfg: Config, result_path: str) -> None:
    os.environ.update(GPU_ENV)  # inherited already; kept for a rank started some other way
    r = Rank(rank, world, cfg, result_path)
    try:
        r.setup(port)
        r.run()
    except BaseException:
        # mp.spawn reports the first failing rank's traceback; print every rank's.
        print(f"rank {rank} of {world} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    r.save(done=True)
    r.log("done")
    del r  # the symmetric-memory buffer goes before its group
    try:
        torch.cuda.synchronize()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the results are saved; teardown trouble is only reported
        print(f"rank {rank}: destroy_process_group: {describe(e)}", file=sys.stderr, flush=True)


# -- in the parent ---------------------------------------------------------------------------


def read_results(path: str) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def run_world(world: int, cfg: Config) -> tuple[dict | None, str]:
    """(rank 0's results or None, "" or why the world did not finish)."""
    with tempfile.TemporaryDirectory(prefix="rsccl-bench-cuda-") as tmp:
        path = os.path.join(tmp, "results.json")
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=cfg.timeout_s), wait_for_workers=False)
        ctx = mp.start_processes(rank_main, args=(world, store.port, cfg, path), nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + cfg.timeout_s + (FSDP_ALLOWANCE_S if cfg.fsdp is not None else 0.0)
        done_at: float | None = None
        error = ""
        try:
            while not ctx.join(timeout=2):
                now = time.monotonic()
                if done_at is None and (read_results(path) or {}).get("done"):
                    done_at = now
                if done_at is not None and now - done_at > DONE_GRACE_S:
                    error = f"ranks still running {DONE_GRACE_S:.0f} s after the results were written: stopped"
                    break
                if now > deadline:
                    error = f"did not finish within --timeout {cfg.timeout_s:.0f} s: stopped"
                    break
        except ProcessException as e:
            error = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
            print(f"{e}", file=sys.stderr, flush=True)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(10)
        del store
        results = read_results(path)
        if results is not None and not results.get("done") and not error:
            error = "ranks exited before finishing"
        if results is not None and results.get("done") and error.startswith("ranks still running"):
            print(f"note: world size {world}: {error}", flush=True)
            error = ""
        return results, error


def add_bandwidth(rows: list[dict]) -> list[dict]:
    nccl = {(r["collective"], r["bytes"]): r["eager_s"] for r in rows if r["backend"] == "nccl"}
    out = []
    for r in rows:
        t = r["eager_s"]
        algbw = r["bytes"] / t / 1e9 if t else None
        busbw = algbw * bus_factor(r["collective"], r["world_size"]) if algbw is not None else None
        ref = nccl.get((r["collective"], r["bytes"]))
        out.append(dict(r, algbw_GBps=algbw, busbw_GBps=busbw, vs_nccl=(ref / t) if (t and ref) else None))
    return out


def fmt(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v * scale:.{digits}f}"


def time_cell(r: dict, key: str) -> str:
    """A latency in us, "fail" when that measurement failed, else "n/a" (not run)."""
    if r[key] is not None:
        return fmt(r[key], 1e6)
    return "fail" if f"{key.removesuffix('_s')}:" in r["note"] else "n/a"


def path_label(r: dict) -> str:
    """rsccl-pool rows: how memory_stats() counted their calls ("inplace", "STAGED", "MIXED ...";
    "staged (one-shot)" for an all_reduce small enough for the one-shot kernel, which rsccl
    always stages)."""
    i, s = r.get("inplace_calls"), r.get("staged_calls")
    if i is None or s is None:
        return ""
    if i and not s:
        return "inplace"
    if s and not i:
        return "staged (one-shot)" if r.get("one_shot") else "STAGED"
    return f"MIXED ({i} inplace, {s} staged)" if i else "NOT COUNTED (0 inplace, 0 staged)"


def path_ok(r: dict) -> bool:
    """The row ran the way rsccl should run it on pool buffers."""
    return path_label(r) in ("inplace", "staged (one-shot)")


def note_of(r: dict) -> str:
    """The note column: the in-place/staged label first, then what went wrong."""
    return "; ".join(filter(None, (path_label(r), r["note"])))


def failed_rows(rows: list[dict]) -> list[dict]:
    """rsccl rows that failed or gave a wrong result (symmetric memory's failures are only reported)."""
    return [
        r
        for r in rows
        if r["backend"].startswith("rsccl") and (r["check"] in ("WRONG", "fail") or "eager:" in r["note"] or "async:" in r["note"])
    ]


def graph_cell(r: dict, cfg: Config) -> str:
    if r["graph_s"] is not None:
        return fmt(r["graph_s"], 1e6)
    if r["graph_note"]:
        return r["graph_note"].split(" ")[0]  # "fail"
    return "n/a" if (not cfg.graph or r["bytes"] > cfg.graph_max_bytes) else ""


def first_snapshot(snaps: list[dict], backend: str, what: str) -> dict | None:
    return next((s for s in snaps if s["label"].startswith(f"{backend}: after first {what}")), None)


def before_first(snaps: list[dict], backend: str) -> dict | None:
    """The snapshot just before the backend's first collective."""
    for k, s in enumerate(snaps):
        if s["label"].startswith(f"{backend}: after first") and k > 0:
            return snaps[k - 1]
    return None


def memory_table(meta: dict) -> list[str]:
    """Per rank: device memory each backend holds after init and adds at its first
    collectives; VA added by init."""
    lines = [
        (
            "| backend | rank | held after init MiB | + first all_reduce | + first all_gather | + first reduce_scatter "
            "| VA added by init GiB | VA added by first collectives GiB |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    symm_lines = []
    for rank, snaps in enumerate(meta.get("memory", [])):
        by = {s["label"]: s for s in snaps}
        for backend, before in (("rsccl", "before init"), ("nccl", "nccl: before init")):
            b, i = by.get(before), by.get(f"{backend}: after init")
            if not (b and i):
                continue
            firsts = [first_snapshot(snaps, backend, w) for w in ("all_reduce", "all_gather", "reduce_scatter")]
            start = before_first(snaps, backend) or i
            prev, cells = start, []
            for f in firsts:
                cells.append(f"{(f['used'] - prev['used']) / MiB:+.0f}{' FAILED' if 'FAILED' in f['label'] else ''}" if f else "n/a")
                prev = f or prev
            va_first = (prev["va"] - start["va"]) / 2**30
            lines.append(
                f"| {backend} | {rank} | {(i['used'] - b['used']) / MiB:.0f} | {' | '.join(cells)} "
                f"| {(i['va'] - b['va']) / 2**30:.2f} | {va_first:+.2f} |"
            )
        before_symm = by.get("symm: before setup")
        after_symm = [s for s in snaps if s["label"].startswith("symm: after setup")]
        if before_symm and after_symm:
            a = after_symm[0]
            symm_lines.append(
                f"rank {rank}: {a['label']}: +{(a['used'] - before_symm['used']) / MiB:.0f} MiB device, "
                f"+{(a['va'] - before_symm['va']) / 2**30:.2f} GiB VA"
            )
    if symm_lines:
        lines += ["", "torch symmetric memory (its buffer included): " + "; ".join(symm_lines)]
    pools = pool_per_rank(meta)
    if any(pools):
        lines += [
            "",
            (
                "rsccl's \"held after init\" includes the default group's pool, made for the rsccl-pool rows "
                "(cuda_pool_bytes per rank, from memory_stats(); mapped at creation; --no-pool leaves it out): "
                + ", ".join(f"rank {k} {v / MiB:.0f} MiB" for k, v in enumerate(pools))
            ),
        ]
    return lines


def pool_per_rank(meta: dict) -> list[int]:
    """The default rsccl group's pool bytes per rank, as memory_stats() reported them (0: none)."""
    return [int(st.get("cuda_pool_bytes", 0) or 0) for st in meta.get("rsccl_memory_stats", [])]


def memory_summary(world: int, meta: dict) -> str:
    """One line: max over ranks of what each backend holds after init and adds at first use."""
    vals: dict[str, list[tuple[float, float, float]]] = {"rsccl": [], "nccl": []}
    for snaps in meta.get("memory", []):
        by = {s["label"]: s for s in snaps}
        for backend, before in (("rsccl", "before init"), ("nccl", "nccl: before init")):
            b, i = by.get(before), by.get(f"{backend}: after init")
            start = before_first(snaps, backend)
            last = first_snapshot(snaps, backend, "reduce_scatter")
            if b and i and start and last:
                vals[backend].append(
                    (
                        (i["used"] - b["used"]) / MiB,
                        (last["used"] - start["used"]) / MiB,
                        (i["va"] - b["va"] + last["va"] - start["va"]) / 2**30,
                    )
                )
    parts = []
    pool = max(pool_per_rank(meta), default=0)
    for backend, v in vals.items():
        if v:
            of_pool = f" (its pool {pool / MiB:.0f} MiB of it)" if backend == "rsccl" and pool else ""
            parts.append(
                f"{backend} held {max(x[0] for x in v):.0f} MiB{of_pool}, +{max(x[1] for x in v):.0f} MiB at "
                f"first collectives, VA {max(x[2] for x in v):.1f} GiB"
            )
    return f"w{world} memory per rank (max over ranks): " + ("; ".join(parts) if parts else "n/a")


def header_lines(meta: dict, cfg: Config, command: str) -> list[str]:
    date = datetime.now().astimezone().isoformat(timespec="seconds")
    return [
        (
            f"- date {date}, host {platform.node()}, {meta.get('gpu', '?')}; torch {meta.get('torch', '?')} "
            f"(CUDA {meta.get('cuda', '?')}), NCCL {meta.get('nccl', '?')} as {meta.get('nccl_backend', 'ProcessGroupNCCL')}, rsccl {meta.get('rsccl', '?')}, "
            f"python {meta.get('python', '?')}"
        ),
        f"- command: `{command}`",
        f"- rsccl options: {cfg.rsccl_options or 'defaults'}; environment: "
        + " ".join(f"{k}={v}" for k, v in GPU_ENV.items())
        + "".join(f" {k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("RSCCL_")),
        (
            f"- message size = bytes of the all_reduce (and broadcast) tensor = the all_gather_into_tensor OUTPUT = "
            f"the reduce_scatter_tensor INPUT = the all_to_all_single input (even splits) = the message rank 0 sends "
            f"rank 1 (send_recv), per rank; dtype {cfg.dtype}; seed {cfg.seed}"
        ),
        (
            f"- eager: CUDA events around N back-to-back blocking calls after {cfg.warmup} warm-up calls, slowest rank, "
            f"median of {cfg.repeats}, per call; async: async_op=True + wait() per call; graph: {GRAPH_CALLS} calls "
            f"captured in one CUDA graph, {GRAPH_REPLAYS} replays per repeat (sizes <= {human(cfg.graph_max_bytes)}); "
            f"busbw from eager (nccl-tests factors); vs nccl = nccl eager time / this eager time; "
            f"check: same random input as nccl (sizes <= {human(cfg.check_max_bytes)}); "
            f"symm-1shot/-2shot: torch.ops.symm_mem.one_shot_all_reduce_out / two_shot_all_reduce_ "
            f"(sizes <= {human(cfg.symm_max_bytes)}); rsccl-pool: the default rsccl group on buffers from "
            f"rsccl.mem_pool() (sizes >= {human(POOL_MIN_BYTES)}; note: inplace / STAGED = how memory_stats() "
            f"counted its calls)"
        ),
        f"- torch symmetric memory: {meta.get('symm', 'n/a')}",
        f"- rsccl pool (rsccl-pool rows): {meta.get('pool', 'n/a')}",
    ]


def world_markdown(world: int, results: dict | None, rows: list[dict], error: str, cfg: Config, command: str) -> str:
    meta = (results or {}).get("meta", {})
    out = [f"# rsccl CUDA benchmark: world size {world}", ""] + header_lines(meta, cfg, command)
    if error:
        out += ["", f"**INCOMPLETE: {error}**"]
    bad = [r for r in rows if r["check"] in ("WRONG", "fail") or r["note"]]
    if bad:
        out += ["", "**WRONG RESULTS OR FAILURES:**", ""] + [
            f"- {r['backend']} {r['collective']} {human(r['bytes'])}: check {r['check']}; {r['note']}" for r in bad
        ]
    staged = [r for r in rows if r["backend"] == POOL_BACKEND and not path_ok(r)]
    if staged:
        out += ["", "**rsccl-pool rows NOT run in place** (memory_stats counted them otherwise):", ""] + [
            f"- {r['collective']} {human(r['bytes'])}: {path_label(r) or 'not counted'}" for r in staged
        ]
    for name, why in meta.get("graph_failures", {}).items():
        out += ["", f"CUDA graph capture failed for {name}: {why}"]
    for collective in dict.fromkeys(r["collective"] for r in rows):
        out += [
            "",
            f"## {collective}",
            "",
            "| size | backend | eager us | async us | graph us | busbw GB/s | algbw GB/s | vs nccl | check | iters | note |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---|",
        ]
        mine = [r for r in rows if r["collective"] == collective]
        for r in sorted(mine, key=lambda r: (r["bytes"], BACKEND_ORDER.index(r["backend"]))):
            vs = f"{r['vs_nccl']:.2f}x" if r["vs_nccl"] else ""
            note = note_of(r).replace("|", "/").replace("\n", " ")[:300]
            out.append(
                f"| {human(r['bytes'])} | {r['backend']} | {time_cell(r, 'eager_s')} | {time_cell(r, 'async_s')} "
                f"| {graph_cell(r, cfg)} | {fmt(r['busbw_GBps'], 1, 2)} | {fmt(r['algbw_GBps'], 1, 2)} "
                f"| {vs} | {r['check']} | {r['iters']} | {note} |"
            )
    if meta.get("memory"):
        out += [
            "",
            "## Memory per rank",
            "",
            (
                "Device memory used = total - free (torch.cuda.mem_get_info after synchronize; device-wide), "
                f"{human(PROBE_BYTES)} probes; VA = the process's mappings (/proc/self/maps)."
            ),
            "",
        ]
        out += memory_table(meta)
        out += ["", "Snapshots (MiB used, GiB VA, MiB torch reserved):", ""]
        for rank, snaps in enumerate(meta["memory"]):
            out.append(
                f"- rank {rank}: "
                + "; ".join(f"{s['label']} {s['used'] / MiB:.0f} / {s['va'] / 2**30:.1f} / {s['torch_reserved'] / MiB:.0f}" for s in snaps)
            )
        out += ["", "rsccl.memory_stats() (default group):", ""]
        for rank, st in enumerate(meta.get("rsccl_memory_stats", [])):
            out.append(f"- rank {rank}: `{json.dumps(st)}`")
    targets = rendered("targets", target_lines, world, rows)
    if targets:
        out += ["", "## Targets (all_to_all_single, send/recv)", ""] + [f"- {t.split(' target ', 1)[-1]}" for t in targets]
    out += rendered("in-place table", pool_markdown, rows)
    out += rendered("FSDP2 section", fsdp_markdown, meta.get("fsdp"), world)
    return "\n".join(out) + "\n"


def rendered(what: str, fn: Callable[..., list[str]], *args: Any) -> list[str]:
    """fn(*args), or one line saying why it could not be drawn: a report never fails the run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return ["", f"({what} could not be rendered: {describe(e)})"]


def pool_pairs(rows: list[dict]) -> list[tuple[dict, dict | None, dict | None]]:
    """(rsccl-pool row, rsccl row, nccl row) per pooled collective and size, in table order."""
    by = {(r["collective"], r["bytes"], r["backend"]): r for r in rows}
    pool = sorted(
        (r for r in rows if r["backend"] == POOL_BACKEND),
        key=lambda r: (POOL_COLLECTIVES.index(r["collective"]) if r["collective"] in POOL_COLLECTIVES else 9, r["bytes"]),
    )
    return [(r, by.get((r["collective"], r["bytes"], "rsccl")), by.get((r["collective"], r["bytes"], "nccl"))) for r in pool]


def ratio(num: dict | None, den: dict | None, key: str = "eager_s") -> float | None:
    """num's time / den's time (how many times faster den is), or None."""
    if not num or not den or not num.get(key) or not den.get(key):
        return None
    return num[key] / den[key]


def pool_markdown(rows: list[dict]) -> list[str]:
    pairs = pool_pairs(rows)
    if not pairs:
        return []
    out = [
        "",
        "## In place (rsccl-pool) vs staged (rsccl)",
        "",
        (
            "Same default rsccl group, same sizes, eager: rsccl on torch's buffers (staged through rsccl's buffer) and "
            "rsccl-pool on buffers from rsccl.mem_pool() (the all_reduce tensor, the all_gather output, the "
            "reduce_scatter input; the other buffer from torch), allocated in the same order on every rank. "
            "in-place/staged = rsccl us / rsccl-pool us; vs nccl = nccl us / rsccl-pool us; path = what "
            "rsccl.memory_stats() counted for rsccl-pool's calls (cuda_inplace_collectives / "
            f"cuda_staged_collectives deltas). Target: in-place/staged >= {POOL_SPEEDUP_TARGET}x from "
            f"{human(POOL_SPEEDUP_MIN_BYTES)}."
        ),
        "",
        (
            "| collective | size | rsccl us | rsccl-pool us | in-place/staged | nccl us | rsccl-pool vs nccl "
            "| rsccl-pool busbw GB/s | path (in place / staged calls) |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p, st, nc in pairs:
        sp, vs = ratio(st, p), ratio(nc, p)
        label = path_label(p).split(" (")[0] if path_label(p).startswith(("MIXED", "NOT")) else path_label(p)
        counts = f" ({p['inplace_calls']} / {p['staged_calls']})" if p.get("inplace_calls") is not None else ""
        out.append(
            f"| {p['collective']} | {human(p['bytes'])} | {time_cell(st, 'eager_s') if st else 'n/a'} "
            f"| {time_cell(p, 'eager_s')} | {f'{sp:.2f}x' if sp else 'n/a'} "
            f"| {time_cell(nc, 'eager_s') if nc else 'n/a'} | {f'{vs:.2f}x' if vs else 'n/a'} "
            f"| {fmt(p['busbw_GBps'], 1, 1)} | {label or 'n/a'}{counts} |"
        )
    return out


def pool_summary_lines(world: int, rows: list[dict]) -> list[str]:
    """Per pooled collective: in-place/staged at each size >= 16 MiB, the verdict on the
    target, and the sizes whose calls were not all counted in place."""
    lines = []
    pairs = pool_pairs(rows)
    for collective in dict.fromkeys(p["collective"] for p, _, _ in pairs):
        cells, ratios, flags = [], [], []
        for p, st, nc in (x for x in pairs if x[0]["collective"] == collective):
            if not path_ok(p):
                flags.append(f"{human(p['bytes'])} {path_label(p) or 'path n/a'}")
            if p["bytes"] < POOL_SPEEDUP_MIN_BYTES:
                continue
            sp, vs = ratio(st, p), ratio(nc, p)
            if sp is None:
                cells.append(f"{human(p['bytes'])} n/a")
                continue
            ratios.append(sp)
            cells.append(f"{human(p['bytes'])} {sp:.2f}x" + (f" ({vs:.2f}x nccl)" if vs else ""))
        if ratios:
            worst = min(ratios)
            verdict = f"min {worst:.2f}x, target >= {POOL_SPEEDUP_TARGET}x {'met' if worst >= POOL_SPEEDUP_TARGET else 'NOT MET'}"
        else:
            verdict = f"no size >= {human(POOL_SPEEDUP_MIN_BYTES)} measured"
        line = f"w{world} in-place/staged {collective[:14]:<14}: " + (" | ".join(cells) + "; " if cells else "") + verdict
        lines.append(line + ("; NOT IN PLACE: " + ", ".join(flags) if flags else ""))
    return lines


def target_lines(world: int, rows: list[dict]) -> list[str]:
    """One line per target of all_to_all_single and send/recv: the figure at each size it
    applies to, and whether it is met (n/a where a size was not measured)."""
    by = {(r["collective"], r["bytes"], r["backend"]): r for r in rows}
    a2a = sorted({r["bytes"] for r in rows if r["collective"] == A2A})
    lines = []

    def line(what: str, cells: list[str], values: list[float], ok: Callable[[float], bool], worst: Callable[..., float]) -> str:
        if not values:
            return f"w{world} target {what}: no size measured"
        w = worst(values)
        return f"w{world} target {what}: {' | '.join(cells)}; worst {w:.2f}x, {'met' if ok(w) else 'NOT MET'}"

    if a2a:
        cells, values = [], []
        for nb in (x for x in a2a if x >= A2A_BUSBW_FROM_BYTES):
            r = ratio(by.get((A2A, nb, "nccl")), by.get((A2A, nb, "rsccl")))  # rsccl busbw / nccl busbw
            cells.append(f"{human(nb)} {f'{r:.2f}x' if r else 'n/a'}")
            values += [r] if r else []
        lines.append(line(f"{A2A} busbw >= nccl from {human(A2A_BUSBW_FROM_BYTES)}", cells, values, lambda v: v >= 1.0, min))
        cells, values = [], []
        for nb in (x for x in a2a if x <= A2A_LATENCY_UP_TO_BYTES):
            r = ratio(by.get((A2A, nb, "rsccl")), by.get((A2A, nb, "nccl")))  # rsccl time / nccl time
            cells.append(f"{human(nb)} {f'{r:.2f}x' if r else 'n/a'}")
            values += [r] if r else []
        lines.append(
            line(
                f"{A2A} eager latency <= {A2A_LATENCY_TARGET}x nccl up to {human(A2A_LATENCY_UP_TO_BYTES)}",
                cells,
                values,
                lambda v: v <= A2A_LATENCY_TARGET,
                max,
            )
        )
    if any(r["collective"] == P2P for r in rows):
        rs, nc = by.get((P2P, P2P_TARGET_BYTES, "rsccl")), by.get((P2P, P2P_TARGET_BYTES, "nccl"))
        got = rs["algbw_GBps"] if rs else None
        head = f"w{world} target {P2P} {human(P2P_TARGET_BYTES)} >= {P2P_TARGET_GBPS:.0f} GB/s (rank 0 -> 1): "
        if got is None:
            lines.append(head + "not measured")
        else:
            theirs = f" (nccl {nc['algbw_GBps']:.0f} GB/s)" if nc and nc["algbw_GBps"] else ""
            lines.append(head + f"{got:.0f} GB/s{theirs}, {'met' if got >= P2P_TARGET_GBPS else 'NOT MET'}")
    return lines


def summary_lines(world: int, rows: list[dict], cfg: Config) -> list[str]:
    """Per collective: a header, then one line per size: each backend's eager us/busbw GB/s,
    then rsccl's and nccl's graph us."""
    lines = []
    for collective in dict.fromkeys(r["collective"] for r in rows):
        mine = [r for r in rows if r["collective"] == collective]
        backends = [b for b in BACKEND_ORDER if any(r["backend"] == b for r in mine)]
        graph_backends = [b for b in ("rsccl", "nccl") if b in backends] if cfg.graph else []
        head = f"w{world} {collective[:14]:<14}" + "".join(f"{SHORT[b]:>15}" for b in backends)
        if graph_backends:
            head += " | graph:" + "".join(f"{SHORT[b]:>7}" for b in graph_backends)
        lines.append(head)
        by = {(r["bytes"], r["backend"]): r for r in mine}
        for nbytes in sorted({r["bytes"] for r in mine}):
            line = f"{human(nbytes):>18}"
            flags = []
            for b in backends:
                r = by.get((nbytes, b))
                if r is None or r["eager_s"] is None:
                    line += f"{time_cell(r, 'eager_s') if r else 'n/a':>15}"
                    if r and r["check"] == "fail":
                        flags.append(f"{SHORT[b]} FAILED")
                    continue
                line += f"{r['eager_s'] * 1e6:>8.1f}/{r['busbw_GBps']:>6.1f}"
                if r["check"] == "WRONG":
                    flags.append(f"{SHORT[b]} WRONG")
                if b == POOL_BACKEND and not path_ok(r):
                    flags.append(f"{SHORT[b]} {path_label(r).split(' ')[0] or 'path n/a'}")
            if graph_backends:
                line += " |       " + "".join(f"{graph_cell(by[(nbytes, b)], cfg) if (nbytes, b) in by else '':>7}" for b in graph_backends)
            lines.append(line + ("  " + ", ".join(flags) if flags else ""))
    return lines


def write_csv(path: Path, rows: list[dict], header: str) -> None:
    with path.open("w", newline="") as f:
        f.write(header + "\n")
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in rows:
            graph = f"{r['graph_s'] * 1e6:.3f}" if r["graph_s"] is not None else (r["graph_note"].split(" ")[0] or "")
            eager, async_ = (fmt(r[k], 1e6, 3) if r[k] is not None else time_cell(r, k).replace("n/a", "") for k in ("eager_s", "async_s"))
            w.writerow(
                [
                    "cuda",
                    r["world_size"],
                    r["collective"],
                    r["bytes"],
                    r["backend"],
                    eager,
                    async_,
                    graph,
                    fmt(r["algbw_GBps"], 1, 4),
                    fmt(r["busbw_GBps"], 1, 4),
                    f"{r['vs_nccl']:.3f}" if r["vs_nccl"] else "",
                    r["iters"],
                    r["check"],
                    note_of(r),
                ]
            )


def write_png(path: Path, rows: list[dict], cfg: Config, title: str) -> bool:
    """Top: busbw against size per collective; bottom: eager (solid) and graph (dotted)
    latency for sizes up to 1 MiB. False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError:
        return False
    collectives = list(dict.fromkeys(r["collective"] for r in rows))
    worlds = sorted({r["world_size"] for r in rows})
    markers = ("o", "s", "^", "v")
    styles = ("-", "--", "-.", ":")
    fig, axes = plt.subplots(2, len(collectives), figsize=(6.5 * len(collectives), 9), squeeze=False)
    small = max(SMALL_PLOT_BYTES, cfg.graph_max_bytes)
    for col, collective in enumerate(collectives):
        top, bottom = axes[0][col], axes[1][col]
        for backend in BACKEND_ORDER:
            for world, marker, style in zip(worlds, markers, styles):
                mine = sorted(
                    (
                        r
                        for r in rows
                        if (r["collective"], r["backend"], r["world_size"]) == (collective, backend, world) and r["eager_s"] is not None
                    ),
                    key=lambda r: r["bytes"],
                )
                if not mine:
                    continue
                label = f"{backend}, {world} GPUs"
                top.plot(
                    [r["bytes"] for r in mine],
                    [r["busbw_GBps"] for r in mine],
                    style,
                    marker=marker,
                    color=COLORS[backend],
                    markersize=4,
                    label=label,
                )
                lat = [r for r in mine if r["bytes"] <= small]
                if lat:
                    bottom.plot(
                        [r["bytes"] for r in lat],
                        [r["eager_s"] * 1e6 for r in lat],
                        style,
                        marker=marker,
                        color=COLORS[backend],
                        markersize=4,
                        label=label,
                    )
                    g = [r for r in lat if r["graph_s"] is not None]
                    if g:
                        bottom.plot(
                            [r["bytes"] for r in g],
                            [r["graph_s"] * 1e6 for r in g],
                            ":",
                            marker="x",
                            color=COLORS[backend],
                            markersize=4,
                            alpha=0.7,
                            label="_nolegend_",
                        )
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(LogLocator(base=4))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human(v).replace(" ", "")))
            ax.set_xlabel("message size per rank")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
        top.set_yscale("log")
        top.set_title(f"{collective}: bus bandwidth")
        top.set_ylabel("busbw (GB/s)")
        bottom.set_title(f"{collective}: latency, sizes <= {human(small)} (dotted, x: CUDA graph)")
        bottom.set_ylabel("us per call")
        bottom.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(args: argparse.Namespace, argv: list[str]) -> int:
    os.environ.update(GPU_ENV)
    # Counting GPUs does not create a CUDA context in this process (which would take memory on GPU 0).
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        print(
            f"rsccl.bench: --device cuda needs at least 2 visible CUDA GPUs; this machine has {gpus} "
            f"(torch {torch.__version__}, torch.cuda.is_available() = {torch.cuda.is_available()}). "
            "Use --device cpu here.",
            file=sys.stderr,
        )
        return 2
    worlds = [w for w in args.world_sizes if w <= gpus]
    if left := [w for w in args.world_sizes if w > gpus]:
        print(f"note: world sizes {left} left out: {gpus} GPUs visible", flush=True)
    if not worlds:
        print(f"rsccl.bench: no world size fits the {gpus} visible GPUs", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(2), "little")
    cfg = Config(
        collectives=tuple(args.collectives),
        sizes=message_sizes(args.min_bytes, args.max_bytes),
        dtype=args.dtype,
        iters=args.iters,
        warmup=args.warmup,
        repeats=args.repeats,
        seed=seed,
        graph=not args.no_graph,
        graph_max_bytes=args.graph_max_bytes,
        check_max_bytes=args.check_max_bytes,
        symm_max_bytes=args.symm_max_bytes,
        sweep_one_shot=args.sweep_one_shot,
        rsccl_options=dict(args.rsccl_options),
        timeout_s=args.timeout,
        pool=not args.no_pool,
        fsdp=FsdpConfig(
            layers=args.fsdp_layers, dim=args.fsdp_dim, steps=args.fsdp_steps, warmup=args.fsdp_warmup, pool_bytes=args.fsdp_pool_bytes or 0
        )
        if args.fsdp
        else None,
    )
    command = "python -m rsccl.bench " + shlex.join(argv)
    print(
        f"rsccl.bench: device cuda ({gpus} GPUs visible), world sizes {worlds}, {cfg.dtype}, "
        f"{human(cfg.sizes[0])}..{human(cfg.sizes[-1])}, collectives {','.join(cfg.collectives)}, seed {seed}, "
        f"rsccl options {cfg.rsccl_options or 'defaults'}{', one-shot sweep' if cfg.sweep_one_shot else ''}",
        flush=True,
    )
    pooled = pool_sizes(cfg)
    print(
        f"rsccl-pool rows: {f'{human(pooled[0])}..{human(pooled[-1])}' if pooled else 'none'}"
        + "".join(
            f"; w{w} default group adds {options_text(pool_options(cfg, w)) or 'nothing (given in --rsccl-options)'}"
            for w in worlds
            if pooled
        )
        + f"; FSDP2 section: {cfg.fsdp.describe() + f', {cfg.fsdp.warmup}+{cfg.fsdp.steps} steps' if cfg.fsdp else 'off'}"
        + (f" (--timeout +{FSDP_ALLOWANCE_S:.0f} s per world size)" if cfg.fsdp else ""),
        flush=True,
    )
    print(
        "message size = all_reduce tensor bytes = all_gather_into_tensor OUTPUT bytes = "
        "reduce_scatter_tensor INPUT bytes = all_to_all_single input bytes = send_recv message bytes (per rank)",
        flush=True,
    )
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    all_rows: list[dict] = []
    summaries: list[str] = []
    failed: list[str] = []
    problems: list[str] = []
    for world in worlds:
        print(f"\n== world size {world}", flush=True)
        results, error = run_world(world, cfg)
        rows = add_bandwidth((results or {}).get("rows", []))
        meta = (results or {}).get("meta", {})
        if error:
            failed.append(f"world size {world}: {error}")
            print(f"rsccl.bench: world size {world}: {error}", file=sys.stderr, flush=True)
        md = world_markdown(world, results, rows, error, cfg, command)
        md_path = args.out / f"bench_cuda_w{world}.md"
        md_path.write_text(md)
        print("\n" + md, flush=True)
        print(f"wrote {md_path}", flush=True)
        all_rows += rows
        summaries += summary_lines(world, rows, cfg)
        summaries += rendered("targets", target_lines, world, rows)
        summaries += rendered("in-place summary", pool_summary_lines, world, rows)
        if meta:
            summaries.append(memory_summary(world, meta))
            summaries += rendered("FSDP2 summary", fsdp_summary_lines, world, meta.get("fsdp"))
            problems += rendered("FSDP2 verdict", fsdp_problems, world, meta.get("fsdp"))
        if error:
            summaries.append(f"w{world} INCOMPLETE: {error}")
    header = (
        f"# date={datetime.now().astimezone().isoformat(timespec='seconds')} host={platform.node()} "
        f"torch={torch.__version__} dtype={cfg.dtype} seed={seed} repeats={cfg.repeats} "
        f"rsccl_options={json.dumps(cfg.rsccl_options)} command={json.dumps(command)}"
    )
    csv_path, png_path = args.out / "bench_cuda.csv", args.out / "bench_cuda.png"
    write_csv(csv_path, all_rows, header)
    print(f"wrote {csv_path}", flush=True)
    if all_rows:
        try:
            if write_png(png_path, all_rows, cfg, header.removeprefix("# ")[:200]):
                print(f"wrote {png_path}", flush=True)
            else:
                print("note: matplotlib is not installed, so no plot was drawn", flush=True)
        except Exception as e:  # noqa: BLE001 - a plot is not worth losing the run's exit status over
            print(f"note: plotting failed: {describe(e)}", flush=True)
    wrong = failed_rows(all_rows)
    print(
        "\n== summary: eager us per call / busbw GB/s; graph us for sizes <= "
        f"{human(cfg.graph_max_bytes)}; n/a = not run; WRONG = differs from nccl; in-place/staged = rsccl eager "
        "time / rsccl-pool eager time",
        flush=True,
    )
    for line in summaries:
        print(line, flush=True)
    for r in wrong:
        print(
            f"{'WRONG' if r['check'] == 'WRONG' else 'FAILED'}: w{r['world_size']} {r['backend']} {r['collective']} "
            f"{human(r['bytes'])}: {r['note']}",
            flush=True,
        )
    print(f"total time {time.perf_counter() - start:.0f} s; results in {args.out}", flush=True)
    for line in problems:
        print(f"FAILED: {line.strip()}", flush=True)
    if failed:
        print("FAILED: " + "; ".join(failed), flush=True)
    return 1 if (failed or wrong or problems) else 0
