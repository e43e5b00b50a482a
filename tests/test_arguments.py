"""A bad argument is rejected before anything is exchanged: the rank that passed it raises
ValueError or TypeError naming the argument, the other ranks raise the same error through
the agreement step, and the group stays usable (a checked all_reduce follows every case).

Table-driven: each case is a call with a good and a bad form; it runs with the bad form on
one rank (the others pass the good one) and on every rank. CPU tensors here; the CUDA
table is in tests/gpu/test_gpu_arguments.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from refs import assert_close, make, reduce_ref

WORLD = 3


def _a2a_single(splits_in, splits_out=None):
    def call(r):
        dist.all_to_all_single(torch.empty(6), torch.arange(6, dtype=torch.float32), splits_out or [2, 2, 2], splits_in)

    return call


def _a2a_list(dtypes):
    # On the group directly: dist.all_to_all checks dtypes itself, on the calling rank
    # only, before any backend sees the call (docs/errors.md).
    def call(r):
        ins = [torch.full((2,), float(r), dtype=d) for d in dtypes]
        outs = [torch.empty(2, dtype=d) for d in dtypes]
        dist.group.WORLD.alltoall(outs, ins, dist.AllToAllOptions()).wait()

    return call


def _opts_call(method, opts_cls, tensors_of, **fields):
    """Call the group's method directly with options torch would not build itself (negative
    roots pass torch's checks only this way on some paths)."""

    def call(r):
        opts = opts_cls()
        for k, v in fields.items():
            setattr(opts, k, v)
        getattr(dist.group.WORLD, method)(*tensors_of(r), opts).wait()

    return call


def _bad_root(good, method, opts_cls, tensors_of, root):
    """A rooted collective's case: `good`, against the group's `method` with root `root`,
    out of range (negative roots pass torch's checks only through the options)."""
    bad = _opts_call(method, opts_cls, tensors_of, rootRank=root)
    return (good, bad, "ValueError", [f"{method}: root/src rank {root} is out of range for a group of size {WORLD}"])


_ONE = lambda r: ([torch.ones(4)],)  # one tensor, as broadcast and reduce take it

# case -> (good call, bad call, exception class, fragments every rank's message contains)
CASES = {
    "broadcast_negative_src": _bad_root(lambda r: dist.broadcast(torch.ones(4), src=0), "broadcast", dist.BroadcastOptions, _ONE, -1),
    "broadcast_src_too_large": _bad_root(lambda r: dist.broadcast(torch.ones(4), src=0), "broadcast", dist.BroadcastOptions, _ONE, 3),
    "reduce_negative_dst": _bad_root(lambda r: dist.reduce(torch.ones(4), dst=0), "reduce", dist.ReduceOptions, _ONE, -2),
    "gather_negative_dst": _bad_root(
        _opts_call(
            "gather",
            dist.GatherOptions,
            lambda r: ([[torch.empty(2) for _ in range(WORLD)]] if r == 0 else [], [torch.ones(2)]),
            rootRank=0,
        ),
        "gather",
        dist.GatherOptions,
        lambda r: ([], [torch.ones(2)]),
        -1,
    ),
    "scatter_negative_src": _bad_root(
        _opts_call(
            "scatter",
            dist.ScatterOptions,
            lambda r: ([torch.empty(2)], [[torch.ones(2) for _ in range(WORLD)]] if r == 0 else []),
            rootRank=0,
        ),
        "scatter",
        dist.ScatterOptions,
        lambda r: ([torch.empty(2)], []),
        -1,
    ),
    "a2a_float_splits": (
        _a2a_single([2, 2, 2]),
        _a2a_single([2.0, 2.0, 2.0]),
        "TypeError",
        ["all_to_all: input split sizes [2.0, 2.0, 2.0] must be integers"],
    ),
    "a2a_negative_split": (
        _a2a_single([2, 2, 2]),
        _a2a_single([4, -2, 4]),
        "ValueError",
        ["all_to_all: input split sizes [4, -2, 4] do not divide its 6 rows among 3 ranks"],
    ),
    "a2a_split_count": (
        _a2a_single([2, 2, 2]),
        _a2a_single([3, 3]),
        "ValueError",
        ["all_to_all: input split sizes [3, 3] do not divide its 6 rows among 3 ranks"],
    ),
    "a2a_list_mixed_dtypes": (
        _a2a_list([torch.float32] * 3),
        _a2a_list([torch.float32, torch.float64, torch.float32]),
        "TypeError",
        ["all_to_all: tensors must share one dtype"],
    ),
    "all_reduce_non_tensor": (
        lambda r: dist.group.WORLD.allreduce([torch.ones(5)]).wait(),
        lambda r: dist.group.WORLD.allreduce([[1.0, 2.0]]).wait(),
        "TypeError",
        ["all_reduce must be a torch.Tensor, got list"],
    ),
    "all_reduce_two_tensors": (
        lambda r: dist.group.WORLD.allreduce([torch.ones(5)]).wait(),
        lambda r: dist.group.WORLD.allreduce([torch.ones(5), torch.ones(5)]).wait(),
        "ValueError",
        ["all_reduce takes exactly one tensor per rank, got 2"],
    ),
    "all_gather_non_tensor_output": (
        lambda r: dist.all_gather([torch.empty(2) for _ in range(WORLD)], torch.ones(2)),
        lambda r: dist.group.WORLD.allgather([[torch.empty(2), 7, torch.empty(2)]], [torch.ones(2)]).wait(),
        "TypeError",
        ["all_gather tensor_list must be a torch.Tensor, got int"],
    ),
    "all_reduce_bitwise_op_on_floats": (
        lambda r: dist.all_reduce(torch.ones(4, dtype=torch.int64), op=dist.ReduceOp.BAND),
        lambda r: dist.all_reduce(torch.ones(4, dtype=torch.float64), op=dist.ReduceOp.BAND),
        "TypeError",
        ["ReduceOp.BAND is not defined on dtype float64"],
    ),
    "all_reduce_unsupported_dtype": (
        lambda r: dist.all_reduce(torch.ones(4)),
        lambda r: dist.all_reduce(torch.ones(4, dtype=torch.uint16)),
        "TypeError",
        ["uint16"],
    ),
    "all_gather_output_size": (
        lambda r: dist.all_gather_into_tensor(torch.empty(3 * 4), torch.ones(4)),
        lambda r: dist.all_gather_into_tensor(torch.empty(3 * 4 + 1), torch.ones(4)),
        "ValueError",
        ["all_gather: output has 13 elements, expected group size 3 x input 4 = 12"],
    ),
    "reduce_scatter_dtype": (
        lambda r: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(6)),
        lambda r: dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.float64), torch.ones(6)),
        "TypeError",
        ["reduce_scatter: output dtype torch.float64 differs from input dtype torch.float32"],
    ),
    "sparse_broadcast": (
        lambda r: dist.broadcast(torch.ones(4), src=0),
        lambda r: dist.group.WORLD.broadcast([torch.ones(4).to_sparse()], dist.BroadcastOptions()).wait(),
        "TypeError",
        ["broadcast has layout torch.sparse_coo"],
    ),
}


def body_argument(ctx, case: str, bad_ranks: list[int]) -> tuple[str, str]:
    good, bad, _, _ = CASES[case]
    r = ctx.rank
    try:
        (bad if r in bad_ranks else good)(r)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        result = (type(e).__name__, str(e))
    else:
        result = ("no error", "")
    # The group is still in step and usable.
    x = make(11, r, 257, torch.float32)
    dist.all_reduce(x)
    assert_close(x, reduce_ref([make(11, q, 257, torch.float32) for q in range(ctx.world)], "SUM"), f"after {case}", 3)
    return result


@pytest.fixture(scope="module")
def trio():
    from harness import Cluster

    c = Cluster(WORLD, init_timeout=5.0)
    yield c
    assert c.close() == [0] * WORLD


@pytest.mark.parametrize("where", ["one_rank", "all_ranks"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_argument_is_named_on_every_rank(trio, case, where, seed):
    bad_rank = seed % WORLD
    bad_ranks = [bad_rank] if where == "one_rank" else list(range(WORLD))
    _, _, kind, fragments = CASES[case]
    results = trio.run(body_argument, case, bad_ranks, timeout=60)
    for rank, (got_kind, msg) in enumerate(results):
        assert got_kind == kind, f"{case} on {bad_ranks}: rank {rank} raised {got_kind}: {msg}"
        for f in fragments:
            assert f in msg, f"{case} on {bad_ranks}: rank {rank}'s message lacks {f!r}: {msg}"
        # Every rank names a rank that passed the bad argument.
        assert any(f"rank {b}" in msg for b in bad_ranks), f"{case}: rank {rank}'s message names none of {bad_ranks}: {msg}"
    assert len({m for _, m in results}) == 1, f"{case}: ranks raised different messages: {results}"


# send/recv: (sender, receiver, sender's call, receiver's call, fragment both messages hold).
# Each case has its own ordered pair: an error ends that pair's channel (docs/errors.md).
P2P_CASES = {
    "negative_tag_on_send": (
        0,
        1,
        lambda: dist.send(torch.ones(8), dst=1, tag=-1),
        lambda: dist.recv(torch.empty(8), src=0, tag=0),
        "rank 0 posted a send to rank 1 with tag -1, out of range",
    ),
    "tag_2_31_on_recv": (
        1,
        2,
        lambda: dist.send(torch.ones(8), dst=2, tag=5),
        lambda: dist.recv(torch.empty(8), src=1, tag=2**31),
        "rank 2 posted a recv from rank 1 with tag 2147483648, out of range",
    ),
    "tag_past_64_bits": (
        0,
        2,
        lambda: dist.send(torch.ones(8), dst=2, tag=2**70),
        lambda: dist.recv(torch.empty(8), src=0, tag=2**70),
        "with tag 9223372036854775807, out of range",
    ),
    "dtype_mismatch": (
        2,
        0,
        lambda: dist.send(torch.ones(8), dst=0, tag=3),
        lambda: dist.recv(torch.empty(8, dtype=torch.int32), src=2, tag=3),
        "rank 0 posted a recv of 8 int32 elements from rank 2 (tag 3), but rank 2 sent 8 float32 elements",
    ),
    "count_mismatch": (
        1,
        0,
        lambda: dist.send(torch.ones(8), dst=0, tag=4),
        lambda: dist.recv(torch.empty(6), src=1, tag=4),
        "rank 0 posted a recv of 6 float32 elements from rank 1 (tag 4), but rank 1 sent 8 float32 elements",
    ),
}


def body_p2p_case(ctx, case: str) -> tuple[str, str]:
    src, dst, send, recv, _ = P2P_CASES[case]
    try:
        if ctx.rank == src:
            send()
        elif ctx.rank == dst:
            recv()
        else:
            return ("idle", "")
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return (type(e).__name__, str(e))
    return ("no error", "")


def body_checked_all_reduce(ctx) -> None:
    x = make(13, ctx.rank, 100, torch.float32)
    dist.all_reduce(x)
    assert_close(x, reduce_ref([make(13, q, 100, torch.float32) for q in range(ctx.world)], "SUM"), "after send/recv errors", 3)


def body_pairs_after_the_errors(ctx) -> list[tuple[str, str]]:
    """0 -> 1 was closed by the out-of-range tag; 1 -> 0 saw only a count mismatch."""
    x = make(17, ctx.rank, 8, torch.float32)
    steps = {
        0: [lambda: dist.send(x, dst=1, tag=0), lambda: dist.recv(x, src=1, tag=4)],
        1: [lambda: dist.recv(x, src=0, tag=0), lambda: dist.send(x, dst=0, tag=4)],
    }
    out = []
    for step in steps.get(ctx.rank, []):
        try:
            step()
            out.append(("no error", ""))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out.append((type(e).__name__, str(e)))
    if ctx.rank == 0:
        assert torch.equal(x, make(17, 1, 8, torch.float32)), "wrong data after a mismatch"
    return out


def test_send_recv_errors_raise_on_both_sides_naming_both():
    from harness import Cluster

    c = Cluster(WORLD, init_timeout=10.0)
    try:
        for case, (src, dst, _, _, fragment) in P2P_CASES.items():
            res = c.run(body_p2p_case, case, timeout=60)
            for r in (src, dst):
                kind, msg = res[r]
                assert kind == "ValueError", f"{case}: rank {r} raised {kind}: {msg}"
                assert fragment in msg, f"{case}: rank {r}'s message lacks {fragment!r}: {msg}"
                assert f"rank {src}" in msg and f"rank {dst}" in msg, f"{case}: rank {r}'s message does not name both ranks: {msg}"
        # A channel closed by a bad tag says so, with the cause; one after a mismatch works.
        res = c.run(body_pairs_after_the_errors, timeout=60)
        for r, what in ((0, "send to rank 1 failed"), (1, "recv from rank 0 failed")):
            kind, msg = res[r][0]
            assert kind == "ValueError", res
            assert f"{what}: the channel was closed by an earlier failure" in msg, res
            assert "rank 0 posted a send to rank 1 with tag -1, out of range" in msg, res
        assert res[0][1] == res[1][1] == ("no error", ""), res
        # Collectives are not affected.
        c.run(body_checked_all_reduce, timeout=60)
    finally:
        assert c.close() == [0] * WORLD


def body_destroy_with_pending(ctx) -> tuple[str, str]:
    w = dist.all_reduce(torch.ones(1 << 16), async_op=True)
    try:
        if ctx.rank == 0:
            dist.group.WORLD.shutdown()
        w.wait()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return (type(e).__name__, str(e))
    return ("no error", "")


def test_destroy_with_a_pending_async_op_gives_consistent_errors():
    """Rank 0 destroys the group while its async all_reduce (and the others') is pending:
    rank 0's Work fails as destroyed, every other rank's names rank 0 as gone (or, raced,
    completes if rank 0's part finished before the destroy)."""
    from harness import Cluster

    c = Cluster(WORLD, init_timeout=10.0)
    try:
        res = c.run(body_destroy_with_pending, timeout=60)
        pid0 = c.procs[0].pid
        assert res[0][0] in ("GroupAbortedError", "no error"), res
        for r in range(1, WORLD):
            kind, msg = res[r]
            if res[0][0] == "no error":
                continue
            assert kind in ("PeerFailureError", "no error"), res
            if kind == "PeerFailureError":
                assert f"rank 0 (pid {pid0})" in msg, res
    finally:
        c.kill()


def body_unforeseen(ctx, bad_rank: int) -> tuple[str, str]:
    splits = None if ctx.rank == bad_rank else [2, 2, 2]  # list(None) fails inside rsccl's preparation
    try:
        dist.group.WORLD.alltoall_base(torch.empty(6), torch.ones(6), [2, 2, 2], splits, dist.AllToAllOptions()).wait()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        result = (type(e).__name__, str(e))
    else:
        result = ("no error", "")
    body_checked_all_reduce(ctx)
    return result


def test_unforeseen_failure_while_preparing_reaches_the_peers(trio, seed):
    """An exception no check of rsccl's foresaw, raised while one rank prepares its call:
    that rank raises the original; the others raise it named through the agreement step;
    the group stays usable."""
    bad = seed % WORLD
    res = trio.run(body_unforeseen, bad, timeout=60)
    assert res[bad] == ("TypeError", "'NoneType' object is not iterable"), res
    for r in set(range(WORLD)) - {bad}:
        assert res[r][0] == "TypeError", res
        assert f"rank {bad}: all_to_all: preparing the call failed: TypeError: 'NoneType' object is not iterable" in res[r][1], res
