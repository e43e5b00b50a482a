//! NCCL, for CUDA groups that span hosts: the library and its communicators (the engine
//! itself, with its choice between flat and hierarchical collectives, is nccl_engine/).
//!
//! torch's nvidia-nccl package ships `libnccl.so.2`, a name cudarc's loader does not try
//! (it tries libnccl.so and libnccl.so.<CUDA major>), so rsccl opens the library itself,
//! by the path the Python layer finds, and resolves the functions it calls. The types
//! (ncclUniqueId, ncclConfig_t, ...) are cudarc's bindings for NCCL 2.28, the version torch
//! 2.11 ships; the library's version is checked against that at load.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicPtr, Ordering as AtomicOrdering};
use std::sync::OnceLock;

use cudarc::nccl::sys as nc;

use crate::error::{Error, Result};

/// The oldest NCCL whose ncclConfig_t matches the bindings (ncclConfig_v22800).
pub const MIN_VERSION: i32 = 22800;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> nc::ncclResult_t;
type GetUniqueId = unsafe extern "C" fn(*mut nc::ncclUniqueId) -> nc::ncclResult_t;
type GetErrorString = unsafe extern "C" fn(nc::ncclResult_t) -> *const c_char;
type CommInitRankConfig =
    unsafe extern "C" fn(*mut nc::ncclComm_t, c_int, nc::ncclUniqueId, c_int, *mut nc::ncclConfig_t) -> nc::ncclResult_t;
type CommOp = unsafe extern "C" fn(nc::ncclComm_t) -> nc::ncclResult_t;
type CommSplit = unsafe extern "C" fn(nc::ncclComm_t, c_int, c_int, *mut nc::ncclComm_t, *mut nc::ncclConfig_t) -> nc::ncclResult_t;
type CommGetAsyncError = unsafe extern "C" fn(nc::ncclComm_t, *mut nc::ncclResult_t) -> nc::ncclResult_t;
type GroupOp = unsafe extern "C" fn() -> nc::ncclResult_t;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    nc::ncclDataType_t,
    nc::ncclRedOp_t,
    nc::ncclComm_t,
    nc::cudaStream_t,
) -> nc::ncclResult_t;
type AllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, nc::ncclDataType_t, nc::ncclComm_t, nc::cudaStream_t) -> nc::ncclResult_t;
type Rooted = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    nc::ncclDataType_t,
    c_int,
    nc::ncclComm_t,
    nc::cudaStream_t,
) -> nc::ncclResult_t;
type RootedReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    nc::ncclDataType_t,
    nc::ncclRedOp_t,
    c_int,
    nc::ncclComm_t,
    nc::cudaStream_t,
) -> nc::ncclResult_t;
type SendFn = unsafe extern "C" fn(*const c_void, usize, nc::ncclDataType_t, c_int, nc::ncclComm_t, nc::cudaStream_t) -> nc::ncclResult_t;
type RecvFn = unsafe extern "C" fn(*mut c_void, usize, nc::ncclDataType_t, c_int, nc::ncclComm_t, nc::cudaStream_t) -> nc::ncclResult_t;

/// The functions of a communicator's life and its operations.
#[derive(Clone, Copy)]
pub struct Fns {
    pub comm_init_rank_config: CommInitRankConfig,
    /// ncclCommSplit (NCCL 2.18 and later; MIN_VERSION is newer).
    pub comm_split: CommSplit,
    pub comm_finalize: CommOp,
    pub comm_destroy: CommOp,
    pub comm_abort: CommOp,
    pub comm_get_async_error: CommGetAsyncError,
    pub group_start: GroupOp,
    pub group_end: GroupOp,
    pub all_reduce: AllReduce,
    pub all_gather: AllGather,
    pub reduce_scatter: AllReduce,
    pub broadcast: Rooted,
    pub reduce: RootedReduce,
    pub send: SendFn,
    pub recv: RecvFn,
}

/// The first failure among the calls of one NCCL group (see `Fns::group`).
pub struct FirstError(nc::ncclResult_t);

impl FirstError {
    /// Keep `r` if no call failed before it.
    pub fn keep(&mut self, r: nc::ncclResult_t) {
        if self.0 == nc::ncclResult_t::ncclSuccess {
            self.0 = r;
        }
    }
}

impl Fns {
    /// One NCCL group: ncclGroupStart, then `calls` (which hands each NCCL call's result to
    /// `FirstError::keep`), then ncclGroupEnd, which runs whatever happened inside the group,
    /// so no group is left open. Returns the first failure: a call's before the end's; a
    /// start that failed runs nothing and is returned as it is.
    pub fn group(&self, calls: impl FnOnce(&mut FirstError)) -> nc::ncclResult_t {
        group_with(self.group_start, self.group_end, calls)
    }
}

/// `Fns::group` with its two functions given (so a test can pass its own).
fn group_with(start: GroupOp, end: GroupOp, calls: impl FnOnce(&mut FirstError)) -> nc::ncclResult_t {
    // SAFETY: ncclGroupStart takes no arguments; the group it opens is closed below.
    let started = unsafe { start() };
    if started != nc::ncclResult_t::ncclSuccess {
        return started;
    }
    let mut first = FirstError(nc::ncclResult_t::ncclSuccess);
    calls(&mut first);
    // SAFETY: closes the group opened above.
    first.keep(unsafe { end() });
    first.0
}

/// The loaded library and the functions rsccl calls.
pub struct Nccl {
    pub path: String,
    pub version: i32,
    get_unique_id: GetUniqueId,
    get_error_string: GetErrorString,
    pub fns: Fns,
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
    let c = CString::new(name).map_err(|_| Error::Internal(format!("symbol name {name:?} has a NUL")))?;
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
    // SAFETY: as above; each type spells the function's nccl.h signature.
    let fns = unsafe {
        Fns {
            comm_init_rank_config: symbol(handle, "ncclCommInitRankConfig", path)?,
            comm_split: symbol(handle, "ncclCommSplit", path)?,
            comm_finalize: symbol(handle, "ncclCommFinalize", path)?,
            comm_destroy: symbol(handle, "ncclCommDestroy", path)?,
            comm_abort: symbol(handle, "ncclCommAbort", path)?,
            comm_get_async_error: symbol(handle, "ncclCommGetAsyncError", path)?,
            group_start: symbol(handle, "ncclGroupStart", path)?,
            group_end: symbol(handle, "ncclGroupEnd", path)?,
            all_reduce: symbol(handle, "ncclAllReduce", path)?,
            all_gather: symbol(handle, "ncclAllGather", path)?,
            reduce_scatter: symbol(handle, "ncclReduceScatter", path)?,
            broadcast: symbol(handle, "ncclBroadcast", path)?,
            reduce: symbol(handle, "ncclReduce", path)?,
            send: symbol(handle, "ncclSend", path)?,
            recv: symbol(handle, "ncclRecv", path)?,
        }
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
    Ok(NCCL.get_or_init(|| Nccl { path: path.to_string(), version, get_unique_id, get_error_string, fns }))
}

/// "2.28.9" for 22809 (NCCL_VERSION_CODE for versions >= 2.9: major*10000 + minor*100 + patch).
pub fn version_text(code: i32) -> String {
    format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
}

/// ncclConfig_t as NCCL_CONFIG_INITIALIZER sets it (every field "undefined", NCCL picks),
/// with rsccl's bounds: blocking init, at most `max_ctas` CTAs (channels), a name in
/// NCCL's logs, and `splitShare = 0` whatever NCCL_COMM_SPLIT_SHARE_RESOURCES says: a
/// communicator split with shared resources shares its parent's internal strong stream,
/// and NCCL orders every kernel launched through one strong stream after the previous
/// one, so a pair communicator's send would wait behind the other direction's receive
/// (the deadlock the per-direction communicators exist to avoid; docs/multihost.md).
///
/// `version` says which fields the struct has, so it is the version of the layout these
/// bindings declare (ncclConfig_v22800), never the loaded library's: a newer library
/// told "2.31" would read fields past the end of this struct (2.31 added nine).
pub fn config(max_ctas: Option<i32>, name: *const c_char) -> nc::ncclConfig_t {
    const UNDEF_INT: c_int = c_int::MIN; // NCCL_CONFIG_UNDEF_INT
    nc::ncclConfig_t {
        size: std::mem::size_of::<nc::ncclConfig_t>(),
        magic: 0xcafebeef,
        version: MIN_VERSION as u32,
        blocking: 1,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: max_ctas.unwrap_or(UNDEF_INT),
        netName: std::ptr::null(),
        splitShare: 0,
        trafficClass: UNDEF_INT,
        commName: name,
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
    }
}

/// `Some(N::x)` for a table cell `x` of NCCL's enum `N`, None for `-`.
macro_rules! nccl_cell {
    ($n:ident, -) => {
        None
    };
    ($n:ident, ($x:ident)) => {
        Some(nc::$n::$x)
    };
    ($n:ident, $x:ident) => {
        Some(nc::$n::$x)
    };
}

macro_rules! nccl_dtypes {
    ($($v:ident = $code:literal, $name:literal, $size:literal, $float:literal, $tag:tt, $nccl:tt, $tch:tt;)*) => {
        /// NCCL's type for an rsccl dtype (None: NCCL has no such type): the NCCL column
        /// of the dtype table (dtype.rs).
        pub fn nccl_dtype(d: crate::dtype::DType) -> Option<nc::ncclDataType_t> {
            match d {
                $(crate::dtype::DType::$v => nccl_cell!(ncclDataType_t, $nccl),)*
            }
        }
    };
}
dtype_rows!(nccl_dtypes);

macro_rules! nccl_ops {
    ($($v:ident = $code:literal, $name:literal, $on:ident, $kernel:tt, $nccl:tt;)*) => {
        /// NCCL's op for an rsccl reduction (None: NCCL has none; bitwise ops): the NCCL
        /// column of the reduce-op table (dtype.rs).
        pub fn nccl_op(o: crate::dtype::ReduceOp) -> Option<nc::ncclRedOp_t> {
            match o {
                $(crate::dtype::ReduceOp::$v => nccl_cell!(ncclRedOp_t, $nccl),)*
            }
        }
    };
}
reduce_op_rows!(nccl_ops);

/// One NCCL communicator (rank `rank` of `nranks`), created blocking and destroyed (or
/// aborted) with the group. Work on it goes to the caller's streams: the engine orders
/// and tracks it like its own kernels.
///
/// The handle is an atomic pointer so that `abort` (from the NCCL engine's watchdog) and
/// `Drop` each free it at most once, whichever comes first.
pub struct NcclComm {
    nccl: &'static Nccl,
    comm: AtomicPtr<c_void>,
    pub rank: usize,
    pub nranks: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time (the engine
// serializes launches under its lock); ncclCommGetAsyncError and ncclCommAbort are meant
// to be called from another thread than the one launching.
unsafe impl Send for NcclComm {}
// SAFETY: as above.
unsafe impl Sync for NcclComm {}

impl NcclComm {
    /// ncclCommInitRankConfig on the current CUDA context (the caller binds the group's
    /// device). Every rank calls it with the same id; it returns when all have joined.
    pub fn init(nccl: &'static Nccl, id: &[u8; 128], rank: usize, nranks: usize, max_ctas: Option<i32>, name: &CStr) -> Result<NcclComm> {
        // SAFETY: zeroed is a valid ncclUniqueId; filled from the bytes below.
        let mut uid: nc::ncclUniqueId = unsafe { std::mem::zeroed() };
        for (d, s) in uid.internal.iter_mut().zip(id.iter()) {
            *d = *s as c_char;
        }
        let mut cfg = config(max_ctas, name.as_ptr());
        let mut comm: nc::ncclComm_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; cfg lives across the call (NCCL copies it).
        let r = unsafe { (nccl.fns.comm_init_rank_config)(&mut comm, nranks as c_int, uid, rank as c_int, &mut cfg) };
        let made = NcclComm { nccl, comm: AtomicPtr::new(comm as *mut c_void), rank, nranks };
        if let Err(e) = nccl.check(r, "ncclCommInitRankConfig") {
            made.abort_failed();
            return Err(e);
        }
        Ok(made)
    }

    /// A communicator whose creation failed: NCCL hands it back all the same when its
    /// creation failed past allocation (a peer gone during NCCL's bootstrap, say), with
    /// its bootstrap sockets and threads, which only ncclCommAbort releases (it waits for
    /// the failed creation and ignores its error). A null handle (NCCL freed it) is left.
    fn abort_failed(&self) {
        if !self.raw().is_null() {
            tracing::debug!(rank = self.rank, nranks = self.nranks, "rsccl: aborting an NCCL communicator whose creation failed");
        }
        self.abort();
    }

    /// The handle (null once aborted or destroyed).
    pub fn raw(&self) -> nc::ncclComm_t {
        self.comm.load(AtomicOrdering::Acquire) as nc::ncclComm_t
    }

    /// The handle, or the error every call on an aborted communicator gets.
    pub fn live(&self) -> Result<nc::ncclComm_t> {
        let raw = self.raw();
        if raw.is_null() {
            return Err(Error::Aborted("the NCCL communicator was aborted".into()));
        }
        Ok(raw)
    }

    pub fn fns(&self) -> &'static Fns {
        &self.nccl.fns
    }

    pub fn check(&self, r: nc::ncclResult_t, what: &str) -> Result<()> {
        self.nccl.check(r, what)
    }

    /// The communicator's asynchronous error (a failed peer, a network error), if any.
    pub fn async_error(&self) -> Result<()> {
        let comm = self.raw();
        if comm.is_null() {
            return Err(Error::Aborted("the NCCL communicator was aborted".into()));
        }
        let mut r = nc::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator (null after abort, checked above); out-pointer to a local.
        self.check(unsafe { (self.nccl.fns.comm_get_async_error)(comm, &mut r) }, "ncclCommGetAsyncError")?;
        if r == nc::ncclResult_t::ncclSuccess || r == nc::ncclResult_t::ncclInProgress {
            return Ok(());
        }
        self.check(r, "an NCCL operation")
    }

    /// Stop every operation in flight and free the communicator (after a failure).
    /// Idempotent; later calls on it fail with "aborted".
    pub fn abort(&self) {
        let comm = self.comm.swap(std::ptr::null_mut(), AtomicOrdering::AcqRel);
        if !comm.is_null() {
            // SAFETY: a communicator NCCL handed back (live, or one whose creation failed,
            // which ncclCommAbort takes too), taken out of `self` above, so freed once.
            unsafe { (self.nccl.fns.comm_abort)(comm as nc::ncclComm_t) };
        }
    }
}

impl NcclComm {
    /// ncclCommSplit of this communicator: collective over all its ranks, each passing
    /// `color` (None: NCCL_SPLIT_NOCOLOR, this rank joins no new communicator) and `key`
    /// (the order of the ranks in the new one). Blocking, with rsccl's config (`config`:
    /// no resource sharing with the parent). Returns the new communicator, None for
    /// NOCOLOR; `nranks` is how many ranks pass this rank's color (the caller knows).
    pub fn split(&self, color: Option<usize>, key: usize, nranks: usize, max_ctas: Option<i32>, name: &CStr) -> Result<Option<NcclComm>> {
        const NOCOLOR: c_int = -1; // NCCL_SPLIT_NOCOLOR
        let parent = self.live()?;
        let color = match color {
            Some(c) => c_int::try_from(c).map_err(|_| Error::Internal(format!("split color {c} out of range")))?,
            None => NOCOLOR,
        };
        let mut cfg = config(max_ctas, name.as_ptr());
        let mut comm: nc::ncclComm_t = std::ptr::null_mut();
        // SAFETY: a live parent (it is aborted only by the engine's watchdog, which does not
        // run during creation); out-pointer to a local; cfg lives across the call.
        let r = unsafe { (self.nccl.fns.comm_split)(parent, color, key as c_int, &mut comm, &mut cfg) };
        let made = NcclComm { nccl: self.nccl, comm: AtomicPtr::new(comm as *mut c_void), rank: key, nranks };
        if let Err(e) = self.check(r, "ncclCommSplit") {
            made.abort_failed();
            return Err(e);
        }
        if made.raw().is_null() {
            return Ok(None);
        }
        Ok(Some(made))
    }

    /// Finalize and destroy the communicator (its operations finished: the engine waited
    /// for them, or aborts instead). Idempotent; later calls on it fail with "aborted".
    pub fn close(&self) {
        let comm = self.comm.swap(std::ptr::null_mut(), AtomicOrdering::AcqRel);
        if comm.is_null() {
            return;
        }
        // SAFETY: a live communicator, taken out of `self` above, so freed once; its
        // operations were waited for by the caller.
        unsafe {
            (self.nccl.fns.comm_finalize)(comm as nc::ncclComm_t);
            (self.nccl.fns.comm_destroy)(comm as nc::ncclComm_t);
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.close();
    }
}

impl Nccl {
    pub fn check(&self, r: nc::ncclResult_t, what: &str) -> Result<()> {
        if r == nc::ncclResult_t::ncclSuccess {
            return Ok(());
        }
        // SAFETY: returns a static string.
        let s = unsafe { CStr::from_ptr((self.get_error_string)(r)) }.to_string_lossy().into_owned();
        let msg = format!("{what} failed: {s} ({r:?})");
        // A remote or system error is a peer (or the network) failing, not a CUDA problem.
        Err(match r {
            nc::ncclResult_t::ncclRemoteError | nc::ncclResult_t::ncclSystemError => Error::PeerFailure(msg),
            _ => Error::Cuda(msg),
        })
    }

    /// The loaded library, if `load` succeeded before.
    pub fn get() -> Option<&'static Nccl> {
        NCCL.get()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_is_the_initializer_with_our_bounds() {
        let c = config(Some(8), std::ptr::null());
        // ncclConfig_v22800: size_t, 2 u32, 4 int, netName, 2 int, commName, 6 int (nccl.h 2.28).
        assert_eq!(c.size, std::mem::size_of::<nc::ncclConfig_t>());
        assert_eq!(c.size, 8 + 2 * 4 + 4 * 4 + 8 + 2 * 4 + 8 + 6 * 4);
        assert_eq!((c.magic, c.version, c.blocking, c.maxCTAs, c.minCTAs), (0xcafebeef, 22800, 1, 8, i32::MIN));
        assert_eq!(c.splitShare, 0, "a shared split would serialize the pair communicators' kernels");
        assert_eq!(config(None, std::ptr::null()).maxCTAs, i32::MIN);
        assert_eq!(std::mem::size_of::<nc::ncclUniqueId>(), 128);
        use crate::dtype::{DType, ReduceOp};
        assert_eq!(nccl_dtype(DType::BF16), Some(nc::ncclDataType_t::ncclBfloat16));
        assert_eq!(nccl_op(ReduceOp::Avg), Some(nc::ncclRedOp_t::ncclAvg));
        assert_eq!(nccl_op(ReduceOp::BAnd), None);
    }

    #[test]
    fn a_group_is_always_closed_and_its_first_error_wins() {
        use nc::ncclResult_t as R;
        use std::cell::Cell;
        thread_local! {
            static LOG: Cell<(u32, u32)> = const { Cell::new((0, 0)) }; // (starts, ends)
            static END: Cell<R> = const { Cell::new(R::ncclSuccess) };
        }
        unsafe extern "C" fn start_ok() -> R {
            LOG.with(|l| l.set((l.get().0 + 1, l.get().1)));
            R::ncclSuccess
        }
        unsafe extern "C" fn start_fails() -> R {
            R::ncclSystemError
        }
        unsafe extern "C" fn end() -> R {
            LOG.with(|l| l.set((l.get().0, l.get().1 + 1)));
            END.with(|e| e.get())
        }
        let run = |start: GroupOp, end_gives: R, calls: &[R]| {
            LOG.with(|l| l.set((0, 0)));
            END.with(|e| e.set(end_gives));
            let mut ran = 0;
            let r = group_with(start, end, |first| {
                for &c in calls {
                    ran += 1;
                    first.keep(c);
                }
            });
            (r, ran, LOG.with(|l| l.get()))
        };
        let ok = R::ncclSuccess;
        assert_eq!(run(start_ok, ok, &[ok, ok]), (ok, 2, (1, 1)));
        // Every call runs and the group is closed; the first failure is returned.
        assert_eq!(run(start_ok, ok, &[ok, R::ncclInvalidArgument, R::ncclRemoteError]), (R::ncclInvalidArgument, 3, (1, 1)));
        assert_eq!(run(start_ok, R::ncclRemoteError, &[R::ncclInvalidUsage]), (R::ncclInvalidUsage, 1, (1, 1)), "a call's error first");
        assert_eq!(run(start_ok, R::ncclRemoteError, &[ok]), (R::ncclRemoteError, 1, (1, 1)), "then the end's");
        // A start that failed opened nothing: no call, no end.
        assert_eq!(run(start_fails, ok, &[ok]), (R::ncclSystemError, 0, (0, 0)));
    }

    #[test]
    fn versions_read_as_text() {
        assert_eq!(version_text(22809), "2.28.9");
        assert_eq!(version_text(MIN_VERSION), "2.28.0");
    }
}
