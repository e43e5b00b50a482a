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

Message size: the bytes of the all_reduce (and broadcast) tensor = the all_gather_into_tensor
OUTPUT = the reduce_scatter_tensor INPUT, per rank, as nccl-tests define it.

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
- busbw from the eager time: all_reduce 2(n-1)/n * bytes / t; all_gather, reduce_scatter
  (n-1)/n * bytes / t; broadcast bytes / t.
- memory per rank: device memory used (total - free from torch.cuda.mem_get_info, after
  torch.cuda.synchronize(); device-wide) and mapped virtual address space (/proc/self/maps),
  before any group (after a CUDA context and the probe tensors exist), after rsccl's init,
  after its first all_reduce, all_gather and reduce_scatter (1 MiB probes), then the same for
  NCCL, then after the symmetric-memory buffer's rendezvous. rsccl.memory_stats() is logged.

Outputs in --out-dir: bench_cuda_w<world>.md per world size (tables, memory, stats),
bench_cuda.csv (all worlds), bench_cuda.png when matplotlib imports. The last lines printed
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
from dataclasses import dataclass, field
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

from ._cuda import mapped_va_bytes
from .bench import TOLERANCES, bus_factor, human, message_sizes, numels

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
BACKEND_ORDER = ("rsccl", "rsccl-2shot", "rsccl-1shot", "nccl", "symm-1shot", "symm-2shot")
SHORT = {"rsccl": "rsccl", "rsccl-2shot": "rs-2shot", "rsccl-1shot": "rs-1shot", "nccl": "nccl",
         "symm-1shot": "symm1", "symm-2shot": "symm2"}
COLORS = {"rsccl": "tab:blue", "rsccl-2shot": "tab:purple", "rsccl-1shot": "tab:cyan", "nccl": "tab:orange",
          "symm-1shot": "tab:green", "symm-2shot": "tab:red"}
CSV_COLUMNS = ("device", "world_size", "collective", "bytes", "backend", "eager_us", "async_us", "graph_us",
               "algbw_GBps", "busbw_GBps", "vs_nccl", "iters", "check", "note")


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


def describe(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its message, shortened."""
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first}"[:400]


def iters_for(nbytes: int, cfg: Config) -> int:
    if cfg.iters:
        return cfg.iters
    return max(ITERS_MIN, min(ITERS_MAX, ITERS_MAX * ITERS_FULL_UP_TO // max(nbytes, 1)))


# -- inside a rank ---------------------------------------------------------------------------




def snapshot(label: str) -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"label": label, "used": total - free, "total": total, "va": mapped_va_bytes(),
            "torch_reserved": torch.cuda.memory_reserved()}


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


class Backend:
    """A way to run the benchmarked collectives: a process group, or a symmetric-memory op."""

    def __init__(self, name: str, group: Any = None, symm: Any = None):
        self.name = name
        self.group = group  # None: the default group (rsccl)
        self.symm = symm  # SymmSetup for the symm-* backends
        self.graph_failed = ""  # why capture failed once (then it is not tried again)

    @property
    def is_symm(self) -> bool:
        return self.symm is not None

    def supports(self, collective: str, nbytes: int) -> bool:
        if self.is_symm:
            return collective == "all_reduce" and nbytes <= self.symm.max_bytes
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
        if b.collective == "all_reduce":
            fn: Call = lambda: dist.all_reduce(inp, group=g, async_op=async_op)
        elif b.collective == "broadcast":
            fn = lambda: dist.broadcast(inp, src=0, group=g, async_op=async_op)
        elif b.collective == "all_gather_into_tensor":
            fn = lambda: dist.all_gather_into_tensor(out, inp, group=g, async_op=async_op)
        else:
            fn = lambda: dist.reduce_scatter_tensor(out, inp, group=g, async_op=async_op)
        if async_op:
            return lambda: fn().wait()
        return fn

    def run_on(self, collective: str, x: torch.Tensor, counts: tuple[int, int], dev: torch.device) -> torch.Tensor:
        """The collective's result on input `x` (for the correctness check)."""
        if self.is_symm:
            n = x.numel()
            self.symm.buf[:n].copy_(x)
            self.call(Bufs(collective, x, x))()
            res = self.symm.out[:n] if self.name == "symm-1shot" else self.symm.buf[:n]
            return res.clone()
        b = make_bufs(collective, counts, x.dtype, dev)
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
    """(matches, max |difference|). Gathers and broadcast move bytes: exact. Reductions may
    add in another order (and round once or at every step): TOLERANCES, atol scaled by world."""
    diff = (got.float() - ref.float()).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    if collective in ("all_gather_into_tensor", "broadcast"):
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
                "world_size": self.world, "collective": collective, "bytes": nbytes, "backend": backend,
                "eager_s": None, "async_s": None, "graph_s": None, "graph_note": "", "iters": 0, "check": "-", "note": "",
            }
        return self.rows[key]

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
        opts = Options(**user) if user else None
        dist.init_process_group("rsccl", store=store, rank=self.rank, world_size=self.world, timeout=timeout,
                                pg_options=opts)
        mem.append(snapshot("rsccl: after init"))
        self.log(f"rsccl initialized ({human(mem[-1]['used'] - mem[0]['used'])} more device memory)")
        # The harness's own group (CPU only), before rsccl's first collectives so that their
        # failures can be agreed on; the deltas of those start from the snapshot after it.
        self.gloo = dist.new_group(backend="gloo", timeout=timeout)
        self.agree = Agree(self.gloo)
        mem.append(snapshot("gloo group created"))
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
        self.log("nccl initialized")
        del probes
        self.backends = [rs]
        if cfg.sweep_one_shot and "all_reduce" in cfg.collectives:
            for name, threshold in SWEEP.items():
                g = dist.new_group(backend="rsccl", timeout=timeout,
                                   pg_options=Options(**{**user, "cuda_allreduce_one_shot_max_bytes": threshold}))
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
            "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rsccl": rsccl.__version__,
            "python": platform.python_version(), "memory": mems, "rsccl_memory_stats": all_stats, "symm": symm_note,
            "backends": [b.name for b in self.backends], "graph_failures": {},
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

            err = self.guarded(b, f"{collective} {human(nbytes)} (check)", run)
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
                print(f"{bar}\nWRONG RESULT: {b.name} {collective} {human(nbytes)} world {self.world}: differs from "
                      f"nccl on the same input, seed {self.cfg.seed} ({bad})\n{bar}", flush=True)
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
            sync = b.call(bufs)

            def warm(call: Call = sync) -> None:
                for _ in range(cfg.warmup):
                    call()

            if err := self.guarded(b, f"{what} (eager)", warm):
                row["note"] = "; ".join(filter(None, (row["note"], f"eager: {err}")))
                continue
            row["eager_s"] = timed(sync, n, cfg, self.agree)
            row["iters"] = n * cfg.repeats
            if b.is_symm:
                continue
            calls = b.call(bufs, async_op=True)
            if err := self.guarded(b, f"{what} (async)", calls):
                row["note"] = "; ".join(filter(None, (row["note"], f"async: {err}")))
                continue
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
            t, why = graph_timed(b.call(bufs), self.cfg, self.agree)
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
            for size in cfg.sizes:
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
                    cells.append(f"{SHORT[b.name]} {time_cell(r, 'eager_s')}{flag}")
            self.log(f"{collective:<22} {human(nbytes):>9}: {' | '.join(cells)} us  ({time.perf_counter() - start:.1f} s)")
            self.save()
            torch.cuda.empty_cache()
        if cfg.graph:
            for collective, counts, nbytes in cases:
                if nbytes <= cfg.graph_max_bytes:
                    self.graphs(collective, counts, nbytes)
            self.log("CUDA graph measurements done")
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
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=cfg.timeout_s),
                              wait_for_workers=False)
        ctx = mp.start_processes(rank_main, args=(world, store.port, cfg, path), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + cfg.timeout_s
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


def failed_rows(rows: list[dict]) -> list[dict]:
    """rsccl rows that failed or gave a wrong result (symmetric memory's failures are only reported)."""
    return [r for r in rows if r["backend"].startswith("rsccl") and (
        r["check"] in ("WRONG", "fail") or "eager:" in r["note"] or "async:" in r["note"])]


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
        ("| backend | rank | held after init MiB | + first all_reduce | + first all_gather | + first reduce_scatter "
         "| VA added by init GiB | VA added by first collectives GiB |"),
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
                cells.append(f"{(f['used'] - prev['used']) / MiB:+.0f}{' FAILED' if 'FAILED' in f['label'] else ''}"
                             if f else "n/a")
                prev = f or prev
            va_first = (prev["va"] - start["va"]) / 2**30
            lines.append(f"| {backend} | {rank} | {(i['used'] - b['used']) / MiB:.0f} | {' | '.join(cells)} "
                         f"| {(i['va'] - b['va']) / 2**30:.2f} | {va_first:+.2f} |")
        before_symm = by.get("symm: before setup")
        after_symm = [s for s in snaps if s["label"].startswith("symm: after setup")]
        if before_symm and after_symm:
            a = after_symm[0]
            symm_lines.append(f"rank {rank}: {a['label']}: +{(a['used'] - before_symm['used']) / MiB:.0f} MiB device, "
                              f"+{(a['va'] - before_symm['va']) / 2**30:.2f} GiB VA")
    if symm_lines:
        lines += ["", "torch symmetric memory (its buffer included): " + "; ".join(symm_lines)]
    return lines


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
                vals[backend].append(((i["used"] - b["used"]) / MiB, (last["used"] - start["used"]) / MiB,
                                      (i["va"] - b["va"] + last["va"] - start["va"]) / 2**30))
    parts = []
    for backend, v in vals.items():
        if v:
            parts.append(f"{backend} held {max(x[0] for x in v):.0f} MiB, +{max(x[1] for x in v):.0f} MiB at first "
                         f"collectives, VA {max(x[2] for x in v):.1f} GiB")
    return f"w{world} memory per rank (max over ranks): " + ("; ".join(parts) if parts else "n/a")


def header_lines(meta: dict, cfg: Config, command: str) -> list[str]:
    date = datetime.now().astimezone().isoformat(timespec="seconds")
    return [
        (f"- date {date}, host {platform.node()}, {meta.get('gpu', '?')}; torch {meta.get('torch', '?')} "
        f"(CUDA {meta.get('cuda', '?')}), NCCL {meta.get('nccl', '?')}, rsccl {meta.get('rsccl', '?')}, "
        f"python {meta.get('python', '?')}"),
        f"- command: `{command}`",
        f"- rsccl options: {cfg.rsccl_options or 'defaults'}; environment: "
        + " ".join(f"{k}={v}" for k, v in GPU_ENV.items())
        + "".join(f" {k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("RSCCL_")),
        (f"- message size = bytes of the all_reduce (and broadcast) tensor = the all_gather_into_tensor OUTPUT = "
        f"the reduce_scatter_tensor INPUT, per rank; dtype {cfg.dtype}; seed {cfg.seed}"),
        (f"- eager: CUDA events around N back-to-back blocking calls after {cfg.warmup} warm-up calls, slowest rank, "
        f"median of {cfg.repeats}, per call; async: async_op=True + wait() per call; graph: {GRAPH_CALLS} calls "
        f"captured in one CUDA graph, {GRAPH_REPLAYS} replays per repeat (sizes <= {human(cfg.graph_max_bytes)}); "
        f"busbw from eager (nccl-tests factors); vs nccl = nccl eager time / this eager time; "
        f"check: same random input as nccl (sizes <= {human(cfg.check_max_bytes)}); "
        f"symm-1shot/-2shot: torch.ops.symm_mem.one_shot_all_reduce_out / two_shot_all_reduce_ "
        f"(sizes <= {human(cfg.symm_max_bytes)})"),
        f"- torch symmetric memory: {meta.get('symm', 'n/a')}",
    ]


def world_markdown(world: int, results: dict | None, rows: list[dict], error: str, cfg: Config, command: str) -> str:
    meta = (results or {}).get("meta", {})
    out = [f"# rsccl CUDA benchmark: world size {world}", ""] + header_lines(meta, cfg, command)
    if error:
        out += ["", f"**INCOMPLETE: {error}**"]
    bad = [r for r in rows if r["check"] in ("WRONG", "fail") or r["note"]]
    if bad:
        out += ["", "**WRONG RESULTS OR FAILURES:**", ""] + [
            f"- {r['backend']} {r['collective']} {human(r['bytes'])}: check {r['check']}; {r['note']}" for r in bad]
    for name, why in meta.get("graph_failures", {}).items():
        out += ["", f"CUDA graph capture failed for {name}: {why}"]
    for collective in dict.fromkeys(r["collective"] for r in rows):
        out += ["", f"## {collective}", "",
                "| size | backend | eager us | async us | graph us | busbw GB/s | algbw GB/s | vs nccl | check | iters | note |",
                "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
        mine = [r for r in rows if r["collective"] == collective]
        for r in sorted(mine, key=lambda r: (r["bytes"], BACKEND_ORDER.index(r["backend"]))):
            vs = f"{r['vs_nccl']:.2f}x" if r["vs_nccl"] else ""
            note = r["note"].replace("|", "/").replace("\n", " ")[:300]
            out.append(f"| {human(r['bytes'])} | {r['backend']} | {time_cell(r, 'eager_s')} | {time_cell(r, 'async_s')} "
                       f"| {graph_cell(r, cfg)} | {fmt(r['busbw_GBps'], 1, 2)} | {fmt(r['algbw_GBps'], 1, 2)} "
                       f"| {vs} | {r['check']} | {r['iters']} | {note} |")
    if meta.get("memory"):
        out += ["", "## Memory per rank", "",
                ("Device memory used = total - free (torch.cuda.mem_get_info after synchronize; device-wide), "
                f"{human(PROBE_BYTES)} probes; VA = the process's mappings (/proc/self/maps)."), ""]
        out += memory_table(meta)
        out += ["", "Snapshots (MiB used, GiB VA, MiB torch reserved):", ""]
        for rank, snaps in enumerate(meta["memory"]):
            out.append(f"- rank {rank}: " + "; ".join(
                f"{s['label']} {s['used'] / MiB:.0f} / {s['va'] / 2**30:.1f} / {s['torch_reserved'] / MiB:.0f}"
                for s in snaps))
        out += ["", "rsccl.memory_stats() (default group):", ""]
        for rank, st in enumerate(meta.get("rsccl_memory_stats", [])):
            out.append(f"- rank {rank}: `{json.dumps(st)}`")
    return "\n".join(out) + "\n"


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
            if graph_backends:
                line += " |       " + "".join(
                    f"{graph_cell(by[(nbytes, b)], cfg) if (nbytes, b) in by else '':>7}" for b in graph_backends)
            lines.append(line + ("  " + ", ".join(flags) if flags else ""))
    return lines


def write_csv(path: Path, rows: list[dict], header: str) -> None:
    with path.open("w", newline="") as f:
        f.write(header + "\n")
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in rows:
            graph = f"{r['graph_s'] * 1e6:.3f}" if r["graph_s"] is not None else (r["graph_note"].split(" ")[0] or "")
            eager, async_ = (fmt(r[k], 1e6, 3) if r[k] is not None else time_cell(r, k).replace("n/a", "")
                             for k in ("eager_s", "async_s"))
            w.writerow([
                "cuda", r["world_size"], r["collective"], r["bytes"], r["backend"], eager, async_, graph,
                fmt(r["algbw_GBps"], 1, 4), fmt(r["busbw_GBps"], 1, 4),
                f"{r['vs_nccl']:.3f}" if r["vs_nccl"] else "", r["iters"], r["check"], r["note"],
            ])


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
                mine = sorted((r for r in rows if (r["collective"], r["backend"], r["world_size"]) == (collective, backend, world)
                               and r["eager_s"] is not None), key=lambda r: r["bytes"])
                if not mine:
                    continue
                label = f"{backend}, {world} GPUs"
                top.plot([r["bytes"] for r in mine], [r["busbw_GBps"] for r in mine], style, marker=marker,
                         color=COLORS[backend], markersize=4, label=label)
                lat = [r for r in mine if r["bytes"] <= small]
                if lat:
                    bottom.plot([r["bytes"] for r in lat], [r["eager_s"] * 1e6 for r in lat], style, marker=marker,
                                color=COLORS[backend], markersize=4, label=label)
                    g = [r for r in lat if r["graph_s"] is not None]
                    if g:
                        bottom.plot([r["bytes"] for r in g], [r["graph_s"] * 1e6 for r in g], ":", marker="x",
                                    color=COLORS[backend], markersize=4, alpha=0.7, label="_nolegend_")
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
        print(f"rsccl.bench: --device cuda needs at least 2 visible CUDA GPUs; this machine has {gpus} "
              f"(torch {torch.__version__}, torch.cuda.is_available() = {torch.cuda.is_available()}). "
              "Use --device cpu here.", file=sys.stderr)
        return 2
    worlds = [w for w in args.world_sizes if w <= gpus]
    if left := [w for w in args.world_sizes if w > gpus]:
        print(f"note: world sizes {left} left out: {gpus} GPUs visible", flush=True)
    if not worlds:
        print(f"rsccl.bench: no world size fits the {gpus} visible GPUs", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(2), "little")
    cfg = Config(
        collectives=tuple(args.collectives), sizes=message_sizes(args.min_bytes, args.max_bytes), dtype=args.dtype,
        iters=args.iters, warmup=args.warmup, repeats=args.repeats, seed=seed, graph=not args.no_graph,
        graph_max_bytes=args.graph_max_bytes, check_max_bytes=args.check_max_bytes, symm_max_bytes=args.symm_max_bytes,
        sweep_one_shot=args.sweep_one_shot, rsccl_options=dict(args.rsccl_options), timeout_s=args.timeout,
    )
    command = "python -m rsccl.bench " + shlex.join(argv)
    print(f"rsccl.bench: device cuda ({gpus} GPUs visible), world sizes {worlds}, {cfg.dtype}, "
          f"{human(cfg.sizes[0])}..{human(cfg.sizes[-1])}, collectives {','.join(cfg.collectives)}, seed {seed}, "
          f"rsccl options {cfg.rsccl_options or 'defaults'}{', one-shot sweep' if cfg.sweep_one_shot else ''}", flush=True)
    print("message size = all_reduce tensor bytes = all_gather_into_tensor OUTPUT bytes = "
          "reduce_scatter_tensor INPUT bytes (per rank)", flush=True)
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    all_rows: list[dict] = []
    summaries: list[str] = []
    failed: list[str] = []
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
        if meta:
            summaries.append(memory_summary(world, meta))
        if error:
            summaries.append(f"w{world} INCOMPLETE: {error}")
    header = (f"# date={datetime.now().astimezone().isoformat(timespec='seconds')} host={platform.node()} "
              f"torch={torch.__version__} dtype={cfg.dtype} seed={seed} repeats={cfg.repeats} "
              f"rsccl_options={json.dumps(cfg.rsccl_options)} command={json.dumps(command)}")
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
    print("\n== summary: eager us per call / busbw GB/s; graph us for sizes <= "
          f"{human(cfg.graph_max_bytes)}; n/a = not run; WRONG = differs from nccl", flush=True)
    for line in summaries:
        print(line, flush=True)
    for r in wrong:
        print(f"{'WRONG' if r['check'] == 'WRONG' else 'FAILED'}: w{r['world_size']} {r['backend']} {r['collective']} "
              f"{human(r['bytes'])}: {r['note']}", flush=True)
    print(f"total time {time.perf_counter() - start:.0f} s; results in {args.out}", flush=True)
    if failed:
        print("FAILED: " + "; ".join(failed), flush=True)
    return 1 if (failed or wrong) else 0

