// all_to_all (rs_all_to_all).

#include "common.cuh"

// NOTE [all_to_all]
// all_to_all (rs_all_to_all): before its first signal every rank writes its send and
//   receive sizes into its own table (half = first barrier's epoch parity); after that
//   barrier every rank reads every rank's table, so all ranks check all pairs alike (a
//   pair that disagrees stops every rank, with the same report, counters in step) and
//   agree on the largest chunk, which sets the step size. A rank rewrites a table half
//   only at a first barrier two epochs later, after every peer passed the barrier after
//   its reads.
// One barrier for small calls: before the table barrier, a rank whose every chunk (to any
//   rank) is at most `one` = G * m0 bytes (m0 = per_block(world - 1 slots,
//   A2A_ONE_BARRIER_BYTES): a layout every rank computes alike, from the group alone)
//   pushes its chunks for the peers as step 0 of that layout (parity s.step & 1). After
//   the barrier every rank knows the largest chunk of the call: at most `one` means that
//   every rank pushed (each rank's chunks are at most the largest), so each rank copies
//   the slots out and ends, with one barrier; above it, the call runs the steps below,
//   whose step 0 rewrites those slots with its own layout.
//   Why the slots hold the pushes when read: rank i's pushes of block b are ordered before
//   its table-barrier signal to block b (the barrier's bar.sync, then the cumulative
//   st.release.sys), and block b reads them after acquiring that signal. Above `one`,
//   step 0's pushes follow i's table barrier in block b's program order (bar.sync), so
//   they come later in the slots' coherence order and are what the step-0 barrier's
//   reader gets. Where step 0's layout is smaller than m0 (per_block is not monotone in
//   the bytes: a small staging), rank i's push may overlap the slot of another sender k
//   at step 0; k writes it after acquiring i's table-barrier signal, so k's store is the
//   later one there too.
//   Why the slots are free when pushed: a kernel's first push at parity s.step & 1 before
//   its first barrier, as the one-shot all_reduce's: every peer's block b finished its
//   reads of that parity before signalling the barrier that ended the step before its last
//   (its last step used the other parity), and this rank passed that barrier.
//   The rank's own chunk is copied after the table check, so a call whose tables disagree
//   writes no output. A2A_ONE_BARRIER_BYTES: a chunk up to it moves in one step of a
//   group's staging (64 MiB over 64 CUDA blocks and 3 peers: 170 KiB per slot), where the
//   second barrier is most of a small call's time. all_to_all_single under CUDA graphs on
//   4 H100s (docs/performance.md, 2026-11-27), 1 KiB-256 KiB per rank: 12.6-13.8 us at 2
//   GPUs and 17.1-17.6 at 4 with two barriers, 9.9-10.5 and 12.2-13.2 with one.
#define A2A_ONE_BARRIER_BYTES (256u << 10)

// all_to_all (bytes; NOTE [all_to_all]). Rank me's chunk for peer j is
// send_n[j] bytes at send[j]; the chunk from peer i lands at recv[i] (recv_n[i] bytes).
// Addresses are absolute, so the list form needs no flattening. Steps as in all_gather:
// block b moves bytes [s * G * m + b * m, + m) of every chunk at step s, through its slot
// of the receiver's staging (world - 1 slots of m bytes), and copies the slots it received
// at step s - 1 while step s's pushes travel:
//   barrier(tables) | push(0) barrier | copy(0) push(1) barrier | ... | copy(last)
// Reuse: as in all_gather (a slot of parity p is rewritten at step s + 2, after a barrier
// that needs the receiver's signal given after its copy of step s); the first push of a
// kernel is step 0's, before or after the table barrier (NOTE [all_to_all]: one barrier
// for small calls). A call whose every chunk is small ends after the table barrier:
//   push(0) barrier(tables) | copy(0)
__device__ __forceinline__ u64* a2a_table(u64 block_base, u32 epoch, u32 cuda_block) {
    return reinterpret_cast<u64*>(block_base + A2A_OFF) + ((epoch & 1) * MAX_BLOCKS + cuda_block) * 2 * MAX_RANKS;
}

// Which chunks a2a_push moves: every one, the peers' only, or the rank's own only.
enum A2aPush : u32 { A2A_ALL, A2A_PEERS, A2A_SELF };

__device__ __forceinline__ void a2a_push(const A2aArgs& x, u64 st, u64 per_step, u64 m, u32 par, u32 tid, u32 nt, A2aPush which = A2A_ALL) {
    const Args& a = x.a;
    const u32 W = a.world, me = a.rank;
    for (u32 j0 = which == A2A_PEERS ? 1 : 0; j0 < (which == A2A_SELF ? 1u : W); j0++) {
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

extern "C" __global__ void __launch_bounds__(THREADS) rs_all_to_all(const __grid_constant__ A2aArgs x) {
    const Args& a = x.a;
    __shared__ BlockState s;
    __shared__ unsigned long long s_max;
    __shared__ u32 s_bad;
    if (!load_state(a, &s)) return;
    const u32 W = a.world, me = a.rank, t = threadIdx.x;
    // The table barrier's epoch. Kept here: barrier() moves s.epoch from thread 0 after its
    // last bar.sync, so the other threads may not read it right after the barrier.
    const u32 e1 = s.epoch + 1;
    if (t < W) {
        u64* mine = a2a_table(a.peer[me], e1, blockIdx.x);
        mine[t] = x.send_n[t];
        mine[MAX_RANKS + t] = x.recv_n[t];
    }
    if (t == 0) {
        s_max = 0;
        s_bad = 0xffffffffu;
    }
    // One barrier for small calls (NOTE [all_to_all]): step 0 of the layout m0, pushed now
    // if every chunk of this rank fits it.
    const u64 m0 = per_block<u8>(a, W > 1 ? W - 1 : 1, A2A_ONE_BARRIER_BYTES);
    const u64 one = m0 * gridDim.x;
    const u32 par0 = s.step & 1;
    u64 own_max = 0;
    for (u32 j = 0; j < W; j++) own_max = x.send_n[j] > own_max ? x.send_n[j] : own_max;
    if (own_max <= one) a2a_push(x, 0, one, m0, par0, t, blockDim.x, A2A_PEERS);
    // The barrier's first __syncthreads orders the table stores and those pushes before
    // the signal.
    if (!barrier(a, &s)) {
        save_state(a, &s, 1);
        return;
    }
    // Every rank checks every pair (i sends to j what j expects from i) and finds the
    // largest chunk; the lowest bad pair is reported, so every rank reports the same one.
    for (u32 k = t; k < W * W; k += blockDim.x) {
        const u32 i = k / W, j = k % W;
        const u64 sent = a2a_table(a.peer[i], e1, blockIdx.x)[j];
        const u64 expected = a2a_table(a.peer[j], e1, blockIdx.x)[MAX_RANKS + i];
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
            h[6] = a2a_table(a.peer[i], e1, blockIdx.x)[j];
            h[7] = a2a_table(a.peer[j], e1, blockIdx.x)[MAX_RANKS + i];
            __threadfence_system();
            st_volatile_host(a.err_host, (ERR_A2A << 16) | i);
            __threadfence_system();
            hold_for_host(a);  // as report_mismatch: the stream waits for the host's verdict
        }
        save_state(a, &s, 1);
        return;
    }
    const u64 biggest = s_max;
    u64 total = 0;
    for (u32 j = 0; j < W; j++) total += x.send_n[j];
    if (biggest <= one) {  // every rank pushed its chunks above: copy them out, done
        note_call(a, total, 2);
        a2a_push(x, 0, one, m0, par0, t, blockDim.x, A2A_SELF);
        a2a_copy(x, 0, one, m0, par0, t, blockDim.x);
        save_state(a, &s, 1);
        return;
    }
    const u64 m = per_block<u8>(a, W > 1 ? W - 1 : 1, biggest);
    const u64 per_step = m * gridDim.x;
    const u64 steps = steps_for(biggest, per_step);
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
