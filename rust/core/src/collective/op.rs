//! The op record: one operation as one rank called it, on any device. Every torch method
//! builds one (Python: `Communicator.run`), and `Group::run` routes it to the engine of its
//! place. The translations into each engine's own description (`Collective`, `P2p`,
//! `CudaCall`) live here, once, with exhaustive matches on `Kind`.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use super::{validate, Buf, Collective, Kind};
use crate::cuda::decide::{self, Blocks};
use crate::cuda::{AllToAll, CudaCall, DeviceCall};
use crate::dtype::{DType, ReduceOp};
use crate::engine::{HostCall, P2p};
use crate::error::{Error, Result};

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
    pub(super) fn buf(self) -> Buf {
        if self.bytes == 0 {
            Buf::empty()
        } else {
            Buf { ptr: self.ptr as *mut u8, len: self.bytes as usize }
        }
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
    /// all_to_all: per peer, in group-rank order, the chunk sent (address, bytes) and where
    /// the chunk from that peer lands. The host engine uses the byte counts only.
    pub splits: Option<AllToAll>,
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

    /// What the host engine runs for this op (`rank` of `n`). Errors are this rank's bad
    /// arguments.
    pub fn to_host(&self, rank: usize, n: usize) -> Result<HostCall> {
        if self.kind.is_p2p() {
            return Ok(HostCall::P2p(self.to_p2p(rank, n)?));
        }
        Ok(HostCall::Collective { c: Collective::from_op(self, rank, n)?, blocking: self.blocking })
    }

    /// What a device engine runs for this op of `rank` in a group of `n` ranks, after
    /// `stream`. Errors are this rank's bad arguments. An all_to_all's splits move into the
    /// call (no copy per call).
    pub fn to_device(&mut self, rank: usize, n: usize, stream: u64) -> Result<DeviceCall> {
        let asynchronous = !self.blocking;
        if self.any_source.is_some() {
            return Err(Error::InvalidArgument(
                "a recv from any source takes host memory; on CUDA pass the sender's rank (NCCL has no receive from any source)".into(),
            ));
        }
        if self.kind.is_p2p() {
            let send = self.kind == Kind::Send;
            let span = if send { self.inp } else { self.out };
            return Ok(DeviceCall::P2p { send, ptr: span.ptr, bytes: span.bytes, peer: self.peer(rank, n)?, stream, asynchronous });
        }
        if self.kind == Kind::AllToAll {
            let chunks = self.splits.take().ok_or_else(|| Error::Internal("all_to_all without splits".into()))?;
            // The kernels copy a rank's own chunk locally: both sides of it must agree here
            // (the host engine checks this in check_local).
            if let (Some(s), Some(r)) = (chunks.send_bytes.get(rank), chunks.recv_bytes.get(rank)) {
                if s != r {
                    return Err(Error::InvalidArgument(format!(
                        "all_to_all: rank {rank} sends itself {s} bytes but expects {r} bytes from itself \
                         (its input and output splits disagree at its own rank)"
                    )));
                }
            }
            return Ok(DeviceCall::AllToAll { chunks, stream, asynchronous });
        }
        if self.kind == Kind::Invalid {
            return Err(Error::Internal("an invalid call without its error".into()));
        }
        Ok(DeviceCall::Collective(self.to_cuda(n, stream)?))
    }

    /// The host engine's description of a send or recv of `rank` in a group of `n` ranks.
    pub fn to_p2p(&self, rank: usize, n: usize) -> Result<P2p> {
        if !self.kind.is_p2p() {
            return Err(Error::Internal(format!("{} is not point to point", self.kind.name())));
        }
        if let (Kind::Recv, Some(source)) = (self.kind, &self.any_source) {
            return Ok(P2p::RecvAny { buf: self.out.buf(), dtype: self.dtype, tag: self.tag, source: source.clone() });
        }
        let (dtype, tag, peer) = (self.dtype, self.tag, self.peer(rank, n)?);
        Ok(if self.kind == Kind::Send {
            P2p::Send { buf: self.inp.buf(), dtype, peer, tag }
        } else {
            P2p::Recv { buf: self.out.buf(), dtype, peer, tag }
        })
    }

    /// The peer of a send or recv of `rank` in a group of `n` (it travels in `root`).
    fn peer(&self, rank: usize, n: usize) -> Result<usize> {
        validate::peer(self.kind.name(), rank, self.root, n)
    }

    /// The CUDA engines' description of a collective on `stream` in a group of `n` ranks:
    /// what its `count` means per kind, and uint8/SUM for operations that move bytes. The
    /// root and the block-per-rank sizes are checked here, by the rules of `validate`
    /// (the caller names the rank, `Error::naming_rank`). What the
    /// engine reduces is not checked here but asked of the engine itself, before this
    /// (`Engine::can_run`, `cuda::decide::can_run`): rsccl's kernels and NCCL reduce
    /// different dtypes.
    pub fn to_cuda(&self, n: usize, stream: u64) -> Result<CudaCall> {
        let elem = self.dtype.size() as u64;
        // The buffer that holds a block per rank must hold `n` of the other's.
        match decide::blocks_per_rank(self.kind) {
            Some(Blocks::Output) => {
                validate::blocks_per_rank(self.kind.name(), n, elem, ("output", self.out.bytes), ("input", self.inp.bytes))?
            }
            Some(Blocks::Input) => {
                validate::blocks_per_rank(self.kind.name(), n, elem, ("input", self.inp.bytes), ("output", self.out.bytes))?
            }
            None => {}
        }
        let count = decide::cuda_count(self.kind, self.inp.bytes, self.out.bytes, self.dtype.size() as u64);
        let (dtype, op) = if self.kind.moves_bytes() || !self.kind.has_op() { (DType::U8, ReduceOp::Sum) } else { (self.dtype, self.op) };
        let root = if self.kind.has_root() { validate::root(self.kind.name(), self.root, n)? } else { 0 };
        Ok(CudaCall { kind: self.kind, dtype, op, root, inp: self.inp.ptr, out: self.out.ptr, count, stream, asynchronous: !self.blocking })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(kind: Kind, inp: u64, out: u64, dtype: DType) -> Op {
        Op {
            inp: Span { ptr: 0x1000, bytes: inp },
            out: Span { ptr: 0x2000, bytes: out },
            dtype,
            op: ReduceOp::Max,
            root: 1,
            tag: 3,
            blocking: true,
            ..Op::new(kind, Place::Cuda { stream: 7 })
        }
    }

    /// Every kind has one route on each place: a call of the host engine and one of the
    /// device engines, of the matching shape (the registry check that a new kind is wired
    /// through the seam). Invalid has none: it only joins, through `Engine::join_invalid`.
    #[test]
    fn every_kind_has_a_route() {
        for k in Kind::ALL {
            // A block per rank on the side that holds them.
            let mut o = if k == Kind::ReduceScatter { op(k, 64 * 4, 64, DType::F32) } else { op(k, 64, 64 * 4, DType::F32) };
            o.splits = Some(AllToAll { send: vec![], send_bytes: vec![32, 32], recv: vec![], recv_bytes: vec![32, 32] });
            let host = o.to_host(0, 4);
            let device = o.to_device(0, 4, 7);
            assert_eq!(host.is_ok(), k != Kind::Invalid, "{k:?} on the host engine");
            assert_eq!(device.is_ok(), k != Kind::Invalid, "{k:?} on a device engine");
            if k == Kind::Invalid {
                continue;
            }
            assert_eq!(matches!(host.unwrap(), HostCall::P2p(_)), k.is_p2p(), "{k:?} on the host engine");
            match device.unwrap() {
                DeviceCall::P2p { send, ptr, bytes, peer, stream, asynchronous } => {
                    assert!(k.is_p2p(), "{k:?}");
                    let want = if k == Kind::Send { (true, 0x1000, 64) } else { (false, 0x2000, 256) };
                    assert_eq!((send, ptr, bytes, peer, stream, asynchronous), (want.0, want.1, want.2, 1, 7, false));
                }
                DeviceCall::AllToAll { chunks, stream, .. } => {
                    assert_eq!((k, chunks.send_bytes, stream), (Kind::AllToAll, vec![32, 32], 7));
                }
                DeviceCall::Collective(c) => {
                    assert!(!k.is_p2p() && k != Kind::AllToAll, "{k:?}");
                    assert_eq!((c.kind, c.stream), (k, 7));
                }
            }
        }
        let mut a2a = op(Kind::AllToAll, 64, 64, DType::F32);
        a2a.splits = None;
        assert!(a2a.to_device(0, 4, 7).is_err() && a2a.to_host(0, 4).is_err(), "all_to_all needs its splits");
        let mut send = op(Kind::Send, 64, 64, DType::F32);
        send.root = -2;
        let e = send.to_device(0, 4, 7).unwrap_err().to_string();
        assert!(e.contains("send: rank 0 passed peer -2; give another rank of this group of 4"), "{e}");
        send.root = 0;
        assert!(send.to_host(0, 4).unwrap_err().to_string().contains("rank 0 passed peer 0"), "itself");
        send.root = 3;
        assert!(send.to_host(0, 4).is_ok() && send.to_device(0, 4, 7).is_ok());
    }

    /// A recv from any source is a recv whose sender lands in `any_source`: the host
    /// engine's `RecvAny`; the device engines have none (NCCL has none) and refuse it.
    #[test]
    fn a_recv_from_any_source_runs_on_host_memory_only() {
        let source = Arc::new(AtomicUsize::new(usize::MAX));
        let mut o = Op { out: Span { ptr: 0x2000, bytes: 64 }, tag: 5, root: -1, ..Op::new(Kind::Recv, Place::Host) };
        o.any_source = Some(source.clone());
        let HostCall::P2p(P2p::RecvAny { tag, source: s, .. }) = o.to_host(0, 4).unwrap() else { panic!("not a recv from any") };
        assert!(tag == 5 && Arc::ptr_eq(&s, &source));
        let e = o.to_device(0, 4, 7).unwrap_err().to_string();
        assert!(e.contains("a recv from any source takes host memory"), "{e}");
    }

    #[test]
    fn device_calls_take_the_stream_they_run_after() {
        let mut o = op(Kind::Recv, 64, 64, DType::F32);
        let DeviceCall::P2p { stream, asynchronous, .. } = o.to_device(0, 2, 0).unwrap().after(11, true) else { panic!("not p2p") };
        assert_eq!((stream, asynchronous), (11, true));
        let DeviceCall::Collective(c) = op(Kind::AllReduce, 64, 64, DType::F32).to_device(0, 2, 0).unwrap().after(5, false) else {
            panic!("not a collective")
        };
        assert_eq!((c.stream, c.asynchronous), (5, false));
    }

    #[test]
    fn cuda_counts_follow_each_kind() {
        let c = op(Kind::AllReduce, 4096, 4096, DType::BF16).to_cuda(2, 9).unwrap();
        assert_eq!((c.count, c.dtype, c.op, c.root, c.stream, c.asynchronous), (2048, DType::BF16, ReduceOp::Max, 0, 9, false));
        let c = op(Kind::ReduceScatter, 4096, 1024, DType::F32).to_cuda(4, 0).unwrap();
        assert_eq!(c.count, 256);
        let c = op(Kind::AllGather, 100, 400, DType::F32).to_cuda(4, 0).unwrap();
        assert_eq!((c.count, c.dtype, c.op), (100, DType::U8, ReduceOp::Sum));
        let c = op(Kind::Scatter, 400, 100, DType::I64).to_cuda(4, 0).unwrap();
        assert_eq!((c.count, c.root, c.dtype), (100, 1, DType::U8));
        assert!(op(Kind::Broadcast, 8, 8, DType::U8).to_cuda(1, 0).is_err(), "root 1 in a group of 1");
    }

    /// What an engine reduces is not this translation's business (Engine::can_run asks the
    /// engine, cuda::decide::can_run): a float64 all_reduce translates for both engines.
    #[test]
    fn cuda_translation_leaves_the_dtype_to_the_engine() {
        let c = op(Kind::AllReduce, 64, 64, DType::F64).to_cuda(4, 0).unwrap();
        assert_eq!((c.dtype, c.op, c.count), (DType::F64, ReduceOp::Max, 8));
        // Operations that move bytes run as uint8.
        assert_eq!(op(Kind::AllGather, 64, 256, DType::F64).to_cuda(4, 0).unwrap().dtype, DType::U8);
    }

    /// What the kernels cannot see is checked here: a rank's own all_to_all chunk, the
    /// block-per-rank buffer of all_gather and reduce_scatter.
    #[test]
    fn cuda_sizes_are_checked_within_the_rank() {
        let e = op(Kind::AllGather, 16, 28, DType::F32).to_cuda(3, 0).unwrap_err().to_string();
        assert_eq!(e, "all_gather: output has 7 elements, expected group size 3 x input 4 = 12");
        let e = op(Kind::ReduceScatter, 40, 16, DType::F32).to_cuda(2, 0).unwrap_err().to_string();
        assert_eq!(e, "reduce_scatter: input has 10 elements, expected group size 2 x output 4 = 8");
        assert!(op(Kind::ReduceScatter, 32, 16, DType::F32).to_cuda(2, 0).is_ok());
        // The device path names the rank as the host engine's agreement does.
        let e = op(Kind::ReduceScatter, 40, 16, DType::F32).to_device(1, 2, 0).unwrap_err().naming_rank(1).to_string();
        assert!(e.starts_with("rank 1: reduce_scatter: input has 10 elements"), "{e}");
        let mut a2a = op(Kind::AllToAll, 0, 0, DType::U8);
        a2a.splits = Some(AllToAll { send: vec![0, 0], send_bytes: vec![8, 4], recv: vec![0, 0], recv_bytes: vec![8, 12] });
        let e = a2a.to_device(1, 2, 0).unwrap_err().to_string();
        assert!(e.contains("all_to_all: rank 1 sends itself 4 bytes but expects 12 bytes from itself"), "{e}");
    }

    #[test]
    fn host_roots_are_checked_and_root_only_sides_dropped() {
        let mut g = op(Kind::Gather, 16, 64, DType::F32);
        assert!(matches!(Collective::from_op(&g, 0, 4).unwrap(), Collective::Gather { output: None, root: 1, .. }));
        assert!(matches!(Collective::from_op(&g, 1, 4).unwrap(), Collective::Gather { output: Some(_), .. }));
        g.root = -1;
        let e = Collective::from_op(&g, 0, 4).unwrap_err().to_string();
        assert!(e.contains("gather: root/src rank -1 is out of range for a group of size 4"), "{e}");
    }
}
