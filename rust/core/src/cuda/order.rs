//! The launch order of both CUDA engines, rsccl's (engine/) and NCCL's (nccl_engine/):
//! which stream a launch goes to, what it waits for there, how the caller's stream is
//! ordered after it, the pool of events that does this (`Order`), and the event an
//! asynchronous call hands to its Work (`CudaEvent`).
//!
//! The rules, the same for both engines:
//! - Target stream (`Launch::collective`): a blocking call runs on the caller's current
//!   stream when cuda_sync_stream is set; any other call on the engine's internal stream,
//!   which first waits for the work the caller queued so far (and so joins the caller's
//!   graph capture, if any). A send/recv runs on its (peer, direction)'s own stream, after
//!   the caller's queued work (`Launch::send_recv`).
//! - Collectives form one chain: each runs after the previous one (rsccl's kernels' per-block
//!   counters assume it, NOTE [Lockstep blocks] in csrc_kernels/protocol.cuh; NCCL runs a
//!   communicator's calls in order). A collective on another stream than the previous one's
//!   first waits on an event recorded there. Under graph capture only streams of the same
//!   capture can be joined, which the caller's stream tells; torch synchronizes the device
//!   before a capture begins. send/recv are not in the chain: only the caller's stream
//!   orders them against the collectives.
//! - After the launch: one on the caller's stream needs nothing more; otherwise an event
//!   recorded on the target goes to the Work (asynchronous), or the caller's stream waits on
//!   it now (blocking). No tensor is marked on a stream: the Work keeps its tensors until
//!   the consumer stream is ordered after the collective.
//!
//! A launch is `begin`, the engine's enqueue on `Launch::target`, then `end`, all under the
//! engine's lock on its `Order`. Shutdown sets the engine's stop flag under that lock, and
//! `begin` refuses once it is set, so no launch starts after shutdown began. What the
//! engines do differently stays with them, in the hook `end` runs after the launch:
//! rsccl's engine, while capturing, hands the graph what its kernels use (and records
//! nothing when not capturing: its health check records its own event on the chain's last
//! stream, only when it must wait, `CudaEngine::wait_collectives`); the NCCL engine records
//! the end event its watchdog tracks the launch by (the start event, recorded between
//! `begin` and the enqueue, is its own step).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;

use super::driver::{check, is_capturing, CUevent, CUstream, Device, Event};
use crate::error::{Error, Result};

/// CU_STREAM_PER_THREAD: one handle for a different stream on each thread, so never "the
/// same stream" as another launch's, and never a stream to name from another thread.
pub const PER_THREAD_STREAM: u64 = 2;

/// Where one launch runs and what it follows: made before the engine takes its lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// The caller's current stream (a raw handle; 0 is the legacy default stream, a stream
    /// like any other here).
    pub caller: u64,
    /// The stream the launch goes to.
    pub target: u64,
    /// The Work gets an event to wait on; otherwise the caller's stream waits now.
    pub asynchronous: bool,
    /// In the group's chain of collectives (after the previous one, before the next);
    /// false for a send/recv.
    chained: bool,
}

impl Launch {
    /// A collective (or barrier, or all_to_all): on the caller's stream when blocking and
    /// `sync_on_caller` (cuda_sync_stream), else on the engine's `internal` stream. A
    /// caller on the per-thread default stream also runs on the internal stream: the
    /// chain's last stream is named later, maybe from another thread (the next launch's
    /// join, the health check's wait), where that handle means another stream.
    pub fn collective(caller: u64, asynchronous: bool, sync_on_caller: bool, internal: u64) -> Launch {
        let target = if asynchronous || !sync_on_caller || caller == PER_THREAD_STREAM { internal } else { caller };
        Launch { caller, target, asynchronous, chained: true }
    }

    /// A send or recv on `stream`, its (peer, direction)'s own (never the caller's).
    pub fn send_recv(caller: u64, stream: u64, asynchronous: bool) -> Launch {
        Launch { caller, target: stream, asynchronous, chained: false }
    }

    /// In the group's chain of collectives (false: a send/recv).
    pub fn chained(&self) -> bool {
        self.chained
    }
}

/// The engine an event came from: where it goes back when dropped, and what a wait on it
/// that ran past the group timeout means for the group.
pub trait EventHome: Send + Sync {
    /// Take back `ev`, an event of this home's `Order` that a `CudaEvent` held; called once,
    /// when that `CudaEvent` drops.
    fn recycle(&self, ev: Event);
    /// A CPU wait for this engine's collective gave up after the group timeout: the error
    /// to raise (the engine may abort the group, as the NCCL engine does).
    fn wait_timed_out(&self) -> Error;
}

/// One engine's ordering state, held under its lock: the stream of the previous collective,
/// a pool of events, and what the Work's events need.
pub struct Order {
    /// The stream of the previous collective (None before the first).
    last_stream: Option<u64>,
    free: Vec<Event>,
    dev: Arc<Device>,
    /// Where a Work's event goes back (the engine), and the bound of a CPU wait on it (the
    /// group timeout).
    home: Weak<dyn EventHome>,
    timeout: Duration,
}

impl Order {
    /// `events`: the pool to start with (made at group creation rather than at the first
    /// launches; more are made when it runs dry). `home` is the engine that holds this order.
    pub fn new(dev: Arc<Device>, events: Vec<Event>, timeout: Duration, home: Weak<dyn EventHome>) -> Order {
        Order { last_stream: None, free: events, dev, home, timeout }
    }

    /// The stream of the previous collective (None before the first).
    pub fn last_stream(&self) -> Option<u64> {
        self.last_stream
    }

    /// An event from the pool, or a new one.
    pub fn event(&mut self) -> Result<Event> {
        self.free.pop().map(Ok).unwrap_or_else(|| Event::new(&self.dev))
    }

    /// Return `ev` to the pool (a pending record on it is harmless: the next record
    /// replaces it, and a wait captures the record it waits for when it is enqueued).
    pub fn give_back(&mut self, ev: Event) {
        self.free.push(ev);
    }

    /// An event from the pool recorded now on `stream`; it goes back to the pool if the
    /// record fails. `wait_then_free` (or `give_back`) returns it later.
    pub fn record(&mut self, stream: u64) -> Result<Event> {
        let ev = self.event()?;
        match record_on(&ev, stream, "cuEventRecord") {
            Ok(()) => Ok(ev),
            Err(e) => {
                self.free.push(ev);
                Err(e)
            }
        }
    }

    /// Make `stream` wait for `ev`'s record, then return `ev` to the pool (the wait captured
    /// the record, so the event can be reused at once).
    pub fn wait_then_free(&mut self, ev: Event, stream: u64) -> Result<()> {
        // SAFETY: a recorded event of this order's device, and a live stream of its context
        // (see `record_on`).
        let r = check(unsafe { cu::cuStreamWaitEvent(stream as CUstream, ev.raw(), 0) }, "cuStreamWaitEvent");
        self.free.push(ev);
        r
    }

    /// Make `to` wait for the work queued on `from` so far.
    pub fn join(&mut self, from: u64, to: u64) -> Result<()> {
        let ev = self.record(from)?;
        self.wait_then_free(ev, to)
    }

    /// Before the launch: refuse it once shutdown began (`stop`, set under this order's
    /// lock), then order `l.target` after the caller's queued work and, for a collective,
    /// after the previous collective.
    pub fn begin(&mut self, l: &Launch, stop: &AtomicBool) -> Result<()> {
        if stop.load(Ordering::Acquire) {
            return Err(Error::destroyed());
        }
        if l.target != l.caller {
            // The target waits for everything the caller queued before the call (and joins
            // the caller's graph capture, if any).
            self.join(l.caller, l.target)?;
        }
        // The previous collective ran on another stream: order this one after it. (Under
        // graph capture only streams of the same capture can be joined, which the caller's
        // stream tells; torch synchronizes the device before capture begins.)
        if let Some(last) = self.last_stream.filter(|_| l.chained) {
            if last != l.target && last != l.caller && is_capturing(last)? == is_capturing(l.caller)? {
                self.join(last, l.target)?;
            }
        }
        Ok(())
    }

    /// After the launch was enqueued on `l.target`: a collective becomes the chain's last;
    /// then the engine's own step (`mark`, under this lock); then the caller's ordering:
    /// nothing when the launch ran on the caller's stream, else the Work's event for an
    /// asynchronous call, or the caller's stream made to wait.
    pub fn end(&mut self, l: &Launch, mark: impl FnOnce(&mut Self) -> Result<()>) -> Result<Option<CudaEvent>> {
        if l.chained {
            self.last_stream = Some(l.target);
        }
        mark(self)?;
        if l.target == l.caller {
            return Ok(None);
        }
        let ev = self.record(l.target)?;
        if l.asynchronous {
            return Ok(Some(CudaEvent { ev: Some(ev), home: self.home.clone(), dev: self.dev.clone(), timeout: self.timeout }));
        }
        self.wait_then_free(ev, l.caller).map(|_| None)
    }
}

/// Record `ev` on `stream`.
fn record_on(ev: &Event, stream: u64, what: &str) -> Result<()> {
    // SAFETY: `ev` is a live event of its device; every stream an `Order` is handed is a
    // live stream of that device's context: the caller's current stream (torch never
    // destroys its streams while work may be queued on them) or one the engine owns.
    check(unsafe { cu::cuEventRecord(ev.raw(), stream as CUstream) }, what)
}

/// An event that marks the end of an asynchronous collective or send/recv (of either
/// engine); goes back to its engine's pool when dropped.
pub struct CudaEvent {
    /// Some until Drop hands it back (or destroys it).
    ev: Option<Event>,
    home: Weak<dyn EventHome>,
    dev: Arc<Device>,
    /// Bound of a CPU wait (the group timeout).
    timeout: Duration,
}

impl CudaEvent {
    fn raw(&self) -> CUevent {
        self.ev.as_ref().map_or(std::ptr::null_mut(), Event::raw)
    }

    /// Whether the collective has finished on the GPU.
    pub fn query(&self) -> Result<bool> {
        let _ctx = self.dev.bind()?;
        // SAFETY: valid event handle.
        let r = unsafe { cu::cuEventQuery(self.raw()) };
        match r {
            cu::CUresult::CUDA_SUCCESS => Ok(true),
            cu::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => check(e, "cuEventQuery").map(|_| false),
        }
    }

    /// Make `stream` wait for the collective (no CPU wait).
    pub fn wait_on(&self, stream: u64) -> Result<()> {
        let _ctx = self.dev.bind()?;
        // SAFETY: valid event; `stream` is a live stream of this context (the caller's).
        check(unsafe { cu::cuStreamWaitEvent(stream as CUstream, self.raw(), 0) }, "cuStreamWaitEvent")
    }

    /// Block the CPU until the collective finished, at most the group timeout (polling,
    /// not cuEventSynchronize, so a collective that never ends cannot hang the caller).
    pub fn synchronize(&self) -> Result<()> {
        let _ctx = self.dev.bind()?;
        let deadline = Instant::now() + self.timeout;
        let mut pause = Duration::from_micros(5);
        loop {
            // SAFETY: valid event handle.
            match unsafe { cu::cuEventQuery(self.raw()) } {
                cu::CUresult::CUDA_SUCCESS => return Ok(()),
                cu::CUresult::CUDA_ERROR_NOT_READY if Instant::now() < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_micros(500));
                }
                cu::CUresult::CUDA_ERROR_NOT_READY => {
                    return Err(match self.home.upgrade() {
                        Some(h) => h.wait_timed_out(),
                        None => Error::Timeout(format!(
                            "a CUDA collective did not finish within the group timeout ({:.1} s)",
                            self.timeout.as_secs_f64()
                        )),
                    })
                }
                e => return check(e, "cuEventQuery"),
            }
        }
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let Some(ev) = self.ev.take() else { return };
        // The engine is gone: the event is ours alone, and `ev`'s Drop destroys it.
        if let Some(e) = self.home.upgrade() {
            e.recycle(ev);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_stream_rule() {
        let (caller, internal) = (7, 9);
        // cuda_sync_stream = 1: a blocking call runs on the caller's stream, an
        // asynchronous one on the internal stream.
        assert_eq!(Launch::collective(caller, false, true, internal).target, caller);
        assert_eq!(Launch::collective(caller, true, true, internal).target, internal);
        // cuda_sync_stream = 0: always the internal stream.
        assert_eq!(Launch::collective(caller, false, false, internal).target, internal);
        assert_eq!(Launch::collective(caller, true, false, internal).target, internal);
        // The legacy default stream (0) is a caller's stream like any other; the per-thread
        // default stream is not (another thread's handle names another stream).
        assert_eq!(Launch::collective(0, false, true, internal).target, 0);
        assert_eq!(Launch::collective(PER_THREAD_STREAM, false, true, internal).target, internal);
        // send/recv: their own stream, outside the chain of collectives.
        let p = Launch::send_recv(caller, 11, false);
        assert_eq!((p.target, p.chained), (11, false));
        assert!(Launch::collective(caller, false, true, internal).chained);
    }
}
