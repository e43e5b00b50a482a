// send / recv (rs_send, rs_recv): not collectives of the group, NOTE [Point to point].

#include "common.cuh"

// NOTE [Point to point]
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

extern "C" __global__ void __launch_bounds__(THREADS) rs_send(const __grid_constant__ P2pArgs x) {
    const Args& a = x.a;
    __shared__ u32 seq, ok;
    const u32 r = a.root, me = a.rank, b = blockIdx.x, t = threadIdx.x;
    const u64 n = a.count, C = x.chunk, per_step = C * gridDim.x;
    const u64 steps = steps_for(n, per_step);
    if (t == 0) {
        seq = *p2p_word(a.peer[me], P2P_SEND, b, r);
        // NOTE [Kernel entry]: nothing runs in a failed group (a replay after a failure).
        ok = !failed_at_entry(a, own_poison(a));
    }
    __syncthreads();
    if (!ok) return;
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

extern "C" __global__ void __launch_bounds__(THREADS) rs_recv(const __grid_constant__ P2pArgs x) {
    const Args& a = x.a;
    __shared__ u32 seq, ok;
    const u32 src = a.root, me = a.rank, b = blockIdx.x, t = threadIdx.x;
    const u64 n = a.count, C = x.chunk, per_step = C * gridDim.x;
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
