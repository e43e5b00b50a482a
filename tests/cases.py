"""The case registry: one entry per collective, each a function that runs the collective on
this rank's random input and checks the result against the reference of tests/refs.py. The
CPU suites (tests/test_collectives.py) and the GPU suite (tests/gpu/test_gpu_collectives.py,
test_gpu_rooted.py, test_gpu_alltoall.py) run these entries; rust/tch/tests/collectives.rs states the same
arithmetic, entry by entry, in Rust.

Every rank makes every rank's input from the test's seed (`inputs`), so each rank computes
the expected result itself: in float64 (floats) or int64 (integers, cast back with
two's-complement wrap-around), rounded once to the dtype; data movement is compared bit for
bit. An entry's docstring states the arithmetic, for `w` ranks whose inputs are x_0 ..
x_{w-1} (`n` elements each, unless it says otherwise), rank `me` and root `root`. Each
returns this rank's result, so that a test may compare it further (with gloo's, say).

A test picks the matrix (dtypes, ops, sizes, roots, and for CUDA tensors the device and the
group) and calls `CASES[name](ctx, seed, call)`. `ctx` is a harness's rank context: its
`rank`, `world` and `gather_rows` (the reference group's all_gather).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from refs import OPS, assert_close, assert_identical_across_ranks, check_reduction, make


@dataclass(frozen=True)
class Call:
    """One call of a case: the dtype, the elements per rank (all_to_all_single: per row),
    the op (reductions), the root (rooted collectives), a salt that tells this call's inputs
    from another's, for all_to_all_single the bound on the rows one rank sends another and
    the kind of splits (`split_matrix`); the device of its tensors (None: the CPU), the group
    it runs on (None: the default group), and a label for messages (the group's config, say)."""

    dtype: torch.dtype
    n: int
    op: str = "SUM"
    root: int = 0
    salt: int | str = 0
    rows: int = 50
    splits: str = "uneven"
    device: Any = None
    group: Any = None
    label: str = ""

    def what(self, name: str, ctx: Any) -> str:
        return f"{name} {self.op} {self.dtype} n={self.n} root={self.root} world={ctx.world}" + (f" {self.label}" if self.label else "")

    def output(self, *shape: int) -> torch.Tensor:
        """An output tensor, filled with 7s: an element the collective leaves unwritten shows."""
        return torch.full(shape, 7, dtype=torch.int8, device=self.device).to(self.dtype)


Case = Callable[[Any, int, Call], Any]
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__] = fn
    return fn


def my_input(seed: int, rank: int, c: Call, n: int | None = None) -> torch.Tensor:
    """Rank `rank`'s input for `c` (`n` elements, default c.n)."""
    return make(seed, rank, c.n if n is None else n, c.dtype, c.op, c.salt, c.device)


def inputs(ctx, seed: int, c: Call, n: int | None = None) -> list[torch.Tensor]:
    """Every rank's input for `c` (`n` elements each, default c.n)."""
    return [my_input(seed, r, c, n) for r in range(ctx.world)]


def cuda_roundings(ctx, group: Any, device: Any, message_bytes: int) -> int:
    """How many times a float reduction of `message_bytes` on CUDA tensors may round its
    partial sums (`refs.tolerance`): once, or once per hop where the group runs it as a ring
    (from its cuda_ring_min_bytes, memory_stats; NOTE [Ring] in csrc_kernels/ring.cuh). An
    upper bound: calls that take the ring's size but another kernel round once."""
    if device is None or torch.device(device).type != "cuda" or ctx.world < 2:
        return 1
    import rsccl

    ring_min = rsccl.memory_stats(group).get("cuda_ring_min_bytes", 0)
    return ctx.world if ring_min and message_bytes >= ring_min else 1


def my_block(t: torch.Tensor, ctx, n: int) -> torch.Tensor:
    return t[ctx.rank * n : (ctx.rank + 1) * n]


@case
def all_reduce(ctx, seed: int, c: Call) -> torch.Tensor:
    """Every rank: out = op(x_0, ..., x_{w-1}), elementwise (AVG: the SUM over w), bitwise
    identical on every rank."""
    xs = inputs(ctx, seed, c)
    out = xs[ctx.rank].clone()
    dist.all_reduce(out, op=OPS[c.op], group=c.group)
    what = c.what("all_reduce", ctx)
    check_reduction(out, xs, c.op, what, cuda_roundings(ctx, c.group, c.device, out.numel() * out.element_size()))
    assert_identical_across_ranks(ctx, out, what)
    return out


@case
def broadcast(ctx, seed: int, c: Call) -> torch.Tensor:
    """Every rank: out = x_root."""
    xs = inputs(ctx, seed, c)
    out = xs[ctx.rank].clone()
    dist.broadcast(out, src=c.root, group=c.group)
    assert_close(out, xs[c.root], c.what("broadcast", ctx))
    return out


@case
def reduce(ctx, seed: int, c: Call) -> torch.Tensor:
    """The root: out = op(x_0, ..., x_{w-1}), elementwise; the other ranks' tensors are
    theirs to reuse (not checked)."""
    xs = inputs(ctx, seed, c)
    out = xs[ctx.rank].clone()
    dist.reduce(out, dst=c.root, op=OPS[c.op], group=c.group)
    if ctx.rank == c.root:
        check_reduction(out, xs, c.op, c.what("reduce", ctx))
    return out


@case
def all_gather_into_tensor(ctx, seed: int, c: Call) -> torch.Tensor:
    """Every rank: out = concat(x_0, ..., x_{w-1}), w x n elements."""
    xs = inputs(ctx, seed, c)
    out = c.output(ctx.world * c.n)
    dist.all_gather_into_tensor(out, xs[ctx.rank], group=c.group)
    assert_close(out, torch.cat(xs), c.what("all_gather_into_tensor", ctx))
    return out


@case
def all_gather(ctx, seed: int, c: Call) -> list[torch.Tensor]:
    """Every rank: outs[r] = x_r (the list form)."""
    xs = inputs(ctx, seed, c)
    outs = [c.output(c.n) for _ in range(ctx.world)]
    dist.all_gather(outs, xs[ctx.rank], group=c.group)
    for r in range(ctx.world):
        assert_close(outs[r], xs[r], f"{c.what('all_gather (list)', ctx)} from rank {r}")
    return outs


@case
def reduce_scatter_tensor(ctx, seed: int, c: Call) -> torch.Tensor:
    """Inputs of w x n elements; rank me: out = op(x_0, ..., x_{w-1})[me*n : (me+1)*n]."""
    xs = inputs(ctx, seed, c, n=c.n * ctx.world)
    out = c.output(c.n)
    dist.reduce_scatter_tensor(out, xs[ctx.rank], op=OPS[c.op], group=c.group)
    hops = cuda_roundings(ctx, c.group, c.device, xs[ctx.rank].numel() * out.element_size())
    check_reduction(out, [my_block(x, ctx, c.n) for x in xs], c.op, c.what("reduce_scatter_tensor", ctx), hops)
    return out


@case
def reduce_scatter(ctx, seed: int, c: Call) -> torch.Tensor:
    """The list form of reduce_scatter_tensor: each rank's input is its w x n elements cut
    into w chunks; rank me: out = op over ranks of chunk me."""
    xs = inputs(ctx, seed, c, n=c.n * ctx.world)
    out = c.output(c.n)
    dist.reduce_scatter(out, list(xs[ctx.rank].chunk(ctx.world)), op=OPS[c.op], group=c.group)
    hops = cuda_roundings(ctx, c.group, c.device, xs[ctx.rank].numel() * out.element_size())
    check_reduction(out, [my_block(x, ctx, c.n) for x in xs], c.op, c.what("reduce_scatter (list)", ctx), hops)
    return out


def split_matrix(seed: int, salt: int | str, world: int, kind: str, rows: int) -> list[list[int]]:
    """send[i][j]: rows rank i sends to rank j, the same on every rank (a CPU generator seeded
    by the case). even: `rows` each; uneven: random in [0, rows], a quarter of them zeros;
    moe: every chunk small (up to 8 rows), except a few of `rows` rows (the "popular experts")."""
    rng = random.Random(f"{seed}/{salt}")
    if kind == "even":
        return [[rows] * world for _ in range(world)]
    if kind == "uneven":
        return [[0 if rng.random() < 0.25 else rng.randint(0, rows) for _ in range(world)] for _ in range(world)]
    if kind == "moe":
        send = [[rng.randint(0, 8) for _ in range(world)] for _ in range(world)]
        for _ in range(world):
            send[rng.randrange(world)][rng.randrange(world)] = rows
        return send
    raise AssertionError(kind)


def a2a_inputs(ctx, seed: int, c: Call) -> tuple[list[list[int]], list[torch.Tensor]]:
    """all_to_all_single's splits (`split_matrix` of kind c.splits, c.rows) and every rank's
    input: rank i's is sum_j send[i][j] rows of c.n elements."""
    send = split_matrix(seed, c.salt, ctx.world, c.splits, c.rows)
    return send, [make(seed, i, sum(send[i]) * c.n, c.dtype, salt=c.salt, device=c.device).view(-1, c.n) for i in range(ctx.world)]


def a2a_expected(xs: list[torch.Tensor], send: list[list[int]], me: int) -> torch.Tensor:
    """What rank `me` receives from all_to_all_single: concat over i of the send[i][me] rows of
    x_i that follow its rows for ranks < me."""
    return torch.cat([x[sum(send[i][:me]) : sum(send[i][:me]) + send[i][me]] for i, x in enumerate(xs)])


@case
def all_to_all_single(ctx, seed: int, c: Call) -> torch.Tensor:
    """Rank i sends send[i][j] rows to rank j (`split_matrix`: even, uneven with zeros, or
    MoE-like; even ones pass no split sizes), its rows for rank 0 first; rank me: out =
    concat over i of the send[i][me] rows of x_i that follow its rows for ranks < me."""
    send, xs = a2a_inputs(ctx, seed, c)
    me = ctx.rank
    in_rows, out_rows = send[me], [send[i][me] for i in range(ctx.world)]
    out = c.output(sum(out_rows), c.n)
    if c.splits == "even":
        dist.all_to_all_single(out, xs[me], group=c.group)
    else:
        dist.all_to_all_single(out, xs[me], output_split_sizes=out_rows, input_split_sizes=in_rows, group=c.group)
    assert_close(out, a2a_expected(xs, send, me), f"{c.what('all_to_all_single', ctx)} {c.splits} splits={send}")
    return out


@case
def all_to_all(ctx, seed: int, c: Call) -> list[torch.Tensor]:
    """The list form, sizes that differ per source and per destination: rank i sends
    n + 2i + j elements to rank j (x_i^j); rank me: outs[i] = x_i^me."""
    me = ctx.rank
    mine = [make(seed, me, c.n + 2 * me + j, c.dtype, salt=f"{c.salt} {j}", device=c.device) for j in range(ctx.world)]
    outs = [c.output(c.n + 2 * i + me) for i in range(ctx.world)]
    dist.all_to_all(outs, mine, group=c.group)
    for i in range(ctx.world):
        want = make(seed, i, c.n + 2 * i + me, c.dtype, salt=f"{c.salt} {me}", device=c.device)
        assert_close(outs[i], want, f"{c.what('all_to_all (list)', ctx)} from rank {i}")
    return outs


@case
def gather(ctx, seed: int, c: Call) -> list[torch.Tensor] | None:
    """The root: outs[r] = x_r; the other ranks pass no output."""
    xs = inputs(ctx, seed, c)
    outs = [c.output(c.n) for _ in range(ctx.world)] if ctx.rank == c.root else None
    dist.gather(xs[ctx.rank], outs, dst=c.root, group=c.group)
    if outs is not None:
        for r in range(ctx.world):
            assert_close(outs[r], xs[r], f"{c.what('gather', ctx)} from {r}")
    return outs


@case
def scatter(ctx, seed: int, c: Call) -> torch.Tensor:
    """The root holds w tensors s_0 .. s_{w-1} (here the inputs x_0 .. x_{w-1}, which the
    root can make); rank me: out = s_me."""
    xs = inputs(ctx, seed, c)
    out = c.output(c.n)
    dist.scatter(out, xs if ctx.rank == c.root else None, src=c.root, group=c.group)
    assert_close(out, xs[ctx.rank], c.what("scatter", ctx))
    return out


@case
def barrier(ctx, seed: int, c: Call) -> tuple[float, float]:
    """Rank r arrives 0.15 x r seconds late; no rank leaves before the last arrived. Returns
    (arrival, departure) for the test to compare across ranks (`barrier_held`)."""
    time.sleep(0.15 * ctx.rank)
    before = time.time()
    dist.barrier(group=c.group)
    return before, time.time()


def barrier_held(times: list[tuple[float, float]]) -> bool:
    """Whether every rank left the barrier after the last one arrived."""
    last_arrival = max(b for b, _ in times)
    return all(after >= last_arrival for _, after in times)


@case
def send_recv(ctx, seed: int, c: Call) -> torch.Tensor:
    """A ring (batch_isend_irecv): rank me sends x_me to me + 1 and receives x_{me-1}."""
    me, w = ctx.rank, ctx.world
    nxt, prv = (me + 1) % w, (me - 1) % w
    x = make(seed, me, c.n, c.dtype, salt=c.salt, device=c.device)
    got = c.output(c.n)
    ops = [dist.P2POp(dist.isend, x, nxt, group=c.group), dist.P2POp(dist.irecv, got, prv, group=c.group)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    assert_close(got, make(seed, prv, c.n, c.dtype, salt=c.salt, device=c.device), c.what("batch_isend_irecv ring", ctx))
    return got
