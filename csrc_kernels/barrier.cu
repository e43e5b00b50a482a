// rs_barrier: a device-side barrier of the group's local ranks.

#include "common.cuh"

// A device-side barrier of every local rank (all CUDA blocks, one epoch each). `a.count`:
// bytes of a collective this barrier ends, counted once it passed (memory_stats; the last
// barrier of a copy-engine collective, NOTE [Copy engines]); 0 for every other barrier.
extern "C" __global__ void __launch_bounds__(THREADS) rs_barrier(const __grid_constant__ Args a) {
    __shared__ BlockState s;
    if (!load_state(a, &s)) return;
    const u64 steps = 0;
    BARRIER_OR_RETURN(a, s, steps)
    note_call(a, a.count, 2);
    save_state(a, &s, steps);
}
