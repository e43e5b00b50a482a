"""What the CPU and the CUDA benchmark share: the collectives, the sweep every rank runs,
the tolerances of the result checks, message sizes, the bus-bandwidth factors and the CSV's
key columns; and what the CUDA bench and its
FSDP2 section share: rsccl's options as rsccl resolves them, the pool arithmetic, and an
exception in one line.
"""

from __future__ import annotations

import math
import socket
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _rsccl
from ..options import as_items

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


# Benchmarked on CUDA only: all_to_all_single (even splits) and send_recv (rank 0 -> rank 1).
CUDA_ONLY_COLLECTIVES = ("all_to_all_single", "send_recv")


# (rtol, atol) for the rsccl-vs-gloo check; the two may sum in a different order.
TOLERANCES = {
    "float32": (1e-4, 1e-5),
    "float64": (1e-9, 1e-12),
    "float16": (1e-2, 3e-2),
    "bfloat16": (2e-2, 1e-1),
    "int32": (0.0, 0.0),
    "int64": (0.0, 0.0),
}


# The first columns of either bench's CSV: what a row measured (its figures follow).
CSV_KEY_COLUMNS = ("device", "world_size", "collective", "bytes", "backend")


@dataclass(frozen=True)
class Sweep:
    """What every rank of either bench runs: the collectives at each message size, `warmup`
    untimed and `iters` timed calls (None: chosen per size), `repeats` times, on inputs drawn
    from `seed`. Picklable, so it travels to spawned ranks; the CUDA bench's Config adds its
    own fields."""

    collectives: tuple[str, ...]
    sizes: tuple[int, ...]
    dtype: str
    iters: int | None
    warmup: int
    repeats: int
    seed: int


POOL_VA_FLOOR = 16 << 30  # rsccl's default max_cuda_va_bytes: the bench never sets a lower cap


GRANULE = 2 << 20


def describe(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its message, shortened."""
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first}"[:400]


def event_us(step: Callable[[], Any], iters: int, barrier: Callable[[], Any]) -> float:
    """Microseconds per call of `step` on this rank: CUDA events around `iters` back-to-back
    calls, after a synchronize and `barrier` (so that the ranks start together). For the
    hierarchy section and the GPU smoke scripts; the CUDA bench's own timing (cuda/timing.py)
    takes the median over repeats of the slowest rank."""
    import torch

    torch.cuda.synchronize()
    barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1000.0


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def resolved(options: dict[str, int | str]) -> dict[str, int] | None:
    """Every setting as rsccl resolves it (the Options field, else the RSCCL_* variable, else
    the default; rsccl's own parser), or None where rsccl would refuse the options (the
    group's creation then fails and says why)."""
    try:
        return dict(_rsccl.resolve_options(as_items(options)))
    except ValueError:
        return None


def message_sizes(min_bytes: int, max_bytes: int) -> tuple[int, ...]:
    count = int(math.log(max_bytes / min_bytes, 4) + 1e-9) + 1
    return tuple(min_bytes * 4**k for k in range(count))


def human(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


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


def bus_factor(collective: str, world: int) -> float:
    if collective == "all_reduce":
        return 2 * (world - 1) / world
    if collective in ("broadcast", "send_recv"):
        return 1.0
    return (world - 1) / world  # all_gather, reduce_scatter, all_to_all


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pyplot() -> Any:
    """matplotlib.pyplot drawing to files only (the Agg backend), or None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display is needed or wanted
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def size_axis(ax: Any) -> None:
    """The x axis of a plot against message size: log 2, labelled in B/KiB/MiB/GiB, with a grid."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_xscale("log", base=2)
    # Powers of 4 keep the tick labels from overlapping.
    ax.xaxis.set_major_locator(LogLocator(base=4))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human(v).replace(" ", "")))
    ax.set_xlabel("message size per rank")
    ax.grid(True, which="both", alpha=0.3)


def abba_order(names: tuple[str, ...] | list[str], repeats: int) -> list[str]:
    """The backends' runs: `names` in order, then reversed, and so on, `repeats` times
    (A B B A A B for two and 3 repeats), so that a drift over the section weighs on each
    backend alike."""
    names = list(names)
    return [n for k in range(repeats) for n in (names if k % 2 == 0 else names[::-1])]


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max of a backend's runs, and the spread (max - min) / median."""
    if not values:
        raise ValueError("spread() of no values")
    med = statistics.median(values)
    lo, hi = min(values), max(values)
    return {"median": med, "min": lo, "max": hi, "spread": (hi - lo) / med if med else float("nan"), "n": len(values)}
