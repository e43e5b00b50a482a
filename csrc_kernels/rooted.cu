// The collectives with a root: broadcast, gather, scatter, reduce (rs_broadcast, rs_gather,
// rs_scatter, rs_reduce_root_*).

#include "common.cuh"

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

extern "C" __global__ void __launch_bounds__(THREADS) rs_broadcast(const __grid_constant__ Args a) {
    __shared__ BlockState s;
    if (!load_state(a, &s)) return;
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
extern "C" __global__ void __launch_bounds__(THREADS) rs_gather(const __grid_constant__ Args a) {
    __shared__ BlockState s;
    if (!load_state(a, &s)) return;
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
extern "C" __global__ void __launch_bounds__(THREADS) rs_scatter(const __grid_constant__ Args a) {
    __shared__ BlockState s;
    if (!load_state(a, &s)) return;
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
template <typename T>
__device__ void reduce_root(const Args& a, u32 op) {
    __shared__ BlockState s;
    if (!load_state(a, &s)) return;
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
            reduce_packs<T>(
            lo, hi, W, op, staged_sources<T>(in, mine, R, m, lo, hi),
                [&](const Pack<T>& p, u64 i) { store_pack(p, out, i, hi); });
        }
    }
    save_state(a, &s, steps);
    note_call(a, n * sizeof(T), 2);
}

RS_TYPES(reduce_root)
