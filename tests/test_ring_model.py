"""The ring schedule's model (scripts/ring_model.py, NOTE [Ring] in csrc_kernels/ring.cuh):
no interleaving of the ranks' steps deadlocks, every result is right, and the model catches
the schedule's two known hazards (one chunk per group deadlocks; ring words left from a call
2^31 steps back pass a wait at once)."""

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
    assert calls == 2 * 4 * 2 * 4 * 2 * 2


def test_one_chunk_per_group_deadlocks(monkeypatch):
    """With RING_GROUP 1 the waits for op i + 1 need prev's op i, which prev releases only
    after its own waits for op i + 1: the model must find that cycle."""
    monkeypatch.setattr(ring_model, "GROUP", 1)
    with pytest.raises(AssertionError, match="deadlock"):
        ring_model.run("RS", 2, 1, 1, 256, 2, random.Random(0))


def test_words_left_from_an_old_call_are_caught(monkeypatch):
    """Without the reset at a call's start (NOTE [Ring], "Fresh words"), a ring call 2^31 + 1000
    steps after the last one finds its words "ahead" (the wrap-safe comparison) and reads a
    slot of the old call: the model must see it."""
    monkeypatch.setattr(ring_model, "RESET", False)
    rng = random.Random(0)
    caught = 0
    for _ in range(20):  # an interleaving where a reader runs ahead of its sender
        blocks = [ring_model.Block(4)]
        ring_model.run("AR", 4, 5000, 1, 2048, 2, rng, 0, blocks)
        try:
            ring_model.run("AR", 4, 5000, 1, 2048, 2, rng, (1 << 31) + 1000, blocks)
        except AssertionError as e:
            assert "stale slot" in str(e) or "wrong" in str(e), e
            caught += 1
    assert caught > 0, "the model did not see words of an old call pass a wait"
