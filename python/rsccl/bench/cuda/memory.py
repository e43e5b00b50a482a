"""The CUDA bench's memory report: what each backend holds after init and adds at its first
collectives, per rank (Markdown) and as one summary line.
"""

from __future__ import annotations

from .config import MiB


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
