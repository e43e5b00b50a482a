// all_reduce: one-shot, two-shot and low-latency (rs_ar_oneshot_*, rs_ar_twoshot_*, rs_ar_ll_*).

#include "common.cuh"
#include "low_latency.cuh"
#include "ring.cuh"

// all_reduce, one-shot: count elements in `in`, result in `out` (may alias in).
// Each step, block b takes m elements and writes them into its slot of every peer's
// staging (remote stores over NVLink), passes a barrier, then reduces in rank order: its
// own input for itself, the slots for the others (so every rank computes the same bits).
template <typename T>
__device__ void ar_oneshot(const Args& a, u32 op) {
    __shared__ BlockState s;
    if (!load_state(a, &s)) return;
    const u32 W = a.world, me = a.rank;
    const u64 m = per_block<T>(a, W - 1 ? W - 1 : 1, a.count);
    const u64 per_step = m * gridDim.x;
    const u64 steps = steps_for(a.count, per_step);
    const T* in = reinterpret_cast<const T*>(a.in);
    T* out = reinterpret_cast<T*>(a.out);
    for (u64 st = 0; st < steps; st++) {
        const u32 par = (s.step + (u32)st) & 1;
        const u64 lo = st * per_step + blockIdx.x * m;
        const u64 hi = min64(lo + m, a.count);
        for_packs<T>(
            lo, hi, [&](Pack<T>& p, u64 i) { load_pack(p, in, i, hi); },
            [&](const Pack<T>& p, u64 i) {
                for (u32 j0 = 1; j0 < W; j0++) {
                    const u32 j = (me + j0) % W;
                    store_stage(p, reinterpret_cast<T*>(stage_of(a, j, par)) + slot_of(me, j) * m, i - lo);
                }
            });
        BARRIER_OR_RETURN(a, s, steps)
        const T* mine = reinterpret_cast<const T*>(stage_of(a, me, par));
        reduce_packs<T>(
            lo, hi, W, op, staged_sources<T>(in, mine, me, m, lo, hi),
            [&](const Pack<T>& p, u64 i) { store_pack(p, out, i, hi); });
    }
    save_state(a, &s, steps);
    note_call(a, a.count * sizeof(T), 2);
}

// all_reduce in place (in and out in the pool, out may alias in): rank r owns shard r;
// for each element of it, one thread reads that element of every rank's input (rank
// order), reduces, and writes the result into every rank's output; then one barrier.
// No barrier is needed between the reads and the writes: an element index is read and
// written, on every rank, by that one thread only (reads before its dependent writes), so
// aliasing in and out is safe. The closing barrier orders every push before each rank's
// later work, and every read of my buffers before I return.
template <typename T>
__device__ void ar_in_place(const Args& a, BlockState& s, u32 op) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count, P = Pack<T>::N;
    const u64 shard = round_up((n + W - 1) / W, P);
    u64 lo, hi;
    block_range(shard, P, &lo, &hi);
    const u64 slo = min64(me * shard + lo, n), shi = min64(me * shard + hi, n);
    reduce_packs<T>(
        slo, shi, W, op, [&](u32 j, Pack<T>& q, u64 i) { load_pack(q, peer_in<T>(a, j), i, shi); },
        [&](const Pack<T>& p, u64 i) {
            for (u32 j0 = 0; j0 < W; j0++) store_pack(p, peer_out<T>(a, (me + j0) % W), i, shi);
        });
    barrier(a, &s);
}

// all_reduce, two-shot: reduce-scatter then all-gather, both through staging, with ONE
// barrier per step. Each step, block b takes m elements split into `world` shards.
// Staging holds an RS area and an AG area of world - 1 shard slots each.
//   push(0) (phase A of step 0: shard j of my input into rank j's RS slot for me); barrier(0)
//   (staged_start's barrier, or its second one when a rank offered in-place buffers)
//   step s, between barrier(s) and barrier(s + 1), two thread groups at once:
//     X (the first AR_X_THREADS threads): copy the AG slots of step s - 1 into my output
//        (they arrived before barrier(s): each peer pushed them before signalling it),
//        then phase A of step s + 1 (push shard j of my input into rank j's RS slot);
//     Y (the other threads): reduce shard `rank` of step s in rank order (my own input
//        for myself), write it to my output and push it into every peer's AG slot for me.
//   barrier(s + 1); after the last step's barrier, the last AG copy (every thread).
//   A message of one step has nothing for X, so there Y is every thread (as before the
//   split).
// So the local copy-out of one step and the NVLink pushes of the next run beside the
// reduction and its pushes, rather than one after the other in the same threads
// (issue 26). X and Y touch disjoint memory: X reads my AG slots of step s - 1's parity and
// my input, writes my output outside shard `rank` of step s - 1 and the peers' RS slots of
// step s + 1's parity; Y reads my RS slots of step s's parity and my input, writes shard
// `rank` of step s of my output and the peers' AG slots of step s's parity. The output
// may be the input (torch's all_reduce is in place): X writes step s - 1's range and reads
// step s + 1's, Y reads and writes step s's, and the step ranges never overlap; within Y
// each thread reads an element before it writes it. barrier() starts with a bar.sync, so
// both groups' stores are ordered before its release.
// Y's reduction issues 4 packs of one source at a time (reduce_packs<T, 4, 1>), not
// 2 packs of 4 sources: its store pushes each result to every peer, and more packs per
// round keep more of those pushes in flight (4 H100s, bf16: 1 GiB 5,512 -> 5,302 us, 256 MiB
// 1,435 -> 1,394 us; docs/performance.md, issue 30).
// Reuse (step parities alternate): a peer writes my RS slots of parity p (step s's) again
// in step s + 1 (its X pushes step s + 2), after barrier(s + 1), which needs my signal
// given after my Y reduced step s (my last read of them); it writes my AG slots of parity
// p again in step s + 2 (its Y pushes step s + 2's results), after barrier(s + 2), which
// needs my signal given after my step s + 1, whose X copied them out. Step 0's RS slots are
// written before barrier(0), by push(0) in staged_start, as the slots of step s + 1 are
// before barrier(s + 1).
// X's share, measured (4 H100s, bf16, eager, 2026-11-27, A B C D E twice in one call): X of
// 320 threads against 256 made 1 GiB 5,229/5,231 -> 4,918/5,062 us and 256 MiB 1,332/1,347
// -> 1,270/1,272 us; 384 was between the two (docs/performance.md, issue 26).
#ifndef AR_X_THREADS
#define AR_X_THREADS 320
#endif
static_assert(AR_X_THREADS % 32 == 0 && AR_X_THREADS > 0 && AR_X_THREADS < THREADS, "AR_X_THREADS: whole warps, and some for the other group");
template <typename T>
__device__ __forceinline__ void copy_ag(const Args& a, u64 st, u64 per_step, u64 m, u64 shard, const T* ag, T* out, u32 tid,
                                        u32 nt) {
    const u32 W = a.world, me = a.rank;
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, a.count);
    for (u32 j0 = 1; j0 < W; j0++) {
        const u32 j = (me + j0) % W;
        const u64 slo = lo + j * shard;
        const u64 shi = min64(slo + shard, hi);
        const T* src = ag + slot_of(j, me) * shard;
        for_packs_by<T>(
            slo, shi, tid, nt, [&](Pack<T>& p, u64 i) { load_stage(p, src, i - slo); },
            [&](const Pack<T>& p, u64 i) { store_pack(p, out, i, shi); });
    }
}

// Phase A of step st: shard j of my input into rank j's RS slot for me.
template <typename T>
__device__ __forceinline__ void twoshot_push(const Args& a, u64 st, u64 per_step, u64 m, u64 shard, u32 par, u32 tid, u32 nt) {
    const u32 W = a.world, me = a.rank;
    const T* in = reinterpret_cast<const T*>(a.in);
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, a.count);
    for (u32 j0 = 1; j0 < W; j0++) {
        const u32 j = (me + j0) % W;
        const u64 slo = lo + j * shard;
        const u64 shi = min64(slo + shard, hi);
        T* dst = reinterpret_cast<T*>(stage_of(a, j, par)) + slot_of(me, j) * shard;
        for_packs_by<T>(
            slo, shi, tid, nt, [&](Pack<T>& p, u64 i) { load_pack(p, in, i, shi); },
            [&](const Pack<T>& p, u64 i) { store_stage(p, dst, i - slo); });
    }
}

template <typename T>
__device__ void ar_twoshot(const Args& a, u32 op) {
    __shared__ BlockState s;
    if (!load_state(a, &s)) return;
    if (ring_on(a)) {  // NOTE [Ring]
        ring_call<T>(a, s, RING_AR, op, a.count * sizeof(T), [&] { ar_in_place<T>(a, s, op); });
        return;
    }
    const u32 W = a.world, me = a.rank;
    const u32 slots = W > 1 ? W - 1 : 1;
    const u64 shard = per_block<T>(a, 2 * slots, (a.count + W - 1) / W);
    const u64 m = shard * W;
    const u64 per_step = m * gridDim.x;
    const u64 steps = steps_for(a.count, per_step);
    const T* in = reinterpret_cast<const T*>(a.in);
    T* out = reinterpret_cast<T*>(a.out);
    if (!staged_start(
            a, s, a.count * sizeof(T), [&] { twoshot_push<T>(a, 0, per_step, m, shard, s.step & 1, threadIdx.x, blockDim.x); },
            [&] { ar_in_place<T>(a, s, op); }))
        return;
    const bool x = steps > 1 && threadIdx.x < AR_X_THREADS;  // one step: every thread is Y
    const u32 tid = steps == 1 || x ? threadIdx.x : threadIdx.x - AR_X_THREADS;
    const u32 nt = steps == 1 ? blockDim.x : x ? AR_X_THREADS : blockDim.x - AR_X_THREADS;
    for (u64 st = 0; st < steps; st++) {
        const u32 par = (s.step + (u32)st) & 1;
        if (x) {
            if (st > 0) {
                const T* ag = reinterpret_cast<const T*>(stage_of(a, me, par ^ 1)) + slots * shard;
                copy_ag<T>(a, st - 1, per_step, m, shard, ag, out, tid, nt);
            }
            if (st + 1 < steps) twoshot_push<T>(a, st + 1, per_step, m, shard, par ^ 1, tid, nt);
        } else {
            const u64 lo = st * per_step + blockIdx.x * m;
            const u64 hi = min64(lo + m, a.count);
            const T* rs = reinterpret_cast<const T*>(stage_of(a, me, par));
            const u64 slo = lo + me * shard;
            const u64 shi = min64(slo + shard, hi);
            reduce_packs_by<T, 4, 1>(
                slo, shi, tid, nt, W, op, staged_sources<T>(in, rs, me, shard, slo, shi),
                [&](const Pack<T>& p, u64 i) {
                    store_pack(p, out, i, shi);
                    for (u32 j0 = 1; j0 < W; j0++) {
                        const u32 j = (me + j0) % W;
                        store_stage(p, reinterpret_cast<T*>(stage_of(a, j, par)) + (slots + slot_of(me, j)) * shard, i - slo);
                    }
                });
        }
        // barrier(st + 1): the AG pushes of step st and the RS pushes of step st + 1 arrive
        // before its signals; the last one is the call's last barrier.
        BARRIER_OR_RETURN(a, s, steps + 1)
    }
    {
        const u32 par = (s.step + (u32)(steps - 1)) & 1;
        const T* ag = reinterpret_cast<const T*>(stage_of(a, me, par)) + slots * shard;
        copy_ag<T>(a, steps - 1, per_step, m, shard, ag, out, threadIdx.x, blockDim.x);
    }
    save_state(a, &s, steps);
}

// The low-latency all_reduce (rs_ar_ll_*): NOTE [Low latency] in low_latency.cuh.
template <typename T>
__device__ void ar_ll(const Args& a, u32 op) {
    ll_call<T, LL_ALL_REDUCE>(a, op);
}

RS_TYPES(ar_oneshot)
RS_TYPES(ar_twoshot)
RS_TYPES(ar_ll)
