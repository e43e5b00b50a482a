// send / recv (rs_send, rs_recv): not collectives of the group, NOTE [Point to point];
// rs_p2p_signal: their signals on the copy-engine path, NOTE [Copy-engine send/recv].

#include "common.cuh"

// NOTE [Point to point]
// Point to point (send/recv, rs_send / rs_recv): not a collective of the group. Each
//   (peer, direction) has its own host stream, so a rank's sends to j run concurrently
//   with its receives from j and with its collectives; the kernels touch none of the
//   collectives' state (flags, counters, descriptors, staging). A message of n bytes goes
//   in steps of C <= `chunk` bytes per CUDA block (block b moves bytes [s*G*C + b*C, +C)
//   of step s; C = p2p_step_bytes(n, chunk, G): the steps `chunk` needs, each spread
//   over every block); each (block, sender, receiver) has a sequence number q, counted by both
//   sides in their own blocks (send_seq / recv_seq), that advances by one per step, so
//   both agree without host round trips and under graph replay. Each (sender, receiver,
//   block) has D = P2P_DEPTH inbox slots, step q using slot q % D. Step q:
//     sender:   thread 0 waits until ack[b][receiver] (its own block) >= q - D (the
//               receiver has emptied slot q % D, last used by step q - D); the data warps
//               copy the chunk into the receiver's inbox slot (sender, b, q % D); a block
//               barrier; thread 0 stores the message size into size[b][sender][q % D] and
//               issues st.release.sys of q into ready[b][sender] (both in the receiver's
//               block).
//     receiver: thread 0 spins with ld.acquire.sys on ready[b][sender] (own block) until
//               >= q and checks the size; a block barrier; the data warps copy the slot
//               out; a block barrier; thread 0 issues st.release.sys of q into
//               ack[b][receiver] (sender's block).
//   (Warp 0 signals and the other warps copy, with named barriers: see rs_send.)
//   Ordering: as in the barrier: the block barrier orders every thread's accesses of the
//   step before thread 0's release (cumulative), the acquire synchronizes with it at
//   system scope, and the following block barrier extends that to the data warps. The
//   receiver's reads of a slot
//   happen before its ack, which happens before the sender's next write of that slot (and
//   of that size word: both are rewritten only by step q + D, after ack >= q).
//   Depth: with D slots the sender may run D steps ahead, so the signal round trip (the
//   release of step q, the receiver's acquire, its copy-out, its ack) may overlap the
//   pushes of steps q + 1 .. q + D - 1. Measured against D = 2 with the same inbox (4
//   H100s, 2026-11-27, two runs each): 16 MiB at 4 ranks 74 -> 68 us, 256 MiB 980-995 ->
//   963-974 us; at 2 ranks unchanged (256 MiB 865-870 us). The chunk size matters more
//   there: a 64 MiB inbox (chunks 4x larger) took 256 MiB at 2 ranks to 799 us
//   (docs/performance.md).
//   The first D steps need no ack ("eager"): a send of at most D chunks per block
//   completes without its receiver, as small NCCL sends do; a larger one waits for it
//   (bounded by the timeout). A receiver that finds a size other than its own records a
//   fatal error and poisons its peers: the sender's later waits stop too.

#define P2P_READY 0   // [block][sender] in the receiver's block
#define P2P_ACK 1     // [block][receiver] in the sender's block
#define P2P_SEND 2    // [block][receiver]: this rank's send steps (own block)
#define P2P_RECV 3    // [block][sender]: this rank's receive steps (own block)

__device__ __forceinline__ u32* p2p_word(u64 block_base, u32 area, u32 cuda_block, u32 j) {
    return reinterpret_cast<u32*>(block_base + P2P_OFF + area * 4096) + cuda_block * MAX_RANKS + j;
}
static_assert(P2P_DEPTH >= 2 && (P2P_DEPTH & (P2P_DEPTH - 1)) == 0, "P2P_DEPTH: a power of two, at least 2");
// The inbox slot of step (sequence number) q.
__device__ __forceinline__ u32 p2p_depth_slot(u32 q) { return q & (P2P_DEPTH - 1); }
// The size the sender wrote for inbox slot `d` (receiver's block).
__device__ __forceinline__ u64* p2p_size(u64 block_base, u32 cuda_block, u32 sender, u32 d) {
    return reinterpret_cast<u64*>(block_base + P2P_OFF + 4 * 4096) + (cuda_block * MAX_RANKS + sender) * P2P_DEPTH + d;
}
__device__ __forceinline__ u8* p2p_slot(const P2pArgs& x, u32 receiver, u32 sender, u32 d) {
    const u64 slot = (u64)slot_of(sender, receiver);
    return reinterpret_cast<u8*>(x.a.peer[receiver] + x.inbox_off) + ((slot * gridDim.x + blockIdx.x) * P2P_DEPTH + d) * x.chunk;
}

// The bytes each block moves per step of an n-byte message: the step count is the one the
// slot capacity `cap` (x.chunk) gives, and the message is spread evenly over those steps and
// the G blocks (rounded up to 256 bytes, so every block's share starts pack-aligned). So a
// message smaller than G slots (and of at least G x 256 bytes) keeps every block busy (with
// a 64 MiB inbox at 4 ranks a 1 MiB message would otherwise fill 5 of 22 blocks' slots),
// and a large one has no sliver of a last step. Sender and receiver compute it from the same n. Slot addresses
// (p2p_slot) keep `cap` as their stride, so messages of different sizes in flight at once
// never share bytes of the inbox.
__device__ __forceinline__ u64 p2p_step_bytes(u64 n, u64 cap, u64 G) {
    if (n == 0) return cap;
    const u64 steps = (n + cap * G - 1) / (cap * G);
    return min64(cap, round_up((n + G * steps - 1) / (G * steps), 256));
}

// The sender `src` wrote a size `got` other than this recv's (`a.count`): both sizes for
// the host (err_host + 384, status.rs), then the fatal report that poisons the group. Out
// of line: it runs once per failure (NOTE [Code size]).
__device__ __noinline__ void report_size(const Args& a, u64 got, u32 src) {
    volatile u64* h = reinterpret_cast<volatile u64*>(a.err_host);
    h[48] = got;
    h[49] = a.count;
    __threadfence_system();
    fail(a, ERR_P2P_SIZE, src);
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

extern "C" __global__ void __launch_bounds__(THREADS) rs_send(const __grid_constant__ P2pArgs x) {
    const Args& a = x.a;
    __shared__ u32 seq, ok;
    const u32 r = a.root, me = a.rank, b = blockIdx.x, t = threadIdx.x;
    const u64 n = a.count, C = p2p_step_bytes(n, x.chunk, gridDim.x), per_step = C * gridDim.x;
    const u64 steps = steps_for(n, per_step);
    if (t == 0) {
        seq = *p2p_word(a.peer[me], P2P_SEND, b, r);
        // NOTE [Kernel entry]: nothing runs in a failed group (a replay after a failure).
        ok = !failed_at_entry(a, own_poison(a));
    }
    __syncthreads();
    if (!ok) return;
    if (t < 32) {
        // Step s may start once the receiver emptied its slot (ack >= q - P2P_DEPTH).
        auto open = [&](u64 st) {
            const u32 q = seq + (u32)st + 1;
            if (t == 0 && !wait_geq(a, p2p_word(a.peer[me], P2P_ACK, b, r), q - P2P_DEPTH, r)) ok = 0;
            __syncwarp();
            bar_arrive(BAR_FREE);
        };
        open(0);
        if (!ok) return;  // fatal: counters are not saved
        for (u64 st = 0; st < steps; st++) {
            const u32 q = seq + (u32)st + 1;
            bar_sync(BAR_DONE);
            const bool more = st + 1 < steps;
            if (more) open(st + 1);
            if (t == 0) {
                *p2p_size(a.peer[r], b, me, p2p_depth_slot(q)) = n;
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
        const u64 lo = st * per_step + b * C;
        const u64 hi = min64(lo + C, n);
        u8* dst = p2p_slot(x, r, me, p2p_depth_slot(seq + (u32)st + 1));
        if (lo < hi) {
            for_packs_by<u8>(
                lo, hi, tid, nt, [&](Pack<u8>& p, u64 i) { load_pack(p, in, i, hi); },
                [&](const Pack<u8>& p, u64 i) { store_stage(p, dst, i - lo); });
        }
        bar_arrive(BAR_DONE);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) rs_recv(const __grid_constant__ P2pArgs x) {
    const Args& a = x.a;
    __shared__ u32 seq, ok;
    const u32 src = a.root, me = a.rank, b = blockIdx.x, t = threadIdx.x;
    const u64 n = a.count, C = p2p_step_bytes(n, x.chunk, gridDim.x), per_step = C * gridDim.x;
    const u64 steps = steps_for(n, per_step);
    if (t == 0) {
        seq = *p2p_word(a.peer[me], P2P_RECV, b, src);
        // NOTE [Kernel entry]: nothing runs in a failed group (a replay after a failure).
        ok = !failed_at_entry(a, own_poison(a));
    }
    __syncthreads();
    if (!ok) return;
    if (t < 32) {
        // Step s may be copied once the sender signalled it, with this rank's size.
        auto arrived = [&](u64 st) {
            const u32 q = seq + (u32)st + 1;
            if (t == 0) {
                if (!wait_geq(a, p2p_word(a.peer[me], P2P_READY, b, src), q, src)) {
                    ok = 0;
                } else {
                    const u64 got = *p2p_size(a.peer[me], b, src, p2p_depth_slot(q));
                    if (got != n) {
                        report_size(a, got, src);
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
        const u64 lo = st * per_step + b * C;
        const u64 hi = min64(lo + C, n);
        const u8* slot = p2p_slot(x, me, src, p2p_depth_slot(seq + (u32)st + 1));
        if (lo < hi) {
            for_packs_by<u8>(
                lo, hi, tid, nt, [&](Pack<u8>& p, u64 i) { load_stage(p, slot, i - lo); },
                [&](const Pack<u8>& p, u64 i) { store_pack(p, out, i, hi); });
        }
        bar_arrive(BAR_DONE);
    }
}

// NOTE [Copy-engine send/recv]
// A message of at least cuda_copy_engine_min_bytes (decide::copy_engine; both sides
//   choose from their own size and the same setting) moves with cuMemcpyDtoDAsync, no SM
//   touching its bytes (rust/core/src/cuda/engine/copy_p2p.rs queues it). The pair's
//   region of the receiver's inbox (p2p_slot's, for every block and slot: D G chunk
//   bytes for a grid of G blocks, D = P2P_DEPTH) is used as two halves of H = D G chunk / 2
//   bytes; step j of m = ceil(n / H) moves bytes [j H, min(n, (j + 1) H)) through half
//   j & 1 (the host queues the copies, and knows j but not the counters). Step j's
//   sequence number is q_j = base + j + 1, where base is block 0's SEND (sender) or RECV
//   (receiver) counter, read from memory by each signal kernel, so that a CUDA graph
//   replays like the kernels.
//   Signals: rs_p2p_signal with one block, on block 0's words of NOTE [Point to point]
//   (READY, ACK, the size slots), with st.release.sys / ld.acquire.sys and bounded waits.
//   Both sides queue on their (peer, direction) stream:
//     sender:   DRAIN: for every block b, wait ACK[b] >= SEND[b] (every earlier message,
//               the kernels' eager steps included, was read out, so the inbox is free);
//               then for j = 0 .. m-1: push step j into half j & 1 (a copy);
//               READY(j): store n into size[0][sender][q_j % D] (the slot a kernel
//               receiver's block 0 reads for step q_j), release READY[0] = q_j,
//               then wait ACK[0] >= q_j - 1 (the receiver copied step j - 1 out, so the
//               next push, into that half, may start); the last READY waits ACK[0] >= q_{m-1}
//               instead and advances SEND[0] by m.
//     receiver: for j = 0 .. m-1: ARRIVED(j): release ACK[0] = q_{j-1} (j > 0: the
//               copy-out of step j - 1 ended before this kernel began, stream order), wait
//               READY[0] >= q_j, check the size against its own n; then the copy-out of
//               step j (half j & 1 into the tensor); FINISH: release ACK[0] = q_{m-1}
//               and advance RECV[0] by m.
//   Rendezvous: the last READY waits for the receiver's last ack, so a copy-engine send
//   completes only once its receiver has copied the whole message out, unlike the kernels,
//   whose first D steps are eager. (A send whose receiver comes later waits for it on
//   the GPU, bounded by the timeout: two ranks that each make a blocking send to the other
//   before their recvs time out, as with a kernel send over the eager capacity: docs/cuda.md's
//   deadlock rule.)
//   Ordering: a signal kernel starts after the copy queued before it on its stream has
//   completed; its st.release.sys then orders that copy's writes (the push) or reads (the
//   copy-out) before anything the peer queues after the kernel whose ld.acquire.sys read
//   the value (the same argument as NOTE [Copy engines]'s barriers). So step j's bytes are
//   in the half before the receiver's copy-out of it starts, and the copy-out of step j - 1
//   ended before the push of step j + 1 into the same half starts (the halves alternate
//   with j within a message). The size slot of step j is written again (step j + D) only
//   after the ack of step j + D - 2 >= j, which the receiver releases after it read the
//   size of step j.
//   Mixing with the kernels: the kernels keep a counter per block; this path moves block
//   0's only, by its m steps, on both sides alike, so block 0's READY/ACK/SEND/RECV stay
//   in step for the next kernel message and blocks 1.. are untouched. DRAIN makes the
//   whole region free before the first push (the kernels' blocks use all of it), and the
//   rendezvous leaves it free for the next kernel message (its block 0 sees ACK >= SEND).
//   Sizes that differ: the receiver reports ERR_P2P_SIZE (both sizes for the host, as
//   rs_recv) at its first step, on whichever paths the two sides took: a kernel receiver's
//   block 0 reads the size this path wrote, and this path reads the size a kernel sender's
//   block 0 wrote; the failure poisons the group, so every other wait stops. Nothing of a
//   mismatched message is acknowledged; a receiver on this path may find inbox bytes in
//   its tensor (its copy-outs are queued and cannot be skipped), but its recv raises.
//   Failures: every wait is wait_geq (NOTE [Bounded waits]); a kernel that finds its group
//   failed at entry writes nothing (NOTE [Kernel entry]); a failed kernel leaves the
//   counters unsaved, the group is over. The copies stay within the pair's region and the
//   caller's tensor, and always finish on their own, so nothing stays blocked on the GPU.
extern "C" __global__ void __launch_bounds__(THREADS) rs_p2p_signal(const __grid_constant__ P2pArgs x) {
    const Args& a = x.a;
    __shared__ u32 ok;
    const u32 peer = a.root, me = a.rank, t = threadIdx.x;
    const u32 mode = (u32)(a.desc0 & 0xff), grid = (u32)(a.desc0 >> P2P_CE_BLOCKS_SHIFT) & 0xff;
    const u32 j = (u32)a.desc1, m = (u32)(a.desc1 >> 32);
    const u64 n = a.count;
    if (t == 0) ok = !failed_at_entry(a, own_poison(a));  // NOTE [Kernel entry]
    __syncthreads();
    if (!ok) return;
    if (mode == P2P_CE_DRAIN) {
        // Thread b waits for block b's earlier sends to be read out (acquire: the receiver's
        // reads happened before its ack). A failed wait reported itself (fail).
        if (t < grid) (void)wait_geq(a, p2p_word(a.peer[me], P2P_ACK, t, peer), *p2p_word(a.peer[me], P2P_SEND, t, peer), peer);
        return;
    }
    if (t != 0) return;
    if (mode == P2P_CE_READY) {
        u32* send = p2p_word(a.peer[me], P2P_SEND, 0, peer);
        const u32 q = *send + j + 1;
        *p2p_size(a.peer[peer], 0, me, p2p_depth_slot(q)) = n;
        // Publishes the push of step j (it completed before this kernel began) and the size.
        st_release_sys(p2p_word(a.peer[peer], P2P_READY, 0, me), q);
        const bool last = j + 1 == m;
        if (!wait_geq(a, p2p_word(a.peer[me], P2P_ACK, 0, peer), last ? q : q - 1, peer)) return;
        if (last) *send = q;
    } else if (mode == P2P_CE_ARRIVED) {
        const u32 q = *p2p_word(a.peer[me], P2P_RECV, 0, peer) + j + 1;
        // The copy-out of step j - 1 completed before this kernel began: its half is free.
        if (j > 0) st_release_sys(p2p_word(a.peer[peer], P2P_ACK, 0, me), q - 1);
        if (!wait_geq(a, p2p_word(a.peer[me], P2P_READY, 0, peer), q, peer)) return;
        const u64 got = *p2p_size(a.peer[me], 0, peer, p2p_depth_slot(q));
        if (got != n) report_size(a, got, peer);
    } else if (mode == P2P_CE_FINISH) {
        u32* recv = p2p_word(a.peer[me], P2P_RECV, 0, peer);
        const u32 q = *recv + m;
        // The last copy-out completed before this kernel began.
        st_release_sys(p2p_word(a.peer[peer], P2P_ACK, 0, me), q);
        *recv = q;
    }
}
