//! The CUDA engine behind the `Engine` trait: an op, translated (`CudaCall::from_op`), to
//! its one launch entry (`CudaEngine::launch`).

use std::sync::Arc;

use super::{CudaCall, CudaEngine};
use crate::collective::op::{Op, Place};
use crate::collective::Kind;
use crate::cuda::decide::{can_run, DeviceEngine};
use crate::engine::{Engine, GroupStats, NotRun, Ran};
use crate::error::{Error, Result};

impl Engine for CudaEngine {
    fn name(&self) -> &'static str {
        "rsccl"
    }

    fn run(self: Arc<Self>, op: &mut Op, rank: usize, size: usize) -> std::result::Result<Ran, NotRun> {
        let Place::Cuda { stream } = op.place else {
            return Err(NotRun::Failed(Error::Internal("a host op reached the CUDA engine".into())));
        };
        let call = CudaCall::from_op(op, rank, size, stream).map_err(NotRun::Arguments)?;
        Ok(Ran::from_event(self.launch(&call)?))
    }

    /// rsccl's kernel table (`decide::can_run`).
    fn can_run(&self, op: &Op, rank: usize) -> Result<()> {
        can_run(DeviceEngine::Rsccl, op.kind, op.dtype, op.op, rank)
    }

    /// Joins as invalid (below), on every rank that got the same answer: their invalid
    /// calls' descriptors agree, so the kernels pass the first barrier with nothing to
    /// report and the counters stay in step (NOTE [Agreement] in csrc_kernels/protocol.cuh);
    /// a peer that passed a dtype the kernels reduce sees the mismatch and raises it,
    /// where refusing alone would leave its kernel waiting for this rank's next call and
    /// pair the two.
    fn refuse(self: Arc<Self>, op: &Op, error: Error) -> Result<Ran> {
        self.join_invalid(op, error)
    }

    /// Launches the invalid kernel (`Kind::Invalid`): it takes part in the first barrier
    /// only, where every peer sees its descriptor mismatch theirs and raises. This rank
    /// raises `error`, its own (a failure to tell the peers is logged).
    fn join_invalid(self: Arc<Self>, op: &Op, error: Error) -> Result<Ran> {
        let Place::Cuda { stream } = op.place else {
            return Err(Error::Internal("a host op reached the CUDA engine".into()));
        };
        if let Err(told) = self.launch(&CudaCall::bare(Kind::Invalid, 0, stream, false)) {
            tracing::warn!(error = %told, "could not report an invalid CUDA call to the peers");
        }
        Err(error)
    }

    fn health(&self) -> Result<()> {
        CudaEngine::health(self)
    }

    fn add_stats(&self, stats: &mut GroupStats) {
        stats.cuda = Some(self.stats());
    }

    fn shutdown(&self) {
        CudaEngine::shutdown(self)
    }
}
