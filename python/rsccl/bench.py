"""Benchmark rsccl on one host: latency and bus bandwidth per collective, side by side
with gloo (--device cpu) or with NCCL and torch's symmetric memory (--device cuda).

    python -m rsccl.bench [--world-sizes 2,4] [--max-bytes 64MiB] [--out-dir bench-results/]
    python -m rsccl.bench --device cuda [--quick] [--sweep-one-shot] [--rsccl-options KEY=VAL,...]
                                        [--no-pool] [--no-fsdp] [--fsdp-steps N]

--device cuda is described in rsccl/_bench_cuda.py; what follows is --device cpu.

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
import re
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
# Benchmarked on CUDA only: all_to_all_single (even splits) and send_recv (rank 0 -> rank 1).
CUDA_ONLY_COLLECTIVES = ("all_to_all_single", "send_recv")
BACKENDS = ("rsccl", "gloo")
# (rtol, atol) for the rsccl-vs-gloo check; the two may sum in a different order.
TOLERANCES = {
    "float32": (1e-4, 1e-5),
    "float64": (1e-9, 1e-12),
    "float16": (1e-2, 3e-2),
    "bfloat16": (2e-2, 1e-1),
    "int32": (0.0, 0.0),
    "int64": (0.0, 0.0),
}
TARGET_SECONDS = 0.2
MIN_ITERS, MAX_ITERS = 3, 200
ROOT = 0
UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
CSV_COLUMNS = (
    "device",
    "world_size",
    "collective",
    "bytes",
    "backend",
    "latency_us",
    "algbw_GBps",
    "busbw_GBps",
    "iters",
)
Groups = dict[str, "dist.ProcessGroup | None"]  # backend name -> group (None: the default group)


class MismatchError(RuntimeError):
    """rsccl's result differs from gloo's."""


@dataclass(frozen=True)
class Config:
    """What every rank runs; picklable, so it travels to spawned ranks."""

    collectives: tuple[str, ...]
    sizes: tuple[int, ...]
    dtype: str
    iters: int | None
    warmup: int
    seed: int
    repeats: int = 3


# -- command line ---------------------------------------------------------------------------


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in UNITS or int(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give a positive integer, optionally with B, KiB, MiB or GiB")
    return int(m.group(1)) * UNITS[unit]


def parse_world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated world sizes of 2 or more, e.g. 2,4")
    return sizes


def parse_collectives(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    known = COLLECTIVES + CUDA_ONLY_COLLECTIVES
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown collective(s) {unknown}; choose from {','.join(known)}")
    return names


# Defaults that differ between the devices; None in the parser means "this device's".
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"collectives": COLLECTIVES, "min_bytes": 4, "max_bytes": 64 << 20, "warmup": 2, "dtype": "float32"},
    "cuda": {
        "collectives": ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor") + CUDA_ONLY_COLLECTIVES,
        "min_bytes": 1 << 10,
        "max_bytes": 1 << 30,
        "warmup": 20,
        "dtype": "bfloat16",
    },
}
QUICK_MAX_BYTES = 1 << 20


def parse_options(text: str) -> dict[str, int | str]:
    """--rsccl-options KEY=VAL,...: fields of rsccl.Options (checked here; values are
    checked by rsccl when the group is created)."""
    from dataclasses import fields

    from .options import Options

    known = [f.name for f in fields(Options)]
    out: dict[str, int | str] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        key, sep, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if not sep or not val or key not in known:
            raise argparse.ArgumentTypeError(f"{item!r}: give KEY=VALUE pairs with KEY one of rsccl.Options' fields: {', '.join(known)}")
        out[key] = int(val) if re.fullmatch(r"-?\d+", val) else val
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rsccl.bench",
        description=__doc__.splitlines()[0] + " " + __doc__.splitlines()[1],
    )
    add = p.add_argument
    cpu, cuda = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["cuda"]
    # String defaults go through `type` too, so they are written the way a user types them.
    add("--device", choices=("cpu", "cuda"), default="cpu", help="default: %(default)s")
    add(
        "--world-sizes",
        type=parse_world_sizes,
        default="2,4",
        help="ranks per run, comma-separated (cuda: those above the number of visible GPUs are left out); default: %(default)s",
    )
    add(
        "--collectives",
        type=parse_collectives,
        default=None,
        help=f"comma-separated; default: {','.join(cpu['collectives'])} (cpu), {','.join(cuda['collectives'])} (cuda)",
    )
    add(
        "--min-bytes",
        type=parse_bytes,
        default=None,
        help=f"smallest per-rank message; default: {human(cpu['min_bytes'])} (cpu), {human(cuda['min_bytes'])} (cuda)",
    )
    add(
        "--max-bytes",
        type=parse_bytes,
        default=None,
        help=f"largest per-rank message; default: {human(cpu['max_bytes'])} (cpu), {human(cuda['max_bytes'])} (cuda)",
    )
    add(
        "--iters",
        type=int,
        default=None,
        help=f"timed calls per size; default (cpu): about {TARGET_SECONDS} s worth, {MIN_ITERS} to {MAX_ITERS}; "
        "(cuda): 50 up to 16 MiB, then fewer, at least 5",
    )
    add(
        "--warmup",
        type=int,
        default=None,
        help=f"untimed calls before each measurement; default: {cpu['warmup']} (cpu), {cuda['warmup']} (cuda)",
    )
    add("--repeats", type=int, default=3, help="measurements per size and backend; the median is reported; default: %(default)s")
    add(
        "--out-dir",
        "--out",
        dest="out",
        metavar="DIR",
        type=Path,
        default="bench-results",
        help="directory for the results (CSV, plot; cuda: Markdown tables too); default: %(default)s",
    )
    add("--dtype", choices=tuple(TOLERANCES), default=None, help=f"default: {cpu['dtype']} (cpu), {cuda['dtype']} (cuda)")
    add("--seed", type=int, default=None, help="seed of the checked inputs; default: random")
    add("--quick", action="store_true", help=f"smoke run: world size 2, messages up to {human(QUICK_MAX_BYTES)}")
    g = p.add_argument_group("--device cuda only")
    g.add_argument(
        "--rsccl-options",
        type=parse_options,
        default={},
        metavar="KEY=VAL,...",
        help="rsccl.Options fields for the rsccl group, e.g. cuda_blocks=16,cuda_buffer_bytes=64MiB",
    )
    g.add_argument(
        "--sweep-one-shot",
        action="store_true",
        help="all_reduce also on two extra rsccl groups, one-shot never (rsccl-2shot) and always "
        "(rsccl-1shot), to read the crossover off one table",
    )
    g.add_argument("--no-graph", action="store_true", help="skip the CUDA graph measurements")
    g.add_argument(
        "--graph-max-bytes", type=parse_bytes, default="1MiB", help="largest message timed in a CUDA graph; default: %(default)s"
    )
    g.add_argument(
        "--check-max-bytes", type=parse_bytes, default="64MiB", help="largest message checked against NCCL; default: %(default)s"
    )
    g.add_argument(
        "--symm-max-bytes", type=parse_bytes, default="64MiB", help="largest all_reduce on torch symmetric memory; default: %(default)s"
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds one world size may take before its ranks are stopped (the FSDP2 section gets 300 s more); default: %(default)s",
    )
    g.add_argument(
        "--no-pool",
        action="store_true",
        help="skip the rsccl-pool rows (the same collectives in place on buffers from rsccl.mem_pool()); "
        "the default rsccl group is then created without a pool",
    )
    g.add_argument(
        "--fsdp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="FSDP2 training steps over rsccl (FSDP's buffers from its pool) and over NCCL; "
        "default: on for --device cuda, off with --quick",
    )
    g.add_argument("--fsdp-steps", type=int, default=20, help="timed FSDP2 steps per backend; default: %(default)s")
    g.add_argument("--fsdp-warmup", type=int, default=5, help="untimed FSDP2 steps before them; default: %(default)s")
    g.add_argument("--fsdp-layers", type=int, default=8, help="transformer layers of the FSDP2 model; default: %(default)s")
    g.add_argument("--fsdp-dim", type=int, default=2048, help="d_model of the FSDP2 model (a multiple of 64); default: %(default)s")
    g.add_argument(
        "--fsdp-pool-bytes", type=parse_bytes, default=None, help="cuda_pool_bytes of the FSDP2 rsccl group; default: sized from the model"
    )
    g.add_argument(
        "--hier",
        action="store_true",
        help="only the emulated multi-host run (4 GPUs as 2 hosts x 2, RSCCL_HOST_ID): hierarchical vs "
        "flat all_reduce, all_gather and reduce_scatter on rsccl's NCCL engine against torch's NCCL, "
        "and send/recv across hosts (pair communicators), written to hier.md (gets --timeout + 360 s: "
        "three collectives and send/recv)",
    )
    args = p.parse_args(argv)
    defaults = DEVICE_DEFAULTS[args.device]
    for key in ("collectives", "min_bytes", "max_bytes", "warmup", "dtype"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    if args.quick:
        args.world_sizes = [2]
        args.max_bytes = min(args.max_bytes, QUICK_MAX_BYTES)
        args.min_bytes = min(args.min_bytes, args.max_bytes)
    if args.device == "cpu":
        cuda_only = [
            flag
            for flag, used in (
                ("--rsccl-options", args.rsccl_options),
                ("--sweep-one-shot", args.sweep_one_shot),
                ("--no-graph", args.no_graph),
                ("--no-pool", args.no_pool),
                ("--fsdp", args.fsdp),
            )
            if used
        ]
        cuda_only += [c for c in args.collectives if c in CUDA_ONLY_COLLECTIVES]
        if cuda_only:
            p.error(f"{', '.join(cuda_only)}: only with --device cuda")
    if args.fsdp is None:
        args.fsdp = args.device == "cuda" and not args.quick
    if args.fsdp_steps < 1 or args.fsdp_warmup < 0 or args.fsdp_layers < 1:
        p.error("--fsdp-steps and --fsdp-layers must be at least 1, --fsdp-warmup at least 0")
    if args.fsdp_dim < 64 or args.fsdp_dim % 64:
        p.error(f"--fsdp-dim {args.fsdp_dim}: give a multiple of 64 (attention heads of 64 or 128)")
    if args.min_bytes > args.max_bytes:
        p.error(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    if (args.iters is not None and args.iters < 1) or args.warmup < 0 or args.repeats < 1:
        p.error("--iters and --repeats must be at least 1, --warmup at least 0")
    return args


def message_sizes(min_bytes: int, max_bytes: int) -> tuple[int, ...]:
    count = int(math.log(max_bytes / min_bytes, 4) + 1e-9) + 1
    return tuple(min_bytes * 4**k for k in range(count))


def human(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


# -- inside a rank ---------------------------------------------------------------------------


def numels(collective: str, nbytes: int, world: int, elem: int) -> tuple[int, int] | None:
    """(input, output) element counts for a per-rank message of `nbytes`, or None when it
    holds too few elements. Sizes that do not split evenly among ranks are rounded down."""
    n = nbytes // elem
    if collective in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        n -= n % world
    if n == 0:
        return None
    if collective == "all_gather_into_tensor":
        return n // world, n
    if collective == "reduce_scatter_tensor":
        return n, n // world
    return n, n


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


# -- in the parent ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, cfg: Config) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="rsccl-bench-") as tmp:
        path = os.path.join(tmp, "rows.json")
        mp.spawn(rank_main, args=(world, free_port(), cfg, path), nprocs=world)
        return json.loads(Path(path).read_text())


def bus_factor(collective: str, world: int) -> float:
    if collective == "all_reduce":
        return 2 * (world - 1) / world
    if collective in ("broadcast", "send_recv"):
        return 1.0
    return (world - 1) / world  # all_gather, reduce_scatter, all_to_all


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
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display is needed or wanted
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError:
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
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        # Powers of 4 keep the tick labels from overlapping.
        ax.xaxis.set_major_locator(LogLocator(base=4))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human(v).replace(" ", "")))
        ax.set_title(collective)
        ax.set_xlabel("message size per rank")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes.flat[len(collectives) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and args.hier:
        from . import _bench_hier

        table, ok = _bench_hier.run(4, 2, timeout=args.timeout + 360)
        print(table, flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hier.md").write_text(table)
        return 0 if ok else 1
    if args.device == "cuda":
        from . import _bench_cuda

        return _bench_cuda.main(args, argv if argv is not None else sys.argv[1:])
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(2), "little")
    sizes = message_sizes(args.min_bytes, args.max_bytes)
    cfg = Config(args.collectives, sizes, args.dtype, args.iters, args.warmup, seed, args.repeats)
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


if __name__ == "__main__":
    sys.exit(main())
