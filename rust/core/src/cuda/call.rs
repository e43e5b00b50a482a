//! A collective as the device engines run it (`CudaCall`, inside `DeviceCall`), made from
//! the op record (collective/op.rs) by cuda/engine/translate.rs.

use crate::dtype::{DType, ReduceOp};

/// The kinds of CUDA operations are rsccl's one list of kinds (collective/kind.rs); the
/// name stays for the engines' code.
use crate::collective::Kind;

#[derive(Debug, Clone, Copy)]
pub struct CudaCall {
    pub kind: Kind,
    pub dtype: DType,
    pub op: ReduceOp,
    pub root: usize,
    pub inp: u64,
    pub out: u64,
    /// all_reduce: elements; reduce_scatter: output elements; all_gather: input bytes;
    /// broadcast: bytes.
    pub count: u64,
    /// The caller's current stream (raw handle).
    pub stream: u64,
    pub asynchronous: bool,
}

impl CudaCall {
    /// A call that carries no buffers, dtype, op or root of its own (all_to_all, whose
    /// chunks travel apart; an invalid call): bytes, SUM, root 0, `count` as given.
    pub fn bare(kind: Kind, count: u64, stream: u64, asynchronous: bool) -> CudaCall {
        CudaCall { kind, dtype: DType::U8, op: ReduceOp::Sum, root: 0, inp: 0, out: 0, count, stream, asynchronous }
    }
}
