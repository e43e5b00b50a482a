// reduce_scatter (rs_reduce_scatter_*), and the reduction of reduce_scatter on the copy
// engines (rs_ce_reduce_*).

#include "common.cuh"

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

// EXPERIMENT (branch tma-rs, issue 26's "at most 32 CTAs"): the pushes of steps 1.. by the
// Hopper bulk-copy engine (TMA, cp.async.bulk) instead of 256 threads' 16-byte loads and
// stores: one thread of warp 0 moves each peer's piece HBM -> shared memory -> the peer's
// slot (NVLink) in RS_TMA_CHUNK-byte pieces through RS_TMA_BUFS shared buffers, so the other
// 480 threads reduce (warp 0's other lanes idle). With 32 CTAs the thread pushes moved about 7.4 GB/s per CTA at 1 GiB
// (4 H100s, 2026-11-27), bound by what 256 threads keep in flight; a bulk copy keeps a
// whole chunk in flight per instruction.
// Ordering: the load's completion is observed through its mbarrier (complete_tx), then
// fence.proxy.async.shared::cta before the bulk store reads that buffer; a buffer is
// reloaded only after cp.async.bulk.wait_group.read says the store that read it is done
// reading. Before the barrier, cp.async.bulk.wait_group 0 waits until every store of the
// step has completed (its writes performed), and fence.proxy.async orders those
// async-proxy writes before the generic proxy's bar.sync and the signalling thread's
// st.release.sys (NOTE [Barrier protocol]): so a peer that acquires the flag sees the
// step's bytes, as with the threads' stores.
// Used only where every address and size is 16-byte aligned (bulk copies need it); else
// the threads push as before. sm_90 and newer only.
#ifndef RS_TMA
#define RS_TMA 1
#endif
#define RS_TMA_CHUNK 8192
#define RS_TMA_BUFS 4
#if RS_TMA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define RS_TMA_ON 1
struct TmaBufs {
    alignas(128) u8 buf[RS_TMA_BUFS][RS_TMA_CHUNK];
    alignas(8) u64 bar[RS_TMA_BUFS];
};
__device__ __forceinline__ u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void tma_init(TmaBufs& t) {
    for (u32 k = 0; k < RS_TMA_BUFS; k++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&t.bar[k])) : "memory");
    // The bulk-copy unit (async proxy) must see the initialized barriers.
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Start a chunk's load HBM -> shared buffer k (its mbarrier completes when the bytes land).
__device__ __forceinline__ void tma_load(TmaBufs& t, u32 k, const void* src, u32 bytes) {
    const u32 bar = smem_addr(&t.bar[k]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(t.buf[k])),
                 "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(bar)
                 : "memory");
}
// Wait for buffer k's load (phase: the parity of the buffer's use count). The bulk store
// that reads the buffer is in the async proxy as the load was: no proxy fence between.
__device__ __forceinline__ void tma_loaded(TmaBufs& t, u32 k, u32 phase) {
    const u32 bar = smem_addr(&t.bar[k]);
    u32 done = 0;
    while (!done) {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done)
                     : "r"(bar), "r"(phase)
                     : "memory");
    }
}
__device__ __forceinline__ void tma_store(void* dst, const TmaBufs& t, u32 k, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(__cvta_generic_to_global(dst)), "r"(smem_addr(t.buf[k])),
                 "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Every store but the newest `N` has finished reading its buffer.
template <int N> __device__ __forceinline__ void tma_reads_done() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory"); }
// Every store has completed (its writes performed), ordered before the generic proxy's
// later accesses (the barrier's bar.sync and release).
__device__ __forceinline__ void tma_all_done() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async;" ::: "memory");
}

// Step st's pushes by lane 0 of warp 0, as a pipeline over the step's chunks (every peer's
// piece cut into RS_TMA_CHUNK bytes): up to RS_TMA_BUFS loads ahead; chunk c's store is
// issued once its load landed, and the buffer of chunk c - 1 takes chunk c - 1 + BUFS once
// that store has read it. `use` counts this block's buffer uses across steps (phases).
// Sizes are multiples of 16 bytes here (the caller's condition).
template <typename T>
__device__ __forceinline__ void rs_push_tma(const Args& a, TmaBufs& t, u32& use, u64 st, u64 per_step, u64 m, u32 par) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, n);
    if (threadIdx.x != 0 || lo >= hi) return;
    // The peers' last reads of the slots these stores overwrite (their reduce of step st - 2,
    // ordinary loads, before their release that the last barrier acquired) are ordered
    // before this thread's async-proxy writes only through a cross-proxy fence (PTX ISA,
    // async proxy: the implicit fence follows a bulk operation's completion, not its start).
    asm volatile("fence.proxy.async.global;" ::: "memory");
    const u64 bytes = (hi - lo) * sizeof(T);
    const u32 per = (u32)((bytes + RS_TMA_CHUNK - 1) / RS_TMA_CHUNK), C = per * (W - 1);
    const u8* in = reinterpret_cast<const u8*>(a.in);
    auto src_of = [&](u32 c, u32* len) {
        const u32 j = (me + 1 + c / per) % W;
        const u64 off = (u64)(c % per) * RS_TMA_CHUNK;
        *len = (u32)min64(RS_TMA_CHUNK, bytes - off);
        return in + (j * n + lo) * sizeof(T) + off;
    };
    auto dst_of = [&](u32 c) {
        const u32 j = (me + 1 + c / per) % W;
        return stage_of(a, j, par) + (u64)slot_of(me, j) * m * sizeof(T) + (u64)(c % per) * RS_TMA_CHUNK;
    };
    u32 len;
    for (u32 c = 0; c < C && c < RS_TMA_BUFS; c++) {
        const u8* src = src_of(c, &len);
        tma_load(t, (use + c) % RS_TMA_BUFS, src, len);
    }
    for (u32 c = 0; c < C; c++) {
        const u32 k = (use + c) % RS_TMA_BUFS;
        tma_loaded(t, k, ((use + c) / RS_TMA_BUFS) & 1);
        (void)src_of(c, &len);
        tma_store(dst_of(c), t, k, len);
        if (c >= 1 && c - 1 + RS_TMA_BUFS < C) {
            tma_reads_done<1>();  // chunk c - 1's store has read its buffer
            const u32 x = c - 1 + RS_TMA_BUFS;
            const u8* src = src_of(x, &len);
            tma_load(t, (use + x) % RS_TMA_BUFS, src, len);
        }
    }
    use += C;
    tma_all_done();
}
#else
#define RS_TMA_ON 0
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
