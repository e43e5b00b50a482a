"""The CUDA bench's results as text: the cells, the summary lines printed last, and the CSV."""

from __future__ import annotations

import csv
from pathlib import Path

from ..common import CSV_KEY_COLUMNS, bus_factor, human
from .config import BACKEND_ORDER, POOL_BACKEND, SHORT, Config

CSV_COLUMNS = (
    *CSV_KEY_COLUMNS,
    "eager_us",
    "cpu_us",
    "async_us",
    "graph_us",
    "algbw_GBps",
    "busbw_GBps",
    "vs_nccl",
    "iters",
    "check",
    "note",
)


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
    if r.get(key) is not None:
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
            eager, cpu, async_ = (
                fmt(r[k], 1e6, 3) if r.get(k) is not None else time_cell(r, k).replace("n/a", "") for k in ("eager_s", "cpu_s", "async_s")
            )
            w.writerow(
                [
                    "cuda",
                    r["world_size"],
                    r["collective"],
                    r["bytes"],
                    r["backend"],
                    eager,
                    cpu,
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
