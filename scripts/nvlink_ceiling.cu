// The kernels of scripts/nvlink_ceiling.py (read and compiled by it with NVRTC at run time;
// `nvcc -arch=sm_90 -cubin scripts/nvlink_ceiling.cu` compiles them too). What each kernel
// does and how it is timed: the script's docstring.
typedef unsigned long long u64;
typedef unsigned int u32;
struct Ptrs { u64 p[8]; };
#define U 4
// [lo, hi) of n16 16-byte words for CTA `b` of `g`.
__device__ __forceinline__ void slice(u64 n16, u32 b, u32 g, u64* lo, u64* hi) {
    u64 per = (n16 + g - 1) / g; *lo = b * per; *hi = *lo + per < n16 ? *lo + per : n16;
}
__device__ __forceinline__ void copy16(uint4* d, const uint4* s, u64 lo, u64 hi) {
    const u64 T = blockDim.x;
    u64 i = lo + threadIdx.x;
    for (; i + (U - 1) * T < hi; i += U * T) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) v[u] = s[i + u * T];
#pragma unroll
        for (int u = 0; u < U; u++) d[i + u * T] = v[u];
    }
    for (; i < hi; i += T) d[i] = s[i];
}
// Buffers: rank r's symmetric buffer holds src slots [0, W) (slot j: r's data for rank j)
// then dst slots [W, 2W) (slot W + j: what rank j sent to r); n16 words per slot.
extern "C" __global__ void st_peer(Ptrs b, u64 n16, u32 W, u32 me) {
    u64 lo, hi; slice(n16, blockIdx.x, gridDim.x, &lo, &hi);
    const uint4* mine = (const uint4*)b.p[me];
    for (u32 k = 1; k < W; k++) {
        const u32 j = (me + k) % W;
        copy16((uint4*)b.p[j] + (W + me) * n16, mine + j * n16, lo, hi);
    }
}
extern "C" __global__ void st_inter(Ptrs b, u64 n16, u32 W, u32 me) {
    u64 lo, hi; slice(n16, blockIdx.x, gridDim.x, &lo, &hi);
    const uint4* mine = (const uint4*)b.p[me];
    for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        uint4 v[7];
        for (u32 k = 1; k < W; k++) v[k - 1] = mine[((me + k) % W) * n16 + i];
        for (u32 k = 1; k < W; k++) { const u32 j = (me + k) % W; ((uint4*)b.p[j])[(W + me) * n16 + i] = v[k - 1]; }
    }
}
extern "C" __global__ void st_split(Ptrs b, u64 n16, u32 W, u32 me) {
    const u32 k = 1 + blockIdx.x % (W - 1), per = gridDim.x / (W - 1);
    if (blockIdx.x / (W - 1) >= per) return;
    u64 lo, hi; slice(n16, blockIdx.x / (W - 1), per, &lo, &hi);
    const u32 j = (me + k) % W;
    copy16((uint4*)b.p[j] + (W + me) * n16, (const uint4*)b.p[me] + j * n16, lo, hi);
}
extern "C" __global__ void ld_peer(Ptrs b, u64 n16, u32 W, u32 me) {
    u64 lo, hi; slice(n16, blockIdx.x, gridDim.x, &lo, &hi);
    uint4* mine = (uint4*)b.p[me];
    for (u32 k = 1; k < W; k++) {
        const u32 j = (me + k) % W;
        copy16(mine + (W + j) * n16, (const uint4*)b.p[j] + me * n16, lo, hi);
    }
}
// The ring: all (W - 1) slots' bytes to the next rank only (as a ring algorithm's steps
// move them), into its dst slots.
extern "C" __global__ void st_ring(Ptrs b, u64 n16, u32 W, u32 me) {
    u64 lo, hi; slice((W - 1) * n16, blockIdx.x, gridDim.x, &lo, &hi);
    const u32 j = (me + 1) % W;
    copy16((uint4*)b.p[j] + W * n16, (const uint4*)b.p[me], lo, hi);
}
// Stepped pushes with a barrier, as rsccl's kernels run: each step a CTA moves `piece16`
// words to each peer. PERM: one peer per phase (me + k at phase k, every rank alike, so each
// phase is a permutation: every rank receives from one), a barrier after each phase. Else
// all peers one after another, one barrier per step. Barrier: thread j < W stores the
// block's epoch into rank j's flag [b][me] (st.release.sys, after bar.sync: the block's
// pushes before it) and spins on its own flag [b][j] (ld.acquire.sys) until it reaches the
// epoch; bar.sync again. The epoch per block lives in the flag page past the slots (`fl`
// bytes into the buffer), zeroed before the first launch. A spin gives up after about a
// second (the data is not checked: no hang, only a wrong time).
__device__ __forceinline__ void step_barrier(const Ptrs& b, u64 fl, u32 W, u32 me, u32 e) {
    __syncthreads();
    if (threadIdx.x < W) {
        u32* theirs = (u32*)(b.p[threadIdx.x] + fl) + blockIdx.x * 8 + me;
        asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(theirs), "r"(e) : "memory");
        const u32* mine = (const u32*)(b.p[me] + fl) + blockIdx.x * 8 + threadIdx.x;
        const long long t0 = clock64();
        u32 v;
        do {
            asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(mine) : "memory");
        } while ((int)(v - e) < 0 && clock64() - t0 < 2000000000LL);
    }
    __syncthreads();
}
template <bool PERM>
__device__ void stepped(Ptrs b, u64 n16, u32 W, u32 me, u64 piece16, u64 fl) {
    __shared__ u32 epoch;
    u32* ctr = (u32*)(b.p[me] + fl + 8192) + blockIdx.x;
    if (threadIdx.x == 0) epoch = *ctr;
    __syncthreads();
    u32 e = epoch;
    const u64 per_step = piece16 * gridDim.x;
    for (u64 lo0 = 0; lo0 < n16; lo0 += per_step) {
        const u64 lo = lo0 + blockIdx.x * piece16;
        const u64 hi = lo + piece16 < n16 ? lo + piece16 : n16;
        for (u32 k = 1; k < W; k++) {
            const u32 j = (me + k) % W;
            if (lo < hi) copy16((uint4*)b.p[j] + (W + me) * n16, (const uint4*)b.p[me] + j * n16, lo, hi);
            if (PERM) step_barrier(b, fl, W, me, ++e);
        }
        if (!PERM) step_barrier(b, fl, W, me, ++e);
    }
    if (threadIdx.x == 0) *ctr = e;
}
extern "C" __global__ void steps_perm(Ptrs b, u64 n16, u32 W, u32 me, u64 piece16, u64 fl) { stepped<true>(b, n16, W, me, piece16, fl); }
extern "C" __global__ void steps_a2a(Ptrs b, u64 n16, u32 W, u32 me, u64 piece16, u64 fl) { stepped<false>(b, n16, W, me, piece16, fl); }
#define CH 8192
#define NB 4
__device__ __forceinline__ u32 sa(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// One thread: bulk-copy [lo, hi) bytes of each piece src -> dst (pieces one after another).
__device__ void tma_run(const char* const* srcs, char* const* dsts, u32 pieces, u64 lo, u64 hi) {
    __shared__ alignas(128) char buf[NB][CH];
    __shared__ alignas(8) u64 bar[NB];
    if (threadIdx.x != 0) return;
    for (u32 k = 0; k < NB; k++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&bar[k])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const u64 per = (hi - lo + CH - 1) / CH;
    const u64 C = per * pieces;
    auto load = [&](u64 c) {
        const u32 k = c % NB; const u64 off = lo + (c % per) * CH; const u32 n = (u32)(hi - off < CH ? hi - off : CH);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&bar[k])), "r"(n) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sa(buf[k])),
                     "l"(__cvta_generic_to_global(srcs[c / per] + off)), "r"(n), "r"(sa(&bar[k])) : "memory");
    };
    for (u64 c = 0; c < C && c < NB; c++) load(c);
    for (u64 c = 0; c < C; c++) {
        const u32 k = c % NB; const u32 ph = (c / NB) & 1;
        u32 done = 0;
        while (!done) asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(sa(&bar[k])), "r"(ph) : "memory");
        const u64 off = lo + (c % per) * CH; const u32 n = (u32)(hi - off < CH ? hi - off : CH);
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(__cvta_generic_to_global(dsts[c / per] + off)), "r"(sa(buf[k])), "r"(n) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (c >= 1 && c - 1 + NB < C) {
            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            load(c - 1 + NB);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
extern "C" __global__ void tma_peer(Ptrs b, u64 n16, u32 W, u32 me) {
    u64 lo, hi; slice(n16, blockIdx.x, gridDim.x, &lo, &hi);
    const char* s[8]; char* d[8];
    for (u32 k = 1; k < W; k++) {
        const u32 j = (me + k) % W;
        s[k - 1] = (const char*)b.p[me] + j * n16 * 16; d[k - 1] = (char*)b.p[j] + (W + me) * n16 * 16;
    }
    if (lo < hi) tma_run(s, d, W - 1, lo * 16, hi * 16);
}
extern "C" __global__ void tma_ring(Ptrs b, u64 n16, u32 W, u32 me) {
    u64 lo, hi; slice((W - 1) * n16, blockIdx.x, gridDim.x, &lo, &hi);
    const char* s[1] = {(const char*)b.p[me]}; char* d[1] = {(char*)b.p[(me + 1) % W] + W * n16 * 16};
    if (lo < hi) tma_run(s, d, 1, lo * 16, hi * 16);
}
extern "C" __global__ void tma_split(Ptrs b, u64 n16, u32 W, u32 me) {
    const u32 k = 1 + blockIdx.x % (W - 1), per = gridDim.x / (W - 1);
    if (blockIdx.x / (W - 1) >= per) return;
    u64 lo, hi; slice(n16, blockIdx.x / (W - 1), per, &lo, &hi);
    const u32 j = (me + k) % W;
    const char* s[1] = {(const char*)b.p[me] + j * n16 * 16}; char* d[1] = {(char*)b.p[j] + (W + me) * n16 * 16};
    if (lo < hi) tma_run(s, d, 1, lo * 16, hi * 16);
}
// A ring reduce-scatter with readiness flags, as rsccl's ring runs (NOTE [Ring] in
// csrc_kernels/ring.cuh), to find what its handshake costs against st-ring's bare stores.
// Each CTA holds `lanes` independent pipelines ("lanes", blockDim / lanes threads each):
// lane id = b * lanes + l takes its own columns of every block, in chunks of chunk16 words,
// in groups of G chunks (s-major within a group, as NOTE [Ring]; rsccl: 2), with `depth` slots of a
// chunk at next and two words: ready[id] (written by prev) and ack[id] (written by next).
// Message numbers run on across launches (ctr[id]), so launches need no barrier between
// them: message q goes to slot q % depth, its ready value is q + 1, and sending q waits
// for ack >= q + 1 - depth (the receiver consumed q - depth, the slot's last message).
// WS = 0: the lane's thread 0 waits for an op, a lane barrier, every thread moves data, a
// lane barrier, thread 0 releases (st.release.sys, cumulative over the barrier).
// WS = 1: rsccl's shape: the lane's first warp waits for op i + 1 while the others move op
// i's data (named barriers FREE / DONE), then releases op i.
// reduce = 1: a reduce_scatter's steps (input block + received slot, bf16 add in float);
// 0: the same steps, copies only. Data are not checked; waits give up after about a second.
__device__ __forceinline__ u32 ld_acq(const u32* p) { u32 v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void st_rel(u32* p, u32 v) { asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ void st_rlx(u32* p, u32 v) { asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory"); }
// fence 1: each op's signals are releases (the protocol); 0: relaxed stores, no ordering (a
// wrong protocol, to time what the releases cost); 2: releases after every second op only
// (and the last), a signal then covering two messages (group >= 3).
__device__ __forceinline__ void signal(u32 fence, u64 i, u64 ops, u32* p, u32 v) {
    if (fence == 0) st_rlx(p, v);
    else if (fence == 1 || (i & 1) || i + 1 == ops) st_rel(p, v);
}
__device__ __forceinline__ void spin_geq(const u32* p, u32 e) {
    const long long t0 = clock64();
    while ((int)(ld_acq(p) - e) < 0 && clock64() - t0 < 2000000000LL) {}
}
__device__ __forceinline__ u32 bf2(u32 a, u32 b) {  // two bf16 sums, rounded to nearest even
    float a0 = __uint_as_float(a << 16), a1 = __uint_as_float(a & 0xffff0000u);
    float b0 = __uint_as_float(b << 16), b1 = __uint_as_float(b & 0xffff0000u);
    u32 x = __float_as_uint(a0 + b0), y = __float_as_uint(a1 + b1);
    x += 0x7fffu + ((x >> 16) & 1); y += 0x7fffu + ((y >> 16) & 1);
    return (x >> 16) | (y & 0xffff0000u);
}
__device__ __forceinline__ uint4 add8(uint4 a, uint4 b) { return make_uint4(bf2(a.x, b.x), bf2(a.y, b.y), bf2(a.z, b.z), bf2(a.w, b.w)); }
struct ROp { u64 lo, hi; u32 blk; bool recv, send; u32 m, c; };
__device__ __forceinline__ ROp rop(u64 i, u32 S, u32 W, u32 me, u64 lo0, u64 hi0, u64 C, u32 G) {
    const u64 grp = (u64)(S + 1) * G, g = i / grp, r = i - g * grp;
    const u32 s = (u32)(r / G), j = (u32)(r % G);
    const u64 k = g * G + j;
    ROp o;
    o.blk = (me + 2 * W - 1 - s) % W;
    o.hi = lo0 + (k + 1) * C < hi0 ? lo0 + (k + 1) * C : hi0;
    o.lo = lo0 + k * C < o.hi ? lo0 + k * C : o.hi;
    o.recv = s >= 1; o.send = s < S;
    o.m = (u32)(g * S * G + s * G + j);
    o.c = (u32)(g * S * G + (s - 1) * G + j);
    return o;
}
__device__ __forceinline__ void rmove(const ROp& o, const uint4* in, u64 n16, const uint4* sin, uint4* sout, uint4* out, bool red, u32 t, u32 nt) {
    for (u64 i = o.lo + t; i < o.hi; i += (u64)nt * U) {
        uint4 x[U], y[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const u64 w = i + u * nt;
            if (w < o.hi) {
                if (red || !o.recv) x[u] = in[o.blk * n16 + w];
                if (o.recv) y[u] = sin[w - o.lo];
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const u64 w = i + u * nt;
            if (w >= o.hi) continue;
            const uint4 z = o.recv ? (red ? add8(x[u], y[u]) : y[u]) : x[u];
            if (o.send) sout[w - o.lo] = z; else out[w] = z;
        }
    }
}
// What every ring-* pipeline `id` of `ids` works with: its neighbours, its words (ready and
// ack in this rank, written by prev and next; ctr, its message count across launches), its
// slots here and at next, the input, the output block, its columns and its chunk count.
struct RingCtx {
    u32 next, prev, S;
    u32 *ready, *ack, *ctr, *ready_next, *ack_prev;
    const uint4* mine;
    uint4* theirs;
    const uint4* in;
    uint4* out;
    u64 lo0, hi0, K;
};
__device__ __forceinline__ RingCtx ring_ctx(const Ptrs& b, u64 n16, u32 W, u32 me, u64 C, u64 fl, u32 depth, u32 G, u32 id, u32 ids) {
    RingCtx c;
    c.next = (me + 1) % W; c.prev = (me + W - 1) % W; c.S = W - 1;
    c.ready = (u32*)(b.p[me] + fl + 16384) + id;
    c.ack = (u32*)(b.p[me] + fl + 20480) + id;
    c.ctr = (u32*)(b.p[me] + fl + 24576) + id;
    c.ready_next = (u32*)(b.p[c.next] + fl + 16384) + id;
    c.ack_prev = (u32*)(b.p[c.prev] + fl + 20480) + id;
    const u64 stage = (u64)W * n16 * 16 + (u64)id * depth * C * 16;
    c.mine = (const uint4*)(b.p[me] + stage);
    c.theirs = (uint4*)(b.p[c.next] + stage);
    c.in = (const uint4*)b.p[me];
    c.out = (uint4*)b.p[me] + (u64)me * n16;
    slice(n16, id, ids, &c.lo0, &c.hi0);
    const u64 len = c.hi0 - c.lo0;
    c.K = len ? ((len + C - 1) / C + G - 1) / G * G : 0;
    return c;
}
// The signalling warp of a ring-* pipeline (lane 0 of it, `t` = 0, waits and releases):
// op i + 1's waits beside op i's data, FREE (arrive) once op i is DONE (sync), then op i's
// releases; `waits(i)` and `release(i)` act for thread 0 only.
template <typename Waits, typename Release>
__device__ __forceinline__ void signal_warp(u64 ops, u32 FREE, u32 DONE, u32 nl, u32 t, Waits waits, Release release) {
    auto step = [&](u64 i) {
        if (t == 0) waits(i);
        __syncwarp();
    };
    if (ops) {
        step(0);
        asm volatile("bar.arrive %0, %1;" ::"r"(FREE), "r"(nl) : "memory");
    }
    for (u64 i = 0; i < ops; i++) {
        if (i + 1 < ops) step(i + 1);
        asm volatile("bar.sync %0, %1;" ::"r"(DONE), "r"(nl) : "memory");
        if (i + 1 < ops) asm volatile("bar.arrive %0, %1;" ::"r"(FREE), "r"(nl) : "memory");
        if (t == 0) release(i);
        __syncwarp();
    }
}
// WS = 2: every warp is a lane of its own (lanes = blockDim / 32), as WS = 0 with
// __syncwarp for the lane barrier: no CTA-wide barrier at all.
__device__ __forceinline__ void lane_sync(int ws, u32 id, u32 n) {
    if (ws == 2) __syncwarp();
    else asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
template <int WS>
__device__ void ring_rs_body(Ptrs b, u64 n16, u32 W, u32 me, u64 C, u64 fl, u32 lanes, u32 depth, u32 red, u32 G, u32 fence) {
    __shared__ u32 base_s[32];
    if (WS == 2) lanes = blockDim.x / 32;
    const u32 nl = blockDim.x / lanes, l = threadIdx.x / nl, t = threadIdx.x % nl;
    if (l >= lanes) return;
    const u32 id = blockIdx.x * lanes + l, ids = gridDim.x * lanes;
    const RingCtx c = ring_ctx(b, n16, W, me, C, fl, depth, G, id, ids);
    const u64 ops = (u64)(c.S + 1) * c.K;
    if (t == 0) base_s[l] = *c.ctr;
    lane_sync(WS, 1 + 2 * l, nl);
    const u32 base = base_s[l];
    if (WS != 1) {
        for (u64 i = 0; i < ops; i++) {
            const ROp o = rop(i, c.S, W, me, c.lo0, c.hi0, C, G);
            if (t == 0) {
                if (o.recv) spin_geq(c.ready, base + o.c + 1);
                if (o.send) spin_geq(c.ack, base + o.m + 1 - depth);
            }
            lane_sync(WS, 1 + 2 * l, nl);
            rmove(o, c.in, n16, c.mine + ((base + o.c) % depth) * C, c.theirs + ((base + o.m) % depth) * C, c.out, red, t, nl);
            lane_sync(WS, 1 + 2 * l, nl);
            if (t == 0) {
                if (o.send) signal(fence, i, ops, c.ready_next, base + o.m + 1);
                if (o.recv) signal(fence, i, ops, c.ack_prev, base + o.c + 1);
            }
        }
    } else if (t < 32) {
        signal_warp(ops, 1 + 2 * l, 2 + 2 * l, nl, t, [&](u64 i) {
            const ROp o = rop(i, c.S, W, me, c.lo0, c.hi0, C, G);
            if (o.recv) spin_geq(c.ready, base + o.c + 1);
            if (o.send) spin_geq(c.ack, base + o.m + 1 - depth);
        }, [&](u64 i) {
            const ROp o = rop(i, c.S, W, me, c.lo0, c.hi0, C, G);
            if (o.send) signal(fence, i, ops, c.ready_next, base + o.m + 1);
            if (o.recv) signal(fence, i, ops, c.ack_prev, base + o.c + 1);
        });
    } else {
        const u32 FREE = 1 + 2 * l, DONE = 2 + 2 * l;
        for (u64 i = 0; i < ops; i++) {
            asm volatile("bar.sync %0, %1;" ::"r"(FREE), "r"(nl) : "memory");
            const ROp o = rop(i, c.S, W, me, c.lo0, c.hi0, C, G);
            if (red != 2 || o.send)  // --ring-reduce 2: each chunk's last (local) step moves nothing
                rmove(o, c.in, n16, c.mine + ((base + o.c) % depth) * C, c.theirs + ((base + o.m) % depth) * C, c.out, red, t - 32, nl - 32);
            asm volatile("bar.arrive %0, %1;" ::"r"(DONE), "r"(nl) : "memory");
        }
    }
    if (t == 0) *c.ctr = base + (u32)(c.S * c.K);
}
extern "C" __global__ void ring_rs(Ptrs b, u64 n16, u32 W, u32 me, u64 C, u64 fl, u32 lanes, u32 depth, u32 red, u32 G, u32 fence) {
    ring_rs_body<0>(b, n16, W, me, C, fl, lanes, depth, red, G, fence);
}
extern "C" __global__ void ring_wp(Ptrs b, u64 n16, u32 W, u32 me, u64 C, u64 fl, u32 lanes, u32 depth, u32 red, u32 G, u32 fence) {
    ring_rs_body<2>(b, n16, W, me, C, fl, lanes, depth, red, G, fence);
}
extern "C" __global__ void ring_ws(Ptrs b, u64 n16, u32 W, u32 me, u64 C, u64 fl, u32 lanes, u32 depth, u32 red, u32 G, u32 fence) {
    ring_rs_body<1>(b, n16, W, me, C, fl, lanes, depth, red, G, fence);
}
// ring-ws for 1024 threads (at most 64 registers a thread).
extern "C" __global__ void __launch_bounds__(1024, 1) ring_ws1k(Ptrs b, u64 n16, u32 W, u32 me, u64 C, u64 fl, u32 lanes, u32 depth, u32 red, u32 G, u32 fence) {
    ring_rs_body<1>(b, n16, W, me, C, fl, lanes, depth, red, G, fence);
}
// Dynamic shared memory of ring-tmabare and ring-tma (the launch sizes it).
extern __shared__ __align__(128) char dsm[];
// ring-tmabare: st-ring's bytes by bulk copies (one thread per CTA) through `depth` shared-
// memory buffers of `C` words (dynamic shared memory), so that up to depth x C x 16 bytes
// are in flight per CTA (tma-ring: 4 x 8 KiB).
extern "C" __global__ void ring_tmabare(Ptrs b, u64 n16, u32 W, u32 me, u64 C, u64 fl, u32 lanes, u32 depth, u32 red, u32 G, u32 fence) {
    __shared__ alignas(8) u64 mb[32];
    if (threadIdx.x != 0) return;
    u64 lo, hi; slice((W - 1) * n16, blockIdx.x, gridDim.x, &lo, &hi);
    if (lo >= hi) return;
    const char* src = (const char*)b.p[me] + lo * 16;
    char* dst = (char*)b.p[(me + 1) % W] + W * n16 * 16 + lo * 16;
    const u64 bytes = (hi - lo) * 16, CHB = C * 16, NBUF = depth;
    for (u32 k = 0; k < NBUF; k++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&mb[k])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const u64 NC = (bytes + CHB - 1) / CHB;
    auto load = [&](u64 c) {
        const u32 k = c % NBUF; const u64 off = c * CHB; const u32 n = (u32)(bytes - off < CHB ? bytes - off : CHB);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&mb[k])), "r"(n) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sa(dsm + k * CHB)),
                     "l"(__cvta_generic_to_global(src + off)), "r"(n), "r"(sa(&mb[k])) : "memory");
    };
    for (u64 c = 0; c < NC && c < NBUF; c++) load(c);
    for (u64 c = 0; c < NC; c++) {
        const u32 k = c % NBUF; const u32 ph = (c / NBUF) & 1;
        u32 done = 0;
        while (!done) asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(sa(&mb[k])), "r"(ph) : "memory");
        const u64 off = c * CHB; const u32 n = (u32)(bytes - off < CHB ? bytes - off : CHB);
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(__cvta_generic_to_global(dst + off)), "r"(sa(dsm + k * CHB)), "r"(n) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (c >= 1 && c - 1 + NBUF < NC) {
            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            load(c - 1 + NBUF);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
// ring-tma: ring-ws whose sends go by bulk copies: the data warps reduce into one of NT
// shared-memory tiles of RT_TILE bytes and one of them bulk-copies the tile into next's
// slot, so that the SM's own stores are local only; before its DONE it waits until the
// op's bulk copies completed, so warp 0's release still follows them.
#define RT_TILE 32768
template <int NT>
__device__ void ring_tma_body(Ptrs b, u64 n16, u32 W, u32 me, u64 C, u64 fl, u32 depth, u32 red, u32 G) {
    __shared__ u32 base_s;
    const u32 t = threadIdx.x, nl = blockDim.x, id = blockIdx.x, ids = gridDim.x;
    const RingCtx c = ring_ctx(b, n16, W, me, C, fl, depth, G, id, ids);
    const u64 ops = (u64)(c.S + 1) * c.K;
    if (t == 0) base_s = *c.ctr;
    __syncthreads();
    const u32 base = base_s;
    if (t < 32) {
        signal_warp(ops, 1, 2, nl, t, [&](u64 i) {
            const ROp o = rop(i, c.S, W, me, c.lo0, c.hi0, C, G);
            if (o.recv) spin_geq(c.ready, base + o.c + 1);
            if (o.send) spin_geq(c.ack, base + o.m + 1 - depth);
        }, [&](u64 i) {
            const ROp o = rop(i, c.S, W, me, c.lo0, c.hi0, C, G);
            if (o.send) st_rel(c.ready_next, base + o.m + 1);
            if (o.recv) st_rel(c.ack_prev, base + o.c + 1);
        });
    } else {
        const u32 nd = nl - 32, dt = t - 32;
        const u64 TW = RT_TILE / 16;
        u64 tiles = 0;
        for (u64 i = 0; i < ops; i++) {
            asm volatile("bar.sync 1, %0;" ::"r"(nl) : "memory");
            const ROp o = rop(i, c.S, W, me, c.lo0, c.hi0, C, G);
            const uint4* sin = c.mine + ((base + o.c) % depth) * C;
            uint4* sout = c.theirs + ((base + o.m) % depth) * C;
            for (u64 w0 = o.lo; w0 < o.hi; w0 += TW) {
                const u64 w1 = w0 + TW < o.hi ? w0 + TW : o.hi;
                uint4* tile = (uint4*)(dsm + (tiles % NT) * RT_TILE);
                if (o.send) {
                    if (dt == 0 && tiles >= NT) asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(NT - 1) : "memory");
                    asm volatile("bar.sync 3, %0;" ::"r"(nd) : "memory");
                }
                for (u64 w = w0 + dt; w < w1; w += (u64)nd * U) {
                    uint4 x[U], y[U];
#pragma unroll
                    for (int u = 0; u < U; u++) {
                        const u64 q = w + u * nd;
                        if (q < w1) {
                            if (red || !o.recv) x[u] = c.in[o.blk * n16 + q];
                            if (o.recv) y[u] = sin[q - o.lo];
                        }
                    }
#pragma unroll
                    for (int u = 0; u < U; u++) {
                        const u64 q = w + u * nd;
                        if (q >= w1) continue;
                        const uint4 z = o.recv ? (red ? add8(x[u], y[u]) : y[u]) : x[u];
                        if (o.send) tile[q - w0] = z; else c.out[q] = z;
                    }
                }
                if (o.send) {
                    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                    asm volatile("bar.sync 3, %0;" ::"r"(nd) : "memory");
                    if (dt == 0) {
                        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(__cvta_generic_to_global(sout + (w0 - o.lo))),
                                     "r"(sa(tile)), "r"((u32)((w1 - w0) * 16)) : "memory");
                        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                    }
                    tiles++;
                }
            }
            if (o.send && dt == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
            asm volatile("bar.arrive 2, %0;" ::"r"(nl) : "memory");
        }
        if (dt == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
    if (t == 0) *c.ctr = base + (u32)(c.S * c.K);
}
extern "C" __global__ void ring_tma(Ptrs b, u64 n16, u32 W, u32 me, u64 C, u64 fl, u32 lanes, u32 depth, u32 red, u32 G, u32 fence) {
    ring_tma_body<4>(b, n16, W, me, C, fl, depth, red, G);
}
extern "C" __global__ void ring_tma6(Ptrs b, u64 n16, u32 W, u32 me, u64 C, u64 fl, u32 lanes, u32 depth, u32 red, u32 G, u32 fence) {
    ring_tma_body<6>(b, n16, W, me, C, fl, depth, red, G);
}
// ring-wsf: ring-ws on a fused schedule (branch ring-fuse; in rsccl it was slower,
// docs/performance.md, 2026-11-28 03:36 UTC): each chunk's last step (local only) runs in
// the operation of the next group's first step at the same position, the two interleaved
// pack by pack, so that every operation but the last group's sends and the CTA's stores to
// next never pause for a local step.
__device__ __forceinline__ u32 fused_ops(u32 S, u32 G, u64 K, ROp* a, bool* ha, ROp* m, bool* hm, u64 i, u32 W, u32 me, u64 lo0, u64 hi0, u64 C) {
    const u64 per = (u64)S * G, g = i / per, r = i - g * per;
    const u32 s = (u32)(r / G), j = (u32)(r % G);
    *ha = g >= 1 && s == 0;
    *hm = g < K / G;
    if (*ha) *a = rop((g - 1) * (S + 1) * G + (u64)S * G + j, S, W, me, lo0, hi0, C, G);
    if (*hm) *m = rop(g * (S + 1) * G + (u64)s * G + j, S, W, me, lo0, hi0, C, G);
    return 0;
}
__device__ __forceinline__ void rmove_one(const ROp& o, u64 r, const uint4* in, u64 n16, const uint4* sin, uint4* sout, uint4* out, bool red, uint4& x, uint4& y, int phase) {
    if (phase == 0) {
        if (red || !o.recv) x = in[o.blk * n16 + o.lo + r];
        if (o.recv) y = sin[r];
    } else {
        const uint4 z = o.recv ? (red ? add8(x, y) : y) : x;
        if (o.send) sout[r] = z; else out[o.lo + r] = z;
    }
}
__device__ void ring_wsf_body(Ptrs b, u64 n16, u32 W, u32 me, u64 C, u64 fl, u32 depth, u32 red, u32 G) {
    __shared__ u32 base_s;
    const u32 t = threadIdx.x, nl = blockDim.x, id = blockIdx.x, ids = gridDim.x;
    const RingCtx c = ring_ctx(b, n16, W, me, C, fl, depth, G, id, ids);
    const u64 ops = c.K ? (c.K / G) * c.S * G + G : 0;
    if (t == 0) base_s = *c.ctr;
    __syncthreads();
    const u32 base = base_s;
    if (t < 32) {
        signal_warp(ops, 1, 2, nl, t, [&](u64 i) {
            ROp a, m; bool ha, hm;
            fused_ops(c.S, G, c.K, &a, &ha, &m, &hm, i, W, me, c.lo0, c.hi0, C);
            if (ha && a.recv) spin_geq(c.ready, base + a.c + 1);
            if (hm && m.recv) spin_geq(c.ready, base + m.c + 1);
            if (hm && m.send) spin_geq(c.ack, base + m.m + 1 - depth);
        }, [&](u64 i) {
            ROp a, m; bool ha, hm;
            fused_ops(c.S, G, c.K, &a, &ha, &m, &hm, i, W, me, c.lo0, c.hi0, C);
            // Numbers grow in the order sent and received: the largest of each kind.
            if (hm && m.send) st_rel(c.ready_next, base + m.m + 1);
            if (hm && m.recv) st_rel(c.ack_prev, base + m.c + 1);
            else if (ha && a.recv) st_rel(c.ack_prev, base + a.c + 1);
        });
    } else {
        const u32 nd = nl - 32, dt = t - 32;
        for (u64 i = 0; i < ops; i++) {
            asm volatile("bar.sync 1, %0;" ::"r"(nl) : "memory");
            ROp a, m; bool ha, hm;
            fused_ops(c.S, G, c.K, &a, &ha, &m, &hm, i, W, me, c.lo0, c.hi0, C);
            const u64 la = ha && a.hi > a.lo ? a.hi - a.lo : 0, lm = hm && m.hi > m.lo ? m.hi - m.lo : 0;
            const u64 L = la > lm ? la : lm;
            const uint4* sin_a = c.mine + ((base + a.c) % depth) * C;
            const uint4* sin_m = c.mine + ((base + m.c) % depth) * C;
            uint4* sout_m = c.theirs + ((base + m.m) % depth) * C;
            for (u64 r = dt; r < L; r += (u64)nd * U) {
                uint4 xa[U], ya[U], xm[U], ym[U];
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const u64 q = r + u * nd;
                    if (q < lm) rmove_one(m, q, c.in, n16, sin_m, sout_m, c.out, red, xm[u], ym[u], 0);
                    if (q < la) rmove_one(a, q, c.in, n16, sin_a, nullptr, c.out, red, xa[u], ya[u], 0);
                }
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const u64 q = r + u * nd;
                    if (q < lm) rmove_one(m, q, c.in, n16, sin_m, sout_m, c.out, red, xm[u], ym[u], 1);
                    if (q < la) rmove_one(a, q, c.in, n16, sin_a, nullptr, c.out, red, xa[u], ya[u], 1);
                }
            }
            asm volatile("bar.arrive 2, %0;" ::"r"(nl) : "memory");
        }
    }
    if (t == 0) *c.ctr = base + (u32)(c.S * c.K);
}
extern "C" __global__ void __launch_bounds__(512, 1) ring_wsf(Ptrs b, u64 n16, u32 W, u32 me, u64 C, u64 fl, u32 lanes, u32 depth, u32 red, u32 G, u32 fence) {
    ring_wsf_body(b, n16, W, me, C, fl, depth, red, G);
}
