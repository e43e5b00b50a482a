//! The NCCL engine: CUDA collectives of a group whose ranks span hosts.
//!
//! What it holds, all made at group creation: a flat NCCL communicator over every rank of
//! the group; and, where every host has the same number L >= 2 of the group's GPUs, rsccl's
//! own CUDA engine over the host's ranks plus a "cross" communicator among the ranks of
//! the same local index (one per index, one rank per host), for hierarchical all_reduce.
//! Each communicator's unique id goes through the c10d store under a key unique to this
//! group creation (`id_key`); every communicator runs a warm-up collective before creation
//! returns, and the device memory creation took is measured (`nccl_bytes`).
//!
//! Streams, as in rsccl's CUDA engine (engine.rs): a blocking call runs on the caller's
//! stream (`cuda_sync_stream = 1`), an asynchronous one on the internal stream after an
//! event makes it wait for the caller's; a call on another stream than the previous one
//! is ordered after it; an asynchronous call returns its end event. The three phases of a
//! hierarchical all_reduce run on one stream, so they are ordered. No tensor is marked on
//! a stream.
//!
//! Errors: NCCL kernels wait without bound, so the engine bounds them. Every launch is
//! tracked by an event; a watchdog thread polls every communicator's asynchronous error,
//! rsccl's local engine, and the oldest tracked launch. A failure, or a launch older than
//! the group timeout, makes the group unusable: the first error is kept (and raised by
//! every later call and Work.wait) and the watchdog aborts the communicators, which ends
//! their kernels, so nothing waits on them forever. Aborts happen on the watchdog thread
//! only (or at shutdown, after it stopped), so a communicator is freed exactly once.

use std::collections::VecDeque;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use cudarc::nccl::sys as nc;
use parking_lot::Mutex;

use super::driver::{check, is_capturing, CUevent, CUstream, Device};
use super::engine::{CudaCall, CudaEngine, CudaEvent, CudaKind, EventHome};
use super::nccl::{choose_cross_host, nccl_dtype, nccl_op, CrossHost, Nccl, NcclComm};
use crate::bootstrap::unix::Listener;
use crate::bootstrap::{LocalMesh, Store, Topology};
use crate::config::Config;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// Bytes of the temporary buffer the warm-up collectives run on: large enough that NCCL
/// picks the protocols of large messages too (and connects their buffers now, not at the
/// first real collective).
const WARM_BYTES: usize = 8 << 20;
/// Bytes of the buffer a barrier all-reduces (one float).
const SCRATCH_BYTES: usize = 256;

/// Which communicator a store key belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommRole {
    /// Every rank of the group.
    Flat,
    /// The ranks of local index `i`, one per host.
    Cross(usize),
}

impl CommRole {
    fn label(self) -> String {
        match self {
            CommRole::Flat => "flat".into(),
            CommRole::Cross(i) => format!("cross{i}"),
        }
    }
}

/// The store key under which `role`'s unique id is published (`what` = "id") or its
/// ranks count their arrival (`what` = "joined"). The nonce is fresh per group creation
/// (see rendezvous::exchange), so a re-created group never reads a stale id.
pub fn id_key(nonce: &[u8; 16], role: CommRole, what: &str) -> String {
    let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    format!("rsccl/nccl/{hex}/{}/{what}", role.label())
}

/// How a CUDA all_reduce of `count` elements of `elem` bytes with `op` runs, and why (a
/// pure function of values every rank has alike, so every rank takes the same path).
/// Hierarchical needs: the same number L >= 2 of ranks on every host and at least
/// `min_bytes` (`choose_cross_host`), an op whose partial results compose (not AVG: the
/// cross-host step would divide by the number of hosts, not of ranks), rsccl's kernels for
/// the dtype and op, and shards (count / L elements) that are whole multiples of 16 bytes,
/// so every phase works on aligned, equal pieces.
pub fn all_reduce_path(
    count: u64,
    elem: usize,
    op: ReduceOp,
    kernels_support: bool,
    ranks_per_host: &[usize],
    min_bytes: u64,
) -> (CrossHost, &'static str) {
    let bytes = count * elem as u64;
    if choose_cross_host(CudaKind::AllReduce, bytes, ranks_per_host, min_bytes) == CrossHost::Flat {
        return (CrossHost::Flat, "small message, or hosts with unequal or single GPUs");
    }
    if !matches!(op, ReduceOp::Sum | ReduceOp::Product | ReduceOp::Min | ReduceOp::Max) {
        return (CrossHost::Flat, "AVG (and ops whose partial results do not compose) run flat");
    }
    if !kernels_support {
        return (CrossHost::Flat, "rsccl's kernels do not reduce this dtype with this op");
    }
    let l = ranks_per_host[0] as u64;
    if count % l != 0 || (count / l * elem as u64) % 16 != 0 {
        return (CrossHost::Flat, "the message does not split into 16-byte-aligned shards per local rank");
    }
    (CrossHost::Hierarchical, "large message, same number of GPUs on every host")
}

/// Counters reported by memory_stats.
#[derive(Debug, Default, Clone, Copy)]
pub struct NcclStats {
    pub device: i32,
    /// Device memory NCCL took at group creation (communicators and their warm-up),
    /// measured with cuMemGetInfo around it.
    pub nccl_bytes: u64,
    pub communicators: u64,
    pub collectives: u64,
    pub hierarchical_collectives: u64,
}

/// A launch the watchdog follows until its event completes.
struct Tracked {
    ev: CUevent,
    at: Instant,
    kind: CudaKind,
    count: u64,
}

struct Order {
    last_stream: Option<u64>,
    free_events: Vec<CUevent>,
}

/// What the engine shares with its watchdog thread.
struct Shared {
    dev: Arc<Device>,
    flat: NcclComm,
    cross: Option<NcclComm>,
    local: Option<Arc<CudaEngine>>,
    rank: usize,
    timeout: Duration,
    order: Mutex<Order>,
    pending: Mutex<VecDeque<Tracked>>,
    /// The first error that made the group unusable.
    poisoned: Mutex<Option<Error>>,
    /// Set with `poisoned`; the watchdog aborts the communicators when it sees it.
    abort_requested: AtomicBool,
    stop: AtomicBool,
}

// SAFETY: the event handles are driver objects usable from any thread; every mutable
// state is behind a mutex or atomic; NcclComm is Send + Sync.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    fn comms(&self) -> impl Iterator<Item = (&'static str, &NcclComm)> {
        std::iter::once(("flat (every rank)", &self.flat)).chain(self.cross.iter().map(|c| ("cross-host", c)))
    }

    /// Make the group unusable with `err` (the first error wins) and have the watchdog
    /// abort the communicators. Returns the first error.
    fn fail(&self, err: Error) -> Error {
        let e = self.poisoned.lock().get_or_insert(err).clone();
        self.abort_requested.store(true, Ordering::Release);
        if let Some(l) = &self.local {
            l.abort_with(e.clone());
        }
        e
    }

    /// A failure nobody reported yet: an NCCL asynchronous error, a failed local engine,
    /// or a launch older than the group timeout.
    fn find_failure(&self) -> Option<Error> {
        for (what, c) in self.comms() {
            if let Err(e) = c.async_error() {
                return Some(with_context(e, &format!("rank {}: the NCCL communicator {what} failed", self.rank)));
            }
        }
        if let Some(l) = &self.local {
            if let Err(e) = l.check_fatal() {
                return Some(e);
            }
        }
        let p = self.pending.lock();
        let front = p.front()?;
        // SAFETY: a valid event of ours (recycled only after it left `pending`).
        let r = unsafe { cu::cuEventQuery(front.ev) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY && front.at.elapsed() > self.timeout {
            return Some(Error::Timeout(format!(
                "rank {}: a CUDA {} of {} elements (NCCL) did not finish within the group timeout ({:.1} s): \
                 a rank of the group did not call it, or died; the group was aborted",
                self.rank,
                front.kind.name(),
                front.count,
                self.timeout.as_secs_f64()
            )));
        }
        None
    }

    /// Return the events of finished launches to the free list.
    fn recycle_finished(&self) {
        let mut done = Vec::new();
        {
            let mut p = self.pending.lock();
            while let Some(t) = p.front() {
                // SAFETY: a valid event of ours.
                if unsafe { cu::cuEventQuery(t.ev) } == cu::CUresult::CUDA_ERROR_NOT_READY {
                    break;
                }
                done.extend(p.pop_front().map(|t| t.ev));
            }
        }
        if !done.is_empty() {
            self.order.lock().free_events.extend(done);
        }
    }

    /// Abort every communicator (their kernels end). A launch still inside an NCCL call
    /// holds the order lock: it gets a moment to return, then the abort goes ahead anyway,
    /// since an NCCL call blocked on a dead peer returns only once aborted.
    ///
    /// The communicators are aborted at once, each on its own thread: NCCL's abort of one
    /// may wait for GPU work that only the abort of another ends. On 4 H200s as 2 emulated
    /// hosts, with a rank killed, its cross-host peer never returned after the aborts when
    /// they ran one after the other (flat first); a kernel of the cross communicator, stuck
    /// on the dead peer, holding up the flat communicator's abort is the suspected cause.
    fn abort_comms(&self) {
        let guard = self.order.try_lock_for(Duration::from_secs(2));
        std::thread::scope(|s| {
            for (_, c) in self.comms() {
                s.spawn(move || c.abort());
            }
        });
        drop(guard);
    }
}

impl EventHome for Shared {
    fn recycle(&self, ev: CUevent) {
        self.order.lock().free_events.push(ev);
    }

    fn wait_timed_out(&self) -> Error {
        self.fail(Error::Timeout(format!(
            "rank {}: a CUDA collective (NCCL) did not finish within the group timeout ({:.1} s); the group was aborted",
            self.rank,
            self.timeout.as_secs_f64()
        )))
    }
}

fn with_context(e: Error, what: &str) -> Error {
    match e {
        Error::PeerFailure(m) => Error::PeerFailure(format!("{what}: {m} (a peer died or the network failed)")),
        Error::Aborted(m) => Error::Aborted(format!("{what}: {m}")),
        other => Error::Cuda(format!("{what}: {other}")),
    }
}

pub struct NcclEngine {
    sh: Arc<Shared>,
    internal: CUstream,
    scratch: u64,
    local_index: usize,
    ranks_per_host: Vec<usize>,
    hier_min: u64,
    sync_on_caller: bool,
    nccl_bytes: u64,
    collectives: AtomicU64,
    hierarchical: AtomicU64,
    watchdog: Mutex<Option<JoinHandle<()>>>,
    /// Names given to NCCL (kept alive: ncclConfig_t points at them).
    _names: Vec<CString>,
}

// SAFETY: the stream and device pointer are driver handles usable from any thread; the
// rest is Sync.
unsafe impl Send for NcclEngine {}
// SAFETY: as above.
unsafe impl Sync for NcclEngine {}

/// Free device memory of the current context.
fn free_bytes() -> Result<u64> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: out-pointers to locals; a context is current (the caller bound it).
    check(unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo")?;
    Ok(free as u64)
}

fn new_event() -> Result<CUevent> {
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    check(unsafe { cu::cuEventCreate(&mut e, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, "cuEventCreate")?;
    Ok(e)
}

/// Publish (if `make`) or read `role`'s unique id, then wait until all `members` ranks of
/// the communicator have it: a rank that died after the rendezvous is reported here, by
/// the store's timeout, instead of leaving the others in ncclCommInitRank for good.
fn share_id(store: &dyn Store, nccl: &Nccl, nonce: &[u8; 16], role: CommRole, make: bool, members: usize, deadline: Instant) -> Result<[u8; 128]> {
    let key = id_key(nonce, role, "id");
    if make {
        store.set(&key, &nccl.unique_id()?)?;
    }
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let raw = store.get(&key, left).map_err(|e| match e {
        Error::Timeout(_) => Error::Timeout(format!(
            "the NCCL id of the {} communicator was not published within the group timeout: its first rank did not get this far",
            role.label()
        )),
        other => other,
    })?;
    let id: [u8; 128] = raw.as_slice().try_into().map_err(|_| Error::Internal(format!("NCCL id of {} bytes in the store", raw.len())))?;
    let joined = id_key(nonce, role, "joined");
    store.add(&joined, 1)?;
    let mut pause = Duration::from_millis(1);
    loop {
        let n = store.add(&joined, 0)?;
        if n >= members as i64 {
            return Ok(id);
        }
        if Instant::now() > deadline {
            return Err(Error::Timeout(format!(
                "only {n} of the {members} ranks of the {} NCCL communicator reached its creation within the group timeout",
                role.label()
            )));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

impl NcclEngine {
    /// Build the engine of this rank on `device`: the flat communicator, and (hosts with
    /// the same number >= 2 of ranks) the local rsccl engine and the cross communicator;
    /// warm each up. Blocks until every rank has done the same, or fails.
    #[allow(clippy::too_many_arguments)]
    pub fn create(
        nccl: &'static Nccl,
        device: i32,
        topo: &Topology,
        store: &dyn Store,
        nonce: &[u8; 16],
        listener: Listener,
        cfg: &Config,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<Arc<NcclEngine>> {
        let dev = Arc::new(Device::open(device)?);
        let ranks_per_host: Vec<usize> = topo.hosts.iter().map(|h| h.len()).collect();
        let hierarchical = ranks_per_host.len() >= 2 && ranks_per_host[0] >= 2 && ranks_per_host.iter().all(|&n| n == ranks_per_host[0]);
        let names = vec![
            CString::new(format!("rsccl-flat-r{}", topo.rank)).map_err(|_| Error::Internal("NUL in a name".into()))?,
            CString::new(format!("rsccl-cross{}-r{}", topo.local_index(), topo.rank)).map_err(|_| Error::Internal("NUL in a name".into()))?,
        ];
        let ctx = dev.bind()?;
        let mut internal: CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; a non-blocking stream does not sync with stream 0.
        check(unsafe { cu::cuStreamCreate(&mut internal, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }, "cuStreamCreate")?;
        let mut bufs = [0u64; 2];
        for (b, len) in bufs.iter_mut().zip([SCRATCH_BYTES, WARM_BYTES]) {
            // SAFETY: out-pointer to a local; freed below (warm) or in Drop (scratch).
            let r = check(unsafe { cu::cuMemAlloc_v2(b, len) }, "cuMemAlloc (NCCL engine)");
            if let Err(e) = r {
                // SAFETY: what was allocated so far is ours and unused.
                unsafe {
                    bufs.iter().filter(|&&p| p != 0).for_each(|&p| {
                        let _ = cu::cuMemFree_v2(p);
                    });
                    cu::cuStreamDestroy_v2(internal);
                }
                return Err(e);
            }
        }
        let [scratch, warm] = bufs;
        // SAFETY: both buffers are ours; zeroing makes the warm-up's reductions finite.
        unsafe {
            check(cu::cuMemsetD8_v2(scratch, 0, SCRATCH_BYTES), "cuMemsetD8")?;
            check(cu::cuMemsetD8_v2(warm, 0, WARM_BYTES), "cuMemsetD8")?;
            check(cu::cuCtxSynchronize(), "cuCtxSynchronize")?;
        }
        drop(ctx);
        let result = Self::build(nccl, dev.clone(), topo, store, nonce, listener, cfg, timeout, deadline, hierarchical, internal, scratch, warm, &names);
        let _ctx = dev.bind()?;
        // SAFETY: the warm-up finished (build waited for it), or failed before launching,
        // or aborted its communicators, which ends their kernels: the stream drains, then
        // the buffer (ours) is free of users.
        unsafe {
            cu::cuStreamSynchronize(internal);
            cu::cuMemFree_v2(warm);
        }
        match result {
            Ok((sh, nccl_bytes)) => {
                let engine = Arc::new(NcclEngine {
                    sh: sh.clone(),
                    internal,
                    scratch,
                    local_index: topo.local_index(),
                    ranks_per_host,
                    hier_min: cfg.nccl_hierarchical_min_bytes,
                    sync_on_caller: cfg.cuda_sync_stream,
                    nccl_bytes,
                    collectives: AtomicU64::new(0),
                    hierarchical: AtomicU64::new(0),
                    watchdog: Mutex::new(None),
                    _names: names,
                });
                let wd = std::thread::Builder::new()
                    .name("rsccl-nccl-watchdog".into())
                    .spawn(move || watchdog(sh))
                    .map_err(|e| Error::os("starting the NCCL watchdog thread", e))?;
                *engine.watchdog.lock() = Some(wd);
                tracing::info!(
                    rank = topo.rank,
                    device,
                    hosts = topo.hosts.len(),
                    hierarchical,
                    nccl_bytes,
                    "rsccl: NCCL engine ready: {} communicator(s), {} MiB of device memory taken by NCCL",
                    if hierarchical { 2 } else { 1 },
                    nccl_bytes >> 20
                );
                Ok(engine)
            }
            Err(e) => {
                // SAFETY: nothing runs on them any more (see above).
                unsafe {
                    cu::cuMemFree_v2(scratch);
                    cu::cuStreamDestroy_v2(internal);
                }
                Err(e)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        nccl: &'static Nccl,
        dev: Arc<Device>,
        topo: &Topology,
        store: &dyn Store,
        nonce: &[u8; 16],
        listener: Listener,
        cfg: &Config,
        timeout: Duration,
        deadline: Instant,
        hierarchical: bool,
        internal: CUstream,
        scratch: u64,
        warm: u64,
        names: &[CString],
    ) -> Result<(Arc<Shared>, u64)> {
        let host = topo.host_of[topo.rank];
        let li = topo.local_index();
        let (flat, flat_bytes) = {
            let id = share_id(store, nccl, nonce, CommRole::Flat, topo.rank == 0, topo.size, deadline)?;
            let _ctx = dev.bind()?;
            let before = free_bytes()?;
            let comm = NcclComm::init(nccl, &id, topo.rank, topo.size, cfg.nccl_max_ctas, &names[0])?;
            warm_up(&comm, internal, warm, scratch, deadline)?;
            (comm, before.saturating_sub(free_bytes()?))
        };
        let hier = || -> Result<(Arc<CudaEngine>, NcclComm, u64)> {
            let ranks = topo.local_ranks().to_vec();
            let mesh = Arc::new(LocalMesh::connect(listener, nonce, &ranks, li, deadline)?);
            let local = CudaEngine::create(dev.ordinal, mesh, ranks, cfg, timeout, deadline)?;
            let hosts = topo.hosts.len();
            let id = share_id(store, nccl, nonce, CommRole::Cross(li), host == 0, hosts, deadline)?;
            let _ctx = dev.bind()?;
            let before = free_bytes()?;
            let comm = NcclComm::init(nccl, &id, host, hosts, cfg.nccl_max_ctas, &names[1])?;
            warm_up(&comm, internal, warm, scratch, deadline)?;
            let bytes = before.saturating_sub(free_bytes()?);
            Ok((local, comm, bytes))
        };
        let (mut local, mut cross, mut cross_bytes) = (None, None, 0);
        if hierarchical {
            match hier() {
                Ok((l, c, b)) => (local, cross, cross_bytes) = (Some(l), Some(c), b),
                Err(e) => {
                    // Abort rather than finalize: finalizing waits for peers that may be gone.
                    flat.abort();
                    return Err(e);
                }
            }
        }
        let sh = Arc::new(Shared {
            dev,
            flat,
            cross,
            local,
            rank: topo.rank,
            timeout,
            order: Mutex::new(Order { last_stream: None, free_events: Vec::new() }),
            pending: Mutex::new(VecDeque::new()),
            poisoned: Mutex::new(None),
            abort_requested: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        // Events for the launches' tracking, made now rather than at the first collective.
        {
            let _ctx = sh.dev.bind()?;
            let mut o = sh.order.lock();
            for _ in 0..16 {
                o.free_events.push(new_event()?);
            }
        }
        Ok((sh, flat_bytes + cross_bytes))
    }

    /// The local rsccl engine (hierarchical groups only).
    pub fn local(&self) -> Option<&Arc<CudaEngine>> {
        self.sh.local.as_ref()
    }

    /// Raise the error that made the group unusable (finding new ones: NCCL's asynchronous
    /// errors, a failed local engine), or a mismatch the local kernels reported.
    pub fn health(&self) -> Result<()> {
        if let Some(e) = self.sh.poisoned.lock().clone() {
            return Err(e);
        }
        if self.sh.stop.load(Ordering::Acquire) {
            return Err(Error::Aborted("the group was destroyed".into()));
        }
        // Querying the launches' events needs the device's context on this thread.
        let _ctx = self.sh.dev.bind()?;
        if let Some(e) = self.sh.find_failure() {
            return Err(self.sh.fail(e));
        }
        if let Some(l) = &self.sh.local {
            if let Err(e) = l.health() {
                return Err(if e.keeps_group_usable() { e } else { self.sh.fail(e) });
            }
        }
        Ok(())
    }

    /// This rank's arguments to a CUDA collective were invalid. NCCL has no way to tell
    /// the peers, which would wait for it until the timeout: the group is aborted now
    /// instead, so they fail fast too. Returns Ok: the caller raises its own error.
    pub fn invalid(&self) -> Result<()> {
        self.sh.fail(Error::Aborted(format!(
            "rank {} passed invalid arguments to a CUDA collective; a group that spans hosts cannot skip a \
             collective (NCCL runs every call on every rank), so the group was aborted",
            self.sh.rank
        )));
        Ok(())
    }

    fn path(&self, c: &CudaCall) -> Result<CrossHost> {
        if matches!(c.kind, CudaKind::AllReduce | CudaKind::ReduceScatter | CudaKind::Reduce) {
            let bad = || Error::InvalidType(format!("NCCL's {} does not support {} with {}", c.kind.name(), c.dtype.name(), c.op.name()));
            nccl_dtype(c.dtype).ok_or_else(bad)?;
            nccl_op(c.op).ok_or_else(bad)?;
        }
        let (Some(local), CudaKind::AllReduce) = (&self.sh.local, c.kind) else { return Ok(CrossHost::Flat) };
        let ok = local.supports_reduce_scatter(c.dtype, c.op);
        Ok(all_reduce_path(c.count, c.dtype.size(), c.op, ok, &self.ranks_per_host, self.hier_min).0)
    }

    /// Launch one collective. Returns the end event for an asynchronous call (the Work
    /// waits on it); a blocking call is ordered before the caller's later work already.
    pub fn launch(&self, c: &CudaCall) -> Result<Option<CudaEvent>> {
        self.health()?;
        match self.launch_inner(c) {
            Ok(ev) => Ok(ev),
            Err(e) if e.keeps_group_usable() => Err(e),
            Err(e) => Err(self.sh.fail(e)),
        }
    }

    fn launch_inner(&self, c: &CudaCall) -> Result<Option<CudaEvent>> {
        let path = self.path(c)?;
        let sh = &self.sh;
        let _ctx = sh.dev.bind()?;
        let caller = c.stream;
        let internal = self.internal as u64;
        let target = if c.asynchronous || !self.sync_on_caller { internal } else { caller };
        let mut o = sh.order.lock();
        // Shutdown sets `stop` under this lock: no launch starts after it.
        if sh.stop.load(Ordering::Acquire) {
            return Err(Error::Aborted("the group was destroyed".into()));
        }
        if target != caller {
            join(&mut o, caller, target)?;
        }
        if let Some(last) = o.last_stream {
            if last != target && last != caller && is_capturing(last)? == is_capturing(caller)? {
                join(&mut o, last, target)?;
            }
        }
        match path {
            CrossHost::Flat => self.enqueue_flat(c, target)?,
            CrossHost::Hierarchical => {
                self.enqueue_hierarchical(c, target)?;
                self.hierarchical.fetch_add(1, Ordering::Relaxed);
            }
        }
        o.last_stream = Some(target);
        self.collectives.fetch_add(1, Ordering::Relaxed);
        // The watchdog follows every launch it can query (not one being captured into a
        // graph: it runs when the graph is replayed).
        if !is_capturing(target)? {
            let ev = o.free_events.pop().map(Ok).unwrap_or_else(new_event)?;
            // SAFETY: valid event and stream.
            if let Err(e) = check(unsafe { cu::cuEventRecord(ev, target as CUstream) }, "cuEventRecord") {
                o.free_events.push(ev);
                return Err(e);
            }
            sh.pending.lock().push_back(Tracked { ev, at: Instant::now(), kind: c.kind, count: c.count });
        }
        if target == caller {
            return Ok(None);
        }
        let ev = o.free_events.pop().map(Ok).unwrap_or_else(new_event)?;
        // SAFETY: valid event and stream.
        if let Err(e) = check(unsafe { cu::cuEventRecord(ev, target as CUstream) }, "cuEventRecord") {
            o.free_events.push(ev);
            return Err(e);
        }
        if c.asynchronous {
            let home: std::sync::Weak<dyn EventHome> = Arc::downgrade(&self.sh) as std::sync::Weak<Shared>;
            return Ok(Some(CudaEvent::new(ev, home, sh.dev.clone(), sh.timeout)));
        }
        // SAFETY: valid event and caller stream; the wait captures the record, so the
        // event can be reused right away.
        let r = check(unsafe { cu::cuStreamWaitEvent(caller as CUstream, ev, 0) }, "cuStreamWaitEvent");
        o.free_events.push(ev);
        r.map(|_| None)
    }

    /// One NCCL collective over every rank, on `stream`.
    fn enqueue_flat(&self, c: &CudaCall, stream: u64) -> Result<()> {
        let comm = &self.sh.flat;
        let raw = comm.live()?;
        let f = comm.fns();
        let s = stream as nc::cudaStream_t;
        let (inp, out, n) = (c.inp as *const c_void, c.out as *mut c_void, c.count as usize);
        let u8_ = nc::ncclDataType_t::ncclUint8;
        let dt = nccl_dtype(c.dtype).unwrap_or(u8_);
        let op = nccl_op(c.op).unwrap_or(nc::ncclRedOp_t::ncclSum);
        let root = c.root as i32;
        let what = format!("NCCL {} (flat)", c.kind.name());
        // SAFETY (every call below): `raw` is a live communicator (aborts wait for the
        // order lock the caller holds, see Shared::abort_comms); the pointers are device
        // buffers of the sizes the Python layer checked (count as CudaCall documents:
        // elements for reductions, bytes for the rest); `s` is a live stream of the
        // communicator's device.
        let r = unsafe {
            match c.kind {
                CudaKind::AllReduce => (f.all_reduce)(inp, out, n, dt, op, raw, s),
                CudaKind::ReduceScatter => (f.reduce_scatter)(inp, out, n, dt, op, raw, s),
                CudaKind::AllGather => (f.all_gather)(inp, out, n, u8_, raw, s),
                CudaKind::Broadcast => (f.broadcast)(inp, out, n, u8_, root, raw, s),
                CudaKind::Reduce => (f.reduce)(inp, out, n, dt, op, root, raw, s),
                CudaKind::Barrier | CudaKind::Invalid => {
                    let p = self.scratch as *mut c_void;
                    (f.all_reduce)(p, p, 1, nc::ncclDataType_t::ncclFloat32, nc::ncclRedOp_t::ncclSum, raw, s)
                }
                CudaKind::Gather | CudaKind::Scatter => return self.enqueue_rooted_p2p(c, stream),
                CudaKind::AllToAll | CudaKind::Send | CudaKind::Recv => {
                    return Err(Error::InvalidType(format!(
                        "CUDA {} in a group that spans hosts is not supported yet (NCCL engine)",
                        c.kind.name()
                    )))
                }
            }
        };
        comm.check(r, &what)
    }

    /// gather / scatter as one NCCL group of sends and receives (count = bytes per rank):
    /// the root receives from (sends to) every rank, itself included, every rank sends to
    /// (receives from) the root.
    fn enqueue_rooted_p2p(&self, c: &CudaCall, stream: u64) -> Result<()> {
        let comm = &self.sh.flat;
        let raw = comm.live()?;
        let f = comm.fns();
        let s = stream as nc::cudaStream_t;
        let n = c.count as usize;
        if n == 0 {
            return Ok(());
        }
        let u8_ = nc::ncclDataType_t::ncclUint8;
        let (me, root, size) = (comm.rank, c.root, comm.nranks);
        let gather = c.kind == CudaKind::Gather;
        // SAFETY: as in enqueue_flat; the root's buffer holds `size` blocks of `n` bytes
        // (the Python layer allocated it so), block r at r * n.
        let mut r = unsafe { (f.group_start)() };
        if r == nc::ncclResult_t::ncclSuccess {
            // SAFETY: as above.
            unsafe {
                if me == root {
                    for peer in 0..size {
                        let at = (peer * n) as u64;
                        let rr = if gather {
                            (f.recv)((c.out + at) as *mut c_void, n, u8_, peer as i32, raw, s)
                        } else {
                            (f.send)((c.inp + at) as *const c_void, n, u8_, peer as i32, raw, s)
                        };
                        if rr != nc::ncclResult_t::ncclSuccess && r == nc::ncclResult_t::ncclSuccess {
                            r = rr;
                        }
                    }
                }
                let rr = if gather {
                    (f.send)(c.inp as *const c_void, n, u8_, root as i32, raw, s)
                } else {
                    (f.recv)(c.out as *mut c_void, n, u8_, root as i32, raw, s)
                };
                if rr != nc::ncclResult_t::ncclSuccess && r == nc::ncclResult_t::ncclSuccess {
                    r = rr;
                }
                // The group is closed whatever happened inside it.
                let end = (f.group_end)();
                if r == nc::ncclResult_t::ncclSuccess {
                    r = end;
                }
            }
        }
        comm.check(r, &format!("NCCL {} (send/recv)", c.kind.name()))
    }

    /// all_reduce in three phases on `stream`: rsccl's reduce-scatter over the host's
    /// GPUs into this rank's shard of `out`, NCCL all_reduce of that shard (in place)
    /// among the ranks of the same local index on every host, rsccl's all-gather of the
    /// shards into `out`. The local engine orders its kernels after what `stream` holds
    /// and `stream` after them (a blocking call to it), so the phases run in order.
    fn enqueue_hierarchical(&self, c: &CudaCall, stream: u64) -> Result<()> {
        let (local, cross) = match (&self.sh.local, &self.sh.cross) {
            (Some(l), Some(x)) => (l, x),
            _ => return Err(Error::Internal("hierarchical path without its engines".into())),
        };
        let l = local.local_size() as u64;
        let shard = c.count / l;
        let shard_bytes = shard * c.dtype.size() as u64;
        let mine = c.out + self.local_index as u64 * shard_bytes;
        let call = |kind, dtype, inp, out, count| CudaCall { kind, dtype, op: c.op, root: 0, inp, out, count, stream, asynchronous: false };
        // Any error once a phase may have started leaves the peers of the other phases
        // waiting: it makes the group unusable (the caller aborts it).
        let fatal = |e: Error| if e.keeps_group_usable() { Error::Aborted(format!("a hierarchical all_reduce failed part-way: {e}")) } else { e };
        local.launch(&call(CudaKind::ReduceScatter, c.dtype, c.inp, mine, shard)).map_err(fatal)?;
        let raw = cross.live()?;
        let dt = nccl_dtype(c.dtype).ok_or_else(|| Error::Internal("checked dtype".into()))?;
        let op = nccl_op(c.op).ok_or_else(|| Error::Internal("checked op".into()))?;
        // SAFETY: a live communicator (see enqueue_flat); `mine` is this rank's shard of
        // `out` (shard elements, inside the count the caller checked); a live stream.
        let r = unsafe { (cross.fns().all_reduce)(mine as *const c_void, mine as *mut c_void, shard as usize, dt, op, raw, stream as nc::cudaStream_t) };
        cross.check(r, "NCCL all_reduce (cross-host phase of a hierarchical all_reduce)")?;
        local.launch(&call(CudaKind::AllGather, DType::U8, mine, c.out, shard_bytes)).map_err(fatal)?;
        Ok(())
    }

    pub fn stats(&self) -> NcclStats {
        NcclStats {
            device: self.sh.dev.ordinal,
            nccl_bytes: self.nccl_bytes,
            communicators: 1 + self.sh.cross.is_some() as u64,
            collectives: self.collectives.load(Ordering::Relaxed),
            hierarchical_collectives: self.hierarchical.load(Ordering::Relaxed),
        }
    }

    /// Let queued work finish (up to the group timeout), then finalize and destroy the
    /// communicators, or abort them if the group failed or the work did not finish; then
    /// the local engine. Idempotent.
    pub fn shutdown(&self) {
        let sh = &self.sh;
        {
            let _o = sh.order.lock();
            if sh.stop.swap(true, Ordering::AcqRel) {
                return;
            }
        }
        if let Some(h) = self.watchdog.lock().take() {
            let _ = h.join();
        }
        let ctx = sh.dev.bind();
        let mut healthy = ctx.is_ok() && sh.poisoned.lock().is_none() && sh.find_failure().is_none();
        if ctx.is_ok() {
            let last = sh.order.lock().last_stream;
            let mut streams = vec![self.internal as u64];
            streams.extend(last.filter(|&l| l != self.internal as u64));
            let deadline = Instant::now() + sh.timeout;
            for s in streams {
                if !healthy {
                    break;
                }
                let Ok(ev) = new_event() else { continue };
                // SAFETY: valid event and stream (torch never destroys its pool streams).
                if unsafe { cu::cuEventRecord(ev, s as CUstream) } == cu::CUresult::CUDA_SUCCESS {
                    // SAFETY: valid event.
                    while unsafe { cu::cuEventQuery(ev) } == cu::CUresult::CUDA_ERROR_NOT_READY {
                        if Instant::now() > deadline || sh.find_failure().is_some() {
                            healthy = false;
                            break;
                        }
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
                // SAFETY: ours; a pending record on it is harmless.
                unsafe { cu::cuEventDestroy_v2(ev) };
            }
        }
        if healthy {
            // Launches are refused from here on (stop), and the queued work finished.
            for (_, c) in sh.comms() {
                c.close();
            }
        } else {
            tracing::warn!(rank = sh.rank, "rsccl: aborting the group's NCCL communicators at shutdown (the group failed or its work did not finish)");
            sh.abort_comms();
        }
        if let Some(l) = &sh.local {
            l.shutdown();
        }
    }
}

impl Drop for NcclEngine {
    fn drop(&mut self) {
        self.shutdown();
        let Ok(_ctx) = self.sh.dev.bind() else { return };
        // SAFETY: shutdown drained or aborted the work on the stream; the buffer and
        // stream are ours. Pending tracked events go back to the free list first.
        unsafe {
            cu::cuStreamSynchronize(self.internal);
            self.sh.recycle_finished();
            cu::cuMemFree_v2(self.scratch);
            cu::cuStreamDestroy_v2(self.internal);
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let Ok(_ctx) = self.dev.bind() else { return };
        // SAFETY: no launch and no event wait refers to these any more (the engine and
        // every CudaEvent of it hold this Shared).
        unsafe {
            for t in self.pending.get_mut().drain(..) {
                cu::cuEventDestroy_v2(t.ev);
            }
            for ev in self.order.get_mut().free_events.drain(..) {
                cu::cuEventDestroy_v2(ev);
            }
        }
    }
}

/// Make `to` wait for the work queued on `from` so far.
fn join(o: &mut Order, from: u64, to: u64) -> Result<()> {
    let ev = o.free_events.pop().map(Ok).unwrap_or_else(new_event)?;
    // SAFETY: valid event and streams; reusing the event after the wait is enqueued is
    // allowed (the wait captured the record).
    let r = unsafe {
        check(cu::cuEventRecord(ev, from as CUstream), "cuEventRecord")
            .and_then(|_| check(cu::cuStreamWaitEvent(to as CUstream, ev, 0), "cuStreamWaitEvent"))
    };
    o.free_events.push(ev);
    r
}

/// The collectives a communicator will run, once each at a small and a large size, on the
/// internal stream, then wait (at most until `deadline`): NCCL connects peers and
/// allocates the buffers of each algorithm and protocol at their first use, so this moves
/// that to group creation. `warm` holds WARM_BYTES, `scratch` SCRATCH_BYTES.
fn warm_up(comm: &NcclComm, stream: CUstream, warm: u64, scratch: u64, deadline: Instant) -> Result<()> {
    let f = comm.fns();
    let raw = comm.raw();
    let s = stream as nc::cudaStream_t;
    let n = comm.nranks;
    let f32_ = nc::ncclDataType_t::ncclFloat32;
    let u8_ = nc::ncclDataType_t::ncclUint8;
    let sum = nc::ncclRedOp_t::ncclSum;
    let (w, sc) = (warm as *mut c_void, scratch as *mut c_void);
    let big = WARM_BYTES / 4; // floats
    let per_rank = (WARM_BYTES / n) & !255; // bytes per rank of the gathers
    let mine = (warm + (comm.rank * per_rank) as u64) as *mut c_void;
    // SAFETY: a live communicator and stream; every call stays inside the warm buffer
    // (WARM_BYTES) or the scratch (one float).
    let calls: [(&str, nc::ncclResult_t); 6] = unsafe {
        [
            ("all_reduce", (f.all_reduce)(sc, sc, 1, f32_, sum, raw, s)),
            ("all_reduce", (f.all_reduce)(w, w, big, f32_, sum, raw, s)),
            // In place, as NCCL defines it: this rank's block of the whole buffer.
            ("all_gather", (f.all_gather)(mine, w, per_rank, u8_, raw, s)),
            ("reduce_scatter", (f.reduce_scatter)(w, mine, per_rank / 4, f32_, sum, raw, s)),
            ("broadcast", (f.broadcast)(w, w, WARM_BYTES, u8_, 0, raw, s)),
            ("reduce", (f.reduce)(w, w, big, f32_, sum, 0, raw, s)),
        ]
    };
    for (what, r) in calls {
        comm.check(r, &format!("NCCL {what} (warm-up at group creation)"))?;
    }
    let ev = new_event()?;
    // SAFETY: valid event and stream.
    let recorded = check(unsafe { cu::cuEventRecord(ev, stream) }, "cuEventRecord");
    let mut result = recorded;
    if result.is_ok() {
        loop {
            // SAFETY: valid event.
            match unsafe { cu::cuEventQuery(ev) } {
                cu::CUresult::CUDA_SUCCESS => break,
                cu::CUresult::CUDA_ERROR_NOT_READY if Instant::now() < deadline => {
                    if let Err(e) = comm.async_error() {
                        result = Err(e);
                        break;
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
                cu::CUresult::CUDA_ERROR_NOT_READY => {
                    result = Err(Error::Timeout(
                        "the NCCL warm-up at group creation did not finish within the group timeout: a rank stopped during creation".into(),
                    ));
                    break;
                }
                e => {
                    result = check(e, "cuEventQuery (NCCL warm-up)");
                    break;
                }
            }
        }
    }
    if result.is_err() {
        // Ends the warm-up kernels, so the buffers can be freed under them.
        comm.abort();
    }
    // SAFETY: ours; the warm-up finished or was aborted.
    unsafe { cu::cuEventDestroy_v2(ev) };
    result
}

fn watchdog(sh: Arc<Shared>) {
    let Ok(_ctx) = sh.dev.bind() else { return };
    let mut aborted = false;
    while !sh.stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(20));
        if !aborted {
            if sh.poisoned.lock().is_none() {
                if let Some(e) = sh.find_failure() {
                    let e = sh.fail(e);
                    tracing::error!(rank = sh.rank, "rsccl: {e}");
                }
            }
            if sh.abort_requested.load(Ordering::Acquire) {
                sh.abort_comms();
                aborted = true;
            }
        }
        sh.recycle_finished();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_keys_are_unique_per_creation_and_communicator() {
        let a = [0xabu8; 16];
        let mut b = a;
        b[15] = 0;
        assert_eq!(id_key(&a, CommRole::Flat, "id"), format!("rsccl/nccl/{}/flat/id", "ab".repeat(16)));
        assert_ne!(id_key(&a, CommRole::Flat, "id"), id_key(&b, CommRole::Flat, "id"), "another creation");
        assert_ne!(id_key(&a, CommRole::Cross(0), "id"), id_key(&a, CommRole::Cross(1), "id"), "one id per local index");
        assert_ne!(id_key(&a, CommRole::Cross(0), "id"), id_key(&a, CommRole::Cross(0), "joined"));
    }

    #[test]
    fn hierarchical_all_reduce_only_where_it_is_exact_and_aligned() {
        let mib = 1u64 << 20;
        let two_by_two = [2usize, 2];
        let path = |count, elem, op, ok, hosts: &[usize]| all_reduce_path(count, elem, op, ok, hosts, mib).0;
        use CrossHost::{Flat, Hierarchical};
        assert_eq!(path(mib, 2, ReduceOp::Sum, true, &two_by_two), Hierarchical);
        assert_eq!(path(mib, 4, ReduceOp::Max, true, &two_by_two), Hierarchical);
        assert_eq!(path(mib / 4, 2, ReduceOp::Sum, true, &two_by_two), Flat, "under the threshold");
        assert_eq!(path(mib, 2, ReduceOp::Avg, true, &two_by_two), Flat, "AVG would divide by the hosts");
        assert_eq!(path(mib, 2, ReduceOp::Sum, false, &two_by_two), Flat, "no kernel");
        assert_eq!(path(mib + 1, 2, ReduceOp::Sum, true, &two_by_two), Flat, "odd count");
        assert_eq!(path(mib + 2, 2, ReduceOp::Sum, true, &two_by_two), Flat, "shard of 2 MiB + 2 bytes: unaligned");
        assert_eq!(path(mib + 16, 2, ReduceOp::Sum, true, &two_by_two), Hierarchical, "shard of 2 MiB + 16 bytes");
        assert_eq!(path(mib, 2, ReduceOp::Sum, true, &[1, 1]), Flat, "one GPU per host");
        assert_eq!(path(mib * 3, 2, ReduceOp::Sum, true, &[3, 3]), Hierarchical);
        assert_eq!(path(mib, 2, ReduceOp::Sum, true, &[2, 3]), Flat, "uneven hosts");
    }
}
