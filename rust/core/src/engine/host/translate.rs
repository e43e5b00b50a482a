//! The host engine's translation of the op record: `HostCall`, a collective (`Collective`)
//! or a send/recv (`P2p`), made by `Engine::run` (mod.rs).

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use crate::collective::op::Op;
use crate::collective::{validate, Buf, Collective, Kind};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// A point-to-point operation with one peer (a rank of the group).
#[derive(Debug)]
pub enum P2p {
    Send {
        buf: Buf,
        dtype: DType,
        peer: usize,
        tag: i64,
    },
    Recv {
        buf: Buf,
        dtype: DType,
        peer: usize,
        tag: i64,
    },
    /// A recv from whichever rank's message with this tag comes first (dist.recv/irecv
    /// without src, CPU tensors): `source` holds that rank once the Work completes.
    RecvAny {
        buf: Buf,
        dtype: DType,
        tag: i64,
        source: Arc<AtomicUsize>,
    },
}

/// What the host engine runs: a collective (on the calling thread, returning when done,
/// when `blocking`) or a send/recv (always a Work).
#[derive(Debug)]
pub enum HostCall {
    Collective { c: Collective, blocking: bool },
    P2p(P2p),
}

/// Tags run from 0 to 2^31 - 1, as gloo's (a 32-bit slot) do: a tag outside is a bad
/// argument, refused on both sides (see `P2p::check_tag`).
pub const P2P_TAG_LIMIT: i64 = 1 << 31;

impl P2p {
    /// The peer of a send or recv; None for a recv from any source.
    pub fn peer(&self) -> Option<usize> {
        match self {
            P2p::Send { peer, .. } | P2p::Recv { peer, .. } => Some(*peer),
            P2p::RecvAny { .. } => None,
        }
    }

    /// This rank's (`me`) tag is in range, or the error that names both ranks.
    pub fn check_tag(&self, me: usize) -> crate::Result<()> {
        let (what, tag) = match self {
            P2p::Send { peer, tag, .. } => (format!("send to rank {peer}"), *tag),
            P2p::Recv { peer, tag, .. } => (format!("recv from rank {peer}"), *tag),
            P2p::RecvAny { tag, .. } => ("recv from any rank".to_string(), *tag),
        };
        if (0..P2P_TAG_LIMIT).contains(&tag) {
            return Ok(());
        }
        Err(crate::Error::InvalidArgument(format!("rank {me} posted a {what} with tag {tag}, out of range: tags run from 0 to 2^31 - 1")))
    }
}

impl HostCall {
    /// What the host engine runs for `op` of `rank` in a group of `n` ranks. Errors are
    /// this rank's bad arguments.
    pub fn from_op(op: &Op, rank: usize, n: usize) -> Result<HostCall> {
        if op.kind.is_p2p() {
            return Ok(HostCall::P2p(P2p::from_op(op, rank, n)?));
        }
        Ok(HostCall::Collective { c: Collective::from_op(op, rank, n)?, blocking: op.blocking })
    }
}

impl P2p {
    /// The host engine's description of a send or recv of `rank` in a group of `n` ranks
    /// (its peer travels in `op.root`).
    pub fn from_op(op: &Op, rank: usize, n: usize) -> Result<P2p> {
        if !op.kind.is_p2p() {
            return Err(Error::Internal(format!("{} is not point to point", op.kind.name())));
        }
        if let (Kind::Recv, Some(source)) = (op.kind, &op.any_source) {
            return Ok(P2p::RecvAny { buf: op.out.buf(), dtype: op.dtype, tag: op.tag, source: source.clone() });
        }
        let (dtype, tag, peer) = (op.dtype, op.tag, validate::peer(op.kind.name(), rank, op.root, n)?);
        Ok(if op.kind == Kind::Send {
            P2p::Send { buf: op.inp.buf(), dtype, peer, tag }
        } else {
            P2p::Recv { buf: op.out.buf(), dtype, peer, tag }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::op::{Chunks, Place, Span};
    use crate::dtype::ReduceOp;

    fn op(kind: Kind, inp: u64, out: u64) -> Op {
        Op {
            inp: Span { ptr: 0x1000, bytes: inp },
            out: Span { ptr: 0x2000, bytes: out },
            dtype: DType::F32,
            op: ReduceOp::Max,
            root: 1,
            tag: 3,
            blocking: true,
            ..Op::new(kind, Place::Host)
        }
    }

    /// Every kind has one route on the host engine, a call of the matching shape (the
    /// device engines' check is in cuda/engine/translate.rs). Invalid has none: it only
    /// joins, through `Engine::join_invalid`.
    #[test]
    fn every_kind_has_a_host_route() {
        for k in Kind::ALL {
            let mut o = if k == Kind::ReduceScatter { op(k, 64 * 4, 64) } else { op(k, 64, 64 * 4) };
            o.splits = Some(Chunks { send: vec![], send_bytes: vec![32, 32], recv: vec![], recv_bytes: vec![32, 32] });
            let host = HostCall::from_op(&o, 0, 4);
            assert_eq!(host.is_ok(), k != Kind::Invalid, "{k:?} on the host engine");
            if k != Kind::Invalid {
                assert_eq!(matches!(host.unwrap(), HostCall::P2p(_)), k.is_p2p(), "{k:?} on the host engine");
            }
        }
        assert!(HostCall::from_op(&op(Kind::AllToAll, 64, 64), 0, 4).is_err(), "all_to_all needs its splits");
        let mut send = op(Kind::Send, 64, 64);
        send.root = 0;
        assert!(HostCall::from_op(&send, 0, 4).unwrap_err().to_string().contains("rank 0 passed peer 0"), "itself");
        send.root = 3;
        assert!(HostCall::from_op(&send, 0, 4).is_ok());
    }

    /// A recv from any source is a recv whose sender lands in `any_source`: `RecvAny`.
    #[test]
    fn a_recv_from_any_source_is_a_recv_any() {
        let source = Arc::new(AtomicUsize::new(usize::MAX));
        let mut o = Op { out: Span { ptr: 0x2000, bytes: 64 }, tag: 5, root: -1, ..Op::new(Kind::Recv, Place::Host) };
        o.any_source = Some(source.clone());
        let HostCall::P2p(P2p::RecvAny { tag, source: s, .. }) = HostCall::from_op(&o, 0, 4).unwrap() else {
            panic!("not a recv from any")
        };
        assert!(tag == 5 && Arc::ptr_eq(&s, &source));
    }

    #[test]
    fn host_roots_are_checked_and_root_only_sides_dropped() {
        let mut g = op(Kind::Gather, 16, 64);
        assert!(matches!(Collective::from_op(&g, 0, 4).unwrap(), Collective::Gather { output: None, root: 1, .. }));
        assert!(matches!(Collective::from_op(&g, 1, 4).unwrap(), Collective::Gather { output: Some(_), .. }));
        g.root = -1;
        let e = Collective::from_op(&g, 0, 4).unwrap_err().to_string();
        assert!(e.contains("gather: root/src rank -1 is out of range for a group of size 4"), "{e}");
    }
}
