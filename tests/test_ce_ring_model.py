"""The copy-engine ring's protocol (scripts/ce_ring.py: the operations each rank issues, and
its reduce kernel as the model runs it) on the CPU: no interleaving of the ranks' streams
deadlocks, every result is right for reduce_scatter, all_reduce and both all_gathers, and
the model catches a protocol that skips its slot acknowledgements or has too few slots."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import ce_ring  # noqa: E402


def test_the_copy_engine_ring_never_deadlocks_and_is_right(seed):
    print(f"seed={seed}")
    assert ce_ring.sweep(seed) == 312


@pytest.mark.parametrize("mode", ["rs", "ar", "sag"])
def test_without_slot_acks_the_model_sees_wrong_data(seed, mode, monkeypatch):
    """Dropping every wait on an ack word lets a copy overwrite a slot its reader has not
    read yet: some of 20 interleavings must come out wrong."""
    print(f"seed={seed}")
    program = ce_ring.program

    def no_acks(*a, **k):
        L = a[10]
        lo, hi = L.flags + 4 * ce_ring.F_ACK, L.flags + 4 * (ce_ring.F_ACK + 64)
        return [(q, op) for q, op in program(*a, **k) if not (op[0] == "wait" and lo <= op[1] < hi)]

    monkeypatch.setattr(ce_ring, "program", no_acks)
    wrong = 0
    for i in range(20):
        try:
            ce_ring.simulate(mode, 4, 4 * 6 * 24, 24, 2, 4, 2, 2, seed + i)
        except RuntimeError as e:
            assert "wrong result" in str(e)
            wrong += 1
    assert wrong > 0


@pytest.mark.parametrize("mode", ["rs", "sag"])
def test_one_slot_deadlocks(mode):
    with pytest.raises(RuntimeError, match="deadlock"):
        ce_ring.simulate(mode, 4, 4 * 6 * 24, 24, 2, 1, 1, 2, 0)


def test_a_ready_target_one_cta_short_is_seen(seed, monkeypatch):
    """The reduce kernel's CTAs are streams of their own in the model: a copy engine that
    waits for one CTA fewer than the grid (B * fills - 1) reads a sendbuf slot one CTA has not
    filled yet, and some of 20 interleavings must come out wrong."""
    print(f"seed={seed}")
    program = ce_ring.program

    def one_short(*a, **k):
        L = a[10]
        lo, hi = L.flags + 4 * ce_ring.F_READY, L.flags + 4 * (ce_ring.F_READY + 64)
        return [(q, ("wait", op[1], op[2] - 1) if op[0] == "wait" and lo <= op[1] < hi else op) for q, op in program(*a, **k)]

    monkeypatch.setattr(ce_ring, "program", one_short)
    wrong = 0
    for i in range(20):
        try:
            ce_ring.simulate("rs", 4, 4 * 6 * 24, 24, 2, 4, 2, 2, seed + i)
        except RuntimeError as e:
            assert "wrong result" in str(e)
            wrong += 1
    assert wrong > 0
