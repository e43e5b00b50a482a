//! The NCCL engine's failure rules: what makes the group unusable (an asynchronous NCCL
//! error, a failed local engine, a launch past the group timeout), the abort of the
//! communicators, and the watchdog thread that looks for failures.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;

use super::choice::launch_timed_out;
use super::{Shared, ABORT_GRACE};
use crate::collective::Kind;
use crate::cuda::driver::Event;
use crate::cuda::nccl::NcclComm;
use crate::cuda::EventHome;
use crate::error::Error;

/// The unit of a CudaCall's count, for messages.
fn count_unit(kind: Kind) -> &'static str {
    if kind.has_op() {
        "elements"
    } else {
        "bytes"
    }
}

impl Shared {
    pub(super) fn comms(&self) -> impl Iterator<Item = (&'static str, &NcclComm)> {
        std::iter::once(("flat (every rank)", &self.flat))
            .chain(self.cross.iter().map(|c| ("cross-host", c)))
            .chain(self.pairs.iter().map(|p| (if p.sending { "of sends to a peer" } else { "of receives from a peer" }, &p.comm)))
    }

    /// Make the group unusable with `err` (the first error wins) and have the watchdog
    /// abort the communicators. Returns the first error.
    pub(super) fn fail(&self, err: Error) -> Error {
        let e = self.poisoned.lock().get_or_insert(err).clone();
        self.abort_requested.store(true, Ordering::Release);
        if let Some(l) = &self.local {
            l.abort_with(e.clone());
        }
        e
    }

    /// A failure nobody reported yet: an NCCL asynchronous error, a failed local engine,
    /// or a launch older than the group timeout.
    pub(super) fn find_failure(&self) -> Option<Error> {
        {
            let _gate = self.gate.read();
            for (what, c) in self.comms() {
                if let Err(e) = c.async_error() {
                    return Some(with_context(e, &format!("rank {}: the NCCL communicator {what} failed", self.rank)));
                }
            }
        }
        if let Some(l) = &self.local {
            if let Err(e) = l.check_fatal() {
                return Some(e);
            }
        }
        let mut p = self.pending.lock();
        let now = Instant::now();
        // Every unfinished launch (not only the oldest: launches on streams that are not
        // ordered after each other, such as the pair communicators' send/recv, may start in
        // any order), aged from its start.
        let late = p.iter_mut().find_map(|t| {
            // SAFETY: valid events of ours (recycled only after they left `pending`).
            if unsafe { cu::cuEventQuery(t.ev.raw()) } != cu::CUresult::CUDA_ERROR_NOT_READY {
                return None;
            }
            // SAFETY: as above.
            if t.started.is_none() && unsafe { cu::cuEventQuery(t.start.raw()) } == cu::CUresult::CUDA_SUCCESS {
                t.started = Some(now);
            }
            launch_timed_out(t.started, now, self.timeout).then_some((t.kind, t.count, t.peer))
        });
        if let Some((kind, count, peer)) = late {
            if let Some(peer) = peer {
                let (what, dir) = if kind == Kind::Send { ("send", "to") } else { ("recv", "from") };
                return Some(Error::Timeout(format!(
                    "rank {}: a CUDA {what} of {count} bytes {dir} rank {peer} (NCCL) did not finish within the group \
                     timeout ({:.1} s) of starting on the GPU: rank {peer} did not post the matching {}, posted it \
                     with another size (NCCL cannot tell), or died; the group was aborted",
                    self.rank,
                    self.timeout.as_secs_f64(),
                    if kind == Kind::Send { "recv" } else { "send" },
                )));
            }
            return Some(Error::Timeout(format!(
                "rank {}: a CUDA {} of {} {} (NCCL) did not finish within the group timeout ({:.1} s) of starting on the GPU: \
                 a rank of the group did not call it, called it with other sizes (all_to_all splits \
                 that disagree between ranks hang NCCL), or died; the group was aborted",
                self.rank,
                kind.name(),
                count,
                count_unit(kind),
                self.timeout.as_secs_f64()
            )));
        }
        None
    }

    /// Return the events of finished launches to the free list.
    pub(super) fn recycle_finished(&self) {
        let mut done = Vec::new();
        {
            let mut p = self.pending.lock();
            while let Some(t) = p.front() {
                // SAFETY: a valid event of ours.
                if unsafe { cu::cuEventQuery(t.ev.raw()) } == cu::CUresult::CUDA_ERROR_NOT_READY {
                    break;
                }
                done.extend(p.pop_front());
            }
        }
        if !done.is_empty() {
            let mut o = self.order.lock();
            for t in done {
                o.give_back(t.start);
                o.give_back(t.ev);
            }
        }
    }

    /// Abort every communicator (their kernels end), exclusive with every use of their
    /// handles (`gate`): launches and error queries hold it shared, so none of them runs
    /// on a handle being freed, and once the abort nulled the handles, a launch that
    /// takes the gate next finds them dead (`live()`) and fails.
    ///
    /// Why the wait for the gate is short: a launch holds it only while it enqueues. NCCL
    /// calls on a blocking communicator queue their kernels and return without waiting
    /// for peers: collectives' connections, and the point-to-point ones of the send/recv
    /// groups (gather, scatter, all_to_all), were all made at creation by the warm-up, so
    /// no call connects (the one step that waits on peers) later; the hierarchical path's
    /// host-local launches queue rsccl kernels without waiting either. What could still
    /// block a launch without bound is the CUDA driver's launch queue, full behind a kernel
    /// that never ends, and only this abort ends such a kernel: so after ABORT_GRACE the
    /// abort goes ahead anyway (logged), the one case where a launch may still be inside
    /// an NCCL call on the handle being aborted.
    ///
    /// The communicators are aborted at once, each on its own thread: NCCL's abort of one
    /// may wait for GPU work that only the abort of another ends. On 4 H200s as 2 emulated
    /// hosts, with a rank killed, its cross-host peer never returned after the aborts when
    /// they ran one after the other (flat first); a kernel of the cross communicator, stuck
    /// on the dead peer, holding up the flat communicator's abort is the suspected cause.
    pub(super) fn abort_comms(&self) {
        let guard = self.gate.try_write_for(ABORT_GRACE);
        if guard.is_none() {
            tracing::warn!(
                rank = self.rank,
                "rsccl: a launch did not leave its NCCL call within {ABORT_GRACE:?}; aborting the communicators anyway"
            );
        }
        std::thread::scope(|s| {
            for (_, c) in self.comms() {
                s.spawn(move || c.abort());
            }
        });
        drop(guard);
    }
}

impl EventHome for Shared {
    fn recycle(&self, ev: Event) {
        self.order.lock().give_back(ev);
    }

    fn wait_timed_out(&self) -> Error {
        self.fail(Error::Timeout(format!(
            "rank {}: a CUDA collective (NCCL) did not finish within the group timeout ({:.1} s); the group was aborted",
            self.rank,
            self.timeout.as_secs_f64()
        )))
    }
}

fn with_context(e: Error, what: &str) -> Error {
    match e {
        Error::PeerFailure(m) => Error::PeerFailure(format!("{what}: {m} (a peer died or the network failed)")),
        Error::Aborted(m) => Error::Aborted(format!("{what}: {m}")),
        other => Error::Cuda(format!("{what}: {other}")),
    }
}

pub(super) fn watchdog(sh: Arc<Shared>) {
    let Ok(_ctx) = sh.dev.bind() else { return };
    let mut aborted = false;
    while !sh.stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(20));
        if !aborted {
            if sh.poisoned.lock().is_none() {
                if let Some(e) = sh.find_failure() {
                    let e = sh.fail(e);
                    tracing::error!(rank = sh.rank, "rsccl: {e}");
                }
            }
            if sh.abort_requested.load(Ordering::Acquire) {
                sh.abort_comms();
                aborted = true;
            }
        }
        sh.recycle_finished();
    }
}
