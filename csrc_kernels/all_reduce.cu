// all_reduce: one-shot and two-shot (rs_ar_oneshot_*, rs_ar_twoshot_*).

#include "common.cuh"

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

// NOTE [Low latency]
// all_reduce of at most LL_MAX_BYTES (decide::choose_allreduce), without the barrier's
// wait on a release (docs/performance.md, 2026-11-27: of a one-shot's 8-10 us under CUDA
// graphs, 5.7-7.5 are its pushes and its one barrier). Block b of the small grid, e = its
// epoch + 1 (the call counts as one barrier epoch, NOTE [Lockstep blocks]), buffer
// k = e % LL_BUFS:
//   1. warp 0, lane j < world: what a barrier's first signal does (this rank's descriptor,
//      with the grid, into rank j's desc slot, then a st.release.sys of e into rank j's
//      flags[b][me]), so that a peer whose mismatched call took a barrier path passes its
//      barrier and sees the mismatch (NOTE [Agreement]), and NOTE [Grids] holds. It runs
//      beside the data stores (no bar.sync before it): its release covers the descriptor.
//   2. the other threads ("workers"): lane j < world of warp 1 first stores this block's
//      header {desc0's low 24 bits | grid << 24, e, count, e} into peer j's header
//      [k][me][b]; then every worker stores its packs of the block's range as LL words
//      {4 bytes of data, e} (two 16-byte stores per 16-byte pack) into every peer's slot
//      [k][me]. No fence: each 8-byte word is written whole (single-copy atomic, aligned)
//      and carries its own epoch.
//   3. warp 0, lane j < world, j != me: spins (ld.volatile, 16 bytes) on its header from j
//      until both epochs read e, then compares it with this call's: another call is a
//      mismatch (reported as the barrier reports one). Every 256 spins it also looks at the
//      barrier's flag from j (ld.acquire.sys): once it is >= e, j has signalled this epoch,
//      and its descriptor in the desc slot (written before that release) is exact: if it
//      differs, j's call took another path (or another size): a mismatch, found without a
//      header; if it is the same, j's header is on its way. And the stop checks of every
//      bounded wait (NOTE [Bounded waits]).
//   4. bar.sync. A mismatch: block 0 stands in for blocks beyond this grid (NOTE [Grids]),
//      the counters move as a mismatched block's do ({e, step + 1}), and nothing is written.
//   5. the workers reduce their packs in rank order: their own input for this rank, for
//      each peer the two LL stores it made, spun on (ld.volatile) until both epochs read e;
//      the same thread reads its input pack in 2 and here before it writes the output pack,
//      so `in` may alias `out`.
// Why the words are this call's: the slots are not per block, so this kernel needs every
// block of its grid at the same epoch, on every rank. They are: every kernel that moves the
// counters runs every block of the small grid (decide::grid: a call's grid is the small
// grid or the group's, which holds it), and the stand-in (NOTE [Grids]) moves only blocks
// beyond the small grid; the one-block barriers of the copy
// engines (NOTE [Copy engines]) would move block 0 alone, so a group with copy-engine
// collectives never runs this kernel (decide::choose_allreduce). Then a word holds epoch e
// only if a peer's block wrote it in its call of epoch e (epochs only grow, once per
// barrier; equal values come back after 2^32 of them), and that call is this one: its
// header, in the same buffer with the same epoch, matched in 3.
// Buffer reuse: rank r writes buffer k = e % LL_BUFS at its epoch e only after it left
// epoch e - 1, for which it waited on every peer (a barrier, or this path's words of e - 1):
// every peer had reached e - 1, so it had finished every call of epoch e - 2 or before, and
// with them its reads of buffer k at e - 2 or earlier; a peer still in e - 1 reads the
// other buffer (LL_BUFS = 2, a power of two: e and e - 1 differ in parity across the wrap
// too). The desc slots are used as by a barrier.
__device__ __forceinline__ void st_ll(u64 addr, u32 d0, u32 d1, u32 e) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %2};" ::"l"(addr), "r"(d0), "r"(e), "r"(d1) : "memory");
}
__device__ __forceinline__ uint4 ld_ll(u64 addr) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(addr) : "memory");
    return v;
}
__device__ __forceinline__ u64 ll_slot(const Args& a, u32 rank, u32 k, u32 src) {
    return a.peer[rank] + LL_OFF + ((u64)k * MAX_RANKS + src) * LL_SLOT;
}
__device__ __forceinline__ u64 ll_header(const Args& a, u32 rank, u32 k, u32 src) {
    return a.peer[rank] + LL_HDR_OFF + (((u64)k * MAX_RANKS + src) * MAX_BLOCKS + blockIdx.x) * 16;
}

// Spin until the LL line at `addr` holds epoch e in both words; false if the wait failed
// (reported; `peer` is the rank waited for).
__device__ __noinline__ bool ll_wait_slow(const Args& a, u64 addr, u32 e, u32 peer, uint4* v) {
    const u64 start = global_ns();
    u32 spins = 0;
    for (;;) {
        *v = ld_ll(addr);
        if (v->y == e && v->w == e) return true;
        if (spin_must_stop(a, start, &spins, peer)) return false;
    }
}
__device__ __forceinline__ bool ll_wait(const Args& a, u64 addr, u32 e, u32 peer, uint4* v) {
    *v = ld_ll(addr);
    if (v->y == e && v->w == e) return true;
    return ll_wait_slow(a, addr, e, peer, v);
}

// Peer j called another collective (its descriptor, or what its header holds of it): report
// it as a barrier does and keep its grid for the stand-in (NOTE [Grids]).
__device__ __forceinline__ void ll_mismatch(const Args& a, BlockState* s, u32 j, const u64* theirs) {
    atomicMax(&s->grid_max, (u32)(theirs[0] >> DESC0_GRID_SHIFT));
    report_mismatch(a, j, theirs);
    s->mismatch = 1;
}

// Step 3 for peer j: s->abort set if the wait failed (reported); a mismatch is reported
// and marked in `s`.
__device__ __noinline__ void ll_check_peer(const Args& a, BlockState* s, u32 j, u32 e, u32 h0, u32 h1) {
    const u64 hdr = ll_header(a, a.rank, e % LL_BUFS, j);
    const u32* flag = flag_ptr(a.peer[a.rank], blockIdx.x, j);
    const u64 start = global_ns();
    u32 spins = 0;
    for (;;) {
        const uint4 v = ld_ll(hdr);
        if (v.y == e && v.w == e) {
            const u64 theirs[2] = {(u64)(v.x & 0xffffff) | ((u64)(v.x >> 24) << DESC0_GRID_SHIFT), v.z};
            if (v.x != h0 || v.z != h1) ll_mismatch(a, s, j, theirs);
            return;
        }
        // At the stop checks' pace: j signalled this epoch through a barrier's flag, so its
        // descriptor (stored before that release) is exact.
        if ((spins & 255) == 255 && (i32)(ld_acquire_sys(flag) - e) >= 0) {
            const u64* d = desc_ptr(a.peer[a.rank], e, blockIdx.x, j);
            const u64 theirs[2] = {d[0], d[1]};
            if (theirs[0] != desc0_with_grid(a) || theirs[1] != a.desc1) {
                ll_mismatch(a, s, j, theirs);
                return;
            }
        }
        if (spin_must_stop(a, start, &spins, j)) {
            s->abort = 1;
            return;
        }
    }
}

template <typename T>
__device__ void ar_ll(const Args& a, u32 op) {
    __shared__ BlockState s;
    if (!load_state(a, &s)) return;
    const u32 W = a.world, me = a.rank, t = threadIdx.x;
    const u32 e = s.epoch + 1, k = e % LL_BUFS;
    const u64 n = a.count, P = Pack<T>::N;
    const u32 h0 = (u32)(a.desc0 & 0xffffff) | (gridDim.x << 24), h1 = (u32)a.desc1;
    u64 lo, hi;
    block_range(n, P, &lo, &hi);
    const T* in = reinterpret_cast<const T*>(a.in);
    T* out = reinterpret_cast<T*>(a.out);
    const u32 nt = blockDim.x - 32, tid = t - 32;  // the workers: every warp but warp 0
    if (t < 32) {
        if (t < W) {  // 1.
            u64* d = desc_ptr(a.peer[t], e, blockIdx.x, me);
            d[0] = desc0_with_grid(a);
            d[1] = a.desc1;
            d[2] = a.place_in;
            d[3] = a.place_out;
            st_release_sys(flag_ptr(a.peer[t], blockIdx.x, me), e);
        }
        if (t < W && t != me) ll_check_peer(a, &s, t, e, h0, h1);  // 3.
    } else {
        if (tid < W && tid != me) st_ll(ll_header(a, tid, k, me), h0, h1, e);  // 2.
        for (u64 i = lo + tid * P; i < hi; i += (u64)nt * P) {
            Pack<T> p;
            load_pack(p, in, i, hi);
            const uint4 w = *reinterpret_cast<const uint4*>(&p);
            const u64 line = i / P * 32;
            for (u32 j0 = 1; j0 < W; j0++) {
                const u64 dst = ll_slot(a, (me + j0) % W, k, me) + line;
                st_ll(dst, w.x, w.y, e);
                st_ll(dst + 16, w.z, w.w, e);
            }
        }
    }
    __syncthreads();  // 4.
    if (s.abort) {  // counters unsaved; the busy word released (save_state)
        save_state(a, &s, 1);
        return;
    }
    if (s.mismatch) {
        if (blockIdx.x == 0 && s.grid_max > gridDim.x) stand_in(a, s.grid_max);
        if (t == 0) s.epoch = e;
        save_state(a, &s, 1);
        return;
    }
    if (t >= 32) {  // 5.
        for (u64 i = lo + tid * P; i < hi; i += (u64)nt * P) {
            typedef typename Acc<T>::type A;
            A acc[Pack<T>::N];
            const u64 line = i / P * 32;
            for (u32 j = 0; j < W; j++) {
                Pack<T> q;
                if (j == me) {
                    load_pack(q, in, i, hi);
                } else {
                    uint4 v0, v1;
                    const u64 src = ll_slot(a, me, k, j) + line;
                    if (!ll_wait(a, src, e, j, &v0) || !ll_wait(a, src + 16, e, j, &v1)) {
                        s.abort = 1;  // reported; every thread returns after the bar.sync
                        break;
                    }
                    uint4 w;
                    w.x = v0.x;
                    w.y = v0.z;
                    w.z = v1.x;
                    w.w = v1.z;
                    *reinterpret_cast<uint4*>(&q) = w;
                }
                reduce_pack(q, acc, j == 0, op);
            }
            if (s.abort) break;
            Pack<T> r;
            finish_pack(r, acc, W, op);
            store_pack(r, out, i, hi);
        }
    }
    __syncthreads();
    if (!s.abort && t == 0) s.epoch = e;
    save_state(a, &s, 1);  // after an abort: counters unsaved, the busy word released
    if (!s.abort) note_call(a, n * sizeof(T), 2);
}

RS_TYPES(ar_oneshot)
RS_TYPES(ar_twoshot)
RS_TYPES(ar_ll)
