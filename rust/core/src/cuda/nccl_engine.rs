//! The NCCL engine: CUDA collectives of a group whose ranks span hosts.
//!
//! What it holds, all made at group creation: a flat NCCL communicator over every rank of
//! the group; and, where every host has the same number L >= 2 of the group's GPUs, rsccl's
//! own CUDA engine over the host's ranks plus a "cross" communicator among the ranks of
//! the same local index (one per index, one rank per host), for hierarchical all_reduce,
//! all_gather and reduce_scatter (the last two also need host-major ranks; reduce_scatter
//! a scratch buffer, `nccl_hierarchical_scratch_bytes`, allocated here too).
//! Each communicator's unique id goes through the c10d store under a key unique to this
//! group creation (`id_key`); every communicator runs a warm-up collective before creation
//! returns, and the device memory creation took is measured (`nccl_bytes`).
//!
//! For CUDA send/recv (`nccl_p2p`), one 2-rank communicator per ordered pair of ranks on
//! different hosts (and on one host where there is no local rsccl engine), split from the
//! flat one in rounds (`p2p_split_rounds`), each carrying one direction only and running
//! on its own stream; warmed up at creation like the others. torch calls isend/irecv of a
//! ProcessGroup subclass one at a time (batch_isend_irecv too), and NCCL runs the kernels
//! of one communicator one after another: a send and a receive between two ranks on one
//! communicator, issued one at a time, would each wait for the other's turn. With one
//! communicator and one stream per direction, a send to j never waits behind a receive
//! from j (docs/multihost.md).
//!
//! Streams, as in rsccl's CUDA engine (engine.rs): a blocking call runs on the caller's
//! stream (`cuda_sync_stream = 1`), an asynchronous one on the internal stream after an
//! event makes it wait for the caller's; a call on another stream than the previous one
//! is ordered after it; an asynchronous call returns its end event. The three phases of a
//! hierarchical collective run on one stream, so they are ordered. No tensor is marked on
//! a stream.
//!
//! Errors: NCCL kernels wait without bound, so the engine bounds them. Every launch is
//! tracked by events before and after it; a watchdog thread polls every communicator's
//! asynchronous error, rsccl's local engine, and the tracked launches. A failure, or a
//! launch still running more than the group timeout after it started on the GPU, makes
//! the group unusable: the first error is kept (and raised by
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
use parking_lot::{Mutex, RwLock};

use super::driver::{check, is_capturing, CUevent, CUstream, Device};
use super::engine::{AllToAll, CudaCall, CudaEngine, CudaEvent, CudaKind, EventHome};
use super::nccl::{choose_cross_host, nccl_dtype, nccl_op, p2p_split_rounds, CrossHost, Nccl, NcclComm};
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
/// How long an abort waits for launches to leave their NCCL calls (see `abort_comms`).
const ABORT_GRACE: Duration = Duration::from_secs(10);
/// The pair communicators' warm-up: a message small enough for NCCL's LL protocol
/// (NCCL_P2P_LL_THRESHOLD, 16 KiB by default) and one that takes the SIMPLE protocol,
/// so both are set up at creation. NCCL connects a peer's channels at the first send or
/// receive whatever its size; the two sizes are for the protocols' own first use.
const PAIR_WARM_BYTES: [usize; 2] = [1024, 1 << 20];
/// Where the pair warm-up's receives land in the warm buffer (the sends read its start).
const PAIR_WARM_RECV_AT: u64 = 4 << 20;

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

/// Whether the group's ranks are host-major: host h (hosts numbered by their lowest rank, as
/// Topology does) holds ranks h * L .. h * L + L - 1, every host the same number L. Then a
/// host's ranks own one contiguous block of a rank-ordered buffer (all_gather output,
/// reduce_scatter input), and a rank's index in its cross communicator is its host index.
pub fn host_major(hosts: &[Vec<usize>]) -> bool {
    let Some(l) = hosts.first().map(|h| h.len()) else { return false };
    hosts.iter().enumerate().all(|(h, ranks)| ranks.len() == l && ranks.iter().enumerate().all(|(i, &r)| r == h * l + i))
}

/// How a CUDA all_gather of `bytes_per_rank` runs, and why (pure; every rank evaluates it
/// alike). Hierarchical needs what `choose_cross_host` needs (on the output's bytes),
/// host-major ranks (so rank r's piece lands at r * bytes_per_rank through host blocks)
/// and pieces that are whole multiples of 16 bytes (aligned for the host-local kernel).
pub fn all_gather_path(bytes_per_rank: u64, ranks_per_host: &[usize], host_major: bool, min_bytes: u64) -> (CrossHost, &'static str) {
    let world = ranks_per_host.iter().sum::<usize>() as u64;
    if choose_cross_host(CudaKind::AllGather, bytes_per_rank * world, ranks_per_host, min_bytes) == CrossHost::Flat {
        return (CrossHost::Flat, "small message, or hosts with unequal or single GPUs");
    }
    if !host_major {
        return (CrossHost::Flat, "ranks are not host-major (rank = host index x GPUs per host + local index)");
    }
    if bytes_per_rank == 0 || bytes_per_rank % 16 != 0 {
        return (CrossHost::Flat, "a rank's piece is empty or not a whole multiple of 16 bytes");
    }
    (CrossHost::Hierarchical, "large message, same number of GPUs on every host, host-major ranks")
}

/// How a CUDA reduce_scatter of `count` output elements of `elem` bytes with `op` runs,
/// and why (pure, as above). Hierarchical needs what `all_gather_path` needs (on the
/// input's bytes, world x count elements), an op whose partial results compose and
/// rsccl's kernels for it (as `all_reduce_path`), and room in the scratch for the host's
/// partial sums: hosts x count elements, at most `scratch_bytes`.
#[allow(clippy::too_many_arguments)]
pub fn reduce_scatter_path(
    count: u64,
    elem: usize,
    op: ReduceOp,
    kernels_support: bool,
    ranks_per_host: &[usize],
    host_major: bool,
    min_bytes: u64,
    scratch_bytes: u64,
) -> (CrossHost, &'static str) {
    let piece = count * elem as u64;
    let world = ranks_per_host.iter().sum::<usize>() as u64;
    if choose_cross_host(CudaKind::ReduceScatter, piece * world, ranks_per_host, min_bytes) == CrossHost::Flat {
        return (CrossHost::Flat, "small message, or hosts with unequal or single GPUs");
    }
    if !host_major {
        return (CrossHost::Flat, "ranks are not host-major (rank = host index x GPUs per host + local index)");
    }
    if !matches!(op, ReduceOp::Sum | ReduceOp::Product | ReduceOp::Min | ReduceOp::Max) {
        return (CrossHost::Flat, "AVG (and ops whose partial results do not compose) run flat");
    }
    if !kernels_support {
        return (CrossHost::Flat, "rsccl's kernels do not reduce this dtype with this op");
    }
    if piece == 0 || piece % 16 != 0 {
        return (CrossHost::Flat, "the output is empty or not a whole multiple of 16 bytes");
    }
    if piece * ranks_per_host.len() as u64 > scratch_bytes {
        return (CrossHost::Flat, "the hosts' partial sums (output bytes x hosts) exceed nccl_hierarchical_scratch_bytes");
    }
    (CrossHost::Hierarchical, "large message, same number of GPUs on every host, host-major ranks")
}

/// The unit of a CudaCall's count, for messages.
fn count_unit(kind: CudaKind) -> &'static str {
    match kind {
        CudaKind::AllReduce | CudaKind::ReduceScatter | CudaKind::Reduce => "elements",
        _ => "bytes",
    }
}

/// Counters reported by memory_stats.
#[derive(Debug, Default, Clone, Copy)]
pub struct NcclStats {
    pub device: i32,
    /// Device memory NCCL took at group creation (communicators and their warm-up),
    /// measured with cuMemGetInfo around it.
    pub nccl_bytes: u64,
    /// The hierarchical reduce_scatter's buffer (nccl_hierarchical_scratch_bytes; 0 where
    /// the group has no hierarchical path or is not host-major).
    pub scratch_bytes: u64,
    pub communicators: u64,
    pub collectives: u64,
    pub hierarchical_collectives: u64,
    /// The pair communicators for send/recv (part of `communicators`) and the device
    /// memory their creation and warm-up took (part of `nccl_bytes`).
    pub p2p_communicators: u64,
    pub p2p_bytes: u64,
    /// send/recv that ran on a pair communicator.
    pub p2p_messages: u64,
}

/// A launch the watchdog follows until its event completes.
struct Tracked {
    /// Recorded on the launch's stream right before the launch: complete once the work
    /// queued ahead of it (the caller's compute, earlier collectives) is done.
    start: CUevent,
    ev: CUevent,
    /// When `start` was first seen complete (by the watchdog or a health check); the
    /// launch's age counts from there, so waiting behind long compute is not a timeout.
    started: Option<Instant>,
    kind: CudaKind,
    count: u64,
    /// The other rank of a send/recv.
    peer: Option<usize>,
}

/// A 2-rank NCCL communicator of one ordered pair of ranks, carrying the messages of one
/// direction only: its NCCL rank 0 sends, rank 1 receives. Its own stream, so it never
/// waits behind another pair's (or the other direction's) messages.
struct PairComm {
    /// The other rank (group rank).
    peer: usize,
    /// This rank sends on it (NCCL rank 0), or receives (NCCL rank 1).
    sending: bool,
    comm: NcclComm,
    stream: CUstream,
}

/// Whether a launch that started on the GPU at `started` (None: not yet) and has not
/// finished is past the group timeout `now` (pure: tested without a GPU).
pub fn launch_timed_out(started: Option<Instant>, now: Instant, timeout: Duration) -> bool {
    started.is_some_and(|t| now.saturating_duration_since(t) > timeout)
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
    /// The pair communicators (nccl_p2p; empty when off).
    pairs: Vec<PairComm>,
    local: Option<Arc<CudaEngine>>,
    rank: usize,
    timeout: Duration,
    /// Held shared by every use of a communicator handle (launches, asynchronous-error
    /// queries) and exclusively by what frees one (abort, close), so a handle is never
    /// freed while in use. Taken before `order`. See `abort_comms` for why the exclusive
    /// side does not wait long.
    gate: RwLock<()>,
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
        std::iter::once(("flat (every rank)", &self.flat))
            .chain(self.cross.iter().map(|c| ("cross-host", c)))
            .chain(self.pairs.iter().map(|p| (if p.sending { "of sends to a peer" } else { "of receives from a peer" }, &p.comm)))
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
        {
            let _gate = self.gate.read();
            for (what, c) in self.comms() {
                if let Err(e) = c.async_error() {
                    return Some(with_context(e, &format!("rank {}: the NCCL communicator {what} failed", self.rank)));
                }
            }
        }
        if let Some(l) = &self.local {
            if let Err(e) = l.check_fatal() {
                return Some(e);
            }
        }
        let mut p = self.pending.lock();
        let now = Instant::now();
        // Every unfinished launch (not only the oldest: launches on streams that are not
        // ordered after each other, such as the pair communicators' send/recv, may start in
        // any order), aged from its start.
        let late = p.iter_mut().find_map(|t| {
            // SAFETY: valid events of ours (recycled only after they left `pending`).
            if unsafe { cu::cuEventQuery(t.ev) } != cu::CUresult::CUDA_ERROR_NOT_READY {
                return None;
            }
            // SAFETY: as above.
            if t.started.is_none() && unsafe { cu::cuEventQuery(t.start) } == cu::CUresult::CUDA_SUCCESS {
                t.started = Some(now);
            }
            launch_timed_out(t.started, now, self.timeout).then_some((t.kind, t.count, t.peer))
        });
        if let Some((kind, count, peer)) = late {
            if let Some(peer) = peer {
                let (what, dir) = if kind == CudaKind::Send { ("send", "to") } else { ("recv", "from") };
                return Some(Error::Timeout(format!(
                    "rank {}: a CUDA {what} of {count} bytes {dir} rank {peer} (NCCL) did not finish within the group \
                     timeout ({:.1} s) of starting on the GPU: rank {peer} did not post the matching {}, posted it \
                     with another size (NCCL cannot tell), or died; the group was aborted",
                    self.rank,
                    self.timeout.as_secs_f64(),
                    if kind == CudaKind::Send { "recv" } else { "send" },
                )));
            }
            return Some(Error::Timeout(format!(
                "rank {}: a CUDA {} of {} {} (NCCL) did not finish within the group timeout ({:.1} s) of starting on the GPU: \
                 a rank of the group did not call it, called it with other sizes (all_to_all splits \
                 that disagree between ranks hang NCCL), or died; the group was aborted",
                self.rank,
                kind.name(),
                count,
                count_unit(kind),
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
                done.extend(p.pop_front().into_iter().flat_map(|t| [t.start, t.ev]));
            }
        }
        if !done.is_empty() {
            self.order.lock().free_events.extend(done);
        }
    }

    /// Abort every communicator (their kernels end), exclusive with every use of their
    /// handles (`gate`): launches and error queries hold it shared, so none of them runs
    /// on a handle being freed, and once the abort nulled the handles, a launch that
    /// takes the gate next finds them dead (`live()`) and fails.
    ///
    /// Why the wait for the gate is short: a launch holds it only while it enqueues. NCCL
    /// calls on a blocking communicator queue their kernels and return without waiting
    /// for peers: collectives' connections, and the point-to-point ones of the send/recv
    /// groups (gather, scatter, all_to_all), were all made at creation by the warm-up, so
    /// no call connects (the one step that waits on peers) later; the hierarchical path's
    /// host-local launches queue rsccl kernels without waiting either. What could still
    /// block a launch without bound is the CUDA driver's launch queue, full behind a kernel
    /// that never ends, and only this abort ends such a kernel: so after ABORT_GRACE the
    /// abort goes ahead anyway (logged), the one case where a launch may still be inside
    /// an NCCL call on the handle being aborted.
    ///
    /// The communicators are aborted at once, each on its own thread: NCCL's abort of one
    /// may wait for GPU work that only the abort of another ends. On 4 H200s as 2 emulated
    /// hosts, with a rank killed, its cross-host peer never returned after the aborts when
    /// they ran one after the other (flat first); a kernel of the cross communicator, stuck
    /// on the dead peer, holding up the flat communicator's abort is the suspected cause.
    fn abort_comms(&self) {
        let guard = self.gate.try_write_for(ABORT_GRACE);
        if guard.is_none() {
            tracing::warn!(
                rank = self.rank,
                "rsccl: a launch did not leave its NCCL call within {ABORT_GRACE:?}; aborting the communicators anyway"
            );
        }
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
    /// The hierarchical reduce_scatter's buffer (0: none) and its bytes.
    hier_scratch: u64,
    hier_scratch_bytes: u64,
    local_index: usize,
    host_index: usize,
    /// See `host_major`: all_gather and reduce_scatter run hierarchically only then.
    host_major: bool,
    ranks_per_host: Vec<usize>,
    /// Host index of every group rank, and this host's ranks (send/recv to a rank of this
    /// host go to the local rsccl engine, when there is one).
    host_of: Vec<usize>,
    local_ranks: Vec<usize>,
    hier_min: u64,
    sync_on_caller: bool,
    nccl_bytes: u64,
    collectives: AtomicU64,
    hierarchical: AtomicU64,
    p2p_bytes: u64,
    p2p_messages: AtomicU64,
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
fn share_id(
    store: &dyn Store,
    nccl: &Nccl,
    nonce: &[u8; 16],
    role: CommRole,
    make: bool,
    members: usize,
    deadline: Instant,
) -> Result<[u8; 128]> {
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

/// What `NcclEngine::build` made.
struct Built {
    sh: Arc<Shared>,
    /// Device memory of every communicator's creation and warm-up; of the pair ones alone.
    nccl_bytes: u64,
    p2p_bytes: u64,
    /// The pair communicators' names (kept alive with the engine, as the others').
    pair_names: Vec<CString>,
}

/// Create this rank's pair communicators (see PairComm): every rank of the group runs
/// every round of `p2p_split_rounds` (ncclCommSplit of the flat communicator is
/// collective), passing as colour its pair's index in the round and as key 0 to send, 1
/// to receive, or NCCL_SPLIT_NOCOLOR when it has no pair in the round. Then warm them up
/// (`warm_pairs`). Returns them, the device memory the splits and the warm-up took, and
/// their names. On failure every pair communicator made is aborted and its stream freed.
///
/// Not bounded by the deadline between rounds: a rank that gave up would leave the
/// others inside the next (blocking) split; as with ncclCommInitRank, a rank that dies
/// during creation leaves its peers there.
fn make_pairs(
    flat: &NcclComm,
    dev: &Device,
    topo: &Topology,
    cfg: &Config,
    same_host: bool,
    warm: u64,
    deadline: Instant,
) -> Result<(Vec<PairComm>, u64, Vec<CString>)> {
    let me = topo.rank;
    let rounds = p2p_split_rounds(&topo.hosts, same_host);
    let _ctx = dev.bind()?;
    let before = free_bytes()?;
    // The streams first: once the splits have started, a rank must not fail alone.
    let mine = rounds.iter().filter(|r| r.iter().any(|&(s, d)| s == me || d == me)).count();
    let mut streams = Vec::with_capacity(mine);
    let free_streams = |streams: &[CUstream]| {
        for &st in streams {
            // SAFETY: ours, with nothing queued that is not ended (see the callers).
            unsafe { cu::cuStreamDestroy_v2(st) };
        }
    };
    for _ in 0..mine {
        let mut st: CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; a non-blocking stream does not sync with stream 0.
        if let Err(e) = check(unsafe { cu::cuStreamCreate(&mut st, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }, "cuStreamCreate") {
            free_streams(&streams);
            return Err(e);
        }
        streams.push(st);
    }
    let mut pairs: Vec<PairComm> = Vec::with_capacity(mine);
    let mut names = Vec::with_capacity(mine);
    let mut made = || -> Result<()> {
        for round in &rounds {
            let slot = round.iter().position(|&(s, d)| s == me || d == me);
            let (sending, peer) = match slot.map(|i| round[i]) {
                Some((s, d)) => (s == me, if s == me { d } else { s }),
                None => (false, 0),
            };
            let name = CString::new(match slot {
                Some(_) if sending => format!("rsccl-p2p-r{me}-to-r{peer}"),
                Some(_) => format!("rsccl-p2p-r{peer}-to-r{me}"),
                None => "rsccl-p2p-none".to_string(),
            })
            .map_err(|_| Error::Internal("NUL in a name".into()))?;
            let comm = flat.split(slot, if sending { 0 } else { 1 }, 2, cfg.nccl_p2p_max_ctas, &name)?;
            match (comm, slot) {
                (Some(comm), Some(_)) => {
                    let stream = streams[pairs.len()];
                    pairs.push(PairComm { peer, sending, comm, stream });
                    names.push(name);
                }
                (None, None) => {}
                (Some(comm), None) => {
                    comm.abort();
                    return Err(Error::Internal("ncclCommSplit made a communicator for NCCL_SPLIT_NOCOLOR".into()));
                }
                (None, Some(_)) => {
                    return Err(Error::Internal(format!("ncclCommSplit made no communicator for rank {me} and rank {peer}")))
                }
            }
        }
        warm_pairs(&pairs, warm, deadline)
    };
    let result = made();
    if let Err(e) = result {
        for p in &pairs {
            p.comm.abort();
        }
        // SAFETY: the aborts ended the pairs' kernels; the streams drain.
        unsafe {
            for &st in &streams {
                cu::cuStreamSynchronize(st);
            }
        }
        free_streams(&streams);
        return Err(e);
    }
    let bytes = before.saturating_sub(free_bytes()?);
    Ok((pairs, bytes, names))
}

/// One small and one larger message on every pair communicator, sent or received on its
/// stream, all in one NCCL group (NCCL connects the communicators of one group in
/// parallel, one thread each, so no pair waits for another's connection), then wait for
/// every stream (at most until `deadline`, watching each communicator's asynchronous
/// error). NCCL connects a peer and allocates its buffers at the first send/recv; this
/// moves that to group creation. The sends read the start of `warm`, the receives all
/// land at PAIR_WARM_RECV_AT (what they write is never read). On failure the caller
/// aborts the pairs.
fn warm_pairs(pairs: &[PairComm], warm: u64, deadline: Instant) -> Result<()> {
    let Some(first) = pairs.first() else { return Ok(()) };
    let f = first.comm.fns();
    let u8_ = nc::ncclDataType_t::ncclUint8;
    let ok = nc::ncclResult_t::ncclSuccess;
    // SAFETY: live communicators and streams of this device; every message lies inside
    // the warm buffer (WARM_BYTES: sends at its start, receives at PAIR_WARM_RECV_AT,
    // PAIR_WARM_BYTES at most 1 MiB each).
    let mut r = unsafe { (f.group_start)() };
    if r == ok {
        for p in pairs {
            let raw = p.comm.raw();
            let s = p.stream as nc::cudaStream_t;
            for n in PAIR_WARM_BYTES {
                // SAFETY: as above.
                let rr = unsafe {
                    if p.sending {
                        (f.send)(warm as *const c_void, n, u8_, 1, raw, s)
                    } else {
                        (f.recv)((warm + PAIR_WARM_RECV_AT) as *mut c_void, n, u8_, 0, raw, s)
                    }
                };
                if r == ok {
                    r = rr;
                }
            }
        }
        // The group is closed whatever happened inside it.
        // SAFETY: closes the group opened above.
        let end = unsafe { (f.group_end)() };
        if r == ok {
            r = end;
        }
    }
    first.comm.check(r, "NCCL send/recv (warm-up of the pair communicators at group creation)")?;
    let mut events = Vec::with_capacity(pairs.len());
    let mut result = Ok(());
    for p in pairs {
        match new_event() {
            Ok(ev) => {
                events.push(ev);
                // SAFETY: valid event and stream.
                if let Err(e) = check(unsafe { cu::cuEventRecord(ev, p.stream) }, "cuEventRecord") {
                    result = Err(e);
                    break;
                }
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    'wait: while result.is_ok() {
        let mut pending = false;
        for &ev in &events {
            // SAFETY: valid event.
            match unsafe { cu::cuEventQuery(ev) } {
                cu::CUresult::CUDA_SUCCESS => {}
                cu::CUresult::CUDA_ERROR_NOT_READY => pending = true,
                e => {
                    result = check(e, "cuEventQuery (NCCL pair warm-up)");
                    break 'wait;
                }
            }
        }
        if !pending {
            break;
        }
        if let Some(e) = pairs.iter().find_map(|p| p.comm.async_error().err()) {
            result = Err(e);
            break;
        }
        if Instant::now() > deadline {
            result = Err(Error::Timeout(
                "the warm-up of the NCCL pair communicators (send/recv) at group creation did not finish within the group \
                 timeout: a rank stopped during creation"
                    .into(),
            ));
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    for ev in events {
        // SAFETY: ours; a pending record on it is harmless (the caller aborts the pairs).
        unsafe { cu::cuEventDestroy_v2(ev) };
    }
    result
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
            CString::new(format!("rsccl-cross{}-r{}", topo.local_index(), topo.rank))
                .map_err(|_| Error::Internal("NUL in a name".into()))?,
        ];
        let ctx = dev.bind()?;
        let mut internal: CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; a non-blocking stream does not sync with stream 0.
        check(unsafe { cu::cuStreamCreate(&mut internal, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }, "cuStreamCreate")?;
        let major = hierarchical && host_major(&topo.hosts);
        // Only a group that can take the hierarchical reduce_scatter holds its buffer.
        let hier_scratch_bytes = if major { cfg.nccl_hierarchical_scratch_bytes as usize } else { 0 };
        let mut bufs = [0u64; 3];
        for (b, len) in bufs.iter_mut().zip([SCRATCH_BYTES, WARM_BYTES, hier_scratch_bytes]) {
            if len == 0 {
                continue;
            }
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
        let [scratch, warm, hier_scratch] = bufs;
        // SAFETY: both buffers are ours; zeroing makes the warm-up's reductions finite.
        unsafe {
            check(cu::cuMemsetD8_v2(scratch, 0, SCRATCH_BYTES), "cuMemsetD8")?;
            check(cu::cuMemsetD8_v2(warm, 0, WARM_BYTES), "cuMemsetD8")?;
            check(cu::cuCtxSynchronize(), "cuCtxSynchronize")?;
        }
        drop(ctx);
        let result = Self::build(
            nccl,
            dev.clone(),
            topo,
            store,
            nonce,
            listener,
            cfg,
            timeout,
            deadline,
            hierarchical,
            internal,
            scratch,
            warm,
            &names,
        );
        let _ctx = dev.bind()?;
        // SAFETY: the warm-up finished (build waited for it), or failed before launching,
        // or aborted its communicators, which ends their kernels: the stream drains, then
        // the buffer (ours) is free of users.
        unsafe {
            cu::cuStreamSynchronize(internal);
            cu::cuMemFree_v2(warm);
        }
        match result {
            Ok(Built { sh, nccl_bytes, p2p_bytes, pair_names }) => {
                let mut names = names;
                names.extend(pair_names);
                let engine = Arc::new(NcclEngine {
                    sh: sh.clone(),
                    internal,
                    scratch,
                    hier_scratch,
                    hier_scratch_bytes: hier_scratch_bytes as u64,
                    local_index: topo.local_index(),
                    host_index: topo.host_of[topo.rank],
                    host_major: major,
                    ranks_per_host,
                    host_of: topo.host_of.clone(),
                    local_ranks: topo.local_ranks().to_vec(),
                    hier_min: cfg.nccl_hierarchical_min_bytes,
                    sync_on_caller: cfg.cuda_sync_stream,
                    nccl_bytes,
                    collectives: AtomicU64::new(0),
                    hierarchical: AtomicU64::new(0),
                    p2p_bytes,
                    p2p_messages: AtomicU64::new(0),
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
                    host_major = major,
                    hier_scratch_bytes,
                    nccl_bytes,
                    p2p_bytes,
                    "rsccl: NCCL engine ready: {} communicator(s) ({} for send/recv), {} MiB of device memory taken by NCCL",
                    engine.stats().communicators,
                    engine.sh.pairs.len(),
                    nccl_bytes >> 20
                );
                Ok(engine)
            }
            Err(e) => {
                // SAFETY: nothing runs on them any more (see above).
                unsafe {
                    cu::cuMemFree_v2(scratch);
                    if hier_scratch != 0 {
                        cu::cuMemFree_v2(hier_scratch);
                    }
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
    ) -> Result<Built> {
        let host = topo.host_of[topo.rank];
        let li = topo.local_index();
        let (flat, flat_bytes) = {
            let id = share_id(store, nccl, nonce, CommRole::Flat, topo.rank == 0, topo.size, deadline)?;
            let _ctx = dev.bind()?;
            let before = free_bytes()?;
            let comm = NcclComm::init(nccl, &id, topo.rank, topo.size, cfg.nccl_max_ctas, &names[0])?;
            warm_up(&comm, internal, warm, scratch, true, deadline)?;
            (comm, before.saturating_sub(free_bytes()?))
        };
        let hier = || -> Result<(Arc<CudaEngine>, NcclComm, u64)> {
            let ranks = topo.local_ranks().to_vec();
            let mesh = Arc::new(LocalMesh::connect(listener, nonce, &ranks, li, deadline, &[])?);
            let local = CudaEngine::create(dev.ordinal, mesh, ranks, cfg, timeout, deadline)?;
            let hosts = topo.hosts.len();
            let id = share_id(store, nccl, nonce, CommRole::Cross(li), host == 0, hosts, deadline)?;
            let _ctx = dev.bind()?;
            let before = free_bytes()?;
            let comm = NcclComm::init(nccl, &id, host, hosts, cfg.nccl_max_ctas, &names[1])?;
            // The cross communicators run collectives only (no send/recv).
            warm_up(&comm, internal, warm, scratch, false, deadline)?;
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
        let (mut pairs, mut p2p_bytes, mut pair_names) = (Vec::new(), 0, Vec::new());
        if cfg.nccl_p2p {
            // Pairs on one host need NCCL only where no rsccl engine runs inside the host.
            match make_pairs(&flat, &dev, topo, cfg, local.is_none(), warm, deadline) {
                Ok((p, b, n)) => (pairs, p2p_bytes, pair_names) = (p, b, n),
                Err(e) => {
                    flat.abort();
                    if let Some(c) = &cross {
                        c.abort();
                    }
                    return Err(e);
                }
            }
        }
        let sh = Arc::new(Shared {
            dev,
            flat,
            cross,
            pairs,
            local,
            rank: topo.rank,
            timeout,
            gate: RwLock::new(()),
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
        Ok(Built { sh, nccl_bytes: flat_bytes + cross_bytes + p2p_bytes, p2p_bytes, pair_names })
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
        let Some(local) = &self.sh.local else { return Ok(CrossHost::Flat) };
        let (hosts, major, min) = (&self.ranks_per_host, self.host_major, self.hier_min);
        Ok(match c.kind {
            CudaKind::AllReduce => {
                let ok = local.supports_reduce_scatter(c.dtype, c.op);
                all_reduce_path(c.count, c.dtype.size(), c.op, ok, hosts, min).0
            }
            CudaKind::AllGather => all_gather_path(c.count, hosts, major, min).0,
            CudaKind::ReduceScatter => {
                let ok = local.supports_reduce_scatter(c.dtype, c.op);
                reduce_scatter_path(c.count, c.dtype.size(), c.op, ok, hosts, major, min, self.hier_scratch_bytes).0
            }
            _ => CrossHost::Flat,
        })
    }

    /// Launch one collective. Returns the end event for an asynchronous call (the Work
    /// waits on it); a blocking call is ordered before the caller's later work already.
    pub fn launch(&self, c: &CudaCall) -> Result<Option<CudaEvent>> {
        self.health()?;
        self.failing_group(self.launch_inner(c, None))
    }

    /// Launch one all_to_all over every rank of the group (see `AllToAll`; every list has
    /// one entry per rank, in group-rank order): one NCCL group of sends and receives on
    /// the flat communicator. NCCL cannot check that the ranks' splits agree: a rank that
    /// expects other sizes than its peer sends hangs the call until the watchdog's timeout
    /// aborts the group.
    pub fn launch_all_to_all(&self, x: &AllToAll, stream: u64, asynchronous: bool) -> Result<Option<CudaEvent>> {
        self.health()?;
        let n = self.sh.flat.nranks;
        if [&x.send, &x.send_bytes, &x.recv, &x.recv_bytes].iter().any(|v| v.len() != n) {
            // The Python layer builds one entry per rank: this is a bug, and the peers
            // would wait for this rank, so it fails the group.
            return Err(self.sh.fail(Error::Internal(format!(
                "rank {}: an all_to_all with {}/{}/{}/{} chunk entries for a group of {n}",
                self.sh.rank,
                x.send.len(),
                x.send_bytes.len(),
                x.recv.len(),
                x.recv_bytes.len()
            ))));
        }
        let total: u64 = x.send_bytes.iter().sum();
        let c = CudaCall::bare(CudaKind::AllToAll, total, stream, asynchronous);
        self.failing_group(self.launch_inner(&c, Some(x)))
    }

    /// Launch one CUDA send (`send`) or recv of `bytes` at `ptr` with group rank `peer`,
    /// after the work queued so far on the caller's `stream`. A rank of this host goes to
    /// the local rsccl engine where there is one (its kernels run each (peer, direction)
    /// on its own stream too); any other rank to the pair communicator of this direction,
    /// on its own stream. Not ordered after the group's collectives, nor they after it:
    /// only the caller's stream orders them (as torch's NCCL backend, whose send/recv run
    /// on communicators of their own). Returns the end event of an asynchronous call; a
    /// blocking one makes the caller's stream wait for it.
    ///
    /// NCCL cannot check that the sizes agree: a recv of more bytes than its peer sends (or
    /// fewer) waits until the watchdog's timeout aborts the group.
    pub fn launch_p2p(&self, send: bool, ptr: u64, bytes: u64, peer: usize, stream: u64, asynchronous: bool) -> Result<Option<CudaEvent>> {
        let (me, n) = (self.sh.rank, self.sh.flat.nranks);
        let what = if send { "send to" } else { "recv from" };
        if peer >= n || peer == me {
            return Err(Error::InvalidArgument(format!("rank {me}: CUDA {what} rank {peer}: not another rank of this group of {n}")));
        }
        self.health()?;
        if self.host_of[peer] == self.host_of[me] {
            if let Some(local) = &self.sh.local {
                let li = self
                    .local_ranks
                    .iter()
                    .position(|&r| r == peer)
                    .ok_or_else(|| Error::Internal(format!("rank {peer} is not among this host's ranks")))?;
                return local.launch_p2p(send, ptr, bytes, li, stream, asynchronous);
            }
        }
        let Some(pair) = self.sh.pairs.iter().find(|p| p.peer == peer && p.sending == send) else {
            return Err(Error::InvalidType(format!(
                "rank {me}: CUDA {what} rank {peer} (on another host) runs on a NCCL communicator of that pair, which \
                 this group does not have: it was created with nccl_p2p = 0 (rsccl.Options(nccl_p2p=...) or \
                 RSCCL_NCCL_P2P). Create it with nccl_p2p = 1 (the default), or use all_to_all or CPU tensors"
            )));
        };
        self.failing_group(self.launch_pair(pair, ptr, bytes, stream, asynchronous))
    }

    /// The NCCL part of launch_p2p: `pair`'s stream waits for the caller's, then one
    /// ncclSend to NCCL rank 1 (or ncclRecv from NCCL rank 0) on it, tracked by the
    /// watchdog, then its end event. An empty message makes no NCCL call (both sides skip
    /// it, as they agree on the size).
    fn launch_pair(&self, pair: &PairComm, ptr: u64, bytes: u64, caller: u64, asynchronous: bool) -> Result<Option<CudaEvent>> {
        let sh = &self.sh;
        let _ctx = sh.dev.bind()?;
        let target = pair.stream as u64;
        // The pair's handle is read (`live()`) under this, so no abort or close frees it
        // meanwhile (Shared::abort_comms).
        let _gate = sh.gate.read();
        let mut o = sh.order.lock();
        // Shutdown sets `stop` under this lock: no launch starts after it.
        if sh.stop.load(Ordering::Acquire) {
            return Err(Error::Aborted("the group was destroyed".into()));
        }
        join(&mut o, caller, target)?;
        // As in launch_inner: the watchdog ages a send/recv from its start on the GPU.
        let tracked = !is_capturing(target)?;
        let start = if tracked { Some(record(&mut o, target)?) } else { None };
        if bytes > 0 {
            let raw = pair.comm.live()?;
            let f = pair.comm.fns();
            let (u8_, s) = (nc::ncclDataType_t::ncclUint8, target as nc::cudaStream_t);
            // SAFETY: `raw` is a live communicator (aborts wait for the gate held shared
            // here, see Shared::abort_comms); `ptr` is a device buffer of `bytes` bytes that
            // the Python layer checked and keeps alive until the end event; `s` is the
            // pair's stream, on the communicator's device.
            let r = unsafe {
                if pair.sending {
                    (f.send)(ptr as *const c_void, bytes as usize, u8_, 1, raw, s)
                } else {
                    (f.recv)(ptr as *mut c_void, bytes as usize, u8_, 0, raw, s)
                }
            };
            let what = if pair.sending { format!("NCCL send to rank {}", pair.peer) } else { format!("NCCL recv from rank {}", pair.peer) };
            pair.comm.check(r, &what)?;
        }
        self.p2p_messages.fetch_add(1, Ordering::Relaxed);
        let kind = if pair.sending { CudaKind::Send } else { CudaKind::Recv };
        if let Some(start) = start {
            let ev = record(&mut o, target).inspect_err(|_| o.free_events.push(start))?;
            sh.pending.lock().push_back(Tracked { start, ev, started: None, kind, count: bytes, peer: Some(pair.peer) });
        }
        let ev = record(&mut o, target)?;
        if asynchronous {
            let home: std::sync::Weak<dyn EventHome> = Arc::downgrade(&self.sh) as std::sync::Weak<Shared>;
            return Ok(Some(CudaEvent::new(ev, home, sh.dev.clone(), sh.timeout)));
        }
        // SAFETY: valid event and caller stream; the wait captures the record, so the
        // event can be reused right away.
        let r = check(unsafe { cu::cuStreamWaitEvent(caller as CUstream, ev, 0) }, "cuStreamWaitEvent");
        o.free_events.push(ev);
        r.map(|_| None)
    }

    /// An error of a launch that may have left peers waiting makes the group unusable;
    /// one found before anything was enqueued (a bad argument) leaves it as it was.
    fn failing_group(&self, r: Result<Option<CudaEvent>>) -> Result<Option<CudaEvent>> {
        match r {
            Ok(ev) => Ok(ev),
            Err(e) if e.keeps_group_usable() => Err(e),
            Err(e) => Err(self.sh.fail(e)),
        }
    }

    fn launch_inner(&self, c: &CudaCall, a2a: Option<&AllToAll>) -> Result<Option<CudaEvent>> {
        let path = if a2a.is_some() { CrossHost::Flat } else { self.path(c)? };
        let sh = &self.sh;
        let _ctx = sh.dev.bind()?;
        let caller = c.stream;
        let internal = self.internal as u64;
        let target = if c.asynchronous || !self.sync_on_caller { internal } else { caller };
        // Every communicator handle used below is read (`live()`, `raw()`) under this, so
        // no abort or close frees it meanwhile (Shared::abort_comms).
        let _gate = sh.gate.read();
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
        // The watchdog follows every launch it can query (not one being captured into a
        // graph: it runs when the graph is replayed), from an event recorded right before
        // it (its start on the GPU) to one right after (its end).
        let tracked = !is_capturing(target)?;
        let start = if tracked { Some(record(&mut o, target)?) } else { None };
        let enqueued = match (a2a, path) {
            (Some(x), _) => self.enqueue_all_to_all(x, target),
            (None, CrossHost::Flat) => self.enqueue_flat(c, target),
            (None, CrossHost::Hierarchical) => {
                let r = match c.kind {
                    CudaKind::AllReduce => self.enqueue_hierarchical(c, target),
                    CudaKind::AllGather => self.enqueue_hier_all_gather(c, target),
                    CudaKind::ReduceScatter => self.enqueue_hier_reduce_scatter(c, target),
                    k => Err(Error::Internal(format!("no hierarchical {}", k.name()))),
                };
                if r.is_ok() {
                    self.hierarchical.fetch_add(1, Ordering::Relaxed);
                }
                r
            }
        };
        if let Err(e) = enqueued {
            // Recorded on the stream already: harmless to reuse (a later record replaces it).
            o.free_events.extend(start);
            return Err(e);
        }
        o.last_stream = Some(target);
        self.collectives.fetch_add(1, Ordering::Relaxed);
        if let Some(start) = start {
            let ev = record(&mut o, target).inspect_err(|_| o.free_events.push(start))?;
            sh.pending.lock().push_back(Tracked { start, ev, started: None, kind: c.kind, count: c.count, peer: None });
        }
        if target == caller {
            return Ok(None);
        }
        let ev = record(&mut o, target)?;
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
        // gate the caller holds shared, see Shared::abort_comms); the pointers are device
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
                CudaKind::AllToAll => return Err(Error::Internal("all_to_all is launched through launch_all_to_all".into())),
                CudaKind::Send | CudaKind::Recv => {
                    return Err(Error::InvalidType(format!(
                        "CUDA {} in a group that spans hosts is not supported (NCCL engine)",
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

    /// all_to_all as one NCCL group on the flat communicator: a send of every non-empty
    /// chunk to its peer and a receive of every non-empty chunk from its peer, this rank's
    /// own chunk included (NCCL matches a send to self with the receive from self in the
    /// same group, as torch's NCCL all_to_all does). Empty chunks are skipped on both
    /// sides, which agree when the splits do.
    fn enqueue_all_to_all(&self, x: &AllToAll, stream: u64) -> Result<()> {
        let comm = &self.sh.flat;
        let raw = comm.raw();
        if raw.is_null() {
            return Err(Error::Aborted("the NCCL communicator was aborted".into()));
        }
        let f = comm.fns();
        let s = stream as nc::cudaStream_t;
        let u8_ = nc::ncclDataType_t::ncclUint8;
        let ok = nc::ncclResult_t::ncclSuccess;
        // SAFETY: as in enqueue_flat; every chunk is a device range of the bytes given
        // next to it, inside the tensors the Python layer checked and keeps alive.
        let mut r = unsafe { (f.group_start)() };
        if r == ok {
            for peer in 0..comm.nranks {
                let (sb, rb) = (x.send_bytes[peer] as usize, x.recv_bytes[peer] as usize);
                if sb > 0 {
                    // SAFETY: as above.
                    let rr = unsafe { (f.send)(x.send[peer] as *const c_void, sb, u8_, peer as i32, raw, s) };
                    if r == ok {
                        r = rr;
                    }
                }
                if rb > 0 {
                    // SAFETY: as above.
                    let rr = unsafe { (f.recv)(x.recv[peer] as *mut c_void, rb, u8_, peer as i32, raw, s) };
                    if r == ok {
                        r = rr;
                    }
                }
            }
            // The group is closed whatever happened inside it.
            // SAFETY: closes the group opened above.
            let end = unsafe { (f.group_end)() };
            if r == ok {
                r = end;
            }
        }
        comm.check(r, "NCCL all_to_all (send/recv)")
    }

    /// The engines of the hierarchical path.
    fn hier_engines(&self) -> Result<(&Arc<CudaEngine>, &NcclComm, nc::ncclComm_t)> {
        let (local, cross) = match (&self.sh.local, &self.sh.cross) {
            (Some(l), Some(x)) => (l, x),
            _ => return Err(Error::Internal("hierarchical path without its engines".into())),
        };
        let raw = cross.raw();
        if raw.is_null() {
            return Err(Error::Aborted("the NCCL communicator was aborted".into()));
        }
        Ok((local, cross, raw))
    }

    /// all_gather (count = n bytes per rank; `out` holds world x n bytes in rank order)
    /// in two phases on `stream`, for host-major ranks (rank r = h * L + l):
    ///   1. across hosts, among the ranks of my local index l (one per host, cross rank =
    ///      host index): one NCCL group of H broadcasts, root h sending its piece, which
    ///      every member receives at its place in `out`, (h * L + l) * n. After it, my
    ///      `out` holds the pieces of local index l of every host. Each rank sends and
    ///      receives only n bytes per host across hosts, as a flat ring would.
    ///   2. inside the host, for every host h: rsccl's all_gather of the piece at
    ///      (h * L + l) * n (in place: it is my slot of host h's block) into host h's
    ///      block `out + h * L * n`, filling the pieces of the other local indices.
    ///
    /// H host-local launches (each with its barrier): hosts >= 2, messages >=
    /// nccl_hierarchical_min_bytes keep their cost small against the bytes moved.
    fn enqueue_hier_all_gather(&self, c: &CudaCall, stream: u64) -> Result<()> {
        let (local, cross, raw) = self.hier_engines()?;
        let l = local.local_size() as u64;
        let hosts = self.ranks_per_host.len() as u64;
        let (me, li, n) = (self.host_index as u64, self.local_index as u64, c.count);
        let piece = |h: u64| c.out + (h * l + li) * n;
        let fatal =
            |e: Error| if e.keeps_group_usable() { Error::Aborted(format!("a hierarchical all_gather failed part-way: {e}")) } else { e };
        let f = cross.fns();
        let s = stream as nc::cudaStream_t;
        let ok = nc::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator (see enqueue_flat); every piece lies inside `out`
        // (world x n bytes: h < H, l < L); `inp` holds n bytes; a live stream. Non-root
        // members ignore the send buffer; the root copies into its own piece (or nothing,
        // when the input already is that piece: in place).
        let mut r = unsafe { (f.group_start)() };
        if r == ok {
            for h in 0..hosts {
                let dst = piece(h);
                let src = if h == me { c.inp } else { dst };
                // SAFETY: as above.
                let rr = unsafe {
                    (f.broadcast)(src as *const c_void, dst as *mut c_void, n as usize, nc::ncclDataType_t::ncclUint8, h as i32, raw, s)
                };
                if r == ok {
                    r = rr;
                }
            }
            // SAFETY: closes the group opened above.
            let end = unsafe { (f.group_end)() };
            if r == ok {
                r = end;
            }
        }
        cross.check(r, "NCCL broadcast (cross-host phase of a hierarchical all_gather)").map_err(fatal)?;
        for h in 0..hosts {
            let call = CudaCall {
                kind: CudaKind::AllGather,
                dtype: DType::U8,
                op: c.op,
                root: 0,
                inp: piece(h),
                out: c.out + h * l * n,
                count: n,
                stream,
                asynchronous: false,
            };
            local.launch(&call).map_err(fatal)?;
        }
        Ok(())
    }

    /// reduce_scatter (count = m output elements; `inp` holds world x m in rank order) in
    /// two phases on `stream`, for host-major ranks (rank r = h * L + l):
    ///   1. inside the host, for every host h: rsccl's reduce_scatter of host h's block of
    ///      the input (L x m elements at h * L * m) into the scratch at h * m. After it, my
    ///      scratch holds, for every h, the sum over my host's ranks of block h * L + l.
    ///   2. across hosts, among the ranks of my local index l (cross rank = host index):
    ///      NCCL reduce_scatter of the scratch (H x m) into `out` (m): cross rank h gets
    ///      the sum over hosts of their partial sums of block h * L + l, i.e. the sum over
    ///      every rank of my block. Each rank sends and receives (H - 1) x m elements across
    ///      hosts, as a flat ring would.
    ///
    /// The scratch (hosts x m elements, checked by reduce_scatter_path) is reused by the
    /// next call: the launches are ordered (one stream, joins across streams), so that
    /// call's first phase runs after this one's NCCL step read it.
    fn enqueue_hier_reduce_scatter(&self, c: &CudaCall, stream: u64) -> Result<()> {
        let (local, cross, raw) = self.hier_engines()?;
        let l = local.local_size() as u64;
        let hosts = self.ranks_per_host.len() as u64;
        let mb = c.count * c.dtype.size() as u64;
        if self.hier_scratch == 0 || hosts * mb > self.hier_scratch_bytes {
            return Err(Error::Internal("hierarchical reduce_scatter without room in its scratch".into()));
        }
        let fatal = |e: Error| {
            if e.keeps_group_usable() {
                Error::Aborted(format!("a hierarchical reduce_scatter failed part-way: {e}"))
            } else {
                e
            }
        };
        for h in 0..hosts {
            let call = CudaCall {
                kind: CudaKind::ReduceScatter,
                dtype: c.dtype,
                op: c.op,
                root: 0,
                inp: c.inp + h * l * mb,
                out: self.hier_scratch + h * mb,
                count: c.count,
                stream,
                asynchronous: false,
            };
            local.launch(&call).map_err(fatal)?;
        }
        let dt = nccl_dtype(c.dtype).ok_or_else(|| Error::Internal("checked dtype".into()))?;
        let op = nccl_op(c.op).ok_or_else(|| Error::Internal("checked op".into()))?;
        // SAFETY: a live communicator (see enqueue_flat); the scratch holds hosts x m
        // elements (checked above), `out` m elements (checked by the Python layer); a live
        // stream.
        let r = unsafe {
            (cross.fns().reduce_scatter)(
                self.hier_scratch as *const c_void,
                c.out as *mut c_void,
                c.count as usize,
                dt,
                op,
                raw,
                stream as nc::cudaStream_t,
            )
        };
        cross.check(r, "NCCL reduce_scatter (cross-host phase of a hierarchical reduce_scatter)").map_err(fatal)
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
        let fatal =
            |e: Error| if e.keeps_group_usable() { Error::Aborted(format!("a hierarchical all_reduce failed part-way: {e}")) } else { e };
        local.launch(&call(CudaKind::ReduceScatter, c.dtype, c.inp, mine, shard)).map_err(fatal)?;
        let raw = cross.live()?;
        let dt = nccl_dtype(c.dtype).ok_or_else(|| Error::Internal("checked dtype".into()))?;
        let op = nccl_op(c.op).ok_or_else(|| Error::Internal("checked op".into()))?;
        // SAFETY: a live communicator (see enqueue_flat); `mine` is this rank's shard of
        // `out` (shard elements, inside the count the caller checked); a live stream.
        let r = unsafe {
            (cross.fns().all_reduce)(mine as *const c_void, mine as *mut c_void, shard as usize, dt, op, raw, stream as nc::cudaStream_t)
        };
        cross.check(r, "NCCL all_reduce (cross-host phase of a hierarchical all_reduce)")?;
        local.launch(&call(CudaKind::AllGather, DType::U8, mine, c.out, shard_bytes)).map_err(fatal)?;
        Ok(())
    }

    pub fn stats(&self) -> NcclStats {
        NcclStats {
            device: self.sh.dev.ordinal,
            nccl_bytes: self.nccl_bytes,
            scratch_bytes: self.hier_scratch_bytes,
            communicators: 1 + self.sh.cross.is_some() as u64 + self.sh.pairs.len() as u64,
            collectives: self.collectives.load(Ordering::Relaxed),
            hierarchical_collectives: self.hierarchical.load(Ordering::Relaxed),
            p2p_communicators: self.sh.pairs.len() as u64,
            p2p_bytes: self.p2p_bytes,
            p2p_messages: self.p2p_messages.load(Ordering::Relaxed),
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
            // Queued sends and receives.
            streams.extend(sh.pairs.iter().map(|p| p.stream as u64));
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
            // Launches are refused from here on (stop), and the queued work finished; the
            // gate keeps a concurrent health check's error query off the handles.
            let _gate = sh.gate.try_write_for(ABORT_GRACE);
            for (_, c) in sh.comms() {
                c.close();
            }
        } else {
            tracing::warn!(
                rank = sh.rank,
                "rsccl: aborting the group's NCCL communicators at shutdown (the group failed or its work did not finish)"
            );
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
            if self.hier_scratch != 0 {
                cu::cuMemFree_v2(self.hier_scratch);
            }
            cu::cuStreamDestroy_v2(self.internal);
            // The pair communicators were closed or aborted by shutdown: their streams drain.
            for p in &self.sh.pairs {
                cu::cuStreamSynchronize(p.stream);
                cu::cuStreamDestroy_v2(p.stream);
            }
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
                cu::cuEventDestroy_v2(t.start);
                cu::cuEventDestroy_v2(t.ev);
            }
            for ev in self.order.get_mut().free_events.drain(..) {
                cu::cuEventDestroy_v2(ev);
            }
        }
    }
}

/// Make `to` wait for the work queued on `from` so far.
/// An event from the free list (or a new one), recorded on `stream`; it goes back to the
/// list if the record fails.
fn record(o: &mut Order, stream: u64) -> Result<CUevent> {
    let ev = o.free_events.pop().map(Ok).unwrap_or_else(new_event)?;
    // SAFETY: a valid event of ours and a live stream (the caller's, or one of ours).
    if let Err(e) = check(unsafe { cu::cuEventRecord(ev, stream as CUstream) }, "cuEventRecord") {
        o.free_events.push(ev);
        return Err(e);
    }
    Ok(ev)
}

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

/// The collectives a communicator will run, once each at a small and a large size, and
/// (`p2p`) sends and receives with every rank, on the internal stream, then wait (at most
/// until `deadline`): NCCL connects peers and allocates the buffers of each algorithm and
/// protocol at their first use, so this moves that to group creation. `warm` holds
/// WARM_BYTES, `scratch` SCRATCH_BYTES.
fn warm_up(comm: &NcclComm, stream: CUstream, warm: u64, scratch: u64, p2p: bool, deadline: Instant) -> Result<()> {
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
    // gather, scatter and all_to_all (flat communicator only: `p2p`) are NCCL groups of
    // sends and receives, whose point-to-point connections NCCL makes (and whose buffers
    // it allocates) at the first send or receive with each peer: one group with a send to
    // and a receive from every rank, this one included (as all_to_all and the rooted calls
    // do), connects them all now, once with a tiny message and once with a larger one
    // (NCCL picks its protocol by size).
    for per_peer in [1usize, p2p_warm_bytes(n)].into_iter().filter(|_| p2p) {
        comm.check(warm_p2p(comm, stream, warm, per_peer), "NCCL send/recv (warm-up at group creation)")?;
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

/// Bytes per peer of the larger point-to-point warm-up: the sends read the first half of
/// the warm buffer, the receives write the second, `n` pieces each, in 256-byte units
/// (at least 1 byte, for very large groups).
pub fn p2p_warm_bytes(n: usize) -> usize {
    ((WARM_BYTES / 2 / n.max(1)) & !255).max(1)
}

/// One NCCL group of a `per_peer`-byte send to and receive from every rank of `comm` (self
/// included), on `stream`: sends from the first half of `warm`, receives into the second.
fn warm_p2p(comm: &NcclComm, stream: CUstream, warm: u64, per_peer: usize) -> nc::ncclResult_t {
    let (f, raw, s) = (comm.fns(), comm.raw(), stream as nc::cudaStream_t);
    let u8_ = nc::ncclDataType_t::ncclUint8;
    let ok = nc::ncclResult_t::ncclSuccess;
    let half = (WARM_BYTES / 2) as u64;
    // SAFETY: a live communicator and stream; every piece lies in its half of the warm
    // buffer: at + per_peer <= half, since per_peer x nranks <= half when per_peer comes
    // from p2p_warm_bytes(nranks) (or per_peer = 1 and at < half). Pieces of 1 byte may
    // coincide in very large groups: the warm-up's data is never read.
    let mut r = unsafe { (f.group_start)() };
    if r != ok {
        return r;
    }
    for peer in 0..comm.nranks {
        let at = (peer * per_peer) as u64 % half;
        // SAFETY: as above.
        let (a, b) = unsafe {
            (
                (f.send)((warm + at) as *const c_void, per_peer, u8_, peer as i32, raw, s),
                (f.recv)((warm + half + at) as *mut c_void, per_peer, u8_, peer as i32, raw, s),
            )
        };
        for x in [a, b] {
            if r == ok {
                r = x;
            }
        }
    }
    // SAFETY: closes the group opened above, whatever happened inside it.
    let end = unsafe { (f.group_end)() };
    if r == ok {
        end
    } else {
        r
    }
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
    fn launches_age_from_their_start_on_the_gpu() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(10);
        // Queued behind an hour of compute: not started, never late.
        assert!(!launch_timed_out(None, t0 + Duration::from_secs(3600), timeout));
        let started = Some(t0 + Duration::from_secs(3600));
        assert!(!launch_timed_out(started, t0 + Duration::from_secs(3605), timeout), "5 s since its start");
        assert!(!launch_timed_out(started, t0 + Duration::from_secs(3610), timeout), "exactly the timeout");
        assert!(launch_timed_out(started, t0 + Duration::from_secs(3611), timeout));
        assert!(!launch_timed_out(started, t0, timeout), "a clock read before the start counts as 0");
    }

    #[test]
    fn p2p_warm_up_pieces_fit_their_half_of_the_warm_buffer() {
        for n in [1usize, 2, 3, 4, 7, 16, 1000, 16 << 10, 1 << 20] {
            let b = p2p_warm_bytes(n);
            assert!(b >= 1);
            assert!(b * n <= WARM_BYTES / 2 || b == 1, "{n} ranks x {b} bytes");
            assert!(b == 1 || b % 256 == 0);
        }
        assert_eq!(p2p_warm_bytes(4), 1 << 20);
    }

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

    #[test]
    fn host_major_means_each_host_holds_one_contiguous_block() {
        assert!(host_major(&[vec![0, 1], vec![2, 3]]));
        assert!(host_major(&[vec![0, 1, 2], vec![3, 4, 5], vec![6, 7, 8]]));
        assert!(host_major(&[vec![0], vec![1]]), "one GPU per host is trivially host-major");
        assert!(!host_major(&[vec![0, 2], vec![1, 3]]), "round-robin placement");
        assert!(!host_major(&[vec![0, 1], vec![2, 3, 4]]), "unequal hosts");
        assert!(!host_major(&[vec![0, 1, 3], vec![2, 4, 5]]), "interleaved");
        assert!(!host_major(&[]));
        // What Topology builds from RSCCL_HOST_ID = "emul-host-{rank // 2}" and from hosts
        // that take turns.
        use crate::bootstrap::RankInfo;
        let i = |h: &str| RankInfo { pid: 1, host_id: h.into(), ..Default::default() };
        let emul = Topology::from_infos(0, &[i("h0"), i("h0"), i("h1"), i("h1")]);
        assert!(host_major(&emul.hosts));
        let turns = Topology::from_infos(0, &[i("h0"), i("h1"), i("h0"), i("h1")]);
        assert!(!host_major(&turns.hosts));
    }

    #[test]
    fn hierarchical_all_gather_only_for_host_major_aligned_large_calls() {
        let mib = 1u64 << 20;
        use CrossHost::{Flat, Hierarchical};
        let two_by_two = [2usize, 2];
        // bytes per rank; the threshold applies to the output (world x bytes per rank).
        assert_eq!(all_gather_path(mib / 4, &two_by_two, true, mib).0, Hierarchical, "4 x 256 KiB = 1 MiB output");
        assert_eq!(all_gather_path(mib / 4 - 16, &two_by_two, true, mib).0, Flat, "under the threshold");
        assert_eq!(all_gather_path(mib, &two_by_two, false, mib).0, Flat, "not host-major");
        assert_eq!(all_gather_path(mib + 8, &two_by_two, true, mib).0, Flat, "unaligned pieces");
        assert_eq!(all_gather_path(mib + 16, &two_by_two, true, mib).0, Hierarchical);
        assert_eq!(all_gather_path(0, &two_by_two, true, 0).0, Flat, "empty");
        assert_eq!(all_gather_path(16, &two_by_two, true, 0).0, Hierarchical, "threshold 0: every aligned call");
        assert_eq!(all_gather_path(mib, &[1, 1], true, mib).0, Flat, "one GPU per host");
        assert_eq!(all_gather_path(mib, &[2, 3], true, mib).0, Flat, "uneven hosts");
        assert_eq!(all_gather_path(mib, &[4], true, mib).0, Flat, "one host");
        assert_eq!(all_gather_path(mib, &[4, 4, 4], true, mib).0, Hierarchical);
    }

    #[test]
    fn hierarchical_reduce_scatter_needs_a_composable_op_and_room_in_the_scratch() {
        let mib = 1u64 << 20;
        use CrossHost::{Flat, Hierarchical};
        let two_by_two = [2usize, 2];
        let scratch = 32 * mib;
        let path = |count, elem, op, ok, hosts: &[usize], major| reduce_scatter_path(count, elem, op, ok, hosts, major, mib, scratch).0;
        // count = output elements; the threshold applies to the input (world x count).
        assert_eq!(path(mib / 8, 2, ReduceOp::Sum, true, &two_by_two, true), Hierarchical, "input 4 x 256 KiB");
        assert_eq!(path(mib / 16, 2, ReduceOp::Sum, true, &two_by_two, true), Flat, "input 512 KiB: under the threshold");
        assert_eq!(path(mib, 4, ReduceOp::Max, true, &two_by_two, true), Hierarchical);
        assert_eq!(path(mib, 4, ReduceOp::Avg, true, &two_by_two, true), Flat, "AVG would divide by the hosts");
        assert_eq!(path(mib, 4, ReduceOp::Sum, false, &two_by_two, true), Flat, "no kernel");
        assert_eq!(path(mib, 4, ReduceOp::Sum, true, &two_by_two, false), Flat, "not host-major");
        assert_eq!(path(mib + 2, 4, ReduceOp::Sum, true, &two_by_two, true), Flat, "output of 4 MiB + 8 bytes: unaligned");
        assert_eq!(path(mib + 4, 4, ReduceOp::Sum, true, &two_by_two, true), Hierarchical, "4 MiB + 16 bytes");
        // The scratch holds hosts x output bytes.
        assert_eq!(path(4 * mib, 4, ReduceOp::Sum, true, &two_by_two, true), Hierarchical, "2 hosts x 16 MiB = 32 MiB: fits");
        assert_eq!(path(4 * mib + 4, 4, ReduceOp::Sum, true, &two_by_two, true), Flat, "2 x (16 MiB + 16 bytes): does not fit");
        assert_eq!(path(4 * mib, 4, ReduceOp::Sum, true, &[2, 2, 2], true), Flat, "3 hosts x 16 MiB: does not fit");
        assert_eq!(reduce_scatter_path(mib, 4, ReduceOp::Sum, true, &two_by_two, true, mib, 0).0, Flat, "no scratch");
        assert_eq!(path(mib, 4, ReduceOp::Sum, true, &[1, 1], true), Flat, "one GPU per host");
        assert_eq!(path(mib, 4, ReduceOp::Sum, true, &[2, 3], false), Flat, "uneven hosts");
        assert_eq!(reduce_scatter_path(0, 4, ReduceOp::Sum, true, &two_by_two, true, 0, scratch).0, Flat, "empty");
    }
}
