// The reduce kernel of scripts/ce_ring.py (read and compiled by it with NVRTC at run time):
// a ring reduce_scatter whose data the copy engines move and whose sums a few CTAs make.
// The schedule, the flags and why they are safe: the script's docstring.
typedef unsigned long long u64;
typedef unsigned int u32;
#define UNROLL 4

// Flag words (u32) of a rank's flag page, in its symmetric buffer (ce_ring.py: F_*). Every
// word belongs to one slot or chunk, so that the copies of different slots can run on
// different copy-engine streams (a slot, a chunk always on the same one: its words rise).
#define F_FAIL 0         // set by this kernel when a wait ran out of time
#define F_READY 64       // [D] per sendbuf slot: my CTAs that filled it, summed over its uses
#define F_ACK 128        // [D] per staging slot of next's: next's CTAs done reading it (next adds)
#define F_ARRIVAL 192    // [D] per staging slot: prev's copies into it (its uses delivered)
#define F_SENT 256       // [D] per sendbuf slot: my copies out of it (slot m mod D, m // D + 1)
#define F_OUT 1024       // [K] per output chunk: my CTAs that wrote it, summed over rounds
#define F_AG 8192        // [K] per output chunk: prev's all_gather copies of it into my output

__device__ __forceinline__ u32 ld_acq(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// Spin until *p >= e (signed 32-bit difference); false after about 2 s of clock (a deadlock
// or a peer gone: the caller records it in F_FAIL and stops).
__device__ __forceinline__ bool spin_geq(const u32* p, u32 e) {
    const long long t0 = clock64();
    while ((int)(ld_acq(p) - e) < 0) {
        if (clock64() - t0 > 4000000000LL) return false;
    }
    return true;
}
__device__ __forceinline__ u32 bf2(u32 a, u32 b) {  // two bf16 sums, rounded to nearest even
    float a0 = __uint_as_float(a << 16), a1 = __uint_as_float(a & 0xffff0000u);
    float b0 = __uint_as_float(b << 16), b1 = __uint_as_float(b & 0xffff0000u);
    u32 x = __float_as_uint(a0 + b0), y = __float_as_uint(a1 + b1);
    x += 0x7fffu + ((x >> 16) & 1);
    y += 0x7fffu + ((y >> 16) & 1);
    return (x >> 16) | (y & 0xffff0000u);
}
__device__ __forceinline__ uint4 add8(uint4 a, uint4 b) {
    return make_uint4(bf2(a.x, b.x), bf2(a.y, b.y), bf2(a.z, b.z), bf2(a.w, b.w));
}

// The send order of a rank's RS messages (the same on every rank): groups of G chunks; for
// each group, steps s = 0 .. W - 2, and the group's chunks j within a step. Message m is
// (chunk k = g * G + j, step s).
__device__ __forceinline__ void decode(u64 m, u32 W, u32 G, u64* k, u32* s) {
    const u64 per = (u64)(W - 1) * G, g = m / per, r = m - g * per;
    *s = (u32)(r / G);
    *k = g * G + r % G;
}
__device__ __forceinline__ u64 index_of(u64 k, u32 s, u32 W, u32 G) { return (k / G) * (W - 1) * G + (u64)s * G + k % G; }

// One round of the ring reduce_scatter's sums on this rank. Rank me receives prev's
// messages in prev's send order (base .. base + M - 1 over all rounds); message (k, s')
// carries prev's partial sum of segment seg = (me - s' - 2) mod W, chunk k. This rank adds
// its input's chunk and, if s' + 1 < W - 1, writes the sum into sendbuf slot (its own
// message (k, s' + 1)) % D for its copy engine to send on; else (its own segment) into the
// output. CTA b sums its slice of each chunk (n16 16-byte words per chunk).
extern "C" __global__ void ce_reduce(const uint4* in, uint4* out, const uint4* staging, uint4* sendbuf, u32* flags, u32* prev_flags,
                                     u64 seg16, u64 n16, u32 W, u32 me, u32 D, u32 G, u64 K, u64 base) {
    const u64 M = K * (W - 1);
    const u32 B = gridDim.x;
    const u64 per = (n16 + B - 1) / B, lo = blockIdx.x * per, hi = lo + per < n16 ? lo + per : n16;
    __shared__ int ok;
    for (u64 m = 0; m < M; m++) {
        const u64 gm = base + m;
        u64 k;
        u32 sp;
        decode(m, W, G, &k, &sp);
        const u32 s = sp + 1;  // this rank's step for the sum
        const bool last = s == W - 1;
        const u32 seg = (me + 2 * W - s - 1) % W;
        const u64 gms = last ? 0 : base + index_of(k, s, W, G);
        if (threadIdx.x == 0) {
            // The message is in my staging: prev's copy engine wrote F_ARRIVAL[slot] =
            // gm / D + 1 after the copy, with the memory barrier of cuStreamWriteValue32
            // (release); the acquire load here orders this CTA's reads after it (bar.sync).
            bool good = spin_geq(flags + F_ARRIVAL + gm % D, (u32)(gm / D + 1));
            // The sendbuf slot is free: my copy engine wrote F_SENT[slot] = n / D + 1 after
            // copying out message n, so gms / D means its last use (gms - D) is gone.
            if (good && !last && gms >= D) good = spin_geq(flags + F_SENT + gms % D, (u32)(gms / D));
            if (!good) atomicExch(flags + F_FAIL, 1u);
            ok = good;
        }
        __syncthreads();
        if (!ok) return;
        const uint4* a = staging + (gm % D) * n16;
        const uint4* x = in + seg * seg16 + k * n16;
        uint4* d = last ? out + seg * seg16 + k * n16 : sendbuf + (gms % D) * n16;
        // UNROLL loads of both operands in flight per thread (one at a time left this
        // kernel at ~12 GB/s per CTA, latency-bound, 2026-11-28).
        const u64 T = blockDim.x;
        u64 i = lo + threadIdx.x;
        for (; i + (UNROLL - 1) * T < hi; i += UNROLL * T) {
            uint4 va[UNROLL], vx[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                va[u] = a[i + u * T];
                vx[u] = x[i + u * T];
            }
#pragma unroll
            for (int u = 0; u < UNROLL; u++) d[i + u * T] = add8(va[u], vx[u]);
        }
        for (; i < hi; i += T) d[i] = add8(a[i], x[i]);
        __syncthreads();
        if (threadIdx.x == 0) {
            // Every thread's reads of the slot and writes of d are ordered before these
            // counts (bar.sync, then a system-scope fence, cumulative): prev's copy engine
            // waits for all B CTAs' counts of this use of the slot before overwriting it,
            // and mine for all B counts of the sendbuf slot (or output chunk) before
            // reading it. A CTA cannot count a later use early: its next use of a sendbuf
            // slot waits for F_SENT[slot], which needs this use's full count first; its count
            // for the same output chunk a round later (message gm + M) needs prev's
            // message gm + M in my staging, which prev sends only after all my CTAs
            // counted F_ACK for gm + M - D >= gm (the host asserts M > D).
            __threadfence_system();
            atomicAdd(prev_flags + F_ACK + gm % D, 1u);
            atomicAdd(flags + (last ? F_OUT + k : F_READY + gms % D), 1u);
        }
    }
}
