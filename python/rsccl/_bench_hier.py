"""Hierarchical vs flat all_reduce on an emulated multi-host topology (python -m rsccl.bench
--device cuda --hier): each rank sets RSCCL_HOST_ID to "emul-host-{rank // per_host}" while it
creates two rsccl groups, so rsccl sees `hosts` hosts of `per_host` GPUs and runs CUDA
collectives on its NCCL engine: one group takes the hierarchical path from
nccl_hierarchical_min_bytes (rsccl reduce-scatter inside each host, NCCL all_reduce across,
rsccl all-gather), the other is forced flat (one NCCL all_reduce over every rank). Both are
timed against torch's own NCCL group over the same ranks, in ABBA order, and checked
against it on random integers (exact whatever the reduction order).

On one machine the "hosts" are joined by NVLink, not a network: the comparison shows the
cost of the extra phases and what the host-local kernels win, not a real cross-host run.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from typing import Any

MiB = 1 << 20


def _rank_main(rank: int, world: int, per_host: int, port: int, sizes: list[int], iters: int, q: Any) -> None:
    import torch
    import torch.distributed as dist

    import rsccl

    out: dict[str, Any] = {"rank": rank, "rows": [], "errors": []}
    try:
        torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        dist.init_process_group("rsccl", store=store, rank=rank, world_size=world)
        nccl = dist.new_group(backend="nccl")
        old = os.environ.get("RSCCL_HOST_ID")
        os.environ["RSCCL_HOST_ID"] = f"emul-host-{rank // per_host}"
        try:
            hier = dist.new_group(backend="rsccl", pg_options=rsccl.Options(nccl_hierarchical_min_bytes="16MiB"))
            flat = dist.new_group(backend="rsccl", pg_options=rsccl.Options(nccl_hierarchical_min_bytes=str(1 << 40)))
        finally:
            if old is None:
                os.environ.pop("RSCCL_HOST_ID", None)
            else:
                os.environ["RSCCL_HOST_ID"] = old
        out["hosts"] = len(hier._comm.hosts)
        out["engine"] = getattr(hier._comm, "cuda_engine", "?")
        g = torch.Generator(device="cuda").manual_seed(1000 + rank)

        def timeit(group: Any, x: torch.Tensor) -> float:
            torch.cuda.synchronize()
            dist.barrier(group=nccl)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(iters):
                dist.all_reduce(x, group=group)
            e.record()
            torch.cuda.synchronize()
            return s.elapsed_time(e) / iters * 1000.0

        for size in sizes:
            n = size // 4
            base = torch.randint(-1000, 1000, (n,), device="cuda", generator=g, dtype=torch.int32)
            ref = base.clone()
            dist.all_reduce(ref, group=nccl)
            ok = {}
            for name, grp in (("flat", flat), ("hier", hier)):
                y = base.clone()
                dist.all_reduce(y, group=grp)
                torch.cuda.synchronize()
                ok[name] = bool(torch.equal(y, ref))
            x = torch.randn(size // 2, device="cuda", generator=g, dtype=torch.bfloat16)
            for grp in (nccl, flat, hier):  # warm-up
                for _ in range(3):
                    dist.all_reduce(x, group=grp)
            t = {"nccl": [], "flat": [], "hier": []}
            for order in (("nccl", "flat", "hier"), ("hier", "flat", "nccl")):
                for name in order:
                    t[name].append(timeit({"nccl": nccl, "flat": flat, "hier": hier}[name], x))
            stats = hier._comm.memory_stats()
            out["rows"].append(
                {"bytes": size, **{k: min(v) for k, v in t.items()}, "ok_flat": ok["flat"], "ok_hier": ok["hier"],
                 "hier_calls": int(stats.get("nccl_hierarchical_collectives", -1))}
            )
        dist.barrier(group=nccl)
        for grp in (hier, flat, nccl):
            dist.destroy_process_group(grp)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported by the parent
        out["errors"].append(traceback.format_exc())
    q.put(out)


def run(world: int = 4, per_host: int = 2, sizes: list[int] | None = None, iters: int = 20, timeout: float = 300.0) -> tuple[str, bool]:
    """Run the comparison; returns (Markdown table, all checks passed)."""
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < world:
        return f"hierarchical all_reduce: needs {world} GPUs, {torch.cuda.device_count()} visible; skipped\n", True
    sizes = sizes or [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, per_host, port, sizes, iters, q)) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + timeout
    while len(results) < world and time.monotonic() < deadline:
        try:
            results.append(q.get(timeout=max(0.1, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001 - the deadline passed
            break
    for p in procs:
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
    errors = [e for r in results for e in r["errors"]]
    if len(results) < world:
        errors.append(f"{world - len(results)} rank(s) did not report within {timeout:.0f} s")
    lines = [
        f"### Hierarchical all_reduce, {world // per_host} emulated hosts x {per_host} GPUs (bf16; int32 for the check)",
        "",
        "| bytes | NCCL (torch) us | rsccl flat (NCCL engine) us | rsccl hierarchical us | hier / NCCL speed | checked vs NCCL | hierarchical calls |",
        "|---:|---:|---:|---:|---:|:---|---:|",
    ]
    ok = not errors
    if results and not errors:
        r0 = sorted(results, key=lambda r: r["rank"])[0]
        for row in r0["rows"]:
            good = all(r2["rows"][i]["ok_flat"] and r2["rows"][i]["ok_hier"] for r2 in results for i, rr in enumerate(r2["rows"]) if rr["bytes"] == row["bytes"])
            ok = ok and good
            size = row["bytes"]
            lines.append(
                f"| {size >> 20} MiB | {row['nccl']:.1f} | {row['flat']:.1f} | {row['hier']:.1f} | "
                f"{row['nccl'] / row['hier']:.2f}x | {'bit-equal' if good else 'WRONG'} | {row['hier_calls']} |"
            )
        lines.append("")
        lines.append(f"hosts seen by the group: {r0.get('hosts')}, CUDA engine: {r0.get('engine')}")
    if errors:
        lines.append("")
        lines.append("errors:")
        lines += ["```", *errors, "```"]
    return "\n".join(lines) + "\n", ok


if __name__ == "__main__":
    table, good = run(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
    print(table)
    sys.exit(0 if good else 1)
