//! The watchdog thread: reads the kernels' reports within milliseconds of a failure on the
//! GPU, and sets the abort word when a local peer process is gone (kernels stop within
//! milliseconds) and poisons the other peers.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::status::{gone_error, HostWords, Shared};

/// How often the watchdog reads the status page: a failed kernel holds its stream until the
/// host acted on its report (FLAG_HOLD_ON_ERROR), so this bounds how long that takes. A
/// read of two words of pinned host memory: nothing next to the GPU's work.
const POLL: Duration = Duration::from_millis(2);
/// How often it asks whether a local peer is gone (a poll of the mesh's sockets and pidfds).
const PEERS_EVERY: u32 = 25;

pub(super) fn watchdog(sh: Arc<Shared>) {
    let (mut tick, mut reported, mut peers_done) = (0u32, false, false);
    while !sh.stop.load(Ordering::Acquire) {
        std::thread::sleep(POLL);
        tick = tick.wrapping_add(1);
        // A failure a kernel of this rank reported (NOTE [Bounded waits] in
        // csrc_kernels/protocol.cuh; the cause the host knows, if it found it first): with
        // cuda_error_teardown the process ends here (Shared::kernel_failed); else the
        // group is marked failed now, which also lets a held kernel go, and the error is
        // raised at the next call or wait.
        if !reported {
            if let Some(code_err) = sh.fatal_error(sh.words.read(HostWords::FATAL)) {
                reported = true;
                let err = sh.poisoned.lock().clone().unwrap_or(code_err);
                sh.poison(sh.kernel_failed(err));
            }
        }
        // A mismatch (ERR) leaves the group usable: without teardown it is raised by the
        // next call's health check, which clears it.
        let code = sh.words.read(HostWords::ERR);
        if code != 0 && sh.teardown && sh.armed.load(Ordering::Acquire) {
            sh.mismatch_failed(code);
        }
        if peers_done || tick % PEERS_EVERY != 0 {
            continue;
        }
        if let Some(&j) = sh.mesh.gone().first() {
            peers_done = true;
            // A peer whose kernel failed (a timeout, say) poisoned every rank's word before
            // its teardown ended it: name that failure, and leave the peers' words as that
            // kernel set them (a copy here would overwrite its cause with a bare culprit).
            if let Some(cause) = sh.cause_in_own_word() {
                sh.poison(cause);
                continue;
            }
            sh.poison(gone_error(&sh.local_ranks, &sh.pids, j));
            // The other peers see the death themselves within one poll; this stops their
            // kernels that wait on this rank's sooner, naming the dead rank as the cause.
            sh.poison_peers(j);
        }
    }
}
