"""Hierarchical vs flat all_reduce, all_gather and reduce_scatter on an emulated multi-host
topology (python -m rsccl.bench --device cuda --hier): each rank sets RSCCL_HOST_ID to
"emul-host-{rank // per_host}" while it creates two rsccl groups, so rsccl sees `hosts` hosts
of `per_host` GPUs (host-major ranks) and runs CUDA collectives on its NCCL engine: one group
takes the hierarchical path from nccl_hierarchical_min_bytes (16 MiB; its reduce_scatter
scratch raised to 128 MiB so that every size from there runs hierarchically), the other is
forced flat (one NCCL collective over every rank). Hierarchical all_reduce: rsccl
reduce-scatter inside each host, NCCL all_reduce across, rsccl all-gather; all_gather: NCCL
broadcasts across hosts, rsccl all_gather inside; reduce_scatter: rsccl reduce_scatter
inside, NCCL reduce_scatter across. Both groups are timed against torch's own NCCL group
over the same ranks, in ABBA order, and checked against it on random integers (exact
whatever the reduction order). Sizes are the message bytes as the threshold counts them:
the all_reduce tensor, the all_gather output, the reduce_scatter input.

Then send/recv across hosts: rank 0 sends to the first rank of the second host (1, 16 and
256 MiB), on the flat group's pair communicator (rsccl's NCCL engine: one 2-rank NCCL
communicator per direction, made at creation) and on torch's NCCL group, timed on the
receiver in ABBA order and checked bit for bit against what torch's NCCL delivered.

On one machine the "hosts" are joined by NVLink, not a network: the comparison shows the
cost of the extra phases and what the host-local kernels win, not a real cross-host run.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from .common import event_us

MiB = 1 << 20
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
P2P_SIZES = [1 * MiB, 16 * MiB, 256 * MiB]


def _p2p(rank: int, src: int, dst: int, group: Any, t: Any) -> None:
    """One message from `src` to `dst` on `group` (the other ranks do nothing); blocking, as
    dist.send/recv are: the caller's stream waits for it."""
    import torch.distributed as dist

    if rank == src:
        dist.send(t, dst, group=group)
    elif rank == dst:
        dist.recv(t, src, group=group)


def _call(kind: str, group: Any, big: Any, small: Any) -> None:
    """One collective on `group`: `big` is the all_reduce tensor, the all_gather output or
    the reduce_scatter input; `small` the all_gather input or reduce_scatter output."""
    import torch.distributed as dist

    if kind == "all_reduce":
        dist.all_reduce(big, group=group)
    elif kind == "all_gather":
        dist.all_gather_into_tensor(big, small, group=group)
    else:
        dist.reduce_scatter_tensor(small, big, group=group)


def _rank_main(rank: int, world: int, per_host: int, port: int, sizes: list[int], iters: int, q: Any) -> None:
    import torch
    import torch.distributed as dist

    import rsccl

    out: dict[str, Any] = {"rank": rank, "rows": [], "p2p_rows": [], "errors": []}
    try:
        torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        dist.init_process_group("rsccl", store=store, rank=rank, world_size=world)
        nccl = dist.new_group(backend="nccl")
        if rank == 0:
            from .._cuda import nccl_baseline

            print(f'hier bench: torch\'s backend "nccl" is {nccl_baseline(nccl)}', flush=True)
        old = os.environ.get("RSCCL_HOST_ID")
        os.environ["RSCCL_HOST_ID"] = f"emul-host-{rank // per_host}"
        try:
            hier = dist.new_group(
                backend="rsccl", pg_options=rsccl.Options(nccl_hierarchical_min_bytes="16MiB", nccl_hierarchical_scratch_bytes="128MiB")
            )
            flat = dist.new_group(backend="rsccl", pg_options=rsccl.Options(nccl_hierarchical_min_bytes=str(1 << 40)))
        finally:
            if old is None:
                os.environ.pop("RSCCL_HOST_ID", None)
            else:
                os.environ["RSCCL_HOST_ID"] = old
        out["hosts"] = len(hier._comm.hosts)
        out["engine"] = getattr(getattr(hier, "_cuda_engine", None), "value", "?")
        g = torch.Generator(device="cuda").manual_seed(1000 + rank)

        def us(step: Callable[[], None]) -> float:
            """Microseconds per call, after a barrier on torch's NCCL group."""
            return event_us(step, iters, lambda: dist.barrier(group=nccl))

        def timeit(kind: str, group: Any, big: torch.Tensor, small: torch.Tensor) -> float:
            return us(lambda: _call(kind, group, big, small))

        def hier_calls() -> int:
            return int(hier._comm.memory_stats().get("nccl_hierarchical_collectives", -1))

        for kind in COLLECTIVES:
            for size in sizes:
                n = size // 4  # int32 elements of the big tensor
                # The reduce_scatter input and all_reduce tensor are random; the all_gather
                # output is filled by the call.
                base = torch.randint(-1000, 1000, (n,), device="cuda", generator=g, dtype=torch.int32)
                small = torch.randint(-1000, 1000, (n // world,), device="cuda", generator=g, dtype=torch.int32)
                ref_big, ref_small = base.clone(), small.clone()
                _call(kind, nccl, ref_big, ref_small)
                ok = {}
                start_calls = hier_calls()
                for name, grp in (("flat", flat), ("hier", hier)):
                    b, sm = base.clone(), small.clone()
                    _call(kind, grp, b, sm)
                    torch.cuda.synchronize()
                    ok[name] = bool(torch.equal(b, ref_big) and torch.equal(sm, ref_small))
                big = torch.randn(size // 2, device="cuda", generator=g, dtype=torch.bfloat16)
                sm = torch.randn(size // 2 // world, device="cuda", generator=g, dtype=torch.bfloat16)
                for grp in (nccl, flat, hier):  # warm-up
                    for _ in range(3):
                        _call(kind, grp, big, sm)
                t = {"nccl": [], "flat": [], "hier": []}
                for order in (("nccl", "flat", "hier"), ("hier", "flat", "nccl")):
                    for name in order:
                        t[name].append(timeit(kind, {"nccl": nccl, "flat": flat, "hier": hier}[name], big, sm))
                out["rows"].append(
                    {
                        "kind": kind,
                        "bytes": size,
                        **{k: min(v) for k, v in t.items()},
                        "ok_flat": ok["flat"],
                        "ok_hier": ok["hier"],
                        "hier_calls": hier_calls() - start_calls,
                    }
                )
        # send/recv across hosts: rank 0 to the first rank of the second host.
        src, dst = 0, per_host
        for size in P2P_SIZES:
            n = size // 4
            x = torch.randint(-(1 << 30), 1 << 30, (n,), device="cuda", generator=g, dtype=torch.int32)
            ref, ours = torch.zeros_like(x), torch.zeros_like(x)
            _p2p(rank, src, dst, nccl, x if rank == src else ref)
            _p2p(rank, src, dst, flat, x if rank == src else ours)
            torch.cuda.synchronize()
            ok = rank != dst or bool(torch.equal(ours, ref))
            buf = x if rank == src else ours
            for grp in (nccl, flat):  # warm-up (torch's NCCL makes its pair communicator at first use)
                for _ in range(3):
                    _p2p(rank, src, dst, grp, buf)

            def time_p2p(grp: Any, buf: torch.Tensor = buf) -> float:
                return us(lambda: _p2p(rank, src, dst, grp, buf))

            t = {"nccl": [], "rsccl": []}
            for order in (("nccl", "rsccl"), ("rsccl", "nccl")):
                for name in order:
                    t[name].append(time_p2p(nccl if name == "nccl" else flat))
            out["p2p_rows"].append({"bytes": size, **{k: min(v) for k, v in t.items()}, "ok": ok})
        out["p2p_pairs"] = int(flat._comm.memory_stats().get("nccl_p2p_communicators", -1))
        out["p2p_bytes"] = int(flat._comm.memory_stats().get("nccl_p2p_bytes", -1))
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
    lines = []
    ok = not errors
    if results and not errors:
        r0 = sorted(results, key=lambda r: r["rank"])[0]
        for kind in COLLECTIVES:
            lines += [
                f"### Hierarchical {kind}, {world // per_host} emulated hosts x {per_host} GPUs (bf16; int32 for the check)",
                "",
                "| bytes | NCCL (torch) us | rsccl flat (NCCL engine) us | rsccl hierarchical us | hier / NCCL speed | checked vs NCCL | hierarchical calls |",
                "|---:|---:|---:|---:|---:|:---|---:|",
            ]
            for i, row in enumerate(r0["rows"]):
                if row["kind"] != kind:
                    continue
                good = all(r2["rows"][i]["ok_flat"] and r2["rows"][i]["ok_hier"] for r2 in results)
                ok = ok and good
                size = row["bytes"]
                lines.append(
                    f"| {size >> 20} MiB | {row['nccl']:.1f} | {row['flat']:.1f} | {row['hier']:.1f} | "
                    f"{row['nccl'] / row['hier']:.2f}x | {'bit-equal' if good else 'WRONG'} | {row['hier_calls']} |"
                )
            lines.append("")
        lines.append(
            "Sizes: the all_reduce tensor, the all_gather output, the reduce_scatter input. Hierarchical calls: "
            "how many of the row's calls (check, warm-up, timed) took the hierarchical path."
        )
        lines.append(f"hosts seen by the group: {r0.get('hosts')}, CUDA engine: {r0.get('engine')}")
        rd = next((r for r in results if r["rank"] == per_host), r0)
        lines += [
            "",
            f"### send/recv across hosts: rank 0 -> rank {per_host} (int32), timed on the receiver",
            "",
            "| bytes | NCCL (torch) us | rsccl (pair communicator) us | rsccl / NCCL speed | GB/s (rsccl) | checked vs NCCL |",
            "|---:|---:|---:|---:|---:|:---|",
        ]
        for i, row in enumerate(rd["p2p_rows"]):
            good = all(r2["p2p_rows"][i]["ok"] for r2 in results)
            ok = ok and good
            lines.append(
                f"| {row['bytes'] >> 20} MiB | {row['nccl']:.1f} | {row['rsccl']:.1f} | {row['nccl'] / row['rsccl']:.2f}x | "
                f"{row['bytes'] / row['rsccl'] / 1e3:.1f} | {'bit-equal' if good else 'WRONG'} |"
            )
        lines.append("")
        lines.append(
            f"pair communicators per rank: {r0.get('p2p_pairs')}, their device memory (creation and warm-up): "
            f"{r0.get('p2p_bytes', 0) / MiB:.1f} MiB on rank 0"
        )
    if errors:
        lines.append("")
        lines.append("errors:")
        lines += ["```", *errors, "```"]
    return "\n".join(lines) + "\n", ok


if __name__ == "__main__":
    table, good = run(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
    print(table)
    sys.exit(0 if good else 1)
