"""The CUDA bench's verdicts: in place (rsccl-pool) vs staged (rsccl), and the all_to_all_single
and send/recv targets.
"""

from __future__ import annotations

from collections.abc import Callable

from ..common import human
from .config import (
    A2A,
    A2A_BUSBW_FROM_BYTES,
    A2A_LATENCY_TARGET,
    A2A_LATENCY_UP_TO_BYTES,
    P2P,
    P2P_TARGET_BYTES,
    P2P_TARGET_GBPS,
    POOL_BACKEND,
    POOL_COLLECTIVES,
    POOL_SPEEDUP_MIN_BYTES,
    POOL_SPEEDUP_TARGET,
)
from .tables import fmt, path_label, path_ok, time_cell


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
