//! What bounds every wait of the NCCL engine's creation (`Bound`), and the free device
//! memory it measures creation by; used by create.rs, warm.rs and pairs.rs.

use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;

use crate::bootstrap::SetupWatch;
use crate::cuda::driver::check;
use crate::error::{Error, Result};

/// Free device memory of the current context.
pub(super) fn free_bytes() -> Result<u64> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: out-pointers to locals; a context is current (the caller bound it).
    check(unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo")?;
    Ok(free as u64)
}

/// What bounds every wait of the NCCL engine's creation: the group's deadline, and the
/// other ranks of this host, watched through their pidfds (`SetupWatch`), so that a local
/// rank that dies ends the wait at once rather than at the deadline. The error it gives is
/// named by the caller of `create` (`SetupWatch::during` -> `explain`: the rank, its pid
/// and the phase).
#[derive(Clone, Copy)]
pub(super) struct Bound<'a> {
    pub(super) deadline: Instant,
    pub(super) watch: &'a SetupWatch,
}

impl Bound<'_> {
    /// Err if a local rank of the group has exited; `during` completes "... exited during".
    pub(super) fn peers_alive(&self, during: &str) -> Result<()> {
        if self.watch.exited(Duration::ZERO).is_empty() {
            return Ok(());
        }
        Err(Error::PeerFailure(format!("a local rank exited during {during}")))
    }
}
