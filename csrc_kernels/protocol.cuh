// rsccl's kernels: the signal / barrier protocol every kernel shares (the block's layout and
// the arguments are the ABI, abi.cuh), with its memory-ordering argument, as named notes,
// each written once at the code it describes; code that relies on one names it:
//   NOTE [Block layout]       abi.cuh, at the layout constants
//   NOTE [Lockstep blocks]    at BlockState
//   NOTE [Grids]              at stand_in, before barrier()
//   NOTE [Bounded waits]      at stop_reason
//   NOTE [Kernel entry]       at load_state
//   NOTE [Code size]          below, at the head
//   NOTE [Barrier protocol], NOTE [Buffer reuse], NOTE [Agreement]   at barrier()
//   NOTE [In place]           common.cuh, at the in-place helpers
//   NOTE [Point to point]     send_recv.cu
//   NOTE [Copy-engine send/recv]   send_recv.cu
//   NOTE [all_to_all]         all_to_all.cu
//   NOTE [Ring]               ring.cuh (large reduce_scatter and all_reduce as a ring)
//   NOTE [Low latency]        low_latency.cuh (small all_reduce, reduce_scatter, all_gather without a barrier)
//   NOTE [Low latency epochs] at ll_refresh (their words never taken from an old call)
// Included by common.cuh; no other headers: NVRTC's built-ins only.
//
// NOTE [Code size]
// What runs once per failure stays out of line: fail, report_mismatch, hold_for_host and
// the spin of wait_geq (after its first, inline check) are __noinline__, so the 3 to 6
// barriers a kernel inlines share one copy of them. The barrier itself stays inline: out
// of line it cost 0.5-1.5 us per small collective under CUDA graphs and 4-8% at 256 MiB-1
// GiB (4 H100s, docs/performance.md, issue 30), for another 5% of code. Kernels take their
// Args as __grid_constant__, so passing `a` by reference to those functions reads the
// kernel's parameter space instead of copying the struct to the stack at every launch.

#pragma once

#include "abi.cuh"

// ---------------------------------------------------------------------------------------
// Per-block state and the barrier.

// NOTE [Lockstep blocks]
// Every rank runs a call with the same grid (a pure function of the call, decide::grid:
// 16 blocks for small calls, `cuda_blocks` above; NOTE [Grids]) and all kernels of a group
// are serialized on the GPU (the engine orders every launch after the previous one), so
// CUDA block b of every rank runs the same sequence of steps and barriers (a block beyond
// a call's grid takes no part in it, on every rank alike): the per-block counters agree
// across ranks without any host round trip, including under CUDA graph replay (the
// counters live in device memory, not in kernel arguments).
struct BlockState {
    u32 epoch;   // barriers passed by this CUDA block (all kernels of the group)
    u32 step;    // steps done by this CUDA block: its parity picks the staging half
    u32 abort;   // set when a wait failed: every thread returns, counters are not saved
    u32 first;   // the next barrier is the kernel's first: it checks descriptors
    u32 mismatch;  // a peer called another collective: stop, counters saved
    u32 place_differs;  // some rank's in-place offsets differ from mine (first barrier)
    u32 any_attempt;    // some rank offered to run in place (first barrier)
    u32 grid_max;       // the largest grid of a mismatched peer's call (first barrier)
    u32 ll_due;         // the low-latency regions are due for a rewrite (NOTE [Low latency epochs])
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
// Named barriers of the whole block (id > 0; __syncthreads is 0): bar.arrive does not wait.
// Both order memory as bar.sync does (send/recv's and the ring's signalling warps).
__device__ __forceinline__ void bar_sync(u32 id) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(blockDim.x) : "memory"); }
__device__ __forceinline__ void bar_arrive(u32 id) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(blockDim.x) : "memory"); }
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
//   finds its rank's poison word set, records an error in host-mapped memory and the
//   whole kernel returns; the GPU is never left spinning. The group is unusable afterwards.
//   A rank whose wait timed out (or that saw a send/recv size mismatch, or two of its
//   kernels running at once) writes its index, the cause and the rank the cause names
//   (whom it waited for) into every rank's poison word, its own included (abi.cuh), so
//   that every rank can say that rank 1 timed out waiting for rank 3, not only that rank
//   1 stopped the group: the peers' waits stop at once instead of each running into its own
//   timeout, and every later kernel of this rank, eager or replayed from a CUDA graph,
//   finds the word at its entry and writes nothing (NOTE [Kernel entry]). The host's
//   abort writes the same words (Shared::poison_peers). The poison word is only ever set,
//   never cleared: the group is over.
//   Reporting: a failure goes into the host-mapped fatal word. A wait or entry that stops
//   because this rank's own word names this rank writes it only while it is empty: that
//   failure was reported by whoever set the word (a kernel of this rank, before its
//   poison stores, ordered by its fence; or the host, which knows the cause and only
//   needs to hear that a kernel of this rank stopped).
//   With FLAG_HOLD_ON_ERROR (cuda_on_error = "teardown", the default) the reporting
//   thread then holds its block until the host sets the abort word, bounded by the
//   timeout: the watchdog reads the report within milliseconds and ends the process, so
//   no work queued behind the failed kernel runs on its output.

// Why a wait must stop now, or 0: the host's abort word, a peer's poison word (`*who` is
// then the word less one: the culprit in the low 16 bits, its cause above, as fail()
// wants it), or the timeout. Polled every 256 spins.
__device__ __forceinline__ u32 stop_reason(const Args& a, u64 start, u32* who) {
    if (ld_volatile_host(a.abort_host) != 0) return ERR_ABORTED;
    const u32 p = ld_volatile_host(a.peer[a.rank] + POISON_OFF);
    if (p == POISON_DESTROYED) return ERR_ABORTED;
    if (p != 0) {
        *who = p - 1;
        return ERR_PEER;
    }
    if (global_ns() - start > a.timeout_ns) return ERR_TIMEOUT;
    return 0;
}

// Keep the calling thread's block until the host acted on a report (FLAG_HOLD_ON_ERROR):
// the host sets the abort word (cuda_on_error = "raise") or ends the process ("teardown").
// Bounded by the timeout, like every wait.
__device__ __noinline__ void hold_for_host(const Args& a) {
    if (!(a.flags & FLAG_HOLD_ON_ERROR)) return;
    const u64 start = global_ns();
    while (ld_volatile_host(a.abort_host) == 0 && global_ns() - start <= a.timeout_ns) __nanosleep(1000);
}

// A wait failed, a kernel found its group failed at entry, or two kernels of the group
// ran at once: record it for the host (the fatal word: never cleared) and poison every
// rank, this one included, so that every wait and every later kernel of the group stops
// (NOTE [Bounded waits]), unless the cause came from a poisoned word already. `peer` is
// the rank the failure names; for ERR_PEER, the poison word less one (stop_reason), whose
// cause goes into the fatal word's high bits (abi.cuh). Any thread may call it; racing
// writers store codes of failures of the same group, each one whole word.
__device__ __noinline__ void fail(const Args& a, u32 why, u32 peer) {
    const u32 culprit = peer & 0xffff;
    const u32 code = why == ERR_PEER ? (why << 16) | (((peer >> 16) & 0xf) << 20) | ((peer >> 24) << 24) | culprit
                                     : (why << 16) | culprit;
    // This rank's own word names this rank: whoever set it reported the cause; write only
    // if nothing is there yet (a host's abort), so that the host hears of this kernel.
    const bool own_word = why == ERR_PEER && culprit == a.rank;
    if (!own_word || ld_volatile_host(a.err_host + 4) == 0) st_volatile_host(a.err_host + 4, code);
    __threadfence_system();
    if (why == ERR_TIMEOUT || why == ERR_P2P_SIZE || why == ERR_CONCURRENT) {
        const u32 poison = (1 + a.rank) | (why << 16) | ((1 + culprit) << 24);
        for (u32 j = 0; j < a.world; j++) st_volatile_host(a.peer[j] + POISON_OFF, poison);
        __threadfence_system();
    }
    hold_for_host(a);
}

// One spin of a bounded wait that began at `start`: every 256 spins, whether it must stop
// (stop_reason); if so it is reported (fail; `peer` is the rank waited for) and true.
__device__ __forceinline__ bool spin_must_stop(const Args& a, u64 start, u32* spins, u32 peer) {
    if ((++*spins & 255) != 0) return false;
    u32 who = peer;
    const u32 why = stop_reason(a, start, &who);
    if (!why) return false;
    fail(a, why, who);
    return true;
}

// Spin (one thread) until *p >= e (wrap-safe), bounded as above. False: it failed and
// reported why (`peer` is the rank waited for). The first check is inline; the spin, with
// its stop checks, is out of line (NOTE [Code size]).
__device__ __noinline__ bool wait_geq_slow(const Args& a, const u32* p, u32 e, u32 peer) {
    const u64 start = global_ns();
    u32 spins = 0;
    while ((i32)(ld_acquire_sys(p) - e) < 0) {
        if (spin_must_stop(a, start, &spins, peer)) return false;
    }
    return true;
}
__device__ __forceinline__ bool wait_geq(const Args& a, const u32* p, u32 e, u32 peer) {
    if ((i32)(ld_acquire_sys(p) - e) >= 0) return true;
    return wait_geq_slow(a, p, e, peer);
}

// NOTE [Kernel entry]
// Kernel entry (load_state, thread 0 of each CUDA block, before the block touches any
//   buffer): three device-local words, read together so they cost one memory latency:
//   - the counters (NOTE [Lockstep blocks]);
//   - this rank's poison word: set, the group failed (a timeout, a dead or failed peer, a
//     host abort: NOTE [Bounded waits]); the kernel reports it and returns, writing
//     nothing. This covers what the host cannot refuse: a CUDA graph captured before the
//     failure and replayed after it. POISON_DESTROYED: the group was destroyed, and a
//     graph that still holds this kernel was replayed; nobody is left to report to, so
//     the kernel stops the CUDA context with a message (a trap: the replay fails loudly)
//     rather than return a result it did not compute;
//   - the block's busy word, incremented (atomicAdd; swapped back to 0 at save_state): if
//     it was not 0, another kernel of this group runs block b on this GPU right now. The
//     lockstep protocol cannot tell two such kernels apart (they would pass each other's
//     barriers and read each other's staging), so this is a failure of the group
//     (ERR_CONCURRENT: e.g. a graph replayed while an async collective of the group was
//     not yet waited for, or two graphs of one group replayed on two streams). The kernel
//     that came first finds the other's increment when it swaps the word back at its end,
//     and fails the same way: its result may be wrong too, and with FLAG_HOLD_ON_ERROR it
//     holds its stream as well, so that nothing consumes that result. Only
//     kernels that overlap on one GPU are caught: two unordered kernels whose blocks b
//     never run at once on any GPU are not, but then each GPU runs them one after the
//     other, and a difference in what they are (collective, dtype, count) is still a
//     mismatch at their first barrier.
//   The atomic and the loads are device scope and local: the busy word is written by this
//   rank's kernels only; the poison word by anyone, and it is only ever set, so a stale 0
//   read here is a failure that this kernel's first wait finds instead (stop_reason).
// A replay of a destroyed group's kernel (NOTE [Kernel entry]): out of line, so that the
// message's formatting costs the kernels nothing on their paths.
__device__ __noinline__ void stop_destroyed() {
    printf("rsccl: a CUDA graph replayed a collective or send/recv of a process group that was destroyed; stopping the CUDA context\n");
    __trap();
}

// The entry check of the group's state (NOTE [Kernel entry]), by one thread, given this
// rank's poison word as read at entry: true (and reported) if the kernel must not run.
__device__ __forceinline__ bool failed_at_entry(const Args& a, u32 poison) {
    if (poison == POISON_DESTROYED) stop_destroyed();
    if (poison == 0) return false;
    fail(a, ERR_PEER, poison - 1);
    return true;
}

__device__ __forceinline__ u32 own_poison(const Args& a) {
    return *reinterpret_cast<volatile const u32*>(a.peer[a.rank] + POISON_OFF);
}

// ---------------------------------------------------------------------------------------
// The low-latency kernels' slots (NOTE [Low latency] in low_latency.cuh): here, because every
// kernel's barrier keeps them fresh.

// The most bytes per sender of the low-latency kernels in a group of `world` ranks, and a
// sender's slot in each buffer (abi.cuh; rust/core/src/cuda/kernels/mod.rs has the same
// rule, ll_max_bytes).
__host__ __device__ constexpr u32 ll_max_bytes(u32 world) {
    return world <= 4 ? LL_MAX_BYTES : world <= 8 ? LL_MAX_BYTES / 2 : LL_MAX_BYTES_16;
}
__host__ __device__ constexpr u64 ll_slot(u32 world) { return 2 * (u64)ll_max_bytes(world) + 32 * MAX_BLOCKS; }
static_assert(LL_MAX_BYTES_16 % 16 == 0 && LL_MAX_BYTES % 32 == 0, "ll_max_bytes: whole 16-byte packs");
static_assert(4 * ll_slot(4) <= LL_BUF_BYTES && 8 * ll_slot(8) <= LL_BUF_BYTES && MAX_RANKS * ll_slot(MAX_RANKS) <= LL_BUF_BYTES,
              "LL_BUF_BYTES: a slot per sender (ll_region_at)");
__device__ __forceinline__ void st_ll(u64 addr, u32 d0, u32 d1, u32 e) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %2};" ::"l"(addr), "r"(d0), "r"(e), "r"(d1) : "memory");
}
// The grid of the group's low-latency kernels (Args::flags, FLAG_LL_GRID_SHIFT).
__device__ __forceinline__ u32 ll_grid(const Args& a) { return (a.flags >> FLAG_LL_GRID_SHIFT) & 0xff; }
// The 16-byte stores of a block's region: what a block's range of ll_max_bytes(world) takes
// as LL lines (32 bytes per 16-byte pack) on the low-latency grid, so that a region depends
// neither on the call's size nor on its dtype.
__device__ __forceinline__ u32 ll_region_stores(const Args& a) {
    const u32 G = ll_grid(a);
    return (ll_max_bytes(a.world) / 16 + G - 1) / G * 2;
}
// Block b's region of slot [k][src] of `rank`'s block. The grid's regions take at most
// 2 * ll_max_bytes(world) + 32 * grid bytes, within ll_slot(world).
__device__ __forceinline__ u64 ll_region_at(const Args& a, u32 rank, u32 k, u32 src, u32 b) {
    return a.peer[rank] + LL_OFF + (u64)k * LL_BUF_BYTES + src * ll_slot(a.world) + (u64)b * ll_region_stores(a) * 16;
}

__device__ __forceinline__ u64 ll_header(const Args& a, u32 rank, u32 k, u32 src) {
    return a.peer[rank] + LL_HDR_OFF + (((u64)k * MAX_RANKS + src) * MAX_BLOCKS + blockIdx.x) * 16;
}

// NOTE [Low latency epochs]
// A low-latency word carries the 32-bit epoch of the call that wrote it, and a reader takes
// a word whose epoch equals its own (NOTE [Low latency] in low_latency.cuh). A word left from a
// call 2^32 epochs before (or never written: epoch word 0, when the epoch wraps to 0) would
// be taken too, before the sender's store lands: a silent wrong result, after days of a
// busy group; a header likewise would be taken as a call's, and a mismatch reported. So
// block b rewrites its own regions and headers (every sender's, both buffers) with data 0
// and a recent epoch word whenever LL_REFRESH_EPOCHS or more epochs passed since it last
// did (`ll_refresh`), at the start of a kernel (load_state), the only place every kernel
// that moves an epoch passes (a stand-in moves another block's by one): the epoch it last did so is kept in its own header slot [0][this rank][b], which
// no peer writes (a peer p writes [k][p][b]). A kernel takes at most a few million epochs
// (a step each), so every word then holds an epoch less than 2^31 old, never equal
// (mod 2^32) to a later reader's.
// Why a rewrite never overwrites words a reader will take: at the start of a kernel whose
// block b's epoch is e0, no peer writes buffer e0 % 2 before this block signals e0 + 1 or
// stores its low-latency words of e0 + 1 (a peer writes it at its epoch e0 + 2, LL_BUFS =
// 2), and none writes the other buffer either unless the kernel is a low-latency one (its
// call e0 + 1 uses that buffer): any other kernel signals before a peer's block b can
// leave it. (A peer's block b can reach e0 + 1 by a stand-in, NOTE [Grids], before this
// block's kernel starts, only after a copy-engine call's one-block barrier, whose next
// barrier needs this rank's block 0 in a later kernel, after this one's rewrite; stand-ins
// after a kernel's barrier move only blocks beyond the small grid, which have no
// regions.) So a low-latency kernel rewrites buffer e0 % 2 at its start and the other at
// its end, once its reads are done (ll_call); any other kernel rewrites both at its start.
// The rewrite's stores come before anything a peer must see before it writes that buffer
// again: at a kernel's start, each thread's fence.sc.sys and a bar.sync follow its rewrite,
// before any store of the call (data words, signals); at a low-latency kernel's end, the
// next signals and low-latency words are in later kernels, ordered after this one's stores
// on this GPU. A peer's store of a mismatched or aborted call that lands after the rewrite
// holds a recent epoch: harmless.
#define LL_REFRESH_EPOCHS 0x40000000u
__device__ __forceinline__ u32* ll_refreshed(const Args& a) {
    return reinterpret_cast<u32*>(ll_header(a, a.rank, 0, a.rank));
}
// Rewrite block blockIdx.x's regions and headers of buffer k (both: k = LL_BUFS) with
// epoch word e (a header of contents 0 is no call's: a reader that took one would report a
// mismatch, but none takes it, its epoch being old).
__device__ __noinline__ void ll_refresh(const Args& a, u32 k, u32 e) {
    const u32 lines = ll_region_stores(a);
    for (u32 kk = 0; kk < LL_BUFS; kk++) {
        if (k != LL_BUFS && kk != k) continue;
        for (u32 src = 0; src < a.world; src++) {
            if (src == a.rank) continue;
            const u64 base = ll_region_at(a, a.rank, kk, src, blockIdx.x);
            for (u32 i = threadIdx.x; i < lines; i += blockDim.x) st_ll(base + 16 * (u64)i, 0, 0, e);
            if (threadIdx.x == 0) st_ll(ll_header(a, a.rank, kk, src), 0, 0, e);
        }
    }
}

// ---------------------------------------------------------------------------------------

// Returns false when the kernel must return at once (nothing written, counters unsaved).
// `low_latency`: the kernel is one of the low-latency ones (NOTE [Low latency epochs]).
__device__ __forceinline__ bool load_state(const Args& a, BlockState* s, bool low_latency = false) {
    if (threadIdx.x == 0) {
        const u64 own = a.peer[a.rank];
        const u32* c = reinterpret_cast<const u32*>(own + CTR_OFF) + 2 * blockIdx.x;
        u32* busy = reinterpret_cast<u32*>(own + BUSY_OFF) + blockIdx.x;
        const u32 was_busy = atomicAdd(busy, 1u);
        const u32 poison = own_poison(a);
        const u32 refreshed = blockIdx.x < ll_grid(a) ? *ll_refreshed(a) : c[0];
        s->epoch = c[0];
        s->ll_due = c[0] - refreshed >= LL_REFRESH_EPOCHS;
        s->step = c[1];
        s->first = 1;
        s->mismatch = 0;
        s->place_differs = 0;
        s->any_attempt = 0;
        s->grid_max = 0;
        s->abort = 0;
        if (poison != 0) {
            if (!was_busy) atomicSub(busy, 1u);
            s->abort = failed_at_entry(a, poison);
        } else if (was_busy) {
            // The other kernel owns the word; its exit finds this one's mark (save_state).
            fail(a, ERR_CONCURRENT, a.rank);
            s->abort = 1;
        }
    }
    __syncthreads();
    if (s->abort) return false;
    if (s->ll_due) {  // block-uniform (NOTE [Low latency epochs])
        ll_refresh(a, low_latency ? s->epoch % LL_BUFS : LL_BUFS, s->epoch);
        if (!low_latency && threadIdx.x == 0) *ll_refreshed(a) = s->epoch;
        __threadfence_system();  // the rewrite before any store of this call, seen from any GPU
        __syncthreads();
    }
    return true;
}

// Store the counters back (not after an abort: the group is unusable then) and leave the
// block's busy word (NOTE [Kernel entry]). `steps` is added to the step counter, so the
// next kernel's parity follows this one's. Kernel boundaries order these plain stores
// before the next kernel's load_state on this GPU.
__device__ __forceinline__ void save_state(const Args& a, BlockState* s, u64 steps) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (!s->abort) {
            s->step += (u32)steps;
            u32* c = reinterpret_cast<u32*>(a.peer[a.rank] + CTR_OFF) + 2 * blockIdx.x;
            c[0] = s->epoch;
            c[1] = s->step;
        }
        // Another kernel of the group entered block b while this one ran (NOTE [Kernel entry]).
        if (atomicExch(reinterpret_cast<u32*>(a.peer[a.rank] + BUSY_OFF) + blockIdx.x, 0u) > 1) fail(a, ERR_CONCURRENT, a.rank);
    }
}

__device__ __forceinline__ u64* desc_ptr(u64 block_base, u32 epoch, u32 cuda_block, u32 src) {
    return reinterpret_cast<u64*>(block_base + DESC_OFF) + DESC_WORDS * (((epoch & 1) * MAX_BLOCKS + cuda_block) * MAX_RANKS + src);
}

// On a mismatch the host reads both descriptors from host-mapped memory next to the error
// word: this rank's at +32 bytes, peer j's at +64 + 16 j (see rust/core/src/cuda/engine/status.rs, HostWords).
__device__ __noinline__ void report_mismatch(const Args& a, u32 peer, const u64* theirs) {
    volatile u64* h = reinterpret_cast<volatile u64*>(a.err_host);
    h[4] = a.desc0;
    h[5] = a.desc1;
    h[8 + 2 * peer] = theirs[0];
    h[9 + 2 * peer] = theirs[1];
    __threadfence_system();
    st_volatile_host(a.err_host, (ERR_MISMATCH << 16) | peer);
    __threadfence_system();
    hold_for_host(a);
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
//   barrier e before my signal e), so flags only grow and ">= e" is exact. Low-latency
//   calls move the epoch without a signal (NOTE [Low latency]): a flag may then be behind
//   its block's epoch, by less than 2^20, so the wrap-safe comparison stays exact; a peer
//   in such a call at my barrier's epoch called something else, and signals e once it
//   finds that (NOTE [Low latency], 2 and 3).
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

// The descriptor this rank publishes and compares at a kernel's first barrier: the host's,
// with the kernel's grid (NOTE [Grids]).
__device__ __forceinline__ u64 desc0_with_grid(const Args& a) {
    return a.desc0 | ((u64)gridDim.x << DESC0_GRID_SHIFT);
}

// This rank's descriptor of its call (`desc0`: with a grid) into rank t's desc slot for
// block b at epoch e: what a barrier's first signal publishes before its release (NOTE
// [Agreement]); the stand-in too, and the low-latency kernels when they signal (NOTE [Low
// latency], 3).
__device__ __forceinline__ void put_desc(const Args& a, u32 t, u32 e, u32 b, u64 desc0) {
    u64* d = desc_ptr(a.peer[t], e, b, a.rank);
    d[0] = desc0;
    d[1] = a.desc1;
    d[2] = a.place_in;
    d[3] = a.place_out;
}

// NOTE [Grids]
// A call's grid depends on its size (decide::grid: 16 blocks up to 64 KiB, the group's
//   grid above), so two ranks whose calls differ may run different grids: block b of the
//   rank with the larger grid then waits in its first barrier for a block b that the
//   other rank does not run, and would wait until the timeout, losing the group to what
//   is only a mismatch. So the grid is part of the descriptor (DESC0_GRID_SHIFT, added by
//   barrier() from gridDim.x), and block 0 of every rank whose grid is smaller than the
//   largest grid among its mismatched peers' (`grid_max`, from their descriptors at the
//   first barrier) stands in for its blocks b in [gridDim.x, grid_max) after that
//   barrier: it does what block b's first barrier of a mismatched kernel would, with this
//   rank's descriptor. Thread j < world, for each such b: e_b = b's epoch + 1; the
//   descriptor into rank j's desc slot (parity of e_b, block b, this rank), then a
//   st.release.sys of e_b into rank j's flags[b][me]. Then thread 0 sets b's counters to
//   {e_b, step + 1}, what BARRIER_OR_RETURN saves for a mismatched block.
//   Why it is sound: (1) block b's counters are this rank's own (CTR_OFF) and nothing else
//   touches them now: this kernel's grid does not reach b, and the group's kernels run one
//   after another on this GPU (their boundaries order these plain stores before the next
//   kernel's load_state). (2) Every call before this one agreed, so block b's epoch,
//   e_b - 1, is the same on every rank. (3) A peer's block b that runs waits in its barrier
//   e_b for this signal; its acquire synchronizes-with the release, which follows the
//   descriptor's stores in thread j's program order (NOTE [Barrier protocol]), so it reads
//   this descriptor, sees the mismatch and stops at {e_b, +1}, like this rank's b now. A
//   peer that does not run b stands in for it the same way. So every rank's block b ends
//   at e_b, every flags[b][*] holds e_b, and barrier e_b + 1 waits as ever: no wait is
//   needed here, since the stand-in only signals what block b would have. (4) The desc slot
//   of e_b's parity is free: a peer's block b last read it at its epoch e_b - 2 (a barrier,
//   or a low-latency call's check), before it moved to e_b - 1, for which this rank's block
//   b waited on it (its signal, or its low-latency words: NOTE [Agreement]).
//   With FLAG_HOLD_ON_ERROR (teardown) report_mismatch holds block 0 before this, until the
//   host ends the process; the peers' waits then end with the process (NOTE [Bounded
//   waits]). A copy-engine collective's barriers run one block (NOTE [Copy engines]): a
//   rank whose call took the other path stands in for the kernel's other blocks the same
//   way at the barrier that finds the mismatch.
__device__ __noinline__ void stand_in(const Args& a, u32 grid_max) {
    const u32 t = threadIdx.x;
    u32* ctr = reinterpret_cast<u32*>(a.peer[a.rank] + CTR_OFF);
    const u64 mine0 = desc0_with_grid(a);
    if (t < a.world) {
        for (u32 b = gridDim.x; b < grid_max && b < MAX_BLOCKS; b++) {
            const u32 e = ctr[2 * b] + 1;
            put_desc(a, t, e, b, mine0);
            st_release_sys(flag_ptr(a.peer[t], b, a.rank), e);
        }
    }
    __syncthreads();  // every thread read the epochs before thread 0 moves them
    if (t == 0) {
        for (u32 b = gridDim.x; b < grid_max && b < MAX_BLOCKS; b++) {
            ctr[2 * b] += 1;
            ctr[2 * b + 1] += 1;
        }
    }
}

// Returns false if the wait failed (timeout or abort) or a peer called another collective;
// then every thread must return (through `finish`).
__device__ bool barrier(const Args& a, BlockState* s) {
    __syncthreads();
    const u32 e = s->epoch + 1;
    const u32 t = threadIdx.x;
    const bool first = s->first;
    if (t < a.world) {
        if (first) {
            put_desc(a, t, e, blockIdx.x, desc0_with_grid(a));
        }
        // Signal rank t: the release publishes this block's stores of the step (ordered
        // before it by the bar.sync above; release is cumulative), NOTE [Barrier protocol].
        st_release_sys(flag_ptr(a.peer[t], blockIdx.x, a.rank), e);
        if (!wait_geq(a, flag_ptr(a.peer[a.rank], blockIdx.x, t), e, t)) s->abort = 1;
    }
    if (first && t < a.world && !s->abort) {
        const u64* d = desc_ptr(a.peer[a.rank], e, blockIdx.x, t);
        const u64 theirs[2] = {d[0], d[1]};
        if (theirs[0] != desc0_with_grid(a) || theirs[1] != a.desc1) {
            atomicMax(&s->grid_max, (u32)(theirs[0] >> DESC0_GRID_SHIFT));
            report_mismatch(a, t, theirs);
            s->mismatch = 1;
        }
        // Several threads may store 1 here: same value, read after the bar.sync below.
        if (d[2] != a.place_in || d[3] != a.place_out) s->place_differs = 1;
        if ((d[2] | d[3]) != 0) s->any_attempt = 1;
    }
    __syncthreads();
    if (s->abort) return false;
    // Block-uniform: shared words read after the bar.sync above (NOTE [Grids]).
    if (first && s->mismatch && blockIdx.x == 0 && s->grid_max > gridDim.x) stand_in(a, s->grid_max);
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
