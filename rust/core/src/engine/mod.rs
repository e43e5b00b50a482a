//! Engines run operations. All engines sit behind `Engine`: the host engine (host/) for
//! host memory, and for device memory rsccl's CUDA engine (cuda/engine/) or the NCCL
//! engine (cuda/nccl_engine/); the group picks them from the topology
//! (`group::choose_engine`) and routes each op by its place (`Group::run`).

pub mod host;

use std::sync::Arc;

use crate::collective::op::Op;
use crate::cuda::{CudaEvent, CudaStats, NcclStats};
use crate::work::WorkState;

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
/// then hands it the op, which the engine translates into its own description itself
/// (`run`). The group owns the rules that a call the engine cannot run is refused by every
/// rank and that a rank whose op fails to translate joins the call as invalid.
///
/// The trait is object safe: the group holds each engine as `Arc<dyn Engine>`. Each engine
/// takes the group's timeout at creation, so no call passes one.
pub trait Engine: Send + Sync {
    /// "host", "rsccl" (rsccl's kernels) or "nccl".
    fn name(&self) -> &'static str;

    /// Translate `op` of `rank` (in a group of `size` ranks) for this engine, and run it.
    /// Returns a Work (host), the end event of an asynchronous CUDA call, or Done (a
    /// blocking call that completed). `NotRun::Arguments`: this rank's arguments do not
    /// translate for the engine, and nothing ran (`Group::run` then joins the call as
    /// invalid, with `op`, from which the engine may have taken what it moved into its
    /// call); `NotRun::Failed`: the translated call failed.
    fn run(self: Arc<Self>, op: &mut Op, rank: usize, size: usize) -> Result<Ran, NotRun>;

    /// This rank's `op` was invalid (`error`): take part in its call as invalid, so that
    /// every peer raises instead of waiting for it. Returns what this rank gets: the host
    /// engine's Work (or, blocking, the error) that all ranks agree on; on CUDA, `error`.
    fn join_invalid(self: Arc<Self>, op: &Op, error: crate::Error) -> crate::Result<Ran>;

    /// Whether this engine can run `op` at all (its kind, dtype and reduce op), or the
    /// error that says what it takes, naming `rank` (the caller's group rank). The answer
    /// is a fact of the engine, the same on every rank that passed the same dtype and op,
    /// so `Group::run` asks before anything is exchanged, and every rank refuses the call
    /// (`refuse`) with the group left usable. The CUDA engines answer with
    /// `cuda::decide::can_run`, each for itself (NCCL with NCCL's types); the host engine
    /// runs what rsccl's dtypes and ops describe (its agreed checks stay in its call).
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
    fn refuse(self: Arc<Self>, _op: &Op, error: crate::Error) -> crate::Result<Ran> {
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

/// Why `Engine::run` returned no result.
#[derive(Debug)]
pub enum NotRun {
    /// This rank's arguments do not translate for the engine (the error says why): the
    /// call did not start, and `Group::run` joins it as invalid.
    Arguments(crate::Error),
    /// The translated call failed.
    Failed(crate::Error),
}

impl From<crate::Error> for NotRun {
    fn from(e: crate::Error) -> NotRun {
        NotRun::Failed(e)
    }
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
