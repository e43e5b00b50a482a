//! The NCCL engine behind the `Engine` trait: an op, translated (`CudaCall::from_op`, as
//! rsccl's CUDA engine does), to its one launch entry (`NcclEngine::launch`).

use std::sync::Arc;

use super::NcclEngine;
use crate::collective::op::{Op, Place};
use crate::cuda::decide::{can_run, DeviceEngine};
use crate::cuda::CudaCall;
use crate::engine::{Engine, GroupStats, NotRun, Ran};
use crate::error::{Error, Result};

impl Engine for NcclEngine {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn run(self: Arc<Self>, op: &mut Op, rank: usize, size: usize) -> std::result::Result<Ran, NotRun> {
        let Place::Cuda { stream } = op.place else {
            return Err(NotRun::Failed(Error::Internal("a host op reached the NCCL engine".into())));
        };
        let call = CudaCall::from_op(op, rank, size, stream).map_err(NotRun::Arguments)?;
        Ok(Ran::from_event(self.launch(&call)?))
    }

    /// NCCL's types and ops (`decide::can_run`): a float64 all_reduce runs here, although
    /// rsccl's kernels do not reduce float64 (the hierarchical path then runs flat).
    fn can_run(&self, op: &Op, rank: usize) -> Result<()> {
        can_run(DeviceEngine::Nccl, op.kind, op.dtype, op.op, rank)
    }

    /// NCCL cannot tell the peers: the group is aborted (`NcclEngine::invalid`), and this
    /// rank raises `error`, its own.
    fn join_invalid(self: Arc<Self>, _op: &Op, error: Error) -> Result<Ran> {
        self.invalid();
        Err(error)
    }

    fn health(&self) -> Result<()> {
        NcclEngine::health(self)
    }

    /// The NCCL engine's counters, and those of the host-local rsccl engine it runs the
    /// hierarchical phases on, if it has one.
    fn add_stats(&self, stats: &mut GroupStats) {
        stats.nccl = Some(self.stats());
        stats.cuda = self.local().map(|c| c.stats());
    }

    fn shutdown(&self) {
        NcclEngine::shutdown(self)
    }
}
