"""What one rank of the CUDA bench does: set up its groups and measure memory, then check
and time every (collective, size) on every backend, eager, async and in a CUDA graph.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..._cuda import mapped_va_bytes, nccl_baseline
from ..common import describe, human, numels
from ..fsdp import run_fsdp
from .backends import Agree, Backend, Bufs, Call, close, make_bufs, setup_symm
from .config import (
    A2A,
    A2A_MAX_BYTES,
    GPU_ENV,
    P2P,
    P2P_SIZES,
    POOL_BACKEND,
    POOL_MIN_BYTES,
    PROBE_BYTES,
    SHORT,
    SWEEP,
    SYMM_BACKENDS,
    Config,
    iters_for,
    one_shot_limit,
    options_text,
    pool_options,
    pool_sizes,
)
from .ctas import PROFILED_BACKENDS, nccl_cta_env, profiled_grids
from .overlap import run_overlap
from .tables import path_label, time_cell
from .timing import graph_timed, launch_cost, timed


def snapshot(label: str) -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"label": label, "used": total - free, "total": total, "va": mapped_va_bytes(), "torch_reserved": torch.cuda.memory_reserved()}


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
                "cpu_s": None,  # the host's seconds per eager call (timing.event_timed)
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
            "sms": torch.cuda.get_device_properties(dev).multi_processor_count,
            "nccl_cta_env": nccl_cta_env(os.environ),
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
        row["eager_s"], row["cpu_s"] = timed(sync, n, cfg, self.agree)
        row["iters"] = n * cfg.repeats
        if b.is_symm:
            return
        calls = b.call(bufs, async_op=True)
        if err := self.guarded(b, f"{what} (async)", calls):
            row["note"] = "; ".join(filter(None, (row["note"], f"async: {err}")))
            return
        row["async_s"], _ = timed(calls, n, cfg, self.agree)

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
        gpu_s, cpu_s = launch_cost(self.dev, iters_for(1024, cfg), cfg, self.agree)
        self.meta["torch_launch"] = f"x.add_(0) on 1 KiB: {gpu_s * 1e6:.1f} us on the GPU, {cpu_s * 1e6:.1f} us of CPU per call"
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
        if cfg.overlap is not None:
            self.overlap()
        if cfg.fsdp is not None:
            self.fsdp()
        if cfg.ctas_profile:
            self.profile_ctas(cases)

    def profile_ctas(self, cases: list[tuple[str, tuple[int, int], int]]) -> None:
        """The grids of rsccl's and NCCL's kernels per collective at its smallest and largest
        size, from a torch.profiler trace of a few calls (rank 0's), into meta["ctas_measured"].
        Last: no timing runs after the profiler was on."""
        torch.cuda.empty_cache()
        measured: dict[str, dict[str, dict[str, Any]]] = {}
        self.meta["ctas_measured"] = measured
        picks: dict[str, list[tuple[tuple[int, int], int]]] = {}
        for collective, counts, nbytes in cases:
            picks.setdefault(collective, []).append((counts, nbytes))
        try:
            for collective, sizes in picks.items():
                for counts, nbytes in dict.fromkeys([sizes[0], sizes[-1]]):
                    bufs = make_bufs(collective, counts, self.dtype, self.dev)
                    for b in self.backends:
                        if b.name not in PROFILED_BACKENDS or not b.supports(collective, nbytes):
                            continue
                        got: dict[str, int] = {}
                        err = self.guarded(
                            b, f"{collective} {human(nbytes)} (profiled)", lambda b=b, got=got: got.update(profiled_grids(b.call(bufs)))
                        )
                        measured.setdefault(collective, {}).setdefault(b.name, {})[str(nbytes)] = err or got
            self.log("kernel grids profiled")
        except Exception as e:  # noqa: BLE001 - recorded; every result above is already saved
            print(f"rank {self.rank}: profiling the kernels' grids failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            self.meta["ctas_measured_error"] = describe(e)
            self.log(f"profiling the kernels' grids FAILED: {describe(e)}")
        self.save()

    def overlap(self) -> None:
        """The overlap section, after the collectives and before FSDP2. Its phases are agreed
        among the ranks; anything else that escapes is recorded too."""
        torch.cuda.empty_cache()
        try:
            run_overlap(self)
        except Exception as e:  # noqa: BLE001 - recorded; the results above are already saved
            print(f"rank {self.rank}: overlap section failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            ov = self.meta.setdefault("overlap", {"runs": {}, "errors": {}})
            ov.setdefault("errors", {})["section"] = describe(e)
            self.log(f"overlap section FAILED: {describe(e)}")
        self.save()

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
