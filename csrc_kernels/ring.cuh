// The ring schedule of large reduce_scatter and two-shot all_reduce: NOTE [Ring]. Included by
// the families that take it.

#pragma once

#include "common.cuh"

// NOTE [Ring]
// Why: every rank pushing to every peer at once tops out at 320-341 GB/s out of each H100
//   on 64 CTAs, while every rank sending to one neighbour moves 359 (4 H100s, bare kernels,
//   scripts/nvlink_ceiling.py, docs/performance.md, issue 26). So large calls run as a
//   ring: rank r receives only from prev = r - 1 and sends only to next = r + 1 (mod W),
//   with point-to-point readiness instead of all-peer barriers between steps. Measured
//   (docs/performance.md, 2026-11-27 21:53-22:28 UTC): from 64 MiB, on 64 CTAs, 3-11%
//   faster than the direct kernels at 4 H100s and up to 19% at 2 (reduce_scatter,
//   all_reduce); on 32 or 16 CTAs slower than the direct kernels on 64; all_gather gained
//   nothing (it keeps its direct kernel); below 64 MiB the ring's per-chunk handshakes cost
//   more than they save.
// Shape. A call's data is W blocks of B elements (reduce_scatter: the input's shards, B =
//   count; all_reduce: count split in W blocks of B = ceil(count / W) rounded up to a cache
//   line, the last ones shorter or empty). CUDA block b takes the same column
//   range [lo_b, hi_b) of every block, cut in chunks of C elements. For each chunk, step s
//   of rank r works on block blk(s):
//     reduce_scatter, s = 0 .. W-1, blk = r - 1 - s: s = 0 sends its input's block; 0 < s
//       < W-1 receives the partial from prev, adds its own input's block, sends the sum;
//       s = W-1 receives, adds its own block (blk = r) and writes the output.
//     all_reduce, s = 0 .. 2W-2, blk = r - 1 - s: reduce_scatter's steps, where s = W-1
//       also sends the result (output block r), then an all_gather's: receive block blk,
//       write it to the output, send it on unless s = 2W-2.
//   The partial that prev sends at its step s is the one this rank needs at its step s + 1,
//   for the same chunk and block (blk shifts by one per rank and step).
// Numerics: a partial sum travels in the call's dtype, so float16 / bfloat16 sums round at
//   each of the W - 1 hops and float32 sums add in ring order, as NCCL's ring does (the
//   direct kernels add every rank's input in float32, in rank order, and round once). Each
//   result is computed by one rank and copied, so every rank of all_reduce has the same
//   bits. The tests bound it as they bound NCCL's result (tests/gpu/gpu_refs.py).
// Order of work per CUDA block: chunks in groups of RING_GROUP; for each group, steps s =
//   0 .. S; for each step, the group's chunks. So the message a step waits for was sent
//   RING_GROUP operations earlier by prev, and its flag's flight hides behind the work in
//   between.
// Slots and flags. Message k (counted per CUDA block in the order sent, which is also the
//   order the receiver takes them) goes into slot k % RING_DEPTH of block b's staging at
//   next (both parities, RING_DEPTH slots of ring_slot_bytes). Sequence numbers: q = base +
//   k + 1, base = block b's step counter, equal on every rank (NOTE [Lockstep blocks]);
//   the call adds its messages to it, so q only grows across calls. Words (abi.cuh
//   RING_OFF): ready[b] in the receiver's block, written by its prev; ack[b] in the sender's
//   block, written by its next. Per operation, warp 0 signals and the other warps move data
//   (named barriers FREE and DONE, as send/recv: NOTE [Point to point]):
//     waits for op i (warp 0, thread 0, while the data warps run op i - 1): if it receives
//       message c, wait ready[b] >= base + c + 1 (own block); if it sends message m >=
//       RING_DEPTH, wait ack[b] >= base + m - RING_DEPTH + 1 (own block: next emptied slot
//       m % RING_DEPTH). Then, once op i - 1 is DONE, FREE.
//     data warps: load the received slot and the input, reduce or copy, store into next's
//       slot (NVLink) and/or the output. Then DONE.
//     after DONE of op i and FREE of op i + 1 (warp 0, thread 0): st.release.sys of base + m
//       + 1 into next's ready[b] if op i sent m, and of base + c + 1 into prev's ack[b] if
//       it received c.
//   Ordering: DONE (bar.arrive / bar.sync) orders the data warps' slot stores and loads of
//   op i before thread 0's release (cumulative); the peer's ld.acquire.sys of that value
//   synchronizes with it, and FREE extends that to its data warps: the receiver reads a
//   slot after its bytes landed, and the sender rewrites a slot after the receiver's reads
//   of it. The first RING_DEPTH messages need no ack: the call's first barrier (below)
//   ordered every rank's reads of its staging in earlier calls before it.
//   Deadlock: warp 0 waits for op i + 1 before it releases op i, so that the data warps
//   need not wait for that release. Every group holds exactly RING_GROUP chunks (the chunk count
//   is even; trailing chunks may be empty), so the message op i + 1 receives was sent at
//   prev's op i + 1 - RING_GROUP = i - 1 (same position one step earlier), released once
//   prev's waits for its op i passed; and the slot op i + 1 refills was emptied at next's op i + 1 +
//   RING_GROUP - RING_DEPTH <= i - 5 at the latest (a message per op at most). Every wait
//   thus depends only on ops of smaller index on some rank, never on a signal held back by
//   a wait that depends on it in turn: no cycle. (With one chunk per group, the waits for
//   op i + 1 would need prev's op i, held back by prev's own waits for its op i + 1: a
//   cycle around the ring. A model of this schedule, scripts/ring_model.py, runs every
//   order of the ranks' steps at random and checks both: no deadlock, the right result.)
// Fresh words: a wait compares with a signed 32-bit difference, and the block's step counter
//   moves on in every call of the block (direct kernels by their steps, the others by one),
//   while ready[b] and ack[b] change only in ring calls. Left alone, a word 2^31 steps old
//   would pass a wait at once (read a slot before it landed, overwrite one not yet read),
//   after hours of small calls between two ring calls. So each ring call first sets its own
//   ready[b] and ack[b] to its base, with plain stores by thread 0 before its first
//   barrier: the barrier's bar.sync and release order them before every peer's writes of
//   this call (made after the peer acquired that barrier's signal), and the previous ring
//   call's writes came before its last barrier, which this rank passed. A wait of this call
//   then expects base + 1 or more, less than 2^31 ahead of any value the word holds.
// Around the ring: the call starts with the group's barrier (NOTE [Agreement]: the
//   descriptor, which carries DESC0_RING_BIT, so a rank that took the other schedule is a
//   mismatch; and every peer's earlier kernels are done with its staging) and ends with
//   one (every rank's reads of its slots are done before any peer's next kernel writes
//   its staging, which a staged kernel does before its own first barrier). Failures: every
//   wait is wait_geq (NOTE [Bounded waits]); a failed wait stops the block without saving
//   its counters, like a failed barrier.
#define RING_DEPTH 8
#define RING_GROUP 2
#define RING_UNROLL 4  // packs per thread in flight per source in a reducing step (UNROLL: copies)

static_assert(RING_GROUP >= 2 && RING_DEPTH >= RING_GROUP + 2, "RING_GROUP, RING_DEPTH: see NOTE [Ring], deadlock");
#define RING_READY 0
#define RING_ACK 1
#define RING_BAR_FREE 1
#define RING_BAR_DONE 2

#define RING_RS 0
#define RING_AR 1

// The call takes the ring (the host sets DESC0_RING_BIT: decide::ring).
__device__ __forceinline__ bool ring_on(const Args& a) { return ((a.desc0 >> DESC0_RING_BIT) & 1) != 0; }

__device__ __forceinline__ u32* ring_word(u64 block_base, u32 area, u32 b) {
    return reinterpret_cast<u32*>(block_base + RING_OFF) + area * MAX_BLOCKS + b;
}

// Bytes of one of block b's RING_DEPTH slots: its two staging halves, in 256-byte units.
__device__ __forceinline__ u64 ring_slot_bytes(const Args& a) { return (2 * a.stage_per_block / RING_DEPTH) & ~(u64)255; }

struct RingPlan {
    u32 W, me, S;  // ranks, this rank, the last step
    u32 mode;
    u64 B;         // elements per block
    u64 lo, hi;    // this CUDA block's columns of each block
    u64 C, K;      // elements per chunk, chunks
    u64 ops, msgs;
};

// One operation of this CUDA block: chunk columns [lo, hi) of block `blk` at step `s`; it
// receives message c (recv) and / or sends message m (send).
struct RingOp {
    u64 lo, hi;
    u32 blk, s, m, c;
    bool recv, send;
};

template <typename T>
__device__ __forceinline__ RingPlan ring_plan(const Args& a, u32 mode) {
    RingPlan p;
    p.W = a.world;
    p.me = a.rank;
    p.mode = mode;
    p.S = mode == RING_AR ? 2 * p.W - 2 : p.W - 1;
    const u64 L = 128 / sizeof(T);
    p.B = mode == RING_AR ? round_up((a.count + p.W - 1) / p.W, L) : a.count;
    const u64 per = round_up((p.B + gridDim.x - 1) / gridDim.x, L);
    p.lo = min64((u64)blockIdx.x * per, p.B);
    p.hi = min64(p.lo + per, p.B);
    // Chunks of at most a slot, and at least 4 of them (two groups) where a chunk stays at
    // 32 KiB or more, so that a step's wait has work before it to hide behind.
    // An even number of chunks (NOTE [Ring], deadlock): every group has RING_GROUP, the
    // last ones possibly empty.
    const u64 len = p.hi - p.lo;
    const u64 cap = round_down(ring_slot_bytes(a) / sizeof(T), L);
    const u64 quarter = round_up((len + 3) / 4, L);
    const u64 floor = 32768 / sizeof(T);
    const u64 c0 = min64(cap, quarter > floor ? quarter : floor);
    p.K = len > 0 ? round_up((len + c0 - 1) / c0, RING_GROUP) : 0;
    p.C = len > 0 ? round_up((len + p.K - 1) / p.K, L) : L;
    p.ops = (u64)(p.S + 1) * p.K;
    p.msgs = (u64)p.S * p.K;
    return p;
}

// The rank's own elements of block `blk` (all_reduce's last blocks may be shorter).
__device__ __forceinline__ u64 ring_block_len(const RingPlan& p, u64 count, u32 blk) {
    if (p.mode != RING_AR) return p.B;
    const u64 start = (u64)blk * p.B;
    return start >= count ? 0 : min64(p.B, count - start);
}

__device__ __forceinline__ RingOp ring_op(const RingPlan& p, u64 count, u64 i) {
    const u64 group = (u64)(p.S + 1) * RING_GROUP;
    const u64 g = i / group, r = i - g * group;
    const u64 jg = min64(RING_GROUP, p.K - g * RING_GROUP);
    const u32 s = (u32)(r / jg), j = (u32)(r % jg);
    const u64 k = g * RING_GROUP + j;
    RingOp o;
    o.s = s;
    o.blk = (p.me + 2 * p.W - 1 - s) % p.W;
    const u64 len = ring_block_len(p, count, o.blk);
    o.hi = min64(min64(p.lo + (k + 1) * p.C, p.hi), len);
    o.lo = min64(p.lo + k * p.C, o.hi);
    o.recv = s >= 1;
    o.send = s < p.S;
    const u64 first = g * p.S * RING_GROUP;  // messages of the groups before
    o.m = (u32)(first + s * jg + j);
    o.c = (u32)(first + (s - 1) * jg + j);
    return o;
}

// Op `o`'s data, by the data warps (`tid` of `nt`): what NOTE [Ring] says per mode and step.
template <typename T>
__device__ __forceinline__ void ring_move(const Args& a, const RingPlan& p, const RingOp& o, const T* slot_in, T* slot_out, u32 op,
                                          u32 tid, u32 nt) {
    if (o.lo >= o.hi) return;
    const u64 P = Pack<T>::N, stride = (u64)nt * P, lo = o.lo, hi = o.hi;
    const T* in = reinterpret_cast<const T*>(a.in);
    T* out = reinterpret_cast<T*>(a.out);
    const bool reduce = p.mode == RING_RS || (p.mode == RING_AR && o.s <= p.W - 1);
    const bool last_reduce = reduce && o.s == p.W - 1;
    // Where the op writes the output: reduce_scatter's own shard (count elements), else the
    // block's place in the output.
    T* dst = p.mode == RING_RS ? out : out + (u64)o.blk * p.B;
    const bool writes = p.mode == RING_RS ? last_reduce : !reduce || last_reduce;
    if (reduce) {
        typedef typename Acc<T>::type A;
        const T* own = in + (u64)o.blk * p.B;
        for (u64 base = lo + tid * P; base < hi; base += stride * RING_UNROLL) {
            Pack<T> x[RING_UNROLL], y[RING_UNROLL];
#pragma unroll
            for (int u = 0; u < RING_UNROLL; u++) {
                const u64 i = base + u * stride;
                if (i < hi) {
                    load_pack(x[u], own, i, hi);
                    if (o.recv) load_stage(y[u], slot_in, i - lo);
                }
            }
#pragma unroll
            for (int u = 0; u < RING_UNROLL; u++) {
                const u64 i = base + u * stride;
                if (i >= hi) continue;
                A acc[Pack<T>::N];
                if (o.recv) {
                    reduce_pack(y[u], acc, true, op);
                    reduce_pack(x[u], acc, false, op);
                } else {
                    reduce_pack(x[u], acc, true, op);
                }
                Pack<T> q;
                if (last_reduce) finish_pack(q, acc, p.W, op);
                else finish_pack(q, acc, p.W, OP_SUM);  // a partial: AVG divides only at the end
                if (o.send) store_stage(q, slot_out, i - lo);
                if (writes) store_pack(q, dst, i, hi);
            }
        }
        return;
    }
    // all_reduce's gather steps: the received slot, copied.
    for_packs_by<T>(
        lo, hi, tid, nt, [&](Pack<T>& x, u64 i) { load_stage(x, slot_in, i - lo); },
        [&](const Pack<T>& x, u64 i) {
            if (o.send) store_stage(x, slot_out, i - lo);
            store_pack(x, dst, i, hi);
        });
}

// The ring part of a call, after its first barrier (every rank runs it, or none: the
// schedule is in the descriptor). Returns false if a wait failed (the block must stop
// without saving its counters); else the messages this block sent, for save_state.
template <typename T>
__device__ __forceinline__ bool ring_run(const Args& a, BlockState& s, u32 mode, u32 op, u64* msgs) {
    __shared__ u32 ok;
    const RingPlan p = ring_plan<T>(a, mode);
    const u32 b = blockIdx.x, t = threadIdx.x, me = p.me;
    const u32 next = (me + 1) % p.W, prev = (me + p.W - 1) % p.W;
    const u32 base = s.step;
    const u64 slot = ring_slot_bytes(a);
    if (t == 0) ok = 1;
    __syncthreads();
    if (t < 32) {
        // Op i may start: its message arrived, its slot at next is empty (thread 0's `fine`
        // = 0: a wait failed, and reported it).
        u32 fine = 1;
        auto wait_for = [&](u64 i) {
            const RingOp o = ring_op(p, a.count, i);
            if (t == 0 && fine) {
                if (o.recv && !wait_geq(a, ring_word(a.peer[me], RING_READY, b), base + o.c + 1, prev)) fine = 0;
                else if (o.send && o.m >= RING_DEPTH && !wait_geq(a, ring_word(a.peer[me], RING_ACK, b), base + o.m - RING_DEPTH + 1, next))
                    fine = 0;
            }
            __syncwarp();  // the warp converged again before its next bar.sync / bar.arrive
        };
        // `ok`, which the data warps read after each FREE, is written only here: before the
        // first FREE, or after a DONE and before the next FREE, when no data warp reads it
        // (they read it after FREE of op i, before arriving at DONE of op i). The data warps
        // then stop at that FREE.
        auto publish = [&] {
            if (t == 0 && !fine) ok = 0;
            __syncwarp();
        };
        if (p.ops > 0) {
            wait_for(0);
            publish();
            bar_arrive(RING_BAR_FREE);
        }
        for (u64 i = 0; i < p.ops && ok; i++) {
            // Op i + 1's waits run beside op i's data; FREE only once op i is DONE (a named
            // barrier's arrivals must not run ahead of its previous use).
            if (i + 1 < p.ops) wait_for(i + 1);
            bar_sync(RING_BAR_DONE);
            publish();
            if (i + 1 < p.ops) bar_arrive(RING_BAR_FREE);
            if (t == 0) {
                const RingOp o = ring_op(p, a.count, i);
                // Publishes op i's slot stores (DONE, cumulative) / its reads of my slot.
                if (o.send) st_release_sys(ring_word(a.peer[next], RING_READY, b), base + o.m + 1);
                if (o.recv) st_release_sys(ring_word(a.peer[prev], RING_ACK, b), base + o.c + 1);
            }
            __syncwarp();
        }
    } else {
        const u8* mine = reinterpret_cast<const u8*>(a.peer[me] + STAGE_OFF + 2ull * b * a.stage_per_block);
        u8* theirs = reinterpret_cast<u8*>(a.peer[next] + STAGE_OFF + 2ull * b * a.stage_per_block);
        for (u64 i = 0; i < p.ops; i++) {
            bar_sync(RING_BAR_FREE);
            if (!ok) break;
            const RingOp o = ring_op(p, a.count, i);
            const T* slot_in = reinterpret_cast<const T*>(mine + (o.c % RING_DEPTH) * slot);
            T* slot_out = reinterpret_cast<T*>(theirs + (o.m % RING_DEPTH) * slot);
            ring_move<T>(a, p, o, slot_in, slot_out, op, t - 32, blockDim.x - 32);
            bar_arrive(RING_BAR_DONE);
        }
    }
    __syncthreads();
    *msgs = p.msgs;
    return ok != 0;
}

// A call on the ring (NOTE [Ring]) from its first barrier to its end: the in-place
// algorithm instead where every rank offered the same pool buffers (NOTE [In place]; no
// rank pushed before the first barrier here, so no second barrier is needed).
template <typename T, typename InPlace>
__device__ void ring_call(const Args& a, BlockState& s, u32 mode, u32 op, u64 bytes, InPlace inplace) {
    // The block's ring words to this call's base (NOTE [Ring], "Fresh words"), before the
    // first barrier's signals: a peer writes them only after it passed that barrier.
    if (threadIdx.x == 0) {
        *ring_word(a.peer[a.rank], RING_READY, blockIdx.x) = s.step;
        *ring_word(a.peer[a.rank], RING_ACK, blockIdx.x) = s.step;
    }
    if (!barrier(a, &s)) {
        save_state(a, &s, 1);
        return;
    }
    note_call(a, bytes, 2);
    if (in_place(a, s)) {
        note_in_place(a, bytes);
        inplace();
        save_state(a, &s, 0);
        return;
    }
    u64 msgs = 0;
    if (!ring_run<T>(a, s, mode, op, &msgs)) {
        if (threadIdx.x == 0) s.abort = 1;
        save_state(a, &s, 0);
        return;
    }
    if (!barrier(a, &s)) {
        save_state(a, &s, 1);
        return;
    }
    save_state(a, &s, msgs);
}
