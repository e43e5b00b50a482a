//! Engines run submitted operations. All engines sit behind `Engine`; the group picks one
//! from the topology (`group::choose_engine`).

pub mod host;

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use crate::collective::{Buf, Collective};
use crate::dtype::DType;
use crate::work::WorkState;

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

/// What an engine has reserved, mapped and uses, in bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub host_region_bytes: u64,
    pub host_mapped_bytes: u64,
    pub collectives: u64,
    pub p2p_messages: u64,
    pub staged_bytes: u64,
}

pub trait Engine: Send + Sync {
    fn submit(&self, c: Collective, timeout: Duration) -> Arc<WorkState>;
    /// Run `c` and return when it completed, after every collective submitted before it.
    fn run_now(&self, c: Collective, timeout: Duration) -> crate::Result<()> {
        self.submit(c, timeout).wait(None)
    }
    fn submit_p2p(&self, op: P2p, timeout: Duration) -> Arc<WorkState>;
    fn stats(&self) -> MemoryStats;
    /// The global rank of each group rank, for error messages of a subgroup (called once,
    /// right after creation; engines without such messages ignore it).
    fn name_global_ranks(&self, _global: Vec<usize>) {}
    /// Stop the engine's threads; pending operations fail with `Error::Aborted`.
    fn shutdown(&self);
}
