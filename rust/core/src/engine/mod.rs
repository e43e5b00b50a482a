//! Engines run operations. All engines sit behind `Engine`: the host engine (host/) for
//! host memory, and for device memory rsccl's CUDA engine (cuda/engine/) or the NCCL
//! engine (cuda/nccl_engine/); the group picks them from the topology
//! (`group::choose_engine`) and routes each op by its place (`Group::run`).

pub mod host;

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use crate::collective::op::Op;
use crate::collective::{Buf, Collective};
use crate::cuda::{CudaEvent, CudaStats, NcclStats};
use crate::dtype::DType;
use crate::work::WorkState;

/// A point-to-point operation with one peer (a rank of the group).
#[derive(Debug)]
pub enum P2p {
    Send {
        buf: Buf,
        dtype: DType,
        peer: usize,
        tag: i64,
    },
    Recv {
        buf: Buf,
        dtype: DType,
        peer: usize,
        tag: i64,
    },
    /// A recv from whichever rank's message with this tag comes first (dist.recv/irecv
    /// without src, CPU tensors): `source` holds that rank once the Work completes.
    RecvAny {
        buf: Buf,
        dtype: DType,
        tag: i64,
        source: Arc<AtomicUsize>,
    },
}

/// What the host engine runs: a collective (on the calling thread, returning when done,
/// when `blocking`) or a send/recv (always a Work).
#[derive(Debug)]
pub enum HostCall {
    Collective { c: Collective, blocking: bool },
    P2p(P2p),
}

/// Tags run from 0 to 2^31 - 1, as gloo's (a 32-bit slot) do: a tag outside is a bad
/// argument, refused on both sides (see `P2p::check_tag`).
pub const P2P_TAG_LIMIT: i64 = 1 << 31;

impl P2p {
    /// The peer of a send or recv; None for a recv from any source.
    pub fn peer(&self) -> Option<usize> {
        match self {
            P2p::Send { peer, .. } | P2p::Recv { peer, .. } => Some(*peer),
            P2p::RecvAny { .. } => None,
        }
    }

    /// This rank's (`me`) tag is in range, or the error that names both ranks.
    pub fn check_tag(&self, me: usize) -> crate::Result<()> {
        let (what, tag) = match self {
            P2p::Send { peer, tag, .. } => (format!("send to rank {peer}"), *tag),
            P2p::Recv { peer, tag, .. } => (format!("recv from rank {peer}"), *tag),
            P2p::RecvAny { tag, .. } => ("recv from any rank".to_string(), *tag),
        };
        if (0..P2P_TAG_LIMIT).contains(&tag) {
            return Ok(());
        }
        Err(crate::Error::InvalidArgument(format!("rank {me} posted a {what} with tag {tag}, out of range: tags run from 0 to 2^31 - 1")))
    }
}

/// What an engine has reserved, mapped and uses, in bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub host_region_bytes: u64,
    pub host_mapped_bytes: u64,
    pub collectives: u64,
    pub p2p_messages: u64,
    pub staged_bytes: u64,
}

/// What a group's engines report, each its own part (`Engine::add_stats`).
#[derive(Debug, Clone, Default)]
pub struct GroupStats {
    /// The host engine (zeros where CPU tensors run on gloo).
    pub host: MemoryStats,
    /// rsccl's CUDA engine of this host: the group's own, or the one the NCCL engine runs
    /// the host-local phases on.
    pub cuda: Option<CudaStats>,
    /// The NCCL engine (groups that span hosts, with CUDA).
    pub nccl: Option<NcclStats>,
}

/// An engine runs the ops of one place: host memory (`HostEngine`), or this rank's GPU
/// (`CudaEngine` on one host, `NcclEngine` across hosts). `Group::run` is its one caller:
/// it asks the engine whether it can run the op at all (`can_run`; if not, `refuse`),
/// translates it for the engine's place (`Call`, built in collective/op.rs), and owns the
/// rules that a call the engine cannot run is refused by every rank and that a rank whose
/// op fails to translate joins the call as invalid.
pub trait Engine: Send + Sync {
    /// What this engine runs: an op translated for its place (`HostCall`, `DeviceCall`).
    type Call;

    /// "host", "rsccl" (rsccl's kernels) or "nccl".
    fn name(&self) -> &'static str;

    /// Run one call whose arguments were valid on this rank. Returns a Work (host), the
    /// end event of an asynchronous CUDA call, or Done (a blocking call that completed).
    fn run(self: Arc<Self>, call: Self::Call, timeout: Duration) -> crate::Result<Ran>;

    /// This rank's `op` was invalid (`error`): take part in its call as invalid, so that
    /// every peer raises instead of waiting for it. Returns what this rank gets: the host
    /// engine's Work (or, blocking, the error) that all ranks agree on; on CUDA, `error`.
    fn join_invalid(self: Arc<Self>, op: &Op, error: crate::Error, timeout: Duration) -> crate::Result<Ran>;

    /// Whether this engine can run `op` at all (its kind, dtype and reduce op), or the
    /// error that says what it takes, naming `rank` (the caller's group rank). The answer
    /// is a fact of the engine, the same on every rank that passed the same dtype and op,
    /// so `Group::run` asks before anything is exchanged, and every rank refuses the call
    /// (`refuse`) with the group left usable. The CUDA engines answer with
    /// `cuda::decide::can_run`; the host engine runs what rsccl's dtypes and ops describe
    /// (its agreed checks stay in its call).
    fn can_run(&self, _op: &Op, _rank: usize) -> crate::Result<()> {
        Ok(())
    }

    /// This rank's `op` is one the engine cannot run (`error`, from `can_run`): what the
    /// rank does before it raises `error`. By default nothing: it raises alone and nothing
    /// is exchanged, which is all an engine can do that tells its peers only by aborting
    /// (NCCL). Its peers got the same answer if they passed the same dtype and op (torch
    /// requires it). An engine that can tell its peers at no harm does (`join_invalid`,
    /// rsccl's kernels): a peer that did pass a dtype the engine runs then raises the
    /// disagreement, instead of running its call with this rank's next one.
    fn refuse(self: Arc<Self>, _op: &Op, error: crate::Error, _timeout: Duration) -> crate::Result<Ran> {
        Err(error)
    }

    /// The error that made the engine unusable, or one its kernels reported.
    fn health(&self) -> crate::Result<()> {
        Ok(())
    }

    /// Fill this engine's part of `stats` (may wait for the engine's queued GPU work).
    fn add_stats(&self, stats: &mut GroupStats);

    /// The global rank of each group rank, for error messages of a subgroup (called once,
    /// right after creation; engines without such messages ignore it).
    fn name_global_ranks(&self, _global: Vec<usize>) {}

    /// Stop the engine's threads and release what it holds; pending operations fail with
    /// `Error::Aborted`. Idempotent.
    fn shutdown(&self);
}

/// What `Engine::run` returns: the Work of a host op, the end event of an asynchronous CUDA
/// op, or nothing (a blocking op that completed).
pub enum Ran {
    Work(Arc<WorkState>),
    Event(CudaEvent),
    Done,
}

impl Ran {
    /// A CUDA launch's result: its end event (asynchronous) or Done.
    pub fn from_event(ev: Option<CudaEvent>) -> Ran {
        ev.map_or(Ran::Done, Ran::Event)
    }
}
