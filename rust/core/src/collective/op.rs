//! The op record: one operation as one rank called it, on any device. Every torch method
//! builds one (Python: `Communicator.run`), and `Group::run` routes it to the engine of its
//! place. Each engine translates it into its own description itself (`Engine::run`: the
//! host engine in engine/host/call.rs, the device engines in cuda/engine/call.rs), so the
//! record depends on no engine.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use super::{Buf, Kind};
use crate::dtype::{DType, ReduceOp};
use crate::error::Error;

/// Where an op's buffers live, and so which engine runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// CPU memory: the host engine (shared memory, one host).
    Host,
    /// Device memory, ordered after the caller's current `stream` (raw handle): rsccl's
    /// CUDA engine on one host, the NCCL engine across hosts.
    Cuda { stream: u64 },
}

/// A contiguous buffer: address and bytes. The caller keeps its storage alive until the
/// op completed (Python: the Work's `keep`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Span {
    pub ptr: u64,
    pub bytes: u64,
}

impl Span {
    pub(crate) fn buf(self) -> Buf {
        if self.bytes == 0 {
            Buf::empty()
        } else {
            Buf { ptr: self.ptr as *mut u8, len: self.bytes as usize }
        }
    }
}

/// The sizes of a call that are per peer (`Kind::has_chunks`: all_to_all): per peer, in
/// rank order, the chunk this rank sends (address, bytes) and where the chunk from that peer
/// lands (address, bytes). The host engine uses the byte counts only; the device engines
/// take them as the call's shape (`CudaCall::chunks`).
#[derive(Debug, Clone, Default)]
pub struct Chunks {
    pub send: Vec<u64>,
    pub send_bytes: Vec<u64>,
    pub recv: Vec<u64>,
    pub recv_bytes: Vec<u64>,
}

impl Chunks {
    /// An empty chunk to and from each of `n` ranks (a warm-up).
    pub fn empty(n: usize) -> Chunks {
        Chunks { send: vec![0; n], send_bytes: vec![0; n], recv: vec![0; n], recv_bytes: vec![0; n] }
    }

    /// Whether every list has one entry per rank of a group of `n`.
    pub fn one_per_rank(&self, n: usize) -> bool {
        [&self.send, &self.send_bytes, &self.recv, &self.recv_bytes].iter().all(|v| v.len() == n)
    }
}

/// One operation as one rank called it.
#[derive(Debug)]
pub struct Op {
    pub kind: Kind,
    pub place: Place,
    /// What it reads. all_reduce, broadcast and reduce work in place (`inp` == `out`);
    /// a rank other than the root passes its own buffer for the root-only side of gather
    /// and scatter.
    pub inp: Span,
    /// What it writes.
    pub out: Span,
    /// Element type. Operations that move bytes on CUDA (`Kind::moves_bytes`) run as uint8.
    pub dtype: DType,
    /// Reduce op (kinds that `has_op`), else SUM.
    pub op: ReduceOp,
    /// Root (src/dst) of rooted kinds, peer of send/recv, as the caller gave it.
    pub root: i64,
    /// Tag of a send/recv on host memory (CUDA ignores it, as NCCL does).
    pub tag: i64,
    /// A kind whose sizes are per peer (`Kind::has_chunks`: all_to_all): per peer, in
    /// group-rank order, the chunk sent (address, bytes) and where the chunk from that peer
    /// lands. The host engine uses the byte counts only.
    pub splits: Option<Chunks>,
    /// Run now and return when done (torch's asyncOp = False), instead of a Work/event.
    pub blocking: bool,
    /// This rank's arguments were found invalid (by Python or while building the op): it
    /// joins the call as invalid, so every rank raises instead of waiting for it.
    pub invalid: Option<Error>,
    /// A recv from whichever rank's message with `tag` comes first (host memory only):
    /// the sender's group rank lands here once the Work completed; `root` is not read.
    pub any_source: Option<Arc<AtomicUsize>>,
}

impl Op {
    /// A `kind` op on `place` with nothing set yet: empty buffers, uint8, SUM, root 0, tag
    /// 0, asynchronous. Front ends fill in the fields their call has
    /// (`Op { inp, out, ..Op::new(kind, place) }`).
    pub fn new(kind: Kind, place: Place) -> Op {
        Op {
            kind,
            place,
            inp: Span::default(),
            out: Span::default(),
            dtype: DType::U8,
            op: ReduceOp::Sum,
            root: 0,
            tag: 0,
            splits: None,
            blocking: false,
            invalid: None,
            any_source: None,
        }
    }

    /// An op that only joins `kind` as invalid with `error` (see `Group::run`).
    pub fn invalid(kind: Kind, place: Place, error: Error) -> Op {
        Op { invalid: Some(error), ..Op::new(kind, place) }
    }
}
