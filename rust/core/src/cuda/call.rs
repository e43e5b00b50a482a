//! The one call record the device engines launch (`CudaCall`), made from the op record
//! (collective/op.rs) by cuda/engine/translate.rs. Every kind is a call of one of three
//! shapes (`Shape`, the kernels' argument blocks): the collectives (sizes in `count`), the
//! kinds whose sizes are per peer (`chunks`: all_to_all), and send/recv (one peer, `root`).
//! Each engine's one launch entry (`CudaEngine::launch`, `NcclEngine::launch`) takes them
//! all.

use crate::collective::op::Chunks;
use crate::collective::Kind;
use crate::cuda::kernels::Shape;
use crate::dtype::{DType, ReduceOp};

#[derive(Debug, Clone)]
pub struct CudaCall {
    pub kind: Kind,
    pub dtype: DType,
    pub op: ReduceOp,
    /// The root of a rooted kind; the peer (group rank) of a send or recv.
    pub root: usize,
    /// What it reads (a send: the message).
    pub inp: u64,
    /// What it writes (a recv: the message).
    pub out: u64,
    /// all_reduce: elements; reduce_scatter: output elements; all_gather: input bytes;
    /// broadcast, send, recv: bytes; a call with chunks: 0 (its sizes are per peer).
    pub count: u64,
    /// Per peer, in group-rank order, the chunk sent and where the chunk received lands:
    /// the kinds whose sizes are per peer (`Kind::has_chunks`); None for the rest.
    pub chunks: Option<Chunks>,
    /// The caller's current stream (raw handle).
    pub stream: u64,
    pub asynchronous: bool,
}

impl CudaCall {
    /// A call that carries no buffers, dtype, op or root of its own (an invalid call, a
    /// warm-up): bytes, SUM, root 0, `count` as given.
    pub fn bare(kind: Kind, count: u64, stream: u64, asynchronous: bool) -> CudaCall {
        CudaCall { kind, dtype: DType::U8, op: ReduceOp::Sum, root: 0, inp: 0, out: 0, count, chunks: None, stream, asynchronous }
    }

    /// Its shape: one peer (send, recv), a chunk per peer, or a collective's sizes. The
    /// kernel that runs it takes the same (`Kernel::shape`).
    pub fn shape(&self) -> Shape {
        match (self.kind.is_p2p(), &self.chunks) {
            (true, _) => Shape::Peer,
            (false, Some(_)) => Shape::Chunks,
            (false, None) => Shape::Collective,
        }
    }
}
