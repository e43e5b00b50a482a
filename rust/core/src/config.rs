//! Every tunable of rsccl, in one place. A value comes from `rsccl.Options` (passed as
//! `pg_options`), else from its `RSCCL_*` environment variable, else the default.
//! Bad values are rejected with a message naming the option and the variable; so is a
//! variable whose value is not UTF-8 (it is never taken as unset).

use std::ffi::{OsStr, OsString};

use crate::error::{Error, Result};

/// How the resolvers look a variable up: the raw value, as `std::env::var_os` gives it
/// (tests pass their own).
pub type EnvLookup<'a> = &'a dyn Fn(&str) -> Option<OsString>;

/// `raw`, the value of variable `name`, as text; a value that is not UTF-8 is an error
/// naming the variable, never "unset".
pub fn env_text<'a>(name: &str, raw: &'a OsStr) -> Result<&'a str> {
    raw.to_str().ok_or_else(|| Error::Config(format!("{name} = {raw:?} is not valid UTF-8")))
}

/// Variable `name` of this process's environment: None when unset, an error naming it
/// when its value is not UTF-8.
pub fn env_var(name: &str) -> Result<Option<String>> {
    std::env::var_os(name).map(|raw| env_text(name, &raw).map(str::to_owned)).transpose()
}

/// One tunable: its Options field, its environment variable, its bounds and meaning.
pub struct Setting {
    pub field: &'static str,
    pub env: &'static str,
    pub default: u64,
    pub min: u64,
    pub max: u64,
    pub is_size: bool,
    pub help: &'static str,
}

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The most cuda_low_latency_max_bytes may be: what the low-latency kernels' slots hold in
/// groups of up to 4 local ranks (LL_MAX_BYTES in csrc_kernels/abi.cuh; cuda/kernels holds
/// the two equal, and lowers the bound for larger groups: ll_max_bytes).
pub const CUDA_LOW_LATENCY_MAX_BYTES: u64 = 64 * KIB;

/// The table users see in README.md (`python -c "import rsccl; rsccl.print_settings()"`).
pub const SETTINGS: &[Setting] = &[
    Setting {
        field: "host_buffer_bytes",
        env: "RSCCL_HOST_BUFFER_BYTES",
        default: 4 * MIB,
        min: 64 * KIB,
        max: GIB,
        is_size: true,
        help: "shared-memory staging per rank for collectives on CPU tensors (two halves, \
               double-buffered); larger messages are pipelined through it",
    },
    Setting {
        field: "p2p_buffer_bytes",
        env: "RSCCL_P2P_BUFFER_BYTES",
        default: 512 * KIB,
        min: 16 * KIB,
        max: 256 * MIB,
        is_size: true,
        help: "shared-memory channel per ordered pair of local ranks for send/recv",
    },
    Setting {
        field: "max_region_bytes",
        env: "RSCCL_MAX_REGION_BYTES",
        default: GIB,
        min: MIB,
        max: 64 * GIB,
        is_size: true,
        help: "cap on one group's shared region on a host; group creation fails if the \
               buffers above need more",
    },
    Setting {
        field: "allreduce_one_shot_max_bytes",
        env: "RSCCL_ALLREDUCE_ONE_SHOT_MAX_BYTES",
        // From `python -m rsccl.bench --collectives all_reduce` with this set to 0, 64 KiB
        // and 2 MiB on the 2-core CI machine (docs/performance.md): one-shot was never
        // clearly faster, and slower from 64 KiB up (4 ranks: 280 vs 160 us at 64 KiB,
        // 1480 vs 960 us at 1 MiB); up to 16 KiB the two were within noise.
        default: 16 * KIB,
        min: 0,
        max: GIB,
        is_size: true,
        help: "all_reduce messages up to this size use the one-shot algorithm (every rank \
               reduces everything, one barrier); larger ones reduce-scatter then all-gather",
    },
    Setting {
        field: "spin_count",
        env: "RSCCL_SPIN_COUNT",
        default: 2000,
        min: 0,
        max: 100_000_000,
        is_size: false,
        help: "polls of a shared-memory flag before a waiting rank yields, then sleeps on a futex",
    },
    Setting {
        field: "cuda_buffer_bytes",
        env: "RSCCL_CUDA_BUFFER_BYTES",
        // Measured on 2 and 4 H200s (scripts/gpu_smoke.py, 2026-11-21): bf16 all_reduce of
        // 256 MiB at 4 ranks, 214 GB/s busbw with 32 MiB and 32 blocks, 282 with 64 MiB
        // and 64 blocks: fewer, larger steps amortize the per-step barrier.
        default: 64 * MIB,
        min: 2 * MIB,
        max: 4 * GIB,
        is_size: true,
        help: "device memory per rank for CUDA collectives (signal pads and double-buffered \
               staging), mapped by every local rank; larger messages are pipelined through it",
    },
    Setting {
        field: "cuda_blocks",
        env: "RSCCL_CUDA_BLOCKS",
        // Same measurement: 64 blocks beat 32 at every size >= 16 MiB (2 ranks, 256 MiB:
        // 268 vs 209 GB/s) and cost nothing below.
        default: 64,
        min: 1,
        max: 64,
        is_size: false,
        help: "CUDA blocks (of 512 threads) of every rsccl kernel; each block moves its own \
               share of the staging and synchronizes with the same block on the other ranks",
    },
    Setting {
        field: "cuda_allreduce_one_shot_max_bytes",
        env: "RSCCL_CUDA_ALLREDUCE_ONE_SHOT_MAX_BYTES",
        default: 0,
        min: 0,
        max: 64 * GIB,
        is_size: true,
        help: "CUDA all_reduce messages up to this size use the one-shot kernel (every rank \
               reduces everything); larger ones use two-shot (reduce-scatter + all-gather). \
               0: by the number of local ranks, as measured on H200s (2 MiB for 2, 512 KiB \
               for 3-4, 256 KiB for more)",
    },
    Setting {
        field: "cuda_low_latency_max_bytes",
        env: "RSCCL_CUDA_LOW_LATENCY_MAX_BYTES",
        // The low-latency kernels' slots (a 1 MiB area of each rank's block) hold 64 KiB per
        // sender in groups of up to 4 local ranks, 32 KiB up to 8, 16 KiB up to 16
        // (ll_max_bytes; the setting lowers it, never raises it). Up to 16 KiB, all_reduce,
        // all_gather and reduce_scatter took 4.8-5.9 us under CUDA graphs on 2 H100s and
        // 6.7-8.4 on 4; at 64 KiB the barrier kernels took 7.7-10.4, the low-latency ones
        // 5.2-5.7 at 2 GPUs and 8.4-9.3 at 4 (docs/performance.md, 2026-11-27 17:44-18:12
        // UTC).
        default: CUDA_LOW_LATENCY_MAX_BYTES,
        min: 0,
        max: CUDA_LOW_LATENCY_MAX_BYTES,
        is_size: true,
        help: "CUDA all_reduce (the message), reduce_scatter (the output) and all_gather (the \
               input) up to this size per rank run rsccl's low-latency kernels, which need no \
               barrier (each word carries its call's epoch); larger ones the barrier kernels. \
               Their slots bound it at 64 KiB in groups of up to 4 GPUs, 32 KiB up to 8 and \
               16 KiB above. 0: never",
    },
    Setting {
        field: "cuda_copy_engine_min_bytes",
        env: "RSCCL_CUDA_COPY_ENGINE_MIN_BYTES",
        // Off: on 4 H100s the copy engines moved 185-195 GB/s into each GPU (all_gather
        // 256 MiB-1 GiB) against 320 for rsccl's kernels and NCCL (the engines themselves
        // stop near 222 with every GPU sending); on 2 H100s 246-275 against 275-309 for the
        // kernels and 231-269 for NCCL; the bench's overlap loop was not faster with them
        // and FSDP2 was 30% slower (2026-11-26, docs/performance.md "Copy engines"). An
        // opt-in for code that needs the SMs more than the bandwidth.
        default: 0,
        min: 0,
        max: 1 << 40,
        is_size: true,
        help: "CUDA all_gather messages (the gathered output), reduce_scatter messages (the \
               input), broadcasts and send/recv messages from this size on move on the GPU's \
               copy engines, with no SM moving data between GPUs, between one-CTA barrier or \
               signal kernels (such a send waits for its recv; a reduce_scatter reduces each \
               round of what arrived with a local kernel of 16 CTAs); smaller ones run rsccl's \
               kernels. 0 (default): never; \
               1: at every size. Slower than the kernels where nothing else runs \
               (docs/performance.md; reduce_scatter not measured yet)",
    },
    Setting {
        field: "cuda_ring_min_bytes",
        env: "RSCCL_CUDA_RING_MIN_BYTES",
        // From 64 MiB the ring beat the direct kernels on 4 H100s by 3-11% (all_reduce 256
        // MiB 1,191 against 1,253 us, reduce_scatter 1 GiB 2,366 against 2,540) and on 2 by
        // up to 19%; at 16 MiB it lost (all_reduce 113 against 104 us at 4 GPUs); on 32
        // CTAs it lost to the direct kernels on 64 (docs/performance.md, 2026-11-27
        // 21:53-22:28 UTC).
        default: 64 * MIB,
        min: 0,
        max: 1 << 40,
        is_size: true,
        help: "CUDA reduce_scatter (the input) and all_reduce messages from this size on run \
               as a ring: each rank sends only to the next, in pipelined chunks with a ready \
               and an ack flag per chunk (csrc_kernels/ring.cuh, NOTE [Ring]). Partial sums \
               travel in the tensor's dtype, so float16/bfloat16 sums round once per hop (up \
               to local ranks - 1 times), as NCCL's ring does; below this size they round \
               once. 0: never",
    },
    Setting {
        field: "max_cuda_va_bytes",
        env: "RSCCL_MAX_CUDA_VA_BYTES",
        // Room for a pool of ~3.9 GiB per rank at 4 ranks (or ~1.9 GiB at 8) with the
        // default buffer; NCCL reserves 281 GiB per GPU on an H200 (docs/memory.md).
        default: 16 * GIB,
        min: 2 * MIB,
        max: 1 << 40,
        is_size: true,
        help: "cap on the virtual address space one group reserves on a GPU (its own buffer \
               and pool and every local peer's, mapped); group creation fails if more is needed",
    },
    Setting {
        field: "cuda_pool_bytes",
        env: "RSCCL_CUDA_POOL_BYTES",
        default: 0,
        min: 0,
        max: 1 << 40,
        is_size: true,
        help: "device memory per rank for rsccl.mem_pool(group): tensors allocated from it \
               are used in place by collectives (no staging copy); mapped by every local rank \
               at group creation. 0: no pool",
    },
    Setting {
        field: "cuda_inplace_min_bytes",
        env: "RSCCL_CUDA_INPLACE_MIN_BYTES",
        default: MIB,
        min: 0,
        max: 1 << 40,
        is_size: true,
        help: "pool tensors are used in place from this message size on (smaller messages are \
               staged: one barrier instead of two)",
    },
    Setting {
        field: "cuda_p2p_bytes",
        env: "RSCCL_CUDA_P2P_BYTES",
        // A send's step is one chunk per block, chunk = this / (local peers x blocks x 4).
        // On 4 H100s a 256 MiB send took 953 us at 4 ranks (22 blocks) with 16 MiB, 862
        // with 32, 802 with 64 (NCCL 754-763 in the same runs); at 2 ranks 820 / 775 / 773
        // (NCCL 758-766). 32 MiB takes most of the gain for 16 MiB more per rank (64: 48
        // more) (docs/performance.md, 2026-11-28 00:04 UTC).
        default: 32 * MIB,
        min: MIB,
        max: GIB,
        is_size: true,
        help: "device memory per rank for CUDA send/recv: an inbox split among the local peers \
               (per peer, CUDA block and four inbox slots), mapped by every local rank; messages \
               are pipelined through it; a sender runs at most four chunks per block ahead of its \
               receiver (one message of up to cuda_p2p_bytes / (local ranks - 1))",
    },
    Setting {
        field: "cuda_p2p_blocks",
        env: "RSCCL_CUDA_P2P_BLOCKS",
        default: 32,
        min: 1,
        max: 64,
        is_size: false,
        help: "CUDA blocks (of 512 threads) of every send/recv kernel; each (peer, direction) \
               runs on its own stream, so several run at once",
    },
    Setting {
        field: "cuda_warmup",
        env: "RSCCL_CUDA_WARMUP",
        default: 1,
        min: 0,
        max: 1,
        is_size: false,
        help: "1: run one collective of every kernel family at group creation, so the first \
               real collective finds everything loaded and resident; 0: skip it (faster \
               creation; memory is still mapped and kernels loaded at creation)",
    },
    Setting {
        field: "allow_shared_gpu",
        env: "RSCCL_ALLOW_SHARED_GPU",
        default: 0,
        min: 0,
        max: 1,
        is_size: false,
        help: "1: ranks of a group may share a GPU (tests, debugging, CI on one GPU); each \
               rank's kernels are sized to its share of the GPU's SMs, so nothing deadlocks, \
               with or without MPS, but timings mean nothing; 0: two ranks on one GPU are \
               refused at group creation",
    },
    Setting {
        field: "cuda_sync_stream",
        env: "RSCCL_CUDA_SYNC_STREAM",
        default: 1,
        min: 0,
        max: 1,
        is_size: false,
        help: "1: a blocking CUDA collective (async_op=False) runs on the caller's current \
               stream; 0: on the group's internal stream, ordered with events",
    },
    Setting {
        field: "cuda_error_teardown",
        env: "RSCCL_CUDA_ERROR_TEARDOWN",
        default: 1,
        min: 0,
        max: 1,
        is_size: false,
        help: "1: a CUDA collective or send/recv that fails on the GPU (a timeout, a dead or \
               failed peer, ranks that called different collectives, two collectives of a \
               group at once) ends the process with the error on stderr, as NCCL's \
               TORCH_NCCL_ASYNC_ERROR_HANDLING does: the failed kernel holds its stream until \
               then, so nothing queued after it computes with a result it did not produce; \
               0: the error is raised at the group's next call or Work.wait (a mismatch \
               leaves the group usable), and work queued behind the failed call on the GPU \
               runs with its output as it was (docs/errors.md)",
    },
    Setting {
        field: "nccl_max_ctas",
        env: "RSCCL_NCCL_MAX_CTAS",
        // NCCL's own default on H100/H200 goes up to 32 channels per communicator (64
        // with NVLS, off here); a group that spans hosts has two communicators per rank
        // (flat and cross), and every channel holds buffers (NCCL_BUFFSIZE per peer and
        // protocol), so rsccl halves NCCL's count. Not measured yet: a bound on memory, not
        // a tuned value.
        default: 16,
        min: 0,
        max: 64,
        is_size: false,
        help: "most CTAs (channels) of each NCCL communicator of a group that spans hosts \
               (ncclConfig_t.maxCTAs); fewer channels hold fewer buffers. 0: NCCL's default",
    },
    Setting {
        field: "nccl_p2p_max_ctas",
        env: "RSCCL_NCCL_P2P_MAX_CTAS",
        // The pair communicators (send/recv across hosts) are many (2 per cross-host peer)
        // and each holds its own channels' buffers: with 16 CTAs, 4 of them took 790 MiB
        // per rank on the emulated 2 x 2 (4 H200s, 2026-11-22 01:11). A send/recv across
        // hosts feeds one NIC, which a few channels fill.
        default: 4,
        min: 0,
        max: 64,
        is_size: false,
        help: "most CTAs (channels) of each pair communicator that carries CUDA send/recv \
               across hosts (nccl_p2p); 0: NCCL's default",
    },
    Setting {
        field: "nccl_hierarchical_min_bytes",
        env: "RSCCL_NCCL_HIERARCHICAL_MIN_BYTES",
        // A guess to be measured: under a few MiB the two host-local kernels and their
        // barriers cost more than the cross-host bytes they save.
        default: 16 * MIB,
        min: 0,
        max: 1 << 40,
        is_size: true,
        help: "CUDA all_reduce, all_gather and reduce_scatter of a group that spans hosts, \
               with the same number (>= 2) of GPUs on every host, run hierarchically from \
               this size on (rsccl's kernels inside each host, NCCL across hosts); smaller \
               messages run as one flat NCCL collective",
    },
    Setting {
        field: "nccl_hierarchical_scratch_bytes",
        env: "RSCCL_NCCL_HIERARCHICAL_SCRATCH_BYTES",
        // A bound, not a tuned value: a hierarchical reduce_scatter keeps the host-local
        // partial sums (hosts x output bytes) here between its two phases, so this is the
        // largest output x hosts that runs hierarchically; larger calls run flat.
        default: 32 * MIB,
        min: 0,
        max: 1 << 40,
        is_size: true,
        help: "device memory per rank, allocated at creation of a group that spans hosts \
               with the same number (>= 2) of GPUs on every host and host-major ranks, for \
               hierarchical reduce_scatter: a call whose output bytes x hosts exceed it runs \
               flat. 0: no buffer, reduce_scatter always flat",
    },
    Setting {
        field: "nccl_p2p",
        env: "RSCCL_NCCL_P2P",
        default: 1,
        min: 0,
        max: 1,
        is_size: false,
        help: "1: a group that spans hosts creates, at creation, one 2-rank NCCL communicator \
               (and CUDA stream) per ordered pair of ranks on different hosts, warmed up, for \
               CUDA send/recv across hosts; 0: none (less memory and a faster creation; CUDA \
               send/recv across hosts then raise TypeError)",
    },
];

/// Where a GPU's kernels come from: `RSCCL_KERNELS`, a process-wide choice read when a group
/// loads its kernels (not an Options field: every group of a process loads the same code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelSource {
    /// `auto` (the default): the fat binary built into the wheel when it holds code for
    /// this GPU, else NVRTC (with a warning saying why).
    Auto,
    /// `prebuilt`: the fat binary only; a GPU it does not cover is an error.
    Prebuilt,
    /// `nvrtc`: compile csrc_kernels/ with NVRTC for this GPU (cached on disk): the
    /// developer's path, and the fallback for GPUs the fat binary does not cover.
    Nvrtc,
}

pub const KERNELS_ENV: &str = "RSCCL_KERNELS";

impl KernelSource {
    pub fn name(self) -> &'static str {
        match self {
            KernelSource::Auto => "auto",
            KernelSource::Prebuilt => "prebuilt",
            KernelSource::Nvrtc => "nvrtc",
        }
    }

    /// From `RSCCL_KERNELS` as `env` reads it (unset or empty: auto).
    pub fn resolve(env: EnvLookup) -> Result<KernelSource> {
        let raw = env(KERNELS_ENV).unwrap_or_default();
        let v = env_text(KERNELS_ENV, &raw)?;
        match v.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(KernelSource::Auto),
            "prebuilt" => Ok(KernelSource::Prebuilt),
            "nvrtc" => Ok(KernelSource::Nvrtc),
            _ => Err(Error::Config(format!("{KERNELS_ENV}={v:?} is not one of auto, prebuilt, nvrtc"))),
        }
    }

    pub fn from_env() -> Result<KernelSource> {
        KernelSource::resolve(&|k| std::env::var_os(k))
    }
}

/// Whether NVRTC compiles the kernels with line info (`-lineinfo`, for profilers and
/// compute-sanitizer to show source lines): `RSCCL_KERNEL_LINEINFO`, a process-wide choice
/// like `RSCCL_KERNELS`. Off by default: line info makes the image 3x larger (20.9 against
/// 7.0 MB, measured on sm_90) and slower to load. Part of the kernel cache's key.
pub const KERNEL_LINEINFO_ENV: &str = "RSCCL_KERNEL_LINEINFO";

/// `RSCCL_KERNEL_LINEINFO` as `env` reads it: unset, empty or 0: no line info; 1: line
/// info; anything else (a value that is not UTF-8 included: `env` gives it as Err) is
/// rejected, naming the variable.
pub fn kernel_lineinfo(env: &dyn Fn(&str) -> Option<std::result::Result<String, std::ffi::OsString>>) -> Result<bool> {
    match env(KERNEL_LINEINFO_ENV) {
        None => Ok(false),
        Some(Ok(v)) => match v.trim() {
            "" | "0" => Ok(false),
            "1" => Ok(true),
            _ => Err(Error::Config(format!("{KERNEL_LINEINFO_ENV}={v:?} is not 0 or 1"))),
        },
        Some(Err(raw)) => Err(Error::Config(format!("{KERNEL_LINEINFO_ENV}={raw:?} is not valid UTF-8 (and not 0 or 1)"))),
    }
}

/// `kernel_lineinfo` of the process environment.
pub fn kernel_lineinfo_from_env() -> Result<bool> {
    kernel_lineinfo(&|k| match std::env::var(k) {
        Ok(v) => Some(Ok(v)),
        Err(std::env::VarError::NotPresent) => None,
        Err(std::env::VarError::NotUnicode(raw)) => Some(Err(raw)),
    })
}

/// Where NVRTC-compiled kernels are cached: `$RSCCL_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/rsccl`, else `~/.cache/rsccl`.
pub fn kernel_cache_dir(env: &dyn Fn(&str) -> Option<std::ffi::OsString>) -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    if let Some(d) = env("RSCCL_CACHE_DIR").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = env("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d).join("rsccl"));
    }
    env("HOME").map(|h| PathBuf::from(h).join(".cache").join("rsccl"))
}

/// Resolved configuration of one group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub host_buffer_bytes: usize,
    pub p2p_buffer_bytes: usize,
    pub max_region_bytes: usize,
    pub allreduce_one_shot_max_bytes: usize,
    pub spin_count: u32,
    pub cuda_buffer_bytes: usize,
    pub cuda_blocks: u32,
    pub cuda_allreduce_one_shot_max_bytes: usize,
    /// all_reduce, reduce_scatter, all_gather up to this many bytes per rank on the
    /// low-latency kernels; 0: never (decide::kernel).
    pub cuda_low_latency_max_bytes: usize,
    /// all_gather, reduce_scatter, broadcast, send/recv from this many bytes on the copy
    /// engines; 0: never (decide::copy_engine).
    pub cuda_copy_engine_min_bytes: u64,
    /// reduce_scatter and two-shot all_reduce from this many bytes on the ring schedule;
    /// 0: never (decide::ring).
    pub cuda_ring_min_bytes: u64,
    pub max_cuda_va_bytes: usize,
    pub cuda_warmup: bool,
    pub cuda_sync_stream: bool,
    pub allow_shared_gpu: bool,
    pub cuda_pool_bytes: usize,
    pub cuda_inplace_min_bytes: usize,
    pub cuda_p2p_bytes: usize,
    pub cuda_p2p_blocks: u32,
    /// A failure on the GPU ends the process (CUDA engine, after creation).
    pub cuda_error_teardown: bool,
    /// None: NCCL's default (the setting's 0).
    pub nccl_max_ctas: Option<i32>,
    /// None: NCCL's default (the setting's 0).
    pub nccl_p2p_max_ctas: Option<i32>,
    pub nccl_hierarchical_min_bytes: u64,
    pub nccl_hierarchical_scratch_bytes: u64,
    /// Pair communicators for CUDA send/recv across hosts (docs/multihost.md).
    pub nccl_p2p: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config::resolve(&[], &|_| None).expect("defaults are valid")
    }
}

/// Parse "4194304", "4MiB", "4M", "512KiB", "1GiB" (binary units; case-insensitive).
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits_end == 0 {
        return None;
    }
    let n: u64 = t[..digits_end].parse().ok()?;
    let unit = t[digits_end..].trim().to_ascii_lowercase();
    let mult = match unit.as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => KIB,
        "m" | "mb" | "mib" => MIB,
        "g" | "gb" | "gib" => GIB,
        _ => return None,
    };
    n.checked_mul(mult)
}

fn parse_value(s: &Setting, raw: &str, source: &str) -> Result<u64> {
    let parsed = if s.is_size { parse_size(raw) } else { raw.trim().parse::<u64>().ok() };
    let v = parsed.ok_or_else(|| {
        Error::Config(format!(
            "{source} = {raw:?} is not {}",
            if s.is_size { "a size (e.g. 4194304, 4MiB, 512KiB)" } else { "a non-negative integer" }
        ))
    })?;
    if v < s.min || v > s.max {
        return Err(Error::Config(format!("{source} = {raw:?} is out of range [{}, {}]", s.min, s.max)));
    }
    Ok(v)
}

impl Config {
    /// Every setting's value, checked, in the table's order, by field: from `overrides`
    /// ((Options field, value) pairs), else `env` (looks up a variable), else the default.
    pub fn resolve_values(overrides: &[(String, String)], env: EnvLookup) -> Result<Vec<(&'static str, u64)>> {
        for (k, _) in overrides {
            if !SETTINGS.iter().any(|s| s.field == k) {
                return Err(Error::Config(format!(
                    "rsccl.Options has no field {k:?}; fields: {}",
                    SETTINGS.iter().map(|s| s.field).collect::<Vec<_>>().join(", ")
                )));
            }
        }
        let mut values = Vec::with_capacity(SETTINGS.len());
        for s in SETTINGS {
            let v = if let Some((_, raw)) = overrides.iter().find(|(k, _)| k == s.field) {
                parse_value(s, raw, &format!("rsccl.Options.{}", s.field))?
            } else if let Some(raw) = env(s.env) {
                parse_value(s, env_text(s.env, &raw)?, s.env)?
            } else {
                s.default
            };
            values.push((s.field, v));
        }
        Ok(values)
    }

    /// `overrides` are (Options field, value) pairs; `env` looks up a variable.
    pub fn resolve(overrides: &[(String, String)], env: EnvLookup) -> Result<Config> {
        let values = Config::resolve_values(overrides, env)?;
        // By name, so the table's order is free.
        let v = |field: &str| values.iter().find(|(f, _)| *f == field).expect("a known setting").1;
        let cfg = Config {
            host_buffer_bytes: v("host_buffer_bytes") as usize,
            p2p_buffer_bytes: v("p2p_buffer_bytes") as usize,
            max_region_bytes: v("max_region_bytes") as usize,
            allreduce_one_shot_max_bytes: v("allreduce_one_shot_max_bytes") as usize,
            spin_count: v("spin_count") as u32,
            cuda_buffer_bytes: v("cuda_buffer_bytes") as usize,
            cuda_blocks: v("cuda_blocks") as u32,
            cuda_allreduce_one_shot_max_bytes: v("cuda_allreduce_one_shot_max_bytes") as usize,
            cuda_low_latency_max_bytes: v("cuda_low_latency_max_bytes") as usize,
            cuda_copy_engine_min_bytes: v("cuda_copy_engine_min_bytes"),
            cuda_ring_min_bytes: v("cuda_ring_min_bytes"),
            max_cuda_va_bytes: v("max_cuda_va_bytes") as usize,
            cuda_warmup: v("cuda_warmup") != 0,
            cuda_sync_stream: v("cuda_sync_stream") != 0,
            allow_shared_gpu: v("allow_shared_gpu") != 0,
            cuda_pool_bytes: v("cuda_pool_bytes") as usize,
            cuda_inplace_min_bytes: v("cuda_inplace_min_bytes") as usize,
            cuda_p2p_bytes: v("cuda_p2p_bytes") as usize,
            cuda_p2p_blocks: v("cuda_p2p_blocks") as u32,
            cuda_error_teardown: v("cuda_error_teardown") != 0,
            nccl_max_ctas: Some(v("nccl_max_ctas") as i32).filter(|&n| n > 0),
            nccl_p2p_max_ctas: Some(v("nccl_p2p_max_ctas") as i32).filter(|&n| n > 0),
            nccl_hierarchical_min_bytes: v("nccl_hierarchical_min_bytes"),
            nccl_hierarchical_scratch_bytes: v("nccl_hierarchical_scratch_bytes"),
            nccl_p2p: v("nccl_p2p") != 0,
        };
        Ok(cfg)
    }

    /// Read the process environment.
    pub fn from_env(overrides: &[(String, String)]) -> Result<Config> {
        Config::resolve(overrides, &|k| std::env::var_os(k))
    }

    /// The settings every rank of a group must share, with their names (spin_count, the
    /// caps and the stream choice are local behaviour and may differ).
    pub fn layout_settings(&self) -> (Vec<u64>, Vec<(&'static str, &'static str)>) {
        let shared = [
            ("host_buffer_bytes", self.host_buffer_bytes as u64),
            ("p2p_buffer_bytes", self.p2p_buffer_bytes as u64),
            ("max_region_bytes", self.max_region_bytes as u64),
            ("allreduce_one_shot_max_bytes", self.allreduce_one_shot_max_bytes as u64),
            ("cuda_buffer_bytes", self.cuda_buffer_bytes as u64),
            ("cuda_blocks", self.cuda_blocks as u64),
            ("cuda_allreduce_one_shot_max_bytes", self.cuda_allreduce_one_shot_max_bytes as u64),
            // Every rank must run the same kernel (low-latency or not) for the same call.
            ("cuda_low_latency_max_bytes", self.cuda_low_latency_max_bytes as u64),
            // Every rank must take the same path (kernel or copy engines) for the same call.
            ("cuda_copy_engine_min_bytes", self.cuda_copy_engine_min_bytes),
            // Every rank must take the same schedule (ring or direct) for the same call.
            ("cuda_ring_min_bytes", self.cuda_ring_min_bytes),
            // The warm-up launches kernels on every rank: a collective.
            ("cuda_warmup", self.cuda_warmup as u64),
            // Every rank must accept (or refuse) the same sharing of GPUs.
            ("allow_shared_gpu", self.allow_shared_gpu as u64),
            // Pools map one another's memory, and ranks must agree on when to run in place.
            ("cuda_pool_bytes", self.cuda_pool_bytes as u64),
            ("cuda_inplace_min_bytes", self.cuda_inplace_min_bytes as u64),
            // The inbox layout (peer slots x blocks x chunk) must be the same on every rank.
            ("cuda_p2p_bytes", self.cuda_p2p_bytes as u64),
            ("cuda_p2p_blocks", self.cuda_p2p_blocks as u64),
            // Communicators must be created alike, and every rank must take the same path
            // (flat or hierarchical) for the same call.
            ("nccl_max_ctas", self.nccl_max_ctas.unwrap_or(0) as u64),
            ("nccl_p2p_max_ctas", self.nccl_p2p_max_ctas.unwrap_or(0) as u64),
            ("nccl_hierarchical_min_bytes", self.nccl_hierarchical_min_bytes),
            // Whether a reduce_scatter fits the scratch decides its path.
            ("nccl_hierarchical_scratch_bytes", self.nccl_hierarchical_scratch_bytes),
            // The pair communicators are split from the flat one: a collective call.
            ("nccl_p2p", self.nccl_p2p as u64),
        ];
        let names = shared
            .iter()
            .map(|(f, _)| SETTINGS.iter().find(|s| s.field == *f).map(|s| (s.field, s.env)).expect("a known setting"))
            .collect();
        (shared.iter().map(|(_, v)| *v).collect(), names)
    }

    /// Bytes of one half of a rank's collective staging (the other half is double-buffered).
    pub fn coll_half_bytes(&self) -> usize {
        // Halves stay a multiple of 4 KiB so every slot starts on its own page.
        (self.host_buffer_bytes / 2) & !4095
    }

    pub fn p2p_half_bytes(&self) -> usize {
        (self.p2p_buffer_bytes / 2) & !4095
    }
}

#[cfg(test)]
mod tests;
