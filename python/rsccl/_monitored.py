"""monitored_barrier: a barrier through rank 0 that names the ranks which did not reach it.

torch's semantics and messages (ProcessGroupGloo::monitoredBarrier), on rsccl's own
send/recv: every other rank sends rank 0 an arrival and waits for rank 0's answer; rank 0
waits for the arrivals until one deadline (`timeout` after it entered), then answers every
rank that arrived. Without `wait_all_ranks` rank 0 raises for the first rank, in rank
order, that had not arrived; with it, for all of them at once (every arrival is awaited
concurrently, so one timeout covers them all). Rank 0's answer to a rank that arrived
says whether the barrier passed, so when rank 0 raises, those ranks raise at once too
(gloo's ranks learn it from rank 0's torn-down connections). Groups across hosts use
gloo's own.

The messages use two tags at the top of the tag range (`ARRIVE`, `RELEASE`): a user's
send/recv with those tags between rank 0 and another rank would be mixed up with them.
After a monitored_barrier failed, a rank that arrives late is answered "failed" at rank
0's next monitored_barrier (its arrival is not counted for that one). Rank 0 cannot tell a
late arrival from a rank that skipped the failed barrier and arrives for the next one: a
group whose ranks skipped a monitored_barrier is not one to reuse for the next (with gloo,
its ranks' tags would disagree), which is how torch's own tests use it.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch

ARRIVE = 2**31 - 2
RELEASE = 2**31 - 1
# Rank 0's answer: PASSED, or the rank it reports as failed (TIMED_OUT: rank 0's own time
# ran out; LATE: this rank arrived after rank 0 had given up on an earlier barrier).
PASSED, TIMED_OUT, LATE = -1, -2, -3


def monitored_barrier(pg: Any, timeout: timedelta | None, wait_all_ranks: bool) -> None:
    if timeout is None:
        timeout = pg._timeout
    if pg._gloo is not None:
        pg._gloo.monitored_barrier(timeout, wait_all_ranks)
        return
    if pg.size() == 1:
        return
    if pg.rank() != 0:
        _member(pg)
    else:
        _rank0(pg, timeout, wait_all_ranks)


def _member(pg: Any) -> None:
    answer = torch.empty(1, dtype=torch.int64)
    release = pg.recv([answer], 0, RELEASE)
    try:
        pg.send([torch.tensor([pg.rank()], dtype=torch.int64)], 0, ARRIVE).wait()
        release.wait()
    except Exception as e:
        raise RuntimeError(_member_error(pg.rank(), f"Original exception: {e}")) from e
    verdict = int(answer.item())
    if verdict != PASSED:
        why = {
            TIMED_OUT: "rank 0 timed out",
            LATE: "this rank arrived after rank 0 had given up on an earlier monitored_barrier",
        }.get(verdict, f"rank 0 reported that rank {verdict} failed to pass it")
        raise RuntimeError(_member_error(pg.rank(), why))


def _member_error(rank: int, detail: str) -> str:
    return (
        f"rsccl: Rank {rank} successfully reached monitoredBarrier, but received errors while waiting for send/recv "
        f"from rank 0. Please check rank 0 logs for faulty rank. ({detail})"
    )


def _rank0(pg: Any, timeout: timedelta, wait_all_ranks: bool) -> None:
    start = time.monotonic()
    deadline = start + timeout.total_seconds()
    ms = int(timeout.total_seconds() * 1000)
    # Arrivals rank 0 gave up on in an earlier barrier stay posted: a recv posted now
    # would only get a rank's message after them (oldest first).
    stale: dict[int, Any] = getattr(pg, "_monitored_arrivals", {})
    arrivals: dict[int, Any] = {}
    for r in range(1, pg.size()):
        w = stale.get(r)
        if w is not None and w.is_completed():
            if w.is_success():
                _answer(pg, r, LATE)  # it waits in that earlier barrier
            w = None
        arrivals[r] = w if w is not None else pg.recv([torch.empty(1, dtype=torch.int64)], r, ARRIVE)
    processed: list[int] = []
    failed: list[int] = []
    error = None
    for r, w in arrivals.items():
        left = deadline - time.monotonic()
        if not w.is_completed() and left <= 0:
            if wait_all_ranks:
                failed.append(r)
                continue
            done = (
                f"Successfully processed ranks: {', '.join(map(str, processed))}"
                if processed
                else "No ranks successfully processed in monitoredBarrier."
            )
            error, verdict = f"rsccl: Rank 0 timed out in monitoredBarrier after {ms} ms.\n{done}", TIMED_OUT
            break
        try:
            # A completed Work returns at once; Work.wait takes 0 as "no limit".
            w.wait(timedelta(seconds=left) if not w.is_completed() else timedelta(0))
            processed.append(r)
        except Exception as e:  # noqa: BLE001 - this rank did not arrive in time (or its recv failed)
            failed.append(r)
            if not wait_all_ranks:
                error, verdict = f"rsccl: [Rank 0]: Rank {r} failed to pass monitoredBarrier in {ms} ms ({e})", r
                break
    if error is None and failed:
        error, verdict = f"rsccl: [Rank 0]: Ranks {', '.join(map(str, failed))} failed to pass monitoredBarrier in {ms} ms", failed[0]
    pg._monitored_arrivals = {r: w for r, w in arrivals.items() if not w.is_completed()}
    if error is None:
        for w in [_answer(pg, r, PASSED) for r in processed]:
            w.wait()
        return
    # Every rank that arrived waits for the answer: tell it now rather than at its timeout.
    for r, w in arrivals.items():
        if w.is_completed() and w.is_success():
            _answer(pg, r, verdict)
    raise RuntimeError(error)


def _answer(pg: Any, rank: int, verdict: int) -> Any:
    """Send `rank` rank 0's answer. The Work is kept until it completed: nobody waits on
    the answers of a failed barrier."""
    w = pg.send([torch.tensor([verdict], dtype=torch.int64)], rank, RELEASE)
    pg._monitored_answers = [a for a in getattr(pg, "_monitored_answers", []) if not a.is_completed()] + [w]
    return w
