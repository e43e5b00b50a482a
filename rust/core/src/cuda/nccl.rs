//! NCCL, for CUDA groups that span hosts (the NCCL engine of issue 5; work in progress).
//!
//! torch's nvidia-nccl package ships `libnccl.so.2`, a name cudarc's loader does not try
//! (it tries libnccl.so and libnccl.so.<CUDA major>), so rsccl opens the library itself,
//! by the path the Python layer finds, and resolves the functions it calls. The types
//! (ncclUniqueId, ncclConfig_t, ...) are cudarc's bindings for NCCL 2.28, the version torch
//! 2.11 ships; the library's version is checked against that at load.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

use cudarc::nccl::sys as nc;

use crate::error::{Error, Result};

/// The oldest NCCL whose ncclConfig_t matches the bindings (ncclConfig_v22800).
pub const MIN_VERSION: i32 = 22800;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> nc::ncclResult_t;
type GetUniqueId = unsafe extern "C" fn(*mut nc::ncclUniqueId) -> nc::ncclResult_t;
type GetErrorString = unsafe extern "C" fn(nc::ncclResult_t) -> *const c_char;

/// The loaded library and the functions rsccl calls.
pub struct Nccl {
    pub path: String,
    pub version: i32,
    get_unique_id: GetUniqueId,
    get_error_string: GetErrorString,
}

// SAFETY: function pointers into a library that stays loaded for the process's life.
unsafe impl Send for Nccl {}
// SAFETY: as above; no state.
unsafe impl Sync for Nccl {}

static NCCL: OnceLock<Nccl> = OnceLock::new();

fn dl_error() -> String {
    // SAFETY: dlerror returns a thread-local message or null.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: a NUL-terminated string owned by libc, copied right away.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// Resolve `name` in `handle` as a function of type `F` (a fn pointer type).
///
/// # Safety
/// `F` must be the function's true C signature.
unsafe fn symbol<F: Copy>(handle: *mut c_void, name: &str, path: &str) -> Result<F> {
    let c = CString::new(name).unwrap();
    // SAFETY: handle is a live dlopen handle; the name is NUL-terminated.
    let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
    if p.is_null() {
        return Err(Error::Cuda(format!("{path} has no {name}: {}", dl_error())));
    }
    // SAFETY: F is a function pointer type of pointer size (caller's contract).
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

/// Load NCCL from `path` (once per process; a later call with another path gets the first
/// library) and check its version.
pub fn load(path: &str) -> Result<&'static Nccl> {
    if let Some(n) = NCCL.get() {
        return Ok(n);
    }
    let c = CString::new(path).map_err(|_| Error::InvalidArgument(format!("NCCL path {path:?} has a NUL")))?;
    // SAFETY: dlopen of a path; the handle is never closed (the functions are kept).
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(Error::Cuda(format!("cannot load NCCL from {path}: {}", dl_error())));
    }
    // SAFETY: the signatures are NCCL's (nccl.h of 2.28, as cudarc binds it).
    let (get_version, get_unique_id, get_error_string) = unsafe {
        (
            symbol::<GetVersion>(handle, "ncclGetVersion", path)?,
            symbol::<GetUniqueId>(handle, "ncclGetUniqueId", path)?,
            symbol::<GetErrorString>(handle, "ncclGetErrorString", path)?,
        )
    };
    let mut version = 0;
    // SAFETY: out-pointer to a local.
    let r = unsafe { get_version(&mut version) };
    if r != nc::ncclResult_t::ncclSuccess {
        return Err(Error::Cuda(format!("ncclGetVersion failed ({r:?})")));
    }
    if version < MIN_VERSION {
        return Err(Error::Cuda(format!(
            "{path} is NCCL {}, rsccl's NCCL engine needs {} or later (the version torch 2.11 ships)",
            version_text(version),
            version_text(MIN_VERSION)
        )));
    }
    Ok(NCCL.get_or_init(|| Nccl { path: path.to_string(), version, get_unique_id, get_error_string }))
}

/// "2.28.9" for 22809 (NCCL_VERSION_CODE for versions >= 2.9: major*10000 + minor*100 + patch).
pub fn version_text(code: i32) -> String {
    format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
}

impl Nccl {
    fn check(&self, r: nc::ncclResult_t, what: &str) -> Result<()> {
        if r == nc::ncclResult_t::ncclSuccess {
            return Ok(());
        }
        // SAFETY: returns a static string.
        let s = unsafe { CStr::from_ptr((self.get_error_string)(r)) }.to_string_lossy().into_owned();
        Err(Error::Cuda(format!("{what} failed: {s}")))
    }

    /// A new unique id (what rank 0 publishes through the store for ncclCommInitRank).
    pub fn unique_id(&self) -> Result<[u8; 128]> {
        // SAFETY: zeroed is a valid ncclUniqueId (a byte array).
        let mut id: nc::ncclUniqueId = unsafe { std::mem::zeroed() };
        // SAFETY: out-pointer to a local.
        self.check(unsafe { (self.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
        let mut out = [0u8; 128];
        for (o, i) in out.iter_mut().zip(id.internal.iter()) {
            *o = *i as u8;
        }
        Ok(out)
    }
}

/// How a CUDA collective of a group that spans hosts runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrossHost {
    /// One NCCL collective over every rank.
    Flat,
    /// rsccl's kernels inside each host, NCCL across hosts among ranks of the same local
    /// index, rsccl's kernels again (all_reduce: reduce-scatter, all_reduce, all_gather).
    Hierarchical,
}

/// The choice between flat NCCL and the hierarchical path: a pure function of the
/// collective, its message bytes and the topology. Hierarchical needs every host to have
/// the same number (>= 2) of ranks, applies to all_reduce, all_gather and reduce_scatter,
/// and pays off only for messages large enough that the host-local phases' extra launches
/// and barriers are small against the bytes moved (`min_bytes`).
pub fn choose_cross_host(kind: super::CudaKind, bytes: u64, ranks_per_host: &[usize], min_bytes: u64) -> CrossHost {
    use super::CudaKind as K;
    let hosts = ranks_per_host.len();
    let even = ranks_per_host.windows(2).all(|w| w[0] == w[1]);
    let eligible = matches!(kind, K::AllReduce | K::AllGather | K::ReduceScatter);
    if hosts >= 2 && even && ranks_per_host[0] >= 2 && eligible && bytes >= min_bytes {
        CrossHost::Hierarchical
    } else {
        CrossHost::Flat
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::CudaKind;

    #[test]
    fn versions_read_as_text() {
        assert_eq!(version_text(22809), "2.28.9");
        assert_eq!(version_text(MIN_VERSION), "2.28.0");
    }

    #[test]
    fn hierarchical_only_where_it_can_pay() {
        let mib = 1u64 << 20;
        let two_by_two = [2usize, 2];
        assert_eq!(choose_cross_host(CudaKind::AllReduce, 16 * mib, &two_by_two, mib), CrossHost::Hierarchical);
        assert_eq!(choose_cross_host(CudaKind::AllGather, mib, &two_by_two, mib), CrossHost::Hierarchical);
        assert_eq!(choose_cross_host(CudaKind::AllReduce, mib - 1, &two_by_two, mib), CrossHost::Flat, "small");
        assert_eq!(choose_cross_host(CudaKind::Broadcast, 16 * mib, &two_by_two, mib), CrossHost::Flat, "not eligible");
        assert_eq!(choose_cross_host(CudaKind::AllReduce, 16 * mib, &[1, 1, 1, 1], mib), CrossHost::Flat, "one GPU per host");
        assert_eq!(choose_cross_host(CudaKind::AllReduce, 16 * mib, &[2, 3], mib), CrossHost::Flat, "uneven hosts");
        assert_eq!(choose_cross_host(CudaKind::AllReduce, 16 * mib, &[4], mib), CrossHost::Flat, "one host");
    }
}
