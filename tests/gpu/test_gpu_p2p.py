"""send/recv on CUDA tensors, 2 and 4 GPUs (ranks paired 0-1, 2-3): every dtype (bool, uint8,
float64 and complex included) at 0, 1 and an odd number of elements, 1 MiB and 256 MiB,
checked bit for bit against the sender's input (the receiver makes it itself from the seed);
blocking and isend/irecv, strided tensors, several messages to one peer matched in order,
both directions at once, a batch_isend_irecv ring of 64 MiB messages (which must not
deadlock), an all-pairs batch (every rank to and from every other at once) with
cuda_p2p_blocks=64, isend/irecv captured in a CUDA graph, the eager capacity (P2P_DEPTH sends
complete before their recvs are posted, the next one waits). Then, on groups of their own over ranks 0
and 1 that these tests leave unusable: a size mismatch, and a send nobody receives (and a
recv nobody sends) on a group with a 5 s timeout, which must raise a timeout and leave
nothing hanging."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from gpu_harness import capture, needs_gpus, rsccl_group, warm_up_aside
from gpu_refs import MOVE_DTYPES, Failures, rand
from refs import assert_equal

pytestmark = needs_gpus

MiB = 1 << 20


def exchange_with(peer: int, pairs: list[tuple[torch.Tensor, torch.Tensor]], group=None):
    """A call that, for each (out, into) pair, sends `out` to `peer` and receives `into` from
    it (isend, then irecv), then waits for all of them."""

    def run() -> None:
        works = []
        for out, into in pairs:
            works += [dist.isend(out, dst=peer, group=group), dist.irecv(into, src=peer, group=group)]
        for w in works:
            w.wait()

    return run


def warmed_up_graph(f: Failures, calls) -> torch.cuda.CUDAGraph | None:
    """`calls` run once aside (the warm-up), then captured; None where the warm-up failed
    (recorded in `f`)."""
    warm_up_aside(lambda: f.run("warm-up", calls))
    return None if f.items else capture(calls)


def _peer(ctx) -> int | None:
    """This rank's partner: 0-1, 2-3, ...; None for the last rank of an odd world."""
    p = ctx.rank ^ 1
    return p if p < ctx.world else None


def _counts(dtype: torch.dtype, sizes: list[int | str]) -> list[int]:
    """Element counts: ints are counts, "1MiB"-style strings are bytes."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return [s if isinstance(s, int) else (int(s.removesuffix("MiB")) * MiB) // elem for s in sizes]


def body_send_recv(ctx, seed: int, sizes: list[int | str]) -> int:
    """Blocking dist.send/dist.recv, one direction, then the other: the lower rank of the
    pair sends first, so neither waits for the other's send."""
    peer = _peer(ctx)
    if peer is None:
        return -1
    me, f, checks = ctx.rank, Failures(), 0
    for dtype in MOVE_DTYPES:
        for n in _counts(dtype, sizes):
            what = f"send/recv {dtype} n={n} pair {min(me, peer)}-{max(me, peer)}"
            for sender in sorted((me, peer)):
                salt = f"{what} from {sender}"
                if me == sender:
                    f.run(f"{what}: send", dist.send, rand(seed, me, n, dtype, salt=salt), dst=peer)
                    continue
                y = torch.zeros(n, dtype=dtype, device=ctx.device)
                failed = len(f.items)
                f.run(f"{what}: recv", dist.recv, y, src=peer)
                if len(f.items) == failed:
                    f.run(what, assert_equal, y, rand(seed, peer, n, dtype, salt=salt), f"{what} from rank {peer}")
                    checks += 1
                del y
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    f.done()
    return checks


# 0 elements, 1, odd; 1 MiB and 256 MiB in bytes of each dtype.
SIZES: list[int | str] = [0, 1, 100_003, "1MiB", "256MiB"]


def test_send_recv_every_dtype_and_size(gpus, seed):
    checks = gpus.run(body_send_recv, seed, SIZES, timeout=300)
    assert all(c in (-1, len(MOVE_DTYPES) * len(SIZES)) for c in checks), checks


def body_isend_irecv(ctx, seed: int) -> None:
    """isend/irecv: both directions at once (each rank sends to and receives from its peer,
    64 MiB, then waits), strided tensors, and several messages of different sizes to one peer,
    received in the order sent (the receiver posts its recvs late)."""
    peer = _peer(ctx)
    if peer is None:
        return
    me, f = ctx.rank, Failures()
    what = "both directions at once, 64 MiB"
    n = 64 * MiB // 2
    x = rand(seed, me, n, torch.bfloat16, salt=what)
    y = torch.zeros(n, dtype=torch.bfloat16, device=ctx.device)
    works = [f.run(what, dist.isend, x, dst=peer), f.run(what, dist.irecv, y, src=peer)]
    for w in works:
        if w is not None:
            f.run(what, w.wait)
    f.run(what, assert_equal, y, rand(seed, peer, n, torch.bfloat16, salt=what), what)
    del x, y

    what = "strided send and recv"
    base = rand(seed, me, 2 * 50_001, torch.float32, salt=what)
    y_home = torch.full((2 * 50_001,), -1.0, device=ctx.device)
    works = [f.run(what, dist.isend, base[::2], dst=peer), f.run(what, dist.irecv, y_home[1::2], src=peer)]
    for w in works:
        if w is not None:
            f.run(what, w.wait)
    f.run(what, assert_equal, y_home[1::2], rand(seed, peer, 2 * 50_001, torch.float32, salt=what)[::2], what)
    f.run(what, assert_equal, y_home[::2], torch.full((50_001,), -1.0, device=ctx.device), f"{what}: elements between the view's changed")

    what = "several messages to one peer, in order"
    sizes = [3, 1 << 20, 0, 17, 4 << 20, 1]
    if me < peer:
        works = [f.run(what, dist.isend, rand(seed, me, k, torch.int32, salt=f"{what} {i}"), dst=peer) for i, k in enumerate(sizes)]
    else:
        time.sleep(0.3)  # the sends are queued before any recv is posted
        ys = [torch.zeros(k, dtype=torch.int32, device=ctx.device) for k in sizes]
        works = [f.run(what, dist.irecv, y, src=peer) for y in ys]
    for w in works:
        if w is not None:
            f.run(what, w.wait)
    if me > peer:
        for i, (k, y) in enumerate(zip(sizes, ys)):
            f.run(what, assert_equal, y, rand(seed, peer, k, torch.int32, salt=f"{what} {i}"), f"{what}: message {i}")
    torch.cuda.synchronize()
    f.done()


def test_isend_irecv(gpus, seed):
    gpus.run(body_isend_irecv, seed, timeout=120)


def body_ring(ctx, seed: int, nbytes: int, config: str = "default", dtype: torch.dtype = torch.float32) -> None:
    """batch_isend_irecv: every rank sends to the next and receives from the previous, both
    ops in one batch, `nbytes` each, 3 rounds, on the group of GROUP_CONFIGS[config]: with
    one stream per peer and direction, nothing waits on anything else. On 2 ranks next and
    previous are the same peer (both directions at once)."""
    g = rsccl_group(ctx, config)
    w, me, n = ctx.world, ctx.rank, nbytes // dtype.itemsize
    nxt, prev = (me + 1) % w, (me - 1) % w
    f = Failures()
    for rep in range(3):
        what = f"batch_isend_irecv ring {nbytes} bytes, round {rep}, group={config}"
        x = rand(seed, me, n, dtype, salt=what)
        y = torch.zeros_like(x)
        ops = [dist.P2POp(dist.isend, x, nxt, g), dist.P2POp(dist.irecv, y, prev, g)]
        reqs = f.run(what, dist.batch_isend_irecv, ops) or []
        for r in reqs:
            f.run(what, r.wait)
        f.run(what, assert_equal, y, rand(seed, prev, n, dtype, salt=what), f"{what}: from rank {prev}")
    torch.cuda.synchronize()
    f.done()


def test_batch_isend_irecv_ring(gpus, seed):
    gpus.run(body_ring, seed, 64 * MiB, timeout=120)


def body_all_pairs(ctx, seed: int, nbytes: int, p2p_blocks: int) -> int:
    """On a group with `cuda_p2p_blocks=p2p_blocks`: one batch_isend_irecv in which every
    rank sends `nbytes` to every other rank and receives `nbytes` from each, all at once
    (2 x (world - 1) send/recv kernels per rank, each message over the eager capacity, so
    every send waits for its receiver's kernel). With 64 blocks on 4 GPUs those kernels and
    a collective would not all fit on an H200 (6 x 64 + 64 blocks > 132 SMs x 2): the group
    must use fewer (memory_stats()["cuda_p2p_blocks"]) and finish, exactly, three rounds.
    Returns the block count the group used."""
    import rsccl

    g = dist.new_group(backend="rsccl", pg_options=rsccl.Options(cuda_p2p_blocks=p2p_blocks))
    w, me, f = ctx.world, ctx.rank, Failures()
    used = int(rsccl.memory_stats(g)["cuda_p2p_blocks"])
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    # 512-thread blocks: at most 4 per SM (2048 threads), whatever the registers allow.
    assert 1 <= used <= p2p_blocks and 2 * (w - 1) * used + 64 <= 4 * sms, (used, sms)
    peers = [p for p in range(w) if p != me]
    for rep in range(3):
        what = f"all-pairs batch_isend_irecv of {nbytes} bytes, round {rep}"
        xs = {p: rand(seed, me, nbytes // 4, torch.float32, salt=f"{what} to {p}") for p in peers}
        ys = {p: torch.zeros(nbytes // 4, dtype=torch.float32, device=ctx.device) for p in peers}
        ops = [op for p in peers for op in (dist.P2POp(dist.isend, xs[p], p, g), dist.P2POp(dist.irecv, ys[p], p, g))]
        reqs = f.run(what, dist.batch_isend_irecv, ops) or []
        for r in reqs:
            f.run(what, r.wait)
        torch.cuda.synchronize()
        for p in peers:
            want = rand(seed, p, nbytes // 4, torch.float32, salt=f"{what} to {me}")
            f.run(what, assert_equal, ys[p], want, f"{what}: from rank {p}")
    dist.destroy_process_group(g)
    torch.cuda.synchronize()
    f.done()
    return used


def test_all_pairs_batch_with_many_p2p_blocks(gpus, seed):
    """Every rank's send/recv kernels resident at once (docs/cuda.md, "Blocks")."""
    used = gpus.run(body_all_pairs, seed, 32 * MiB, 64, timeout=180)
    assert len(set(used)) == 1, f"local ranks disagree on the send/recv grid: {used}"
    print(f"cuda_p2p_blocks=64 on {len(used)} GPUs: send/recv kernels use {used[0]} blocks")


def body_graph(ctx, seed: int) -> None:
    """isend + irecv + wait() with the peer captured in one CUDA graph, replayed on fresh data."""
    peer = _peer(ctx)
    if peer is None:
        return
    me, f, n = ctx.rank, Failures(), 300_007
    x = torch.zeros(n, dtype=torch.float16, device=ctx.device)
    y = torch.zeros_like(x)

    graph = warmed_up_graph(f, exchange_with(peer, [(x, y)]))
    if graph is not None:
        for rep in range(4):
            what = f"graph replay {rep}"
            x.copy_(rand(seed, me, n, torch.float16, salt=what))
            graph.replay()
            torch.cuda.synchronize()
            f.run(what, assert_equal, y, rand(seed, peer, n, torch.float16, salt=what), what)
    torch.cuda.synchronize()
    f.done()


def test_cuda_graph(gpus, seed):
    gpus.run(body_graph, seed, timeout=120)


# csrc_kernels/abi.cuh P2P_DEPTH: inbox slots per (peer, CUDA block), the steps a sender may
# run ahead of its receiver (docs/cuda.md, "Eager capacity").
P2P_DEPTH = 4


def body_eager_capacity(ctx, seed: int) -> int:
    """The eager capacity (docs/cuda.md): the lower rank of each pair makes P2P_DEPTH small
    sends (one step each) while its peer posts no recv; they complete on the GPU without
    it. The next send waits for its receiver: it has not completed half a second later.
    Then the peer posts the recvs (host order kept by a gloo barrier, which touches no GPU)
    and every message arrives intact, in order. Returns the messages checked."""
    cpu = dist.new_group(backend="gloo")
    peer = _peer(ctx)
    if peer is None:
        dist.barrier(group=cpu)
        return -1
    me, f = ctx.rank, Failures()
    lo, hi = sorted((me, peer))
    sizes = [1, 1000, 4099, 7, 333]  # float32 elements: P2P_DEPTH messages, then one more
    assert len(sizes) == P2P_DEPTH + 1
    msgs = [rand(seed, lo, n, torch.float32, salt=f"eager {lo}-{hi} message {i}") for i, n in enumerate(sizes)]
    checks = 0
    if me == lo:
        # Every check is recorded, not raised, so that this rank always reaches the barrier
        # (its peer waits there) and the harness reports the check's own message.
        for x in msgs[:P2P_DEPTH]:
            dist.isend(x, dst=peer).wait()  # the current stream waits for the send kernel
        eager = torch.cuda.Event()
        eager.record()
        deadline = time.monotonic() + 30
        while not eager.query() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not eager.query():
            f.items.append(
                f"rank {me}: {P2P_DEPTH} small sends to rank {peer} did not complete before rank {peer} posted its recvs (eager capacity)"
            )
        dist.isend(msgs[P2P_DEPTH], dst=peer).wait()
        beyond = torch.cuda.Event()
        beyond.record()
        time.sleep(0.5)
        if beyond.query():
            f.items.append(
                f"rank {me}: send {P2P_DEPTH + 1} to rank {peer} completed before rank {peer} posted any recv (more than {P2P_DEPTH} eager steps)"
            )
        dist.barrier(group=cpu)
    else:
        dist.barrier(group=cpu)
        for i, (n, x) in enumerate(zip(sizes, msgs)):
            y = torch.zeros(n, device=ctx.device)
            dist.recv(y, src=peer)
            f.run(f"message {i}", assert_equal, y, x, f"eager message {i} of {n} float32 from rank {peer}")
            checks += 1
    torch.cuda.synchronize()
    f.done()
    return checks


def test_eager_capacity(gpus, seed):
    results = gpus.run(body_eager_capacity, seed, timeout=120)
    for rank in range(0, len(results) - 1, 2):
        assert results[rank] == 0 and results[rank + 1] == P2P_DEPTH + 1, results


def body_anysource(ctx) -> str:
    try:
        dist.recv(torch.zeros(4, device=ctx.device))
    except Exception as e:  # noqa: BLE001 - the parent inspects it
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_recv_from_any_source_is_refused(gpus):
    for rank, outcome in enumerate(gpus.run(body_anysource, timeout=60)):
        assert outcome.startswith("TypeError") and "src" in outcome, f"rank {rank}: {outcome}"


# -- errors: on groups of their own over ranks 0 and 1, which they leave unusable -----------

TIMEOUT_S = 5.0
SLACK_S = 20.0


def _pair_group():
    """A group over ranks 0 and 1 with a short timeout (every rank calls new_group; ranks
    outside it get a non-member handle and do nothing)."""
    return dist.new_group(ranks=[0, 1], backend="rsccl", timeout=timedelta(seconds=TIMEOUT_S))


def _settle(g, work) -> None:
    """Wait for a p2p Work, let the GPU finish, and raise what it reported."""
    work.wait()
    torch.cuda.synchronize()
    work.wait()  # now also raises an error the kernels reported after the first wait
    dist.barrier(group=g)


def body_size_mismatch(ctx, seed: int) -> tuple[tuple[str, str], tuple[str, str]]:
    """Rank 0 sends 1000 float32, rank 1 posts a recv of 999: an error (the group is then
    unusable) on both, within the timeout, and nothing hangs. Then a correct send/recv of 8
    float32 between the same two ranks (issue 25, place 5): it delivers, or it is refused
    with an error that says an earlier failure stopped the group and names it (never the
    mismatch's text as if this call had mismatched)."""
    g = _pair_group()
    if ctx.rank > 1:
        return ("not in the group", ""), ("not in the group", "")

    def attempt(n_send: int, n_recv: int, salt: str) -> tuple[str, str]:
        x = rand(seed, 0, n_send, torch.float32, salt=salt)
        try:
            if ctx.rank == 0:
                work = dist.isend(x, dst=1, group=g)
            else:
                y = torch.zeros(n_recv, device=ctx.device)
                work = dist.irecv(y, src=0, group=g)
            _settle(g, work)
            if ctx.rank == 1:
                assert_equal(y, x.to(y.device), f"the {salt} send/recv")
            return ("no error", "")
        except Exception as e:  # noqa: BLE001 - the parent inspects it
            return (type(e).__name__, str(e))

    first = attempt(1000, 999, "mismatch")
    second = attempt(8, 8, "after the mismatch")
    torch.cuda.synchronize()  # the GPU is not left waiting
    dist.destroy_process_group(g)
    return first, second


def body_unmatched(ctx, seed: int, nbytes: int) -> list[tuple[str, str, float]]:
    """On one 5 s group rank 0 sends `nbytes` (over the eager capacity) that rank 1 never
    receives; on another rank 1 posts a recv that rank 0 never sends. The waiting rank
    raises a timeout within the group's timeout (+ slack), the GPU is free after, and the
    world group still works."""
    out = []
    for case, waiting in (("send without recv", 0), ("recv without send", 1)):
        g = _pair_group()
        if ctx.rank == waiting:
            start = time.monotonic()
            try:
                x = rand(seed, 0, nbytes // 4, torch.float32, salt=case)
                work = dist.isend(x, dst=1, group=g) if waiting == 0 else dist.irecv(x, src=0, group=g)
                _settle(g, work)
                out.append((case, "no error", time.monotonic() - start))
            except Exception as e:  # noqa: BLE001 - the parent inspects it
                out.append((case, f"{type(e).__name__}: {e}", time.monotonic() - start))
            torch.cuda.synchronize()
        # The other rank keeps its end of the group until then: the waiting rank must see a
        # timeout, not a peer that left. The world group (rsccl, used by later tests) still works.
        dist.barrier()
        dist.destroy_process_group(g)
    # And carries a message between the two ranks.
    if ctx.rank in (0, 1):
        t = rand(seed, 0, 1000, torch.float32, salt="after")
        if ctx.rank == 0:
            dist.send(t, dst=1)
        else:
            y = torch.zeros_like(t)
            dist.recv(y, src=0)
            assert_equal(y, t, "send/recv on the world group after the failed groups")
    torch.cuda.synchronize()
    return out


def test_size_mismatch_raises(gpus, seed):
    results = gpus.run(body_size_mismatch, seed, timeout=TIMEOUT_S * 6 + 2 * SLACK_S)
    for rank, ((kind, msg), (kind2, msg2)) in enumerate(results[:2]):
        assert kind not in ("no error", "not in the group"), f"rank {rank}: a 1000-element send matched a 999-element recv without an error"
        assert kind in ("ValueError", "RuntimeError", "TimeoutError", "PeerFailureError", "GroupAbortedError"), (
            f"rank {rank} raised {kind}: {msg}"
        )
        if kind2 != "no error":
            assert "earlier failure stopped the group" in msg2 and (msg in msg2 or "bytes" in msg2), (
                f"rank {rank}: the send/recv after the mismatch raised {kind2} without naming the earlier failure: {msg2}"
            )


def test_unmatched_send_or_recv_times_out(gpus, seed):
    results = gpus.run(body_unmatched, seed, 64 * MiB, timeout=4 * (TIMEOUT_S + SLACK_S))
    for rank, cases in enumerate(results):
        for case, outcome, took in cases:
            assert outcome != "no error", f"rank {rank}: {case} returned without an error"
            assert "timeout" in outcome.lower() or "timed out" in outcome.lower(), f"rank {rank}: {case}: not a timeout: {outcome}"
            assert took < TIMEOUT_S + SLACK_S, f"rank {rank}: {case} raised only after {took:.1f} s (group timeout {TIMEOUT_S} s)"
