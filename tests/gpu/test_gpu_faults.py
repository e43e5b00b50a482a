"""Failures on the GPU never hand back a result that was not computed (issue 25, place 1 and
2): a peer that arrives past the timeout, a CUDA graph replayed after a failure, two
collectives of one group running at once (an async collective not waited for, then a graph
replay), ranks that called different collectives. Each case runs with
cuda_error_teardown = 1 (the default: the process ends with the named error on stderr,
before anything computes with the result) and 0 (the error is raised at the next call;
outputs of the failed call are left as they were, never filled with a wrong result).

Each rank is its own process (tests/gpu/fault_rank.py), so that its exit status and stderr
can be read; worlds of 2 and 4 ranks, on a GPU each or sharing GPUs (allow_shared_gpu)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from gpu_harness import GPU_ENV, needs_gpus, selected_worlds, shares_gpus
from harness import free_port

pytestmark = needs_gpus

HERE = os.path.dirname(os.path.abspath(__file__))
WORLDS = [w for w in selected_worlds() if w <= 4] or [2]
DEADLINE_S = 120.0


def run_ranks(scenario: str, world: int, seed: int, teardown: int) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of every rank of `scenario`."""
    port = free_port()
    env = {**os.environ, **GPU_ENV, "PYTHONUNBUFFERED": "1"}
    env.pop("RSCCL_CUDA_ERROR_TEARDOWN", None)
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "fault_rank.py"), scenario, str(r), str(world), str(port), str(seed), str(teardown)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    out = []
    for r, p in enumerate(procs):
        try:
            o, e = p.communicate(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: rank {r} did not finish within {DEADLINE_S:.0f} s (a hang)")
        out.append((p.returncode, o, e))
    return out


def lines(stdout: str, prefix: str) -> list[str]:
    return [ln for ln in stdout.splitlines() if ln.startswith(prefix)]


def never_wrong(scenario: str, res: list[tuple[int, str, str]], raised_later: tuple[str, ...] = ()) -> None:
    """No rank was handed a wrong result, except for the calls named in `raised_later`: with
    cuda_error_teardown = 0 a blocking call that fails on the GPU returns before its kernel
    ran, and its failure is raised at the next call (the test checks that it is)."""
    for r, (rc, o, e) in enumerate(res):
        wrong = [ln for ln in lines(o, "RESULT ") if "WRONG" in ln and ln.split()[1] not in raised_later]
        assert not wrong, f"{scenario}: rank {r} was handed a wrong result: {wrong}\nstdout:\n{o}\nstderr:\n{e[-3000:]}"
        assert "READY" in o, f"{scenario}: rank {r} did not make the group (rc {rc}):\n{e[-3000:]}"
        assert "illegal memory access" not in e, f"{scenario}: rank {r}: an illegal address:\n{e[-3000:]}"


def torn_down(scenario: str, res: list[tuple[int, str, str]], says: str, ranks: list[int]) -> None:
    """`ranks` ended by rsccl (SIGABRT) with the named error on stderr."""
    for r in ranks:
        rc, o, e = res[r]
        assert rc == -signal.SIGABRT, f"{scenario}: rank {r} exited with {rc}, not ended by rsccl:\nstdout:\n{o}\nstderr:\n{e[-3000:]}"
        assert f"rsccl: rank {r}: a CUDA collective" in e and says in e, (
            f"{scenario}: rank {r}'s stderr does not say {says!r}:\n{e[-3000:]}"
        )


def late_peer_waiters_torn_down(scenario: str, call: str, world: int, seed: int) -> list[tuple[int, str, str]]:
    """`scenario` with teardown: rank world-1 calls `call` past the timeout. The waiting
    ranks end naming the timeout and the late rank (their own wait's, or the one of the
    peer whose timeout stopped the group first: with 3 ranks waiting, any of them may time
    out first and poison the others; the poison word carries the cause); nobody prints a
    result."""
    res = run_ranks(scenario, world, seed, 1)
    never_wrong(scenario, res)
    for r, (_, o, _) in enumerate(res):
        assert not lines(o, "RESULT "), f"rank {r} was handed a result of a failed {call}: {o}"
    for r in range(world - 1):
        torn_down(scenario, res, "waited longer than the group timeout", [r])
        assert f"for rank {world - 1}" in res[r][2], res[r][2][-2000:]
    return res


def late_peer_raised(scenario: str, call: str, world: int, seed: int) -> None:
    """`scenario` without teardown: the timeout is raised at the next call on every rank
    (the failed blocking call itself returned before its work ran: its output is not a
    result)."""
    res = run_ranks(scenario, world, seed, 0)
    never_wrong(scenario, res, raised_later=(f"late_{call}",))
    for r, (rc, o, e) in enumerate(res):
        assert "DONE" in o and rc == 0, f"rank {r} (rc {rc}):\n{o}\n{e[-3000:]}"
        raised = lines(o, f"RAISED next_{call}")
        assert raised, f"rank {r}: the {call} after a failed one did not raise:\n{o}"
        if r < world - 1:
            assert "TimeoutError" in raised[0] and f"rank {world - 1}" in raised[0], raised


@pytest.mark.parametrize("world", WORLDS)
def test_late_peer_teardown(world, seed):
    """A peer past the timeout: the waiting ranks end with the timeout named, the late one
    with the failed group named; nobody prints a result."""
    res = late_peer_waiters_torn_down("late_peer", "all_reduce", world, seed)
    # The late rank finds the group stopped: its kernel at entry (ended too, naming the
    # timeout that stopped the group), or, if the others were gone by then, its launch
    # raises naming them.
    rc, o, e = res[world - 1]
    if rc != 0:
        torn_down("late_peer", res, f"for rank {world - 1}", [world - 1])
    else:
        # Any waiting rank's timeout may be the one that stopped the group (the poison word
        # carries the cause): the message names that rank and the late one.
        raised = lines(o, "RAISED late_all_reduce")
        who = re.search(r"on rank (\d+) waited longer than the group timeout .* for rank (\d+)", raised[0]) if raised else None
        assert who and int(who[1]) < world - 1 and int(who[2]) == world - 1, (
            f"the late rank was not told of the failed group:\n{o}\n{e[-3000:]}"
        )


@pytest.mark.parametrize("world", WORLDS)
def test_late_peer_raise(world, seed):
    late_peer_raised("late_peer", "all_reduce", world, seed)


@pytest.mark.parametrize("world", WORLDS)
def test_ring_late_peer_raise(world, seed):
    """late_peer_raised with the all_reduce on the ring schedule (NOTE [Ring])."""
    late_peer_raised("ring_late_peer", "all_reduce", world, seed)


@pytest.mark.parametrize("world", WORLDS)
def test_graph_replayed_after_a_failure_writes_nothing(world, seed):
    """A graph captured before a timeout and replayed after it (cuda_error_teardown = 0, so
    that the process lives to replay it): its kernels find the group failed at their entry
    and write nothing (the output keeps its NaN), and the group's next call raises."""
    res = run_ranks("graph_after_failure", world, seed, 0)
    never_wrong("graph_after_failure", res, raised_later=("late_all_reduce",))
    for r, (rc, o, e) in enumerate(res):
        assert "RESULT replay_before ok" in o, f"rank {r}: the replay before the failure was wrong:\n{o}"
        for k in range(3):
            assert f"RESULT replay_after_{k} untouched" in o or f"RAISED replay_after_{k}" in o, f"rank {r}, replay {k}:\n{o}"
        assert "RAISED barrier_after_replays" in o, f"rank {r}: the call after the replays did not raise:\n{o}"
        assert rc == 0, f"rank {r} exited with {rc}:\n{e[-3000:]}"


@pytest.mark.parametrize("teardown", [1, 0])
@pytest.mark.parametrize("world", WORLDS)
def test_async_collective_then_graph_replay(world, seed, teardown):
    """Two kernels of one group at once (an async all_reduce not waited for, then a graph
    replay, both released together by a GPU sleep, so that they overlap): never wrong data,
    and the group stops, naming what the user did."""
    res = run_ranks("async_then_replay", world, seed, teardown)
    # With cuda_error_teardown = 0 the round in which the kernels overlapped may hand back
    # wrong data (Work.wait() orders streams, it does not wait for the GPU); its error is
    # raised at the next call, checked below. With teardown no round may.
    rounds = tuple(f"{what}_{k}" for what in ("async", "replay") for k in range(4))
    never_wrong("async_then_replay", res, raised_later=() if teardown else rounds)
    said = "two CUDA collectives of this group ran at the same time"
    if shares_gpus(world):
        # Ranks on one GPU split its SMs: the overlapping kernels may not all be resident,
        # so the misuse can also surface as a timeout; any named stop, or right results.
        for r, (rc, _, e) in enumerate(res):
            assert rc in (0, -signal.SIGABRT), f"rank {r} exited with {rc}:\n{e[-3000:]}"
            assert rc == 0 or "rsccl: rank" in e, e[-3000:]
        return
    if teardown:
        ended = [r for r, (rc, _, _) in enumerate(res) if rc != 0]
        for r in ended:
            assert res[r][0] == -signal.SIGABRT, f"rank {r} exited with {res[r][0]}:\n{res[r][2][-3000:]}"
        assert any(said in res[r][2] for r in ended), "no rank named the concurrent collectives:\n" + "\n".join(
            f"rank {r} (rc {rc}): {o}{e[-2000:]}" for r, (rc, o, e) in enumerate(res)
        )
    else:
        raised = [ln for _, o, _ in res for ln in lines(o, "RAISED ")]
        assert any(said in ln for ln in raised), f"no rank raised the concurrent collectives: {raised}"
        for ln in raised:
            assert said in ln or "stopped because of rank" in ln, ln


def mismatch_torn_down(scenario: str, call: str, world: int, seed: int) -> list[str]:
    """`scenario` with teardown: ranks that called different collectives (rank 1's count)
    end with the mismatch named, and nobody goes on. Returns the stderr of those ended."""
    res = run_ranks(scenario, world, seed, 1)
    never_wrong(scenario, res)
    for r, (_, o, _) in enumerate(res):
        assert "RESULT barrier_after_mismatch" not in o, f"rank {r} went on after a mismatched {call}:\n{o}"
    ended = [r for r in range(world) if res[r][0] != 0]
    assert ended, f"no rank was ended after a mismatched {call}"
    torn_down(scenario, res, "ranks called different CUDA collectives", ended)
    return [res[r][2] for r in ended]


@pytest.mark.parametrize("world", WORLDS)
def test_mismatch_teardown(world, seed):
    mismatch_torn_down("mismatch", "all_reduce", world, seed)


@pytest.mark.parametrize("world", WORLDS)
def test_graph_replayed_after_destroy_fails_loudly(world, seed):
    """destroy_process_group, then a replay of a graph captured before: the graph kept the
    group's memory (no illegal address), and its kernels stop with rsccl's message rather
    than return a result (issue 25, place 3)."""
    res = run_ranks("replay_after_destroy", world, seed, 1)
    never_wrong("replay_after_destroy", res)
    for r, (rc, o, e) in enumerate(res):
        assert "RESULT replay_before ok" in o and "DESTROYED" in o, f"rank {r} (rc {rc}):\n{o}\n{e[-3000:]}"
        assert "RAISED replay_after_destroy" in o, f"rank {r}: the replay after destroy did not fail:\n{o}\n{e[-3000:]}"
        assert "process group that was destroyed" in o, f"rank {r}: no message from the replayed kernel:\n{o}"


# The copy-engine path (issue 28): its waits are one-CTA barrier kernels, so a late peer
# and a mismatched call end as the kernels' do: named, within the timeout, nothing left
# running on the GPU.


@pytest.mark.parametrize("world", WORLDS)
def test_copy_engine_late_peer_teardown(world, seed):
    late_peer_waiters_torn_down("ce_late_peer", "all_gather", world, seed)


@pytest.mark.parametrize("world", WORLDS)
def test_copy_engine_late_peer_raise(world, seed):
    """The failed call's output is not a result (its copies moved whatever the peers'
    staging held): it is the call whose error the next call raises."""
    late_peer_raised("ce_late_peer", "all_gather", world, seed)


@pytest.mark.parametrize("world", WORLDS)
def test_copy_engine_mismatch_teardown(world, seed):
    """Rank 1 gathers one element more: the barrier kernels see the descriptors differ."""
    said = mismatch_torn_down("ce_mismatch", "all_gather", world, seed)
    assert any("on the copy engines" in e for e in said), "the mismatch does not say the call ran on the copy engines"


@pytest.mark.parametrize("world", WORLDS)
def test_copy_engine_mismatch_raise(world, seed):
    """Without teardown every rank raises: the mismatch, or the timeout that stopped the
    group when its next call, queued before it heard of the mismatch, took another path
    than a peer's (seen at world 2: rank 0's barrier waited for rank 1, which had raised
    and gone on to the next all_gather). The call after it is right or raises, never
    wrong (docs/errors.md)."""
    res = run_ranks("ce_mismatch", world, seed, 0)
    never_wrong("ce_mismatch", res)
    for r, (rc, o, e) in enumerate(res):
        assert "DONE" in o and rc == 0, f"rank {r} (rc {rc}):\n{o}\n{e[-3000:]}"
        raised = lines(o, "RAISED mismatched_all_gather")
        assert raised and ("ranks called different CUDA collectives" in raised[0] or "TimeoutError" in raised[0]), f"rank {r}:\n{o}"
        assert lines(o, "RESULT after_mismatch ok") or lines(o, "RAISED after_mismatch"), f"rank {r}:\n{o}"
