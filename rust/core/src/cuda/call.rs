//! What the device engines run (`DeviceCall`, of which a collective is a `CudaCall`), made
//! from the op record (collective/op.rs), and the descriptor words peers compare
//! (`describe`).

use super::kernels::{DESC0_DTYPE_SHIFT, DESC0_OP_SHIFT, DESC0_ROOT_SHIFT};
use super::AllToAll;
use crate::dtype::{DType, ReduceOp};

/// One call to a device engine (`Engine::Call` of `CudaEngine` and `NcclEngine`), ordered
/// after the caller's current stream.
#[derive(Debug, Clone)]
pub enum DeviceCall {
    /// A collective, a barrier, or the invalid call (`CudaKind::Invalid`).
    Collective(CudaCall),
    /// An all_to_all: its chunks, one per group rank.
    AllToAll { chunks: AllToAll, stream: u64, asynchronous: bool },
    /// A send (`send`) or recv of `bytes` at `ptr` with group rank `peer`.
    P2p { send: bool, ptr: u64, bytes: u64, peer: usize, stream: u64, asynchronous: bool },
}

impl DeviceCall {
    /// The same call ordered after `stream`, asynchronous or not (a front end that builds
    /// its calls before it knows the stream).
    pub fn after(mut self, on: u64, is_async: bool) -> DeviceCall {
        match &mut self {
            DeviceCall::Collective(c) => (c.stream, c.asynchronous) = (on, is_async),
            DeviceCall::AllToAll { stream, asynchronous, .. } | DeviceCall::P2p { stream, asynchronous, .. } => {
                (*stream, *asynchronous) = (on, is_async)
            }
        }
        self
    }
}

/// The kinds of CUDA operations are rsccl's one list of kinds (collective/kind.rs); the
/// name stays for the engines' code.
pub use crate::collective::Kind as CudaKind;

#[derive(Debug, Clone, Copy)]
pub struct CudaCall {
    pub kind: CudaKind,
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
    pub fn bare(kind: CudaKind, count: u64, stream: u64, asynchronous: bool) -> CudaCall {
        CudaCall { kind, dtype: DType::U8, op: ReduceOp::Sum, root: 0, inp: 0, out: 0, count, stream, asynchronous }
    }
}

/// A kernel descriptor (the two words every rank publishes at a barrier) in words, for
/// mismatch messages.
pub(crate) fn describe(d0: u64, d1: u64) -> String {
    let Some(k) = CudaKind::from_code((d0 & 0xff) as u8) else {
        return "an unknown call".to_string();
    };
    let dtype = DType::from_code(((d0 >> DESC0_DTYPE_SHIFT) & 0xff) as u8).map(|d| d.name()).unwrap_or("?");
    let op = ReduceOp::from_code(((d0 >> DESC0_OP_SHIFT) & 0xff) as u8).map(|o| o.name()).unwrap_or("?");
    super::decide::call_in_words(k, dtype, op, (d0 >> DESC0_ROOT_SHIFT) as u32, d1)
}
