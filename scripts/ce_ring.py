"""A ring reduce_scatter and all_reduce on the copy engines, outside rsccl: how fast the copy
engines carry them when a few CTAs do the sums (issues 28 and 26; docs/performance.md,
2026-11-28: every GPU copying to the next at once moves 385 GB/s per GPU, above every SM
pattern's ~360 and NCCL's ring all_reduce's ~350 busbw).

bf16 sums. Every rank's input is W segments of K chunks of C bytes. Ring reduce_scatter:
message (k, s) of rank r, for s = 0 .. W - 2, is its partial sum of segment (r - s - 1) mod W,
chunk k; at s = 0 its own input's chunk, later the sum the reduce kernel (scripts/ce_ring.cu,
`--ctas` CTAs) wrote into a sendbuf slot. The copy engine copies it into slot
m mod D of the next rank's staging and then writes the next rank's arrival word there
(cuStreamWriteValue32: its memory barrier orders the copy first). The next rank's reduce
kernel adds its own chunk: into its sendbuf for its own message (k, s + 1), or, at s = W - 2,
into its output (its own segment). Messages go in groups of G chunks (for each group every
step, the group's chunks within a step), so that G - 1 other copies run while a chunk's
next sum is made.

Flags (u32 words in each rank's symmetric flag page; scripts/ce_ring.cu names them). Each
belongs to one slot or chunk, and a slot's (or chunk's) copies always go on the same one of
`--streams` copy-engine streams, so each word only rises:
- arrival[slot]: prev's copy engine writes u + 1 after the slot's use u (message m = u D +
  slot); the kernel waits for it before reading the slot.
- sent[slot]: my copy engine writes u + 1 after copying message u D + slot out; the
  kernel waits for the slot's previous use before writing sendbuf slot m' mod D.
- ready[slot]: each of my CTAs adds 1 after filling a sendbuf slot; my copy engine waits
  (cuStreamWaitValue32 GEQ) for B times that slot's fills so far before copying it.
- ack[slot]: each of the next rank's CTAs adds 1 (a remote atomic into my page) after
  reading its staging slot; my copy engine waits for B times the slot's earlier uses
  before overwriting it.
- out[k]: each of my CTAs adds 1 after writing output chunk k; for all_reduce, a second
  set of copy-engine streams then runs the ring all_gather: message (k, s) copies output
  segment (r - s) mod W, chunk k, straight into the next rank's output (symmetric memory),
  after out[k] (s = 0) or after prev's message (k, s - 1) arrived (ag[k], s >= 1).
- sag (all_gather into ordinary memory): the same ring through the staging slots, with
  arrival[slot] and ack[slot] (uses consumed, written by the consumer after it forwarded
  the slot and copied it out into its output); no kernel.
The copy engines wait only in stream memory operations and hold no SM; the reduce kernel
holds `--ctas` SMs for the call. Nothing here has a timeout but the kernel's spins (about
2 s: then it records a failure and ends, and the host reports it); a deadlock in the
copy-engine streams hangs the process (run it under `timeout`).

`program` lists the operations each rank issues, and `simulate` runs them on the CPU with
the ranks' streams interleaved at random (tests/test_ce_ring_model.py, `--model SEED`): no
deadlock and every result right over worlds 2-4, 1-3 streams, groups of 1-2 chunks and
G + 2 or G + 3 slots (each CTA of the kernel a stream of its own); without the ack waits,
or with a ready wait one CTA short, the model sees wrong data; with one slot, a deadlock.

Each configuration: one eager round checked against NCCL's result (inputs are small
integers, so every sum is exact in bf16 in any order), then R rounds captured in one CUDA
graph, replayed after a reset of the flag pages (every rank idle, barriers on both sides),
timed by events; NCCL's all_reduce / reduce_scatter_tensor eager on the same data in the
same run. Times are the slowest rank's, medians of the replays.

    torchrun --nproc-per-node 4 scripts/ce_ring.py [--mib 64,256,1024] [--chunk-mib 2,4]
        [--group 2,4] [--ctas 8,16] [--streams 1,2,4] [--modes rs,ar,ag,sag]
        [--overlap N | --abort-test]
    python scripts/ce_ring.py --model 1
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
from nvlink_ceiling import _check, compile_cubin, load_module, slowest, slowest_ms, start, symmetric

SRC_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ce_ring.cu")
PAGE = 64 << 10  # the flag page, first in each rank's symmetric buffer
F_FAIL, F_READY, F_ACK, F_ARRIVAL, F_SENT, F_OUT, F_AG = 0, 64, 128, 192, 256, 1024, 8192
GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ


def decode(m: int, W: int, G: int) -> tuple[int, int]:
    """(chunk, step) of message m in the send order (scripts/ce_ring.cu: decode)."""
    per = (W - 1) * G
    g, r = divmod(m, per)
    return g * G + r % G, r // G


def index_of(k: int, s: int, W: int, G: int) -> int:
    return (k // G) * (W - 1) * G + s * G + k % G


@dataclass(frozen=True)
class Layout:
    """Addresses as rank `rank` sees them: its own and its neighbours' flag pages, stagings
    and outputs (symmetric memory), and its input, sendbuf and ordinary output."""

    flags: int
    next_flags: int
    prev_flags: int
    stage: int
    next_stage: int
    out: int
    next_out: int
    inp: int
    sbuf: int
    sag_out: int


def program(mode: str, W: int, rank: int, n: int, C: int, G: int, D: int, B: int, NS: int, rounds: int, L: Layout, ag_flags: str = "full"):
    """The operations one rank issues for `rounds` rounds, in issue order, as (stream, op):
    streams "k" (the reduce kernel), "rs<i>" and "ag<i>"; ops ("wait", addr, value) (GEQ),
    ("write", addr, value), ("copy", dst, src, bytes) and ("kernel", base, K) (ce_reduce of
    one round). Both the GPU run and the CPU model (`simulate`) execute this list."""
    seg = n // W
    K = seg // C
    M = K * (W - 1)
    ops = []
    fills = [0] * D  # kernel fills of each sendbuf slot so far (ready's target / B)
    for r in range(rounds):
        base = r * M
        if mode in ("rs", "ar"):
            ops.append(("k", ("kernel", base, K)))
            for m in range(M):
                gm = base + m
                k, s = decode(m, W, G)
                slot = gm % D
                q = f"rs{slot % NS}"  # a slot always on the same stream: its words rise
                if gm >= D:  # the next rank read this slot's earlier uses
                    ops.append((q, ("wait", L.flags + 4 * (F_ACK + slot), (gm // D) * B)))
                if s == 0:
                    src = L.inp + ((rank - 1) % W) * seg + k * C
                else:
                    fills[slot] += 1
                    ops.append((q, ("wait", L.flags + 4 * (F_READY + slot), fills[slot] * B)))
                    src = L.sbuf + slot * C
                ops.append((q, ("copy", L.next_stage + slot * C, src, C)))
                ops.append((q, ("write", L.next_flags + 4 * (F_ARRIVAL + slot), gm // D + 1)))
                ops.append((q, ("write", L.flags + 4 * (F_SENT + slot), gm // D + 1)))
        if mode == "sag":
            ops += staged_all_gather(W, rank, base, M, seg, C, G, D, NS, L)
        if mode in ("ar", "ag"):
            for m in range(M):
                k, s = decode(m, W, G)
                q = f"ag{k % NS}"  # a chunk always on the same stream: its word rises
                if s == 0 and mode == "ag":
                    pass  # all_gather alone: my segment is in my output before the call
                elif s == 0:
                    ops.append((q, ("wait", L.flags + 4 * (F_OUT + k), (r + 1) * B)))
                elif ag_flags != "none":  # prev's (k, s - 1) is in my output
                    ops.append((q, ("wait", L.flags + 4 * (F_AG + k), r * (W - 1) + s)))
                off = ((rank - s) % W) * seg + k * C
                ops.append((q, ("copy", L.next_out + off, L.out + off, C)))
                if ag_flags != "none":
                    ops.append((q, ("write", L.next_flags + 4 * (F_AG + k), r * (W - 1) + s + 1)))
    return ops


def staged_all_gather(W: int, rank: int, base: int, M: int, seg: int, C: int, G: int, D: int, NS: int, L: Layout):
    """One round of all_gather into ordinary memory (L.sag_out) through the staging: rank r's
    message (k, s) copies its input's block (s = 0) or prev's message (k, s - 1) from its
    staging slot into the next rank's slot m mod D; each received message is also copied out
    into the output, then acked to prev (ack[slot] = uses consumed). A slot's consumption
    always goes on the stream of the message that forwards it (slot (grm + G) mod D), so its
    ack rises; prev's last message of a chunk, (k, W - 2), is copied out only."""
    # This rank's own block, on a stream the ring's copies do not use (local, `seg` bytes).
    ops = [("ag0", ("copy", L.sag_out + rank * seg, L.inp + rank * seg, seg))]

    def consume(grm: int, s_prev: int, k: int) -> None:
        q = f"rs{((grm + G) % D) % NS}"
        rslot = grm % D
        ops.append((q, ("wait", L.flags + 4 * (F_ARRIVAL + rslot), grm // D + 1)))
        ops.append((q, ("copy", L.sag_out + ((rank - 1 - s_prev) % W) * seg + k * C, L.stage + rslot * C, C)))
        ops.append((q, ("write", L.prev_flags + 4 * (F_ACK + rslot), grm // D + 1)))

    for m in range(M):
        gm = base + m
        k, s = decode(m, W, G)
        slot = gm % D
        q = f"rs{slot % NS}"
        if gm >= D:  # the next rank consumed this slot's earlier uses
            ops.append((q, ("wait", L.flags + 4 * (F_ACK + slot), gm // D)))
        if s == 0:
            src = L.inp + rank * seg + k * C
        else:  # prev's (k, s - 1), in my slot
            grm = base + index_of(k, s - 1, W, G)
            ops.append((q, ("wait", L.flags + 4 * (F_ARRIVAL + grm % D), grm // D + 1)))
            src = L.stage + (grm % D) * C
        ops.append((q, ("copy", L.next_stage + slot * C, src, C)))
        ops.append((q, ("write", L.next_flags + 4 * (F_ARRIVAL + slot), gm // D + 1)))
        if s >= 1:
            consume(base + index_of(k, s - 1, W, G), s - 1, k)
        if s == W - 2:  # prev's last message of chunk k: copied out only
            consume(base + index_of(k, W - 2, W, G), W - 2, k)
    return ops


def kernel_program(W: int, rank: int, base: int, K: int, seg: int, C: int, G: int, D: int, B: int, b: int, L: Layout):
    """CTA b of ce_reduce (scripts/ce_ring.cu) in one round, as the model's operations: the
    same waits, its slice of each chunk's sum ("sum", dst, a, b, bytes) and its count of 1
    ("add", addr, 1). Each CTA is a stream of its own, so a target off by one CTA shows."""
    per = -(-C // 4 // B) * 4  # bytes of each CTA's slice, in 4-byte words as ce_reduce splits its 16-byte ones
    lo, hi = min(C, b * per), min(C, (b + 1) * per)
    ops = []
    for m in range(K * (W - 1)):
        gm = base + m
        k, sp = decode(m, W, G)
        s = sp + 1
        last = s == W - 1
        sg = (rank - s - 1) % W
        gms = 0 if last else base + index_of(k, s, W, G)
        ops.append(("wait", L.flags + 4 * (F_ARRIVAL + gm % D), gm // D + 1))
        if not last and gms >= D:
            ops.append(("wait", L.flags + 4 * (F_SENT + gms % D), gms // D))
        dst = L.out + sg * seg + k * C if last else L.sbuf + (gms % D) * C
        ops.append(("sum", dst + lo, L.stage + (gm % D) * C + lo, L.inp + sg * seg + k * C + lo, hi - lo))
        ops.append(("add", L.prev_flags + 4 * (F_ACK + gm % D), 1))
        ops.append(("add", L.flags + 4 * (F_OUT + k) if last else L.flags + 4 * (F_READY + gms % D), 1))
    return ops


def simulate(mode: str, W: int, n: int, C: int, G: int, D: int, NS: int, rounds: int, seed: int, B: int = 3) -> None:
    """The CPU model: every rank's `program` (and its kernels) run with the streams' heads
    interleaved at random, copies and flag words in a dict of 4-byte words; raises on a
    deadlock (no stream can move) or a wrong result (int32 sums of random inputs, checked
    against the collective's definition). `n`, `C`: bytes, multiples of 4."""
    rng = random.Random(seed)
    seg = n // W
    stage_bytes = D * C
    sym = [(r + 1) << 32 for r in range(W)]  # rank r's symmetric buffer: flag page, staging, output
    own = [(r + 1) << 40 for r in range(W)]  # its ordinary memory: input, sendbuf, sag output

    def layout(r: int) -> Layout:
        nx, pv = (r + 1) % W, (r - 1) % W
        return Layout(
            sym[r], sym[nx], sym[pv], sym[r] + PAGE, sym[nx] + PAGE, sym[r] + PAGE + stage_bytes,
            sym[nx] + PAGE + stage_bytes, own[r], own[r] + (1 << 30), own[r] + (2 << 30),
        )  # fmt: skip

    mem: dict[int, int] = {}
    inputs = [[rng.randrange(-1000, 1000) for _ in range(n // 4)] for _ in range(W)]
    for r in range(W):
        for i, v in enumerate(inputs[r]):
            mem[own[r] + 4 * i] = v
        if mode == "ag":  # in place: my block is in my output before the call
            for i in range(seg // 4):
                mem[layout(r).out + r * seg + 4 * i] = inputs[r][r * seg // 4 + i]
    streams = []
    for r in range(W):
        L = layout(r)
        by: dict[str, list] = {}
        for q, op in program(mode, W, r, n, C, G, D, B, NS, rounds, L):
            if op[0] == "kernel":
                for b in range(B):
                    by.setdefault(f"{q}{b}", []).extend(kernel_program(W, r, op[1], op[2], seg, C, G, D, B, b, L))
            else:
                by.setdefault(q, []).append(op)
        streams += [(r, q, ops[::-1]) for q, ops in by.items()]  # reversed: pop() takes the head

    def ready(op) -> bool:
        return op[0] != "wait" or ((mem.get(op[1], 0) - op[2]) % (1 << 32)) < (1 << 31)

    while True:
        live = [st for st in streams if st[2]]
        if not live:
            break
        runnable = [st for st in live if ready(st[2][-1])]
        if not runnable:
            heads = [(r, q, st[-1]) for r, q, st in live]
            raise RuntimeError(f"deadlock: {mode} W={W} n={n} C={C} G={G} D={D} NS={NS}: heads {heads[:6]}")
        r, q, ops = rng.choice(runnable)
        op = ops.pop()
        if op[0] == "write":
            mem[op[1]] = op[2] % (1 << 32)
        elif op[0] == "add":
            mem[op[1]] = (mem.get(op[1], 0) + op[2]) % (1 << 32)
        elif op[0] == "copy":
            for i in range(0, op[3], 4):
                mem[op[1] + i] = mem.get(op[2] + i, 0)
        elif op[0] == "sum":
            for i in range(0, op[4], 4):
                mem[op[1] + i] = mem.get(op[2] + i, 0) + mem.get(op[3] + i, 0)
    total = [sum(inputs[r][i] for r in range(W)) for i in range(n // 4)]
    gathered = [inputs[j][j * seg // 4 + i] for j in range(W) for i in range(seg // 4)]
    for r in range(W):
        L = layout(r)
        if mode == "rs":
            got = [mem.get(L.out + r * seg + 4 * i, 0) for i in range(seg // 4)]
            want = total[r * seg // 4 : (r + 1) * seg // 4]
        else:
            at = L.sag_out if mode == "sag" else L.out
            got = [mem.get(at + 4 * i, 0) for i in range(n // 4)]
            want = total if mode == "ar" else gathered
        if got != want:
            raise RuntimeError(f"wrong result: {mode} W={W} n={n} C={C} G={G} D={D} NS={NS} rank {r}")


def sweep(seed: int, worlds=(2, 3, 4), modes=("rs", "ar", "ag", "sag")) -> int:
    """`simulate` over worlds, modes, chunk counts, groups, slots and streams; the calls run."""
    calls = 0
    for W in worlds:
        for mode in modes:
            for K in (2, 4, 6):
                for G in (1, 2):
                    if K % G:
                        continue
                    for D in (G + 2, G + 3):
                        for NS in (1, 2, 3):
                            C = 24  # 6 words: 2 for each of the model's 3 CTAs
                            if K * (W - 1) <= D:
                                continue  # the harness's condition (M > D), ce_ring.cu
                            simulate(mode, W, W * K * C, C, G, D, NS, rounds=2, seed=seed + calls)
                            calls += 1
    return calls


class Driver:
    """The driver calls issued per copy, with their argument types set (ctypes converts the
    Python ints)."""

    def __init__(self, c: ctypes.CDLL) -> None:
        self.c = c
        u64, u32, vp = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p
        self.memcpy = c.cuMemcpyAsync
        self.memcpy.argtypes = [u64, u64, ctypes.c_size_t, vp]
        self.wait = getattr(c, "cuStreamWaitValue32_v2", None) or c.cuStreamWaitValue32
        self.wait.argtypes = [vp, u64, u32, ctypes.c_uint]
        self.write = getattr(c, "cuStreamWriteValue32_v2", None) or c.cuStreamWriteValue32
        self.write.argtypes = [vp, u64, u32, ctypes.c_uint]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", default="64,256,1024", help="MiB per rank (the all_reduce's message)")
    ap.add_argument("--chunk-mib", default="2,4", help="MiB per chunk and slot (a list)")
    ap.add_argument("--group", default="2,4", help="chunks per group (a list)")
    ap.add_argument("--slots", type=int, default=0, help="staging and sendbuf slots (default: group + 2)")
    ap.add_argument("--ctas", default="16", help="CTAs of the reduce kernel (a list)")
    ap.add_argument("--streams", default="1,2,4", help="copy-engine streams of each ring (a list): slot or chunk i on stream i mod it")
    ap.add_argument("--threads", type=int, default=512)
    ap.add_argument(
        "--modes",
        default="rs,ar",
        help="rs, ar, ag (all_gather into symmetric outputs: no kernel, no SM), sag (all_gather into ordinary memory "
        "through the staging: no kernel)",
    )
    ap.add_argument("--rounds", type=int, default=0, help="rounds per graph (default: about 1 GiB of messages)")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument(
        "--overlap",
        type=int,
        default=0,
        help="instead of the sweep: N bf16 8192^3 matmuls on the main stream against R rounds of each mode on a side "
        "stream (the first chunk, group, CTAs and streams given), copy engines and NCCL, alone and together",
    )
    ap.add_argument(
        "--abort-test",
        action="store_true",
        help="instead of the sweep: rank 0 stalls, the others' all_gather streams block in their waits, and each "
        "releases its own by writing its flag page from another stream (the watchdog's way out, issue 28)",
    )
    ap.add_argument(
        "--ag-flags",
        choices=("full", "none"),
        default="full",
        help="the ag mode's flags: full (the protocol); none: the copies alone, no waits or writes (where the cost per "
        "copy goes; the data may come out wrong). No effect on the other modes",
    )
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--model", type=int, metavar="SEED", help="run the CPU model's sweep (`sweep`) and stop (no GPU)")
    a = ap.parse_args()
    if a.model is not None:
        print(f"ce_ring model: {sweep(a.model)} calls, no deadlock, every result right (seed {a.model})")
        return
    if a.compile_only:
        print(f"cubin: {len(compile_cubin('sm_90', SRC_PATH))} bytes")
        return
    rank, W, local, dev = start()
    sizes = [int(x) << 20 for x in a.mib.split(",")]
    chunks = [int(float(x) * (1 << 20)) for x in a.chunk_mib.split(",")]
    groups = [int(x) for x in a.group.split(",")]
    max_d = max(a.slots or g + 2 for g in groups)
    stage_bytes = max_d * max(chunks)
    nmax = max(sizes)
    buf, hdl = symmetric(PAGE + stage_bytes + nmax, dev)
    base_of = list(hdl.buffer_ptrs)
    nxt, prv = (rank + 1) % W, (rank - 1) % W
    flags = buf[:PAGE].view(torch.int32)
    out_all = buf[PAGE + stage_bytes :]
    sendbuf = torch.empty(stage_bytes, dtype=torch.uint8, device=dev)
    inp_all = torch.empty(nmax // 2, dtype=torch.bfloat16, device=dev)
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    inp_all.copy_(torch.randint(-8, 9, (nmax // 2,), generator=gen, device=dev).to(torch.bfloat16))
    flags.zero_()
    torch.cuda.synchronize()
    dist.barrier()
    cuda, mod = load_module(local, dev, SRC_PATH)
    drv = Driver(cuda)
    fn = ctypes.c_void_p()
    _check(cuda.cuModuleGetFunction(ctypes.byref(fn), mod, b"ce_reduce"), "cuModuleGetFunction")
    s_k = torch.cuda.Stream(device=dev)
    max_ns = max(int(v) for v in a.streams.split(","))
    s_rs = [torch.cuda.Stream(device=dev) for _ in range(max_ns)]
    s_ag = [torch.cuda.Stream(device=dev) for _ in range(max_ns)]
    my_flags, next_flags, prev_flags = base_of[rank], base_of[nxt], base_of[prv]
    stage_me, stage_next = base_of[rank] + PAGE, base_of[nxt] + PAGE
    out_me, out_next = base_of[rank] + PAGE + stage_bytes, base_of[nxt] + PAGE + stage_bytes
    inp, sbuf = inp_all.data_ptr(), sendbuf.data_ptr()
    sag_out = torch.empty(nmax // 2, dtype=torch.bfloat16, device=dev) if "sag" in a.modes else inp_all[:0]
    keep = []  # the kernel parameters of captured launches stay alive

    L = Layout(
        my_flags, next_flags, prev_flags, stage_me, stage_next, out_me, out_next, inp, sbuf, sag_out.data_ptr()
    )  # fmt: skip

    def issue(mode: str, n: int, C: int, G: int, D: int, B: int, NS: int, rounds: int) -> None:
        """`rounds` rounds of `program` on the side streams, joined to the current stream."""
        seg = n // W
        main_s = torch.cuda.current_stream()
        side = [s_k, *s_rs[:NS], *s_ag[:NS]]
        for st in side:
            st.wait_stream(main_s)
        q = {"k": ctypes.c_void_p(s_k.cuda_stream)}
        q.update({f"rs{i}": ctypes.c_void_p(x.cuda_stream) for i, x in enumerate(s_rs[:NS])})
        q.update({f"ag{i}": ctypes.c_void_p(x.cuda_stream) for i, x in enumerate(s_ag[:NS])})
        for st, op in program(mode, W, rank, n, C, G, D, B, NS, rounds, L, a.ag_flags):
            if op[0] == "wait":
                _check(drv.wait(q[st], op[1], op[2] % (1 << 32), GEQ), "cuStreamWaitValue32")
            elif op[0] == "write":
                _check(drv.write(q[st], op[1], op[2] % (1 << 32), 0), "cuStreamWriteValue32")
            elif op[0] == "copy":
                _check(drv.memcpy(op[1], op[2], op[3], q[st]), "cuMemcpyAsync")
            else:  # ("kernel", base, K): ce_reduce of one round
                params = (
                    ctypes.c_uint64(inp),
                    ctypes.c_uint64(out_me),
                    ctypes.c_uint64(stage_me),
                    ctypes.c_uint64(sbuf),
                    ctypes.c_uint64(my_flags),
                    ctypes.c_uint64(prev_flags),
                    ctypes.c_uint64(seg // 16),
                    ctypes.c_uint64(C // 16),
                    ctypes.c_uint32(W),
                    ctypes.c_uint32(rank),
                    ctypes.c_uint32(D),
                    ctypes.c_uint32(G),
                    ctypes.c_uint64(op[2]),
                    ctypes.c_uint64(op[1]),
                )
                arr = (ctypes.c_void_p * len(params))(*[ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in params])
                keep.append((params, arr))
                _check(cuda.cuLaunchKernel(fn, B, 1, 1, a.threads, 1, 1, 0, q[st], arr, None), "cuLaunchKernel")
        for st in side:
            main_s.wait_stream(st)

    def reset() -> None:
        torch.cuda.synchronize()
        dist.barrier()
        failed = int(flags[F_FAIL].item())
        flags.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        if failed:
            raise RuntimeError(f"rank {rank}: the reduce kernel's wait ran out of time")

    if a.abort_test:
        abort_test(a, sizes[0], W, rank, dev, drv, issue, out_all, s_ag, flags, chunks[0], groups[0])
        dist.destroy_process_group()
        return
    if a.overlap:
        overlap(a, sizes, W, rank, dev, issue, reset, inp_all, out_all, chunks[0], groups[0])
        dist.destroy_process_group()
        return
    rows = []
    for n in sizes:
        x = inp_all[: n // 2]
        ref_ar = x.clone()
        dist.all_reduce(ref_ar)
        ref_rs = torch.empty(n // 2 // W, dtype=torch.bfloat16, device=dev)
        dist.reduce_scatter_tensor(ref_rs, x)
        x_seg = x[rank * (n // 2 // W) : (rank + 1) * (n // 2 // W)]
        ref_ag = torch.empty_like(x)
        dist.all_gather_into_tensor(ref_ag, x_seg)
        nccl = {}
        for mode in a.modes.split(","):
            y = x.clone()
            o = torch.empty_like(ref_rs)
            reps = max(3, min(50, (1 << 30) // n * 2))
            nccl[mode] = statistics.median(slowest_ms(nccl_call(mode, x, x_seg, y, o), reps) for _ in range(3))
        for mode in a.modes.split(","):
            for C in chunks:
                for G in groups:
                    D = a.slots or G + 2
                    seg = n // W
                    if D < G + (mode == "sag"):
                        continue  # the model deadlocks there (tests/test_ce_ring_model.py)
                    if seg % C or (seg // C) % G or D * C > stage_bytes or D > 64 or seg // C > 7000:
                        continue  # (the flag page holds 64 slots' and 7000 chunks' words)
                    M = (seg // C) * (W - 1)
                    if M <= D:
                        continue
                    for B, NS in [(int(b), int(q)) for b in a.ctas.split(",") for q in a.streams.split(",")]:
                        if mode == "ag" and (B != int(a.ctas.split(",")[0]) or G != groups[0]):
                            continue  # no kernel, and its order does not depend on G
                        if mode == "sag" and B != int(a.ctas.split(",")[0]):
                            continue  # no kernel
                        label = f"{mode} {n >> 20} MiB chunk {C / 2**20:g} MiB group {G} slots {D} ctas {B} streams {NS}"
                        out = out_all[:n].view(torch.bfloat16)
                        out.zero_()
                        mine = out[rank * (n // 2 // W) : (rank + 1) * (n // 2 // W)]
                        if mode == "sag":  # nothing left from the last configuration
                            sag_out.fill_(float("nan"))
                        if mode == "ag":  # all_gather in place: my segment already there
                            mine.copy_(x_seg)
                        reset()
                        issue(mode, n, C, G, D, B, NS, 1)
                        reset()
                        good = {
                            "ar": lambda: torch.equal(out, ref_ar),
                            "rs": lambda: torch.equal(mine, ref_rs),
                            "ag": lambda: torch.equal(out, ref_ag),
                            "sag": lambda: torch.equal(sag_out[: n // 2], ref_ag),
                        }[mode]()
                        bad = torch.tensor([0 if good else 1])
                        dist.all_reduce(bad)
                        R = a.rounds or max(2, min(20, (1 << 30) // n * 2))
                        reset()
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        issue(mode, n, C, G, D, B, NS, R)
                        e1.record()
                        e1.synchronize()
                        eager = slowest(e0.elapsed_time(e1) / R)
                        keep.clear()
                        g = torch.cuda.CUDAGraph()
                        try:
                            with torch.cuda.graph(g):
                                issue(mode, n, C, G, D, B, NS, R)
                        except Exception as e:  # noqa: BLE001 (report and go on)
                            rows.append((label, f"capture failed: {e}", nccl[mode], bad.item(), eager))
                            continue
                        times = []
                        for i in range(a.replays + 1):
                            reset()
                            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            e0.record()
                            g.replay()
                            e1.record()
                            e1.synchronize()
                            if i:
                                times.append(slowest(e0.elapsed_time(e1) / R))
                        reset()
                        del g
                        keep.clear()
                        rows.append((label, statistics.median(times), nccl[mode], bad.item(), eager))
    if rank == 0:
        print(f"# ce_ring: world {W}, {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, nccl {torch.cuda.nccl.version()}")
        print(
            "| config | ms per call (copy engines, graph) | busbw GB/s | NCCL ms (eager) | NCCL busbw | NCCL/ce | ce eager ms | ranks wrong |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for label, t, tn, bad, eager in rows:
            n = int(label.split()[1]) << 20
            factor = (2 if label.startswith("ar") else 1) * (W - 1) / W * n  # ag and rs: (W - 1) / W
            if isinstance(t, str):
                print(f"| {label} | {t} | | {tn:.3f} | {factor / tn / 1e6:.1f} | | {eager:.3f} | {bad} |")
            else:
                print(
                    f"| {label} | {t:.3f} | {factor / t / 1e6:.1f} | {tn:.3f} | {factor / tn / 1e6:.1f} | {tn / t:.3f} | {eager:.3f} | {bad} |"
                )
    dist.destroy_process_group()


def nccl_call(mode: str, x: torch.Tensor, x_seg: torch.Tensor, y: torch.Tensor, o: torch.Tensor):
    """NCCL's call for `mode` on the world group: all_reduce of y, reduce_scatter of x into o,
    all_gather of x_seg into y (ag and sag alike)."""
    if mode == "ar":
        return lambda: dist.all_reduce(y)
    if mode == "rs":
        return lambda: dist.reduce_scatter_tensor(o, x)
    return lambda: dist.all_gather_into_tensor(y, x_seg)


def abort_test(a, n, W, rank, dev, drv, issue, out_all, s_ag, flags, C, G) -> None:
    """A stream blocked in cuStreamWaitValue32 on a peer that never writes (rank 0 stalls:
    it issues nothing) is released by its own host writing its flag page from another
    stream (cuMemsetD32Async to a value every wait accepts): how a watchdog can end a
    copy-engine call whose peer died or stopped, with nothing left blocked on the GPU."""
    import time

    NS = int(a.streams.split(",")[0])
    D = a.slots or G + 2
    out_all[: n // W].fill_(rank)
    torch.cuda.synchronize()
    dist.barrier()
    line = f"rank {rank}: stalls"
    if rank != 0:
        issue("ag", n, C, G, D, 1, NS, 1)  # on the side streams; the current stream waits for them
        done = torch.cuda.Event()
        done.record()
        time.sleep(1.0)
        blocked = not done.query()
        t0 = time.perf_counter()
        release = torch.cuda.Stream(device=dev)
        memset = drv.c.cuMemsetD32Async
        memset.argtypes = [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_void_p]
        # 2^30: at or past every target a wait of this call names (signed 32-bit difference).
        _check(memset(flags.data_ptr(), 1 << 30, PAGE // 4, ctypes.c_void_p(release.cuda_stream)), "cuMemsetD32Async")
        while not done.query() and time.perf_counter() - t0 < 10:
            time.sleep(0.0005)
        drained = done.query()
        line = (
            f"rank {rank}: all_gather streams blocked after 1 s: {blocked}; after its flag page was written from "
            f"another stream: drained {drained} in {(time.perf_counter() - t0) * 1e3:.1f} ms"
        )
    torch.cuda.synchronize()
    lines = [None] * W
    dist.all_gather_object(lines, line)
    if rank == 0:
        print(f"# ce_ring --abort-test: world {W}, {torch.cuda.get_device_name(dev)}, {n >> 20} MiB, chunk {C >> 20} MiB")
        print("\n".join(lines))


def overlap(a, sizes, W, rank, dev, issue, reset, inp_all, out_all, C, G) -> None:
    """The overlap section's question (the bench's, rsccl.bench --overlap) for these paths:
    N matmuls beside R rounds of a collective on a side stream. ms, the slowest rank's."""
    B, NS = int(a.ctas.split(",")[0]), int(a.streams.split(",")[0])
    R = a.rounds or 16
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    c = torch.empty_like(m)
    side = torch.cuda.Stream(device=dev)

    def timed(matmuls: bool, comm) -> float:
        reset()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        if comm is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                comm()
        if matmuls:
            for _ in range(a.overlap):
                torch.mm(m, m, out=c)
        torch.cuda.current_stream().wait_stream(side)
        e1.record()
        e1.synchronize()
        return slowest(e0.elapsed_time(e1))

    lines = []
    for n in sizes:
        x = inp_all[: n // 2]
        x_seg = x[rank * (n // 2 // W) : (rank + 1) * (n // 2 // W)]
        y = torch.empty_like(x)
        o = torch.empty_like(x_seg)
        D = a.slots or G + 2
        for mode in a.modes.split(","):
            out = out_all[:n].view(torch.bfloat16)
            out[rank * (n // 2 // W) : (rank + 1) * (n // 2 // W)].copy_(x_seg)
            reset()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                issue(mode, n, C, G, D, B, NS, R)
            nccl_one = nccl_call(mode, x, x_seg, y, o)

            def nccl() -> None:
                for _ in range(R):
                    nccl_one()  # noqa: B023 (called before the loop moves on)

            res = {}
            for label, fn in (("ce", g.replay), ("nccl", nccl)):
                runs = [(timed(False, fn), timed(True, None), timed(True, fn)) for _ in range(3)]
                res[label] = [statistics.median(r[i] for r in runs) for i in range(3)]
            reset()
            del g
            (ca, ma, ba), (na, _, nb) = res["ce"], res["nccl"]
            lines.append(
                f"| {mode} {n >> 20} MiB x {R}, chunk {C >> 20} MiB, {B} CTAs, {NS} streams | {ma:.2f} | {na:.2f} | {ca:.2f} | "
                f"{nb:.2f} | {ba:.2f} | {ba / nb:.3f} |"
            )
    if rank == 0:
        print(f"# ce_ring --overlap {a.overlap}: world {W}, {torch.cuda.get_device_name(dev)}")
        print("| collective | matmuls alone | NCCL alone | ce alone | NCCL + matmuls | ce + matmuls | ce/NCCL both |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
