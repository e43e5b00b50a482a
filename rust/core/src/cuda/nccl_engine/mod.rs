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
//! Streams: the launch order rsccl's CUDA engine uses too (cuda/order.rs): a blocking call
//! runs on the caller's stream (`cuda_sync_stream = 1`), an asynchronous one on the
//! internal stream after an event makes it wait for the caller's; a collective on another
//! stream than the previous one is ordered after it; an asynchronous call returns its end
//! event. The three phases of a hierarchical collective run on one stream, so they are
//! ordered. No tensor is marked on a stream.
//!
//! Errors: NCCL kernels wait without bound, so the engine bounds them. Every launch is
//! tracked by events before and after it; a watchdog thread polls every communicator's
//! asynchronous error, rsccl's local engine, and the tracked launches. A failure, or a
//! launch still running more than the group timeout after it started on the GPU, makes
//! the group unusable: the first error is kept (and raised by
//! every later call and Work.wait) and the watchdog aborts the communicators, which ends
//! their kernels, so nothing waits on them forever. Aborts happen on the watchdog thread
//! only (or at shutdown, after it stopped), so a communicator is freed exactly once.
//!
//! Where each part lives: group creation (the communicators, the local engine, their
//! warm-up) in create.rs, warm.rs and pairs.rs; the watchdog and the failure rules in
//! watchdog.rs; the launch path (ordering, tracking, flat NCCL calls) in launch.rs; the
//! hierarchical path (`Hierarchical`: the local engine and the cross communicator
//! composed) in hier.rs. Pure, tested without a GPU: the choices (flat or hierarchical,
//! a launch's age) in choice.rs, the pair communicators' split schedule in pair_rounds.rs.

mod bound;
mod choice;
mod create;
mod hier;
mod launch;
mod pair_rounds;
mod pairs;
mod run;
mod warm;
mod watchdog;

pub use choice::{
    all_gather_path, all_reduce_path, choose_cross_host, hierarchical_layout, host_major, launch_timed_out, reduce_scatter_path, CrossHost,
};
pub use create::{id_key, CommRole};
pub use pair_rounds::p2p_split_rounds;
pub use warm::p2p_warm_bytes;

use std::collections::VecDeque;
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use parking_lot::{Mutex, RwLock};

use super::decide::{nccl_call, NcclCall};
use super::driver::{CUstream, Device, DeviceBuffer, Event, Stream};
use super::nccl::NcclComm;
use super::order::Order;
use super::{CudaCall, CudaEngine, CudaEvent};
use crate::collective::validate;
use crate::collective::Kind;
use crate::error::{Error, Result};
use hier::{HierLayout, Hierarchical};

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
    start: Event,
    ev: Event,
    /// When `start` was first seen complete (by the watchdog or a health check); the
    /// launch's age counts from there, so waiting behind long compute is not a timeout.
    started: Option<Instant>,
    kind: Kind,
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
    stream: Stream,
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

pub struct NcclEngine {
    sh: Arc<Shared>,
    internal: Stream,
    /// The barrier's float (SCRATCH_BYTES).
    scratch: DeviceBuffer,
    /// The hierarchical path's layout and scratch; its engines are in `sh`.
    hier: HierLayout,
    /// Host index of every group rank (send/recv to a rank of this host go to the local
    /// rsccl engine, when there is one).
    host_of: Vec<usize>,
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

impl NcclEngine {
    /// The hierarchical path, where the group has one (same number >= 2 of GPUs per host).
    fn hierarchical(&self) -> Option<Hierarchical<'_>> {
        Hierarchical::new(self.sh.local.as_ref(), self.sh.cross.as_ref(), &self.hier)
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
            return Err(Error::destroyed());
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
    /// instead, so they fail fast too. The caller raises its own error.
    pub fn invalid(&self) {
        self.sh.fail(Error::Aborted(format!(
            "rank {} passed invalid arguments to a CUDA collective; a group that spans hosts cannot skip a \
             collective (NCCL runs every call on every rank), so the group was aborted",
            self.sh.rank
        )));
    }

    /// Launch one call of any kind, by the NCCL call that runs it (`decide::nccl_call`):
    /// send/recv on their own communicators (`launch_p2p`), the rest on the flat
    /// communicator or the hierarchical path. Returns the end event for an asynchronous
    /// call (the Work waits on it); a blocking call is ordered before the caller's later
    /// work already.
    ///
    /// A call with chunks (all_to_all: every list has one entry per rank, in group-rank
    /// order) is one NCCL group of sends and receives on the flat communicator. NCCL cannot
    /// check that the ranks' chunks agree: a rank that expects other sizes than its peer
    /// sends hangs the call until the watchdog's timeout aborts the group.
    pub fn launch(&self, c: &CudaCall) -> Result<Option<CudaEvent>> {
        if nccl_call(c.kind) == NcclCall::P2p {
            return self.launch_p2p(c);
        }
        self.health()?;
        let n = self.sh.flat.nranks;
        if let Some(x) = c.chunks.as_ref().filter(|x| !x.one_per_rank(n)) {
            // The Python layer builds one entry per rank: this is a bug, and the peers
            // would wait for this rank, so it fails the group.
            return Err(self.sh.fail(Error::Internal(format!(
                "rank {}: an {} with {}/{}/{}/{} chunk entries for a group of {n}",
                self.sh.rank,
                c.kind.name(),
                x.send.len(),
                x.send_bytes.len(),
                x.recv.len(),
                x.recv_bytes.len()
            ))));
        }
        self.failing_group(self.launch_inner(c))
    }

    /// Launch one CUDA send or recv (`c`: `c.count` bytes at `c.inp` or `c.out` with group
    /// rank `c.root`), after the work queued so far on the caller's `c.stream`. A rank of
    /// this host goes to the local rsccl engine where there is one (its kernels run each
    /// (peer, direction) on its own stream too); any other rank to the pair communicator of
    /// this direction, on its own stream. Not ordered after the group's collectives, nor
    /// they after it: only the caller's stream orders them (as torch's NCCL backend, whose
    /// send/recv run on communicators of their own). Returns the end event of an
    /// asynchronous call; a blocking one makes the caller's stream wait for it.
    ///
    /// NCCL cannot check that the sizes agree: a recv of more bytes than its peer sends (or
    /// fewer) waits until the watchdog's timeout aborts the group.
    fn launch_p2p(&self, c: &CudaCall) -> Result<Option<CudaEvent>> {
        let (me, n, peer, send) = (self.sh.rank, self.sh.flat.nranks, c.root, c.kind == Kind::Send);
        validate::peer(if send { "CUDA send" } else { "CUDA recv" }, me, peer as i64, n)?;
        let what = if send { "send to" } else { "recv from" };
        self.health()?;
        if self.host_of[peer] == self.host_of[me] {
            if let Some(local) = &self.sh.local {
                // The same call: the local engine finds the peer among this host's ranks.
                return local.launch(c);
            }
        }
        let Some(pair) = self.sh.pairs.iter().find(|p| p.peer == peer && p.sending == send) else {
            return Err(Error::InvalidType(format!(
                "rank {me}: CUDA {what} rank {peer} (on another host) runs on a NCCL communicator of that pair, which \
                 this group does not have: it was created with nccl_p2p = 0 (rsccl.Options(nccl_p2p=...) or \
                 RSCCL_NCCL_P2P). Create it with nccl_p2p = 1 (the default), or use all_to_all or CPU tensors"
            )));
        };
        let ptr = if send { c.inp } else { c.out };
        self.failing_group(self.launch_pair(pair, ptr, c.count, c.stream, c.asynchronous))
    }

    pub fn stats(&self) -> NcclStats {
        NcclStats {
            device: self.sh.dev.ordinal,
            nccl_bytes: self.nccl_bytes,
            scratch_bytes: self.hier.scratch_bytes,
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
            let last = sh.order.lock().last_stream();
            let internal = self.internal.raw() as u64;
            let mut streams = vec![internal];
            streams.extend(last.filter(|&l| l != internal));
            // Queued sends and receives.
            streams.extend(sh.pairs.iter().map(|p| p.stream.raw() as u64));
            let deadline = Instant::now() + sh.timeout;
            for s in streams {
                if !healthy {
                    break;
                }
                let Ok(ev) = Event::new(&sh.dev) else { continue };
                // SAFETY: valid event and stream (torch never destroys its pool streams).
                if unsafe { cu::cuEventRecord(ev.raw(), s as CUstream) } == cu::CUresult::CUDA_SUCCESS {
                    // SAFETY: valid event.
                    while unsafe { cu::cuEventQuery(ev.raw()) } == cu::CUresult::CUDA_ERROR_NOT_READY {
                        if Instant::now() > deadline || sh.find_failure().is_some() {
                            healthy = false;
                            break;
                        }
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
                // Dropping `ev` destroys it; a pending record on it is harmless.
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
        // Shutdown drained or aborted the work on the internal stream; the pair
        // communicators were closed or aborted by it too: their streams drain. The buffers
        // and streams go with their owners (DeviceBuffer, Stream) after this, with nothing
        // queued that uses them.
        self.internal.synchronize();
        for p in &self.sh.pairs {
            p.stream.synchronize();
        }
    }
}
