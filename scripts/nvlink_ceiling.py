"""How fast the GPUs of one host can move data to each other over NVLink, by pattern and
grid size, outside rsccl: a ceiling to hold rsccl's kernels against (issue 26).

Every rank moves (world - 1) x `--mib` MiB per round, all ranks at once, with one of these
kernels, on 8 to 132 CTAs (st-split and st-inter are the pattern of the push phases of
rsccl's reduce_scatter, all_gather and two-shot all_reduce):
  st-peer   each CTA stores its slice to one peer after another (16-byte st.global)
  st-inter  each CTA stores its slice to every peer in one loop (the loads of all peers'
            data first, then their stores)
  st-split  the CTAs split among the peers: CTA b pushes to one peer only
  ld-peer   pull: each CTA loads its slice from one peer after another, stores locally
  tma-peer  one thread per CTA pushes by bulk copies (cp.async.bulk, 4 x 8 KiB of shared
            memory), one peer after another (sm_90+)
  tma-split bulk copies, the CTAs split among the peers
  st-ring, tma-ring  the same bytes ((world - 1) x size) to the next rank only, as a ring
            algorithm's steps send them (threads' stores, or bulk copies)
  steps-perm  in steps of --piece-kib per CTA and peer, with a barrier among the ranks'
            blocks (as rsccl's kernels have): one peer per phase (me + k at phase k), a
            barrier after each phase, so every phase is a permutation of the ranks
  steps-a2a the same steps, every peer one after another, one barrier per step (the order
            of rsccl's reduce_scatter pushes)
  ring-ws   a ring reduce_scatter with readiness flags and slots, as rsccl's ring runs
            (csrc_kernels/ring.cuh): per CTA, one warp waits for the next operation's flags
            and releases the last one's while the others move data (--ring-chunk-kib,
            --ring-depth, --ring-group, --ring-reduce, --ring-fence, --ring-lanes
            pipelines per CTA); ring-ws1k the same for --threads 1024
  ring-rs   the same schedule, each CTA's lane waits, moves data and releases in turn
  ring-wp   ring-rs with every warp a pipeline of its own (no CTA-wide barrier)
  ring-tma  ring-ws whose sends are bulk copies of shared-memory tiles (4 of 32 KiB;
            ring-tma6: 6), the SM's own stores local only
  ring-wsf  ring-ws on a fused schedule: each chunk's last, local step runs interleaved with
            the next group's first step (branch ring-fuse; in rsccl it was slower,
            docs/performance.md, 2026-11-28 03:36 UTC)
  ring-tmabare  st-ring's bytes by bulk copies through --ring-depth buffers of
            --ring-chunk-kib (tma-ring: 4 of 8 KiB)
GB/s = bytes each GPU sends (world - 1) x size, over the slowest rank's time per round.
The buffers are torch symmetric memory (torch.distributed._symmetric_memory) on an NCCL
group; the kernels (scripts/nvlink_ceiling.cu) are compiled with NVRTC (the libnvrtc that
comes with torch's CUDA wheels) and launched with the driver API through ctypes. Nothing
checks the data.

    torchrun --nproc-per-node 4 scripts/nvlink_ceiling.py [--mib 64] [--rounds 20] [--kernels st-ring,st-split]
"""

import argparse
import ctypes
import glob
import os
import sys

import torch
import torch.distributed as dist

# The kernels (one CUDA source beside this script, compiled with NVRTC at run time).
SRC_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nvlink_ceiling.cu")
KERNELS = (
    "st-peer",
    "st-inter",
    "st-split",
    "st-ring",
    "ld-peer",
    "tma-peer",
    "tma-split",
    "tma-ring",
    "steps-perm",
    "steps-a2a",
    "ring-rs",
    "ring-ws",
    "ring-wp",
    "ring-ws1k",
)


def _lib(names: list[str], pattern: str) -> ctypes.CDLL:
    for n in names:
        try:
            return ctypes.CDLL(n)
        except OSError:
            pass
    for d in sys.path:
        for p in sorted(glob.glob(os.path.join(d, pattern))):
            return ctypes.CDLL(p)
    raise OSError(f"none of {names} found (nor {pattern} under sys.path)")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: error {rc}")


def compile_cubin(arch: str, path: str = SRC_PATH) -> bytes:
    """The CUDA source at `path` compiled for `arch` (sm_90) with NVRTC; also scripts/ce_ring.py's."""
    nvrtc = _lib(["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"], "nvidia/*/lib/libnvrtc.so*")
    prog = ctypes.c_void_p()
    with open(path, "rb") as f:
        src = f.read()
    _check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, os.path.basename(path).encode(), 0, None, None), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    if rc != 0:
        n = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError("NVRTC: " + log.value.decode(errors="replace"))
    n = ctypes.c_size_t()
    _check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n)), "nvrtcGetCUBINSize")
    out = ctypes.create_string_buffer(n.value)
    _check(nvrtc.nvrtcGetCUBIN(prog, out), "nvrtcGetCUBIN")
    return out.raw


def start() -> tuple[int, int, int, torch.device]:
    """torchrun's rank, world size and local rank, this rank's GPU, and the world group
    (gloo for CPU tensors, NCCL for CUDA ones); also scripts/ce_ring.py's."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=dev)
    return rank, world, local, dev


def symmetric(nbytes: int, dev: torch.device):
    """A torch symmetric-memory buffer of `nbytes` on `dev`, rendezvoused on the world group:
    (the buffer, its handle; `handle.buffer_ptrs[j]` is rank j's buffer in this process)."""
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=dev)
    name = dist.group.WORLD.group_name
    try:
        return buf, symm_mem.rendezvous(buf, name)
    except RuntimeError as e:  # torch before 2.11 wants the group enabled first
        if "group info" not in str(e):
            raise
        symm_mem.enable_symm_mem_for_group(name)
        return buf, symm_mem.rendezvous(buf, name)


def load_module(local: int, dev: torch.device, path: str = SRC_PATH) -> tuple[ctypes.CDLL, ctypes.c_void_p]:
    """The driver library and the CUDA source at `path` compiled for `dev` and loaded into
    torch's context (made current on this thread if it is not)."""
    major, minor = torch.cuda.get_device_capability(dev)
    cuda = _lib(["libcuda.so.1"], "libcuda.so*")
    ctx = ctypes.c_void_p()
    _check(cuda.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:  # torch's primary context, made current on this thread
        _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), local), "cuDevicePrimaryCtxRetain")
        _check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    mod = ctypes.c_void_p()
    _check(cuda.cuModuleLoadData(ctypes.byref(mod), compile_cubin(f"sm_{major}{minor}", path)), "cuModuleLoadData")
    return cuda, mod


def slowest(ms: float) -> float:
    """The largest of the ranks' `ms` (a gloo all_reduce of a CPU tensor)."""
    t = torch.tensor([ms])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def slowest_ms(fn, reps: int, warmup: int = 1) -> float:
    """ms per call of `fn` (GPU work on the current stream), `reps` calls timed by events
    after `warmup` untimed ones and a barrier: the slowest rank's (a gloo all_reduce)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return slowest(a.elapsed_time(b) / reps)


class Ptrs(ctypes.Structure):
    _fields_ = [("p", ctypes.c_uint64 * 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB each rank sends each other rank per round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--ctas", default="8,16,32,64,132")
    ap.add_argument("--threads", type=int, default=512)
    ap.add_argument("--piece-kib", type=int, default=160, help="steps-*: KiB per CTA, peer and step")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--ring-lanes", default="1", help="ring-*: pipelines per CTA (a list)")
    ap.add_argument("--ring-chunk-kib", default="128", help="ring-*: KiB per chunk and slot (a list)")
    ap.add_argument("--ring-depth", type=int, default=8, help="ring-*: slots per pipeline")
    ap.add_argument(
        "--ring-reduce",
        type=int,
        default=1,
        help="ring-*: 1 reduce (bf16 add), 0 copy; 2 (ring-ws only): reduce, but each chunk's last, local step moves "
        "nothing (its flags still run): what that step costs",
    )
    ap.add_argument(
        "--ring-fence", type=int, default=1, help="ring-*: 1 release per signal, 0 relaxed (wrong, for timing), 2 every second op"
    )
    ap.add_argument("--ring-group", default="2", help="ring-*: chunks per group (a list); slots: at least group + 2")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 and stop (no GPU needed)")
    args = ap.parse_args()
    if args.compile_only:
        print(f"cubin: {len(compile_cubin('sm_90'))} bytes")
        return
    rank, world, local, dev = start()
    n = args.mib << 20
    fl = 2 * world * n  # the flag page of the steps-* kernels: flags, then epochs at +8 KiB
    buf, hdl = symmetric(fl + 32768, dev)
    buf.random_(0, 255)
    buf[fl:].zero_()
    torch.cuda.synchronize()
    dist.barrier()  # every flag page zeroed before any kernel signals into it
    cuda, mod = load_module(local, dev)
    ptrs = Ptrs()
    for j, p in enumerate(hdl.buffer_ptrs):
        ptrs.p[j] = p
    n16, W, me = ctypes.c_uint64(n // 16), ctypes.c_uint32(world), ctypes.c_uint32(rank)
    piece16, flo = ctypes.c_uint64(args.piece_kib * 1024 // 16), ctypes.c_uint64(fl)
    # The kernels of four parameters read the first four (cuLaunchKernel reads as many as
    # the kernel has).
    args6 = (ptrs, n16, W, me, piece16, flo)
    params = (ctypes.c_void_p * 6)(*[ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in args6])
    stream = torch.cuda.current_stream(dev).cuda_stream
    rows = []
    configs = []
    for name in args.kernels.split(","):
        for g in [int(c) for c in args.ctas.split(",")]:
            if not name.startswith("ring"):
                configs.append((name, g, None))
                continue
            for lanes in [int(x) for x in args.ring_lanes.split(",")] if name != "ring-wp" else [args.threads // 32]:
                for kib in [int(x) for x in args.ring_chunk_kib.split(",")]:
                    for grp in [int(x) for x in args.ring_group.split(",")]:
                        depth = max(args.ring_depth, grp + 2)
                        fits = g * lanes * depth * kib * 1024 <= world * n and (lanes * 64 <= args.threads or name == "ring-wp")
                        if fits and (not name.startswith("ring-ws") or 2 + 2 * lanes <= 16):
                            configs.append((name, g, (lanes, kib, grp, depth)))
    for name, g, ring in configs:
        f = ctypes.c_void_p()
        _check(cuda.cuModuleGetFunction(ctypes.byref(f), mod, name.replace("-", "_").encode()), f"cuModuleGetFunction {name}")
        if ring is not None:
            lanes, kib, grp, depth = ring
            rargs = (
                ptrs,
                n16,
                W,
                me,
                ctypes.c_uint64(kib * 1024 // 16),
                flo,
                ctypes.c_uint32(lanes),
                ctypes.c_uint32(depth),
                ctypes.c_uint32(args.ring_reduce),
                ctypes.c_uint32(grp),
                ctypes.c_uint32(args.ring_fence),
            )
            rparams = (ctypes.c_void_p * 11)(*[ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in rargs])
        threads = 32 if name.startswith("tma") or name == "ring-tmabare" else args.threads
        kp = rparams if ring is not None else params
        # Dynamic shared memory: ring-tmabare's buffers (slots x chunk), ring-tma's tiles.
        smem = {"ring-tmabare": ring[3] * ring[1] * 1024 if ring else 0, "ring-tma": 4 * 32768, "ring-tma6": 6 * 32768}.get(name, 0)
        if smem > 227 * 1024:
            continue
        if smem:
            _check(cuda.cuFuncSetAttribute(f, 8, smem), f"cuFuncSetAttribute {name}")  # MAX_DYNAMIC_SHARED_SIZE_BYTES
        label = name if ring is None else f"{name} lanes {ring[0]} chunk {ring[1]} KiB group {ring[2]} depth {ring[3]}"

        def launch() -> None:
            _check(cuda.cuLaunchKernel(f, g, 1, 1, threads, 1, 1, smem, ctypes.c_void_p(stream), kp, None), f"launch {name}")

        ms = slowest_ms(launch, args.rounds, warmup=3)
        dist.barrier()
        gbs = (world - 1) * n / (ms * 1e-3) / 1e9
        rows.append((label, g, ms * 1e3, gbs))
    if rank == 0:
        gpu = torch.cuda.get_device_name(dev)
        print(
            f"# nvlink_ceiling: world {world}, {gpu}, {args.mib} MiB to each peer per round, {args.rounds} rounds, torch {torch.__version__}"
        )
        print("| kernel | CTAs | us per round (slowest rank) | GB/s out of each GPU |")
        print("|---|---:|---:|---:|")
        for name, g, us, gbs in rows:
            print(f"| {name} | {g} | {us:.0f} | {gbs:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
