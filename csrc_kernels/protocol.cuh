// rsccl's kernels: the signal / barrier protocol every kernel shares (the block's layout and
// the arguments are the ABI, abi.cuh), with its memory-ordering argument, as named notes,
// each written once at the code it describes; code that relies on one names it:
//   NOTE [Block layout]       abi.cuh, at the layout constants
//   NOTE [Lockstep blocks]    at BlockState
//   NOTE [Bounded waits]      at stop_reason
//   NOTE [Barrier protocol], NOTE [Buffer reuse], NOTE [Agreement]   at barrier()
//   NOTE [In place]           common.cuh, at the in-place helpers
//   NOTE [Point to point]     send_recv.cu
//   NOTE [all_to_all]         all_to_all.cu
// Included by common.cuh; no other headers: NVRTC's built-ins only.

#pragma once

#include "abi.cuh"

// ---------------------------------------------------------------------------------------
// Per-block state and the barrier.

// NOTE [Lockstep blocks]
// Every kernel of a group runs with the same grid (`cuda_blocks` blocks) and all kernels of
// a group are serialized on the GPU (the engine orders every launch after the previous
// one), so CUDA block b of every rank runs the same sequence of steps and barriers: the
// per-block counters agree across ranks without any host round trip, including under
// CUDA graph replay (the counters live in device memory, not in kernel arguments).
struct BlockState {
    u32 epoch;   // barriers passed by this CUDA block (all kernels of the group)
    u32 step;    // steps done by this CUDA block: its parity picks the staging half
    u32 abort;   // set when a wait failed: every thread returns, counters are not saved
    u32 first;   // the next barrier is the kernel's first: it checks descriptors
    u32 mismatch;  // a peer called another collective: stop, counters saved
    u32 place_differs;  // some rank's in-place offsets differ from mine (first barrier)
    u32 any_attempt;    // some rank offered to run in place (first barrier)
};

__device__ __forceinline__ u32* flag_ptr(u64 block_base, u32 cuda_block, u32 src) {
    return reinterpret_cast<u32*>(block_base) + cuda_block * MAX_RANKS + src;
}

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_volatile_host(u64 p) {
    u32 v;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_volatile_host(u64 p, u32 v) {
    asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// NOTE [Bounded waits]
// Bounded waits: a spin that outlasts `timeout_ns`, sees the host's abort word set, or
//   finds its block's poison word set, records an error in host-mapped memory and the
//   whole kernel returns; the GPU is never left spinning. The group is unusable afterwards
//   (the host poisons it). A rank whose wait timed out (or that saw a send/recv size
//   mismatch) also writes its index into every peer's poison word, so the peers' waits
//   stop at once instead of each running into its own timeout. The poison word is only
//   ever set, never cleared: the group is over.

// Why a wait must stop now, or 0: the host's abort word, a peer's poison word (`*who` is
// then that peer), or the timeout. Polled every 256 spins.
__device__ __forceinline__ u32 stop_reason(const Args& a, u64 start, u32* who) {
    if (ld_volatile_host(a.abort_host) != 0) return ERR_ABORTED;
    const u32 p = ld_volatile_host(a.peer[a.rank] + POISON_OFF);
    if (p != 0) {
        *who = (p - 1) & 0xffff;
        return ERR_PEER;
    }
    if (global_ns() - start > a.timeout_ns) return ERR_TIMEOUT;
    return 0;
}

// A wait failed (or a fatal mismatch): record it for the host (the fatal word: never
// cleared) and, unless it came from the host or a peer already, poison every peer so their
// waits stop too (NOTE [Bounded waits]). Any thread may call it; racing writers store
// codes of the same failure.
__device__ void fail(const Args& a, u32 why, u32 peer) {
    st_volatile_host(a.err_host + 4, (why << 16) | peer);
    if (why == ERR_TIMEOUT || why == ERR_P2P_SIZE) {
        for (u32 j = 0; j < a.world; j++) {
            if (j != a.rank) st_volatile_host(a.peer[j] + POISON_OFF, 1 + a.rank);
        }
    }
    __threadfence_system();
}

// Spin (one thread) until *p >= e (wrap-safe), bounded as above. False: it failed and
// reported why (`peer` is the rank waited for).
__device__ bool wait_geq(const Args& a, const u32* p, u32 e, u32 peer) {
    if ((i32)(ld_acquire_sys(p) - e) >= 0) return true;
    const u64 start = global_ns();
    u32 spins = 0;
    while ((i32)(ld_acquire_sys(p) - e) < 0) {
        if ((++spins & 255) == 0) {
            u32 who = peer;
            const u32 why = stop_reason(a, start, &who);
            if (why) {
                fail(a, why, who);
                return false;
            }
        }
    }
    return true;
}

__device__ __forceinline__ void load_state(const Args& a, BlockState* s) {
    if (threadIdx.x == 0) {
        const u32* c = reinterpret_cast<const u32*>(a.peer[a.rank] + CTR_OFF) + 2 * blockIdx.x;
        s->epoch = c[0];
        s->step = c[1];
        s->abort = 0;
        s->first = 1;
        s->mismatch = 0;
        s->place_differs = 0;
        s->any_attempt = 0;
    }
    __syncthreads();
}

// Store the counters back (not after an abort: the group is unusable then). `steps` is
// added to the step counter, so the next kernel's parity follows this one's.
__device__ __forceinline__ void save_state(const Args& a, BlockState* s, u64 steps) {
    __syncthreads();
    if (threadIdx.x == 0 && !s->abort) {
        s->step += (u32)steps;
        u32* c = reinterpret_cast<u32*>(a.peer[a.rank] + CTR_OFF) + 2 * blockIdx.x;
        c[0] = s->epoch;
        c[1] = s->step;
    }
}

__device__ __forceinline__ u64* desc_ptr(u64 block_base, u32 epoch, u32 cuda_block, u32 src) {
    return reinterpret_cast<u64*>(block_base + DESC_OFF) + DESC_WORDS * (((epoch & 1) * MAX_BLOCKS + cuda_block) * MAX_RANKS + src);
}

// On a mismatch the host reads both descriptors from host-mapped memory next to the error
// word: this rank's at +32 bytes, peer j's at +64 + 16 j (see rust/core/src/cuda/engine/status.rs, HostWords).
__device__ void report_mismatch(const Args& a, u32 peer, const u64* theirs) {
    volatile u64* h = reinterpret_cast<volatile u64*>(a.err_host);
    h[4] = a.desc0;
    h[5] = a.desc1;
    h[8 + 2 * peer] = theirs[0];
    h[9 + 2 * peer] = theirs[1];
    __threadfence_system();
    st_volatile_host(a.err_host, (ERR_MISMATCH << 16) | peer);
    __threadfence_system();
}

// NOTE [Barrier protocol]
// Barrier protocol (per CUDA block b, between the same block on every local rank):
//   epoch e = my counter + 1. After __syncthreads() (every thread of the block finished
//   its stores for this step, local and remote), thread j < world issues a st.release.sys
//   of e into rank j's flags[b][me]. Thread j then spins with
//   ld.acquire.sys on my flags[b][j] until it is >= e (wrap-safe signed difference), and
//   __syncthreads() publishes that to the block.
//   Ordering: bar.sync orders the block's data stores before the signalling thread's
//   release (release is cumulative over what happened-before it); the waiter's acquire
//   synchronizes-with that release at system scope, and the second bar.sync extends it to
//   the block's later loads. A peer can run at most one barrier ahead (it cannot pass
//   barrier e before my signal e), so flags only grow and ">= e" is exact.
//
// NOTE [Buffer reuse]
// Buffer reuse: staging is double-buffered by step parity. A block writes parity p at
//   step s+2 only after passing the barrier of step s+1 with every peer's block b, which
//   each peer's block reached only after finishing its reads of step s; every element is
//   written and read by the same block index on every rank, so no other block is involved.
//
// NOTE [Agreement]
// Agreement: the first barrier of every kernel also carries the caller's descriptor
//   (collective, dtype, op, root, count), stored into the peer's desc slot before the
//   release; the waiter compares it after the acquire. Slots alternate by epoch parity: a
//   peer may already be one barrier ahead (the first of its next kernel) and write its
//   next descriptor, but only into the other half. Ranks that called different
//   collectives all pass that barrier, see the mismatch, record it for the host and stop
//   before moving data, with their counters still in step, so the group stays usable.

// Returns false if the wait failed (timeout or abort) or a peer called another collective;
// then every thread must return (through `finish`).
__device__ bool barrier(const Args& a, BlockState* s) {
    __syncthreads();
    const u32 e = s->epoch + 1;
    const u32 t = threadIdx.x;
    const bool first = s->first;
    if (t < a.world) {
        if (first) {
            u64* d = desc_ptr(a.peer[t], e, blockIdx.x, a.rank);
            d[0] = a.desc0;
            d[1] = a.desc1;
            d[2] = a.place_in;
            d[3] = a.place_out;
        }
        // Signal rank t: the release publishes this block's stores of the step (ordered
        // before it by the bar.sync above; release is cumulative), NOTE [Barrier protocol].
        st_release_sys(flag_ptr(a.peer[t], blockIdx.x, a.rank), e);
        if (!wait_geq(a, flag_ptr(a.peer[a.rank], blockIdx.x, t), e, t)) s->abort = 1;
    }
    if (first && t < a.world && !s->abort) {
        const u64* d = desc_ptr(a.peer[a.rank], e, blockIdx.x, t);
        const u64 theirs[2] = {d[0], d[1]};
        if (theirs[0] != a.desc0 || theirs[1] != a.desc1) {
            report_mismatch(a, t, theirs);
            s->mismatch = 1;
        }
        // Several threads may store 1 here: same value, read after the bar.sync below.
        if (d[2] != a.place_in || d[3] != a.place_out) s->place_differs = 1;
        if ((d[2] | d[3]) != 0) s->any_attempt = 1;
    }
    __syncthreads();
    if (s->abort) return false;
    if (t == 0) {
        s->epoch = e;
        s->first = 0;
    }
    // The next reader of s->epoch is after the next barrier's first __syncthreads().
    return !s->mismatch;
}

// A failed barrier is either an abort (nothing is saved) or a descriptor mismatch, which
// only the first barrier of step 0 detects, on every rank alike: every rank then counts
// exactly one step, so the counters stay equal across ranks.
#define BARRIER_OR_RETURN(a, s, steps) \
    if (!barrier(a, &s)) {             \
        save_state(a, &s, 1);          \
        return;                        \
    }
