// rsccl's kernels: what every family shares beyond the protocol (protocol.cuh): element
// types and reduce ops (chosen at run time: NOTE [Reduce op at run time]), 16-byte packs,
// staging slots, the reduction in rank order, the per-thread copy loops, the in-place
// helpers and the entry-point macros.

#pragma once

#include "protocol.cuh"

// ---------------------------------------------------------------------------------------
// Scalar types and reduction ops. fp16/bf16 are accumulated in float.

struct f16 { u16 x; };
struct bf16 { u16 x; };

template <typename T> struct Acc { typedef T type; };
template <> struct Acc<f16> { typedef float type; };
template <> struct Acc<bf16> { typedef float type; };

__device__ __forceinline__ float widen(f16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
    return f;
}
__device__ __forceinline__ float widen(bf16 v) { return __uint_as_float(((u32)v.x) << 16); }
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ i32 widen(i32 v) { return v; }
__device__ __forceinline__ i64 widen(i64 v) { return v; }

template <typename T> __device__ __forceinline__ T narrow(typename Acc<T>::type a) { return a; }
template <> __device__ __forceinline__ f16 narrow<f16>(float a) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.x) : "f"(a));
    return r;
}
template <> __device__ __forceinline__ bf16 narrow<bf16>(float a) {
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.x) : "f"(a));
    return r;
}

// The ops' arithmetic; `reduce_pack` and `finish_pack` pick one by the call's op code.
struct OpSum { template <typename A> __device__ __forceinline__ static A f(A a, A b) { return a + b; } };
struct OpProd { template <typename A> __device__ __forceinline__ static A f(A a, A b) { return a * b; } };
struct OpMin { template <typename A> __device__ __forceinline__ static A f(A a, A b) { return b < a ? b : a; } };
struct OpMax { template <typename A> __device__ __forceinline__ static A f(A a, A b) { return b > a ? b : a; } };
// AVG is a sum, divided by the number of ranks at the end (floating types only).

// NOTE [Reduce op at run time]
// One kernel per (family, dtype) serves every reduce op (issue 30: one entry point per
// (family, dtype, op) made 100 fully inlined kernels, 47 MB of fat binaries for four
// arches and 7 min of nvcc CPU). The op is the call's (abi.cuh's OP_*, in Args::desc0),
// the same in every thread of the grid, so the switch on it at each pack is a uniform
// branch: no divergence, a few instructions per 16-byte pack on a memory-bound path.
// `uniform_op` hides the op's value from the optimizer at each use (an empty volatile asm:
// it cannot be hoisted out of the loop), so that no compiler unswitches the loops around
// the reduction back into one copy per op, which would bring the code size back. (nvcc
// 13.0 does not, even without it; the guard is for others, such as a newer NVRTC at run
// time. Sizes before and after: docs/performance.md, issue 30.) Integer kernels have no
// AVG code: they treat any op they do not know as SUM.

// The reduce op of this call, from its descriptor (every rank's is the same: the first
// barrier compares descriptors before any reduction).
__device__ __forceinline__ u32 desc_op(const Args& a) { return (u32)(a.desc0 >> DESC0_OP_SHIFT) & 0xff; }
__device__ __forceinline__ u32 desc_op(const CeReduceArgs& x) { return desc_op(x.a); }

__device__ __forceinline__ u32 uniform_op(u32 op) {
    asm volatile("" : "+r"(op));
    return op;
}

template <typename A> struct IsFloat { enum { value = 0 }; };
template <> struct IsFloat<float> { enum { value = 1 }; };

// ---------------------------------------------------------------------------------------
// 16-byte packs. A pack is 16 / sizeof(T) consecutive elements; a pack that runs past the
// end, or sits at an address that is not 16-byte aligned, moves element by element.

template <typename T> struct Pack {
    enum { N = 16 / sizeof(T) };
    T v[N];
};

template <typename T>
__device__ __forceinline__ void load_pack(Pack<T>& p, const T* base, u64 i, u64 n) {
    const T* src = base + i;
    if (i + Pack<T>::N <= n && (((u64)src) & 15) == 0) {
        *reinterpret_cast<uint4*>(&p) = *reinterpret_cast<const uint4*>(src);
    } else {
#pragma unroll
        for (int k = 0; k < Pack<T>::N; k++) {
            if (i + k < n) p.v[k] = src[k];
        }
    }
}

template <typename T>
__device__ __forceinline__ void store_pack(const Pack<T>& p, T* base, u64 i, u64 n) {
    T* dst = base + i;
    if (i + Pack<T>::N <= n && (((u64)dst) & 15) == 0) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&p);
    } else {
#pragma unroll
        for (int k = 0; k < Pack<T>::N; k++) {
            if (i + k < n) dst[k] = p.v[k];
        }
    }
}

// Staging is always 16-byte aligned and sized in whole packs.
template <typename T> __device__ __forceinline__ void load_stage(Pack<T>& p, const T* base, u64 i) {
    *reinterpret_cast<uint4*>(&p) = *reinterpret_cast<const uint4*>(base + i);
}
template <typename T> __device__ __forceinline__ void store_stage(const Pack<T>& p, T* base, u64 i) {
    *reinterpret_cast<uint4*>(base + i) = *reinterpret_cast<const uint4*>(&p);
}

// ---------------------------------------------------------------------------------------
// Staging and the reduction in rank order.

__device__ __forceinline__ u8* stage_of(const Args& a, u32 rank, u32 parity) {
    return reinterpret_cast<u8*>(a.peer[rank] + STAGE_OFF + (2ull * blockIdx.x + parity) * a.stage_per_block);
}

__device__ __forceinline__ u64 round_down(u64 x, u64 m) { return x - x % m; }
__device__ __forceinline__ u64 round_up(u64 x, u64 m) { return (x + m - 1) / m * m; }
__device__ __forceinline__ u64 min64(u64 a, u64 b) { return a < b ? a : b; }

// Elements per block and step: the fewest steps whose pieces fit `slots` slots of the
// staging half, then `count` split evenly over those steps and the grid (so small
// messages use every block, and no step is a sliver: 1.01 steps' worth runs as two equal
// halves on every block, not a full step and a step where most blocks idle). A multiple
// of 128 bytes where the staging allows (else of the pack size), so that slots and block
// ranges start on a cache line. (Balanced pieces rounded to 16 bytes only made all_reduce
// 4-7% slower at 256 MiB-1 GiB on 4 H100s than full-staging pieces, which the default
// buffer makes 128-byte multiples: docs/performance.md, issue 30. The likely reason: a
// warp's 512 bytes of pushes then touch 5 lines instead of 4.)
template <typename T>
__device__ __forceinline__ u64 per_block(const Args& a, u64 slots, u64 count) {
    const u64 G = gridDim.x, room = a.stage_per_block / slots / sizeof(T);
    const u64 L = room >= 128 / sizeof(T) ? 128 / sizeof(T) : Pack<T>::N;
    const u64 cap = round_down(room, L);
    // An empty message (the warm-up) still moves one pack's worth of nothing per block.
    if (count == 0 || cap == 0) return Pack<T>::N;
    const u64 steps = (count + cap * G - 1) / (cap * G);
    return round_up((count + G * steps - 1) / (G * steps), L);
}

// Steps of a kernel: at least one, so that even an empty message passes the first
// barrier (the one that checks descriptors).
__device__ __forceinline__ u64 steps_for(u64 count, u64 per_step) {
    const u64 n = (count + per_step - 1) / per_step;
    return n == 0 ? 1 : n;
}

// Staging slots hold data from the OTHER ranks only: at rank `me`, peer p's slot is
// p - (p > me), so a staging half is split in world - 1 slots (or 2 (world - 1) areas).
__device__ __forceinline__ u32 slot_of(u32 src, u32 me) { return src - (src > me ? 1 : 0); }

template <typename T, typename Op>
__device__ __forceinline__ void reduce_pack_with(const Pack<T>& p, typename Acc<T>::type* acc) {
    typedef typename Acc<T>::type A;
#pragma unroll
    for (int k = 0; k < Pack<T>::N; k++) acc[k] = Op::f(acc[k], (A)widen(p.v[k]));
}

// acc = p (first) or acc op p, element-wise, for the call's `op` (NOTE [Reduce op at run time]).
template <typename T>
__device__ __forceinline__ void reduce_pack(Pack<T>& p, typename Acc<T>::type* acc, bool first, u32 op) {
    if (first) {
#pragma unroll
        for (int k = 0; k < Pack<T>::N; k++) acc[k] = widen(p.v[k]);
        return;
    }
    switch (uniform_op(op)) {
    case OP_PROD: reduce_pack_with<T, OpProd>(p, acc); break;
    case OP_MIN: reduce_pack_with<T, OpMin>(p, acc); break;
    case OP_MAX: reduce_pack_with<T, OpMax>(p, acc); break;
    default: reduce_pack_with<T, OpSum>(p, acc); break; // SUM, and AVG's sum
    }
}

// p = acc, narrowed to T; AVG divides by the number of ranks first.
template <typename T>
__device__ __forceinline__ void finish_pack(Pack<T>& p, typename Acc<T>::type* acc, u32 W, u32 op) {
    typedef typename Acc<T>::type A;
    if (IsFloat<A>::value && uniform_op(op) == OP_AVG) {
#pragma unroll
        for (int k = 0; k < Pack<T>::N; k++) acc[k] = acc[k] / (A)W;
    }
#pragma unroll
    for (int k = 0; k < Pack<T>::N; k++) p.v[k] = narrow<T>(acc[k]);
}

// Count a collective of `bytes` (memory_stats) once it passed its first barrier (calls
// that mismatched are not counted, nor empty ones: the warm-up): slots 2-3 for every
// collective, 0-1 for those that ran in place; the host derives the staged ones. One thread of one block, with
// reductions (red.global: no result, so no stall); counted on the GPU so that graph
// replays count too.
__device__ __forceinline__ void note_call(const Args& a, u64 bytes, u32 slot) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && bytes != 0) {
        u64* st = reinterpret_cast<u64*>(a.peer[a.rank] + STATS_OFF);
        atomicAdd(reinterpret_cast<unsigned long long*>(st + slot), 1ull);
        atomicAdd(reinterpret_cast<unsigned long long*>(st + slot + 1), (unsigned long long)bytes);
    }
}
__device__ __forceinline__ void note_in_place(const Args& a, u64 bytes) { note_call(a, bytes, 0); }

// Every thread moves packs lo + (k * blockDim + threadIdx) * P, UNROLL packs at a time:
// all UNROLL loads are issued before the first store, so each thread keeps several 16-byte
// requests in flight (the compiler cannot hoist loads above stores that may alias).
#define UNROLL 4
// for_packs over the block's threads [t0, t0 + nt) only (`tid` = threadIdx.x - t0), so two
// thread groups of a block can move different data at once.
template <typename T, typename Load, typename Store>
__device__ __forceinline__ void for_packs_by(u64 lo, u64 hi, u32 tid, u32 nt, Load load, Store store) {
    const u64 P = Pack<T>::N;
    const u64 stride = (u64)nt * P;
    for (u64 base = lo + tid * P; base < hi; base += stride * UNROLL) {
        Pack<T> p[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const u64 i = base + u * stride;
            if (i < hi) load(p[u], i);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const u64 i = base + u * stride;
            if (i < hi) store(p[u], i);
        }
    }
}

template <typename T, typename Load, typename Store>
__device__ __forceinline__ void for_packs(u64 lo, u64 hi, Load load, Store store) {
    const u64 P = Pack<T>::N;
    const u64 stride = (u64)blockDim.x * P;
    for (u64 base = lo + threadIdx.x * P; base < hi; base += stride * UNROLL) {
        Pack<T> p[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const u64 i = base + u * stride;
            if (i < hi) load(p[u], i);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const u64 i = base + u * stride;
            if (i < hi) store(p[u], i);
        }
    }
}

// The reduction over sources 0 .. W - 1 in rank order of packs [lo, hi), by the block's
// threads [t0, t0 + nt) (`tid` = threadIdx.x - t0): `load(j, q, i)` loads source j's pack
// i into q, `store(p, i)` takes the result. Each thread issues the loads of REDUCE_UNROLL
// packs x SOURCES_IN_FLIGHT sources before adding any of them, so that 8 16-byte loads are
// in flight per thread (the load-then-add loop this replaced waited for memory once per
// source and pack: 4 H100s, bf16 reduce_scatter of 1 GiB, 262 -> 306 GB/s; docs/
// performance.md, issue 26); the additions keep rank order, so every rank that reduces an
// element gets the same bits. (More packs or accumulators per thread spill registers at
// 512 threads per block: a bf16 pack's accumulator is 8 floats.)
// `RU` x `SF` (packs x sources per round) can be chosen per caller: two-shot all_reduce,
// whose store pushes every result to all peers, does better with more packs and one source
// at a time (all_reduce.cu).
#define SOURCES_IN_FLIGHT 4
#define REDUCE_UNROLL 2
template <typename T, int RU = REDUCE_UNROLL, int SF = SOURCES_IN_FLIGHT, typename Load, typename Store>
__device__ __forceinline__ void reduce_packs_by(u64 lo, u64 hi, u32 tid, u32 nt, u32 W, u32 op, Load load, Store store) {
    typedef typename Acc<T>::type A;
    const u64 P = Pack<T>::N;
    const u64 stride = (u64)nt * P;
    for (u64 base = lo + tid * P; base < hi; base += stride * RU) {
        A acc[RU][Pack<T>::N];
        for (u32 j0 = 0; j0 < W; j0 += SF) {
            Pack<T> q[RU][SF];
#pragma unroll
            for (int u = 0; u < RU; u++) {
                const u64 i = base + u * stride;
#pragma unroll
                for (u32 v = 0; v < SF; v++)
                    if (i < hi && j0 + v < W) load(j0 + v, q[u][v], i);
            }
#pragma unroll
            for (int u = 0; u < RU; u++) {
#pragma unroll
                for (u32 v = 0; v < SF; v++)
                    if (j0 + v < W) reduce_pack(q[u][v], acc[u], j0 + v == 0, op);
            }
        }
#pragma unroll
        for (int u = 0; u < RU; u++) {
            const u64 i = base + u * stride;
            if (i < hi) {
                Pack<T> p;
                finish_pack(p, acc[u], W, op);
                store(p, i);
            }
        }
    }
}

template <typename T, int RU = REDUCE_UNROLL, int SF = SOURCES_IN_FLIGHT, typename Load, typename Store>
__device__ __forceinline__ void reduce_packs(u64 lo, u64 hi, u32 W, u32 op, Load load, Store store) {
    reduce_packs_by<T, RU, SF>(lo, hi, threadIdx.x, blockDim.x, W, op, load, store);
}

// The sources of a staged reduction: rank `own`'s input `in` (valid below `hi`) and the
// other ranks' staging slots (`slots` + slot_of(j, own) * width, at i - lo).
template <typename T>
__device__ __forceinline__ auto staged_sources(const T* in, const T* slots, u32 own, u64 width, u64 lo, u64 hi) {
    return [=](u32 j, Pack<T>& q, u64 i) {
        if (j == own) load_pack(q, in, i, hi);
        else load_stage(q, slots + slot_of(j, own) * width, i - lo);
    };
}

// ---------------------------------------------------------------------------------------
// NOTE [In place]
// In place: a call whose buffers lie in the pool passes their offsets in the block
//   (`place_in`/`place_out`, offset + 1; 0 = not in the pool or not eligible) in its
//   descriptor. The first barrier shows every rank every rank's offsets, so all ranks
//   decide alike, with no host round trip (and under graph replay): if every rank passed
//   the same non-zero offsets, the kernel reads and writes the peers' buffers directly
//   (`peer[j] + offset`) and uses no staging; otherwise it runs the staged algorithm. A
//   staged kernel pushes its first step before the first barrier; a rank that offered in
//   place did not, so when any rank offered, every rank pushes after that barrier and
//   passes one more before reading (all of them know that any rank offered).
//   In-place algorithms start after the first barrier (every peer's kernel has started,
//   so its buffers hold the caller's data and are no longer used by its earlier work) and
//   end with a barrier (no peer reads or writes my buffers after my kernel ends).
//
// The helpers below are called after the first barrier, when every
// rank passed the same pool offsets; `peer[j] + offset` is rank j's buffer. Elements are
// split in the same per-block ranges on every rank, so the per-block barriers order each
// element's producer before its consumers. No staging: counters' step parity is untouched.

__device__ __forceinline__ bool attempts(const Args& a) { return (a.place_in | a.place_out) != 0; }
__device__ __forceinline__ bool in_place(const Args& a, const BlockState& s) { return attempts(a) && !s.place_differs; }

template <typename T> __device__ __forceinline__ const T* peer_in(const Args& a, u32 j) {
    return reinterpret_cast<const T*>(a.peer[j] + a.place_in - 1);
}
template <typename T> __device__ __forceinline__ T* peer_out(const Args& a, u32 j) {
    return reinterpret_cast<T*>(a.peer[j] + a.place_out - 1);
}

// This block's share [lo, hi) of [0, n), in whole packs of P elements.
__device__ __forceinline__ void block_range(u64 n, u64 P, u64* lo, u64* hi) {
    const u64 per = round_up((n + gridDim.x - 1) / gridDim.x, P);
    *lo = min64((u64)blockIdx.x * per, n);
    *hi = min64(*lo + per, n);
}

// The start every kernel that may run in place shares (NOTE [In place]): pushes of step 0
// (`push0`) go before the first barrier unless this rank offered to run in place; after
// it, either the in-place algorithm runs (`inplace`, then the kernel returns) or the ranks
// that offered push their step 0 and, if any rank offered, all pass one more barrier.
// Returns false when the kernel must return (mismatch, abort, or done in place).
template <typename Push0, typename InPlace>
__device__ __forceinline__ bool staged_start(const Args& a, BlockState& s, u64 bytes, Push0 push0, InPlace inplace) {
    const bool offer = attempts(a);
    if (!offer) push0();
    if (!barrier(a, &s)) {
        save_state(a, &s, 1);
        return false;
    }
    note_call(a, bytes, 2);
    if (in_place(a, s)) {
        note_in_place(a, bytes);
        inplace();
        save_state(a, &s, 0);
        return false;
    }
    if (offer) push0();
    if (s.any_attempt && !barrier(a, &s)) {
        save_state(a, &s, 1);
        return false;
    }
    return true;
}

// NOTE [Bulk-copy pushes]
// reduce_scatter's and all_gather's pushes go by the Hopper bulk-copy engine (TMA,
// cp.async.bulk) instead of many threads' 16-byte loads and stores: one thread
// (threadIdx.x 0) moves a list of pieces HBM -> shared memory -> destination (a peer's
// slot over NVLink, or local memory; all_gather stores each chunk to every peer and its own
// output) in RS_TMA_CHUNK-byte chunks through RS_TMA_BUFS shared buffers, as a pipeline:
// up to RS_TMA_BUFS loads ahead; chunk c's stores (one bulk group) are issued once its
// load landed (its mbarrier, complete_tx), and the buffer of chunk c - 1 takes chunk
// c - 1 + RS_TMA_BUFS once those stores have read it (cp.async.bulk.wait_group.read 1).
// Why: a bulk copy keeps a whole chunk in flight per instruction, so one thread pushes
// about as fast as 256 did and the other threads of the block are free to reduce (or to
// copy out). Measured (4 H100s, bf16, eager, 2026-11-27, main against this in one call,
// docs/performance.md): reduce_scatter at 32 CTAs 1 GiB 3,415-3,429 -> 2,701-2,748 us and
// 256 MiB 930 -> 759-773; at 64 CTAs 256 MiB 702 -> 673-675; all_gather at 64 CTAs 1 GiB
// 2,464-2,501 -> 2,389-2,394. Two-shot all_reduce's X group (copy-out and next pushes) by
// bulk copies was slower (1 GiB 4,863-4,940 -> 5,380-5,395 us at 64 CTAs) and is not used.
// Ordering: before its first bulk store, fence.proxy.async.global orders the generic
// accesses before it (the peers' reads of the slots being overwritten, ordered before this
// thread by the last barrier's acquire and bar.sync) before the async proxy's writes. A
// load and the store that reads its buffer are both async proxy: no fence between them.
// At the end, cp.async.bulk.wait_group 0 waits until every store completed (writes
// performed; the ISA's implicit generic-async fence follows a completion), so the
// barrier's bar.sync and st.release.sys publish them as they publish the threads' stores
// (NOTE [Barrier protocol]).
// Used only where every address and size is 16-byte aligned (bulk copies need it); else
// the threads move the data as before. sm_90 and newer only.
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
// By the thread that runs tma_copies (or a __syncthreads between).
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
// Issue a bulk store of buffer k (its bytes) to dst; a bulk group ends at tma_commit.
__device__ __forceinline__ void tma_store(void* dst, const TmaBufs& t, u32 k, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(__cvta_generic_to_global(dst)), "r"(smem_addr(t.buf[k])),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void tma_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Copy `pieces` pieces, each to `fans` destinations (piece(p, f, &src, &dst, &len): the
// source and length of piece p, its f-th destination; 16-byte aligned addresses, len a
// multiple of 16, the same src and len for every f), by thread 0 of the block; other
// threads return at once. A chunk is loaded once and stored to every destination (one
// bulk group). `use` counts this block's buffer uses across calls (the mbarriers'
// phases). Returns after every store completed (NOTE [Bulk-copy pushes]).
template <typename Piece>
__device__ __forceinline__ void tma_copies(TmaBufs& t, u32& use, u32 pieces, u32 fans, Piece piece) {
    if (threadIdx.x != 0) return;
    asm volatile("fence.proxy.async.global;" ::: "memory");
    const u8* src;
    u8* dst;
    u64 len;
    u32 C = 0;
    for (u32 p = 0; p < pieces; p++) {
        piece(p, 0, &src, &dst, &len);
        C += (u32)((len + RS_TMA_CHUNK - 1) / RS_TMA_CHUNK);
    }
    // A cursor over the chunks in order (piece, offset); loads run ahead of stores.
    struct Cursor {
        u32 p = 0;
        u64 off = 0;
    };
    // The next chunk: its piece and offset in `*cp`, `*co`, its bytes returned.
    auto next = [&](Cursor& cu, u32* cp, u64* co) -> u32 {
        for (;;) {
            piece(cu.p, 0, &src, &dst, &len);
            if (cu.off < len) break;
            cu.p++;
            cu.off = 0;
        }
        const u32 n = (u32)min64(RS_TMA_CHUNK, len - cu.off);
        *cp = cu.p;
        *co = cu.off;
        cu.off += n;
        return n;
    };
    Cursor ld, stc;
    u32 cp;
    u64 co;
    for (u32 c = 0; c < C && c < RS_TMA_BUFS; c++) {
        const u32 n = next(ld, &cp, &co);
        piece(cp, 0, &src, &dst, &len);
        tma_load(t, (use + c) % RS_TMA_BUFS, src + co, n);
    }
    for (u32 c = 0; c < C; c++) {
        const u32 k = (use + c) % RS_TMA_BUFS;
        tma_loaded(t, k, ((use + c) / RS_TMA_BUFS) & 1);
        const u32 n = next(stc, &cp, &co);
        for (u32 f = 0; f < fans; f++) {
            piece(cp, f, &src, &dst, &len);
            tma_store(dst + co, t, k, n);
        }
        tma_commit();
        if (c >= 1 && c - 1 + RS_TMA_BUFS < C) {
            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");  // chunk c - 1's stores have read its buffer
            const u32 n2 = next(ld, &cp, &co);
            piece(cp, 0, &src, &dst, &len);
            tma_load(t, (use + c - 1 + RS_TMA_BUFS) % RS_TMA_BUFS, src + co, n2);
        }
    }
    use += C;
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    // Belt and braces beside the ISA's implicit fence after a completion: the bulk copies'
    // reads and writes before the generic accesses that follow (the barrier's release).
    asm volatile("fence.proxy.async.global;" ::: "memory");
}
#else
#define RS_TMA_ON 0
#endif

// ---------------------------------------------------------------------------------------
// Entry points: rs_<algorithm>_<dtype>, one per reduced type; the op comes with the call
// (NOTE [Reduce op at run time]).

// `A`: the argument block (`Args`, or a struct that begins with one, with its own desc_op).
#define RS_ENTRY(ALG, A, T, TN)                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) rs_##ALG##_##TN(const __grid_constant__ A a) { \
        ALG<T>(a, desc_op(a));                                                                           \
    }

#define RS_TYPES_OF(ALG, A)       \
    RS_ENTRY(ALG, A, float, f32)  \
    RS_ENTRY(ALG, A, f16, f16)    \
    RS_ENTRY(ALG, A, bf16, bf16)  \
    RS_ENTRY(ALG, A, i32, i32)    \
    RS_ENTRY(ALG, A, i64, i64)

#define RS_TYPES(ALG) RS_TYPES_OF(ALG, Args)
