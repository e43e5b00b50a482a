"""rsccl.memory_report: what rsccl reserved, mapped and used on every rank of a group, as
one text table (one line per rank).

It is a collective: every rank of the group calls it, each reads its own figures
(rsccl.memory_stats and the size of /proc/self/maps), and they gather them through the
group itself, so every rank returns the same text. The figures are read before that
gather: the report's own two CPU all_gathers show up only in the next report. Reading the
CUDA figures synchronizes each rank's device (memory_stats copies counters off the GPU),
so this is a between-steps call, not one for inside a training step.

Why not dist.all_gather_object: it moves the bytes on the device torch picks from the
group's registered device types, which for a backend like ours is an implementation
detail of torch (today "cpu", as rsccl registers none; it would be "cuda" if one day only
CUDA were registered). On CUDA the report would launch rsccl kernels, synchronize the
device and count itself in the CUDA counters it reports. Gathering CPU tensors directly
keeps the report off the GPU, and JSON (not pickle) keeps it to plain data.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._backend import rsccl_group
from ._cuda import mapped_va_bytes


def human_bytes(n: int) -> str:
    """Binary units, three significant digits (exact multiples without decimals)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            break
    if value == int(value):
        return f"{int(value)} {unit}"
    return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"


@dataclass(frozen=True)
class Column:
    """One column: shown when some rank's row has any of `keys` (or always, if empty)."""

    header: str
    keys: tuple[str, ...]
    cell: Callable[[dict[str, Any]], str]
    meaning: str = ""
    numeric: bool = True


def _stat(key: str) -> Callable[[dict[str, Any]], str]:
    def cell(row: dict[str, Any]) -> str:
        v = row["stats"].get(key)
        return "-" if v is None else human_bytes(int(v))

    return cell


def _count_and_bytes(count: str, nbytes: str) -> Callable[[dict[str, Any]], str]:
    def cell(row: dict[str, Any]) -> str:
        s = row["stats"]
        if count not in s and nbytes not in s:
            return "-"
        return f"{s.get(count, 0)} / {human_bytes(int(s.get(nbytes, 0)))}"

    return cell


def _rsccl_va(row: dict[str, Any]) -> str:
    parts = [row["stats"][k] for k in ("cuda_va_reserved_bytes", "host_mapped_bytes") if k in row["stats"]]
    return human_bytes(sum(int(p) for p in parts)) if parts else "-"


def _gpu(row: dict[str, Any]) -> str:
    s = row["stats"]
    sharers = int(s.get("cuda_gpu_sharers", 1))
    return str(s.get("cuda_device", "-")) + (f" (x{sharers})" if sharers > 1 else "")


COLUMNS = (
    Column("rank", (), lambda r: str(r["rank"])),
    Column("host", (), lambda r: str(r["host"]), numeric=False),
    Column("engine", ("engine",), lambda r: str(r["stats"].get("engine", "-")), numeric=False),
    Column("gpu", ("cuda_device",), _gpu, "CUDA device; (xk): k ranks of the group share it (allow_shared_gpu)"),
    Column(
        "rsccl VA",
        ("cuda_va_reserved_bytes", "host_mapped_bytes"),
        _rsccl_va,
        "address space rsccl reserved (GPU range + host shared region)",
    ),
    Column("process VA", (), lambda r: human_bytes(int(r["process_va_bytes"])), "every mapping of the process (/proc/self/maps)"),
    Column("mapped own", ("cuda_mapped_own_bytes",), _stat("cuda_mapped_own_bytes"), "GPU memory of this rank's block"),
    Column("mapped peers", ("cuda_mapped_peer_bytes",), _stat("cuda_mapped_peer_bytes"), "local peers' blocks mapped here"),
    Column("in use", ("cuda_in_use_bytes",), _stat("cuda_in_use_bytes"), "part of the own block the kernels use"),
    Column("pool", ("cuda_pool_bytes",), _stat("cuda_pool_bytes"), "symmetric pool capacity"),
    Column("pool alloc", ("cuda_pool_allocated_bytes",), _stat("cuda_pool_allocated_bytes"), "handed to torch now"),
    Column("pool peak", ("cuda_pool_peak_bytes",), _stat("cuda_pool_peak_bytes")),
    Column(
        "in place",
        ("cuda_inplace_collectives", "cuda_inplace_bytes"),
        _count_and_bytes("cuda_inplace_collectives", "cuda_inplace_bytes"),
        "CUDA collectives on pool buffers, count / message bytes",
    ),
    Column(
        "staged",
        ("cuda_staged_collectives", "cuda_staged_bytes"),
        _count_and_bytes("cuda_staged_collectives", "cuda_staged_bytes"),
        "CUDA collectives through staging, count / message bytes",
    ),
    Column(
        "CPU ops",
        ("collectives", "staged_bytes"),
        _count_and_bytes("collectives", "staged_bytes"),
        "host-engine collectives / bytes copied into the shared region",
    ),
    Column("p2p", ("p2p_messages",), lambda r: str(r["stats"].get("p2p_messages", "-")), "send/recv messages"),
)


def format_report(rows: list[dict[str, Any]], title: str) -> str:
    """The table for `rows` (each: rank, global_rank, host, process_va_bytes, stats),
    ordered by rank; columns no rank has figures for are left out."""
    rows = sorted(rows, key=lambda r: r["rank"])
    cols = [c for c in COLUMNS if not c.keys or any(k in r["stats"] for r in rows for k in c.keys)]
    if any(r["global_rank"] != r["rank"] for r in rows):
        cols.insert(1, Column("global", (), lambda r: str(r["global_rank"])))
    table = [[c.header for c in cols]] + [[c.cell(r) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]

    def fmt(line: list[str]) -> str:
        cells = [v.rjust(w) if c.numeric else v.ljust(w) for v, w, c in zip(line, widths, cols)]
        return "  ".join(cells).rstrip()

    legend = "; ".join(f"{c.header}: {c.meaning}" for c in cols if c.meaning)
    return "\n".join([title, *(fmt(line) for line in table), legend])


def local_row(group: Any) -> dict[str, Any]:
    """This rank's figures."""
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("rsccl.memory_report: this process is not a member of the group (only its members call it)")
    stats = rsccl_group(group).memory_stats()
    return {
        "rank": rank,
        "global_rank": dist.get_rank(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_va_bytes": mapped_va_bytes(),
        "stats": {k: (v if isinstance(v, (int, str)) else str(v)) for k, v in stats.items()},
    }


def all_gather_json(obj: Any, group: Any) -> list[Any]:
    """Every rank's `obj` (JSON-serializable), in group-rank order, through CPU tensors:
    the sizes first, then the payloads padded to the longest."""
    n = dist.get_world_size(group)
    payload = json.dumps(obj).encode()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=group)
    lengths = [int(s.item()) for s in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    outs = [torch.empty(max(lengths), dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(outs, mine, group=group)
    return [json.loads(bytes(o[:k].tolist())) for o, k in zip(outs, lengths)]


def memory_report(group: Any = None) -> str:
    """Every rank's rsccl memory in `group` (default: the world group) as a text table, one
    line per rank, the same text on every rank. A collective: all the group's ranks call it."""
    pg = group if group is not None else dist.group.WORLD
    rows = all_gather_json(local_row(pg), pg)
    name = getattr(pg, "group_name", "") or ""
    title = f"rsccl memory report: group {name!r}, {len(rows)} rank{'s' if len(rows) != 1 else ''}"
    return format_report(rows, title)
