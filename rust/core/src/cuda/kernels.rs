//! rsccl's kernels (csrc_kernels/): one CUDA module per family (a .cu file each, sharing
//! protocol.cuh and common.cuh), loaded once per group and looked up once. Nothing is
//! compiled on a collective's path.
//!
//! Where the code comes from (`RSCCL_KERNELS`, config::KernelSource):
//! - prebuilt: the fat binaries build.rs made with nvcc when the wheel was built (the
//!   `prebuilt-kernels` feature), embedded in the extension: SASS for sm_80, sm_90, sm_100
//!   and sm_120 and PTX of compute_120. The driver picks the GPU's code (cuModuleLoadData);
//!   `pick` checks first that there is some, so an uncovered GPU gets a sentence, not
//!   CUDA_ERROR_NO_BINARY_FOR_GPU.
//! - NVRTC: compiled for the GPU's arch at group creation, the families in parallel threads,
//!   cached on disk. One process per host compiles (a file lock beside the cache files);
//!   the others wait for its files.
//!
//! `auto` takes the prebuilt code when it covers the GPU and loads, else NVRTC.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use cudarc::driver::sys as cu;
use cudarc::nvrtc::sys as nv;

use super::driver::{check, Device, Function, Module};
use crate::config::KernelSource;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// The headers every family includes, by the name its `#include` uses.
pub const HEADERS: [(&str, &str); 2] = [
    ("protocol.cuh", include_str!("../../../../csrc_kernels/protocol.cuh")),
    ("common.cuh", include_str!("../../../../csrc_kernels/common.cuh")),
];

/// The families: module name (csrc_kernels/<name>.cu) and source. Largest first: NVRTC
/// starts the longest compilations first.
pub const MODULES: [(&str, &str); 7] = [
    ("all_reduce", include_str!("../../../../csrc_kernels/all_reduce.cu")),
    ("reduce_scatter", include_str!("../../../../csrc_kernels/reduce_scatter.cu")),
    ("rooted", include_str!("../../../../csrc_kernels/rooted.cu")),
    ("all_gather", include_str!("../../../../csrc_kernels/all_gather.cu")),
    ("all_to_all", include_str!("../../../../csrc_kernels/all_to_all.cu")),
    ("send_recv", include_str!("../../../../csrc_kernels/send_recv.cu")),
    ("barrier", include_str!("../../../../csrc_kernels/barrier.cu")),
];

/// Every kernel source file, concatenated: for tests that check the Rust mirrors of the
/// source's structs and constants.
pub const SOURCE: &str = concat!(
    include_str!("../../../../csrc_kernels/protocol.cuh"),
    include_str!("../../../../csrc_kernels/common.cuh"),
    include_str!("../../../../csrc_kernels/all_reduce.cu"),
    include_str!("../../../../csrc_kernels/reduce_scatter.cu"),
    include_str!("../../../../csrc_kernels/rooted.cu"),
    include_str!("../../../../csrc_kernels/all_gather.cu"),
    include_str!("../../../../csrc_kernels/all_to_all.cu"),
    include_str!("../../../../csrc_kernels/send_recv.cu"),
    include_str!("../../../../csrc_kernels/barrier.cu"),
);

/// What build.rs embedded: `IMAGES` (module name, fat binary), empty when built without
/// the `prebuilt-kernels` feature; `NVCC` (the compiler's version) and `TARGETS`.
mod prebuilt {
    include!(concat!(env!("OUT_DIR"), "/prebuilt_kernels.rs"));
}

/// Threads per block of every kernel (the source's __launch_bounds__).
pub const THREADS: u32 = 512;
/// Offsets inside a rank's block (the source's layout constants).
pub const STAGE_OFF: usize = 262144;
/// {in-place collectives, their bytes, all collectives, their bytes}: u64 counters this
/// rank's kernels keep (memory_stats).
pub const STATS_OFF: usize = 4096;
/// 1 + the local index of a rank that stopped the group, 0 = none: read by this rank's
/// kernels, written by a failing peer (its kernels, or its host: CudaEngine::abort_group).
pub const POISON_OFF: usize = STATS_OFF + 256;
pub const MAX_RANKS: usize = 16;
pub const MAX_BLOCKS: u32 = 64;

/// The kernel families with a dtype x op instantiation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    OneShot,
    TwoShot,
    ReduceScatter,
    /// reduce to a root
    Reduce,
}

pub const FAMILIES: [Family; 4] = [Family::OneShot, Family::TwoShot, Family::ReduceScatter, Family::Reduce];

impl Family {
    fn prefix(self) -> &'static str {
        match self {
            Family::OneShot => "rs_ar_oneshot",
            Family::TwoShot => "rs_ar_twoshot",
            Family::ReduceScatter => "rs_reduce_scatter",
            Family::Reduce => "rs_reduce_root",
        }
    }

    /// The module (csrc_kernels/<module>.cu) that holds the family's entry points.
    fn module(self) -> &'static str {
        match self {
            Family::OneShot | Family::TwoShot => "all_reduce",
            Family::ReduceScatter => "reduce_scatter",
            Family::Reduce => "rooted",
        }
    }
}

pub const REDUCE_DTYPES: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64];
pub const REDUCE_OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max];

/// The kernels without a dtype x op matrix: (module, entry point).
pub const PLAIN_KERNELS: [(&str, &str); 8] = [
    ("all_gather", "rs_all_gather"),
    ("rooted", "rs_broadcast"),
    ("rooted", "rs_gather"),
    ("rooted", "rs_scatter"),
    ("all_to_all", "rs_all_to_all"),
    ("send_recv", "rs_send"),
    ("send_recv", "rs_recv"),
    ("barrier", "rs_barrier"),
];

fn dtype_tag(d: DType) -> Option<&'static str> {
    Some(match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I32 => "i32",
        DType::I64 => "i64",
        _ => return None,
    })
}

fn op_tag(o: ReduceOp) -> Option<&'static str> {
    Some(match o {
        ReduceOp::Sum => "sum",
        ReduceOp::Avg => "avg",
        ReduceOp::Product => "prod",
        ReduceOp::Min => "min",
        ReduceOp::Max => "max",
        _ => return None,
    })
}

/// The entry point's name, or None if rsccl's CUDA kernels do not reduce this combination
/// (AVG is defined on floating types only: ReduceOp::check rejects it on integers before
/// any launch, so the source has no integer AVG entry points).
pub fn kernel_name(f: Family, d: DType, o: ReduceOp) -> Option<String> {
    if o == ReduceOp::Avg && !d.is_float() {
        return None;
    }
    Some(format!("{}_{}_{}", f.prefix(), dtype_tag(d)?, op_tag(o)?))
}

/// Every entry point the loader looks up, with its module.
pub fn required_kernels() -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = PLAIN_KERNELS.iter().map(|(m, k)| (*m, k.to_string())).collect();
    for f in FAMILIES {
        for d in REDUCE_DTYPES {
            for o in REDUCE_OPS {
                if let Some(name) = kernel_name(f, d, o) {
                    out.push((f.module(), name));
                }
            }
        }
    }
    out
}

// -- The fat binary ------------------------------------------------------------------------

/// One image of a fat binary: SASS (an ELF cubin) for `sm_<arch>`, or PTX for
/// `compute_<arch>` (arch 90 = 9.0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FatEntry {
    pub ptx: bool,
    pub arch: u32,
    /// Bytes of the payload (as stored: PTX may be compressed).
    pub bytes: usize,
}

impl FatEntry {
    pub fn name(&self) -> String {
        format!("{}_{}", if self.ptx { "compute" } else { "sm" }, self.arch)
    }
}

const FATBIN_MAGIC: u32 = 0xBA55_ED50;

/// The entries of a fat binary as the `fatbinary` tool writes it: a 16-byte header
/// {u32 magic, u16 version, u16 header size, u64 size of the entries}, then entries, each
/// {u16 kind (1 PTX, 2 ELF), u16, u32 header size, u64 payload size, ..., u32 arch at +28}
/// followed by its payload. Several fat binaries may follow each other.
pub fn fatbin_entries(data: &[u8]) -> Result<Vec<FatEntry>> {
    let bad = |what: &str| Error::Internal(format!("rsccl's embedded fat binary is malformed: {what}"));
    let u16_at = |p: usize| data.get(p..p + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let u32_at = |p: usize| data.get(p..p + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()));
    let u64_at = |p: usize| data.get(p..p + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize);
    let mut out = Vec::new();
    let mut pos = 0;
    while pos + 16 <= data.len() {
        if u32_at(pos) != Some(FATBIN_MAGIC) {
            return Err(bad(&format!("no magic at offset {pos}")));
        }
        let hsize = u16_at(pos + 6).ok_or_else(|| bad("short header"))?;
        let size = u64_at(pos + 8).ok_or_else(|| bad("short header"))?;
        let (mut p, end) = (pos + hsize, pos + hsize + size);
        if end > data.len() {
            return Err(bad("entries run past the end"));
        }
        while p < end {
            let kind = u16_at(p).ok_or_else(|| bad("short entry"))?;
            let ehsize = u32_at(p + 4).ok_or_else(|| bad("short entry"))? as usize;
            let bytes = u64_at(p + 8).ok_or_else(|| bad("short entry"))?;
            let arch = u32_at(p + 28).ok_or_else(|| bad("short entry"))?;
            if !(kind == 1 || kind == 2) || ehsize < 32 {
                return Err(bad(&format!("entry of kind {kind} at offset {p}")));
            }
            out.push(FatEntry { ptx: kind == 1, arch, bytes });
            p += ehsize + bytes;
        }
        pos = end;
    }
    Ok(out)
}

/// What the driver runs on a GPU of compute capability `cc` (90 = 9.0) from `entries`:
/// SASS of the same major version and a minor version no higher (the newest such), else
/// PTX of an arch no higher (the newest), JIT-compiled at load; None: nothing runs there.
pub fn pick(entries: &[FatEntry], cc: u32) -> Option<FatEntry> {
    let sass = entries.iter().filter(|e| !e.ptx && e.arch / 10 == cc / 10 && e.arch <= cc).max_by_key(|e| e.arch);
    let ptx = || entries.iter().filter(|e| e.ptx && e.arch <= cc).max_by_key(|e| e.arch);
    sass.or_else(ptx).copied()
}

/// The fat binaries built into this build (empty without the `prebuilt-kernels` feature).
pub fn prebuilt_images() -> &'static [(&'static str, &'static [u8])] {
    prebuilt::IMAGES
}

/// The version of the nvcc that built them ("" if none).
pub fn prebuilt_nvcc() -> &'static str {
    prebuilt::NVCC
}

/// The archs of the prebuilt code: (SASS archs, PTX archs), taken from the images.
pub fn prebuilt_archs() -> Result<(Vec<u32>, Vec<u32>)> {
    let mut sass = Vec::new();
    let mut ptx = Vec::new();
    for (_, img) in prebuilt_images() {
        for e in fatbin_entries(img)? {
            let v = if e.ptx { &mut ptx } else { &mut sass };
            if !v.contains(&e.arch) {
                v.push(e.arch);
            }
        }
    }
    sass.sort_unstable();
    ptx.sort_unstable();
    Ok((sass, ptx))
}

fn arch_list(archs: &[u32], prefix: &str) -> String {
    archs.iter().map(|a| format!("{prefix}_{a}")).collect::<Vec<_>>().join(", ")
}

/// Whether the prebuilt code runs on compute capability `cc`: Ok((what runs, bytes of the
/// device code that loads: the picked SASS of every module)), or Err(why not), a sentence.
pub fn prebuilt_coverage(cc: u32) -> std::result::Result<(String, usize), String> {
    if prebuilt_images().is_empty() {
        return Err("this build of rsccl has no prebuilt kernels (built without nvcc: the `prebuilt-kernels` feature was off)".into());
    }
    let mut bytes = 0;
    let mut what = String::new();
    for (module, img) in prebuilt_images() {
        let entries = fatbin_entries(img).map_err(|e| e.to_string())?;
        match pick(&entries, cc) {
            Some(e) => {
                bytes += e.bytes;
                what = if e.ptx { format!("{} PTX, compiled by the driver at load", e.name()) } else { format!("{} SASS", e.name()) };
            }
            None => {
                let (sass, ptx) = prebuilt_archs().map_err(|e| e.to_string())?;
                return Err(format!(
                    "rsccl's prebuilt kernels hold no code for sm_{cc} (module {module}: SASS for {}, PTX for {})",
                    arch_list(&sass, "sm"),
                    arch_list(&ptx, "compute")
                ));
            }
        }
    }
    Ok((what, bytes))
}

/// The build's targets ("sm_80", ..., "compute_120"): what build.rs was asked to embed.
pub fn prebuilt_targets() -> &'static [&'static str] {
    prebuilt::TARGETS
}

/// Where a GPU of compute capability `cc` (90 = 9.0) gets its kernels under the current
/// `RSCCL_KERNELS` (what `Kernels::load` does, before it tries to load): ("prebuilt", what
/// runs, device code bytes) or ("nvrtc", why, 0). An error where no source is allowed.
pub fn choice(cc: u32) -> Result<(&'static str, String, usize)> {
    match KernelSource::from_env()? {
        KernelSource::Nvrtc => Ok(("nvrtc", "RSCCL_KERNELS=nvrtc".into(), 0)),
        source => match prebuilt_coverage(cc) {
            Ok((what, bytes)) => Ok(("prebuilt", what, bytes)),
            Err(why) if source == KernelSource::Auto => Ok(("nvrtc", why, 0)),
            Err(why) => Err(Error::Cuda(format!("{why}; RSCCL_KERNELS=prebuilt forbids compiling them with NVRTC (use auto or nvrtc)"))),
        },
    }
}

// -- NVRTC ----------------------------------------------------------------------------------

fn nvrtc_check(r: nv::nvrtcResult, what: &str) -> Result<()> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: returns a pointer to a static string.
    let s = unsafe { CStr::from_ptr(nv::nvrtcGetErrorString(r)) }.to_string_lossy().into_owned();
    Err(Error::Cuda(format!("{what} failed: {s}")))
}

fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut a, mut b) = (0, 0);
    // SAFETY: out-pointers to locals.
    nvrtc_check(unsafe { nv::nvrtcVersion(&mut a, &mut b) }, "nvrtcVersion")?;
    Ok((a, b))
}

fn options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "-default-device".into(), "--std=c++17".into(), "-lineinfo".into()]
}

fn nvrtc_present() -> Result<()> {
    // SAFETY: only tries to dlopen NVRTC by its usual names.
    if !unsafe { nv::is_culib_present() } {
        return Err(Error::Cuda("NVRTC (libnvrtc.so.13) is not loadable: rsccl finds it in torch's nvidia-cuda-nvrtc package".into()));
    }
    Ok(())
}

/// Compile one module (`name`, `source`) for `arch` ("sm_90") to a cubin. Needs libnvrtc
/// (loaded by the Python layer from torch's CUDA packages), not a GPU.
pub fn compile_module(name: &str, source: &str, arch: &str) -> Result<Vec<u8>> {
    nvrtc_present()?;
    let src = CString::new(source).map_err(|_| Error::Internal("kernel source has a NUL".into()))?;
    let file = CString::new(format!("{name}.cu")).unwrap();
    let hnames: Vec<CString> = HEADERS.iter().map(|h| CString::new(h.0).unwrap()).collect();
    let hsrcs: Vec<CString> = HEADERS.iter().map(|h| CString::new(h.1).unwrap()).collect();
    let hname_ptrs: Vec<*const std::ffi::c_char> = hnames.iter().map(|h| h.as_ptr()).collect();
    let hsrc_ptrs: Vec<*const std::ffi::c_char> = hsrcs.iter().map(|h| h.as_ptr()).collect();
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid NUL-terminated strings; the header arrays have HEADERS.len() entries
    // and outlive the call.
    nvrtc_check(
        unsafe {
            nv::nvrtcCreateProgram(&mut prog, src.as_ptr(), file.as_ptr(), HEADERS.len() as i32, hsrc_ptrs.as_ptr(), hname_ptrs.as_ptr())
        },
        "nvrtcCreateProgram",
    )?;
    struct Prog(nv::nvrtcProgram);
    impl Drop for Prog {
        fn drop(&mut self) {
            // SAFETY: destroys the program created above exactly once.
            unsafe { nv::nvrtcDestroyProgram(&mut self.0) };
        }
    }
    let prog = Prog(prog);
    let opts: Vec<CString> = options(arch).into_iter().map(|o| CString::new(o).unwrap()).collect();
    let ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `ptrs` holds valid C strings that outlive the call.
    let r = unsafe { nv::nvrtcCompileProgram(prog.0, ptrs.len() as i32, ptrs.as_ptr()) };
    if r != nv::nvrtcResult::NVRTC_SUCCESS {
        let mut n = 0usize;
        // SAFETY: out-pointer; then a buffer of the reported size.
        unsafe { nv::nvrtcGetProgramLogSize(prog.0, &mut n) };
        let mut log = vec![0u8; n.max(1)];
        // SAFETY: `log` has the size NVRTC asked for.
        unsafe { nv::nvrtcGetProgramLog(prog.0, log.as_mut_ptr() as *mut std::ffi::c_char) };
        let text = String::from_utf8_lossy(&log).trim_end_matches('\0').to_string();
        return Err(Error::Cuda(format!("compiling rsccl's kernels ({name}.cu) for {arch} failed:\n{text}")));
    }
    let mut n = 0usize;
    // SAFETY: out-pointer to a local.
    nvrtc_check(unsafe { nv::nvrtcGetCUBINSize(prog.0, &mut n) }, "nvrtcGetCUBINSize")?;
    let mut cubin = vec![0u8; n];
    // SAFETY: `cubin` has the size NVRTC reported.
    nvrtc_check(unsafe { nv::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut std::ffi::c_char) }, "nvrtcGetCUBIN")?;
    Ok(cubin)
}

/// Compile every module for `arch`, in parallel (one thread per module, at most the
/// machine's cores at once, the largest first): (module, cubin) in MODULES order.
pub fn compile(arch: &str) -> Result<Vec<(&'static str, Vec<u8>)>> {
    nvrtc_present()?;
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(MODULES.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done = parking_lot::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((name, src)) = MODULES.get(i) else { break };
                let r = compile_module(name, src, arch);
                done.lock().push((i, r));
            });
        }
    });
    let mut done = done.into_inner();
    done.sort_by_key(|d| d.0);
    done.into_iter().map(|(i, r)| r.map(|c| (MODULES[i].0, c))).collect()
}

/// FNV-1a: a stable hash for the cache key (no new dependency for one checksum).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for b in *p {
            h ^= *b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// Where compiled kernels are cached (config::kernel_cache_dir).
pub fn cache_dir() -> Option<PathBuf> {
    crate::config::kernel_cache_dir(&|k| std::env::var_os(k))
}

/// The hash naming `arch`'s cache files: every source, NVRTC's version and the options.
fn cache_key(arch: &str) -> Result<u64> {
    let (ma, mi) = nvrtc_version()?;
    let opts = options(arch).join(" ");
    let mut parts: Vec<&[u8]> = vec![arch.as_bytes(), opts.as_bytes()];
    let (ma, mi) = (ma.to_le_bytes(), mi.to_le_bytes());
    parts.extend([&ma[..], &mi[..]]);
    parts.extend(HEADERS.iter().chain(MODULES.iter()).flat_map(|(n, s)| [n.as_bytes(), s.as_bytes()]));
    Ok(fnv1a(&parts))
}

/// The cache file of `module` for `arch`, in `dir`.
fn cache_file(dir: &Path, key: u64, module: &str, arch: &str) -> PathBuf {
    dir.join(format!("kernels-{key:016x}-{module}-{arch}.cubin"))
}

/// The cache files of `arch`'s kernels, one per module (None if there is no cache
/// directory).
pub fn cache_paths(arch: &str) -> Result<Option<Vec<PathBuf>>> {
    let key = cache_key(arch)?;
    Ok(cache_dir().map(|d| MODULES.iter().map(|(m, _)| cache_file(&d, key, m, arch)).collect()))
}

/// Every module's cubin from the cache, or None if any is missing.
fn read_cached(dir: &Path, key: u64, arch: &str) -> Option<Vec<(&'static str, Vec<u8>)>> {
    MODULES.iter().map(|(m, _)| std::fs::read(cache_file(dir, key, m, arch)).ok().filter(|b| !b.is_empty()).map(|b| (*m, b))).collect()
}

/// An exclusive flock on `path`, held until the file is dropped (and released by the
/// kernel if the process dies): one process per host compiles a set of kernels.
fn lock_file(path: &Path, arch: &str) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| Error::os(format!("opening {}", path.display()), e))?;
    let lock = |how: i32| loop {
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(f.as_raw_fd(), how) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    match lock(libc::LOCK_EX | libc::LOCK_NB) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
            tracing::info!(arch, lock = %path.display(), "rsccl: another process of this host compiles the kernels; waiting for its files");
            lock(libc::LOCK_EX).map_err(|e| Error::os(format!("locking {}", path.display()), e))?;
        }
        Err(e) => return Err(Error::os(format!("locking {}", path.display()), e)),
    }
    Ok(f)
}

/// The cubins of `arch`'s modules, from the disk cache or compiled with NVRTC (then cached:
/// each written to a temporary name and renamed, so no process reads a partial file).
/// Compilation happens under the lock file `kernels-<key>-<arch>.lock` of the cache
/// directory: the first process compiles, the others wait for the lock and then read its
/// files. Returns the cubins and whether they came from the cache.
/// Each family's name and cubin.
pub type Cubins = Vec<(&'static str, Vec<u8>)>;

pub fn cubin_for(arch: &str) -> Result<(Cubins, bool)> {
    let key = cache_key(arch)?;
    let Some(dir) = cache_dir() else {
        return Ok((compile_logged(arch)?, false));
    };
    if let Some(c) = read_cached(&dir, key, arch) {
        return Ok((c, true));
    }
    if let Err(e) = std::fs::create_dir_all(&dir) {
        tracing::warn!(dir = %dir.display(), error = %e, "rsccl: cannot create the kernel cache directory; compiling without a cache");
        return Ok((compile_logged(arch)?, false));
    }
    let _lock = match lock_file(&dir.join(format!("kernels-{key:016x}-{arch}.lock")), arch) {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!(error = %e, "rsccl: cannot lock the kernel cache; compiling without waiting for other processes");
            None
        }
    };
    // Another process may have compiled them while this one waited.
    if let Some(c) = read_cached(&dir, key, arch) {
        return Ok((c, true));
    }
    let cubins = compile_logged(arch)?;
    for (m, cubin) in &cubins {
        let p = cache_file(&dir, key, m, arch);
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, cubin).and_then(|_| std::fs::rename(&tmp, &p)).is_err() {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(path = %p.display(), "rsccl: could not cache compiled kernels");
        }
    }
    Ok((cubins, false))
}

fn compile_logged(arch: &str) -> Result<Vec<(&'static str, Vec<u8>)>> {
    let t = std::time::Instant::now();
    let cubins = compile(arch)?;
    let bytes: usize = cubins.iter().map(|c| c.1.len()).sum();
    tracing::info!(arch, ms = t.elapsed().as_millis() as u64, bytes, "rsccl: compiled the kernels with NVRTC");
    Ok(cubins)
}

// -- Loading ----------------------------------------------------------------------------------

/// Where a group's kernels came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The fat binary built into the wheel; what the driver runs ("sm_90 SASS").
    Prebuilt(String),
    /// NVRTC, for this arch; `cached`: read from the disk cache.
    Nvrtc { arch: String, cached: bool },
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Prebuilt(what) => write!(f, "prebuilt ({what}, nvcc {})", prebuilt_nvcc()),
            Origin::Nvrtc { arch, cached: true } => write!(f, "NVRTC for {arch}, from the disk cache"),
            Origin::Nvrtc { arch, cached: false } => write!(f, "NVRTC for {arch}, compiled now"),
        }
    }
}

/// Loaded modules, unloaded on drop (also when a later load or lookup fails: `Module`).
struct Modules(Vec<(&'static str, Module)>);

impl Modules {
    /// Load every image; the caller made the device's context current.
    fn load(images: &[(&'static str, &[u8])]) -> Result<Modules> {
        let mut out = Modules(Vec::new());
        for (name, img) in images {
            // The driver reads the image's headers as 8-byte words; include_bytes! data is
            // only byte-aligned, so an unaligned image is loaded from an aligned copy.
            let copy: Vec<u64>;
            let ptr = if img.as_ptr() as usize % 8 == 0 {
                img.as_ptr() as *const std::ffi::c_void
            } else {
                let mut words = vec![0u64; img.len().div_ceil(8)];
                // SAFETY: `words` holds at least img.len() bytes; the two do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(img.as_ptr(), words.as_mut_ptr() as *mut u8, img.len()) };
                copy = words;
                copy.as_ptr() as *const std::ffi::c_void
            };
            // SAFETY: `ptr` is a complete cubin or fat binary (NVRTC's or build.rs's), 8-byte
            // aligned and alive during the call; the driver copies what it loads.
            let module = unsafe { Module::load(ptr, &format!("cuModuleLoadData({name})")) }?;
            out.0.push((name, module));
        }
        Ok(out)
    }

    fn get(&self, module: &str, name: &str) -> Result<Function> {
        let m = &self.0.iter().find(|m| m.0 == module).ok_or_else(|| Error::Internal(format!("no kernel module {module}")))?.1;
        let c = CString::new(name).unwrap();
        m.function(&c, &format!("cuModuleGetFunction({module}: {name})"))
    }
}

/// The loaded modules and every entry point.
pub struct Kernels {
    _modules: Modules,
    reduce: HashMap<(Family, DType, ReduceOp), Function>,
    pub all_gather: Function,
    pub broadcast: Function,
    pub gather: Function,
    pub scatter: Function,
    pub all_to_all: Function,
    pub send: Function,
    pub recv: Function,
    pub barrier: Function,
    /// Bytes of device code loaded: the picked SASS (or PTX) of every prebuilt module, or
    /// the NVRTC cubins.
    pub cubin_bytes: usize,
    pub origin: Origin,
}

impl Kernels {
    pub fn load(dev: &Device) -> Result<Kernels> {
        let source = KernelSource::from_env()?;
        let arch = dev.arch()?;
        let cc: u32 = arch.trim_start_matches("sm_").parse().map_err(|_| Error::Internal(format!("device arch {arch}")))?;
        let t = std::time::Instant::now();
        let _ctx = dev.bind()?;
        let prebuilt = match source {
            KernelSource::Nvrtc => None,
            KernelSource::Prebuilt | KernelSource::Auto => match prebuilt_coverage(cc) {
                Ok((what, bytes)) => match Modules::load(prebuilt_images()) {
                    Ok(m) => Some((m, Origin::Prebuilt(what), bytes)),
                    Err(e) if source == KernelSource::Auto => {
                        tracing::warn!(arch = %arch, error = %e, "rsccl: the prebuilt kernels did not load; compiling them with NVRTC instead");
                        None
                    }
                    Err(e) => return Err(Error::Cuda(format!("{e} (loading rsccl's prebuilt kernels on {arch}, RSCCL_KERNELS=prebuilt)"))),
                },
                Err(why) if source == KernelSource::Auto => {
                    tracing::warn!(arch = %arch, "rsccl: {why}; compiling them with NVRTC for this GPU (RSCCL_KERNELS=nvrtc skips this check)");
                    None
                }
                Err(why) => {
                    return Err(Error::Cuda(format!("{why}; RSCCL_KERNELS=prebuilt forbids compiling them with NVRTC (use auto or nvrtc)")))
                }
            },
        };
        let (modules, origin, cubin_bytes) = match prebuilt {
            Some(p) => p,
            None => {
                let (cubins, cached) = cubin_for(&arch)?;
                let images: Vec<(&'static str, &[u8])> = cubins.iter().map(|(m, c)| (*m, c.as_slice())).collect();
                let bytes = cubins.iter().map(|c| c.1.len()).sum();
                (Modules::load(&images)?, Origin::Nvrtc { arch: arch.clone(), cached }, bytes)
            }
        };
        let mut reduce = HashMap::new();
        for fam in FAMILIES {
            for d in REDUCE_DTYPES {
                for o in REDUCE_OPS {
                    if let Some(name) = kernel_name(fam, d, o) {
                        reduce.insert((fam, d, o), modules.get(fam.module(), &name)?);
                    }
                }
            }
        }
        let get = |i: usize| modules.get(PLAIN_KERNELS[i].0, PLAIN_KERNELS[i].1);
        let (all_gather, broadcast, gather, scatter) = (get(0)?, get(1)?, get(2)?, get(3)?);
        let (all_to_all, send, recv, barrier) = (get(4)?, get(5)?, get(6)?, get(7)?);
        tracing::info!(arch = %arch, origin = %origin, bytes = cubin_bytes, ms = t.elapsed().as_millis() as u64, "rsccl: kernels loaded");
        Ok(Kernels {
            _modules: modules,
            reduce,
            all_gather,
            broadcast,
            gather,
            scatter,
            all_to_all,
            send,
            recv,
            barrier,
            cubin_bytes,
            origin,
        })
    }

    pub fn reduce(&self, f: Family, d: DType, o: ReduceOp) -> Option<Function> {
        self.reduce.get(&(f, d, o)).copied()
    }

    /// Every collective entry point (not send/recv): what runs on a group's collective grid.
    pub fn collectives(&self) -> impl Iterator<Item = Function> + '_ {
        let plain = [self.all_gather, self.broadcast, self.gather, self.scatter, self.all_to_all, self.barrier];
        self.reduce.values().copied().chain(plain)
    }

    /// The fewest blocks of THREADS threads that any of `funcs` can have resident on one
    /// SM (cuOccupancyMaxActiveBlocksPerMultiprocessor; no dynamic shared memory). Every
    /// block of these kernels then uses at most 1/that of each SM resource, so any that
    /// many blocks of them, whichever kernels they belong to, fit on one SM together.
    pub fn min_blocks_per_sm(funcs: impl IntoIterator<Item = Function>) -> Result<u32> {
        let mut least = u32::MAX;
        for f in funcs {
            let mut n: std::ffi::c_int = 0;
            // SAFETY: out-pointer to a local; `f` is a function of a loaded module; the
            // caller made the module's context current.
            check(
                unsafe { cu::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, f.raw(), THREADS as std::ffi::c_int, 0) },
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            )?;
            least = least.min(n.max(0) as u32);
        }
        Ok(if least == u32::MAX { 0 } else { least })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_point_is_in_its_module() {
        let required = required_kernels();
        // 4 families x (3 float types x 5 ops + 2 integer types x 4 ops) + 8 plain kernels.
        assert_eq!(required.len(), 4 * (3 * 5 + 2 * 4) + 8);
        for (module, name) in &required {
            let src = MODULES.iter().find(|m| m.0 == *module).unwrap_or_else(|| panic!("{module}")).1;
            let plain = format!("void __launch_bounds__(512) {name}(");
            let family = name.rsplitn(3, '_').nth(2).unwrap_or("").trim_start_matches("rs_").to_string();
            assert!(src.contains(&plain) || src.contains(&format!("RS_TYPES({family})")), "{name} in {module}.cu");
        }
        assert!(kernel_name(Family::OneShot, DType::F64, ReduceOp::Sum).is_none());
        assert!(kernel_name(Family::OneShot, DType::F32, ReduceOp::BAnd).is_none());
        assert!(kernel_name(Family::TwoShot, DType::I64, ReduceOp::Avg).is_none());
        assert_eq!(kernel_name(Family::TwoShot, DType::BF16, ReduceOp::Avg).unwrap(), "rs_ar_twoshot_bf16_avg");
    }

    #[test]
    fn modules_are_the_kernel_files() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../csrc_kernels");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|f| f.ends_with(".cu"))
            .map(|f| f.trim_end_matches(".cu").to_string())
            .collect();
        files.sort();
        let mut modules: Vec<String> = MODULES.iter().map(|m| m.0.to_string()).collect();
        modules.sort();
        assert_eq!(files, modules);
        for (_, src) in MODULES {
            assert!(src.contains("#include \"common.cuh\""));
        }
    }

    #[test]
    fn pick_follows_the_driver_rules() {
        let e = |ptx, arch| FatEntry { ptx, arch, bytes: 1 };
        let fat = [e(false, 80), e(false, 90), e(false, 100), e(false, 120), e(true, 120)];
        assert_eq!(pick(&fat, 90), Some(e(false, 90)));
        assert_eq!(pick(&fat, 89), Some(e(false, 80)), "sm_80 SASS runs on 8.9");
        assert_eq!(pick(&fat, 86), Some(e(false, 80)));
        assert_eq!(pick(&fat, 103), Some(e(false, 100)));
        assert_eq!(pick(&fat, 121), Some(e(false, 120)));
        assert_eq!(pick(&fat, 130), Some(e(true, 120)), "a newer GPU JIT-compiles the PTX");
        assert_eq!(pick(&fat, 110), None, "11.0: no SASS of its major, PTX too new");
        assert_eq!(pick(&fat, 75), None);
    }

    #[test]
    fn fatbin_entries_reads_a_synthetic_image() {
        // One fat binary with an ELF for sm_90 (8 bytes) and a PTX for compute_120 (4 bytes).
        let entry = |kind: u16, arch: u32, payload: &[u8]| {
            let mut h = vec![0u8; 64];
            h[0..2].copy_from_slice(&kind.to_le_bytes());
            h[4..8].copy_from_slice(&64u32.to_le_bytes());
            h[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
            h[28..32].copy_from_slice(&arch.to_le_bytes());
            h.extend_from_slice(payload);
            h
        };
        let body: Vec<u8> = [entry(2, 90, b"\x7fELF0123"), entry(1, 120, b"ptx!")].concat();
        let mut img = Vec::new();
        img.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        img.extend_from_slice(&1u16.to_le_bytes());
        img.extend_from_slice(&16u16.to_le_bytes());
        img.extend_from_slice(&(body.len() as u64).to_le_bytes());
        img.extend_from_slice(&body);
        let got = fatbin_entries(&img).unwrap();
        assert_eq!(got, vec![FatEntry { ptx: false, arch: 90, bytes: 8 }, FatEntry { ptx: true, arch: 120, bytes: 4 }]);
        assert!(fatbin_entries(&img[..40]).is_err());
        assert!(fatbin_entries(b"not a fat binary at all").is_err());
    }

    #[test]
    fn prebuilt_images_cover_the_targets_when_built() {
        // With the prebuilt-kernels feature (the wheel), every module has every target.
        for (module, img) in prebuilt_images() {
            let names: Vec<String> = fatbin_entries(img).unwrap().iter().map(|e| e.name()).collect();
            for t in prebuilt::TARGETS {
                assert!(names.iter().any(|n| n == t), "{module}: {t} missing from {names:?}");
            }
        }
    }

    #[test]
    fn the_cache_lock_makes_a_second_process_wait() {
        // flock locks belong to the open file, so two opens in one process exclude each
        // other as two processes' do.
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = std::env::temp_dir().join(format!("rsccl-lock-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kernels-test-sm_90.lock");
        let first = lock_file(&path, "sm_90").unwrap();
        let released = AtomicBool::new(false);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let _second = lock_file(&path, "sm_90").unwrap();
                released.load(Ordering::SeqCst)
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            released.store(true, Ordering::SeqCst);
            drop(first);
            assert!(waiter.join().unwrap(), "the second lock was granted while the first was held");
        });
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cache_key_changes_with_input() {
        assert_ne!(fnv1a(&[b"a", b"b"]), fnv1a(&[b"ab"]));
        assert_eq!(fnv1a(&[b"x"]), fnv1a(&[b"x"]));
    }
}
