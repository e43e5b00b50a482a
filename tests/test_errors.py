"""Bad input, disagreeing ranks, missing and dead ranks: every involved rank raises a
clear exception (which rank passed what), nothing hangs, and processes still shut down
cleanly."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta

import pytest
import rsccl
import torch
import torch.distributed as dist
from harness import Cluster
from refs import assert_close, make, reduce_ref


@pytest.fixture(scope="module")
def trio():
    c = Cluster(3, init_timeout=20.0)
    yield c
    assert c.close() == [0, 0, 0]


def body_mismatch(ctx, case: str) -> tuple[str, str]:
    r = ctx.rank
    pg = dist.group.WORLD
    try:
        if case == "dtype":
            dist.all_reduce(torch.ones(12, dtype=torch.float64 if r == 1 else torch.float32))
        elif case == "count":
            dist.all_reduce(torch.ones(10 if r == 2 else 12))
        elif case == "op":
            dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX if r == 1 else dist.ReduceOp.SUM)
        elif case == "collective":
            t = torch.ones(4)
            dist.broadcast(t, 0) if r == 0 else dist.all_reduce(t)
        elif case == "root":
            dist.broadcast(torch.ones(4), src=1 if r == 2 else 0)
        elif case == "unsupported_dtype":
            dist.all_reduce(torch.ones(4, dtype=torch.int16 if r == 1 else torch.float32))
        elif case == "avg_on_ints":
            dist.all_reduce(torch.ones(4, dtype=torch.int64), op=dist.ReduceOp.AVG)
        elif case == "root_out_of_range":
            opts = dist.BroadcastOptions()
            opts.rootRank = 7 if r == 2 else 0
            pg.broadcast([torch.ones(4)], opts).wait()
        elif case == "split_sum":
            splits = [2, 2, 2] if r != 0 else [1, 1, 1]
            dist.all_to_all_single(torch.empty(6), torch.ones(6), output_split_sizes=[2, 2, 2], input_split_sizes=splits)
        elif case == "split_pairing":
            send = [[1, 2, 3], [1, 2, 3], [1, 2, 3]]
            if r == 1:
                send[1] = [2, 1, 3]
            recv = [send[i][r] for i in range(3)]
            if r == 0:
                recv = [1, 1, 3] if False else [send[0][0], send[1][0] - 1 if False else 1, send[2][0]]
            dist.all_to_all_single(torch.empty(sum(recv)), torch.ones(sum(send[r])), recv, send[r])
        elif case == "coalesced_output_size":
            ins = [torch.ones(4), torch.ones(5, dtype=torch.int64), torch.ones(6)]
            outs = [torch.empty(12), torch.empty(15 - (1 if r == 1 else 0), dtype=torch.int64), torch.empty(18)]
            with dist._coalescing_manager(async_ops=True) as cm:
                for o, i in zip(outs, ins):
                    dist.all_gather_into_tensor(o, i)
            cm.wait()
        elif case == "coalesced_rs_dtype":
            ins = [torch.ones(6), torch.ones(9)]
            outs = [torch.empty(2, dtype=torch.float64 if r == 1 else torch.float32), torch.empty(3)]
            with dist._coalescing_manager(async_ops=True) as cm:
                for o, i in zip(outs, ins):
                    dist.reduce_scatter_tensor(o, i)
            cm.wait()
        elif case == "gather_output_size":
            out = torch.empty(3 * 4 - (1 if r == 1 else 0))
            dist.all_gather_into_tensor(out, torch.ones(4))
        else:
            raise AssertionError(case)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        result = (type(e).__name__, str(e))
    else:
        result = ("no error", "")
    # The group is still in step and usable after an argument error.
    x = make(7, ctx.rank, 100, torch.float32)
    dist.all_reduce(x)
    assert_close(x, reduce_ref([make(7, q, 100, torch.float32) for q in range(ctx.world)], "SUM"), "after error", 3)
    return result


CASES = {
    "dtype": ("ValueError", ["rank 0 passed dtype=float32", "rank 1 passed dtype=float64"]),
    "count": ("ValueError", ["rank 0 passed elements=12", "rank 2 passed elements=10"]),
    "op": ("ValueError", ["op=SUM", "rank 1 passed op=MAX"]),
    "collective": ("ValueError", ["rank 0 called broadcast, rank 1 called all_reduce"]),
    "root": ("ValueError", ["rank 2 passed root=1"]),
    "unsupported_dtype": ("TypeError", ["rank 1: rsccl does not support dtype int16"]),
    "avg_on_ints": ("TypeError", ["ReduceOp.AVG is not defined on dtype int64"]),
    "root_out_of_range": ("ValueError", ["rank 2: broadcast: root/src rank 7 is out of range for a group of size 3"]),
    "split_sum": ("ValueError", ["rank 0: all_to_all: input split sizes [1, 1, 1]"]),
    "split_pairing": ("ValueError", ["all_to_all split sizes disagree", "rank 1 sends 2 elements to rank 0, but rank 0 expects 1"]),
    "coalesced_output_size": ("ValueError", ["rank 1: all_gather_into_tensor_coalesced #1: output has 14 elements, expected 3 x 5"]),
    "coalesced_rs_dtype": (
        "TypeError",
        ["rank 1: reduce_scatter_tensor_coalesced #0: output dtype torch.float64 differs from input dtype torch.float32"],
    ),
    "gather_output_size": ("ValueError", ["rank 1:", "all_gather: output has 11 elements, expected group size 3 x input 4 = 12"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rank_raises_the_same_clear_error(trio, case):
    kind, fragments = CASES[case]
    results = trio.run(body_mismatch, case, timeout=60)
    for rank, (got_kind, msg) in enumerate(results):
        assert got_kind == kind, f"rank {rank} raised {got_kind}: {msg}"
        for f in fragments:
            assert f in msg, f"rank {rank}'s message lacks {f!r}: {msg}"
    assert len({m for _, m in results}) == 1, f"ranks raised different messages: {results}"


def p2p_outcome(ctx, calls: dict) -> tuple[str, str]:
    """What this rank's call in `calls` (rank -> call) did: (exception class, message), or
    ("no error", "") when it returned, or ("skip", "") for a rank that has none."""
    if ctx.rank not in calls:
        return ("skip", "")
    try:
        calls[ctx.rank]()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return (type(e).__name__, str(e))
    return ("no error", "")


def body_p2p_errors(ctx) -> tuple[str, str]:
    big = torch.arange(300_000, dtype=torch.float32)  # several channel chunks
    return p2p_outcome(ctx, {0: lambda: dist.send(big, dst=1, tag=5), 1: lambda: dist.recv(torch.empty(200_000), src=0, tag=5)})


def body_tag_nobody_receives(ctx) -> tuple[str, str]:
    def late_send() -> None:
        time.sleep(1)  # so the recv's deadline comes first
        dist.send(torch.ones(10), dst=0, tag=5)

    return p2p_outcome(ctx, {2: late_send, 0: lambda: dist.recv(torch.empty(10), src=2, tag=6)})


def body_tags_out_of_order(ctx) -> None:
    """Messages go to the recv with their tag, whatever order the recvs were posted in."""
    if ctx.rank == 0:
        works = [dist.isend(torch.full((7,), float(t)), dst=1, tag=t) for t in (1, 2, 3)]
    elif ctx.rank == 1:
        bufs = {t: torch.empty(7) for t in (3, 1, 2)}
        works = [dist.irecv(bufs[t], src=0, tag=t) for t in (3, 1, 2)]
    else:
        return
    for w in works:
        w.wait()
    if ctx.rank == 1:
        for t, b in bufs.items():
            assert torch.equal(b, torch.full((7,), float(t))), (t, b)


def body_send_without_recv(ctx) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        if ctx.rank == 2:
            dist.send(torch.ones(400_000), dst=1, tag=1)  # a pair not yet used in this cluster
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e), time.monotonic() - start)
    return ("no error", "", time.monotonic() - start)


def test_p2p_mismatch_and_unmatched_send():
    c = Cluster(3, init_timeout=4.0)
    try:
        c.run(body_tags_out_of_order, timeout=60)
        res = c.run(body_p2p_errors, timeout=60)
        assert res[1][0] == "ValueError", res
        assert "rank 1 posted a recv of 200000 float32 elements from rank 0 (tag 5)" in res[1][1], res
        assert "rank 0 sent 300000 float32 elements" in res[1][1], res
        assert res[0][0] == "ValueError" and res[1][1].removeprefix("rsccl: ") in res[0][1], (
            f"the sender must fail with the receiver's message: {res}"
        )
        res = c.run(body_tag_nobody_receives, timeout=60)
        assert res[0][0] == "TimeoutError" and "recv of 10 float32 elements from rank 2 (tag 6): Timed out" in res[0][1], res
        # The tag-5 message was taken aside (its send completed) so that it would not
        # block other tags; the recv's timeout says it is there.
        assert "messages from rank 2 with tags [5] arrived and wait for matching recvs" in res[0][1], res
        assert res[2] == ("no error", ""), res
        res = c.run(body_send_without_recv, timeout=60)
        kind, msg, took = res[2]
        assert kind == "TimeoutError", res
        assert "send of 400000 float32 elements to rank 1 (tag 1): Timed out after 4.0 s: rank 1 posted no matching recv" in msg
        assert 3.5 < took < 15, took
    finally:
        c.close()


def body_absent_rank(ctx) -> tuple[str, str, float]:
    if ctx.rank == 2:
        time.sleep(5)  # never calls the collective in time
        return ("absent", "", 0.0)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1000))
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e), time.monotonic() - start)
    return ("no error", "", 0.0)


def body_after_abort(ctx) -> str:
    try:
        dist.all_reduce(torch.ones(3))
    except Exception as e:  # noqa: BLE001
        return type(e).__name__ + ": " + str(e)
    return "no error"


def test_rank_that_never_calls_times_out_naming_it():
    c = Cluster(3, init_timeout=2.0)
    try:
        res = c.run(body_absent_rank, timeout=60)
        for r in (0, 1):
            kind, msg, took = res[r]
            assert kind == "TimeoutError", res
            assert "waiting for rank 2 (pid" in msg and "Timed out after 2.0 s in all_reduce" in msg, msg
            # The rank whose own wait timed out waited the whole timeout; a rank that learns it
            # from that rank's abort started its call later, so it may have waited less.
            own = f"rank {r}: Timed out after" in msg and "aborted the group" not in msg
            assert (1.9 if own else 0.0) < took < 8, (r, took, msg)
        # The group is aborted now: every rank, the late one included, gets an error.
        after = c.run(body_after_abort, timeout=60)
        assert all("no error" not in a for a in after), after
        assert "aborted" in after[2], after
    finally:
        assert c.close() == [0, 0, 0]


def body_die_or_collect(ctx, victim: int) -> tuple[str, str, float] | None:
    if ctx.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        x = torch.ones(100_000)
        for _ in range(50):
            dist.all_reduce(x)
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e), time.monotonic() - start)
    return ("no error", "", 0.0)


def test_killed_rank_fails_the_others_quickly_and_cleanly():
    c = Cluster(3, init_timeout=60.0)
    try:
        res = c.run(body_die_or_collect, 1, timeout=60, may_exit=frozenset({1}))
        for r in (0, 2):
            kind, msg, took = res[r]
            assert kind == "PeerFailureError", res
            assert "rank 1 (pid" in msg and "exited, was killed, or left the group" in msg, msg
            assert took < 10, f"took {took:.1f} s, the group timeout is 60 s"
    finally:
        codes = c.close()
    assert codes[0] == 0 and codes[2] == 0, codes
    assert codes[1] == -signal.SIGKILL


def _partial_join(rank: int, world: int, port: int, q) -> None:
    import rsccl  # noqa: F401

    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=30), wait_for_workers=False)
    start = time.monotonic()
    try:
        dist.init_process_group("rsccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=3))
        q.put((rank, "no error", "", 0.0))
    except Exception as e:  # noqa: BLE001
        q.put((rank, type(e).__name__, str(e), time.monotonic() - start))


def test_rank_that_never_joins_fails_group_creation():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # The store lives in this process, so it outlives whichever rank gives up first.
    server = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    procs = [ctx.Process(target=_partial_join, args=(r, 3, server.port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for _rank, kind, msg, took in got:
        assert kind == "TimeoutError", got
        assert "rank 2 did not join the group within 3.0 s" in msg, msg
        assert took < 15


def test_bad_options_name_the_setting(monkeypatch):
    with pytest.raises(ValueError, match=r'rsccl.Options.host_buffer_bytes = "lots" is not a size'):
        rsccl._rsccl.resolve_options(rsccl.Options(host_buffer_bytes="lots").items())
    monkeypatch.setenv("RSCCL_SPIN_COUNT", "-5")
    with pytest.raises(ValueError, match="RSCCL_SPIN_COUNT"):
        rsccl._rsccl.resolve_options([])
    monkeypatch.delenv("RSCCL_SPIN_COUNT")
    with pytest.raises(ValueError, match='no field "bogus"'):
        rsccl._rsccl.resolve_options([("bogus", "1")])
    resolved = dict(rsccl._rsccl.resolve_options(rsccl.Options(host_buffer_bytes="8MiB").items()))
    assert resolved["host_buffer_bytes"] == 8 << 20


BAD_UTF8 = b"\xff\xfe4MiB"

# Sets each named variable, alone, to BAD_UTF8 and creates a one-rank group; prints per
# variable: name, exception type, message.
SETTINGS_CHILD = r"""
import os, sys
from datetime import timedelta
import rsccl, torch.distributed as dist
for name in sys.argv[1:]:
    os.environb[name.encode()] = BAD
    try:
        dist.init_process_group("rsccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
        dist.destroy_process_group()
        print(name, "no error", "", sep="\t")
    except Exception as e:
        print(name, type(e).__name__, str(e).replace("\n", " "), sep="\t")
    del os.environb[name.encode()]
"""


def test_settings_that_are_not_utf8_raise_naming_the_variable():
    """A value that is not UTF-8 is a bad value (a ValueError naming the variable), not
    "unset": every RSCCL_* setting, RSCCL_HOST_ID, and RSCCL_LOG (read at import)."""
    import subprocess
    import sys

    names = [env for _, env, *_ in rsccl._rsccl.settings()] + ["RSCCL_HOST_ID"]
    assert len(names) > 20, names
    env = {k: v for k, v in os.environb.items() if not k.startswith(b"RSCCL_")}
    script = SETTINGS_CHILD.replace("BAD", repr(BAD_UTF8))
    got = subprocess.run([sys.executable, "-c", script, *names], env=env, capture_output=True, timeout=300)
    assert got.returncode == 0, got.stderr.decode(errors="replace")
    lines = [line.split("\t") for line in got.stdout.decode().splitlines()]
    assert [line[0] for line in lines] == names, got.stdout
    for name, kind, msg in lines:
        assert kind == "ValueError", (name, kind, msg)
        assert f"{name} = " in msg and "xFF\\xFE4MiB" in msg and "is not valid UTF-8" in msg, (name, msg)
    env[b"RSCCL_LOG"] = BAD_UTF8
    got = subprocess.run([sys.executable, "-c", "import rsccl"], env=env, capture_output=True, timeout=300)
    err = got.stderr.decode(errors="replace")
    assert got.returncode != 0 and "ValueError: rsccl: RSCCL_LOG = " in err and "is not valid UTF-8" in err, err


def test_region_cap_is_enforced_at_init():
    with pytest.raises(AssertionError, match=r"needs a \d+-byte host region .* over max_region_bytes=1048576 \(RSCCL_MAX_REGION_BYTES\)"):
        Cluster(2, init_timeout=10.0, options=rsccl.Options(max_region_bytes="1MiB"), start_timeout=120).close()


def body_world_of_one(ctx, seed: int) -> None:
    x = make(seed, 0, 3 << 20, torch.float32)  # 12 MiB: several staging halves
    y = x.clone()
    dist.all_reduce(y)
    assert torch.equal(x, y)
    dist.all_reduce(y, op=dist.ReduceOp.AVG)
    assert torch.equal(x, y)
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out, x)
    dist.barrier()


def test_single_rank_group_with_large_messages():
    c = Cluster(1)
    try:
        c.run(body_world_of_one, 3)
    finally:
        assert c.close() == [0]


def test_ranks_with_different_settings_fail_at_creation():
    env = [{"RSCCL_ALLREDUCE_ONE_SHOT_MAX_BYTES": "1MiB"}, {"RSCCL_ALLREDUCE_ONE_SHOT_MAX_BYTES": "0"}]
    with pytest.raises(AssertionError) as info:
        Cluster(2, init_timeout=20.0, rank_env=env, start_timeout=120).close()
    text = str(info.value)
    msg = "ValueError: rsccl: ranks disagree on allreduce_one_shot_max_bytes (RSCCL_ALLREDUCE_ONE_SHOT_MAX_BYTES): rank 0 has 1048576, rank 1 has 0"
    assert f"--- rank 0: {msg}" in text and f"--- rank 1: {msg}" in text, text


def _init_twice(rank: int, port: int, q) -> None:
    import rsccl  # noqa: F401

    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30), wait_for_workers=False)
    try:
        for round_ in range(2):
            if rank == 0 and round_ == 1:
                time.sleep(1)  # the other rank re-creates first and must not read stale records
            dist.init_process_group("rsccl", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=20))
            x = torch.full((10,), float(rank + round_))
            dist.all_reduce(x)
            assert torch.equal(x, torch.full((10,), float(1 + 2 * round_))), x
            dist.destroy_process_group()
        q.put((rank, "ok"))
    except Exception as e:  # noqa: BLE001
        q.put((rank, f"{type(e).__name__}: {e}"))


def test_re_creating_groups_on_the_same_store():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    procs = [ctx.Process(target=_init_twice, args=(r, server.port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert got == [(0, "ok"), (1, "ok")], got


def body_wait_timeout_then_complete(ctx, seed: int) -> str:
    x = make(seed, ctx.rank, 100, torch.float32)
    if ctx.rank == 1:
        time.sleep(1.0)
        dist.all_reduce(x)
        return "late"
    work = dist.all_reduce(x, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=0.2))
        return "wait returned before the peer arrived"
    except TimeoutError as e:
        first = str(e)
    assert not work.is_completed()
    assert work.wait()  # completes once rank 1 arrives
    assert_close(x, reduce_ref([make(seed, r, 100, torch.float32) for r in range(2)], "SUM"), "after a timed-out wait", 2)
    return first


def body_destroy_with_pending_work(ctx) -> tuple[str, float]:
    if ctx.rank == 1:
        time.sleep(0.5)
        return ("idle", 0.0)
    work = dist.all_reduce(torch.ones(10), async_op=True)  # rank 1 never joins it
    start = time.monotonic()
    dist.group.WORLD.shutdown()
    try:
        work.wait()
        return ("no error", 0.0)
    except Exception as e:  # noqa: BLE001
        return (f"{type(e).__name__}: {e}", time.monotonic() - start)


def test_work_wait_timeout_and_shutdown_with_pending_work(seed):
    c = Cluster(2, init_timeout=30.0)
    try:
        res = c.run(body_wait_timeout_then_complete, seed, timeout=60)
        assert "Work.wait: Timed out after 0.2" in res[0], res
        res = c.run(body_destroy_with_pending_work, timeout=60)
        kind, took = res[0]
        assert kind.startswith("GroupAbortedError") and "destroyed" in kind, res
        assert took < 5, f"shutdown took {took:.1f} s with a 30 s timeout"
    finally:
        c.close()


# (sent elements, sent dtype, received elements, received dtype, recv from any source)
P2P_AFTER_MISMATCH = [
    (10, torch.float32, 12, torch.float32, False),  # the count differs
    (8, torch.float32, 8, torch.float32, False),  # then a correct pair
    (8, torch.float32, 8, torch.float64, False),  # the dtype differs
    (100_000, torch.float32, 90_000, torch.float32, False),  # many chunks through 16 KiB halves
    (50_000, torch.float32, 50_000, torch.float32, False),
    (6, torch.int64, 7, torch.int64, True),  # a recv from any source
    (6, torch.int64, 6, torch.int64, True),
    (3, torch.float32, 3, torch.float32, False),
]


def body_p2p_after_mismatch(ctx, seed: int, src: int) -> list[tuple[str, str]]:
    """Rank `src` sends each step's message to the other rank, which posts each step's
    recv; a step's outcome is ("ok", "") or (exception type, text)."""
    out = []
    for step, (n_sent, dt_sent, n_recv, dt_recv, any_src) in enumerate(P2P_AFTER_MISMATCH):
        data = make(seed, src, n_sent, dt_sent, salt=step)
        try:
            if ctx.rank == src:
                dist.send(data, dst=1 - src, tag=step % 2)
            else:
                got = torch.full((n_recv,), -7, dtype=dt_recv)
                sender = dist.recv(got, src=None if any_src else src, tag=step % 2)
                assert sender == src, (step, sender)
                if n_sent == n_recv and dt_sent == dt_recv:
                    assert torch.equal(got, data), f"step {step}: wrong data"
            out.append(("ok", ""))
        except Exception as e:  # noqa: BLE001 - every step's outcome is reported
            out.append((type(e).__name__, str(e)))
        dist.barrier(group=ctx.gloo)  # each step starts once both ranks finished the last
    return out


@pytest.mark.parametrize("src", [0, 1])
def test_p2p_channel_works_again_after_a_mismatch(seed, src):
    """A size or dtype mismatch fails both the send and the recv, naming both, and only
    them: the next message between the same ranks arrives whole, and a later mismatch is
    reported with its own text, not the earlier one's."""
    c = Cluster(2, env={"RSCCL_P2P_BUFFER_BYTES": "32KiB"}, init_timeout=20.0)
    try:
        res = c.run(body_p2p_after_mismatch, seed, src, timeout=120)
    finally:
        c.close()
    dst = 1 - src
    for step, (n_sent, dt_sent, n_recv, dt_recv, _) in enumerate(P2P_AFTER_MISMATCH):
        sent, recvd = res[src][step], res[dst][step]
        if n_sent == n_recv and dt_sent == dt_recv:
            assert sent == ("ok", "") and recvd == ("ok", ""), (step, res)
            continue
        sender_dt, recv_dt = str(dt_sent).removeprefix("torch."), str(dt_recv).removeprefix("torch.")
        assert recvd[0] == "ValueError" and sent[0] == "ValueError", (step, res)
        assert f"rank {dst} posted a recv of {n_recv} {recv_dt} elements" in recvd[1], (step, res)
        assert f"but rank {src} sent {n_sent} {sender_dt} elements (tag {step % 2})" in recvd[1], (step, res)
        assert recvd[1].removeprefix("rsccl: ") in sent[1], (step, "the sender must fail with the receiver's message", res)
        assert f"send to rank {dst} failed" in sent[1], (step, res)
        for earlier in range(step):
            if res[dst][earlier][0] == "ValueError":
                assert res[dst][earlier][1] != recvd[1], (step, "the text of an earlier mismatch", res)
