"""The ring schedule's model (scripts/ring_model.py, NOTE [Ring] in csrc_kernels/ring.cuh):
no interleaving of the ranks' steps deadlocks, every result is right, and the model catches
the schedule's known hazard (one chunk per group deadlocks)."""

from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import ring_model  # noqa: E402


def test_the_ring_schedule_never_deadlocks_and_sums_right(seed):
    print(f"seed={seed}")
    calls = ring_model.sweep(
        worlds=(2, 3, 4, 8), counts=(1, 63, 1000, 20_000), grids=(1, 3), slots=(256, 40_000), elems=(2,), rounds=1, seed=seed
    )
    assert calls == 4 * 2 * 4 * 2 * 2


def test_one_chunk_per_group_deadlocks(monkeypatch):
    """With RING_GROUP 1 the waits for op i + 1 need prev's op i, which prev releases only
    after its own waits for op i + 1: the model must find that cycle."""
    monkeypatch.setattr(ring_model, "GROUP", 1)
    with pytest.raises(AssertionError, match="deadlock"):
        ring_model.run("RS", 2, 1, 1, 256, 2, random.Random(0))
