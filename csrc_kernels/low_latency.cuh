// The low-latency kernels' protocol (NOTE [Low latency]) and their one template, ll_call,
// which rs_ar_ll_* (all_reduce.cu), rs_reduce_scatter_ll_* (reduce_scatter.cu) and
// rs_all_gather_ll (all_gather.cu) run. Their slots' addressing and the rewrite of old words
// are in protocol.cuh (NOTE [Low latency epochs]): every kernel's start needs them.

#pragma once

#include "common.cuh"

// NOTE [Low latency]
// all_reduce, reduce_scatter and all_gather whose data per sender (all_reduce: the message;
// reduce_scatter: the output shard; all_gather: the input) is at most the group's
// cuda_low_latency_max_bytes (<= ll_max_bytes(world); decide::kernel), without the
// barrier's wait on a release (docs/performance.md, 2026-11-27: of a one-shot's 8-10 us
// under CUDA graphs, 5.7-7.5 are its pushes and its one barrier). Block b of the grid, e =
// its epoch + 1 (the call counts as one barrier epoch, NOTE [Lockstep blocks]), buffer k =
// e % LL_BUFS:
//   1. every thread but warp 0's ("workers"): lane j < world of warp 1 first stores this
//      block's header {desc0's low 24 bits | grid << 24, e, count, e} into peer j's header
//      [k][me][b]; then every worker stores its packs of the block's range of what goes to
//      peer j (all_reduce, all_gather: the input; reduce_scatter: the input's shard j) as
//      LL words {4 bytes of data, e} (two 16-byte stores per 16-byte pack) into block b's
//      region of peer j's slot [k][me]. No fence: each 8-byte word is written whole
//      (single-copy atomic, aligned) and carries its own epoch.
//   2. warp 0, lane j < world, j != me: spins (ld.volatile, 16 bytes) on its header from j
//      until both epochs read e, then compares it with this call's: another call is a
//      mismatch (reported as the barrier reports one). Every 256 spins it also looks at the
//      barrier's flag from j (ld.acquire.sys), for a peer whose call took a barrier path
//      (another size, or another collective), which writes no header: once the flag is >=
//      e, it reads the header once more, and if that holds e either, goes on as above;
//      if not, j's descriptor in the desc slot of e is exact (below), and if it differs
//      from this call's, that is a mismatch, found without a header; if it is the same,
//      j's header is on its way. And the stop checks of every bounded wait (NOTE [Bounded
//      waits]).
//   3. bar.sync. After a mismatch, or when e is a multiple of LL_SIGNAL_EPOCHS: lane j <
//      world of warp 0 does what a barrier's first signal does (this rank's descriptor,
//      with the grid, into rank j's desc slot of e, then a st.release.sys of e into rank
//      j's flags[b][me]), so that a peer whose call took a barrier path passes its barrier
//      and sees the mismatch (NOTE [Agreement]), and so that no flag falls 2^31 epochs
//      behind (below). A mismatch: block 0 stands in for blocks beyond this grid (NOTE
//      [Grids]); the counters move as a mismatched block's do ({e, step + 1}), and nothing
//      is written.
//   4. the workers read, for each peer j, the two LL stores per pack that j made into their
//      block's region of slot [k][j], spun on (ld.volatile) until both epochs read e, and
//      this rank's own part from its input: all_reduce and reduce_scatter reduce them in
//      rank order (every rank computes the same bits), all_gather stores each into its
//      block of the output. The thread that writes an output pack read every input pack
//      that may alias it (its own part, in 1 or here) itself, before, so the output may be
//      the input (all_reduce), the input's own shard (reduce_scatter) or hold the input as
//      its own block (all_gather).
// No signal when the calls agree (but once every LL_SIGNAL_EPOCHS): a release at system
// scope waits for this thread's remote stores to be acknowledged, a round trip over
// NVLink, and signalling e in every call (as a barrier does) cost 1.5-2 us of the 7-9 under
// CUDA graphs (docs/performance.md, "4 H100s, 2026-11-27, 17:44-18:12 UTC"). The flags are
// read by barriers (a wait for >= e') and by 2 only: a later barrier's wait for e' > e is
// met by that barrier's signal, and a barrier-path peer at e that waits for this rank's e
// gets it in 3, since this rank's 2 finds the mismatch from that peer's flag (a barrier
// signals before it waits). Those reads compare wrap-safe ((i32)(flag - e) >= 0), which
// is exact while a flag is less than 2^31 behind: every epoch of block b is moved by a
// barrier, a stand-in or a low-latency call, and each of them signals the multiples of
// LL_SIGNAL_EPOCHS (2^20: one release per million calls), so a flag is less than 2^20
// behind.
// Why, in 2, a flag >= e with no header of e means that j's desc slot of e holds j's call
// of e: j's flag reached e or more by a release that j made (a) at a barrier or stand-in of
// epoch e, after storing its descriptor there; or (b) in 3 of its own low-latency call of
// e, or (c) in a kernel after its call of e. In (b) and (c) j's call of e was a low-latency
// one, whose header store (1) is ordered before that release: by the bar.sync of 3, or by
// the kernel boundary; the release is cumulative, so the header read after the acquire
// holds e, and the slot is not read. In (a) the slot holds j's descriptor of e until j
// writes that parity again at e + 2, which needs this rank's e + 1.
// Why the words are this call's: block b's region of slot [k][j] (what the block's range
// takes at ll_max_bytes(world), ceil(ll_max_bytes(world) / 16 / grid) lines of 32 bytes
// whatever T: ll_region_at in protocol.cuh; the grid is the group's, in Args::flags, which
// the host launches these kernels with) is written by block b of rank j only, at block b's
// epochs, and block b's epoch is the same on every rank (NOTE [Lockstep blocks]), whatever
// other blocks' epochs are (the copy engines' one-block barriers move block 0 alone; the
// stand-in moves blocks beyond the small grid). A word
// there holds epoch e only if j's block b wrote it in its call of epoch e (epochs only
// grow, once per barrier; equal values come back after 2^32 of them), and that call is this
// one: its header, in the same buffer with the same epoch, matched in 2. The grid is in the
// header, so two calls whose grids (and so regions) differ mismatch there.
// Buffer reuse: block b of rank r writes buffer k = e % LL_BUFS at its epoch e only after it
// left epoch e - 1, for which it waited on every peer's block b (a barrier, or this path's
// words of e - 1): each had reached e - 1, so it had finished its calls of epoch e - 2 or
// before, and with them its reads of buffer k at e - 2 or earlier; a block still in e - 1
// reads the other buffer (LL_BUFS = 2, a power of two: e and e - 1 differ in parity across
// the wrap too). Where e - 1 was a stand-in's (NOTE [Grids]: a copy-engine call's one-block
// barrier moves blocks 1.. along), the stand-in ran after its block waited on every peer's
// block 0 in that call, whose kernels had then finished every earlier kernel of theirs,
// with their reads of buffer k. The desc slots are written as by a barrier's first signal
// when 3 signals, and read in 2 in case (a) only. Epochs are 32 bits: what keeps a word of
// 2^32 epochs ago from being taken is NOTE [Low latency epochs] (protocol.cuh).
#define LL_SIGNAL_EPOCHS (1u << 20)
static_assert(LL_BUFS == 2, "LL_BUFS: consecutive epochs must pick different buffers across the u32 wrap");
__device__ __forceinline__ uint4 ld_ll(u64 addr) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(addr) : "memory");
    return v;
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
// The pack peer `j` stored as the two LL lines at `src` (step 4); false if the wait failed.
template <typename T>
__device__ __forceinline__ bool ll_read(const Args& a, u64 src, u32 e, u32 j, Pack<T>& q) {
    uint4 v0, v1;
    if (!ll_wait(a, src, e, j, &v0) || !ll_wait(a, src + 16, e, j, &v1)) return false;
    *reinterpret_cast<uint4*>(&q) = make_uint4(v0.x, v0.z, v1.x, v1.z);
    return true;
}

// Peer j called another collective (its descriptor, or what its header holds of it): report
// it as a barrier does and keep its grid for the stand-in (NOTE [Grids]).
__device__ __forceinline__ void ll_mismatch(const Args& a, BlockState* s, u32 j, const u64* theirs) {
    atomicMax(&s->grid_max, (u32)(theirs[0] >> DESC0_GRID_SHIFT));
    report_mismatch(a, j, theirs);
    s->mismatch = 1;
}

// Step 2 for peer j: s->abort set if the wait failed (reported); a mismatch is reported
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
        // At the stop checks' pace: j's flag reached e. A header of e that the acquire
        // made visible is taken at the top of the loop; without one, j's descriptor of e is
        // exact (NOTE [Low latency]: (a)).
        if ((spins & 255) == 255 && (i32)(ld_acquire_sys(flag) - e) >= 0) {
            const uint4 w = ld_ll(hdr);
            if (w.y == e && w.w == e) continue;
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

// What a low-latency kernel does with the data (NOTE [Low latency]).
enum LlKind : u32 { LL_ALL_REDUCE, LL_REDUCE_SCATTER, LL_ALL_GATHER };

// A low-latency call of `count` elements of T per sender (all_gather: bytes, T = u8):
// NOTE [Low latency], steps 1-4.
template <typename T, LlKind K>
__device__ void ll_call(const Args& a, u32 op) {
    __shared__ BlockState s;
    if (!load_state(a, &s, true)) return;
    const u32 W = a.world, me = a.rank, t = threadIdx.x;
    const u32 e = s.epoch + 1, k = e % LL_BUFS;
    const u64 n = a.count, P = Pack<T>::N;
    const u32 h0 = (u32)(a.desc0 & 0xffffff) | (gridDim.x << 24), h1 = (u32)a.desc1;
    u64 lo, hi;
    block_range(n, P, &lo, &hi);
    const T* in = reinterpret_cast<const T*>(a.in);
    T* out = reinterpret_cast<T*>(a.out);
    // What goes to peer j starts at in + j * shard (reduce_scatter: its shard); this rank's
    // own part at in + me * shard.
    const u64 shard = K == LL_REDUCE_SCATTER ? n : 0;
    const u32 nt = blockDim.x - 32, tid = t - 32;  // the workers: every warp but warp 0
    if (t < 32) {
        if (t < W && t != me) ll_check_peer(a, &s, t, e, h0, h1);  // 2.
    } else {
        if (tid < W && tid != me) st_ll(ll_header(a, tid, k, me), h0, h1, e);  // 1.
        for (u64 i = lo + tid * P; i < hi; i += (u64)nt * P) {
            const u64 line = (i - lo) / P * 32;
            Pack<T> p;
            if (shard == 0) load_pack(p, in, i, hi);
            for (u32 j0 = 1; j0 < W; j0++) {
                const u32 j = (me + j0) % W;
                if (shard != 0) load_pack(p, in + j * shard, i, hi);
                const uint4 w = *reinterpret_cast<const uint4*>(&p);
                const u64 dst = ll_region_at(a, j, k, me, blockIdx.x) + line;
                st_ll(dst, w.x, w.y, e);
                st_ll(dst + 16, w.z, w.w, e);
            }
        }
    }
    __syncthreads();  // 3.
    if (s.abort) {  // counters unsaved; the busy word released (save_state)
        save_state(a, &s, 1);
        return;
    }
    if ((s.mismatch || e % LL_SIGNAL_EPOCHS == 0) && t < W) {  // 3. (a block-uniform condition)
        put_desc(a, t, e, blockIdx.x, desc0_with_grid(a));
        st_release_sys(flag_ptr(a.peer[t], blockIdx.x, me), e);
    }
    if (s.mismatch) {
        if (blockIdx.x == 0 && s.grid_max > gridDim.x) stand_in(a, s.grid_max);
        if (t == 0) s.epoch = e;
        save_state(a, &s, 1);
        return;
    }
    if (t >= 32) {  // 4.
        for (u64 i = lo + tid * P; i < hi; i += (u64)nt * P) {
            const u64 line = (i - lo) / P * 32;
            if constexpr (K == LL_ALL_GATHER) {
                for (u32 j = 0; j < W; j++) {
                    Pack<T> q;
                    if (j == me) {
                        if (in == out + me * n) continue;  // in place: already there
                        load_pack(q, in, i, hi);
                    } else if (!ll_read(a, ll_region_at(a, me, k, j, blockIdx.x) + line, e, j, q)) {
                        s.abort = 1;  // reported; every thread returns after the bar.sync
                        break;
                    }
                    store_pack(q, out + j * n, i, hi);
                }
            } else {
                typedef typename Acc<T>::type A;
                A acc[Pack<T>::N];
                for (u32 j = 0; j < W; j++) {
                    Pack<T> q;
                    if (j == me) {
                        load_pack(q, in + me * shard, i, hi);
                    } else if (!ll_read(a, ll_region_at(a, me, k, j, blockIdx.x) + line, e, j, q)) {
                        s.abort = 1;  // reported; every thread returns after the bar.sync
                        break;
                    }
                    reduce_pack(q, acc, j == 0, op);
                }
                if (s.abort) break;
                Pack<T> r;
                finish_pack(r, acc, W, op);
                store_pack(r, out, i, hi);
            }
            if (s.abort) break;
        }
    }
    __syncthreads();
    if (!s.abort && s.ll_due) {  // NOTE [Low latency epochs]: this call's buffer, now read
        ll_refresh(a, k, e);
        if (t == 0) *ll_refreshed(a) = s.epoch;
        __threadfence_system();  // belt and braces beside the kernel boundary (rare path)
    }
    if (!s.abort && t == 0) s.epoch = e;
    save_state(a, &s, 1);  // after an abort: counters unsaved, the busy word released
    if (!s.abort) note_call(a, (K == LL_ALL_REDUCE ? 1 : W) * n * sizeof(T), 2);
}
