//! Engines run submitted operations. All engines sit behind `Engine`; the group picks one
//! from the topology (`group::choose_engine`).

pub mod host;

use std::sync::Arc;
use std::time::Duration;

use crate::collective::{Buf, Collective};
use crate::dtype::DType;
use crate::work::WorkState;

/// A point-to-point operation with one peer (a rank of the group).
#[derive(Debug)]
pub enum P2p {
    Send { buf: Buf, dtype: DType, peer: usize, tag: i64 },
    Recv { buf: Buf, dtype: DType, peer: usize, tag: i64 },
}

/// Tags run from 0 to 2^31 - 1, as gloo's (a 32-bit slot) do: a tag outside is a bad
/// argument, refused on both sides (see `P2p::check_tag`).
pub const P2P_TAG_LIMIT: i64 = 1 << 31;

impl P2p {
    pub fn peer(&self) -> usize {
        match self {
            P2p::Send { peer, .. } | P2p::Recv { peer, .. } => *peer,
        }
    }

    /// This rank's (`me`) tag is in range, or the error that names both ranks.
    pub fn check_tag(&self, me: usize) -> crate::Result<()> {
        let (what, tag) = match self {
            P2p::Send { tag, .. } => ("send to", *tag),
            P2p::Recv { tag, .. } => ("recv from", *tag),
        };
        if (0..P2P_TAG_LIMIT).contains(&tag) {
            return Ok(());
        }
        Err(crate::Error::InvalidArgument(format!(
            "rank {me} posted a {what} rank {} with tag {tag}, out of range: tags run from 0 to 2^31 - 1",
            self.peer()
        )))
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
    /// Stop the engine's threads; pending operations fail with `Error::Aborted`.
    fn shutdown(&self);
}
