// all_gather (rs_all_gather, and its low-latency form rs_all_gather_ll).

#include "common.cuh"
#include "low_latency.cuh"

// all_gather in place (out, world * count bytes, in the pool): push my input into slot
// `rank` of every rank's output (my own too, unless the input already is that slot, as in
// FSDP); barrier (every push has landed). On sm_90+, where the input, the output and the
// size are 16-byte aligned, thread 0 moves the block's range by bulk copies (`tb`: NOTE
// [Bulk-copy pushes] in common.cuh), each chunk loaded once and stored to every
// destination; tma_copies waits for its stores before the barrier's release.
template <typename Tb>
__device__ void ag_in_place(const Args& a, BlockState& s, Tb* tb) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const u8* in = reinterpret_cast<const u8*>(a.in);
    const bool self_copy = reinterpret_cast<const u8*>(a.out) + me * n != in;
    u64 lo, hi;
    block_range(n, 16, &lo, &hi);
#if RS_TMA_ON
    // From 4 bulk-copy chunks per block (2 MiB at 64 blocks): below that the threads'
    // stores are no slower to start (a review's advice, not measured).
    if (((a.in | a.out | n) & 15) == 0 && n >= (u64)gridDim.x * 4 * RS_TMA_CHUNK) {
        u32 use = 0;
        if (threadIdx.x == 0 && lo < hi) {
            tma_init(*tb);
            // Destinations in order me + 1, ..., me (my own slot last, and only when needed).
            tma_copies(*tb, use, 1, self_copy ? W : W - 1, [&](u32, u32 f, const u8** src, u8** dst, u64* len) {
                const u32 j = (me + 1 + f) % W;
                *src = in + lo;
                *dst = peer_out<u8>(a, j) + me * n + lo;
                *len = hi - lo;
            });
        }
        barrier(a, &s);
        return;
    }
#else
    (void)tb;
#endif
    for_packs<u8>(
        lo, hi, [&](Pack<u8>& p, u64 i) { load_pack(p, in, i, hi); },
        [&](const Pack<u8>& p, u64 i) {
            for (u32 j0 = 0; j0 < W; j0++) {
                const u32 j = (me + j0) % W;
                if (j != me || self_copy) store_pack(p, peer_out<u8>(a, j) + me * n, i, hi);
            }
        });
    barrier(a, &s);
}

// all_gather (bytes): `in` holds count bytes, `out` world * count. Each step, block b
// copies its piece of my input into my own output block and pushes it into my slot of
// every peer's staging; barrier; the copy of the peers' slots into my output is deferred
// to the next step (as in two-shot: the slots are rewritten two steps later, after a
// barrier that needs my signal, given after the copy). Between two barriers two thread
// groups work at once, as in reduce_scatter (issue 26): the first AG_PUSH_THREADS threads
// push step s while the others copy out step s - 1. They touch disjoint memory (the
// pushers read my input and write my own output block and the peers' slots of step s's
// parity; the copiers read my slots of step s - 1's parity and write the peers' blocks of
// my output), and barrier() starts with a bar.sync, so both groups' stores are ordered
// before its release. Measured against one group (4 H100s, bf16, eager, 2026-11-27): 64 MiB
// 187/190 -> 180/180 us, 256 MiB 686/671 -> 657/655 us, 1 GiB unchanged (docs/performance.md).
#ifndef AG_PUSH_THREADS
#define AG_PUSH_THREADS 256
#endif
static_assert(AG_PUSH_THREADS % 32 == 0 && AG_PUSH_THREADS > 0 && AG_PUSH_THREADS < THREADS, "AG_PUSH_THREADS: whole warps, and some for the other group");
__device__ __forceinline__ void copy_gathered(const Args& a, u64 st, u64 per_step, u64 m, const u8* mine, u8* out, u32 tid, u32 nt) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, n);
    for (u32 j0 = 1; j0 < W; j0++) {
        const u32 j = (me + j0) % W;
        const u8* src = mine + slot_of(j, me) * m;
        u8* dst = out + j * n;
        for_packs_by<u8>(
            lo, hi, tid, nt, [&](Pack<u8>& p, u64 i) { load_stage(p, src, i - lo); },
            [&](const Pack<u8>& p, u64 i) { store_pack(p, dst, i, hi); });
    }
}

__device__ __forceinline__ void ag_push(const Args& a, u64 st, u64 per_step, u64 m, u32 par, u32 tid, u32 nt) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const u8* in = reinterpret_cast<const u8*>(a.in);
    u8* out = reinterpret_cast<u8*>(a.out);
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, n);
    for_packs_by<u8>(
        lo, hi, tid, nt, [&](Pack<u8>& p, u64 i) { load_pack(p, in, i, hi); },
        [&](const Pack<u8>& p, u64 i) {
            store_pack(p, out + me * n, i, hi);
            for (u32 j0 = 1; j0 < W; j0++) {
                const u32 j = (me + j0) % W;
                store_stage(p, stage_of(a, j, par) + slot_of(me, j) * m, i - lo);
            }
        });
}

#if RS_TMA_ON
// Step st's pushes by bulk copies (NOTE [Bulk-copy pushes] in common.cuh): each chunk of my
// input's piece is loaded once and stored into my own output block and into my slot of
// every peer's staging, as ag_push moves it.
__device__ __forceinline__ void ag_push_tma(const Args& a, TmaBufs& t, u32& use, u64 st, u64 per_step, u64 m, u32 par) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, n);
    if (lo >= hi) return;
    const u8* in = reinterpret_cast<const u8*>(a.in);
    u8* out = reinterpret_cast<u8*>(a.out);
    tma_copies(t, use, 1, W, [&](u32, u32 f, const u8** src, u8** dst, u64* len) {
        const u32 j = (me + f) % W;
        *src = in + lo;
        *dst = f == 0 ? out + me * n + lo : stage_of(a, j, par) + (u64)slot_of(me, j) * m;
        *len = hi - lo;
    });
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS) rs_all_gather(const __grid_constant__ Args a) {
    __shared__ BlockState s;
    if (!load_state(a, &s)) return;
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const u64 m = per_block<u8>(a, W > 1 ? W - 1 : 1, n);
    const u64 per_step = m * gridDim.x;
    const u64 steps = steps_for(n, per_step);
    u8* out = reinterpret_cast<u8*>(a.out);
#if RS_TMA_ON
    __shared__ TmaBufs tb;  // the in-place path's or the staged pushes' (one of the two per call)
    TmaBufs* tbp = &tb;
#else
    int* tbp = nullptr;
#endif
    if (!staged_start(
            a, s, (u64)W * n, [&] { ag_push(a, 0, per_step, m, s.step & 1, threadIdx.x, blockDim.x); }, [&] { ag_in_place(a, s, tbp); }))
        return;
#if RS_TMA_ON
    // Bulk copies need 16-byte aligned addresses and sizes (NOTE [Bulk-copy pushes]): then
    // the pushers are warp 0 (its thread 0 drives the copies) and the copiers 480 threads.
    const bool tma = steps > 1 && ((a.in | a.out | n | m) & 15) == 0;
    u32 use = 0;
    if (tma && threadIdx.x == 0) tma_init(tb);
    const u32 PT = tma ? 32 : AG_PUSH_THREADS;
#else
    const u32 PT = AG_PUSH_THREADS;
#endif
    const bool pusher = threadIdx.x < PT;
    const u32 tid = pusher ? threadIdx.x : threadIdx.x - PT;
    const u32 nt = pusher ? PT : blockDim.x - PT;
    for (u64 st = 1; st < steps; st++) {
        const u32 par = (s.step + (u32)st) & 1;
#if RS_TMA_ON
        if (pusher && tma)
            ag_push_tma(a, tb, use, st, per_step, m, par);
        else
#endif
            if (pusher)
            ag_push(a, st, per_step, m, par, tid, nt);
        else
            copy_gathered(a, st - 1, per_step, m, stage_of(a, me, par ^ 1), out, tid, nt);
        BARRIER_OR_RETURN(a, s, steps)
    }
    copy_gathered(a, steps - 1, per_step, m, stage_of(a, me, (s.step + (u32)(steps - 1)) & 1), out, threadIdx.x, blockDim.x);
    save_state(a, &s, steps);
}

// The low-latency all_gather, in bytes: NOTE [Low latency] in low_latency.cuh.
extern "C" __global__ void __launch_bounds__(THREADS) rs_all_gather_ll(const __grid_constant__ Args a) { ll_call<u8, LL_ALL_GATHER>(a, 0); }
