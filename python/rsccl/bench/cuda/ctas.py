"""How many SMs each collective's kernel occupies, per backend (issue 17, target 3), as far as
it can be known: a kernel's grid is its number of CTAs (thread blocks); a CTA runs on one SM,
so the SMs a kernel takes are at most its CTAs (fewer where the GPU places several on one SM).

- rsccl: the grid its engine decided and reports (rsccl.memory_stats() of the default group,
  read in the ranks after their first collectives: `cuda_small_blocks` up to
  `cuda_small_max_bytes`, `cuda_blocks` above and for all_to_all, `cuda_p2p_blocks` for each
  send and each recv kernel; rust/core/src/cuda/decide.rs `grid` and `grids_that_fit`).
  Nothing is recomputed here.
- NCCL: it does not report the grid it launches. What the environment bounds it to
  (NCCL_MIN_CTAS / NCCL_MAX_CTAS, NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS: one CTA per channel)
  is given when set; otherwise "NCCL's choice, not reported".
- Both, measured (--ctas-profile, on by default): the grids of the kernels a torch.profiler
  trace (CUPTI's kernel records) shows while a few calls of each collective run, at the
  smallest and the largest size benchmarked, per backend; last in the ranks, after every
  timing, so the profiler cannot disturb one. Where the trace has no grid, "n/a" and why.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from ..common import human
from .config import P2P

NCCL_CTA_VARIABLES = ("NCCL_MIN_CTAS", "NCCL_MAX_CTAS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_CTA_POLICY")
NOT_REPORTED = "NCCL's choice, not reported"


def nccl_cta_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of NCCL_CTA_VARIABLES set in `env` (what the ranks inherit)."""
    return {k: env[k] for k in NCCL_CTA_VARIABLES if env.get(k, "").strip()}


def nccl_ctas(env: Mapping[str, str]) -> str:
    """What can honestly be said about NCCL's grid from the variables set (nccl_cta_env)."""
    lo = [env[k] for k in ("NCCL_MIN_CTAS", "NCCL_MIN_NCHANNELS") if k in env]
    hi = [env[k] for k in ("NCCL_MAX_CTAS", "NCCL_MAX_NCHANNELS") if k in env]
    if not env:
        return NOT_REPORTED
    given = ", ".join(f"{k}={v}" for k, v in env.items())
    if lo and hi and len(set(lo + hi)) == 1:
        return f"{lo[0]} ({given}; the grid NCCL launched is not reported)"
    bound = []
    if lo:
        bound.append(f"at least {max(lo, key=_num)}")
    if hi:
        bound.append(f"at most {min(hi, key=_num)}")
    return f"{' and '.join(bound) or 'set'} ({given}; the grid NCCL launched is not reported)"


def _num(v: str) -> float:
    try:
        return float(v)
    except ValueError:
        return float("inf")


def rsccl_ctas(stats: Mapping[str, object], collective: str) -> int | None:
    """The grid of rsccl's kernel for `collective` as its engine reports it, or None if the
    stats lack it (a group without the CUDA engine, or an rsccl that does not report it)."""
    key = "cuda_p2p_blocks" if collective == P2P else "cuda_blocks"
    v = stats.get(key)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


# rust/core/src/cuda/decide.rs copy_engine
COPY_ENGINE_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", P2P)
# reduce_scatter's reduce kernel on the copy engines (rust/core/src/cuda/engine/copy.rs
# REDUCE_BLOCKS), at most the collective grid.
COPY_ENGINE_REDUCE_CTAS = 16


def copy_engine_from(stats: Mapping[str, object], collective: str) -> int | None:
    """The message size from which rsccl moves `collective` on the copy engines (no SM; its
    barriers are kernels of one CTA), or None (never, or not reported)."""
    v = stats.get("cuda_copy_engine_min_bytes")
    if collective not in COPY_ENGINE_COLLECTIVES or not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        return None
    return v


# The bench's size of each collective with low-latency kernels, in what each rank sends each
# peer (cuda_low_latency_max_bytes' unit) times this factor: the all_reduce tensor (1), the
# all_gather output and the reduce_scatter input (world).
LOW_LATENCY_SIZE_PER_RANK = {"all_reduce": False, "all_gather_into_tensor": True, "reduce_scatter_tensor": True}


def small_grid(per_rank: list[Mapping[str, object]], collective: str) -> tuple[int, int] | None:
    """(blocks, up to bytes) of the small grid rsccl runs `collective` on up to a size
    (memory_stats' cuda_small_blocks and cuda_small_max_bytes, and the low-latency kernels,
    which take it up to cuda_low_latency_max_bytes per rank: rust/core/src/cuda/decide.rs
    `grid`), when every rank reports the same one below the group's grid; None otherwise, and
    for all_to_all and send/recv, which always take their group's grid. Sizes are the
    bench's (per world of ranks: len(per_rank))."""
    if collective in (P2P, "all_to_all_single") or not per_rank:
        return None
    keys = ("cuda_small_blocks", "cuda_small_max_bytes", "cuda_blocks")
    got = {(*(s.get(k) for k in keys), s.get("cuda_low_latency_max_bytes", 0)) for s in per_rank}
    if len(got) != 1:
        return None
    blocks, upto, full, ll = got.pop()
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (blocks, upto, full, ll)) or blocks >= full:
        return None
    if collective in LOW_LATENCY_SIZE_PER_RANK:
        upto = max(upto, ll * (len(per_rank) if LOW_LATENCY_SIZE_PER_RANK[collective] else 1))
    return blocks, upto


def rsccl_cell(per_rank: list[Mapping[str, object]], collective: str) -> str:
    """rsccl's grid for `collective` on every rank ("n/a" if not reported); the ranks agree on
    it at group creation, so one figure, else each rank's. Up to the small-grid size, the
    small grid first (`small_grid`). From the copy-engine size on: 0 CTAs move the data,
    with barrier kernels of 1 CTA (and, for reduce_scatter, a local reduce kernel of
    COPY_ENGINE_REDUCE_CTAS, at most the collective grid)."""
    got = [rsccl_ctas(s, collective) for s in per_rank]
    if not got or all(g is None for g in got):
        return "n/a (not in memory_stats)"
    cell = str(got[0]) if len(set(got)) == 1 else " / ".join("n/a" if g is None else str(g) for g in got) + " (per rank)"
    if (small := small_grid(per_rank, collective)) is not None:
        cell = f"{small[0]} up to {human(small[1])}, {cell} above"
    ce = {copy_engine_from(s, collective) for s in per_rank}
    if len(ce) == 1 and (at := ce.pop()) is not None:
        if collective == "reduce_scatter_tensor":
            grid = min([COPY_ENGINE_REDUCE_CTAS, *(g for g in got if g is not None)])
            cell += f"; from {human(at)}: {grid} (a reduce kernel per round; copy engines move the data; 1-CTA barrier kernels)"
        else:
            cell += f"; from {human(at)}: 0 (copy engines; 1-CTA {'signal' if collective == P2P else 'barrier'} kernels)"
    return cell


PROFILED_CALLS = 3  # calls per profiled (collective, size, backend)
PROFILE_ALLOWANCE_S = 60.0  # added to --timeout when the grids are profiled (the profiler's start, ~24 traces)
PROFILED_BACKENDS = ("rsccl", "nccl")


def kernel_grids(trace: Mapping[str, Any]) -> dict[str, int]:
    """{kernel name: the largest grid (CTAs, x * y * z) it ran with} from a torch.profiler
    Chrome trace (kineto writes a kernel's launch grid as args "grid": [x, y, z])."""
    out: dict[str, int] = {}
    for ev in trace.get("traceEvents", []):
        if not isinstance(ev, dict) or str(ev.get("cat", "")).lower() != "kernel":
            continue
        grid = (ev.get("args") or {}).get("grid")
        if not (isinstance(grid, list) and len(grid) == 3 and all(isinstance(g, int) and g > 0 for g in grid)):
            continue
        name = str(ev.get("name", "?"))
        out[name] = max(out.get(name, 0), grid[0] * grid[1] * grid[2])
    return out


def profiled_grids(fn: Callable[[], Any], calls: int = PROFILED_CALLS) -> dict[str, int]:
    """kernel_grids() of a profile of `calls` calls of fn (CUDA activity only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory(prefix="rsccl-bench-trace-") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return kernel_grids(json.load(f))


def measured_cell(got: Mapping[str, Any] | None) -> str:
    """A backend's measured grids for one collective: "<size>: <CTAs>" per size profiled
    (several kernels: their grids joined by "+"; none seen or a failure: why)."""
    if not got:
        return "n/a"
    cells = []
    for size, grids in sorted(got.items(), key=lambda kv: int(kv[0])):
        if isinstance(grids, str):
            cells.append(f"{human(int(size))}: n/a ({grids[:120]})")
        elif not grids:
            cells.append(f"{human(int(size))}: n/a (no kernel grid in the trace)")
        else:
            cells.append(f"{human(int(size))}: {'+'.join(str(v) for v in grids.values())}")
    return "; ".join(cells)


def cta_rows(meta: dict, collectives: list[str] | tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(collective, rsccl CTAs, nccl CTAs) per collective benchmarked, as the engine and the
    environment say (measured_rows: as the profiler saw them)."""
    stats = meta.get("rsccl_memory_stats") or []
    nccl = nccl_ctas(meta.get("nccl_cta_env") or {})
    return [(c, rsccl_cell(stats, c), nccl) for c in collectives]


def measured_rows(meta: dict, collectives: list[str] | tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(collective, rsccl's measured grids, nccl's) where the profiler ran (empty if it did not)."""
    measured = meta.get("ctas_measured") or {}
    if not measured:
        return []
    return [(c, *(measured_cell((measured.get(c) or {}).get(b)) for b in PROFILED_BACKENDS)) for c in collectives if c in measured]


def cta_markdown(meta: dict, collectives: list[str] | tuple[str, ...]) -> list[str]:
    """The "SMs per collective" section of bench_cuda_w<world>.md (empty without the stats)."""
    if not meta.get("rsccl_memory_stats"):
        return []
    sms = meta.get("sms")
    out = [
        "",
        "## SMs per collective kernel (CTAs)",
        "",
        (
            f"The grid (CTAs, thread blocks) of each collective's kernel; a CTA runs on one SM, so the SMs a kernel "
            f"takes are at most its CTAs, of the GPU's {sms if sms else '?'} SMs. rsccl: as its engine reports it "
            "(rsccl.memory_stats() of the default group: cuda_small_blocks up to cuda_small_max_bytes, cuda_blocks "
            "above and for all_to_all, cuda_p2p_blocks for each send and each recv kernel; rsccl-pool is the same group, the --sweep-one-shot groups have the same "
            "options). NCCL: bounded only by NCCL_MIN/MAX_CTAS or NCCL_MIN/MAX_NCHANNELS when set; it does not report "
            "the grid it launched."
        ),
        "",
        "| collective | rsccl CTAs | nccl CTAs |",
        "|---|---:|---|",
    ]
    measured = {c: (rs, nc) for c, rs, nc in measured_rows(meta, collectives)}
    if measured:
        out[-2:] = [
            "| collective | rsccl CTAs (engine) | nccl CTAs (environment) | rsccl CTAs (profiler) | nccl CTAs (profiler) |",
            "|---|---:|---|---|---|",
        ]
        out += [f"| {c} | {rs} | {nc} | {' | '.join(measured.get(c, ('n/a', 'n/a')))} |" for c, rs, nc in cta_rows(meta, collectives)]
    else:
        out += [f"| {c} | {rs} | {nc} |" for c, rs, nc in cta_rows(meta, collectives)]
    if meta.get("ctas_measured_error"):
        out += ["", f"Profiled grids: FAILED: {meta['ctas_measured_error']}"]
    elif measured:
        out += [
            "",
            (
                f"Profiler columns: the grid of each kernel a torch.profiler trace (CUDA activity, CUPTI) recorded on rank 0 "
                f"during {PROFILED_CALLS} calls, at the smallest and the largest size benchmarked, after every timing "
                "('+' joins the grids of different kernels)."
            ),
        ]
    return out


def cta_summary_lines(world: int, meta: dict, collectives: list[str] | tuple[str, ...]) -> list[str]:
    """One line: rsccl's grid per collective (grouped where equal) and what is known of NCCL's."""
    rows = cta_rows(meta, collectives)
    if not rows or not meta.get("rsccl_memory_stats"):
        return []
    groups: dict[str, list[str]] = {}
    for c, rs, _ in rows:
        groups.setdefault(rs, []).append(c)
    sms = meta.get("sms")
    rs_text = "; ".join(f"{','.join(cs)} {rs}" for rs, cs in groups.items())
    lines = [f"w{world} CTAs per kernel (of {sms if sms else '?'} SMs): rsccl {rs_text}; nccl {rows[0][2]}"]
    for c, rs, nc in measured_rows(meta, collectives):
        lines.append(f"w{world} CTAs profiled {c[:22]}: rsccl {rs} | nccl {nc}")
    return lines
