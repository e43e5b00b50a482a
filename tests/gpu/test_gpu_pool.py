"""rsccl's symmetric pool (`cuda_pool_bytes`, `rsccl.mem_pool()`), on 2 and 4 GPUs.

Every test here runs on a cluster whose world group has a 1 GiB pool (POOL_OPTIONS); a
few use extra groups with pools of their own (another one-shot limit, CUDA graphs,
rank-dependent allocations, exhaustion), so that the world pool's history stays the same
on every rank and its counters exact.
Tensors made under `with torch.cuda.use_mem_pool(rsccl.mem_pool()):` in the same order on
every rank lie at the same offset of every rank's pool; a collective on such buffers, of
at least `cuda_inplace_min_bytes` (1 MiB), reads and writes the peers' buffers directly
("in place") instead of copying through rsccl's staging buffer. Anything else (a buffer
outside the pool on some rank, offsets that differ, a small message, an all_reduce small
enough for the one-shot kernel) takes the staged path. Both must give NCCL's results;
`rsccl.memory_stats()` counts each collective as one or the other, and the tests check
those counters call by call.

After each rsccl call the pool buffer is copied out and overwritten on the same stream:
a rank whose kernel returned while a peer was still reading or writing its buffer gives
that peer wrong data, which the peer's check then reports.

Also: CUDA graphs of in-place collectives; buffers at unequal offsets; pool and regular
tensors mixed across ranks; pool exhaustion (torch.OutOfMemoryError) and the pool
counters; FSDP2 with its buffers in the pool (rsccl.fsdp.use_pool: the all-gather outputs,
or every communication buffer) against the same training over NCCL; a hand-written tensor-parallel MLP whose all_reduce buffers come
from the pool, against NCCL, and its peak reserved memory.
"""

from __future__ import annotations

import copy
import functools
import gc
import math
import time

import pytest
import rsccl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cases import cuda_roundings
from gpu_harness import capture, needs_gpus, needs_own_gpus, shares_gpus, warm_up_aside
from gpu_refs import DTYPES, RED, check_vs_nccl, gather_inputs, nccl_result, ops_for, rand, ref_call, refill
from refs import assert_equal, assert_identical_across_ranks, check_reduction
from torch import nn

pytestmark = needs_gpus

MiB = 1 << 20
# The world group of every test in this module.
POOL_OPTIONS = {"cuda_pool_bytes": "1GiB", "max_cuda_va_bytes": "16GiB"}
POOL_BYTES = 1 << 30
STAGING_BYTES = 64 * MiB  # cuda_buffer_bytes, default
COUNTERS = ("cuda_inplace_collectives", "cuda_inplace_bytes", "cuda_staged_collectives", "cuda_staged_bytes")
POOL_KEYS = ("cuda_pool_bytes", "cuda_pool_allocated_bytes", "cuda_pool_peak_bytes") + COUNTERS

KINDS = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast"]
REDUCING = {"all_reduce", "reduce_scatter_tensor"}
# (name, target message bytes, odd element count). The message is what rsccl compares with
# cuda_inplace_min_bytes: the all_reduce/broadcast tensor, the all_gather output, the
# reduce_scatter input. "1MiB" is exactly the default minimum (in place: ">= 1 MiB").
SIZES = [("1MiB", MiB, False), ("3MiB+odd", 3 * MiB, True), ("64MiB", 64 * MiB, False)]


def _sizes(world: int) -> list:
    """SIZES, less 64 MiB where ranks share GPUs: there every reference goes through gloo on
    CPU copies (8 ranks: 3 x 512 MiB over loopback per case), which took longer than the
    test's deadline; 1 and 3 MiB still run in place (two-shot at every world size)."""
    return [s for s in SIZES if s[1] < 64 * MiB] if shares_gpus(world) else SIZES


@pytest.fixture
def pool_gpus(gpus):
    """The cluster of this world size whose world group has a 1 GiB pool."""
    return gpus.with_options(POOL_OPTIONS)


# -- helpers --------------------------------------------------------------------------------


def _auto_one_shot_max(local_ranks: int) -> int:
    """rust/core/src/cuda/decide.rs auto_one_shot_max: the one-shot limit when
    cuda_allreduce_one_shot_max_bytes is 0."""
    return 2 * MiB if local_ranks <= 2 else 512 << 10 if local_ranks <= 4 else 256 << 10


# rust/core/src/cuda/decide.rs ALLREDUCE_IN_PLACE_MAX_BYTES: above 2 local ranks, all_reduce
# runs in place only below this size.
ALLREDUCE_IN_PLACE_MAX = 64 * MiB


def _limits(world: int, options: dict) -> tuple[int, int, int]:
    """(cuda_inplace_min_bytes, one-shot all_reduce limit, all_reduce's in-place limit) of a
    group created with `options` (and this process's RSCCL_* environment)."""
    resolved = dict(rsccl._rsccl.resolve_options([(k, str(v)) for k, v in options.items()]))
    inplace_min = resolved.get("cuda_inplace_min_bytes", MiB)
    one_shot = resolved.get("cuda_allreduce_one_shot_max_bytes", 0) or _auto_one_shot_max(world)
    return inplace_min, one_shot, (ALLREDUCE_IN_PLACE_MAX if world > 2 else 1 << 62)


def _expect_inplace(kind: str, msg_bytes: int, limits: tuple[int, int, int]) -> bool:
    """The contract: in place when every rank's buffer is in the pool at the same offset,
    the message is >= cuda_inplace_min_bytes and, for all_reduce, above the one-shot limit
    and below its in-place limit (above 2 ranks)."""
    inplace_min, one_shot, ar_max = limits
    return msg_bytes >= inplace_min and (kind != "all_reduce" or one_shot < msg_bytes < ar_max)


def _elements(kind: str, esize: int, size: tuple, world: int) -> tuple[int, int]:
    """(elements of the message tensor, elements of the per-rank tensor): the all_reduce or
    broadcast tensor twice; the all_gather output and input; the reduce_scatter input and
    output. "odd" sizes have an odd element count per rank (and bytes not a multiple of 16)."""
    _, target, odd = size
    base = target // esize
    if kind in ("all_reduce", "broadcast"):
        n = base + 7 if odd else base
        return n, n
    m = -(-base // world)
    if odd:
        m += 7 - m % 2
    return world * m, m


def _pool_empty(pool, n: int, dtype: torch.dtype) -> torch.Tensor:
    with torch.cuda.use_mem_pool(pool):
        return torch.empty(n, dtype=dtype, device="cuda")


def _in_pool(pool):
    return lambda n, dtype: _pool_empty(pool, n, dtype)


def _regular(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(n, dtype=dtype, device="cuda")


def _poison(t: torch.Tensor) -> None:
    t.fill_(float("nan") if t.is_floating_point() else 0x5A5A5A5A)


def _take(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t`, then `t` overwritten, both on the current stream right after the
    collective: a peer still reading this rank's buffer would read the poison."""
    c = t.clone()
    _poison(t)
    return c


def _all_reduce_and_take(t: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return _take(t)


def _stat(stats: dict, key: str) -> int:
    assert key in stats, f"rsccl.memory_stats() has no {key!r}; it has {sorted(stats)}"
    return int(stats[key])


def _counts(group=None) -> tuple[int, ...]:
    s = rsccl.memory_stats(group)
    return tuple(_stat(s, k) for k in COUNTERS)


_EXPECT = {True: "in place", False: "staged", None: "in place or staged"}


class _Counter:
    """Checks, call by call, that rsccl's in-place/staged counters moved by one collective
    of the message's bytes, the way expected. Mismatches are collected (with the results
    still checked) and reported together at the end, so one run shows all of them."""

    def __init__(self, group=None):
        self.group = group
        self.calls = 0
        self.inplace = 0
        self.staged = 0
        self.problems: list[str] = []

    def run(self, what: str, expect: bool | None, msg_bytes: int, fn):
        """Run `fn` (one rsccl collective, then whatever copies out its result); `expect`:
        True in place, False staged, None either (but exactly one of them)."""
        before = _counts(self.group)
        result = fn()
        after = _counts(self.group)
        n_in, b_in, n_st, b_st = (a - b for a, b in zip(after, before, strict=True))
        self.calls += 1
        self.inplace += n_in
        self.staged += n_st
        if expect is None:
            ok = (n_in, b_in, n_st, b_st) in ((1, msg_bytes, 0, 0), (0, 0, 1, msg_bytes))
        else:
            ok = (n_in, b_in, n_st, b_st) == ((1, msg_bytes, 0, 0) if expect else (0, 0, 1, msg_bytes))
        if not ok:
            self.problems.append(
                f"{what} ({msg_bytes} byte message): expected {_EXPECT[expect]}; the counters moved by "
                f"in place +{n_in} (+{b_in} bytes), staged +{n_st} (+{b_st} bytes)"
            )
        return result

    def check(self) -> None:
        assert not self.problems, f"{len(self.problems)} of {self.calls} collectives were counted wrong:\n" + "\n".join(self.problems[:60])

    def summary(self) -> dict:
        return {"calls": self.calls, "inplace": self.inplace, "staged": self.staged}


def _ops(kind: str, dtype: torch.dtype) -> list[str]:
    return ops_for(dtype) if kind in REDUCING else ["COPY"]


def _run_case(ctx, seed: int, g, counter: _Counter, case: tuple, place, expect: str, limits: tuple[int, int], label: str) -> None:
    """One collective on group `g` whose pool-side buffer (the all_reduce/broadcast tensor,
    the all_gather output, the reduce_scatter input) comes from `place(n, dtype)`; its
    result checked against NCCL's on the same inputs (and a float64/int64 reference for
    reductions), its counters against `expect`: "auto" (the contract's rule), "staged",
    or "either"."""
    kind, dtype, op, size, root = case
    w, me = ctx.world, ctx.rank
    n_msg, n_part = _elements(kind, dtype.itemsize, size, w)
    msg = n_msg * dtype.itemsize
    exp = {"auto": _expect_inplace(kind, msg, limits), "staged": False, "either": None}[expect]
    what = f"{kind} {op} {str(dtype).removeprefix('torch.')} {size[0]} ({n_msg} elements){f' root={root}' if kind == 'broadcast' else ''} world={w} [{label}]"
    red = RED.get(op)

    if kind == "all_reduce":
        x = rand(seed, me, n_msg, dtype, op, salt=what)
        buf = place(n_msg, dtype)
        buf.copy_(x)

        def fn() -> torch.Tensor:
            dist.all_reduce(buf, op=red, group=g)
            return _take(buf)

        got = counter.run(what, exp, msg, fn)
        # A staged call of the ring's size rounds at each hop (NOTE [Ring]).
        check_reduction(got, gather_inputs(ctx, x), op, what, cuda_roundings(ctx, g, x.device, msg))
        theirs = x.clone()
        if nccl_result(dist.all_reduce, theirs, op=red, group=ctx.nccl):
            check_vs_nccl(got, theirs, op, what, w)
        assert_identical_across_ranks(ctx, got, what)
    elif kind == "broadcast":
        x = rand(seed, me, n_msg, dtype, salt=what)
        buf = place(n_msg, dtype)
        buf.copy_(x)

        def fn() -> torch.Tensor:
            dist.broadcast(buf, src=root, group=g)
            return _take(buf)

        got = counter.run(what, exp, msg, fn)
        theirs = x.clone()
        ref_call(dist.broadcast, theirs, src=root, group=ctx.nccl)
        assert_equal(got, theirs, what)
    elif kind == "all_gather_into_tensor":
        x = rand(seed, me, n_part, dtype, salt=what)
        out = place(n_msg, dtype)

        def fn() -> torch.Tensor:
            dist.all_gather_into_tensor(out, x, group=g)
            return _take(out)

        got = counter.run(what, exp, msg, fn)
        assert_equal(got, gather_inputs(ctx, x).reshape(-1), what)
    elif kind == "reduce_scatter_tensor":
        x = rand(seed, me, n_msg, dtype, op, salt=what)
        inp = place(n_msg, dtype)
        inp.copy_(x)
        out = torch.empty(n_part, dtype=dtype, device=x.device)

        def fn() -> torch.Tensor:
            dist.reduce_scatter_tensor(out, inp, op=red, group=g)
            return _take(inp)

        kept = counter.run(what, exp, msg, fn)
        assert_equal(kept, x, f"{what}: the input changed (reduce_scatter must leave it as it was)")
        xs = gather_inputs(ctx, x)
        check_reduction(out, xs[:, me * n_part : (me + 1) * n_part], op, what, cuda_roundings(ctx, g, out.device, msg))
        theirs = torch.empty_like(out)
        if nccl_result(dist.reduce_scatter_tensor, theirs, x, op=red, group=ctx.nccl):
            check_vs_nccl(out, theirs, op, what, w)
    else:
        raise AssertionError(kind)


def _pool_group(ctx, name: str, fields: dict):
    """An extra all-rank rsccl group with `fields`, created on first use (every rank asks for
    it in the same body) and kept until the cluster closes."""
    groups = ctx.state.setdefault("pool_groups", {})
    if name not in groups:
        groups[name] = dist.new_group(backend="rsccl", pg_options=rsccl.Options(**fields))
    return groups[name]


# -- the API and the figures at creation ----------------------------------------------------


def body_pool_api(ctx, seed: int) -> dict:
    w, dev = ctx.world, torch.device("cuda", torch.cuda.current_device())
    pg = dist.group.WORLD
    stats = rsccl.memory_stats()
    for key in POOL_KEYS:
        _stat(stats, key)
    assert stats["cuda_pool_bytes"] == POOL_BYTES, f"world group created with cuda_pool_bytes=1GiB: {stats}"
    # The pool shares the staging buffer's VMM allocation; every rank maps every peer's at creation.
    per_rank = POOL_BYTES + STAGING_BYTES
    assert stats["cuda_mapped_own_bytes"] >= per_rank, f"own mapping smaller than pool + staging ({per_rank}): {stats}"
    assert stats["cuda_mapped_peer_bytes"] >= (w - 1) * per_rank, f"peers' pools must be mapped at creation: {stats}"
    assert w * per_rank <= stats["cuda_va_reserved_bytes"] <= 16 << 30, f"max_cuda_va_bytes=16GiB: {stats}"

    pool = rsccl.mem_pool()
    assert isinstance(pool, torch.cuda.MemPool), type(pool)
    assert rsccl.mem_pool() is pool and rsccl.mem_pool(pg) is pool, "rsccl.mem_pool() must return the same MemPool every time"

    # What FSDP2's ProcessGroupAllocMixin calls.
    assert pg._get_backend(dev) is pg, "_get_backend(device) must return the group itself"
    assert pg.supports_tensor_alloc(dev) is True
    assert pg.mem_allocator is not None
    n = (1 << 20) + 1  # float32: 4 MiB + 4 bytes, above the one-shot limit at 2 and 4 ranks
    t = pg.allocate_tensor(n, dtype=torch.float32, device=dev)
    assert t.shape == (n,) and t.dtype == torch.float32 and t.device == dev, f"allocate_tensor gave {t.dtype}{tuple(t.shape)} on {t.device}"
    # allocate_tensor's memory is the pool's: an all_reduce on it runs in place.
    what = "all_reduce on a tensor from allocate_tensor"
    x = rand(seed, ctx.rank, n, torch.float32, salt=what)
    t.copy_(x)
    counter = _Counter()
    got = counter.run(
        what, _expect_inplace("all_reduce", 4 * n, _limits(w, POOL_OPTIONS)), 4 * n, lambda: (dist.all_reduce(t), _take(t))[1]
    )
    check_reduction(got, gather_inputs(ctx, x), "SUM", what)
    counter.check()

    # A group without a pool says so.
    plain = dist.new_group(backend="rsccl")
    try:
        assert plain.supports_tensor_alloc(dev) is False
        try:
            rsccl.mem_pool(plain)
            raised = "nothing"
        except RuntimeError as e:
            raised = str(e)
        assert "cuda_pool_bytes" in raised, (
            f"rsccl.mem_pool() of a group without a pool raised {raised!r}; expected a RuntimeError naming cuda_pool_bytes"
        )
    finally:
        dist.destroy_process_group(plain)
    torch.cuda.synchronize()
    return {k: stats[k] for k in POOL_KEYS}


def test_pool_api_and_stats(pool_gpus, seed):
    pool_gpus.run(body_pool_api, seed, timeout=120)


# -- (a) in place: every collective x dtype x op x size --------------------------------------


def body_inplace(ctx, seed: int, kind: str, sizes: list) -> dict:
    """Every buffer allocated from the pool in the same order on every rank (so at the
    same offset): in place wherever the contract says so, staged otherwise (all_reduce of
    1 MiB on 2 ranks: one-shot)."""
    g, pool = dist.group.WORLD, rsccl.mem_pool()
    limits = _limits(ctx.world, POOL_OPTIONS)
    counter = _Counter(g)
    i = 0
    for dtype in DTYPES:
        for op in _ops(kind, dtype):
            for size in sizes:
                _run_case(
                    ctx, seed, g, counter, (kind, dtype, op, size, i % ctx.world), _in_pool(pool), "auto", limits, "pool, same offsets"
                )
                i += 1
    torch.cuda.synchronize()
    counter.check()
    return counter.summary()


@pytest.mark.parametrize("kind", KINDS)
def test_inplace_collectives(pool_gpus, seed, kind):
    sizes = _sizes(pool_gpus.world)
    res = pool_gpus.run(body_inplace, seed, kind, sizes, timeout=300)
    calls = sum(len(_ops(kind, d)) for d in DTYPES) * len(sizes)
    for rank, r in enumerate(res):
        assert r["calls"] == calls and r["inplace"] + r["staged"] == calls, f"rank {rank}: {r}"
        assert r["inplace"] > 0, f"rank {rank}: no {kind} ran in place: {r}"


ONE_SHOT_OPTIONS = {"cuda_pool_bytes": "64MiB", "cuda_allreduce_one_shot_max_bytes": "4MiB"}
ONE_SHOT_SIZES = [("3MiB+odd", 3 * MiB, True), ("4MiB", 4 * MiB, False), ("4MiB+odd", 4 * MiB, True)]


def body_one_shot_is_staged(ctx, seed: int) -> dict:
    """An all_reduce from the pool that the one-shot kernel runs (<= its limit, 4 MiB here)
    counts as staged; just above the limit, two-shot, it runs in place."""
    g = _pool_group(ctx, "one-shot 4MiB", ONE_SHOT_OPTIONS)
    pool = rsccl.mem_pool(g)
    limits = _limits(ctx.world, ONE_SHOT_OPTIONS)
    assert limits[1] == 4 * MiB, limits
    counter = _Counter(g)
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        for size in ONE_SHOT_SIZES:
            _run_case(ctx, seed, g, counter, ("all_reduce", dtype, "SUM", size, 0), _in_pool(pool), "auto", limits, "one-shot limit 4 MiB")
    torch.cuda.synchronize()
    counter.check()
    return counter.summary()


def test_inplace_all_reduce_only_above_the_one_shot_limit(pool_gpus, seed):
    for rank, r in enumerate(pool_gpus.run(body_one_shot_is_staged, seed, timeout=120)):
        assert (r["inplace"], r["staged"]) == (3, 6), f"rank {rank}: {r}"


GRAPH_OPTIONS = {"cuda_pool_bytes": "256MiB"}


def body_inplace_graph(ctx, seed: int, replays: int) -> dict:
    """In-place collectives (and one staged) captured in a CUDA graph, replayed on fresh
    data each time and checked against NCCL run eagerly; each replay runs in place again
    (the kernels count it). In a group of its own: its counters are read only here (see
    the staged count below)."""
    w, dev = ctx.world, ctx.device
    g = _pool_group(ctx, "graph", GRAPH_OPTIONS)
    pool = rsccl.mem_pool(g)
    limits = _limits(w, GRAPH_OPTIONS)
    n_ar = (2 << 20) + 5  # bfloat16: 4 MiB + 10 bytes, two-shot at 2 and 4 ranks
    m_ag = (1 << 18) // w + 1  # float32 output: just over 1 MiB
    m_rs = 300_007  # bfloat16 input: w x 600 KB
    n_bc = 200_003  # int64: 1.6 MB
    with torch.cuda.use_mem_pool(pool):
        ar = torch.zeros(n_ar, dtype=torch.bfloat16, device=dev)
        ar_small = torch.zeros(1003, device=dev)  # in the pool, but one-shot sized: staged
        ag_out = torch.zeros(w * m_ag, device=dev)
        rs_in = torch.zeros(w * m_rs, dtype=torch.bfloat16, device=dev)
        bc = torch.zeros(n_bc, dtype=torch.int64, device=dev)
    ag_in = torch.zeros(m_ag, device=dev)
    rs_out = torch.empty(m_rs, dtype=torch.bfloat16, device=dev)
    inputs = {"ar": ar, "ar_small": ar_small, "ag": ag_in, "rs": rs_in, "bc": bc}
    expected = [
        _expect_inplace("all_reduce", 2 * n_ar, limits),
        _expect_inplace("all_reduce", 4 * 1003, limits),
        _expect_inplace("all_gather_into_tensor", 4 * w * m_ag, limits),
        _expect_inplace("reduce_scatter_tensor", 2 * w * m_rs, limits),
        _expect_inplace("broadcast", 8 * n_bc, limits),
    ]
    assert expected == [True, False, True, True, True], f"sizes chosen for a different configuration: {expected} (limits {limits})"

    def collectives() -> None:
        dist.all_reduce(ar, group=g)
        dist.all_reduce(ar_small, group=g)
        dist.all_gather_into_tensor(ag_out, ag_in, group=g)
        dist.reduce_scatter_tensor(rs_out, rs_in, op=dist.ReduceOp.SUM, group=g)
        dist.broadcast(bc, src=w - 1, group=g)

    refill(inputs, seed, ctx.rank, "pool graph", -1)
    warm_up_aside(collectives)
    graph = capture(collectives)

    before = _counts(g)
    for i in range(replays):
        fresh = refill(inputs, seed, ctx.rank, "pool graph", i)
        graph.replay()
        what = f"pool graph replay {i}"
        ref = fresh["ar"].clone()
        ref_call(dist.all_reduce, ref, group=ctx.nccl)
        check_vs_nccl(ar, ref, "SUM", f"{what}: in-place all_reduce bfloat16[{n_ar}]", w)
        ref = fresh["ar_small"].clone()
        ref_call(dist.all_reduce, ref, group=ctx.nccl)
        check_vs_nccl(ar_small, ref, "SUM", f"{what}: one-shot all_reduce float32[1003] from the pool", w)
        ref = torch.empty_like(ag_out)
        ref_call(dist.all_gather_into_tensor, ref, fresh["ag"], group=ctx.nccl)
        assert_equal(ag_out, ref, f"{what}: in-place all_gather_into_tensor")
        ref = torch.empty_like(rs_out)
        ref_call(dist.reduce_scatter_tensor, ref, fresh["rs"], group=ctx.nccl)
        check_vs_nccl(rs_out, ref, "SUM", f"{what}: in-place reduce_scatter_tensor", w)
        assert_equal(rs_in, fresh["rs"], f"{what}: reduce_scatter input changed")
        ref = fresh["bc"].clone()
        ref_call(dist.broadcast, ref, src=w - 1, group=ctx.nccl)
        assert_equal(bc, ref, f"{what}: in-place broadcast")
    torch.cuda.synchronize()
    after = _counts(g)
    n_in, b_in, n_st, b_st = (a - b for a, b in zip(after, before, strict=True))
    want_in = 4 * replays
    want_b_in = replays * (2 * n_ar + 4 * w * m_ag + 2 * w * m_rs + 8 * n_bc)
    assert (n_in, b_in) == (want_in, want_b_in), (
        f"{replays} replays of a graph with 4 in-place collectives: the in-place counters moved by +{n_in} "
        f"(+{b_in} bytes); expected +{want_in} (+{want_b_in})"
    )
    # Not asserted: the staged figures are (collectives launched, counted by the host) minus
    # (in place, counted by the kernels), and the host does not see graph replays. The
    # contract ("every collective counts as one or the other") would give +{replays} here.
    return {"inplace": n_in, "staged": n_st, "staged_bytes": b_st, "staged_expected_by_contract": replays}


def test_inplace_under_cuda_graph(pool_gpus, seed, capsys):
    res = pool_gpus.run(body_inplace_graph, seed, 20, timeout=120)
    with capsys.disabled():
        print(f"\nCUDA graph, 20 replays of 4 in-place + 1 staged collectives: counter deltas per rank {res}")


# -- (b) unequal offsets, (c) pool and regular tensors mixed --------------------------------

PAD = 4 * MiB
# Tests that allocate differently on different ranks do it in this group's pool, not the
# world group's: torch's caching allocator keeps the blocks it got, so a rank-dependent
# history would leave later world-pool buffers at offsets that differ between ranks, and
# the later tests' in-place expectations (FSDP2, tensor parallel) would not hold.
ASYM_OPTIONS = {"cuda_pool_bytes": "512MiB"}
SOME_CASES = [(torch.float32, "SUM"), (torch.bfloat16, "SUM"), (torch.int64, "MAX")]


def _cases(world: int, sizes: list) -> list[tuple]:
    out = []
    for kind in KINDS:
        for dtype, op in SOME_CASES:
            for size in sizes:
                out.append((kind, dtype, op if kind in REDUCING else "COPY", size, len(out) % world))
    return out


def _slices_of(base: torch.Tensor, offset: int):
    """Buffers `base[offset:]` viewed as the dtype asked for (`base`: uint8)."""
    return lambda n, dtype: base[offset : offset + n * dtype.itemsize].view(dtype)


def body_unequal_offsets(ctx, seed: int) -> dict:
    g, pool = dist.group.WORLD, rsccl.mem_pool()
    w, me = ctx.world, ctx.rank
    limits = _limits(w, POOL_OPTIONS)
    cases = _cases(w, _sizes(w))

    # 1. Buffers in the pool at offsets that differ by construction: one pool allocation of
    #    the same size on every rank, and rank r's buffers start r x 4 MiB into it. Staged.
    counter = _Counter(g)
    largest = max(_elements(k, d.itemsize, s, w)[0] * d.itemsize for k, d, _, s, _ in cases)
    arena = _pool_empty(pool, (w - 1) * PAD + largest, torch.uint8)
    place = _slices_of(arena, me * PAD)
    for case in cases:
        _run_case(ctx, seed, g, counter, case, place, "staged", limits, f"pool, rank r's buffer r x {PAD >> 20} MiB further in")
    torch.cuda.synchronize()
    counter.check()
    del place, arena
    arena_counts = counter.summary()

    # 2. As an application gets them: rank r first allocates a pad of r x 4 MiB from the
    #    pool, then each buffer (in a group of its own, see ASYM_OPTIONS). Where the buffers
    #    land depends on torch's caching allocator (how it splits and reuses the blocks it
    #    holds): every result must be right, and each call counted once, in place or staged.
    g = _pool_group(ctx, "asymmetric", ASYM_OPTIONS)
    pool = rsccl.mem_pool(g)
    counter = _Counter(g)
    pad = _pool_empty(pool, me * PAD, torch.uint8)
    for case in cases:
        _run_case(ctx, seed, g, counter, case, _in_pool(pool), "either", limits, f"pool, after a {me * PAD >> 20} MiB pad on rank {me}")
    torch.cuda.synchronize()
    counter.check()
    del pad
    return {"arena": arena_counts, "pads": counter.summary()}


def test_unequal_offsets_are_staged(pool_gpus, seed):
    res = pool_gpus.run(body_unequal_offsets, seed, timeout=300)
    for rank, r in enumerate(res):
        assert r["arena"]["inplace"] == 0 and r["arena"]["staged"] == r["arena"]["calls"], f"rank {rank}: {r}"


def body_mixed(ctx, seed: int) -> dict:
    """A pool tensor on some ranks, a regular tensor on others (and on none): staged, right.
    In the pool of a group of its own (see ASYM_OPTIONS)."""
    g = _pool_group(ctx, "asymmetric", ASYM_OPTIONS)
    pool = rsccl.mem_pool(g)
    w, me = ctx.world, ctx.rank
    limits = _limits(w, ASYM_OPTIONS)
    counter = _Counter(g)
    cases = _cases(w, _sizes(w)[1:])
    for regular_ranks, label in (
        ({0}, "rank 0 regular, the others pool"),
        ({w - 1}, f"rank {w - 1} regular, the others pool"),
        (set(range(w)), "no rank in the pool"),
    ):
        place = _regular if me in regular_ranks else _in_pool(pool)
        for case in cases:
            _run_case(ctx, seed, g, counter, case, place, "staged", limits, label)
    torch.cuda.synchronize()
    counter.check()
    return counter.summary()


def test_pool_and_regular_tensors_mixed_are_staged(pool_gpus, seed):
    for rank, r in enumerate(pool_gpus.run(body_mixed, seed, timeout=300)):
        assert r["inplace"] == 0 and r["staged"] == r["calls"] > 0, f"rank {rank}: {r}"


# -- (d) allocation: capacity, OutOfMemoryError, counters, device memory ---------------------

SMALL_POOL = {"cuda_pool_bytes": "256MiB"}
SMALL_POOL_BYTES = 256 * MiB
CHUNK = 16 * MiB  # >= 10 MiB and a multiple of 2 MiB: torch asks its pool for exactly this


def _pool_figures(g) -> tuple[int, int, int]:
    s = rsccl.memory_stats(g)
    return _stat(s, "cuda_pool_bytes"), _stat(s, "cuda_pool_allocated_bytes"), _stat(s, "cuda_pool_peak_bytes")


def _chunk(pool) -> torch.Tensor:
    return _pool_empty(pool, CHUNK // 4, torch.float32)


def _check_inplace_all_reduce(ctx, seed: int, g, t: torch.Tensor, what: str) -> None:
    x = rand(seed, ctx.rank, t.numel(), t.dtype, salt=what)
    t.copy_(x)
    counter = _Counter(g)
    got = counter.run(what, True, t.numel() * t.element_size(), lambda: (dist.all_reduce(t, group=g), _take(t))[1])
    check_reduction(got, gather_inputs(ctx, x), "SUM", what)
    counter.check()


def body_pool_exhaustion(ctx, seed: int) -> dict:
    """A fresh group with a 256 MiB pool (its own, so that earlier tests' cached blocks do
    not matter): allocating from it leaves the device's free memory unchanged (the pool is
    mapped at creation) and moves cuda_pool_allocated_bytes/peak; past its capacity torch
    raises OutOfMemoryError; after freeing, the pool hands memory out again and in-place
    collectives on it are right; then the group is destroyed with its pool."""
    g = dist.new_group(backend="rsccl", pg_options=rsccl.Options(**SMALL_POOL))
    pool = rsccl.mem_pool(g)
    assert rsccl.mem_pool(g) is pool
    assert rsccl.mem_pool() is not pool, "the new group must have its own pool, not the world group's"
    cap, allocated, peak = _pool_figures(g)
    assert (cap, allocated, peak) == (SMALL_POOL_BYTES, 0, 0), (
        f"a new group with cuda_pool_bytes=256MiB: capacity, allocated, peak = {cap, allocated, peak}"
    )

    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    held = []
    steps = []
    for k in range(1, 5):
        held.append(_chunk(pool))
        _, allocated, peak = _pool_figures(g)
        steps.append(allocated)
        # torch asks its MemPool's allocator for 16 MiB segments; rsccl may round each up a little.
        assert k * CHUNK <= allocated <= k * (CHUNK + 2 * MiB) and peak == allocated, (
            f"after {k} x 16 MiB: allocated {allocated}, peak {peak}"
        )
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    assert free1 == free0, (
        f"allocating 64 MiB from the pool changed the device's free memory by {(free1 - free0) / MiB:+.1f} MiB (it is mapped at creation)"
    )
    _check_inplace_all_reduce(ctx, seed, g, held[1], "all_reduce float32 16 MiB in a 256 MiB pool")

    oom = None
    for _ in range(SMALL_POOL_BYTES // CHUNK + 2):
        try:
            held.append(_chunk(pool))
        except torch.OutOfMemoryError as e:
            oom = str(e)
            break
    full = len(held)
    assert oom is not None, f"{full} x 16 MiB allocated from a 256 MiB pool without torch.OutOfMemoryError"
    assert SMALL_POOL_BYTES // CHUNK - 1 <= full <= SMALL_POOL_BYTES // CHUNK, (
        f"the 256 MiB pool held {full} x 16 MiB before OutOfMemoryError"
    )
    _, allocated_full, peak_full = _pool_figures(g)
    assert full * CHUNK <= allocated_full <= SMALL_POOL_BYTES and peak_full == allocated_full, (
        f"full: allocated {allocated_full}, peak {peak_full}"
    )
    # The group still works after the failed allocation.
    _check_inplace_all_reduce(ctx, seed, g, held[-1], "all_reduce in a full pool, after OutOfMemoryError")
    # FSDP2's path (allocate_tensor) does not fail on a full pool: it warns once and falls
    # back to torch's allocator; a collective on that tensor is staged and right.
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spill = g.allocate_tensor(CHUNK // 4, dtype=torch.float32, device=ctx.device)
        spill2 = g.allocate_tensor(CHUNK // 4, dtype=torch.float32, device=ctx.device)
    full_warnings = [w for w in caught if "pool" in str(w.message) and "full" in str(w.message)]
    assert len(full_warnings) == 1, (
        f"allocate_tensor on a full pool: expected one 'pool is full' warning, got {[str(w.message) for w in caught]}"
    )
    stats = rsccl.memory_stats(g)
    assert _stat(stats, "cuda_pool_allocated_bytes") == allocated_full, "the fallback must not take pool memory"
    x = rand(seed, ctx.rank, spill.numel(), spill.dtype, salt="spill")
    spill.copy_(x)
    counter = _Counter(g)
    got = counter.run(
        "all_reduce on allocate_tensor's fallback tensor",
        False,
        spill.numel() * 4,
        functools.partial(_all_reduce_and_take, spill, g),
    )
    check_reduction(got, gather_inputs(ctx, x), "SUM", "all_reduce on allocate_tensor's fallback tensor")
    counter.check()
    del spill, spill2

    # Freed tensors go back to torch's MemPool (which keeps the blocks, so rsccl's
    # allocated figure need not fall); the same sizes are handed out again.
    del held
    gc.collect()
    _, allocated_freed, _ = _pool_figures(g)
    held = [_chunk(pool) for _ in range(full)]
    _check_inplace_all_reduce(ctx, seed, g, held[0], "all_reduce in the pool after freeing and reallocating it")
    _, allocated_again, peak_again = _pool_figures(g)
    assert allocated_again <= allocated_full and peak_again == peak_full, (
        f"after freeing and reallocating: allocated {allocated_again}, peak {peak_again} (full: {allocated_full})"
    )

    # The world group's pool is separate and untouched by this one being full.
    _check_inplace_all_reduce(
        ctx, seed, dist.group.WORLD, _chunk(rsccl.mem_pool()), "all_reduce in the world pool while the small one is full"
    )

    # Tear down: tensors, the pool, then the group (and every Python reference to it, so that
    # whatever the last reference's release does happens here, inside this test).
    del held, pool
    gc.collect()
    torch.cuda.synchronize()
    dist.destroy_process_group(g)
    del g
    gc.collect()
    torch.cuda.synchronize()
    return {
        "steps": steps,
        "full_chunks": full,
        "allocated_full": allocated_full,
        "allocated_after_free": allocated_freed,
        "oom": oom[:200],
    }


def test_pool_exhaustion_and_accounting(pool_gpus, seed):
    needs_own_gpus(pool_gpus.world)  # reads the device's free memory, which sharing ranks move
    res = pool_gpus.run(body_pool_exhaustion, seed, timeout=120)
    assert len({r["full_chunks"] for r in res}) == 1, (
        f"ranks held different numbers of chunks before OutOfMemoryError: {[r['full_chunks'] for r in res]}"
    )


# -- (e) FSDP2 --------------------------------------------------------------------------------

FSDP_STEPS = 50
FSDP_DIM, FSDP_LAYERS, FSDP_HEADS = 1024, 4, 8
FSDP_BATCH, FSDP_SEQ = 4, 512
FSDP_LR = 1e-4
LOSS_RTOL, LOSS_ATOL = 2e-2, 1e-3  # a few bfloat16 ulps (2**-8 relative)


class _Block(nn.Module):
    """Pre-norm transformer block; attention written out (deterministic kernels only)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax((q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class _Transformer(nn.Module):
    def __init__(self, d: int, layers: int, heads: int):
        super().__init__()
        self.layers = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _train(ctx, model: nn.Module, seed: int, steps: int) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=FSDP_LR)
    shape = (FSDP_BATCH, FSDP_SEQ, FSDP_DIM)
    n = FSDP_BATCH * FSDP_SEQ * FSDP_DIM
    losses, times = [], []
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    for i in range(steps):
        x = rand(seed, ctx.rank, n, torch.float32, salt=f"fsdp x {i}").view(shape)
        y = rand(seed, ctx.rank, n, torch.float32, salt=f"fsdp y {i}").view(shape)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronizes
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    warm = times[5:] if len(times) > 10 else times
    return {"losses": losses, "peak_reserved_mib": torch.cuda.max_memory_reserved() / MiB, "step_ms": 1e3 * sum(warm) / len(warm)}


def body_fsdp2(ctx, seed: int, steps: int, comms: str) -> dict:
    import rsccl.fsdp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)  # the same initial model on every rank, built on the CPU
    base = _Transformer(FSDP_DIM, FSDP_LAYERS, FSDP_HEADS)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = {}
    for name, group in (("rsccl", dist.group.WORLD), ("nccl", ctx.nccl)):
        model = copy.deepcopy(base).to(ctx.device)
        mesh = DeviceMesh.from_group(group, "cuda")
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if name == "rsccl":
            rsccl.fsdp.use_pool(model, group, comms)
        before = _counts()
        runs[name] = _train(ctx, model, seed, steps)
        after = _counts()
        runs[name]["rsccl_counters"] = dict(zip(COUNTERS, (a - b for a, b in zip(after, before, strict=True)), strict=True))
        del model
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    runs["pool_peak_mib"] = _stat(rsccl.memory_stats(), "cuda_pool_peak_bytes") / MiB

    ours, theirs = runs["rsccl"]["losses"], runs["nccl"]["losses"]
    assert all(math.isfinite(v) for v in ours + theirs), f"non-finite losses: rsccl {ours}, NCCL {theirs}"
    bad = [(i, a, b) for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if not abs(a - b) <= LOSS_RTOL * abs(b) + LOSS_ATOL]
    assert not bad, (
        f"rank {ctx.rank}: FSDP2 losses over rsccl and NCCL differ at {len(bad)} of {steps} steps (step, rsccl, NCCL): {bad[:10]}"
    )
    runs["max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))
    c = runs["rsccl"]["rsccl_counters"]
    assert c["cuda_inplace_collectives"] > 0, f"FSDP2 with rsccl.fsdp.use_pool(comms={comms!r}): no collective ran in place: {c}"
    return runs


@pytest.mark.parametrize("comms", ["all_gather", "both"])
def test_fsdp2_allocates_from_the_pool(pool_gpus, seed, capsys, comms):
    needs_own_gpus(pool_gpus.world)  # compared with FSDP2 over NCCL
    res = pool_gpus.run(body_fsdp2, seed, FSDP_STEPS, comms, timeout=300)
    with capsys.disabled():
        print(
            f"\nFSDP2 (use_pool comms={comms}), {FSDP_LAYERS} layers d={FSDP_DIM}, bf16 params / fp32 reduce, "
            f"{FSDP_STEPS} steps, world {pool_gpus.world}:"
        )
        for rank, r in enumerate(res):
            c = r["rsccl"]["rsccl_counters"]
            print(
                f"  rank {rank}: rsccl {r['rsccl']['step_ms']:.1f} ms/step, peak reserved {r['rsccl']['peak_reserved_mib']:.0f} MiB "
                f"(pool peak {r['pool_peak_mib']:.0f} MiB), in place {c['cuda_inplace_collectives']} / staged {c['cuda_staged_collectives']} | "
                f"NCCL {r['nccl']['step_ms']:.1f} ms/step, peak reserved {r['nccl']['peak_reserved_mib']:.0f} MiB | "
                f"loss {r['rsccl']['losses'][0]:.4f} -> {r['rsccl']['losses'][-1]:.4f}, max rel diff {r['max_rel_diff']:.1e}"
            )


# -- (f) tensor-parallel MLP, Megatron style ---------------------------------------------------

TP_TOKENS, TP_DIM, TP_FFN = 4096, 4096, 16384
TP_STEPS = 8


def _comm_buffer(pool, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A buffer for an all_reduce: from the pool (rsccl), or torch's allocator (pool None)."""
    if pool is None:
        return torch.empty(shape, dtype=dtype, device="cuda")
    with torch.cuda.use_mem_pool(pool):  # also in backward, on autograd's thread
        return torch.empty(shape, dtype=dtype, device="cuda")


class _ColumnParallelLinear(torch.autograd.Function):
    """y = x @ w.T with w split by output rows; x is replicated, so backward all-reduces
    x's gradient (Megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(fctx, x, w, group, pool, reduce):
        fctx.save_for_backward(x, w)
        fctx.group, fctx.pool, fctx.reduce = group, pool, reduce
        return x @ w.t()

    @staticmethod
    def backward(fctx, grad_out):
        x, w = fctx.saved_tensors
        grad_x = _comm_buffer(fctx.pool, (grad_out.shape[0], w.shape[1]), grad_out.dtype)
        torch.matmul(grad_out, w, out=grad_x)  # written straight into the all_reduce buffer
        if fctx.reduce:
            dist.all_reduce(grad_x, group=fctx.group)
        return grad_x, grad_out.t() @ x, None, None, None


class _RowParallelLinear(torch.autograd.Function):
    """y = all_reduce(h @ w.T) with w split by input columns (Megatron's
    reduce_from_tensor_model_parallel_region); backward needs no collective."""

    @staticmethod
    def forward(fctx, h, w, group, pool, reduce):
        fctx.save_for_backward(h, w)
        y = _comm_buffer(pool, (h.shape[0], w.shape[0]), h.dtype)
        torch.matmul(h, w.t(), out=y)
        if reduce:
            dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(fctx, grad_y):
        h, w = fctx.saved_tensors
        return grad_y @ w, grad_y.t() @ h, None, None, None


def _tp_step(x, w1, w2, grad_y, group, pool, reduce: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w1.grad = w2.grad = None
    xx = x.detach().requires_grad_(True)
    a = _ColumnParallelLinear.apply(xx, w1, group, pool, reduce)
    y = _RowParallelLinear.apply(F.gelu(a), w2, group, pool, reduce)
    y.backward(grad_y)
    return y.detach(), xx.grad


def body_tp_mlp(ctx, seed: int, steps: int) -> dict:
    w, me, dev = ctx.world, ctx.rank, ctx.device
    assert TP_FFN % w == 0
    g, pool = dist.group.WORLD, rsccl.mem_pool()
    gen = torch.Generator(device=dev).manual_seed(seed)  # the same full tensors on every rank
    x = torch.randn(TP_TOKENS, TP_DIM, generator=gen, device=dev).to(torch.bfloat16)
    grad_y = torch.randn(TP_TOKENS, TP_DIM, generator=gen, device=dev).to(torch.bfloat16)
    w1_full = torch.randn(TP_FFN, TP_DIM, generator=gen, device=dev) / math.sqrt(TP_DIM)
    w2_full = torch.randn(TP_DIM, TP_FFN, generator=gen, device=dev) / math.sqrt(TP_FFN)
    w1 = w1_full.chunk(w, 0)[me].to(torch.bfloat16).requires_grad_(True)
    w2 = w2_full.chunk(w, 1)[me].to(torch.bfloat16).contiguous().requires_grad_(True)
    del w1_full, w2_full

    # The same step over NCCL (regular buffers) and over rsccl (buffers from the pool).
    y_n, gx_n = _tp_step(x, w1, w2, grad_y, ctx.nccl, None, True)
    gw1_n, gw2_n = w1.grad.clone(), w2.grad.clone()
    before = _counts(g)
    y_r, gx_r = _tp_step(x, w1, w2, grad_y, g, pool, True)
    after = _counts(g)
    what = f"tensor-parallel MLP {TP_TOKENS}x{TP_DIM}, ffn {TP_FFN}/{w}"
    check_vs_nccl(y_r, y_n, "SUM", f"{what}: output (forward all_reduce)", w)
    check_vs_nccl(gx_r, gx_n, "SUM", f"{what}: input gradient (backward all_reduce)", w)
    torch.testing.assert_close(w1.grad, gw1_n, msg=lambda m: f"{what}: column-parallel weight gradient: {m}")
    torch.testing.assert_close(w2.grad, gw2_n, msg=lambda m: f"{what}: row-parallel weight gradient: {m}")
    assert_identical_across_ranks(ctx, y_r, f"{what}: output")
    assert_identical_across_ranks(ctx, gx_r, f"{what}: input gradient")
    n_in, b_in, n_st, b_st = (a - b for a, b in zip(after, before, strict=True))
    msg = TP_TOKENS * TP_DIM * 2
    # 32 MiB messages: in place at every world under the contract (_expect_inplace).
    inplace = _expect_inplace("all_reduce", msg, _limits(w, {}))
    assert inplace, f"{what}: {msg}-byte all_reduces would be staged at world {w}: the test no longer covers the in-place path"
    assert (n_in, b_in, n_st) == (2, 2 * msg, 0), (
        f"{what}: one step's two all_reduces ({msg} bytes each, in the pool) moved the counters by in place +{n_in} (+{b_in} bytes), staged +{n_st} (+{b_st} bytes)"
    )
    del y_n, gx_n, y_r, gx_r, gw1_n, gw2_n
    _tp_step(x, w1, w2, grad_y, g, pool, False)  # and the variant without collectives, once

    def peak(group, pool_, reduce: bool) -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            y, gx = _tp_step(x, w1, w2, grad_y, group, pool_, reduce)
        torch.cuda.synchronize()
        del y, gx
        return torch.cuda.max_memory_reserved()

    peaks = {"none": peak(g, pool, False)}
    before = _counts(g)
    peaks["rsccl"] = peak(g, pool, True)
    after = _counts(g)
    peaks["nccl"] = peak(ctx.nccl, None, True)
    n_in, n_st = after[0] - before[0], after[2] - before[2]
    assert (n_in, n_st) == (2 * steps, 0), f"{steps} steps: {n_in} all_reduces in place, {n_st} staged; expected {2 * steps} in place"
    assert peaks["rsccl"] <= peaks["none"], (
        f"peak reserved memory (MiB) of {steps} tensor-parallel steps: with rsccl's all_reduce (pool buffers) {peaks['rsccl'] >> 20}, "
        f"the same loop without the all_reduces {peaks['none'] >> 20}"
    )
    return {k: v >> 20 for k, v in peaks.items()}


def test_tensor_parallel_mlp(pool_gpus, seed, capsys):
    needs_own_gpus(pool_gpus.world)  # compared with the same step over NCCL
    res = pool_gpus.run(body_tp_mlp, seed, TP_STEPS, timeout=240)
    with capsys.disabled():
        print(
            f"\ntensor-parallel MLP, peak reserved MiB per rank (no all_reduce / rsccl pool / NCCL): {[(r['none'], r['rsccl'], r['nccl']) for r in res]}"
        )
