"""The overlap section of `python -m rsccl.bench --device cuda` (see rsccl/bench/cuda/__init__.py,
"What runs"): a bf16 matmul loop on the compute stream while a side stream runs
all_gather_into_tensor and reduce_scatter_tensor, per backend, in the benchmark's rank
processes, after the collective measurements and before FSDP2. Its report is in
overlap_report.py, its configuration (OverlapConfig, --quick's, the flags' checks) in
overlap_config.py.

A window is the same work for every backend: `matmuls` bf16 (n x n) @ (n x n) products on
the current (compute) stream, and `rounds` rounds of one all_gather_into_tensor and one
reduce_scatter_tensor (or only one of them: `collectives`) per message size on a side
stream, issued interleaved (`interleave`)
so that neither queue waits on the host. Per run of a backend, each rank times with CUDA
events, after synchronize and a gloo barrier: the matmuls alone (compute stream), the
collectives alone (side stream), and both together (an event on the compute stream before
the first call, the side stream joined back into it, an event after: the total), plus the
host wall time of that window (synchronize before and after) and when the matmuls' own part
of it ended. A run's figures are the slowest rank's. Backends run `repeats` times each in
ABBA order (`abba_order`); medians and spreads are reported (`spread`).

Before the first timed run of each backend, its collectives are checked while the matmuls
run: the same seeded random inputs as an NCCL reference computed alone, compared as the
benchmark's check does (exact for all_gather, bf16 tolerance for reduce_scatter).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ..common import abba_order, spread
from .overlap_config import OverlapConfig

OVERLAP_ALLOWANCE_S = 180.0  # added to --timeout for a world size that runs this section
TARGET_RATIO = 0.95  # issue 17, target 4: rsccl's total <= 0.95 x NCCL's
FIRST = "nccl"  # ABBA starts with NCCL, as the FSDP2 section does
SECTION = "overlap"  # the name failures are printed under


def interleave(matmuls: int, calls: int) -> list[str]:
    """The host's issue order for one window: "m" (a matmul) and "c" (a collective), spread
    so that after the k-th matmul about k x calls / matmuls collectives have been issued
    (each stream always has work queued; neither waits for the host to reach its calls).
    A collective goes first on a tie, so the side stream starts at once."""
    slots = [(k / matmuls, 1, "m") for k in range(matmuls)] + [(k / calls, 0, "c") for k in range(calls)]
    return [what for _, _, what in sorted(slots)]


METRICS = ("matmul_ms", "collectives_ms", "total_ms", "matmul_in_overlap_ms", "wall_ms")


def run_figures(run: dict) -> dict[str, float]:
    """The ratios of one run: total / matmul alone, total / (matmul alone + collectives alone)."""
    mm, co, tot = run["matmul_ms"], run["collectives_ms"], run["total_ms"]
    return {
        "total_over_matmul": tot / mm if mm else float("nan"),
        "total_over_serial": tot / (mm + co) if (mm + co) else float("nan"),
    }


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per backend, per metric (METRICS and run_figures' ratios): spread() over its runs."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, rs in runs.items():
        if not rs:
            continue
        rows = [dict(r, **run_figures(r)) for r in rs]
        out[name] = {k: spread([r[k] for r in rows]) for k in (*METRICS, "total_over_matmul", "total_over_serial")}
    return out


def paired_ratios(runs: dict[str, list[dict]], num: str, den: str) -> list[float]:
    """num's total / den's total, run k of one against run k of the other (in ABBA order the
    k-th runs of two backends are next to each other in time), for as many pairs as both have."""
    a, b = runs.get(num) or [], runs.get(den) or []
    return [x["total_ms"] / y["total_ms"] for x, y in zip(a, b) if y["total_ms"]]


# -- inside a rank ------------------------------------------------------------------------------


class Window:
    """One rank's tensors for one backend: the matmul operands and the collectives' buffers."""

    def __init__(self, mm: tuple[Any, Any, Any], bufs: list[Any]):
        self.a, self.b, self.c = mm
        self.bufs = bufs  # one Bufs per (size, collective), in issue order within a round


def make_matmul(oc: OverlapConfig, dev: Any, seed: int) -> tuple[Any, Any, Any]:
    import torch

    gen = torch.Generator(device=dev).manual_seed(seed)
    n = oc.matmul
    # Scaled so that products stay near 1 (bf16 keeps its precision; nothing overflows).
    a = (torch.randn(n, n, generator=gen, device=dev) / n**0.5).to(torch.bfloat16)
    b = torch.randn(n, n, generator=gen, device=dev).to(torch.bfloat16)
    return a, b, torch.empty(n, n, device=dev, dtype=torch.bfloat16)


def issue(win: Window, oc: OverlapConfig, call: Callable[[Any], Callable[[], Any]], side: Any, mm: bool, coll: bool) -> Any:
    """Queue one window's work (matmuls on the current stream, collectives on `side`); the
    current stream then waits for `side`. Returns the event marking the matmuls' end."""
    import torch

    compute = torch.cuda.current_stream()
    calls = [call(b) for _ in range(oc.rounds) for b in win.bufs] if coll else []
    side.wait_stream(compute)
    mm_end = torch.cuda.Event(enable_timing=True)
    k = 0
    for what in interleave(oc.matmuls if mm else 1, max(len(calls), 1)):
        if what == "m":
            if mm:
                torch.mm(win.a, win.b, out=win.c)
            continue
        if k < len(calls):
            with torch.cuda.stream(side):
                calls[k]()
            k += 1
    mm_end.record(compute)
    compute.wait_stream(side)
    return mm_end


def timed_window(
    r: Any, what: str, win: Window, oc: OverlapConfig, call: Callable[[Any], Callable[[], Any]], side: Any, mm: bool, coll: bool
) -> dict:
    """One window on every rank, started together (synchronize, then an agreement over gloo):
    ms from CUDA events on the compute stream (start, the matmuls' end, the end after the side
    stream joined) and the host's wall time, synchronize to synchronize. PhaseError on every
    rank if it failed on one."""
    import torch

    from ..fsdp import phase

    def window() -> dict:
        t0 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        mm_end = issue(win, oc, call, side, mm, coll)
        end.record()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        return {"ms": start.elapsed_time(end), "mm_ms": start.elapsed_time(mm_end), "wall_ms": wall}

    phase(r, f"{what}: synchronize before", lambda: None, SECTION)  # synchronizes, then all ranks agree: a barrier
    return phase(r, what, window, SECTION)


def run_once(r: Any, name: str, win: Window, oc: OverlapConfig, call: Callable[[Any], Callable[[], Any]], side: Any) -> dict:
    """One run of one backend: a warm-up window with both, then the three timed windows; the
    slowest rank's figures (METRICS). PhaseError on every rank if a window failed on one."""
    timed_window(r, f"overlap {name}: warm-up", win, oc, call, side, True, True)
    alone_mm = timed_window(r, f"overlap {name}: matmuls alone", win, oc, call, side, True, False)
    alone_coll = timed_window(r, f"overlap {name}: collectives alone", win, oc, call, side, False, True)
    both = timed_window(r, f"overlap {name}: both", win, oc, call, side, True, True)
    mine = [alone_mm["ms"], alone_coll["ms"], both["ms"], both["mm_ms"], both["wall_ms"]]
    return dict(zip(METRICS, r.agree.max(mine)))


def collective_call(backend: Any) -> Callable[[Any], Callable[[], Any]]:
    return lambda bufs: backend.call(bufs)


def run_overlap(r: Any) -> None:
    """The section, on every rank: results in r.meta["overlap"] (rank 0's are saved). `r` is the
    bench's Rank (or anything with its dev, agree, world, rank, cfg, meta, backends, log and
    save: scripts/gpu_overlap_smoke.py). The reference of the check is NCCL, or where there is
    no NCCL backend (ranks sharing one GPU, which NCCL refuses) the first backend, alone."""
    import torch

    from ..common import human, numels
    from ..fsdp import PhaseError, phase
    from .backends import close, make_bufs

    oc: OverlapConfig = r.cfg.overlap
    dt = torch.bfloat16
    backends = [b for b in r.backends if not b.is_symm and b.name in ("rsccl", "rsccl-pool", "nccl")]
    names = [b.name for b in backends if b.name == FIRST] + [b.name for b in backends if b.name != FIRST]
    by_name = {b.name: b for b in backends}
    order = abba_order(names, oc.repeats)
    res: dict[str, Any] = {
        "config": asdict(oc),
        "describe": oc.describe(),
        "order": order,
        "runs": {},
        "checks": {},
        "errors": {},
        "skipped": {},
        "reference": names[0] if names else "",
    }
    res["sms"] = torch.cuda.get_device_properties(r.dev).multi_processor_count
    r.meta["overlap"] = res
    if not names:
        res["errors"]["setup"] = "no backend to run (rsccl, rsccl-pool or nccl)"
        return
    r.log(f"overlap: {oc.describe()}")
    elem = torch.empty(0, dtype=dt).element_size()
    counts = []
    for size in oc.sizes:
        for collective in oc.collectives:
            c = numels(collective, size, r.world, elem)
            if c is None:
                res["errors"]["setup"] = f"{human(size)} holds too few bf16 elements for {r.world} ranks"
                return
            counts.append((collective, c))
    res["calls"] = [[col, (c[1] if col == "all_gather_into_tensor" else c[0]) * elem] for col, c in counts]
    state: dict[str, Any] = {}

    def prepare() -> None:
        gen = torch.Generator(device=r.dev).manual_seed(r.cfg.seed * 1013 + r.rank)
        state["mm"] = make_matmul(oc, r.dev, r.cfg.seed * 1013 + 17)
        state["inputs"] = [torch.randn(c[0], generator=gen, device=r.dev).to(dt) for _, c in counts]
        nc = by_name[names[0]]
        refs = []
        for (col, c), x in zip(counts, state["inputs"]):
            b = make_bufs(col, c, dt, r.dev)
            b.inp.copy_(x)
            nc.call(b)()
            refs.append(b.out)
        state["refs"] = refs
        state["side"] = torch.cuda.Stream(device=r.dev)
        for _ in range(2):  # cuBLAS handles and workspaces, before any timing
            torch.mm(state["mm"][0], state["mm"][1], out=state["mm"][2])

    try:
        phase(r, "overlap setup", prepare, SECTION)
    except PhaseError as e:
        res["errors"]["setup"] = str(e)
        r.log(f"overlap FAILED before timing: {e}")
        return
    wins: dict[str, Window] = {}
    for name in names:
        b = by_name[name]

        def buffers(b: Any = b) -> Window:
            bufs = []
            for (col, c), x in zip(counts, state["inputs"]):
                bb = b.bufs(col, c, dt, r.dev)
                bb.inp.copy_(x)
                bufs.append(bb)
            return Window(state["mm"], bufs)

        try:
            wins[name] = phase(r, f"overlap {name}: buffers", buffers, SECTION)
        except PhaseError as e:
            # rsccl-pool's buffers come from the default group's pool, sized for these
            # buffers too (config.pool_options); a pool the user sized smaller with
            # --rsccl-options only leaves its rows out, as in the rest of the bench.
            res["skipped" if b.pool is not None else "errors"][name] = str(e)
            r.log(f"overlap {name} left out: {e}")
            continue

        def check(b: Any = b, win: Window = wins[name]) -> list[tuple[bool, float]]:
            for bb in win.bufs:
                bb.out.zero_()
            one = OverlapConfig(matmul=oc.matmul, matmuls=oc.matmuls, sizes=oc.sizes, rounds=1, repeats=oc.repeats)
            issue(win, one, collective_call(b), state["side"], True, True)
            torch.cuda.synchronize()
            return [close(bb.out, ref, col, "bfloat16", r.world) for bb, ref, (col, _) in zip(win.bufs, state["refs"], counts)]

        try:
            got = phase(r, f"overlap {name}: check", check, SECTION)
        except PhaseError as e:
            res["errors"][name] = str(e)
            r.log(f"overlap {name} FAILED: {e}")
            wins.pop(name)
            continue
        per_rank = r.agree.gather(got)
        bad = [
            f"rank {k}: {res['calls'][j][0]} {human(res['calls'][j][1])} max |diff| {w:.3g}"
            for k, rows in enumerate(per_rank)
            for j, (ok, w) in enumerate(rows)
            if not ok
        ]
        res["checks"][name] = "ok" if not bad else f"WRONG: differs from {names[0]} alone (" + "; ".join(bad[:4]) + ")"
        if bad:
            r.log(f"overlap {name}: WRONG RESULT under overlap, seed {r.cfg.seed}: {'; '.join(bad[:4])}")
    for name in order:
        if name not in wins or name in res["errors"]:
            continue
        start = time.perf_counter()
        try:
            got = run_once(r, name, wins[name], oc, collective_call(by_name[name]), state["side"])
        except PhaseError as e:
            res["errors"][name] = str(e)
            r.log(f"overlap {name} FAILED: {e}")
            continue
        res["runs"].setdefault(name, []).append(got)
        r.log(
            f"overlap {name}: matmul {got['matmul_ms']:.2f} ms, collectives {got['collectives_ms']:.2f} ms, both "
            f"{got['total_ms']:.2f} ms ({time.perf_counter() - start:.1f} s)"
        )
        r.save()
    wins.clear()
    state.clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
