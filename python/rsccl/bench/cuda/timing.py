"""Timing with CUDA events: eager and async calls, and calls replayed from a CUDA graph."""

from __future__ import annotations

import statistics
import time

import torch

from ..common import describe
from .backends import Agree, Call
from .config import GRAPH_CALLS, GRAPH_REPLAYS, Config


def timed(call: Call, n: int, cfg: Config, agree: Agree) -> tuple[float, float]:
    """(GPU, CPU) seconds per call, n calls per repeat: see event_timed."""
    return event_timed(call, n, cfg, agree)


def event_timed(step: Call, per_step: int, cfg: Config, agree: Agree, steps: int | None = None) -> tuple[float, float]:
    """(GPU, CPU) seconds per call, each the median over repeats of the slowest rank's:
    CUDA events around `steps` runs of `step` (default: `per_step` runs, one call each),
    and the calling thread's wall clock over the same runs (what issuing them cost the
    host), each divided by `per_step`, the number of calls those runs make."""
    runs = steps if steps is not None else per_step
    times, host = [], []
    for _ in range(cfg.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        agree.barrier()
        start.record()
        t0 = time.perf_counter()
        for _ in range(runs):
            step()
        host.append((time.perf_counter() - t0) / per_step)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_step)
    return statistics.median(agree.max(times)), statistics.median(agree.max(host))


def launch_cost(dev: torch.device, n: int, cfg: Config, agree: Agree) -> tuple[float, float]:
    """(GPU, CPU) seconds per call of a plain torch launch, `x.add_(0)` on 1 KiB: the
    yardstick for what an eager collective costs the host (issue 27)."""
    x = torch.zeros(256, device=dev)
    for _ in range(cfg.warmup):
        x.add_(0)
    return event_timed(lambda: x.add_(0), n, cfg, agree)


def graph_timed(call: Call, cfg: Config, agree: Agree) -> tuple[float | None, str]:
    """(seconds per call replaying a graph of GRAPH_CALLS calls, "") or (None, why it failed)."""
    err = ""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        err = f"warm-up on a side stream: {describe(e)}"
    if err := agree.first_error(err):
        return None, err
    agree.barrier()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(GRAPH_CALLS):
                call()
    except Exception as e:  # noqa: BLE001
        err = f"capture: {describe(e)}"
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        err += f"; synchronize after capture: {describe(e)}"
    if err := agree.first_error(err):
        return None, err
    torch.cuda.synchronize()
    agree.barrier()
    graph.replay()  # the first replay uploads the graph
    per_call, _ = event_timed(graph.replay, GRAPH_REPLAYS * GRAPH_CALLS, cfg, agree, steps=GRAPH_REPLAYS)
    del graph
    return per_call, ""
