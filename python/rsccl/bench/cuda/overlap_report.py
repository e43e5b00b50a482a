"""The overlap section's report, in the parent: its Markdown table and verdict, the summary lines
printed last, and what fails the run (rsccl/bench/cuda/overlap.py runs the section).
"""

from __future__ import annotations

from ..common import human
from .ctas import nccl_ctas, rsccl_cell
from .overlap import FIRST, TARGET_RATIO, paired_ratios, summarize
from .overlap_config import OVERLAP_COLLECTIVES

REFERENCE = "nccl"
# The backend the target is read on: rsccl on torch's buffers (staged), as a user gets it
# without the pool; rsccl-pool (in place) is reported beside it.
TARGET_BACKEND = "rsccl"


def cell(s: dict | None, digits: int = 2, unit: str = "") -> str:
    """A spread() as "median (min-max)"; "n/a" when missing."""
    if not s:
        return "n/a"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}{unit}"
    return f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def vs_reference(ov: dict, name: str) -> tuple[float | None, list[float]]:
    """(median total of `name` / median total of NCCL, the paired run-by-run ratios)."""
    stats = summarize(ov.get("runs", {}))
    a, b = stats.get(name), stats.get(REFERENCE)
    if not (a and b) or not b["total_ms"]["median"]:
        return None, []
    return a["total_ms"]["median"] / b["total_ms"]["median"], paired_ratios(ov.get("runs", {}), name, REFERENCE)


def verdict(ov: dict) -> str:
    """The target line: rsccl's total / NCCL's total, medians, against TARGET_RATIO."""
    ratio, pairs = vs_reference(ov, TARGET_BACKEND)
    if ratio is None:
        return f"{TARGET_BACKEND} total / {REFERENCE} total: n/a (a backend did not finish)"
    paired = f" (run by run: {' / '.join(f'{p:.3f}' for p in pairs)})" if pairs else ""
    met = "met" if ratio <= TARGET_RATIO else "NOT MET"
    return f"{TARGET_BACKEND} total / {REFERENCE} total {ratio:.3f}x{paired}, target <= {TARGET_RATIO}x: {met}"


def ctas_cell(meta: dict, name: str) -> str:
    if name.startswith("rsccl"):
        ran = {c for c, _ in (meta.get("overlap") or {}).get("calls", [])} or set(OVERLAP_COLLECTIVES)
        cells = {rsccl_cell(meta.get("rsccl_memory_stats") or [], c) for c in OVERLAP_COLLECTIVES if c in ran}
        return " / ".join(sorted(cells))
    if name == "nccl":
        return nccl_ctas(meta.get("nccl_cta_env") or {})
    return "n/a"


def overlap_markdown(ov: dict | None, meta: dict) -> list[str]:
    """The overlap section of bench_cuda_w<world>.md (empty if it did not run)."""
    if not ov:
        return []
    calls = ", ".join(f"{c} {human(b)}" for c, b in ov.get("calls", []))
    out = [
        "",
        "## Overlap: bf16 matmuls on the compute stream, all_gather / reduce_scatter on a side stream",
        "",
        f"- work per window: {ov.get('describe', '?')}; one round = {calls or '?'} (sizes per rank: the all_gather OUTPUT, the reduce_scatter INPUT)",
        (
            "- per run of a backend, after one untimed window with both: the matmuls alone, the collectives alone, "
            "then both, issued interleaved from the host (collectives inside `torch.cuda.stream(side)`, blocking "
            "calls, async_op=False); each window starts after synchronize and an agreement of all ranks; ms from CUDA "
            "events on the compute stream (both: after the side stream joined it), the slowest rank's; *matmuls' part* "
            "= the matmuls' end within the window with both; *host wall* = perf_counter from before the first call to "
            "after synchronize (the window with both)"
        ),
        (
            f"- run order: {' '.join(ov.get('order', []))} (ABBA); every cell is the median over a backend's runs "
            "(min-max); *total / matmul alone* and *total / serial* (= both / (matmul alone + collectives alone)) are "
            f"per run, then the median; *vs {REFERENCE}* = median total / {REFERENCE}'s median total; check: the "
            f"collectives run once with the matmuls on seeded random inputs, against {ov.get('reference') or REFERENCE} alone on the same inputs"
        ),
        f"- CTAs per collective kernel: rsccl as its engine reports it (rsccl.memory_stats() cuda_blocks), of {ov.get('sms', '?')} SMs",
        "",
    ]
    for what, why in ov.get("errors", {}).items():
        out += [f"**overlap {what} FAILED: {why}**", ""]
    for what, why in ov.get("skipped", {}).items():
        out += [f"overlap {what} left out: {why}", ""]
    runs = ov.get("runs", {})
    stats = summarize(runs)
    if stats:
        out += [
            (
                "| backend | runs | matmul alone ms | collectives alone ms | both (total) ms | matmuls' part ms | host wall ms "
                f"| total / matmul alone | total / serial | vs {REFERENCE} | CTAs per collective | check |"
            ),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for name in dict.fromkeys(ov.get("order", [])):
            s = stats.get(name)
            if not s:
                continue
            ratio, _ = vs_reference(ov, name)
            vs = "-" if name == REFERENCE else (f"{ratio:.3f}x" if ratio is not None else "n/a")
            out.append(
                f"| {name} | {s['total_ms']['n']} | {cell(s['matmul_ms'])} | {cell(s['collectives_ms'])} | {cell(s['total_ms'])} "
                f"| {cell(s['matmul_in_overlap_ms'])} | {cell(s['wall_ms'])} | {cell(s['total_over_matmul'], 3, 'x')} "
                f"| {cell(s['total_over_serial'], 3, 'x')} | {vs} | {ctas_cell(meta, name)} | {ov.get('checks', {}).get(name, 'n/a')} |"
            )
        out += ["", "Verdict: " + verdict(ov)]
    return out


def overlap_summary_lines(world: int, ov: dict | None) -> list[str]:
    if not ov:
        return []
    stats = summarize(ov.get("runs", {}))
    c = ov.get("config", {})
    head = f"w{world} overlap (matmul {c.get('matmul', '?')}^3 x {c.get('matmuls', '?')}, {c.get('rounds', '?')} rounds)"
    cells = []
    for name in dict.fromkeys([FIRST, *ov.get("order", [])]):
        s = stats.get(name)
        if s:
            cells.append(
                f"{name} total {s['total_ms']['median']:.2f} ms (spread {s['total_ms']['spread']:.1%}), "
                f"{s['total_over_matmul']['median']:.2f}x matmul alone"
            )
    lines = [f"{head}: " + ("; ".join(cells) + "; " if cells else "") + verdict(ov)]
    for what, why in ov.get("errors", {}).items():
        lines.append(f"w{world} overlap {what} FAILED: {why}")
    for name, check in ov.get("checks", {}).items():
        if check != "ok":
            lines.append(f"w{world} overlap {name} {check}")
    return lines


def overlap_problems(world: int, ov: dict | None) -> list[str]:
    """What makes the run's exit status non-zero: a failed phase, a wrong result under overlap."""
    if not ov:
        return []
    out = [f"w{world} overlap {what}: {why}" for what, why in ov.get("errors", {}).items()]
    out += [f"w{world} overlap {name}: {check}" for name, check in ov.get("checks", {}).items() if check != "ok"]
    return out
