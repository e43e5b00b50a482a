// reduce_scatter (rs_reduce_scatter_*; its low-latency form rs_reduce_scatter_ll_*), and the
// reduction of reduce_scatter on the copy engines (rs_ce_reduce_*).

#include "common.cuh"
#include "low_latency.cuh"
#include "ring.cuh"

// reduce_scatter in place (in, world * count elements, in the pool): pull shard `rank` of
// every peer's input, reduce in rank order into my output; barrier (peers are done reading
// my input).
template <typename T>
__device__ void rs_in_place(const Args& a, BlockState& s, u32 op) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count, P = Pack<T>::N;
    T* out = reinterpret_cast<T*>(a.out);
    u64 lo, hi;
    block_range(n, P, &lo, &hi);
    reduce_packs<T>(
        lo, hi, W, op, [&](u32 j, Pack<T>& q, u64 i) { load_pack(q, peer_in<T>(a, j) + me * n, i, hi); },
        [&](const Pack<T>& p, u64 i) { store_pack(p, out, i, hi); });
    barrier(a, &s);
}

// reduce_scatter: `in` holds world * count elements, `out` count (this rank's shard).
// Each step, block b takes m elements of every shard and pushes shard j's piece into rank
// j's slot for me; barrier; then two thread groups at once: the first RS_PUSH_THREADS
// threads push the next step's pieces over NVLink while the others reduce this step's
// slots in rank order (own input for myself) into the output (issue 26: before, the same
// threads pushed, then reduced):
//   push(0) barrier(0) | push(1) || reduce(0) barrier(1) | ... | reduce(last)
// The groups touch disjoint memory (the pushers read my input and write the peers' slots
// of the next step's parity; the reducers read my slots of this step's parity and my own
// shard of the input, and write the output; the pushers never read that shard, so the
// output may be it, and a reducer reads each element before it writes it), and barrier()
// starts with a bar.sync, so both groups' stores are ordered before its release.
// Reuse: a peer writes parity p's slots again at push(s + 2), after barrier(s + 1), which
// needs my signal given after reduce(s) (my last read of them).
#ifndef RS_PUSH_THREADS
#define RS_PUSH_THREADS 256
#endif
static_assert(RS_PUSH_THREADS % 32 == 0 && RS_PUSH_THREADS > 0 && RS_PUSH_THREADS < THREADS, "RS_PUSH_THREADS: whole warps, and some for the other group");
template <typename T>
__device__ __forceinline__ void rs_reduce_step(const Args& a, u64 st, u64 per_step, u64 m, u32 par, const T* in, T* out, u32 op,
                                               u32 tid, u32 nt) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, n);
    const T* rs = reinterpret_cast<const T*>(stage_of(a, me, par));
    const T* own = in + me * n;
    reduce_packs_by<T>(
        lo, hi, tid, nt, W, op, staged_sources<T>(own, rs, me, m, lo, hi), [&](const Pack<T>& p, u64 i) { store_pack(p, out, i, hi); });
}

template <typename T>
__device__ __forceinline__ void rs_push(const Args& a, u64 st, u64 per_step, u64 m, u32 par, u32 tid, u32 nt) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const T* in = reinterpret_cast<const T*>(a.in);
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, n);
    for (u32 j0 = 1; j0 < W; j0++) {
        const u32 j = (me + j0) % W;
        const T* src = in + j * n;
        T* dst = reinterpret_cast<T*>(stage_of(a, j, par)) + slot_of(me, j) * m;
        for_packs_by<T>(
            lo, hi, tid, nt, [&](Pack<T>& p, u64 i) { load_pack(p, src, i, hi); },
            [&](const Pack<T>& p, u64 i) { store_stage(p, dst, i - lo); });
    }
}

#if RS_TMA_ON
// Step st's pushes by bulk copies (NOTE [Bulk-copy pushes] in common.cuh): every peer's
// piece of shard j into its slot for me, as rs_push moves them.
template <typename T>
__device__ __forceinline__ void rs_push_tma(const Args& a, TmaBufs& t, u32& use, u64 st, u64 per_step, u64 m, u32 par) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, n);
    if (lo >= hi) return;
    const u64 bytes = (hi - lo) * sizeof(T);
    const u8* in = reinterpret_cast<const u8*>(a.in);
    tma_copies(t, use, W - 1, 1, [&](u32 p, u32, const u8** src, u8** dst, u64* len) {
        const u32 j = (me + 1 + p) % W;
        *src = in + (j * n + lo) * sizeof(T);
        *dst = stage_of(a, j, par) + (u64)slot_of(me, j) * m * sizeof(T);
        *len = bytes;
    });
}
#endif

template <typename T>
__device__ void reduce_scatter(const Args& a, u32 op) {
    __shared__ BlockState s;
    if (!load_state(a, &s)) return;
    const u32 W = a.world;
    const u64 n = a.count;
    const u64 m = per_block<T>(a, W > 1 ? W - 1 : 1, n);
    const u64 per_step = m * gridDim.x;
    const u64 steps = steps_for(n, per_step);
    if (ring_on(a)) {  // NOTE [Ring]
        ring_call<T>(a, s, RING_RS, op, (u64)W * n * sizeof(T), [&] { rs_in_place<T>(a, s, op); });
        return;
    }
    const T* in = reinterpret_cast<const T*>(a.in);
    T* out = reinterpret_cast<T*>(a.out);
    if (!staged_start(
            a, s, (u64)W * n * sizeof(T), [&] { rs_push<T>(a, 0, per_step, m, s.step & 1, threadIdx.x, blockDim.x); },
            [&] { rs_in_place<T>(a, s, op); }))
        return;
#if RS_TMA_ON
    // Bulk copies need 16-byte aligned addresses and sizes: the input, a shard (n) and a
    // block's piece (m); staging is 256-aligned. The same on every thread of the block.
    const bool tma = ((a.in | (n * sizeof(T)) | (m * sizeof(T))) & 15) == 0 && steps > 1;
    __shared__ TmaBufs tb;
    u32 use = 0;
    if (tma && threadIdx.x == 0) tma_init(tb);
    __syncthreads();
    // Two loops, where all_gather has one with a pusher count: folded into one (2026-11-27),
    // nvcc spilled more in the bf16 and f16 entry points (stack 80 -> 96 bytes, spill
    // stores 60 -> 80), in the loop that reduces; not measured, so not taken.
    if (tma) {
        const bool pusher = threadIdx.x < 32;
        for (u64 st = 1; st < steps; st++) {
            const u32 par = (s.step + (u32)st) & 1;
            if (pusher)
                rs_push_tma<T>(a, tb, use, st, per_step, m, par);  // lane 0; the warp waits at the barrier
            else
                rs_reduce_step<T>(a, st - 1, per_step, m, par ^ 1, in, out, op, threadIdx.x - 32, blockDim.x - 32);
            BARRIER_OR_RETURN(a, s, steps)
        }
    } else
#endif
    {
        const bool pusher = threadIdx.x < RS_PUSH_THREADS;
        const u32 tid = pusher ? threadIdx.x : threadIdx.x - RS_PUSH_THREADS;
        const u32 nt = pusher ? RS_PUSH_THREADS : blockDim.x - RS_PUSH_THREADS;
        for (u64 st = 1; st < steps; st++) {
            const u32 par = (s.step + (u32)st) & 1;
            if (pusher)
                rs_push<T>(a, st, per_step, m, par, tid, nt);
            else
                rs_reduce_step<T>(a, st - 1, per_step, m, par ^ 1, in, out, op, tid, nt);
            BARRIER_OR_RETURN(a, s, steps)
        }
    }
    rs_reduce_step<T>(a, steps - 1, per_step, m, (s.step + (u32)(steps - 1)) & 1, in, out, op, threadIdx.x, blockDim.x);
    save_state(a, &s, steps);
}

RS_TYPES(reduce_scatter)

// The low-latency reduce_scatter (rs_reduce_scatter_ll_*): NOTE [Low latency] in low_latency.cuh.
template <typename T>
__device__ void reduce_scatter_ll(const Args& a, u32 op) {
    ll_call<T, LL_REDUCE_SCATTER>(a, op);
}
RS_TYPES(reduce_scatter_ll)

// reduce_scatter on the copy engines (NOTE [Copy engines] in rust/core/src/cuda/engine/
// copy.rs): one round, after its barrier B_k, on the collective's stream. The peers' copy
// engines pushed their bytes of my block for this round into my staging buffer, a slot
// each (`x.slots`, `x.slot_bytes` apart; abi.cuh's CeReduceArgs); this reduces them with
// my own block of the input, in rank order as rs_reduce_step does (own input for myself,
// so every element gets the bits the kernel path gives it; AVG divides at the end), into
// the output. Local memory only: no flag, no wait, no barrier (the barriers before and
// after it on the stream order it against the peers' pushes). The output may be my own
// block of the input (in place): each thread reads a pack of it before it writes that
// pack, and no other thread nor push reads it. Slots are 256-byte aligned and sized in
// 256-byte units, so whole packs load from them (`load_stage`: a last partial pack reads
// bytes of the slot past the round, never stored); the input and output may sit at any
// element alignment (`load_pack`, `store_pack`).
template <typename T>
__device__ void ce_reduce(const CeReduceArgs& x, u32 op) {
    const Args& a = x.a;
    const T* own = reinterpret_cast<const T*>(a.in);
    const T* slots = reinterpret_cast<const T*>(x.slots);
    T* out = reinterpret_cast<T*>(a.out);
    u64 lo, hi;
    block_range(a.count, Pack<T>::N, &lo, &hi);
    reduce_packs<T>(
        lo, hi, a.world, op, staged_sources<T>(own, slots, a.rank, x.slot_bytes / sizeof(T), 0, hi),
        [&](const Pack<T>& p, u64 i) { store_pack(p, out, i, hi); });
}

RS_TYPES_OF(ce_reduce, CeReduceArgs)
