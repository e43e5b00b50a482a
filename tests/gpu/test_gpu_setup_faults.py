"""A rank that dies while a group builds its CUDA engine (phase "cuda": GPU check, kernels,
pool, warm-up) or right after: every survivor raises PeerFailureError or TimeoutError
naming the victim and its pid within the group timeout, releases what was built, and
exits cleanly; nothing hangs. The CPU phases are in tests/test_setup_faults.py, whose
trial this reuses with every rank on its own GPU.

Not run in CI (no GPU there). 4 ranks, round-robin over the GPUs (sharing them where
there are fewer).
"""

from __future__ import annotations

import random

import pytest
from gpu_harness import gpu_count, needs_gpus
from harness import fresh_seed
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
