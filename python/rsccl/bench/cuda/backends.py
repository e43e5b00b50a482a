"""How the CUDA bench runs a collective: the ranks' agreements over gloo, the buffers, a
Backend (a process group or a torch symmetric-memory op) and the result check.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..common import TOLERANCES, describe
from .config import A2A, EXACT_COLLECTIVES, P2P, POOL_COLLECTIVES, POOL_MIN_BYTES, SWEEP


class Agree:
    """Barriers and agreements among the ranks over gloo (CPU): they never touch a GPU."""

    def __init__(self, gloo: dist.ProcessGroup):
        self.gloo = gloo

    def barrier(self) -> None:
        dist.barrier(group=self.gloo)

    def first_error(self, err: str) -> str:
        """The empty string if no rank had an error, else the first failing rank's, naming it."""
        errs = self.gather(err)
        bad = [(r, e) for r, e in enumerate(errs) if e]
        if not bad:
            return ""
        r, e = bad[0]
        more = f" (and {len(bad) - 1} more ranks)" if len(bad) > 1 else ""
        return f"rank {r}{more}: {e}"

    def max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.gloo)
        return t.tolist()

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size(self.gloo)
        dist.all_gather_object(out, obj, group=self.gloo)
        return out


Call = Callable[[], Any]


@dataclass
class Bufs:
    """One (collective, size)'s tensors, shared by the backends (zeros: repeated in-place
    sums of zeros stay finite)."""

    collective: str
    inp: torch.Tensor
    out: torch.Tensor


def make_bufs(collective: str, counts: tuple[int, int], dtype: torch.dtype, dev: torch.device) -> Bufs:
    inp = torch.zeros(counts[0], dtype=dtype, device=dev)
    in_place = collective in ("all_reduce", "broadcast")
    return Bufs(collective, inp, inp if in_place else torch.zeros(counts[1], dtype=dtype, device=dev))


def make_pool_bufs(collective: str, counts: tuple[int, int], dtype: torch.dtype, dev: torch.device, pool: Any) -> Bufs:
    """The buffer rsccl uses in place comes from the pool (all_reduce: the tensor, all_gather:
    the output, reduce_scatter: the input), the other from torch's allocator as usual. Every
    rank allocates the same sizes in the same order, so the pool buffers have the same offset
    on every rank."""
    pooled = counts[1] if collective == "all_gather_into_tensor" else counts[0]
    with torch.cuda.use_mem_pool(pool):
        big = torch.zeros(pooled, dtype=dtype, device=dev)
    if collective in ("all_reduce", "broadcast"):
        return Bufs(collective, big, big)
    if collective == "all_gather_into_tensor":
        return Bufs(collective, torch.zeros(counts[0], dtype=dtype, device=dev), big)
    return Bufs(collective, big, torch.zeros(counts[1], dtype=dtype, device=dev))


class Backend:
    """A way to run the benchmarked collectives: a process group, or a symmetric-memory op."""

    def __init__(self, name: str, group: Any = None, symm: Any = None, pool: Any = None):
        self.name = name
        self.group = group  # None: the default group (rsccl)
        self.symm = symm  # SymmSetup for the symm-* backends
        self.pool = pool  # rsccl-pool: the default group's rsccl.mem_pool(), where its buffers come from
        self.graph_failed = ""  # why capture failed once (then it is not tried again)

    @property
    def is_symm(self) -> bool:
        return self.symm is not None

    def supports(self, collective: str, nbytes: int) -> bool:
        if self.is_symm:
            return collective == "all_reduce" and nbytes <= self.symm.max_bytes
        if self.pool is not None:
            return collective in POOL_COLLECTIVES and nbytes >= POOL_MIN_BYTES
        if self.name in SWEEP:
            return collective == "all_reduce"
        return True

    def call(self, b: Bufs, async_op: bool = False) -> Call:
        if self.is_symm:
            n = b.inp.numel()
            buf, name = self.symm.buf[:n], self.symm.group_name
            if self.name == "symm-1shot":
                out = self.symm.out[:n]
                return lambda: torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", name, out)
            return lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name)
        g, inp, out = self.group, b.inp, b.out
        if b.collective == P2P:
            me = dist.get_rank()
            if me > 1:
                return lambda: None  # only ranks 0 and 1 take part
            if me == 0:
                return (lambda: dist.isend(inp, dst=1, group=g).wait()) if async_op else (lambda: dist.send(inp, dst=1, group=g))
            return (lambda: dist.irecv(out, src=0, group=g).wait()) if async_op else (lambda: dist.recv(out, src=0, group=g))
        if b.collective == "all_reduce":
            fn: Call = lambda: dist.all_reduce(inp, group=g, async_op=async_op)
        elif b.collective == "broadcast":
            fn = lambda: dist.broadcast(inp, src=0, group=g, async_op=async_op)
        elif b.collective == "all_gather_into_tensor":
            fn = lambda: dist.all_gather_into_tensor(out, inp, group=g, async_op=async_op)
        elif b.collective == A2A:
            fn = lambda: dist.all_to_all_single(out, inp, group=g, async_op=async_op)
        else:
            fn = lambda: dist.reduce_scatter_tensor(out, inp, group=g, async_op=async_op)
        if async_op:
            return lambda: fn().wait()
        return fn

    def bufs(self, collective: str, counts: tuple[int, int], dtype: torch.dtype, dev: torch.device) -> Bufs:
        if self.pool is not None:
            return make_pool_bufs(collective, counts, dtype, dev, self.pool)
        return make_bufs(collective, counts, dtype, dev)

    def run_on(self, collective: str, x: torch.Tensor, counts: tuple[int, int], dev: torch.device) -> torch.Tensor:
        """The collective's result on input `x` (for the correctness check)."""
        if self.is_symm:
            n = x.numel()
            self.symm.buf[:n].copy_(x)
            self.call(Bufs(collective, x, x))()
            res = self.symm.out[:n] if self.name == "symm-1shot" else self.symm.buf[:n]
            return res.clone()
        b = self.bufs(collective, counts, x.dtype, dev)
        b.inp.copy_(x)
        self.call(b)()
        return b.out


@dataclass
class SymmSetup:
    group_name: str
    buf: torch.Tensor  # symmetric memory, rendezvoused on the NCCL group
    out: torch.Tensor  # one-shot's output
    max_bytes: int


def setup_symm(nccl: Any, max_bytes: int, dtype: torch.dtype, dev: torch.device, agree: Agree) -> tuple[SymmSetup | None, str]:
    """Torch's symmetric memory for all_reduce on the NCCL group's ranks, or (None, why not).
    Every step is agreed among the ranks, so that none waits in a rendezvous another left."""
    import torch.distributed._symmetric_memory as symm_mem

    err = ""
    if dtype not in (torch.bfloat16, torch.float32):
        err = f"its all_reduce ops take bfloat16 and float32, not {dtype}"
    elif not all(hasattr(torch.ops.symm_mem, op) for op in ("one_shot_all_reduce_out", "two_shot_all_reduce_")):
        err = "torch.ops.symm_mem lacks one_shot_all_reduce_out or two_shot_all_reduce_"
    if err := agree.first_error(err):
        return None, err
    name = nccl.group_name
    elem = torch.empty(0, dtype=dtype).element_size()
    n = max_bytes // elem
    buf = out = torch.empty(0, dtype=dtype, device=dev)
    try:
        buf = symm_mem.empty(n, dtype=dtype, device=dev)
        out = torch.empty(n, dtype=dtype, device=dev)
    except Exception as e:  # noqa: BLE001 - reported, the benchmark goes on without it
        err = f"symm_mem.empty: {describe(e)}"
    if err := agree.first_error(err):
        return None, err
    try:
        try:
            symm_mem.rendezvous(buf, name)
        except RuntimeError as e:
            # torch 2.11 finds the group by its name; older versions need it enabled first.
            if "group info" not in str(e):
                raise
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(name)
            symm_mem.rendezvous(buf, name)
    except Exception as e:  # noqa: BLE001
        err = f"rendezvous: {describe(e)}"
    if err := agree.first_error(err):
        return None, err
    setup = SymmSetup(name, buf, out, max_bytes)
    try:
        buf.zero_()
        small = Bufs("all_reduce", buf[:1024], buf[:1024])
        Backend("symm-1shot", symm=setup).call(small)()
        Backend("symm-2shot", symm=setup).call(small)()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        err = f"first call: {describe(e)}"
    if err := agree.first_error(err):
        return None, err
    return setup, ""


def close(got: torch.Tensor, ref: torch.Tensor, collective: str, dtype: str, world: int) -> tuple[bool, float]:
    """(matches, max |difference|). Gathers, broadcast, all_to_all and send/recv move bytes: exact. Reductions may
    add in another order (and round once or at every step): TOLERANCES, atol scaled by world."""
    diff = (got.float() - ref.float()).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    if collective in EXACT_COLLECTIVES:
        return bool(torch.equal(got, ref)), worst
    rtol, atol = TOLERANCES[dtype]
    ok = bool(torch.allclose(got.float(), ref.float(), rtol=rtol, atol=atol * world / 2))
    return ok and math.isfinite(worst), worst
