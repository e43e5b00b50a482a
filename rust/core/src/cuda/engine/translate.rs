//! The device engines' translation of the op record: `CudaCall::from_op`, the one call
//! record rsccl's CUDA engine and the NCCL engine launch (each calls it in its
//! `Engine::run`). What the engine reduces is not checked here but asked of the engine
//! itself, before this (`Engine::can_run`, `cuda::decide::can_run`): rsccl's kernels and
//! NCCL reduce different dtypes.

use super::CudaCall;
use crate::collective::op::Op;
use crate::collective::{validate, Kind};
use crate::cuda::decide::{self, Blocks};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

impl CudaCall {
    /// What a device engine runs for `op` of `rank` in a group of `n` ranks, after
    /// `stream`. Errors are this rank's bad arguments, naming it (`Error::naming_rank`, as
    /// the host engine's agreed errors do). The chunks of a kind whose sizes are per peer
    /// move into the call (no copy per call).
    pub fn from_op(op: &mut Op, rank: usize, n: usize, stream: u64) -> Result<CudaCall> {
        translate(op, rank, n, stream).map_err(|e| e.naming_rank(rank))
    }
}

fn translate(op: &mut Op, rank: usize, n: usize, stream: u64) -> Result<CudaCall> {
    if op.any_source.is_some() {
        return Err(Error::InvalidArgument(
            "a recv from any source takes host memory; on CUDA pass the sender's rank (NCCL has no receive from any source)".into(),
        ));
    }
    if op.kind == Kind::Invalid {
        return Err(Error::Internal("an invalid call without its error".into()));
    }
    let mut call = cuda_call(op, rank, n, stream)?;
    if op.kind.has_chunks() {
        let chunks = op.splits.take().ok_or_else(|| Error::Internal(format!("{} without splits", op.kind.name())))?;
        // The kernels copy a rank's own chunk locally: both sides of it must agree here
        // (the host engine checks this in check_local).
        if let (Some(s), Some(r)) = (chunks.send_bytes.get(rank), chunks.recv_bytes.get(rank)) {
            if s != r {
                return Err(Error::InvalidArgument(format!(
                    "{}: rank {rank} sends itself {s} bytes but expects {r} bytes from itself \
                     (its input and output splits disagree at its own rank)",
                    op.kind.name()
                )));
            }
        }
        call.chunks = Some(chunks);
    }
    Ok(call)
}

/// The CUDA engines' description of `op` of `rank` on `stream` in a group of `n` ranks:
/// what its `count` means per kind, and uint8/SUM for operations that move bytes. The root,
/// the peer of a send/recv and the block-per-rank sizes are checked here, by the rules of
/// `validate` (the caller names the rank, `Error::naming_rank`).
fn cuda_call(op: &Op, rank: usize, n: usize, stream: u64) -> Result<CudaCall> {
    let elem = op.dtype.size() as u64;
    // The buffer that holds a block per rank must hold `n` of the other's.
    match decide::blocks_per_rank(op.kind) {
        Some(Blocks::Output) => validate::blocks_per_rank(op.kind.name(), n, elem, ("output", op.out.bytes), ("input", op.inp.bytes))?,
        Some(Blocks::Input) => validate::blocks_per_rank(op.kind.name(), n, elem, ("input", op.inp.bytes), ("output", op.out.bytes))?,
        None => {}
    }
    let count = decide::cuda_count(op.kind, op.inp.bytes, op.out.bytes, op.dtype.size() as u64);
    let (dtype, rop) = if op.kind.moves_bytes() || !op.kind.has_op() { (DType::U8, ReduceOp::Sum) } else { (op.dtype, op.op) };
    let root = match (op.kind.has_root(), op.kind.is_p2p()) {
        (true, _) => validate::root(op.kind.name(), op.root, n)?,
        (false, true) => validate::peer(op.kind.name(), rank, op.root, n)?,
        (false, false) => 0,
    };
    Ok(CudaCall {
        kind: op.kind,
        dtype,
        op: rop,
        root,
        inp: op.inp.ptr,
        out: op.out.ptr,
        count,
        chunks: None,
        stream,
        asynchronous: !op.blocking,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::op::{Chunks, Place, Span};
    use crate::cuda::decide::NcclCall;
    use crate::cuda::kernels::{self, Shape};

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

    fn to_cuda(o: &Op, n: usize, stream: u64) -> Result<CudaCall> {
        cuda_call(o, 0, n, stream)
    }

    /// Every kind is one call record of the matching shape on the device engines (the
    /// registry check that a new kind is wired through the seam; the host engine's is in
    /// engine/host/translate.rs). Invalid has none: it only joins, through
    /// `Engine::join_invalid`.
    #[test]
    fn every_kind_has_a_device_route() {
        for k in Kind::ALL {
            // A block per rank on the side that holds them.
            let mut o = if k == Kind::ReduceScatter { op(k, 64 * 4, 64, DType::F32) } else { op(k, 64, 64 * 4, DType::F32) };
            o.splits = Some(Chunks { send: vec![], send_bytes: vec![32, 32], recv: vec![], recv_bytes: vec![32, 32] });
            let device = CudaCall::from_op(&mut o, 0, 4, 7);
            assert_eq!(device.is_ok(), k != Kind::Invalid, "{k:?} on a device engine");
            if k == Kind::Invalid {
                continue;
            }
            let c = device.unwrap();
            assert_eq!((c.kind, c.stream, c.asynchronous), (k, 7, false));
            // Each engine's one launch entry routes by what the kind is to it: rsccl's kernel
            // takes the call's shape, and NCCL's call is the pair communicators' for one
            // peer and a group of sends and receives for chunks.
            // Both of a kind's kernels where it has a low-latency one (`low_latency_max`).
            for ll in [0, kernels::LL_MAX_BYTES] {
                let kernel = decide::kernel(k, 64, 2, 4, 0, ll);
                assert_eq!(kernel.shape(), c.shape(), "{k:?}: rsccl's kernel takes the call's shape");
                let name = kernels::kernel_name(kernel, DType::BF16).unwrap();
                assert!(kernels::required_kernels().iter().any(|e| e.1 == name), "{k:?}: its kernel {name} is in the table");
            }
            let nccl = decide::nccl_call(k);
            assert_eq!(
                (nccl == NcclCall::P2p, nccl == NcclCall::AllToAll),
                (c.shape() == Shape::Peer, c.shape() == Shape::Chunks),
                "{k:?}"
            );
            match c.shape() {
                Shape::Peer => {
                    let (ptr, want) = if k == Kind::Send { (c.inp, (0x1000, 64)) } else { (c.out, (0x2000, 256)) };
                    assert_eq!((ptr, c.count, c.root), (want.0, want.1, 1), "{k:?}: the peer in root, the message's bytes in count");
                }
                Shape::Chunks => assert_eq!((k.has_chunks(), c.chunks.unwrap().send_bytes), (true, vec![32, 32])),
                Shape::Collective => assert!(!k.is_p2p() && !k.has_chunks(), "{k:?}"),
            }
        }
        let mut a2a = op(Kind::AllToAll, 64, 64, DType::F32);
        assert!(CudaCall::from_op(&mut a2a, 0, 4, 7).is_err(), "all_to_all needs its splits");
        let mut send = op(Kind::Send, 64, 64, DType::F32);
        send.root = -2;
        let e = CudaCall::from_op(&mut send, 0, 4, 7).unwrap_err().to_string();
        assert!(e.contains("send: rank 0 passed peer -2; give another rank of this group of 4"), "{e}");
        send.root = 3;
        assert!(CudaCall::from_op(&mut send, 0, 4, 7).is_ok());
    }

    /// A recv from any source is the host engine's alone (NCCL has none): refused here.
    #[test]
    fn a_recv_from_any_source_is_refused_on_cuda() {
        let mut o = Op { out: Span { ptr: 0x2000, bytes: 64 }, tag: 5, root: -1, ..Op::new(Kind::Recv, Place::Cuda { stream: 7 }) };
        o.any_source = Some(Default::default());
        let e = CudaCall::from_op(&mut o, 0, 4, 7).unwrap_err().to_string();
        assert!(e.contains("a recv from any source takes host memory"), "{e}");
    }

    #[test]
    fn cuda_counts_follow_each_kind() {
        let c = to_cuda(&op(Kind::AllReduce, 4096, 4096, DType::BF16), 2, 9).unwrap();
        assert_eq!((c.count, c.dtype, c.op, c.root, c.stream, c.asynchronous), (2048, DType::BF16, ReduceOp::Max, 0, 9, false));
        let c = to_cuda(&op(Kind::ReduceScatter, 4096, 1024, DType::F32), 4, 0).unwrap();
        assert_eq!(c.count, 256);
        let c = to_cuda(&op(Kind::AllGather, 100, 400, DType::F32), 4, 0).unwrap();
        assert_eq!((c.count, c.dtype, c.op), (100, DType::U8, ReduceOp::Sum));
        let c = to_cuda(&op(Kind::Scatter, 400, 100, DType::I64), 4, 0).unwrap();
        assert_eq!((c.count, c.root, c.dtype), (100, 1, DType::U8));
        assert!(to_cuda(&op(Kind::Broadcast, 8, 8, DType::U8), 1, 0).is_err(), "root 1 in a group of 1");
    }

    /// What an engine reduces is not this translation's business (Engine::can_run asks the
    /// engine, cuda::decide::can_run): a float64 all_reduce translates for both engines.
    #[test]
    fn cuda_translation_leaves_the_dtype_to_the_engine() {
        let c = to_cuda(&op(Kind::AllReduce, 64, 64, DType::F64), 4, 0).unwrap();
        assert_eq!((c.dtype, c.op, c.count), (DType::F64, ReduceOp::Max, 8));
        // Operations that move bytes run as uint8.
        assert_eq!(to_cuda(&op(Kind::AllGather, 64, 256, DType::F64), 4, 0).unwrap().dtype, DType::U8);
    }

    /// What the kernels cannot see is checked here: a rank's own all_to_all chunk, the
    /// block-per-rank buffer of all_gather and reduce_scatter.
    #[test]
    fn cuda_sizes_are_checked_within_the_rank() {
        let e = to_cuda(&op(Kind::AllGather, 16, 28, DType::F32), 3, 0).unwrap_err().to_string();
        assert_eq!(e, "all_gather: output has 7 elements, expected group size 3 x input 4 = 12");
        let e = to_cuda(&op(Kind::ReduceScatter, 40, 16, DType::F32), 2, 0).unwrap_err().to_string();
        assert_eq!(e, "reduce_scatter: input has 10 elements, expected group size 2 x output 4 = 8");
        assert!(to_cuda(&op(Kind::ReduceScatter, 32, 16, DType::F32), 2, 0).is_ok());
        // The device path names the rank as the host engine's agreement does.
        let e = CudaCall::from_op(&mut op(Kind::ReduceScatter, 40, 16, DType::F32), 1, 2, 0).unwrap_err().to_string();
        assert!(e.starts_with("rank 1: reduce_scatter: input has 10 elements"), "{e}");
        let mut a2a = op(Kind::AllToAll, 0, 0, DType::U8);
        a2a.splits = Some(Chunks { send: vec![0, 0], send_bytes: vec![8, 4], recv: vec![0, 0], recv_bytes: vec![8, 12] });
        let e = CudaCall::from_op(&mut a2a, 1, 2, 0).unwrap_err().to_string();
        assert!(e.contains("all_to_all: rank 1 sends itself 4 bytes but expects 12 bytes from itself"), "{e}");
    }
}
