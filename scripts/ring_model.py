"""A model of the ring schedule of csrc_kernels/ring.cuh (NOTE [Ring]), run on the CPU.

It follows the kernel's plan (`ring_plan`: columns per CUDA block, chunks, their even count),
its operations (`ring_op`: step, block, message numbers) and its flags, with warp 0's order
(the waits for op i + 1 before the release of op i), and checks two things for every order in
which the ranks' steps may interleave (picked at random, many times):

- no deadlock: some rank can always move on;
- the result: reduce_scatter gives each rank the sum of its block, all_reduce every rank the
  sum, with every message read from the slot its sender wrote, never an older one.

Each case runs two calls on the same ring words and slots, the second at a base (the block's
step counter) up to 2^32 further on, with the kernel's 32-bit wrap-safe comparisons and its
reset of the words at a call's start (NOTE [Ring], "Fresh words"); every slot carries the
sequence number it was sent with, so a read of an older call's data shows. The model does
not follow the abort path, the named barriers or memory ordering.

Integers stand for the data, so the sums are exact. A change of the kernel's plan, op order,
slot or flag numbering should be made here too; `python scripts/ring_model.py` runs the
default sweep (tests/test_ring_model.py runs a smaller one in CI).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

DEPTH = 8  # RING_DEPTH
GROUP = 2  # RING_GROUP
RESET = True  # ring_call sets its block's ready and ack words to the call's base
WRAP = 1 << 32
MODES = ("RS", "AR")


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass
class Plan:
    mode: str
    world: int
    me: int
    last: int  # S
    blk_elems: int  # B
    lo: int
    hi: int
    chunk: int  # C
    chunks: int  # K

    @property
    def ops(self) -> int:
        return (self.last + 1) * self.chunks


def plan(mode: str, world: int, me: int, count: int, grid: int, b: int, slot_bytes: int, elem: int) -> Plan:
    """ring_plan for CUDA block `b` of `grid`, elements of `elem` bytes, slots of `slot_bytes`."""
    line = 128 // elem
    last = 2 * world - 2 if mode == "AR" else world - 1
    blk = round_up((count + world - 1) // world, line) if mode == "AR" else count
    per = round_up((blk + grid - 1) // grid, line)
    lo = min(b * per, blk)
    hi = min(lo + per, blk)
    n = hi - lo
    cap = (slot_bytes // elem) // line * line
    c0 = min(cap, max(round_up((n + 3) // 4, line), 32768 // elem))
    chunks = round_up((n + c0 - 1) // c0, GROUP) if n > 0 else 0
    chunk = round_up((n + chunks - 1) // chunks, line) if n > 0 else line
    return Plan(mode, world, me, last, blk, lo, hi, chunk, chunks)


def block_len(p: Plan, count: int, blk: int) -> int:
    if p.mode != "AR":
        return p.blk_elems
    start = blk * p.blk_elems
    return 0 if start >= count else min(p.blk_elems, count - start)


@dataclass
class Op:
    lo: int
    hi: int
    blk: int
    step: int
    recv: bool
    send: bool
    m: int  # message sent
    c: int  # message received


def op(p: Plan, count: int, i: int) -> Op:
    """ring_op: operation i of the plan's block."""
    group = (p.last + 1) * GROUP
    g, r = divmod(i, group)
    jg = min(GROUP, p.chunks - g * GROUP)
    s, j = divmod(r, jg)
    k = g * GROUP + j
    blk = (p.me + 2 * p.world - 1 - s) % p.world
    n = block_len(p, count, blk)
    hi = min(p.lo + (k + 1) * p.chunk, p.hi, n)
    lo = min(p.lo + k * p.chunk, hi)
    first = g * p.last * GROUP
    return Op(lo, hi, blk, s, s >= 1, s < p.last, first + s * jg + j, first + (s - 1) * jg + j)


def at_least(word: int, want: int) -> bool:
    """wait_geq's test: the signed 32-bit difference."""
    return (word - want) % WRAP < WRAP // 2


class Block:
    """What one CUDA block index keeps across calls on every rank: slots, ready and ack words."""

    def __init__(self, world: int) -> None:
        self.slots = [[None] * DEPTH for _ in range(world)]  # slots[r][d]: in rank r, written by r - 1
        self.ready = [0] * world  # ready[r]: in rank r, written by r - 1
        self.ack = [0] * world  # ack[r]: in rank r, written by r + 1


def run(
    mode: str,
    world: int,
    count: int,
    grid: int,
    slot_bytes: int,
    elem: int,
    rng: random.Random,
    base: int = 0,
    blocks: list | None = None,
) -> None:
    """One call on every CUDA block at step counter `base`, on `blocks` (kept across calls;
    fresh ones if None), the ranks' steps interleaved at random; raises on a deadlock, a
    stale slot or a wrong result."""
    n_in = world * count if mode == "RS" else count
    ins = [[rng.randint(-9, 9) for _ in range(n_in)] for _ in range(world)]
    outs = [[None] * count for _ in range(world)]
    blocks = blocks if blocks is not None else [Block(world) for _ in range(grid)]
    for b in range(grid):
        plans = [plan(mode, world, r, count, grid, b, slot_bytes, elem) for r in range(world)]
        ops = plans[0].ops
        assert all(p.ops == ops for p in plans), "every rank runs the same operations"
        slots, ready, ack = blocks[b].slots, blocks[b].ready, blocks[b].ack
        if RESET:
            for r in range(world):
                ready[r] = ack[r] = base % WRAP
        # Each rank's sequence, in warp 0's order: waits of op 0, then per op i its data, the
        # waits of op i + 1, the releases of op i.
        progs = []
        for _ in range(world):
            seq = [("wait", 0)] if ops else []
            for i in range(ops):
                seq.append(("data", i))
                if i + 1 < ops:
                    seq.append(("wait", i + 1))
                seq.append(("release", i))
            progs.append(seq)
        pc = [0] * world
        while any(pc[r] < len(progs[r]) for r in range(world)):
            order = [r for r in range(world) if pc[r] < len(progs[r])]
            rng.shuffle(order)
            for r in order:
                kind, i = progs[r][pc[r]]
                p, o = plans[r], op(plans[r], count, i)
                nxt, prv = (r + 1) % world, (r - 1) % world
                if kind == "wait":
                    if o.recv and not at_least(ready[r], base + o.c + 1):
                        continue
                    if o.send and o.m >= DEPTH and not at_least(ack[r], base + o.m - DEPTH + 1):
                        continue
                elif kind == "release":
                    if o.send:
                        ready[nxt] = (base + o.m + 1) % WRAP
                    if o.recv:
                        ack[prv] = (base + o.c + 1) % WRAP
                else:
                    move(p, o, ins[r], outs[r], slots, r, nxt, base)
                pc[r] += 1
                break
            else:
                raise AssertionError(f"deadlock: {mode} world={world} count={count} grid={grid} block={b} at {pc}")
    for r in range(world):
        if mode == "RS":
            want = [sum(x[r * count + i] for x in ins) for i in range(count)]
        else:
            want = [sum(x[i] for x in ins) for i in range(count)]
        assert outs[r] == want, f"{mode} world={world} count={count} grid={grid}: rank {r}'s result is wrong"


def move(p: Plan, o: Op, inp: list, out: list, slots: list, r: int, nxt: int, base: int) -> None:
    """ring_move: the op's data (the slot it sends carries its sequence number, to catch a
    read of an older message, of this call or an earlier one)."""
    got = None
    if o.recv:
        got = slots[r][o.c % DEPTH]
        want = base + o.c + 1
        assert got is not None and got[1] == want, f"rank {r} read message {got and got[1]} for {want}: a stale slot"
    vals = []
    reduce = p.mode == "RS" or o.step <= p.world - 1
    last_reduce = reduce and o.step == p.world - 1
    for i in range(o.lo, o.hi):
        if reduce:
            v = inp[o.blk * p.blk_elems + i] + (got[0][i - o.lo] if o.recv else 0)
        else:
            v = got[0][i - o.lo]
        vals.append(v)
        if p.mode == "RS" and last_reduce:
            out[i] = v
        elif p.mode == "AR" and (not reduce or last_reduce):
            out[o.blk * p.blk_elems + i] = v
    if o.send:
        slots[nxt][o.m % DEPTH] = (vals, base + o.m + 1)


def sweep(worlds, counts, grids, slots, elems, rounds: int, seed: int) -> int:
    rng = random.Random(seed)
    calls = 0
    for world in worlds:
        for mode in MODES:
            for count in counts:
                for grid in grids:
                    for slot in slots:
                        for elem in elems:
                            for _ in range(rounds):
                                # Two calls on the same words; the second at least the first's
                                # messages on (a real counter moves that far) and up to 2^32
                                # steps (other calls of the block in between), so across the
                                # wrap too.
                                blocks = [Block(world) for _ in range(grid)]
                                first = rng.randrange(WRAP)
                                run(mode, world, count, grid, slot, elem, rng, first, blocks)
                                gap = (1 << 20) + rng.randrange(WRAP - (1 << 21))
                                run(mode, world, count, grid, slot, elem, rng, first + gap, blocks)
                                calls += 2
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1, help="random interleavings per case")
    a = ap.parse_args()
    calls = sweep(
        worlds=(2, 3, 4, 8),
        counts=(1, 63, 64, 1000, 4096, 70_000),
        grids=(1, 3, 4),
        slots=(256, 2048, 40_000),
        elems=(2, 4),
        rounds=a.rounds,
        seed=a.seed,
    )
    print(f"ring model: {calls} calls, no deadlock, every result right (seed {a.seed})")


if __name__ == "__main__":
    main()
