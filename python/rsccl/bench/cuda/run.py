"""The CUDA bench's parent process: one spawned world per world size, then the reports."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from ..common import describe, human, message_sizes
from ..fsdp import FsdpConfig
from ..fsdp_report import fsdp_problems, fsdp_summary_lines
from .config import DONE_GRACE_S, GPU_ENV, Config, options_text, pool_options, pool_sizes
from .ctas import PROFILE_ALLOWANCE_S, cta_summary_lines
from .memory import memory_summary
from .overlap import OVERLAP_ALLOWANCE_S
from .overlap_report import overlap_problems, overlap_summary_lines
from .plot import write_png
from .rank import rank_main
from .report import rendered, world_markdown
from .tables import add_bandwidth, failed_rows, summary_lines, write_csv
from .targets import pool_summary_lines, target_lines


def read_results(path: str) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def run_world(world: int, cfg: Config) -> tuple[dict | None, str]:
    """(rank 0's results or None, "" or why the world did not finish)."""
    with tempfile.TemporaryDirectory(prefix="rsccl-bench-cuda-") as tmp:
        path = os.path.join(tmp, "results.json")
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=cfg.timeout_s), wait_for_workers=False)
        ctx = mp.start_processes(rank_main, args=(world, store.port, cfg, path), nprocs=world, join=False, start_method="spawn")
        deadline = (
            time.monotonic()
            + cfg.timeout_s
            + (cfg.fsdp.allowance_s() if cfg.fsdp is not None else 0.0)
            + (OVERLAP_ALLOWANCE_S if cfg.overlap is not None else 0.0)
            + (PROFILE_ALLOWANCE_S if cfg.ctas_profile else 0.0)
        )
        done_at: float | None = None
        error = ""
        try:
            while not ctx.join(timeout=2):
                now = time.monotonic()
                if done_at is None and (read_results(path) or {}).get("done"):
                    done_at = now
                if done_at is not None and now - done_at > DONE_GRACE_S:
                    error = f"ranks still running {DONE_GRACE_S:.0f} s after the results were written: stopped"
                    break
                if now > deadline:
                    error = f"did not finish within --timeout {cfg.timeout_s:.0f} s: stopped"
                    break
        except ProcessException as e:
            error = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
            print(f"{e}", file=sys.stderr, flush=True)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(10)
        del store
        results = read_results(path)
        if results is not None and not results.get("done") and not error:
            error = "ranks exited before finishing"
        if results is not None and results.get("done") and error.startswith("ranks still running"):
            print(f"note: world size {world}: {error}", flush=True)
            error = ""
        return results, error


def main(args: argparse.Namespace, argv: list[str]) -> int:
    os.environ.update(GPU_ENV)
    # Counting GPUs does not create a CUDA context in this process (which would take memory on GPU 0).
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        print(
            f"rsccl.bench: --device cuda needs at least 2 visible CUDA GPUs; this machine has {gpus} "
            f"(torch {torch.__version__}, torch.cuda.is_available() = {torch.cuda.is_available()}). "
            "Use --device cpu here.",
            file=sys.stderr,
        )
        return 2
    worlds = [w for w in args.world_sizes if w <= gpus]
    if left := [w for w in args.world_sizes if w > gpus]:
        print(f"note: world sizes {left} left out: {gpus} GPUs visible", flush=True)
    if not worlds:
        print(f"rsccl.bench: no world size fits the {gpus} visible GPUs", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(2), "little")
    cfg = Config(
        collectives=tuple(args.collectives),
        sizes=message_sizes(args.min_bytes, args.max_bytes),
        dtype=args.dtype,
        iters=args.iters,
        warmup=args.warmup,
        repeats=args.repeats,
        seed=seed,
        graph=not args.no_graph,
        graph_max_bytes=args.graph_max_bytes,
        check_max_bytes=args.check_max_bytes,
        symm_max_bytes=args.symm_max_bytes,
        sweep_one_shot=args.sweep_one_shot,
        rsccl_options=dict(args.rsccl_options),
        timeout_s=args.timeout,
        pool=not args.no_pool,
        fsdp=FsdpConfig(
            layers=args.fsdp_layers,
            dim=args.fsdp_dim,
            steps=args.fsdp_steps,
            warmup=args.fsdp_warmup,
            repeats=args.fsdp_repeats,
            pool_comms=args.fsdp_pool_comms,
            lr=args.fsdp_lr,
            pool_bytes=args.fsdp_pool_bytes or 0,
        )
        if args.fsdp
        else None,
        overlap=args.overlap_config if args.overlap else None,
        ctas_profile=args.ctas_profile,
    )
    command = "python -m rsccl.bench " + shlex.join(argv)
    print(
        f"rsccl.bench: device cuda ({gpus} GPUs visible), world sizes {worlds}, {cfg.dtype}, "
        f"{human(cfg.sizes[0])}..{human(cfg.sizes[-1])}, collectives {','.join(cfg.collectives)}, seed {seed}, "
        f"rsccl options {cfg.rsccl_options or 'defaults'}{', one-shot sweep' if cfg.sweep_one_shot else ''}",
        flush=True,
    )
    pooled = pool_sizes(cfg)
    print(
        f"rsccl-pool rows: {f'{human(pooled[0])}..{human(pooled[-1])}' if pooled else 'none'}"
        + "".join(
            f"; w{w} default group adds {options_text(pool_options(cfg, w)) or 'nothing (given in --rsccl-options)'}"
            for w in worlds
            if pooled
        )
        + f"; FSDP2 section: {cfg.fsdp.describe() + f', {cfg.fsdp.warmup}+{cfg.fsdp.steps} steps' if cfg.fsdp else 'off'}"
        + (f", {cfg.fsdp.repeats} runs per backend (--timeout +{cfg.fsdp.allowance_s():.0f} s per world size)" if cfg.fsdp else "")
        + f"; overlap section: {cfg.overlap.describe() if cfg.overlap else 'off'}"
        + (f" (--timeout +{OVERLAP_ALLOWANCE_S:.0f} s per world size)" if cfg.overlap else ""),
        flush=True,
    )
    print(
        "message size = all_reduce tensor bytes = all_gather_into_tensor OUTPUT bytes = "
        "reduce_scatter_tensor INPUT bytes = all_to_all_single input bytes = send_recv message bytes (per rank)",
        flush=True,
    )
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    all_rows: list[dict] = []
    summaries: list[str] = []
    failed: list[str] = []
    problems: list[str] = []
    for world in worlds:
        print(f"\n== world size {world}", flush=True)
        results, error = run_world(world, cfg)
        rows = add_bandwidth((results or {}).get("rows", []))
        meta = (results or {}).get("meta", {})
        if error:
            failed.append(f"world size {world}: {error}")
            print(f"rsccl.bench: world size {world}: {error}", file=sys.stderr, flush=True)
        md = world_markdown(world, results, rows, error, cfg, command)
        md_path = args.out / f"bench_cuda_w{world}.md"
        md_path.write_text(md)
        print("\n" + md, flush=True)
        print(f"wrote {md_path}", flush=True)
        all_rows += rows
        summaries += summary_lines(world, rows, cfg)
        summaries += rendered("targets", target_lines, world, rows)
        summaries += rendered("in-place summary", pool_summary_lines, world, rows)
        if meta:
            summaries.append(memory_summary(world, meta))
            summaries += rendered("CTAs summary", cta_summary_lines, world, meta, list(cfg.collectives))
            summaries += rendered("overlap summary", overlap_summary_lines, world, meta.get("overlap"))
            problems += rendered("overlap verdict", overlap_problems, world, meta.get("overlap"))
            summaries += rendered("FSDP2 summary", fsdp_summary_lines, world, meta.get("fsdp"))
            problems += rendered("FSDP2 verdict", fsdp_problems, world, meta.get("fsdp"))
        if error:
            summaries.append(f"w{world} INCOMPLETE: {error}")
    header = (
        f"# date={datetime.now().astimezone().isoformat(timespec='seconds')} host={platform.node()} "
        f"torch={torch.__version__} dtype={cfg.dtype} seed={seed} repeats={cfg.repeats} "
        f"rsccl_options={json.dumps(cfg.rsccl_options)} command={json.dumps(command)}"
    )
    csv_path, png_path = args.out / "bench_cuda.csv", args.out / "bench_cuda.png"
    write_csv(csv_path, all_rows, header)
    print(f"wrote {csv_path}", flush=True)
    if all_rows:
        try:
            if write_png(png_path, all_rows, cfg, header.removeprefix("# ")[:200]):
                print(f"wrote {png_path}", flush=True)
            else:
                print("note: matplotlib is not installed, so no plot was drawn", flush=True)
        except Exception as e:  # noqa: BLE001 - a plot is not worth losing the run's exit status over
            print(f"note: plotting failed: {describe(e)}", flush=True)
    wrong = failed_rows(all_rows)
    print(
        "\n== summary: eager us per call / busbw GB/s; graph us for sizes <= "
        f"{human(cfg.graph_max_bytes)}; n/a = not run; WRONG = differs from nccl; in-place/staged = rsccl eager "
        "time / rsccl-pool eager time",
        flush=True,
    )
    for line in summaries:
        print(line, flush=True)
    for r in wrong:
        print(
            f"{'WRONG' if r['check'] == 'WRONG' else 'FAILED'}: w{r['world_size']} {r['backend']} {r['collective']} "
            f"{human(r['bytes'])}: {r['note']}",
            flush=True,
        )
    print(f"total time {time.perf_counter() - start:.0f} s; results in {args.out}", flush=True)
    for line in problems:
        print(f"FAILED: {line.strip()}", flush=True)
    if failed:
        print("FAILED: " + "; ".join(failed), flush=True)
    return 1 if (failed or wrong or problems) else 0
