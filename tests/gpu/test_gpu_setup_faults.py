"""A rank that dies while a group builds its CUDA engine (phase "cuda": GPU check, kernels,
pool, warm-up) or right after: every survivor raises PeerFailureError or TimeoutError
naming the victim and its pid within the group timeout, releases what was built, and
exits cleanly; nothing hangs. The CPU phases are in tests/test_setup_faults.py, whose
trial this reuses with every rank on its own GPU. The same for phase "nccl" (a group
that spans two emulated hosts builds its NCCL engine), on 4 GPUs.

Not run in CI (no GPU there). 4 ranks, round-robin over the GPUs (sharing them where
there are fewer).
"""

from __future__ import annotations

import os
import random

import pytest
import test_setup_faults
from gpu_harness import gpu_count, needs_gpus, needs_own_gpus
from harness import fresh_seed
from test_setup_faults import _rank as _rank_on_one_host
from test_setup_faults import _trial

pytestmark = needs_gpus


def _cases() -> list[tuple[str, int, bool, int]]:
    rng = random.Random(fresh_seed())
    world = 4  # on fewer GPUs, ranks share them
    cases = []
    for phase in ("mesh", "region", "cuda", "engine"):
        for second in (False, True):
            cases.append((phase, rng.randrange(max(world, 2)), second, rng.choice([0, rng.randrange(1, 30)])))
    return cases


@pytest.mark.parametrize("phase,victim,second,delay_ms", _cases() if gpu_count() >= 1 else [])
def test_rank_dying_during_cuda_set_up_is_named(phase, victim, second, delay_ms):
    _trial(phase, victim % 4, second, delay_ms, store_in_rank0=False, world=4, cuda=True)


def _rank_on_two_hosts(rank: int, *args) -> None:
    """A rank of the trial on emulated host rank // 2 (RSCCL_HOST_ID, read at group
    creation): the groups span two hosts of 2 GPUs, so their CUDA side is the NCCL engine
    (hierarchical: the local rsccl engine and the cross communicators are built too)."""
    os.environ["RSCCL_HOST_ID"] = f"emul-host-{rank // 2}"
    _rank_on_one_host(rank, *args)


@pytest.mark.parametrize("victim", range(4))
@pytest.mark.parametrize("second", [False, True])
def test_rank_dying_while_nccl_communicators_are_made_is_named(victim, second, monkeypatch):
    """The victim dies as it enters the phase (delay 0: before any NCCL call, so every
    other rank waits for it in the store: for the flat communicator's id if it was rank 0,
    for its arrival otherwise). Its host's other rank sees its pidfd; the two ranks of
    the other host learn its name from the store. A death inside ncclCommInitRank itself
    is the documented limit (docs/multihost.md) and not tried here: it would hang."""
    needs_own_gpus(4)  # NCCL refuses two ranks of one communicator on one GPU
    # _trial starts its ranks with test_setup_faults._rank: these set their host first.
    monkeypatch.setattr(test_setup_faults, "_rank", _rank_on_two_hosts)
    _trial("nccl", victim, second, 0, store_in_rank0=False, world=4, cuda=True)
