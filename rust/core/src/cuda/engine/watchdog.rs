//! The watchdog thread: a local peer process gone sets the abort word (kernels stop within
//! milliseconds) and poisons the other peers.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::status::{HostWords, Shared};
use crate::bootstrap::LocalMesh;
use crate::error::Error;

/// The error naming local peer `j`, whose process is gone (`pids`: each local peer's pid,
/// read while the connections were up).
pub(super) fn gone_error(local_ranks: &[usize], pids: &[Option<u32>], j: usize) -> Error {
    let pid = pids.get(j).copied().flatten().map(|pid| format!("pid {pid}, ")).unwrap_or_default();
    Error::PeerFailure(format!(
        "rank {} ({pid}local rank {j}) is gone: its process exited or closed its connection",
        local_ranks.get(j).copied().unwrap_or(j)
    ))
}

pub(super) fn watchdog(sh: Arc<Shared>, mesh: Arc<LocalMesh>, local_ranks: Vec<usize>, pids: Vec<Option<u32>>) {
    while !sh.stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(50));
        let gone = mesh.gone();
        if let Some(&j) = gone.first() {
            let mut p = sh.poisoned.lock();
            if p.is_none() {
                *p = Some(gone_error(&local_ranks, &pids, j));
            }
            drop(p);
            // Kernels poll this word while they wait and return (NOTE [Bounded waits] in csrc_kernels/protocol.cuh).
            sh.words.write(HostWords::ABORT, 1);
            // The other peers see the death themselves within one poll; this stops their
            // kernels that wait on this rank's sooner, naming the dead rank as the cause.
            sh.poison_peers(j);
            return;
        }
    }
}
