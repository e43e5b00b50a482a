"""The FSDP2 section's report, in the parent: its Markdown table and verdicts, the summary lines
printed last, and what fails the run (rsccl/bench/fsdp.py runs the section).
"""

from __future__ import annotations

import math

from .fsdp import LOSS_RTOL, RUN_ORDER, calls_text, mib


def ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def step_ms(row: dict) -> float:
    """A backend's step time: the median of its runs' means (`step`, fsdp.run_fsdp)."""
    return row["step"]["median"] if "step" in row else row["mean_ms"]


def runs_text(row: dict) -> str:
    """ " (run 1 / run 2 / ..., spread x%)" for a backend of more than one run; "" otherwise."""
    r = row.get("round_ms") or []
    if len(r) < 2:
        return ""
    return (
        f" ({' / '.join(f'{v:.2f}' for v in r)}, spread {row['step']['spread']:.1%})"
        if "step" in row
        else f" ({' / '.join(f'{v:.2f}' for v in r)})"
    )


def pool_comms_text(which: str) -> str:
    """What the rsccl run took from its pool (rsccl.fsdp.use_pool)."""
    if which == "all_gather":
        return (
            "`set_custom_all_gather(PoolAllGather(group))` on every FSDP module, so FSDP's all-gather outputs come "
            "from rsccl's pool, its reduce-scatter buffers and float32 gradient shards from torch's allocator"
        )
    return (
        "`set_allocate_memory_from_process_group_for_comm(True)` on every FSDP module, so FSDP's all-gather "
        "outputs and reduce-scatter buffers, and with them its float32 gradient shards, come from rsccl's pool"
    )


def loss_check(runs: dict) -> tuple[bool | None, str]:
    """(agree, text) for the final losses of the two backends; (None, ...) if one is missing."""
    a, b = runs.get("rsccl"), runs.get("nccl")
    if not (a and b):
        return None, "n/a"
    la, lb = a["loss_final"], b["loss_final"]
    ok = math.isfinite(la) and math.isfinite(lb) and abs(la - lb) <= LOSS_RTOL * max(abs(lb), 1e-6)
    return ok, f"rsccl {la:.4f} / nccl {lb:.4f} ({'ok' if ok else 'DIFFER'}: within {LOSS_RTOL:.0%} required)"


def fsdp_markdown(fsdp: dict | None, world: int) -> list[str]:
    """The FSDP2 section of bench_cuda_w<world>.md (empty if it did not run)."""
    if not fsdp:
        return []
    c = fsdp.get("config", {})
    out = [
        "",
        "## FSDP2 training steps: rsccl (pool buffers, in place) vs NCCL",
        "",
        (
            f"- model: {fsdp.get('describe', '?')}; float32 master weights, MixedPrecisionPolicy(param_dtype=bfloat16, "
            "reduce_dtype=float32), fully_shard on every layer and on the root, AdamW; DeviceMesh.from_group(group, "
            '"cuda") over a group created for this section (rsccl: `new_group(backend="rsccl")` with '
            f"cuda_pool_bytes {mib(fsdp.get('pool_bytes'))} MiB and {pool_comms_text(c.get('pool_comms', 'both'))}; "
            'NCCL: `new_group(backend="nccl")`, FSDP\'s default buffers)'
        ),
        (
            f"- same seed, same weights, same data per rank for both; {c.get('warmup', '?')} warm-up steps, then "
            f"{c.get('steps', '?')} timed ones; step time: CUDA events around each step on the compute stream, a "
            "rank's mean = first start to last end / steps, the slowest rank's reported; min / max over steps of "
            "the slowest rank at each step; final loss: the last timed step's, averaged over ranks"
        ),
        (
            f"- run order: {' then '.join(fsdp.get('order', RUN_ORDER))} (step time: the median of a backend's runs, "
            "each run's in parentheses with their spread, (max - min) / median; memory and losses: its first run's); before each: gc, torch.cuda.empty_cache(), "
            "torch.cuda.reset_peak_memory_stats(); one unsharded layer ran forward and backward before both "
            "(kernels, math-library handles)"
        ),
        (
            "- memory, max over ranks: *peak reserved* = torch.cuda.max_memory_reserved() over the run (what torch's "
            "caching allocator held, including the segments it took from rsccl's pool; it does not count the rest "
            "of the pool, which rsccl maps at group creation outside torch's allocator, nor NCCL's own buffers, "
            "which NCCL allocates itself, partly at its first collective); *reserved at start*: what torch already "
            "held when the run began (the benchmark's earlier buffers included); *device used* = total - free from "
            "torch.cuda.mem_get_info() after the warm-up and after the timed steps, the larger (device-wide: "
            "everything the process holds, both libraries' memory, rsccl's whole pool and the benchmark's earlier "
            "groups included); *added* = device used minus device used at the run's start: the backend's group, "
            "model, optimizer state, activations and library buffers, the fair comparison of the two; *group "
            "creation* = what creating the group took"
        ),
        "",
    ]
    runs, errors = fsdp.get("runs", {}), fsdp.get("errors", {})
    for what, why in errors.items():
        out += [f"**FSDP2 {what} FAILED: {why}**", ""]
    if runs:
        out += [
            (
                "| backend | step ms (median of runs, slowest rank) | per step min / max | peak reserved MiB | reserved at "
                "start MiB | device used MiB | added MiB | group creation MiB | first / final loss | collectives in "
                "place / staged | pool MiB (capacity / peak) |"
            ),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name in dict.fromkeys(fsdp.get("order", RUN_ORDER)):
            row = runs.get(name)
            if not row:
                continue
            pool = f"{mib(row['pool_bytes'])} / {mib(row['pool_peak_bytes'])}" if name == "rsccl" else "-"
            out.append(
                f"| {name} | {ms(step_ms(row))}{runs_text(row)} | {ms(row['step_min_ms'])} / {ms(row['step_max_ms'])} "
                f"| {mib(row['peak_reserved'])} | {mib(row['reserved_start'])} | {mib(row['used_peak'])} "
                f"| {mib(row['used_added'])} | {mib(row['group_init'])} | {row['loss_first']:.4f} / {row['loss_final']:.4f} "
                f"| {calls_text(row) if name == 'rsccl' else '-'} | {pool} |"
            )
        rs = runs.get("rsccl")
        if rs and rs.get("pool_alloc") is False:
            out += ["", ("**rsccl's group did not offer pool allocation (supports_tensor_alloc False): FSDP used torch's allocator**")]
        if rs and rs.get("counts_per_rank"):
            out += ["", f"In-place / staged counts differ between ranks: {rs['counts_per_rank']}"]
        out += ["", "Verdicts: " + "; ".join(verdicts(runs))]
    return out


def verdicts(runs: dict) -> list[str]:
    rs, nc = runs.get("rsccl"), runs.get("nccl")
    if not (rs and nc):
        return [
            f"{name} n/a (did not finish)"
            if not row
            else f"{name} only: {step_ms(row):.2f} ms per step, peak reserved {mib(row['peak_reserved'])} MiB, device "
            f"memory added {mib(row['used_added'])} MiB, final loss {row['loss_final']:.4f}"
            for name, row in (("rsccl", rs), ("nccl", nc))
        ]
    out = []
    r_ms, n_ms = step_ms(rs), step_ms(nc)
    ratio = n_ms / r_ms if r_ms else float("nan")
    out.append(
        f"step time (median) rsccl {r_ms:.2f} ms{runs_text(rs)} / nccl {n_ms:.2f} ms{runs_text(nc)} = "
        f"nccl/rsccl {ratio:.2f}x, "
        f"target rsccl <= nccl: {'met' if r_ms <= n_ms else 'NOT MET'}"
    )
    if rs["peak_reserved"] is not None and nc["peak_reserved"] is not None:
        out.append(
            f"peak reserved rsccl {mib(rs['peak_reserved'])} / nccl {mib(nc['peak_reserved'])} MiB, target "
            f"rsccl <= nccl: {'met' if rs['peak_reserved'] <= nc['peak_reserved'] else 'NOT MET'}"
        )
    out.append(f"device memory added by the run rsccl {mib(rs['used_added'])} / nccl {mib(nc['used_added'])} MiB")
    out.append("final loss " + loss_check(runs)[1])
    return out


def fsdp_summary_lines(world: int, fsdp: dict | None) -> list[str]:
    if not fsdp:
        return []
    c = fsdp.get("config", {})
    head = (
        f"w{world} fsdp2 ({c.get('layers', '?')} layers, d {c.get('dim', '?')}, seq {c.get('seq', '?')} x batch "
        f"{c.get('batch', '?')}, {c.get('steps', '?')} steps)"
    )
    lines = [f"{head}: " + "; ".join(verdicts(fsdp.get("runs", {})))]
    rs = fsdp.get("runs", {}).get("rsccl")
    if rs:
        lines.append(
            f"w{world} fsdp2 rsccl: collectives in place / staged {calls_text(rs)}; pool "
            f"{mib(rs['pool_bytes'])} MiB, peak used {mib(rs['pool_peak_bytes'])} MiB; device used peak "
            f"{mib(rs['used_peak'])} MiB (nccl run: "
            f"{mib(fsdp['runs']['nccl']['used_peak']) if 'nccl' in fsdp.get('runs', {}) else 'n/a'} MiB)"
        )
    for what, why in fsdp.get("errors", {}).items():
        lines.append(f"w{world} fsdp2 {what} FAILED: {why}")
    return lines


def fsdp_problems(world: int, fsdp: dict | None) -> list[str]:
    """What makes the run's exit status non-zero: a failed phase, losses that disagree."""
    if not fsdp:
        return []
    out = [f"w{world} FSDP2 {what}: {why}" for what, why in fsdp.get("errors", {}).items()]
    ok, text = loss_check(fsdp.get("runs", {}))
    if ok is False:
        out.append(f"w{world} FSDP2 final losses differ: {text}")
    return out
