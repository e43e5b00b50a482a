//! What a CUDA collective is (`CudaKind`) and one call of it (`CudaCall`): the description
//! the engines receive, and the descriptor words peers compare (`describe`).

use crate::dtype::{DType, ReduceOp};

/// What a CUDA collective is. Counts are in elements of `dtype` (bytes for gather and
/// broadcast, which move bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaKind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Barrier,
    /// Rooted: count is bytes per rank (gather, scatter) or elements (reduce).
    Gather,
    Scatter,
    Reduce,
    /// Bytes per peer in the AllToAll passed along (count is unused).
    AllToAll,
    /// Point to point with `root` (a local index): count is bytes.
    Send,
    Recv,
    /// This rank's arguments were invalid: it takes part in the first barrier only, so
    /// every peer learns of it (descriptor mismatch) instead of waiting.
    Invalid,
}

impl CudaKind {
    pub(crate) fn code(self) -> u64 {
        match self {
            CudaKind::AllReduce => 1,
            CudaKind::ReduceScatter => 2,
            CudaKind::AllGather => 3,
            CudaKind::Broadcast => 4,
            CudaKind::Barrier => 5,
            CudaKind::Invalid => 6,
            CudaKind::Gather => 7,
            CudaKind::Scatter => 8,
            CudaKind::Reduce => 9,
            CudaKind::AllToAll => 10,
            CudaKind::Send => 11,
            CudaKind::Recv => 12,
        }
    }

    pub(crate) fn from_code(c: u64) -> Option<CudaKind> {
        [
            CudaKind::AllReduce,
            CudaKind::ReduceScatter,
            CudaKind::AllGather,
            CudaKind::Broadcast,
            CudaKind::Barrier,
            CudaKind::Invalid,
            CudaKind::Gather,
            CudaKind::Scatter,
            CudaKind::Reduce,
            CudaKind::AllToAll,
            CudaKind::Send,
            CudaKind::Recv,
        ]
        .into_iter()
        .find(|k| k.code() == c)
    }

    pub fn name(self) -> &'static str {
        match self {
            CudaKind::AllReduce => "all_reduce",
            CudaKind::ReduceScatter => "reduce_scatter",
            CudaKind::AllGather => "all_gather",
            CudaKind::Broadcast => "broadcast",
            CudaKind::Barrier => "barrier",
            CudaKind::Invalid => "an invalid call",
            CudaKind::Gather => "gather",
            CudaKind::Scatter => "scatter",
            CudaKind::Reduce => "reduce",
            CudaKind::AllToAll => "all_to_all",
            CudaKind::Send => "send",
            CudaKind::Recv => "recv",
        }
    }
}

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
    let kind = CudaKind::from_code(d0 & 0xff).map(|k| k.name()).unwrap_or("an unknown call");
    if kind == "barrier" || kind == "an invalid call" || kind == "all_to_all" {
        return kind.to_string();
    }
    let dtype = DType::from_code(((d0 >> 8) & 0xff) as u8).map(|d| d.name()).unwrap_or("?");
    let op = ReduceOp::from_code(((d0 >> 16) & 0xff) as u8).map(|o| o.name()).unwrap_or("?");
    let root = (d0 >> 32) as u32;
    match kind {
        "all_reduce" | "reduce_scatter" => format!("{kind} {dtype}[{d1}] {op}"),
        "reduce" => format!("{kind} {dtype}[{d1}] {op} to local rank {root}"),
        "broadcast" => format!("{kind} of {d1} bytes from local rank {root}"),
        "gather" => format!("{kind} of {d1} bytes per rank to local rank {root}"),
        "scatter" => format!("{kind} of {d1} bytes per rank from local rank {root}"),
        _ => format!("{kind} of {d1} bytes per rank"),
    }
}
