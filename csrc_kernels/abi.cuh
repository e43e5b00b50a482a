// rsccl's kernel ABI: everything the host (rust/core) and the kernels must agree on, defined
// here once: the numbers (threads per block, limits, the symmetric block's layout, error
// codes) and the argument blocks the kernels take by value. rust/core/build.rs reads this
// file and generates the Rust side from it (the constants, and const assertions that the
// #[repr(C)] mirrors in rust/core/src/cuda/engine/abi.rs have exactly these layouts); the
// static_asserts at the end make the compiler check the layout build.rs computed. So a
// change here that the Rust side does not follow fails to build.
//
// build.rs understands a small subset of C, which this file keeps to: `#define NAME value`
// with an integer expression (+ - * and parentheses over numbers and earlier names),
// structs of u32 / u64 fields, fixed-size arrays of them, and earlier structs, and
// static_asserts of sizeof / alignof.

#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

// NOTE [Block layout]
// Memory: every local rank owns one VMM allocation ("symmetric block"), mapped by every
// local rank; `Args::peer[j]` is rank j's block as mapped in this process. A block is
//   [0, FLAGS_BYTES)          flags[MAX_BLOCKS][MAX_RANKS] u32: written by peers (barrier)
//   [STATS_OFF, +32)          {in-place collectives, bytes, all collectives, bytes} u64:
//                             this rank's kernels count them (memory_stats)
//   [CTR_OFF, +MAX_BLOCKS*8)  per CUDA block {epoch, step} u32 pairs: this rank only
//   [BUSY_OFF, +MAX_BLOCKS*4) per CUDA block: 1 while a kernel of the group runs that
//                             block on this GPU (NOTE [Kernel entry]): this rank only
//   [POISON_OFF, +4)          low 16 bits: 1 + the local index of the rank whose failure
//                             stopped the group (a peer's kernel, this rank's own kernel,
//                             or a host's abort); bits 16-23: that kernel's ERR_* cause and
//                             bits 24-31: 1 + the rank it names (the one a timed-out wait
//                             waited for), both 0 when a host wrote it for an abort or a
//                             dead peer (a host that found a mismatch before its teardown
//                             writes the mismatch's kind and the rank it names);
//                             POISON_DESTROYED once the group was destroyed;
//                             0 = none (NOTE [Bounded waits], NOTE [Kernel entry])
//   [DESC_OFF, +64 KiB)       desc[2][MAX_BLOCKS][MAX_RANKS] 32-byte collective descriptors,
//                             written by peers before their first signal of a kernel, in
//                             the half picked by the barrier epoch's parity
//   [RING_OFF, +512)          ring schedule words (NOTE [Ring] in ring.cuh): ready[MAX_BLOCKS]
//                             u32 written by the previous rank of the ring, then
//                             ack[MAX_BLOCKS] u32 written by the next
//   [P2P_OFF, +48 KiB)        send/recv signals and counters, then the message sizes per
//                             (CUDA block, sender, inbox slot) (NOTE [Point to point])
//   [A2A_OFF, +32 KiB)        all_to_all split tables: [parity][CUDA block] this rank's
//                             send sizes then receive sizes, MAX_RANKS u64 each
//   [LL_OFF, +LL_BYTES)       low-latency kernels (NOTE [Low latency] in low_latency.cuh):
//                             LL_BUFS buffers of LL_BUF_BYTES, each a slot of
//                             ll_slot(world) bytes per sender ({4 data bytes, u32 epoch}
//                             words, written by the sender named by the slot, a region per
//                             CUDA block), then headers
//                             [LL_BUFS][MAX_RANKS][MAX_BLOCKS] of 16 bytes
//   [STAGE_OFF, stage end)    staging: for CUDA block b and parity p, `stage_per_block`
//                             bytes at STAGE_OFF + (2*b + p) * stage_per_block
//   [inbox_off, +p2p bytes)   send/recv inbox: per sending peer slot, CUDA block and one of
//                             P2P_DEPTH slots, `chunk` bytes (NOTE [Point to point])
//   [pool, block end)         the pool (rsccl.mem_pool()): user tensors, allocated by the
//                             host (rust/core/src/memory/device_heap.rs), used in place
#define MAX_RANKS 16
#define MAX_BLOCKS 64
#define FLAGS_BYTES (MAX_BLOCKS * MAX_RANKS * 4)
#define STATS_OFF 4096
#define CTR_OFF 8192
#define BUSY_OFF (CTR_OFF + MAX_BLOCKS * 8)
#define DESC_OFF 16384
#define DESC_WORDS 4
#define POISON_OFF (STATS_OFF + 256)
#define RING_OFF 81920
// The poison word's value once the group was destroyed (shutdown): a CUDA graph replayed
// after destroy_process_group must not run a collective of it (NOTE [Kernel entry]).
#define POISON_DESTROYED 4294967295u
#define P2P_OFF 131072
// Inbox slots per (sender, receiver, CUDA block): how many steps a sender may run ahead of
// its receiver (NOTE [Point to point]). A power of two (the slot is the step's sequence
// number modulo it, and u32 wrap-around keeps that consistent).
#define P2P_DEPTH 4
#define A2A_OFF 180224
// The low-latency kernels (NOTE [Low latency] in low_latency.cuh): at most
// ll_max_bytes(world) per sender (protocol.cuh: LL_MAX_BYTES in groups of up to 4 ranks,
// half of it up to 8, LL_MAX_BYTES_16 up to MAX_RANKS; cuda_low_latency_max_bytes may lower
// it), in LL_BUFS buffers picked by the block's epoch (a power of two, so that consecutive
// epochs pick different buffers across the u32 wrap). A buffer of LL_BUF_BYTES holds a slot
// per sender of the group, of ll_slot(world) bytes: a sender's bytes twice over ({data,
// epoch} words), in a region per CUDA block, each rounded up to a 16-byte pack (32 bytes of
// words). The slots are as large as the group's ranks leave room for: the buffer holds
// MAX_RANKS slots of LL_MAX_BYTES_16, 4 of LL_MAX_BYTES, or 8 of half of it.
#define LL_MAX_BYTES 65536
#define LL_MAX_BYTES_16 16384
#define LL_BUFS 2
#define LL_BUF_BYTES (MAX_RANKS * (2 * LL_MAX_BYTES_16 + 32 * MAX_BLOCKS))
#define LL_OFF 262144
#define LL_HDR_OFF (LL_OFF + LL_BUFS * LL_BUF_BYTES)
#define LL_BYTES (LL_BUFS * LL_BUF_BYTES + LL_BUFS * MAX_RANKS * MAX_BLOCKS * 16)
#define STAGE_OFF (LL_OFF + LL_BYTES)

// Error codes written to Args::err_host (bits 16-19: kind, low 16: peer local index): a
// mismatch into the first u32, a timeout or abort into the second, so that neither kind
// overwrites the other (the host clears a reported mismatch but never a fatal error).
// ERR_PEER also carries what the poison word said of the culprit: bits 20-23 its cause
// (an ERR_* code, 0 if a host poisoned with none), bits 24-31 1 + the rank that cause names.
#define ERR_TIMEOUT 1u
#define ERR_ABORTED 2u
#define ERR_MISMATCH 3u
#define ERR_PEER 4u       // a peer failed and poisoned the group (peer = that rank)
#define ERR_P2P_SIZE 5u   // recv: the sender's size differs (sizes at err_host + 384)
#define ERR_A2A 6u        // all_to_all splits disagree (pair and sizes at err_host + 32)
#define ERR_CONCURRENT 7u // two kernels of the group ran at once on this GPU (peer = this rank)

// Args::flags bits.
// FLAG_HOLD_ON_ERROR: a kernel that reports an error (fatal or a mismatch) keeps its block
// until the host's abort word is set, or the timeout: the stream it runs on does not move
// on past a failed collective before the host has acted on the report (cuda_on_error =
// "teardown": the host ends the process; NOTE [Bounded waits]).
#define FLAG_HOLD_ON_ERROR 1
// Bits 8-15: the grid of the group's low-latency kernels (decide::low_latency_grid), which
// sizes each block's region of their slots: every kernel's barrier keeps those regions
// fresh (NOTE [Low latency epochs] in protocol.cuh).
#define FLAG_LL_GRID_SHIFT 8

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
    u64 place_in;          // offset + 1 of `in` in the pool, 0 if none (NOTE [In place])
    u64 place_out;         // offset + 1 of `out` in the pool, 0 if none
    u32 rank;              // local index of this rank
    u32 world;             // local ranks
    u32 root;              // broadcast root (local index)
    u32 flags;             // FLAG_* bits
};

// The collective descriptor's first word (Args::desc0, built by the host in
// rust/core/src/cuda/engine/launch.rs): kind | dtype << 8 | op << 16 | root << 32, one byte
// each but the root. The reducing kernels take their reduce op from it.
#define DESC0_DTYPE_SHIFT 8
#define DESC0_OP_SHIFT 16
#define DESC0_ROOT_SHIFT 32
// Set in desc0 by the barriers of a copy-engine collective (NOTE [Copy engines], rust/core/
// src/cuda/engine/copy.rs): a rank whose call took the other path is a mismatch.
#define DESC0_COPY_ENGINE_BIT 48
// Set in desc0 by the host for a call on the ring schedule (NOTE [Ring] in ring.cuh): a rank
// whose call took the direct schedule is a mismatch.
#define DESC0_RING_BIT 49
// The call's grid (gridDim.x), in the descriptor the kernels publish and compare: put there
// by barrier() itself, not by the host (NOTE [Grids] in protocol.cuh).
#define DESC0_GRID_SHIFT 56

// Reduce op codes in desc0: rust/core's ReduceOp discriminants (const assertions in
// rust/core/src/cuda/kernels/mod.rs hold the two equal). The kernels reduce these five; AVG
// on floating types only (ReduceOp::check rejects it on integers before any launch).
#define OP_SUM 0
#define OP_PROD 1
#define OP_MIN 2
#define OP_MAX 3
#define OP_AVG 7

// Threads per block of every kernel (their __launch_bounds__; the host launches this many).
#define THREADS 512

// The all_to_all kernel's arguments (NOTE [all_to_all]).
struct A2aArgs {
    Args a;
    u64 send[MAX_RANKS];
    u64 send_n[MAX_RANKS];
    u64 recv[MAX_RANKS];
    u64 recv_n[MAX_RANKS];
};

// The send/recv arguments (NOTE [Point to point]). `a.root` is the peer's local
// index, `a.count` the message's bytes.
struct P2pArgs {
    Args a;
    u64 inbox_off;   // the inbox's offset in a block
    u64 chunk;       // bytes per (sender slot, CUDA block, inbox slot of P2P_DEPTH); a multiple of 256
};

// rs_p2p_signal (send/recv on the copy engines, NOTE [Copy-engine send/recv] in
// send_recv.cu) takes a P2pArgs whose descriptor words say what to do: desc0 = mode |
// the send/recv grid's blocks << P2P_CE_BLOCKS_SHIFT, desc1 = step | steps << 32 (the
// message's step j, 0-based, and its number of steps m); `a.count` is the message's bytes.
#define P2P_CE_DRAIN 1     // sender, first: every block's earlier sends were consumed
#define P2P_CE_READY 2     // sender, after step j's push: publish it; wait for step j - 1's ack
#define P2P_CE_ARRIVED 3   // receiver, before step j's copy-out: ack step j - 1; wait for step j
#define P2P_CE_FINISH 4    // receiver, after the last copy-out: ack it; advance the counter
#define P2P_CE_BLOCKS_SHIFT 8

// rs_ce_reduce_<dtype> (reduce_scatter on the copy engines, NOTE [Copy engines] in
// rust/core/src/cuda/engine/copy.rs): one round's reduction, after its barrier, of this
// rank's own block and the peers' slots of one staging buffer, all in local memory.
// `a.in`: this rank's own block of the input at the round's offset; `a.out`: the output
// at that offset; `a.count`: the round's elements; `a.desc0`: the call's (its op);
// `a.rank`, `a.world`: as always. `slots`: slot 0 of the buffer (slot_of(j, rank) holds
// rank j's bytes); `slot_bytes`: the distance between slots, a multiple of 256.
struct CeReduceArgs {
    Args a;
    u64 slots;
    u64 slot_bytes;
};

// The layout build.rs computed for the structs above (natural alignment, no packing),
// checked by the compiler; build.rs checks it computes the same numbers. (NVRTC has no
// offsetof: the field offsets follow from the field types' sizes and alignments, which
// these pin, and the Rust side checks every offset.)
static_assert(sizeof(u32) == 4 && alignof(u32) == 4, "u32");
static_assert(sizeof(u64) == 8 && alignof(u64) == 8, "u64");
static_assert(sizeof(Args) == 232, "Args layout");
static_assert(alignof(Args) == 8, "Args layout");
static_assert(sizeof(A2aArgs) == 744, "A2aArgs layout");
static_assert(sizeof(P2pArgs) == 248, "P2pArgs layout");
static_assert(sizeof(CeReduceArgs) == 248, "CeReduceArgs layout");
