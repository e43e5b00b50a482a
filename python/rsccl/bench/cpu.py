"""`python -m rsccl.bench --device cpu`: rsccl and gloo side by side on one host.

What it measures: for each world size, collective and message size (powers of 4 from
--min-bytes to --max-bytes), the latency of one synchronous call on rsccl and on gloo,
and the bandwidths derived from it the way nccl-tests define them. The size is the
per-rank message: the tensor for all_reduce and broadcast, the output of
all_gather_into_tensor, the input of reduce_scatter_tensor.

Method: the parent spawns the ranks of one world size; each rank joins a default rsccl
group and a gloo group over the same TCP store. For every collective and size, each rank
first checks that rsccl gives gloo's result on the same seeded random input (the run
aborts on any difference), then times both backends in turn, alternating which goes first:
warm-up calls, a gloo barrier, then N back-to-back calls timed with time.perf_counter.
A measurement's latency is the slowest rank's time divided by N; each backend is measured
--repeats times (interleaved with the other) and the median is reported. Without --iters, N is chosen
from the warm-up so that one measurement takes about 0.2 s (3 to 200 calls). Rank 0 hands
its rows to the parent through a JSON file; the parent prints one table per world size
and writes DIR/bench_<device>.csv and, when matplotlib is installed, DIR/bench_<device>.png.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from .common import CSV_KEY_COLUMNS, TOLERANCES, Sweep, bus_factor, free_port, human, message_sizes, numels, pyplot, size_axis

BACKENDS = ("rsccl", "gloo")


TARGET_SECONDS = 0.2


MIN_ITERS, MAX_ITERS = 3, 200


ROOT = 0


CSV_COLUMNS = (
    *CSV_KEY_COLUMNS,
    "latency_us",
    "algbw_GBps",
    "busbw_GBps",
    "iters",
)


Groups = dict[str, "dist.ProcessGroup | None"]  # backend name -> group (None: the default group)


class MismatchError(RuntimeError):
    """rsccl's result differs from gloo's."""


Config = Sweep  # the CPU bench runs a sweep and nothing else


def is_in_place(collective: str) -> bool:
    return collective in ("all_reduce", "broadcast")


def make_call(collective: str, inp: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup | None) -> Callable[[], None]:
    if collective == "all_reduce":
        return lambda: dist.all_reduce(inp, group=group)
    if collective == "broadcast":
        return lambda: dist.broadcast(inp, src=ROOT, group=group)
    if collective == "all_gather_into_tensor":
        return lambda: dist.all_gather_into_tensor(out, inp, group=group)
    return lambda: dist.reduce_scatter_tensor(out, inp, group=group)


def buffers(collective: str, n_in: int, n_out: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # Zeros, because in-place sums repeated hundreds of times would overflow other data
    # into inf/NaN.
    inp = torch.zeros(n_in, dtype=dtype)
    return inp, inp if is_in_place(collective) else torch.empty(n_out, dtype=dtype)


def random_input(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen, dtype=dtype)
    return torch.randint(-100, 100, (n,), generator=gen, dtype=dtype)


def gloo_of(groups: Groups) -> dist.ProcessGroup:
    g = groups["gloo"]
    assert g is not None
    return g


def max_over_ranks(value: float, gloo: dist.ProcessGroup) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
    return t.item()


def check(collective: str, counts: tuple[int, int], label: str, groups: Groups, cfg: Config, gen: torch.Generator) -> None:
    """Run once on each backend from the same input; raise on every rank if any differs.
    `label` names the case in the error."""
    dtype = getattr(torch, cfg.dtype)
    x = random_input(counts[0], dtype, gen)
    results = []
    for backend in BACKENDS:
        inp, out = buffers(collective, *counts, dtype)
        inp.copy_(x)
        make_call(collective, inp, out, groups[backend])()
        results.append(out)
    rtol, atol = TOLERANCES[cfg.dtype]
    ok = torch.allclose(results[0], results[1], rtol=rtol, atol=atol)
    # Agree on the verdict so that every rank stops, not only the one that saw it.
    if max_over_ranks(0.0 if ok else 1.0, gloo_of(groups)):
        diff = (results[0].double() - results[1].double()).abs().max().item()
        raise MismatchError(
            f"{label}: rsccl's result differs from gloo's (this rank's max |diff| {diff:.3g}, rtol {rtol}, atol {atol}, seed {cfg.seed})"
        )


def timed(call: Callable[[], None], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call()
    return time.perf_counter() - start


def adaptive_iters(per_call: float) -> int:
    return min(MAX_ITERS, max(MIN_ITERS, math.ceil(TARGET_SECONDS / max(per_call, 1e-9))))


def measure(call: Callable[[], None], gloo: dist.ProcessGroup, cfg: Config) -> tuple[float, int]:
    """(seconds per call on the slowest rank, calls timed)."""
    # The adaptive count is estimated from the warm-up, so it needs at least one call.
    warmup = cfg.warmup if cfg.iters else max(cfg.warmup, 1)
    # The max over ranks, so that every rank derives the same count.
    per_call = max_over_ranks(timed(call, warmup), gloo) / warmup if warmup else 0.0
    iters = cfg.iters or adaptive_iters(per_call)
    dist.barrier(group=gloo)
    return max_over_ranks(timed(call, iters), gloo) / iters, iters


def bench_collective(collective: str, world: int, groups: Groups, cfg: Config, gen: torch.Generator) -> list[dict]:
    dtype = getattr(torch, cfg.dtype)
    elem = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for i, nbytes in enumerate(cfg.sizes):
        counts = numels(collective, nbytes, world, elem)
        if counts is None:
            continue
        message = (counts[1] if collective == "all_gather_into_tensor" else counts[0]) * elem
        check(collective, counts, f"{collective}, {human(message)}, world size {world}", groups, cfg, gen)
        inp, out = buffers(collective, *counts, dtype)
        samples: dict[str, list[float]] = {b: [] for b in BACKENDS}
        iters_done = dict.fromkeys(BACKENDS, 0)
        # Interleave the backends' repeats, alternating who goes first, so that neither
        # always inherits the other's caches, and a burst of load on a shared machine hits
        # both; the median of the repeats is reported.
        for rep in range(cfg.repeats):
            for backend in BACKENDS if (i + rep) % 2 == 0 else BACKENDS[::-1]:
                latency, iters = measure(make_call(collective, inp, out, groups[backend]), gloo_of(groups), cfg)
                samples[backend].append(latency)
                iters_done[backend] += iters
        for backend in BACKENDS:
            rows.append(
                {
                    "world_size": world,
                    "collective": collective,
                    "bytes": message,
                    "backend": backend,
                    "latency_s": statistics.median(samples[backend]),
                    "iters": iters_done[backend],
                }
            )
    return rows


def rank_main(rank: int, world: int, port: int, cfg: Config, result_path: str) -> None:
    import rsccl  # noqa: F401 - registers the "rsccl" backend in this process

    # Leave each rank its share of the cores for generating and comparing data.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    timeout = timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
    dist.init_process_group("rsccl", store=store, rank=rank, world_size=world, timeout=timeout)
    groups: Groups = {"rsccl": None, "gloo": dist.new_group(backend="gloo", timeout=timeout)}
    gen = torch.Generator().manual_seed(cfg.seed * 1009 + rank)
    rows = []
    for collective in cfg.collectives:
        start = time.perf_counter()
        rows += bench_collective(collective, world, groups, cfg, gen)
        if rank == 0:
            took = time.perf_counter() - start
            print(f"  world size {world}: {collective} checked and timed in {took:.1f} s", flush=True)
    if rank == 0:
        Path(result_path).write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_world(world: int, cfg: Config) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="rsccl-bench-") as tmp:
        path = os.path.join(tmp, "rows.json")
        mp.spawn(rank_main, args=(world, free_port(), cfg, path), nprocs=world)
        return json.loads(Path(path).read_text())


def add_bandwidth(row: dict) -> dict:
    algbw = row["bytes"] / row["latency_s"] / 1e9
    return dict(row, algbw_GBps=algbw, busbw_GBps=algbw * bus_factor(row["collective"], row["world_size"]))


def format_table(world: int, rows: list[dict]) -> str:
    cores = os.cpu_count()
    by_key = {(r["collective"], r["bytes"], r["backend"]): r for r in rows}
    head = f"{'collective':<24}{'size':>10}{'rsccl us':>12}{'gloo us':>12}{'rsccl busbw GB/s':>18}{'gloo busbw GB/s':>17}{'speedup':>9}"
    lines = [f"world size {world} ({world} ranks on {cores} cores)", head, "-" * len(head)]
    for collective in dict.fromkeys(r["collective"] for r in rows):
        for nbytes in sorted({b for c, b, _ in by_key if c == collective}):
            rs, gl = by_key[collective, nbytes, "rsccl"], by_key[collective, nbytes, "gloo"]
            lines.append(
                f"{collective:<24}{human(nbytes):>10}{rs['latency_s'] * 1e6:>12.1f}{gl['latency_s'] * 1e6:>12.1f}"
                f"{rs['busbw_GBps']:>18.3f}{gl['busbw_GBps']:>17.3f}{gl['latency_s'] / rs['latency_s']:>8.2f}x"
            )
    return "\n".join(lines)


def header_line(cfg: Config) -> str:
    import rsccl

    date = datetime.now().astimezone().isoformat(timespec="seconds")
    return (
        f"# date={date} host={platform.node()} cores={os.cpu_count()} python={platform.python_version()} "
        f"torch={torch.__version__} rsccl={rsccl.__version__} dtype={cfg.dtype} seed={cfg.seed} repeats={cfg.repeats}"
    )


def write_csv(path: Path, device: str, rows: list[dict], header: str) -> None:
    with path.open("w", newline="") as f:
        f.write(header + "\n")
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in rows:
            w.writerow(
                [
                    device,
                    r["world_size"],
                    r["collective"],
                    r["bytes"],
                    r["backend"],
                    f"{r['latency_s'] * 1e6:.3f}",
                    f"{r['algbw_GBps']:.6g}",
                    f"{r['busbw_GBps']:.6g}",
                    r["iters"],
                ]
            )


def write_png(path: Path, rows: list[dict], title: str) -> bool:
    """Plot busbw against size, one panel per collective; False if matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    collectives = list(dict.fromkeys(r["collective"] for r in rows))
    worlds = sorted({r["world_size"] for r in rows})
    ncols = min(2, len(collectives))
    nrows = math.ceil(len(collectives) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.5 * nrows), squeeze=False)
    styles = ("-o", "--s", ":^", "-.v")
    for ax, collective in zip(axes.flat, collectives):
        for backend, color in zip(BACKENDS, ("tab:blue", "tab:orange")):
            for world, style in zip(worlds, itertools.cycle(styles)):
                pts = sorted(
                    (r["bytes"], r["busbw_GBps"])
                    for r in rows
                    if (r["collective"], r["backend"], r["world_size"]) == (collective, backend, world)
                )
                if pts:
                    ax.plot(*zip(*pts), style, color=color, markersize=4, label=f"{backend}, {world} ranks")
        size_axis(ax)
        ax.set_yscale("log")
        ax.set_title(collective)
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.legend(fontsize=8)
    for ax in axes.flat[len(collectives) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(2), "little")
    sizes = message_sizes(args.min_bytes, args.max_bytes)
    cfg = Config(args.collectives, sizes, args.dtype, args.iters, args.warmup, args.repeats, seed)
    print(
        f"rsccl.bench: device {args.device}, world sizes {args.world_sizes}, {args.dtype}, "
        f"{human(cfg.sizes[0])}..{human(cfg.sizes[-1])}, seed {seed}",
        flush=True,
    )
    start = time.perf_counter()
    rows = []
    for world in args.world_sizes:
        try:
            world_rows = [add_bandwidth(r) for r in run_world(world, cfg)]
        except ProcessException as e:
            # The rank's traceback, then its last line (the error itself) as the verdict.
            reason = str(e).strip().splitlines()[-1]
            print(f"{e}\nrsccl.bench: aborted at world size {world}: {reason}", file=sys.stderr)
            return 1
        print("\n" + format_table(world, world_rows) + "\n", flush=True)
        rows += world_rows
    header = header_line(cfg)
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = args.out / f"bench_{args.device}.csv", args.out / f"bench_{args.device}.png"
    write_csv(csv_path, args.device, rows, header)
    print(f"wrote {csv_path}")
    if write_png(png_path, rows, header.removeprefix("# ")):
        print(f"wrote {png_path}")
    else:
        print("note: matplotlib is not installed, so no plot was drawn (pip install matplotlib)")
    print(f"total time {time.perf_counter() - start:.0f} s")
    return 0
