"""Benchmark rsccl on one host: latency and bus bandwidth per collective, side by side
with gloo (--device cpu) or with NCCL and torch's symmetric memory (--device cuda).

    python -m rsccl.bench [--world-sizes 2,4] [--max-bytes 64MiB] [--out-dir bench-results/]
    python -m rsccl.bench --device cuda [--quick] [--sweep-one-shot] [--rsccl-options KEY=VAL,...]
                                        [--no-pool] [--no-fsdp] [--fsdp-steps N] [--fsdp-repeats N]
                                        [--no-overlap] [--overlap-matmul N] [--overlap-bytes 64MiB,256MiB]

--device cpu is described in rsccl/bench/cpu.py, --device cuda in rsccl/bench/cuda/__init__.py.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..fsdp import POOL_COMMS
from .common import COLLECTIVES, CUDA_ONLY_COLLECTIVES, TOLERANCES, human
from .cpu import MAX_ITERS, MIN_ITERS, TARGET_SECONDS
from .cuda.overlap_config import QUICK as OVERLAP_QUICK
from .cuda.overlap_config import OverlapConfig, config_problems
from .fsdp import REPEATS_DEFAULT

UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in UNITS or int(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give a positive integer, optionally with B, KiB, MiB or GiB")
    return int(m.group(1)) * UNITS[unit]


def parse_byte_list(text: str) -> tuple[int, ...]:
    """Comma-separated sizes, each as parse_bytes takes it."""
    items = [s for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated sizes, e.g. 64MiB,256MiB")
    return tuple(parse_bytes(s) for s in items)


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
    "cpu": {"collectives": COLLECTIVES, "min_bytes": 4, "max_bytes": 64 << 20, "warmup": 2, "repeats": 3, "dtype": "float32"},
    "cuda": {
        "collectives": ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor") + CUDA_ONLY_COLLECTIVES,
        "min_bytes": 1 << 10,
        "max_bytes": 1 << 30,
        "warmup": 20,
        # Eager calls are bound by the host, whose hiccups last milliseconds: 5 repeats
        # (with cuda/config.py's 1000 calls each) keep them out of the median.
        "repeats": 5,
        "dtype": "bfloat16",
    },
}


QUICK_MAX_BYTES = 1 << 20


def parse_options(text: str) -> dict[str, int | str]:
    """--rsccl-options KEY=VAL,...: fields of rsccl.Options (checked here; values are
    checked by rsccl when the group is created)."""
    from dataclasses import fields

    from ..options import Options

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


# The overlap flags (None: not given) and the OverlapConfig fields they set.
OVERLAP_FLAGS = {
    "overlap_matmul": "matmul",
    "overlap_matmuls": "matmuls",
    "overlap_bytes": "sizes",
    "overlap_rounds": "rounds",
    "overlap_repeats": "repeats",
    "overlap_collectives": "collectives",
}


def overlap_config(args: argparse.Namespace) -> OverlapConfig:
    """The overlap section's configuration: the defaults (the reduced ones with --quick), with
    every overlap flag given in place of its default."""
    base = OVERLAP_QUICK if args.quick else OverlapConfig()
    return replace(base, **{field: getattr(args, flag) for flag, field in OVERLAP_FLAGS.items() if getattr(args, flag) is not None})


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
        "(cuda): 1000 up to 4 MiB, then fewer, at least 5",
    )
    add(
        "--warmup",
        type=int,
        default=None,
        help=f"untimed calls before each measurement; default: {cpu['warmup']} (cpu), {cuda['warmup']} (cuda)",
    )
    add(
        "--repeats",
        type=int,
        default=None,
        help=f"measurements per size and backend; the median is reported; default: {cpu['repeats']} (cpu), {cuda['repeats']} (cuda)",
    )
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
    g.add_argument(
        "--fsdp-repeats",
        type=int,
        default=REPEATS_DEFAULT,
        help="FSDP2 runs per backend, in ABBA order; the step time is their median, reported with their spread; default: %(default)s",
    )
    g.add_argument("--fsdp-layers", type=int, default=8, help="transformer layers of the FSDP2 model; default: %(default)s")
    g.add_argument("--fsdp-dim", type=int, default=2048, help="d_model of the FSDP2 model (a multiple of 64); default: %(default)s")
    g.add_argument(
        "--fsdp-lr",
        type=float,
        default=0.0,
        help="AdamW's rate after the FSDP2 warm-up steps (linear warm-up over them); default: 3e-4 up to d_model 2048, "
        "scaled by 2048 / d_model above",
    )
    g.add_argument(
        "--fsdp-pool-comms",
        choices=POOL_COMMS,
        default="all_gather",
        help="which of FSDP2's communication buffers the rsccl run takes from rsccl's pool (rsccl.fsdp.use_pool): "
        "all_gather (its outputs only; the reduce-scatter buffers from torch's allocator) or both (all-gather outputs, "
        "reduce-scatter buffers and with them the gradient shards); default: %(default)s",
    )
    g.add_argument(
        "--fsdp-pool-bytes", type=parse_bytes, default=None, help="cuda_pool_bytes of the FSDP2 rsccl group; default: sized from the model"
    )
    g.add_argument(
        "--ctas-profile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="last, read the grid (CTAs) of rsccl's and NCCL's kernels per collective from a torch.profiler trace, at "
        "the smallest and largest size (rsccl/bench/cuda/ctas.py); default: on for --device cuda",
    )
    od = OverlapConfig()
    g.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a bf16 matmul loop on the compute stream with all_gather/reduce_scatter on a side stream, rsccl against "
        "NCCL, ABBA (rsccl/bench/cuda/overlap.py); default: on for --device cuda, reduced with --quick",
    )
    g.add_argument(
        "--overlap-matmul",
        type=int,
        default=None,
        metavar="N",
        help=f"n of the overlap section's bf16 n x n x n matmul; default: {od.matmul} ({OVERLAP_QUICK.matmul} with --quick)",
    )
    g.add_argument(
        "--overlap-matmuls",
        type=int,
        default=None,
        help=f"matmuls per overlap window; default: {od.matmuls} ({OVERLAP_QUICK.matmuls} with --quick)",
    )
    g.add_argument(
        "--overlap-bytes",
        type=parse_byte_list,
        default=None,
        metavar="SIZE,...",
        help="per-rank message sizes of the overlap section's collectives (all_gather OUTPUT, reduce_scatter INPUT); default: "
        f"{','.join(human(s).replace(' ', '') for s in od.sizes)} "
        f"({','.join(human(s).replace(' ', '') for s in OVERLAP_QUICK.sizes)} with --quick)",
    )
    g.add_argument(
        "--overlap-rounds",
        type=int,
        default=None,
        help=f"rounds per overlap window, one all_gather and one reduce_scatter per size each; default: {od.rounds} "
        f"({OVERLAP_QUICK.rounds} with --quick)",
    )
    g.add_argument("--overlap-repeats", type=int, default=None, help=f"overlap runs per backend, ABBA, at least 3; default: {od.repeats}")
    g.add_argument(
        "--overlap-collectives",
        type=lambda v: tuple(x.strip() for x in v.split(",") if x.strip()),
        default=None,
        metavar="NAME,...",
        help=f"the collectives of each overlap round, one or both of {','.join(od.collectives)} (one alone tells "
        f"its cost apart); default: {','.join(od.collectives)}",
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
    for key in ("collectives", "min_bytes", "max_bytes", "warmup", "repeats", "dtype"):
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
                ("--overlap", args.overlap),
                ("--ctas-profile", args.ctas_profile),
            )
            if used
        ]
        cuda_only += [f"--{k.replace('_', '-')}" for k in OVERLAP_FLAGS if getattr(args, k) is not None]
        cuda_only += [c for c in args.collectives if c in CUDA_ONLY_COLLECTIVES]
        if cuda_only:
            p.error(f"{', '.join(cuda_only)}: only with --device cuda")
    if args.fsdp is None:
        args.fsdp = args.device == "cuda" and not args.quick
    if args.overlap is None:
        args.overlap = args.device == "cuda"
    if args.ctas_profile is None:
        args.ctas_profile = args.device == "cuda"
    args.overlap_config = overlap_config(args)
    if args.overlap and (problems := config_problems(args.overlap_config)):
        p.error("; ".join(problems))
    if args.fsdp_steps < 1 or args.fsdp_warmup < 0 or args.fsdp_layers < 1 or args.fsdp_repeats < 1:
        p.error("--fsdp-steps, --fsdp-layers and --fsdp-repeats must be at least 1, --fsdp-warmup at least 0")
    if args.fsdp_lr < 0:
        p.error(f"--fsdp-lr {args.fsdp_lr}: give a positive rate, or 0 for the default")
    if args.fsdp_dim < 64 or args.fsdp_dim % 64:
        p.error(f"--fsdp-dim {args.fsdp_dim}: give a multiple of 64 (attention heads of 64 or 128)")
    if args.min_bytes > args.max_bytes:
        p.error(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    if (args.iters is not None and args.iters < 1) or args.warmup < 0 or args.repeats < 1:
        p.error("--iters and --repeats must be at least 1, --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and args.hier:
        from . import hier

        table, ok = hier.run(4, 2, timeout=args.timeout + 360)
        print(table, flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hier.md").write_text(table)
        return 0 if ok else 1
    if args.device == "cuda":
        from .cuda import run

        return run.main(args, argv if argv is not None else sys.argv[1:])
    from . import cpu

    return cpu.main(args)
