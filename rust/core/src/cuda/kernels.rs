//! rsccl's kernels (csrc_kernels/rsccl_kernels.cu): compiled by NVRTC for the device's
//! architecture at group creation, cached on disk, loaded as a module, and looked up once.
//! Nothing is compiled on a collective's path.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::PathBuf;

use cudarc::driver::sys as cu;
use cudarc::nvrtc::sys as nv;

use super::driver::{check, CUfunction, CUmodule, Device};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

pub const SOURCE: &str = include_str!("../../../../csrc_kernels/rsccl_kernels.cu");

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
}

pub const REDUCE_DTYPES: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64];
pub const REDUCE_OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max];

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

/// The entry point's name, or None if rsccl's CUDA kernels do not reduce this combination.
pub fn kernel_name(f: Family, d: DType, o: ReduceOp) -> Option<String> {
    Some(format!("{}_{}_{}", f.prefix(), dtype_tag(d)?, op_tag(o)?))
}

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

/// Compile the kernels for `arch` ("sm_90") to a cubin. Needs libnvrtc (loaded by the
/// Python layer from torch's CUDA packages), not a GPU.
pub fn compile(arch: &str) -> Result<Vec<u8>> {
    // SAFETY: only tries to dlopen NVRTC by its usual names.
    if !unsafe { nv::is_culib_present() } {
        return Err(Error::Cuda(
            "NVRTC (libnvrtc.so.13) is not loadable: rsccl finds it in torch's nvidia-cuda-nvrtc package".into(),
        ));
    }
    let src = CString::new(SOURCE).map_err(|_| Error::Internal("kernel source has a NUL".into()))?;
    let name = CString::new("rsccl_kernels.cu").unwrap();
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid NUL-terminated strings; no headers.
    nvrtc_check(
        unsafe { nv::nvrtcCreateProgram(&mut prog, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null()) },
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
        return Err(Error::Cuda(format!("compiling rsccl's kernels for {arch} failed:\n{text}")));
    }
    let mut n = 0usize;
    // SAFETY: out-pointer to a local.
    nvrtc_check(unsafe { nv::nvrtcGetCUBINSize(prog.0, &mut n) }, "nvrtcGetCUBINSize")?;
    let mut cubin = vec![0u8; n];
    // SAFETY: `cubin` has the size NVRTC reported.
    nvrtc_check(unsafe { nv::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut std::ffi::c_char) }, "nvrtcGetCUBIN")?;
    Ok(cubin)
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

/// Where compiled kernels are cached: $RSCCL_CACHE_DIR, else $XDG_CACHE_HOME/rsccl, else
/// ~/.cache/rsccl.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("RSCCL_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("rsccl"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("rsccl"))
}

/// The cache file of `arch`'s kernels (None if there is no cache directory).
pub fn cache_path(arch: &str) -> Result<Option<PathBuf>> {
    let (ma, mi) = nvrtc_version()?;
    let key = fnv1a(&[SOURCE.as_bytes(), arch.as_bytes(), &ma.to_le_bytes(), &mi.to_le_bytes(), options(arch).join(" ").as_bytes()]);
    Ok(cache_dir().map(|d| d.join(format!("kernels-{key:016x}-{arch}.cubin"))))
}

/// The cubin for `arch`, from the disk cache or freshly compiled (then cached: written to
/// a temporary name and renamed, so concurrent ranks never read a partial file).
pub fn cubin_for(arch: &str) -> Result<Vec<u8>> {
    let path = cache_path(arch)?;
    if let Some(p) = &path {
        if let Ok(b) = std::fs::read(p) {
            if !b.is_empty() {
                return Ok(b);
            }
        }
    }
    let t = std::time::Instant::now();
    let cubin = compile(arch)?;
    tracing::info!(arch, ms = t.elapsed().as_millis() as u64, bytes = cubin.len(), "compiled rsccl kernels");
    if let Some(p) = &path {
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        let ok = p.parent().map(std::fs::create_dir_all).transpose().is_ok()
            && std::fs::write(&tmp, &cubin).is_ok()
            && std::fs::rename(&tmp, p).is_ok();
        if !ok {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(path = %p.display(), "could not cache rsccl's compiled kernels");
        }
    }
    Ok(cubin)
}

/// The loaded module and every entry point.
pub struct Kernels {
    module: CUmodule,
    reduce: HashMap<(Family, DType, ReduceOp), CUfunction>,
    pub all_gather: CUfunction,
    pub broadcast: CUfunction,
    pub gather: CUfunction,
    pub scatter: CUfunction,
    pub all_to_all: CUfunction,
    pub send: CUfunction,
    pub recv: CUfunction,
    pub barrier: CUfunction,
    pub cubin_bytes: usize,
}

// SAFETY: module and function handles are plain driver handles, valid on any thread
// while the module is loaded (until Drop).
unsafe impl Send for Kernels {}
// SAFETY: as above; read-only after load.
unsafe impl Sync for Kernels {}

impl Kernels {
    pub fn load(dev: &Device) -> Result<Kernels> {
        let cubin = cubin_for(&dev.arch()?)?;
        let _ctx = dev.bind()?;
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: `cubin` is a complete image produced by NVRTC for this architecture.
        check(unsafe { cu::cuModuleLoadData(&mut module, cubin.as_ptr() as *const std::ffi::c_void) }, "cuModuleLoadData")?;
        // Owns the module until `Kernels` does, so a failed lookup unloads it.
        struct Loaded(CUmodule);
        impl Drop for Loaded {
            fn drop(&mut self) {
                if !self.0.is_null() {
                    // SAFETY: the module loaded above, used by nothing else yet.
                    unsafe { cu::cuModuleUnload(self.0) };
                }
            }
        }
        let mut loaded = Loaded(module);
        let get = |name: &str| -> Result<CUfunction> {
            let c = CString::new(name).unwrap();
            let mut f: CUfunction = std::ptr::null_mut();
            // SAFETY: module is loaded; name is NUL-terminated.
            check(unsafe { cu::cuModuleGetFunction(&mut f, module, c.as_ptr()) }, &format!("cuModuleGetFunction({name})"))?;
            Ok(f)
        };
        let mut reduce = HashMap::new();
        for fam in FAMILIES {
            for d in REDUCE_DTYPES {
                for o in REDUCE_OPS {
                    let name = kernel_name(fam, d, o).expect("a supported combination");
                    reduce.insert((fam, d, o), get(&name)?);
                }
            }
        }
        let (all_gather, broadcast, barrier) = (get("rs_all_gather")?, get("rs_broadcast")?, get("rs_barrier")?);
        let (gather, scatter) = (get("rs_gather")?, get("rs_scatter")?);
        let (all_to_all, send, recv) = (get("rs_all_to_all")?, get("rs_send")?, get("rs_recv")?);
        loaded.0 = std::ptr::null_mut(); // `Kernels` owns the module from here
        Ok(Kernels { module, reduce, all_gather, broadcast, gather, scatter, all_to_all, send, recv, barrier, cubin_bytes: cubin.len() })
    }

    pub fn reduce(&self, f: Family, d: DType, o: ReduceOp) -> Option<CUfunction> {
        self.reduce.get(&(f, d, o)).copied()
    }

    /// Every collective entry point (not send/recv): what runs on a group's collective grid.
    pub fn collectives(&self) -> impl Iterator<Item = CUfunction> + '_ {
        let plain = [self.all_gather, self.broadcast, self.gather, self.scatter, self.all_to_all, self.barrier];
        self.reduce.values().copied().chain(plain)
    }

    /// The fewest blocks of THREADS threads that any of `funcs` can have resident on one
    /// SM (cuOccupancyMaxActiveBlocksPerMultiprocessor; no dynamic shared memory). Every
    /// block of these kernels then uses at most 1/that of each SM resource, so any that
    /// many blocks of them, whichever kernels they belong to, fit on one SM together.
    pub fn min_blocks_per_sm(funcs: impl IntoIterator<Item = CUfunction>) -> Result<u32> {
        let mut least = u32::MAX;
        for f in funcs {
            let mut n: std::ffi::c_int = 0;
            // SAFETY: out-pointer to a local; `f` is a function of a loaded module; the
            // caller made the module's context current.
            check(
                unsafe { cu::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, f, THREADS as std::ffi::c_int, 0) },
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            )?;
            least = least.min(n.max(0) as u32);
        }
        Ok(if least == u32::MAX { 0 } else { least })
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        // SAFETY: unloads the module loaded in `load`; the engine synchronized first.
        unsafe { cu::cuModuleUnload(self.module) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_combination_has_a_name() {
        for f in FAMILIES {
            for d in REDUCE_DTYPES {
                for o in REDUCE_OPS {
                    let n = kernel_name(f, d, o).unwrap();
                    assert!(SOURCE.contains(&format!("RS_TYPES({})", &f.prefix()[3..])), "{n}");
                }
            }
        }
        for plain in ["rs_all_gather", "rs_broadcast", "rs_gather", "rs_scatter", "rs_barrier"] {
            assert!(SOURCE.contains(&format!("void __launch_bounds__(512) {plain}(const Args a)")), "{plain}");
        }
        assert!(SOURCE.contains("void __launch_bounds__(512) rs_all_to_all(const A2aArgs x)"));
        for p2p in ["rs_send", "rs_recv"] {
            assert!(SOURCE.contains(&format!("void __launch_bounds__(512) {p2p}(const P2pArgs x)")), "{p2p}");
        }
        assert!(kernel_name(Family::OneShot, DType::F64, ReduceOp::Sum).is_none());
        assert!(kernel_name(Family::OneShot, DType::F32, ReduceOp::BAnd).is_none());
    }

    #[test]
    fn cache_key_changes_with_input() {
        assert_ne!(fnv1a(&[b"a", b"b"]), fnv1a(&[b"ab"]));
        assert_eq!(fnv1a(&[b"x"]), fnv1a(&[b"x"]));
    }
}
