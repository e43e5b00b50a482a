// rsccl's collective kernels for the ranks of one host, over symmetric memory.
//
// Compiled by NVRTC at group creation (rust/core/src/cuda/kernels.rs; cached on disk,
// never compiled on a collective's path) for the device's architecture (sm_90 on H100/H200),
// and checked by the CPU-only test suite. No headers: NVRTC's built-ins only.
//
// Memory: every local rank owns one VMM allocation ("symmetric block"), mapped by every
// local rank; `Args::peer[j]` is rank j's block as mapped in this process. A block is
//   [0, FLAGS_BYTES)          flags[MAX_BLOCKS][MAX_RANKS] u32: written by peers (barrier)
//   [STATS_OFF, +32)          {in-place collectives, bytes, all collectives, bytes} u64:
//                             this rank's kernels count them (memory_stats)
//   [CTR_OFF, +MAX_BLOCKS*8)  per CUDA block {epoch, step} u32 pairs: this rank only
//   [POISON_OFF, +4)          1 + the local index of a peer whose kernel failed (timeout,
//                             send/recv size mismatch) and stopped the group; 0 = none
//   [DESC_OFF, +64 KiB)       desc[2][MAX_BLOCKS][MAX_RANKS] 32-byte collective descriptors,
//                             written by peers before their first signal of a kernel, in
//                             the half picked by the barrier epoch's parity
//   [P2P_OFF, +32 KiB)        send/recv signals and counters (see "Point to point")
//   [A2A_OFF, +32 KiB)        all_to_all split tables: [parity][CUDA block] this rank's
//                             send sizes then receive sizes, MAX_RANKS u64 each
//   [STAGE_OFF, stage end)    staging: for CUDA block b and parity p, `stage_per_block`
//                             bytes at STAGE_OFF + (2*b + p) * stage_per_block
//   [inbox_off, +p2p bytes)   send/recv inbox: per sending peer slot, CUDA block and
//                             parity, `chunk` bytes (see "Point to point")
//   [pool, block end)         the pool (rsccl.mem_pool()): user tensors, allocated by the
//                             host (rust/core/src/cuda/heap.rs), used in place
// Every kernel of a group runs with the same grid (`cuda_blocks` blocks) and all kernels of
// a group are serialized on the GPU (the engine orders every launch after the previous
// one), so CUDA block b of every rank runs the same sequence of steps and barriers: the
// per-block counters agree across ranks without any host round trip, including under
// CUDA graph replay (the counters live in device memory, not in kernel arguments).
//
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
// Buffer reuse: staging is double-buffered by step parity. A block writes parity p at
//   step s+2 only after passing the barrier of step s+1 with every peer's block b, which
//   each peer's block reached only after finishing its reads of step s; every element is
//   written and read by the same block index on every rank, so no other block is involved.
// Agreement: the first barrier of every kernel also carries the caller's descriptor
//   (collective, dtype, op, root, count), stored into the peer's desc slot before the
//   release; the waiter compares it after the acquire. Slots alternate by epoch parity: a
//   peer may already be one barrier ahead (the first of its next kernel) and write its
//   next descriptor, but only into the other half. Ranks that called different
//   collectives all pass that barrier, see the mismatch, record it for the host and stop
//   before moving data, with their counters still in step, so the group stays usable.
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
// Bounded waits: a spin that outlasts `timeout_ns`, sees the host's abort word set, or
//   finds its block's poison word set, records an error in host-mapped memory and the
//   whole kernel returns; the GPU is never left spinning. The group is unusable afterwards
//   (the host poisons it). A rank whose wait timed out (or that saw a send/recv size
//   mismatch) also writes its index into every peer's poison word, so the peers' waits
//   stop at once instead of each running into its own timeout. The poison word is only
//   ever set, never cleared: the group is over.
// Point to point (send/recv, rs_send / rs_recv): not a collective of the group. Each
//   (peer, direction) has its own host stream, so a rank's sends to j run concurrently
//   with its receives from j and with its collectives; the kernels touch none of the
//   collectives' state (flags, counters, descriptors, staging). A message of n bytes goes
//   in steps of `chunk` bytes per CUDA block (block b moves bytes [s*G*chunk + b*chunk, +chunk)
//   of step s); each (block, sender, receiver) has a sequence number q, counted by both
//   sides in their own blocks (send_seq / recv_seq), that advances by one per step, so
//   both agree without host round trips and under graph replay. Step q:
//     sender:   thread 0 waits until ack[b][receiver] (its own block) >= q - 2 (the
//               receiver has emptied the inbox slot of parity q & 1, last used by step
//               q - 2); the data warps copy the chunk into the receiver's inbox slot
//               (sender, b, q & 1); a block barrier; thread 0 stores the message size into
//               size[b][sender][q & 1] and issues st.release.sys of q into
//               ready[b][sender] (both in the receiver's block).
//     receiver: thread 0 spins with ld.acquire.sys on ready[b][sender] (own block) until
//               >= q and checks the size; a block barrier; the data warps copy the slot
//               out; a block barrier; thread 0 issues st.release.sys of q into
//               ack[b][receiver] (sender's block).
//   (Warp 0 signals and the other warps copy, with named barriers: see rs_send.)
//   Ordering: as in the barrier: the block barrier orders every thread's accesses of the
//   step before thread 0's release (cumulative), the acquire synchronizes with it at
//   system scope, and the following block barrier extends that to the data warps. The
//   receiver's reads of a slot
//   happen before its ack, which happens before the sender's next write of that slot.
//   The first two steps of a message need no ack ("eager"): a send of at most 2 chunks per
//   block completes without its receiver, as small NCCL sends do; a larger one waits for
//   it (bounded by the timeout). A receiver that finds a size other than its own records a
//   fatal error and poisons its peers: the sender's later waits stop too.
// all_to_all (rs_all_to_all): before its first signal every rank writes its send and
//   receive sizes into its own table (half = first barrier's epoch parity); after that
//   barrier every rank reads every rank's table, so all ranks check all pairs alike (a
//   pair that disagrees stops every rank, with the same report, counters in step) and
//   agree on the largest chunk, which sets the step size. A rank rewrites a table half
//   only at a first barrier two epochs later, after every peer passed the barrier after
//   its reads.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#define MAX_RANKS 16
#define MAX_BLOCKS 64
#define FLAGS_BYTES (MAX_BLOCKS * MAX_RANKS * 4)
#define STATS_OFF 4096
#define CTR_OFF 8192
#define DESC_OFF 16384
#define DESC_WORDS 4
#define POISON_OFF (STATS_OFF + 256)
#define P2P_OFF 131072
#define A2A_OFF 163840
#define STAGE_OFF 262144

// Error codes written to Args::err_host (high 16 bits: kind, low 16: peer local index): a
// mismatch into the first u32, a timeout or abort into the second, so that neither kind
// overwrites the other (the host clears a reported mismatch but never a fatal error).
#define ERR_TIMEOUT 1u
#define ERR_ABORTED 2u
#define ERR_MISMATCH 3u
#define ERR_PEER 4u       // a peer failed and poisoned the group (peer = that rank)
#define ERR_P2P_SIZE 5u   // recv: the sender's size differs (sizes at err_host + 384)
#define ERR_A2A 6u        // all_to_all splits disagree (pair and sizes at err_host + 32)

struct Args {
    u64 peer[MAX_RANKS];   // symmetric block of each local rank, as mapped here
    u64 in;                // this rank's input
    u64 out;               // this rank's output
    u64 count;             // elements: see each kernel
    u64 stage_per_block;   // bytes of staging per CUDA block and parity (multiple of 256)
    u64 err_host;          // device pointer to a host-mapped u32: first error
    u64 abort_host;        // device pointer to a host-mapped u32: set by the host to abort
    u64 timeout_ns;        // bound on any single wait
    u64 desc0;             // this call's descriptor (kind, dtype, op, root) ...
    u64 desc1;             // ... and element count: equal on every rank of a valid call
    u64 place_in;          // offset + 1 of `in` in the pool, 0 if none (see "In place")
    u64 place_out;         // offset + 1 of `out` in the pool, 0 if none
    u32 rank;              // local index of this rank
    u32 world;             // local ranks
    u32 root;              // broadcast root (local index)
    u32 pad;
};

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

struct OpSum { template <typename A> __device__ __forceinline__ static A f(A a, A b) { return a + b; } };
struct OpProd { template <typename A> __device__ __forceinline__ static A f(A a, A b) { return a * b; } };
struct OpMin { template <typename A> __device__ __forceinline__ static A f(A a, A b) { return b < a ? b : a; } };
struct OpMax { template <typename A> __device__ __forceinline__ static A f(A a, A b) { return b > a ? b : a; } };
// AVG: a sum, divided by the number of ranks at the end (integer division for integers).
struct OpAvg { template <typename A> __device__ __forceinline__ static A f(A a, A b) { return a + b; } };

template <typename Op> struct Finish {
    template <typename A> __device__ __forceinline__ static A f(A a, u32) { return a; }
};
template <> struct Finish<OpAvg> {
    template <typename A> __device__ __forceinline__ static A f(A a, u32 world) { return a / (A)world; }
};

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
// Per-block state and the barrier.

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
// waits stop too (see "Bounded waits"). Any thread may call it; racing writers store
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
// word: this rank's at +32 bytes, peer j's at +64 + 16 j (see engine.rs, HostWords).
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
        // before it by the bar.sync above; release is cumulative), see the file comment.
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

__device__ __forceinline__ u8* stage_of(const Args& a, u32 rank, u32 parity) {
    return reinterpret_cast<u8*>(a.peer[rank] + STAGE_OFF + (2ull * blockIdx.x + parity) * a.stage_per_block);
}

__device__ __forceinline__ u64 round_down(u64 x, u64 m) { return x - x % m; }
__device__ __forceinline__ u64 round_up(u64 x, u64 m) { return (x + m - 1) / m * m; }
__device__ __forceinline__ u64 min64(u64 a, u64 b) { return a < b ? a : b; }

// Elements per block and step: at most what `slots` slots of the staging half hold, and no
// more than an even share of `count` over the grid (so small messages use every block).
// A multiple of the pack size, so slots and block ranges stay 16-byte aligned.
template <typename T>
__device__ __forceinline__ u64 per_block(const Args& a, u64 slots, u64 count) {
    const u64 P = Pack<T>::N;
    const u64 cap = round_down(a.stage_per_block / slots / sizeof(T), P);
    const u64 even = round_up((count + gridDim.x - 1) / gridDim.x, P);
    const u64 m = min64(cap, even);
    return m == 0 ? P : m;
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

// A failed barrier is either an abort (nothing is saved) or a descriptor mismatch, which
// only the first barrier of step 0 detects, on every rank alike: every rank then counts
// exactly one step, so the counters stay equal across ranks.
#define BARRIER_OR_RETURN(a, s, steps) \
    if (!barrier(a, &s)) {             \
        save_state(a, &s, 1);          \
        return;                        \
    }

template <typename T, typename Op>
__device__ __forceinline__ void reduce_pack(Pack<T>& p, typename Acc<T>::type* acc, bool first) {
    typedef typename Acc<T>::type A;
    if (first) {
#pragma unroll
        for (int k = 0; k < Pack<T>::N; k++) acc[k] = widen(p.v[k]);
    } else {
#pragma unroll
        for (int k = 0; k < Pack<T>::N; k++) acc[k] = Op::f(acc[k], (A)widen(p.v[k]));
    }
}

template <typename T, typename Op>
__device__ __forceinline__ void finish_pack(Pack<T>& p, const typename Acc<T>::type* acc, u32 W) {
#pragma unroll
    for (int k = 0; k < Pack<T>::N; k++) p.v[k] = narrow<T>(Finish<Op>::f(acc[k], W));
}

// Pack i of the reduction, in rank order, of rank `own`'s input `in` (valid below `hi`) and
// the other ranks' staging slots (`slots` + slot_of(j, own) * width, at i - lo): every rank
// that reduces an element adds the same values in the same order, so gets the same bits.
template <typename T, typename Op>
__device__ __forceinline__ void reduce_staged(Pack<T>& p, const T* in, const T* slots, u32 own, u32 W, u64 width, u64 i, u64 lo, u64 hi) {
    typename Acc<T>::type acc[Pack<T>::N];
    for (u32 j = 0; j < W; j++) {
        if (j == own) load_pack(p, in, i, hi);
        else load_stage(p, slots + slot_of(j, own) * width, i - lo);
        reduce_pack<T, Op>(p, acc, j == 0);
    }
    finish_pack<T, Op>(p, acc, W);
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

// ---------------------------------------------------------------------------------------
// all_reduce, one-shot: count elements in `in`, result in `out` (may alias in).
// Each step, block b takes m elements and writes them into its slot of every peer's
// staging (remote stores over NVLink), passes a barrier, then reduces in rank order: its
// own input for itself, the slots for the others (so every rank computes the same bits).
template <typename T, typename Op>
__device__ void ar_oneshot(const Args& a) {
    __shared__ BlockState s;
    load_state(a, &s);
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
        for_packs<T>(
            lo, hi,
            [&](Pack<T>& p, u64 i) { reduce_staged<T, Op>(p, in, mine, me, W, m, i, lo, hi); },
            [&](const Pack<T>& p, u64 i) { store_pack(p, out, i, hi); });
    }
    save_state(a, &s, steps);
    note_call(a, a.count * sizeof(T), 2);
}

// ---------------------------------------------------------------------------------------
// In place (see "In place" in the file comment). Called after the first barrier, when every
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

// all_reduce in place (in and out in the pool, out may alias in): rank r owns shard r;
// for each element of it, one thread reads that element of every rank's input (rank
// order), reduces, and writes the result into every rank's output; then one barrier.
// No barrier is needed between the reads and the writes: an element index is read and
// written, on every rank, by that one thread only (reads before its dependent writes), so
// aliasing in and out is safe. The closing barrier orders every push before each rank's
// later work, and every read of my buffers before I return.
template <typename T, typename Op>
__device__ void ar_in_place(const Args& a, BlockState& s) {
    typedef typename Acc<T>::type A;
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count, P = Pack<T>::N;
    const u64 shard = round_up((n + W - 1) / W, P);
    u64 lo, hi;
    block_range(shard, P, &lo, &hi);
    const u64 slo = min64(me * shard + lo, n), shi = min64(me * shard + hi, n);
    for_packs<T>(
        slo, shi,
        [&](Pack<T>& p, u64 i) {
            A acc[Pack<T>::N];
            for (u32 j = 0; j < W; j++) {
                load_pack(p, peer_in<T>(a, j), i, shi);
                reduce_pack<T, Op>(p, acc, j == 0);
            }
            finish_pack<T, Op>(p, acc, W);
        },
        [&](const Pack<T>& p, u64 i) {
            for (u32 j0 = 0; j0 < W; j0++) store_pack(p, peer_out<T>(a, (me + j0) % W), i, shi);
        });
    barrier(a, &s);
}

// reduce_scatter in place (in, world * count elements, in the pool): pull shard `rank` of
// every peer's input, reduce in rank order into my output; barrier (peers are done reading
// my input).
template <typename T, typename Op>
__device__ void rs_in_place(const Args& a, BlockState& s) {
    typedef typename Acc<T>::type A;
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count, P = Pack<T>::N;
    T* out = reinterpret_cast<T*>(a.out);
    u64 lo, hi;
    block_range(n, P, &lo, &hi);
    for_packs<T>(
        lo, hi,
        [&](Pack<T>& p, u64 i) {
            A acc[Pack<T>::N];
            for (u32 j = 0; j < W; j++) {
                load_pack(p, peer_in<T>(a, j) + me * n, i, hi);
                reduce_pack<T, Op>(p, acc, j == 0);
            }
            finish_pack<T, Op>(p, acc, W);
        },
        [&](const Pack<T>& p, u64 i) { store_pack(p, out, i, hi); });
    barrier(a, &s);
}

// all_gather in place (out, world * count bytes, in the pool): push my input into slot
// `rank` of every rank's output (my own too, unless the input already is that slot, as in
// FSDP); barrier (every push has landed).
__device__ void ag_in_place(const Args& a, BlockState& s) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const u8* in = reinterpret_cast<const u8*>(a.in);
    const bool self_copy = reinterpret_cast<const u8*>(a.out) + me * n != in;
    u64 lo, hi;
    block_range(n, 16, &lo, &hi);
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

// broadcast in place (out in the pool): the root pushes its input into every peer's
// output (and its own, if it is another buffer); barrier.
__device__ void bc_in_place(const Args& a, BlockState& s) {
    const u64 n = a.count;
    if (a.rank == a.root) {
        const u8* in = reinterpret_cast<const u8*>(a.in);
        u64 lo, hi;
        block_range(n, 16, &lo, &hi);
        for_packs<u8>(
            lo, hi, [&](Pack<u8>& p, u64 i) { load_pack(p, in, i, hi); },
            [&](const Pack<u8>& p, u64 i) {
                for (u32 j = 0; j < a.world; j++) {
                    if (j != a.rank || a.out != a.in) store_pack(p, peer_out<u8>(a, j), i, hi);
                }
            });
    }
    barrier(a, &s);
}

// The start every kernel that may run in place shares (see "In place"): pushes of step 0
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

// all_reduce, two-shot: reduce-scatter then all-gather, both through staging, with ONE
// barrier per step. Each step, block b takes m elements split into `world` shards.
// Staging holds an RS area and an AG area of world - 1 shard slots each.
//   A. push shard j of my input into rank j's RS slot for me;               barrier(s)
//   B. copy the AG slots of step s - 1 into my output (they arrived before barrier(s):
//      each peer pushed them before signalling it); reduce shard `rank` of step s in rank
//      order (my own input for myself), write it to my output and push it into every
//      peer's AG slot for me.
// After the last step, one more barrier, then the last AG copy.
// Reuse: a peer writes RS slots of parity p again in phase A of step s + 2, after passing
// barrier(s + 1), which needs my signal given after my phase B of step s (my last read of
// them); it writes AG slots of parity p again in phase B of step s + 2, after barrier(s + 2),
// which needs my signal given after my phase B of step s + 1 (where I copy them out).
template <typename T, typename Op>
__device__ __forceinline__ void copy_ag(const Args& a, u64 st, u64 per_step, u64 m, u64 shard, const T* ag, T* out) {
    const u32 W = a.world, me = a.rank;
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, a.count);
    for (u32 j0 = 1; j0 < W; j0++) {
        const u32 j = (me + j0) % W;
        const u64 slo = lo + j * shard;
        const u64 shi = min64(slo + shard, hi);
        const T* src = ag + slot_of(j, me) * shard;
        for_packs<T>(
            slo, shi, [&](Pack<T>& p, u64 i) { load_stage(p, src, i - slo); },
            [&](const Pack<T>& p, u64 i) { store_pack(p, out, i, shi); });
    }
}

// Phase A of step st: shard j of my input into rank j's RS slot for me.
template <typename T>
__device__ __forceinline__ void twoshot_push(const Args& a, u64 st, u64 per_step, u64 m, u64 shard, u32 par) {
    const u32 W = a.world, me = a.rank;
    const T* in = reinterpret_cast<const T*>(a.in);
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, a.count);
    for (u32 j0 = 1; j0 < W; j0++) {
        const u32 j = (me + j0) % W;
        const u64 slo = lo + j * shard;
        const u64 shi = min64(slo + shard, hi);
        T* dst = reinterpret_cast<T*>(stage_of(a, j, par)) + slot_of(me, j) * shard;
        for_packs<T>(
            slo, shi, [&](Pack<T>& p, u64 i) { load_pack(p, in, i, shi); },
            [&](const Pack<T>& p, u64 i) { store_stage(p, dst, i - slo); });
    }
}

template <typename T, typename Op>
__device__ void ar_twoshot(const Args& a) {
    __shared__ BlockState s;
    load_state(a, &s);
    const u32 W = a.world, me = a.rank;
    const u32 slots = W > 1 ? W - 1 : 1;
    const u64 shard = per_block<T>(a, 2 * slots, (a.count + W - 1) / W);
    const u64 m = shard * W;
    const u64 per_step = m * gridDim.x;
    const u64 steps = steps_for(a.count, per_step);
    const T* in = reinterpret_cast<const T*>(a.in);
    T* out = reinterpret_cast<T*>(a.out);
    if (!staged_start(
            a, s, a.count * sizeof(T), [&] { twoshot_push<T>(a, 0, per_step, m, shard, s.step & 1); },
            [&] { ar_in_place<T, Op>(a, s); }))
        return;
    for (u64 st = 0; st < steps; st++) {
        const u32 par = (s.step + (u32)st) & 1;
        const u64 lo = st * per_step + blockIdx.x * m;
        const u64 hi = min64(lo + m, a.count);
        if (st > 0) {
            twoshot_push<T>(a, st, per_step, m, shard, par);
            BARRIER_OR_RETURN(a, s, steps + 1)
        }
        if (st > 0) {
            const T* ag = reinterpret_cast<const T*>(stage_of(a, me, par ^ 1)) + slots * shard;
            copy_ag<T, Op>(a, st - 1, per_step, m, shard, ag, out);
        }
        const T* rs = reinterpret_cast<const T*>(stage_of(a, me, par));
        const u64 slo = lo + me * shard;
        const u64 shi = min64(slo + shard, hi);
        for_packs<T>(
            slo, shi,
            [&](Pack<T>& p, u64 i) { reduce_staged<T, Op>(p, in, rs, me, W, shard, i, slo, shi); },
            [&](const Pack<T>& p, u64 i) {
                store_pack(p, out, i, shi);
                for (u32 j0 = 1; j0 < W; j0++) {
                    const u32 j = (me + j0) % W;
                    store_stage(p, reinterpret_cast<T*>(stage_of(a, j, par)) + (slots + slot_of(me, j)) * shard, i - slo);
                }
            });
    }
    // The AG pushes of the last step arrive before this barrier's signals.
    BARRIER_OR_RETURN(a, s, steps + 1)
    {
        const u32 par = (s.step + (u32)(steps - 1)) & 1;
        const T* ag = reinterpret_cast<const T*>(stage_of(a, me, par)) + slots * shard;
        copy_ag<T, Op>(a, steps - 1, per_step, m, shard, ag, out);
    }
    save_state(a, &s, steps);
}

// reduce_scatter: `in` holds world * count elements, `out` count (this rank's shard).
// Each step, block b takes m elements of every shard and pushes shard j's piece into rank
// j's slot for me; barrier; then, while the next step's pushes go out over NVLink, it
// reduces this step's slots in rank order (own input for myself) into the output:
//   push(0) barrier(0) | push(1) reduce(0) barrier(1) | ... | reduce(last)
// Reuse: a peer writes parity p's slots again at push(s + 2), after barrier(s + 1), which
// needs my signal given after reduce(s) (my last read of them).
template <typename T, typename Op>
__device__ __forceinline__ void rs_reduce_step(const Args& a, u64 st, u64 per_step, u64 m, u32 par, const T* in, T* out) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, n);
    const T* rs = reinterpret_cast<const T*>(stage_of(a, me, par));
    const T* own = in + me * n;
    for_packs<T>(
        lo, hi,
        [&](Pack<T>& p, u64 i) { reduce_staged<T, Op>(p, own, rs, me, W, m, i, lo, hi); },
        [&](const Pack<T>& p, u64 i) { store_pack(p, out, i, hi); });
}

template <typename T>
__device__ __forceinline__ void rs_push(const Args& a, u64 st, u64 per_step, u64 m, u32 par) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const T* in = reinterpret_cast<const T*>(a.in);
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, n);
    for (u32 j0 = 1; j0 < W; j0++) {
        const u32 j = (me + j0) % W;
        const T* src = in + j * n;
        T* dst = reinterpret_cast<T*>(stage_of(a, j, par)) + slot_of(me, j) * m;
        for_packs<T>(
            lo, hi, [&](Pack<T>& p, u64 i) { load_pack(p, src, i, hi); },
            [&](const Pack<T>& p, u64 i) { store_stage(p, dst, i - lo); });
    }
}

template <typename T, typename Op>
__device__ void reduce_scatter(const Args& a) {
    __shared__ BlockState s;
    load_state(a, &s);
    const u32 W = a.world;
    const u64 n = a.count;
    const u64 m = per_block<T>(a, W > 1 ? W - 1 : 1, n);
    const u64 per_step = m * gridDim.x;
    const u64 steps = steps_for(n, per_step);
    const T* in = reinterpret_cast<const T*>(a.in);
    T* out = reinterpret_cast<T*>(a.out);
    if (!staged_start(
            a, s, (u64)W * n * sizeof(T), [&] { rs_push<T>(a, 0, per_step, m, s.step & 1); },
            [&] { rs_in_place<T, Op>(a, s); }))
        return;
    for (u64 st = 1; st < steps; st++) {
        const u32 par = (s.step + (u32)st) & 1;
        rs_push<T>(a, st, per_step, m, par);
        rs_reduce_step<T, Op>(a, st - 1, per_step, m, par ^ 1, in, out);
        BARRIER_OR_RETURN(a, s, steps)
    }
    rs_reduce_step<T, Op>(a, steps - 1, per_step, m, (s.step + (u32)(steps - 1)) & 1, in, out);
    save_state(a, &s, steps);
}

// all_gather (bytes): `in` holds count bytes, `out` world * count. Each step, block b
// copies its piece of my input into my own output block and pushes it into my slot of
// every peer's staging; barrier; the copy of the peers' slots into my output is deferred
// to the next step's first phase (as in two-shot: the slots are rewritten two steps later,
// after a barrier that needs my signal, given after the copy).
__device__ __forceinline__ void copy_gathered(const Args& a, u64 st, u64 per_step, u64 m, const u8* mine, u8* out) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, n);
    for (u32 j0 = 1; j0 < W; j0++) {
        const u32 j = (me + j0) % W;
        const u8* src = mine + slot_of(j, me) * m;
        u8* dst = out + j * n;
        for_packs<u8>(
            lo, hi, [&](Pack<u8>& p, u64 i) { load_stage(p, src, i - lo); },
            [&](const Pack<u8>& p, u64 i) { store_pack(p, dst, i, hi); });
    }
}

__device__ __forceinline__ void ag_push(const Args& a, u64 st, u64 per_step, u64 m, u32 par) {
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const u8* in = reinterpret_cast<const u8*>(a.in);
    u8* out = reinterpret_cast<u8*>(a.out);
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, n);
    for_packs<u8>(
        lo, hi, [&](Pack<u8>& p, u64 i) { load_pack(p, in, i, hi); },
        [&](const Pack<u8>& p, u64 i) {
            store_pack(p, out + me * n, i, hi);
            for (u32 j0 = 1; j0 < W; j0++) {
                const u32 j = (me + j0) % W;
                store_stage(p, stage_of(a, j, par) + slot_of(me, j) * m, i - lo);
            }
        });
}

extern "C" __global__ void __launch_bounds__(512) rs_all_gather(const Args a) {
    __shared__ BlockState s;
    load_state(a, &s);
    const u32 W = a.world, me = a.rank;
    const u64 n = a.count;
    const u64 m = per_block<u8>(a, W > 1 ? W - 1 : 1, n);
    const u64 per_step = m * gridDim.x;
    const u64 steps = steps_for(n, per_step);
    u8* out = reinterpret_cast<u8*>(a.out);
    if (!staged_start(
            a, s, (u64)W * n, [&] { ag_push(a, 0, per_step, m, s.step & 1); }, [&] { ag_in_place(a, s); }))
        return;
    for (u64 st = 1; st < steps; st++) {
        const u32 par = (s.step + (u32)st) & 1;
        copy_gathered(a, st - 1, per_step, m, stage_of(a, me, par ^ 1), out);
        ag_push(a, st, per_step, m, par);
        BARRIER_OR_RETURN(a, s, steps)
    }
    copy_gathered(a, steps - 1, per_step, m, stage_of(a, me, (s.step + (u32)(steps - 1)) & 1), out);
    save_state(a, &s, steps);
}

// broadcast (bytes): the root pushes count bytes of `in` into every peer's staging;
// barrier; the others copy it into `out`.
__device__ __forceinline__ void bc_push(const Args& a, u64 st, u64 per_step, u64 m, u32 par) {
    if (a.rank != a.root) return;
    const u64 n = a.count;
    const u8* in = reinterpret_cast<const u8*>(a.in);
    u8* out = reinterpret_cast<u8*>(a.out);
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, n);
    for_packs<u8>(
        lo, hi, [&](Pack<u8>& p, u64 i) { load_pack(p, in, i, hi); },
        [&](const Pack<u8>& p, u64 i) {
            if (out != in) store_pack(p, out, i, hi);
            for (u32 j = 0; j < a.world; j++) {
                if (j != a.rank) store_stage(p, stage_of(a, j, par), i - lo);
            }
        });
}

__device__ __forceinline__ void bc_copy(const Args& a, u64 st, u64 per_step, u64 m, u32 par) {
    if (a.rank == a.root) return;
    const u64 n = a.count;
    u8* out = reinterpret_cast<u8*>(a.out);
    const u64 lo = st * per_step + blockIdx.x * m;
    const u64 hi = min64(lo + m, n);
    const u8* mine = stage_of(a, a.rank, par);
    for_packs<u8>(
        lo, hi, [&](Pack<u8>& p, u64 i) { load_stage(p, mine, i - lo); },
        [&](const Pack<u8>& p, u64 i) { store_pack(p, out, i, hi); });
}

extern "C" __global__ void __launch_bounds__(512) rs_broadcast(const Args a) {
    __shared__ BlockState s;
    load_state(a, &s);
    const u64 n = a.count;
    const u64 m = per_block<u8>(a, 1, n);
    const u64 per_step = m * gridDim.x;
    const u64 steps = steps_for(n, per_step);
    if (!staged_start(
            a, s, n, [&] { bc_push(a, 0, per_step, m, s.step & 1); }, [&] { bc_in_place(a, s); }))
        return;
    bc_copy(a, 0, per_step, m, s.step & 1);
    for (u64 st = 1; st < steps; st++) {
        const u32 par = (s.step + (u32)st) & 1;
        bc_push(a, st, per_step, m, par);
        BARRIER_OR_RETURN(a, s, steps)
        bc_copy(a, st, per_step, m, par);
    }
    save_state(a, &s, steps);
}

// gather (bytes): `in` holds count bytes on every rank, `out` world * count on the root.
// Each step, block b: the root copies its own piece into its slot of the output; every
// other rank pushes its piece into its slot of the root's staging; barrier; the root
// copies the slots into the output. Reuse: a rank writes parity p's slot again at step
// s + 2, after barrier(s + 1), which needs the root's signal given after its copy of s.
extern "C" __global__ void __launch_bounds__(512) rs_gather(const Args a) {
    __shared__ BlockState s;
    load_state(a, &s);
    const u32 W = a.world, me = a.rank, R = a.root;
    const u64 n = a.count;
    const u64 m = per_block<u8>(a, W > 1 ? W - 1 : 1, n);
    const u64 per_step = m * gridDim.x;
    const u64 steps = steps_for(n, per_step);
    const u8* in = reinterpret_cast<const u8*>(a.in);
    u8* out = reinterpret_cast<u8*>(a.out);
    for (u64 st = 0; st < steps; st++) {
        const u32 par = (s.step + (u32)st) & 1;
        const u64 lo = st * per_step + blockIdx.x * m;
        const u64 hi = min64(lo + m, n);
        if (me == R) {
            if (out + R * n != in) {
                for_packs<u8>(
                    lo, hi, [&](Pack<u8>& p, u64 i) { load_pack(p, in, i, hi); },
                    [&](const Pack<u8>& p, u64 i) { store_pack(p, out + R * n, i, hi); });
            }
        } else {
            u8* dst = stage_of(a, R, par) + slot_of(me, R) * m;
            for_packs<u8>(
                lo, hi, [&](Pack<u8>& p, u64 i) { load_pack(p, in, i, hi); },
                [&](const Pack<u8>& p, u64 i) { store_stage(p, dst, i - lo); });
        }
        BARRIER_OR_RETURN(a, s, steps)
        if (me == R) {
            const u8* mine = stage_of(a, R, par);
            for (u32 j0 = 1; j0 < W; j0++) {
                const u32 j = (R + j0) % W;
                const u8* src = mine + slot_of(j, R) * m;
                for_packs<u8>(
                    lo, hi, [&](Pack<u8>& p, u64 i) { load_stage(p, src, i - lo); },
                    [&](const Pack<u8>& p, u64 i) { store_pack(p, out + j * n, i, hi); });
            }
        }
    }
    save_state(a, &s, steps);
    note_call(a, (u64)W * n, 2);
}

// scatter (bytes): `in` holds world * count bytes on the root, `out` count on every rank.
// Each step, block b: the root pushes piece j of its input into rank j's staging (and
// copies its own piece into its output); barrier; the others copy it into their output.
// Reuse as for broadcast: the root writes parity p again at step s + 2, after barrier(s + 1),
// which needs every rank's signal given after its copy of step s.
extern "C" __global__ void __launch_bounds__(512) rs_scatter(const Args a) {
    __shared__ BlockState s;
    load_state(a, &s);
    const u32 W = a.world, me = a.rank, R = a.root;
    const u64 n = a.count;
    const u64 m = per_block<u8>(a, 1, n);
    const u64 per_step = m * gridDim.x;
    const u64 steps = steps_for(n, per_step);
    const u8* in = reinterpret_cast<const u8*>(a.in);
    u8* out = reinterpret_cast<u8*>(a.out);
    for (u64 st = 0; st < steps; st++) {
        const u32 par = (s.step + (u32)st) & 1;
        const u64 lo = st * per_step + blockIdx.x * m;
        const u64 hi = min64(lo + m, n);
        if (me == R) {
            for (u32 j0 = 0; j0 < W; j0++) {
                const u32 j = (R + j0) % W;
                const u8* src = in + j * n;
                if (j == R) {
                    if (src != out) {
                        for_packs<u8>(
                            lo, hi, [&](Pack<u8>& p, u64 i) { load_pack(p, src, i, hi); },
                            [&](const Pack<u8>& p, u64 i) { store_pack(p, out, i, hi); });
                    }
                } else {
                    u8* dst = stage_of(a, j, par);
                    for_packs<u8>(
                        lo, hi, [&](Pack<u8>& p, u64 i) { load_pack(p, src, i, hi); },
                        [&](const Pack<u8>& p, u64 i) { store_stage(p, dst, i - lo); });
                }
            }
        }
        BARRIER_OR_RETURN(a, s, steps)
        if (me != R) {
            const u8* mine = stage_of(a, me, par);
            for_packs<u8>(
                lo, hi, [&](Pack<u8>& p, u64 i) { load_stage(p, mine, i - lo); },
                [&](const Pack<u8>& p, u64 i) { store_pack(p, out, i, hi); });
        }
    }
    save_state(a, &s, steps);
    note_call(a, (u64)W * n, 2);
}

// reduce to a root: `in` holds count elements on every rank, `out` the result on the
// root (it may alias in; other ranks' out is not written). Each step, block b: every rank
// but the root pushes its piece into its slot of the root's staging; barrier; the root
// reduces in rank order (its own input for itself) into its output. Reuse as for gather.
template <typename T, typename Op>
__device__ void reduce_root(const Args& a) {
    __shared__ BlockState s;
    load_state(a, &s);
    const u32 W = a.world, me = a.rank, R = a.root;
    const u64 n = a.count;
    const u64 m = per_block<T>(a, W > 1 ? W - 1 : 1, n);
    const u64 per_step = m * gridDim.x;
    const u64 steps = steps_for(n, per_step);
    const T* in = reinterpret_cast<const T*>(a.in);
    T* out = reinterpret_cast<T*>(a.out);
    for (u64 st = 0; st < steps; st++) {
        const u32 par = (s.step + (u32)st) & 1;
        const u64 lo = st * per_step + blockIdx.x * m;
        const u64 hi = min64(lo + m, n);
        if (me != R) {
            T* dst = reinterpret_cast<T*>(stage_of(a, R, par)) + slot_of(me, R) * m;
            for_packs<T>(
                lo, hi, [&](Pack<T>& p, u64 i) { load_pack(p, in, i, hi); },
                [&](const Pack<T>& p, u64 i) { store_stage(p, dst, i - lo); });
        }
        BARRIER_OR_RETURN(a, s, steps)
        if (me == R) {
            const T* mine = reinterpret_cast<const T*>(stage_of(a, R, par));
            for_packs<T>(
                lo, hi,
                [&](Pack<T>& p, u64 i) { reduce_staged<T, Op>(p, in, mine, R, W, m, i, lo, hi); },
                [&](const Pack<T>& p, u64 i) { store_pack(p, out, i, hi); });
        }
    }
    save_state(a, &s, steps);
    note_call(a, n * sizeof(T), 2);
}

// ---------------------------------------------------------------------------------------
// all_to_all (bytes; see "all_to_all" in the file comment). Rank me's chunk for peer j is
// send_n[j] bytes at send[j]; the chunk from peer i lands at recv[i] (recv_n[i] bytes).
// Addresses are absolute, so the list form needs no flattening. Steps as in all_gather:
// block b moves bytes [s * G * m + b * m, + m) of every chunk at step s, through its slot
// of the receiver's staging (world - 1 slots of m bytes), and copies the slots it received
// at step s - 1 while step s's pushes travel:
//   barrier(tables) | push(0) barrier | copy(0) push(1) barrier | ... | copy(last)
// Reuse: as in all_gather (a slot of parity p is rewritten at step s + 2, after a barrier
// that needs the receiver's signal given after its copy of step s); the first push of a
// kernel follows the table barrier, which every peer passed after its previous kernel.
struct A2aArgs {
    Args a;
    u64 send[MAX_RANKS];
    u64 send_n[MAX_RANKS];
    u64 recv[MAX_RANKS];
    u64 recv_n[MAX_RANKS];
};

__device__ __forceinline__ u64* a2a_table(u64 block_base, u32 epoch, u32 cuda_block) {
    return reinterpret_cast<u64*>(block_base + A2A_OFF) + ((epoch & 1) * MAX_BLOCKS + cuda_block) * 2 * MAX_RANKS;
}

__device__ __forceinline__ void a2a_push(const A2aArgs& x, u64 st, u64 per_step, u64 m, u32 par, u32 tid, u32 nt) {
    const Args& a = x.a;
    const u32 W = a.world, me = a.rank;
    for (u32 j0 = 0; j0 < W; j0++) {
        const u32 j = (me + j0) % W;
        const u64 n = x.send_n[j];
        const u64 lo = st * per_step + blockIdx.x * m;
        if (lo >= n) continue;
        const u64 hi = min64(lo + m, n);
        const u8* src = reinterpret_cast<const u8*>(x.send[j]);
        if (j == me) {
            u8* dst = reinterpret_cast<u8*>(x.recv[me]);
            for_packs_by<u8>(
                lo, hi, tid, nt, [&](Pack<u8>& p, u64 i) { load_pack(p, src, i, hi); },
                [&](const Pack<u8>& p, u64 i) { store_pack(p, dst, i, hi); });
        } else {
            u8* dst = stage_of(a, j, par) + slot_of(me, j) * m;
            for_packs_by<u8>(
                lo, hi, tid, nt, [&](Pack<u8>& p, u64 i) { load_pack(p, src, i, hi); },
                [&](const Pack<u8>& p, u64 i) { store_stage(p, dst, i - lo); });
        }
    }
}

__device__ __forceinline__ void a2a_copy(const A2aArgs& x, u64 st, u64 per_step, u64 m, u32 par, u32 tid, u32 nt) {
    const Args& a = x.a;
    const u32 W = a.world, me = a.rank;
    const u8* mine = stage_of(a, me, par);
    for (u32 i0 = 1; i0 < W; i0++) {
        const u32 i = (me + i0) % W;
        const u64 n = x.recv_n[i];
        const u64 lo = st * per_step + blockIdx.x * m;
        if (lo >= n) continue;
        const u64 hi = min64(lo + m, n);
        const u8* src = mine + slot_of(i, me) * m;
        u8* dst = reinterpret_cast<u8*>(x.recv[i]);
        for_packs_by<u8>(
            lo, hi, tid, nt, [&](Pack<u8>& p, u64 i2) { load_stage(p, src, i2 - lo); },
            [&](const Pack<u8>& p, u64 i2) { store_pack(p, dst, i2, hi); });
    }
}

extern "C" __global__ void __launch_bounds__(512) rs_all_to_all(const A2aArgs x) {
    const Args& a = x.a;
    __shared__ BlockState s;
    __shared__ unsigned long long s_max;
    __shared__ u32 s_bad;
    load_state(a, &s);
    const u32 W = a.world, me = a.rank, t = threadIdx.x;
    if (t < W) {
        u64* mine = a2a_table(a.peer[me], s.epoch + 1, blockIdx.x);
        mine[t] = x.send_n[t];
        mine[MAX_RANKS + t] = x.recv_n[t];
    }
    if (t == 0) {
        s_max = 0;
        s_bad = 0xffffffffu;
    }
    // The barrier's first __syncthreads orders the table stores before the signal.
    if (!barrier(a, &s)) {
        save_state(a, &s, 1);
        return;
    }
    // Every rank checks every pair (i sends to j what j expects from i) and finds the
    // largest chunk; the lowest bad pair is reported, so every rank reports the same one.
    for (u32 k = t; k < W * W; k += blockDim.x) {
        const u32 i = k / W, j = k % W;
        const u64 sent = a2a_table(a.peer[i], s.epoch, blockIdx.x)[j];
        const u64 expected = a2a_table(a.peer[j], s.epoch, blockIdx.x)[MAX_RANKS + i];
        if (sent != expected) atomicMin(&s_bad, k);
        atomicMax(&s_max, (unsigned long long)sent);
    }
    __syncthreads();
    if (s_bad != 0xffffffffu) {
        if (t == 0 && blockIdx.x == 0) {
            const u32 i = s_bad / W, j = s_bad % W;
            volatile u64* h = reinterpret_cast<volatile u64*>(a.err_host);
            h[4] = i;
            h[5] = j;
            h[6] = a2a_table(a.peer[i], s.epoch, blockIdx.x)[j];
            h[7] = a2a_table(a.peer[j], s.epoch, blockIdx.x)[MAX_RANKS + i];
            __threadfence_system();
            st_volatile_host(a.err_host, (ERR_A2A << 16) | i);
            __threadfence_system();
        }
        save_state(a, &s, 1);
        return;
    }
    const u64 biggest = s_max;
    const u64 m = per_block<u8>(a, W > 1 ? W - 1 : 1, biggest);
    const u64 per_step = m * gridDim.x;
    const u64 steps = steps_for(biggest, per_step);
    u64 total = 0;
    for (u32 j = 0; j < W; j++) total += x.send_n[j];
    note_call(a, total, 2);
    // Each step, half the threads push step st over NVLink while the other half copy
    // step st - 1 out of local staging (different slots: parities differ), so the copy
    // costs no step time; the barrier's bar.sync joins both halves before the signal.
    const u32 half = blockDim.x / 2, t2 = t - (t < half ? 0 : half);
    for (u64 st = 0; st < steps; st++) {
        const u32 par = (s.step + (u32)st) & 1;
        if (t >= half) {
            if (st > 0) a2a_copy(x, st - 1, per_step, m, par ^ 1, t2, blockDim.x - half);
        } else {
            a2a_push(x, st, per_step, m, par, t2, half);
        }
        BARRIER_OR_RETURN(a, s, steps)
    }
    a2a_copy(x, steps - 1, per_step, m, (s.step + (u32)(steps - 1)) & 1, t, blockDim.x);
    save_state(a, &s, steps);
}

// ---------------------------------------------------------------------------------------
// Point to point (see "Point to point" in the file comment). `a.root` is the peer's local
// index, `a.count` the message's bytes.
struct P2pArgs {
    Args a;
    u64 inbox_off;   // the inbox's offset in a block
    u64 chunk;       // bytes per (sender slot, CUDA block, parity); a multiple of 256
};

#define P2P_READY 0   // [block][sender] in the receiver's block
#define P2P_ACK 1     // [block][receiver] in the sender's block
#define P2P_SEND 2    // [block][receiver]: this rank's send steps (own block)
#define P2P_RECV 3    // [block][sender]: this rank's receive steps (own block)

__device__ __forceinline__ u32* p2p_word(u64 block_base, u32 area, u32 cuda_block, u32 j) {
    return reinterpret_cast<u32*>(block_base + P2P_OFF + area * 4096) + cuda_block * MAX_RANKS + j;
}
// The size the sender wrote for parity `par` (receiver's block).
__device__ __forceinline__ u64* p2p_size(u64 block_base, u32 cuda_block, u32 sender, u32 par) {
    return reinterpret_cast<u64*>(block_base + P2P_OFF + 4 * 4096) + (cuda_block * MAX_RANKS + sender) * 2 + par;
}
__device__ __forceinline__ u8* p2p_slot(const P2pArgs& x, u32 receiver, u32 sender, u32 par) {
    const u64 slot = (u64)slot_of(sender, receiver);
    return reinterpret_cast<u8*>(x.a.peer[receiver] + x.inbox_off) + ((slot * gridDim.x + blockIdx.x) * 2 + par) * x.chunk;
}

// Warp 0 of a send/recv block signals, the other warps move data, so the slow part of a
// step's signal (the system-scope release waits until the chunk's NVLink stores are
// performed) overlaps the next chunk's copy. Two named barriers of the whole block pass
// each step between them: FREE (warp 0 arrives, the data warps wait: step s may start, or
// `ok` = 0: stop) and DONE (the data warps arrive after their copy of step s, warp 0
// waits). bar.arrive / bar.sync order memory like bar.sync: the data warps' stores of a
// step happen before warp 0's release of it (cumulative), and warp 0's acquire of a
// signal happens before the data warps' accesses after FREE. Warp 0 lets the data warps
// start step s + 1 before it releases step s; a FREE and a DONE are never in flight twice.
#define BAR_FREE 1
#define BAR_DONE 2
__device__ __forceinline__ void bar_sync(u32 id) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(blockDim.x) : "memory"); }
__device__ __forceinline__ void bar_arrive(u32 id) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(blockDim.x) : "memory"); }

extern "C" __global__ void __launch_bounds__(512) rs_send(const P2pArgs x) {
    const Args& a = x.a;
    __shared__ u32 seq, ok;
    const u32 r = a.root, me = a.rank, b = blockIdx.x, t = threadIdx.x;
    const u64 n = a.count, C = x.chunk, per_step = C * gridDim.x;
    const u64 steps = steps_for(n, per_step);
    if (t == 0) {
        seq = *p2p_word(a.peer[me], P2P_SEND, b, r);
        ok = 1;
    }
    __syncthreads();
    if (t < 32) {
        // Step s may start once the receiver emptied its slot (ack >= q - 2).
        auto open = [&](u64 st) {
            const u32 q = seq + (u32)st + 1;
            if (t == 0 && !wait_geq(a, p2p_word(a.peer[me], P2P_ACK, b, r), q - 2, r)) ok = 0;
            __syncwarp();
            bar_arrive(BAR_FREE);
        };
        open(0);
        if (!ok) return;  // fatal: counters are not saved
        for (u64 st = 0; st < steps; st++) {
            const u32 q = seq + (u32)st + 1, par = q & 1;
            bar_sync(BAR_DONE);
            const bool more = st + 1 < steps;
            if (more) open(st + 1);
            if (t == 0) {
                *p2p_size(a.peer[r], b, me, par) = n;
                // Publishes the chunk (DONE, cumulative) and the size.
                st_release_sys(p2p_word(a.peer[r], P2P_READY, b, me), q);
            }
            if (more && !ok) return;
        }
        if (t == 0) *p2p_word(a.peer[me], P2P_SEND, b, r) = seq + (u32)steps;
        return;
    }
    const u8* in = reinterpret_cast<const u8*>(a.in);
    const u32 tid = t - 32, nt = blockDim.x - 32;
    for (u64 st = 0; st < steps; st++) {
        bar_sync(BAR_FREE);
        if (!ok) return;
        const u32 par = (seq + (u32)st + 1) & 1;
        const u64 lo = st * per_step + b * C;
        const u64 hi = min64(lo + C, n);
        u8* dst = p2p_slot(x, r, me, par);
        if (lo < hi) {
            for_packs_by<u8>(
                lo, hi, tid, nt, [&](Pack<u8>& p, u64 i) { load_pack(p, in, i, hi); },
                [&](const Pack<u8>& p, u64 i) { store_stage(p, dst, i - lo); });
        }
        bar_arrive(BAR_DONE);
    }
}

extern "C" __global__ void __launch_bounds__(512) rs_recv(const P2pArgs x) {
    const Args& a = x.a;
    __shared__ u32 seq, ok;
    const u32 src = a.root, me = a.rank, b = blockIdx.x, t = threadIdx.x;
    const u64 n = a.count, C = x.chunk, per_step = C * gridDim.x;
    const u64 steps = steps_for(n, per_step);
    if (t == 0) {
        seq = *p2p_word(a.peer[me], P2P_RECV, b, src);
        ok = 1;
    }
    __syncthreads();
    if (t < 32) {
        // Step s may be copied once the sender signalled it, with this rank's size.
        auto arrived = [&](u64 st) {
            const u32 q = seq + (u32)st + 1, par = q & 1;
            if (t == 0) {
                if (!wait_geq(a, p2p_word(a.peer[me], P2P_READY, b, src), q, src)) {
                    ok = 0;
                } else {
                    const u64 got = *p2p_size(a.peer[me], b, src, par);
                    if (got != n) {
                        volatile u64* h = reinterpret_cast<volatile u64*>(a.err_host);
                        h[48] = got;
                        h[49] = n;
                        __threadfence_system();
                        fail(a, ERR_P2P_SIZE, src);
                        ok = 0;
                    }
                }
            }
            __syncwarp();
            bar_arrive(BAR_FREE);
        };
        arrived(0);
        if (!ok) return;
        for (u64 st = 0; st < steps; st++) {
            const u32 q = seq + (u32)st + 1;
            bar_sync(BAR_DONE);
            // The slot was read (DONE): the sender may refill it.
            if (t == 0) st_release_sys(p2p_word(a.peer[src], P2P_ACK, b, me), q);
            if (st + 1 < steps) {
                arrived(st + 1);
                if (!ok) return;
            }
        }
        if (t == 0) *p2p_word(a.peer[me], P2P_RECV, b, src) = seq + (u32)steps;
        return;
    }
    u8* out = reinterpret_cast<u8*>(a.out);
    const u32 tid = t - 32, nt = blockDim.x - 32;
    for (u64 st = 0; st < steps; st++) {
        bar_sync(BAR_FREE);
        if (!ok) return;
        const u32 par = (seq + (u32)st + 1) & 1;
        const u64 lo = st * per_step + b * C;
        const u64 hi = min64(lo + C, n);
        const u8* slot = p2p_slot(x, me, src, par);
        if (lo < hi) {
            for_packs_by<u8>(
                lo, hi, tid, nt, [&](Pack<u8>& p, u64 i) { load_stage(p, slot, i - lo); },
                [&](const Pack<u8>& p, u64 i) { store_pack(p, out, i, hi); });
        }
        bar_arrive(BAR_DONE);
    }
}

// A device-side barrier of every local rank (all CUDA blocks, one epoch each).
extern "C" __global__ void __launch_bounds__(512) rs_barrier(const Args a) {
    __shared__ BlockState s;
    load_state(a, &s);
    const u64 steps = 0;
    BARRIER_OR_RETURN(a, s, steps)
    save_state(a, &s, steps);
}

// ---------------------------------------------------------------------------------------
// Entry points: rs_<algorithm>_<dtype>_<op>.

#define RS_ENTRY(ALG, T, TN, OP, ON)                                                        \
    extern "C" __global__ void __launch_bounds__(512) rs_##ALG##_##TN##_##ON(const Args a) { \
        ALG<T, OP>(a);                                                                      \
    }

#define RS_OPS(ALG, T, TN)             \
    RS_ENTRY(ALG, T, TN, OpSum, sum)   \
    RS_ENTRY(ALG, T, TN, OpAvg, avg)   \
    RS_ENTRY(ALG, T, TN, OpProd, prod) \
    RS_ENTRY(ALG, T, TN, OpMin, min)   \
    RS_ENTRY(ALG, T, TN, OpMax, max)

#define RS_TYPES(ALG)            \
    RS_OPS(ALG, float, f32)      \
    RS_OPS(ALG, f16, f16)        \
    RS_OPS(ALG, bf16, bf16)      \
    RS_OPS(ALG, i32, i32)        \
    RS_OPS(ALG, i64, i64)

RS_TYPES(ar_oneshot)
RS_TYPES(ar_twoshot)
RS_TYPES(reduce_scatter)
RS_TYPES(reduce_root)
