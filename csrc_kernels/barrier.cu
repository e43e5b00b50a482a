// rs_barrier: a device-side barrier of the group's local ranks.

#include "common.cuh"

// A device-side barrier of every local rank (all CUDA blocks, one epoch each).
extern "C" __global__ void __launch_bounds__(THREADS) rs_barrier(const __grid_constant__ Args a) {
    __shared__ BlockState s;
    if (!load_state(a, &s)) return;
    const u64 steps = 0;
    BARRIER_OR_RETURN(a, s, steps)
    save_state(a, &s, steps);
}
