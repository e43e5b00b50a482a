"""The CUDA bench's report per world size: one Markdown file (the header, every table, memory,
targets, in place, FSDP2).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from datetime import datetime
from typing import Any

from ..common import describe, human
from ..fsdp_report import fsdp_markdown
from .config import BACKEND_ORDER, GPU_ENV, GRAPH_CALLS, GRAPH_REPLAYS, POOL_BACKEND, POOL_MIN_BYTES, PROBE_BYTES, Config, MiB
from .ctas import cta_markdown
from .memory import memory_table
from .overlap_report import overlap_markdown
from .tables import fmt, graph_cell, note_of, path_label, path_ok, time_cell
from .targets import pool_markdown, target_lines


def header_lines(meta: dict, cfg: Config, command: str) -> list[str]:
    date = datetime.now().astimezone().isoformat(timespec="seconds")
    return [
        (
            f"- date {date}, host {platform.node()}, {meta.get('gpu', '?')}; torch {meta.get('torch', '?')} "
            f"(CUDA {meta.get('cuda', '?')}), NCCL {meta.get('nccl', '?')} as {meta.get('nccl_backend', 'ProcessGroupNCCL')}, rsccl {meta.get('rsccl', '?')}, "
            f"python {meta.get('python', '?')}"
        ),
        f"- command: `{command}`",
        f"- rsccl options: {cfg.rsccl_options or 'defaults'}; environment: "
        + " ".join(f"{k}={v}" for k, v in GPU_ENV.items())
        + "".join(f" {k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("RSCCL_", "NCCL_")) and k not in GPU_ENV),
        (
            f"- message size = bytes of the all_reduce (and broadcast) tensor = the all_gather_into_tensor OUTPUT = "
            f"the reduce_scatter_tensor INPUT = the all_to_all_single input (even splits) = the message rank 0 sends "
            f"rank 1 (send_recv), per rank; dtype {cfg.dtype}; seed {cfg.seed}"
        ),
        (
            f"- eager: CUDA events around N back-to-back blocking calls after {cfg.warmup} warm-up calls, slowest rank, "
            f"median of {cfg.repeats}, per call; CPU: the calling thread's time over the same calls, per call; "
            f"async: async_op=True + wait() per call; graph: {GRAPH_CALLS} calls "
            f"captured in one CUDA graph, {GRAPH_REPLAYS} replays per repeat (sizes <= {human(cfg.graph_max_bytes)}); "
            f"busbw from eager (nccl-tests factors); vs nccl = nccl eager time / this eager time; "
            f"check: same random input as nccl (sizes <= {human(cfg.check_max_bytes)}); "
            f"symm-1shot/-2shot: torch.ops.symm_mem.one_shot_all_reduce_out / two_shot_all_reduce_ "
            f"(sizes <= {human(cfg.symm_max_bytes)}); rsccl-pool: the default rsccl group on buffers from "
            f"rsccl.mem_pool() (sizes >= {human(POOL_MIN_BYTES)}; note: inplace / STAGED = how memory_stats() "
            f"counted its calls)"
        ),
        f"- a plain torch launch, the CPU yardstick: {meta.get('torch_launch', 'n/a')}",
        f"- torch symmetric memory: {meta.get('symm', 'n/a')}",
        f"- rsccl pool (rsccl-pool rows): {meta.get('pool', 'n/a')}",
    ]


def world_markdown(world: int, results: dict | None, rows: list[dict], error: str, cfg: Config, command: str) -> str:
    meta = (results or {}).get("meta", {})
    out = [f"# rsccl CUDA benchmark: world size {world}", ""] + header_lines(meta, cfg, command)
    if error:
        out += ["", f"**INCOMPLETE: {error}**"]
    bad = [r for r in rows if r["check"] in ("WRONG", "fail") or r["note"]]
    if bad:
        out += ["", "**WRONG RESULTS OR FAILURES:**", ""] + [
            f"- {r['backend']} {r['collective']} {human(r['bytes'])}: check {r['check']}; {r['note']}" for r in bad
        ]
    staged = [r for r in rows if r["backend"] == POOL_BACKEND and not path_ok(r)]
    if staged:
        out += ["", "**rsccl-pool rows NOT run in place** (memory_stats counted them otherwise):", ""] + [
            f"- {r['collective']} {human(r['bytes'])}: {path_label(r) or 'not counted'}" for r in staged
        ]
    for name, why in meta.get("graph_failures", {}).items():
        out += ["", f"CUDA graph capture failed for {name}: {why}"]
    for collective in dict.fromkeys(r["collective"] for r in rows):
        out += [
            "",
            f"## {collective}",
            "",
            "| size | backend | eager us | CPU us | async us | graph us | busbw GB/s | algbw GB/s | vs nccl | check | iters | note |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
        ]
        mine = [r for r in rows if r["collective"] == collective]
        for r in sorted(mine, key=lambda r: (r["bytes"], BACKEND_ORDER.index(r["backend"]))):
            vs = f"{r['vs_nccl']:.2f}x" if r["vs_nccl"] else ""
            note = note_of(r).replace("|", "/").replace("\n", " ")[:300]
            out.append(
                f"| {human(r['bytes'])} | {r['backend']} | {time_cell(r, 'eager_s')} | {time_cell(r, 'cpu_s')} | {time_cell(r, 'async_s')} "
                f"| {graph_cell(r, cfg)} | {fmt(r['busbw_GBps'], 1, 2)} | {fmt(r['algbw_GBps'], 1, 2)} "
                f"| {vs} | {r['check']} | {r['iters']} | {note} |"
            )
    if meta.get("memory"):
        out += [
            "",
            "## Memory per rank",
            "",
            (
                "Device memory used = total - free (torch.cuda.mem_get_info after synchronize; device-wide), "
                f"{human(PROBE_BYTES)} probes; VA = the process's mappings (/proc/self/maps)."
            ),
            "",
        ]
        out += memory_table(meta)
        out += ["", "Snapshots (MiB used, GiB VA, MiB torch reserved):", ""]
        for rank, snaps in enumerate(meta["memory"]):
            out.append(
                f"- rank {rank}: "
                + "; ".join(f"{s['label']} {s['used'] / MiB:.0f} / {s['va'] / 2**30:.1f} / {s['torch_reserved'] / MiB:.0f}" for s in snaps)
            )
        out += ["", "rsccl.memory_stats() (default group):", ""]
        for rank, st in enumerate(meta.get("rsccl_memory_stats", [])):
            out.append(f"- rank {rank}: `{json.dumps(st)}`")
    targets = rendered("targets", target_lines, world, rows)
    if targets:
        out += ["", "## Targets (all_to_all_single, send/recv)", ""] + [f"- {t.split(' target ', 1)[-1]}" for t in targets]
    out += rendered("in-place table", pool_markdown, rows)
    out += rendered("CTAs section", cta_markdown, meta, list(cfg.collectives))
    out += rendered("overlap section", overlap_markdown, meta.get("overlap"), meta)
    out += rendered("FSDP2 section", fsdp_markdown, meta.get("fsdp"), world)
    return "\n".join(out) + "\n"


def rendered(what: str, fn: Callable[..., list[str]], *args: Any) -> list[str]:
    """fn(*args), or one line saying why it could not be drawn: a report never fails the run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return ["", f"({what} could not be rendered: {describe(e)})"]
