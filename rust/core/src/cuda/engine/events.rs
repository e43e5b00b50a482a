//! Events: the pool the engine records into, the ordering between the streams it launches
//! on, and the event an asynchronous collective hands to its Work.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;

use super::CudaEngine;
use crate::cuda::driver::{check, CUevent, CUstream, Device, Event};
use crate::error::{Error, Result};

pub(super) struct Ordering_ {
    /// The stream of the previous launch (None before the first; 0 is the legacy default
    /// stream, a stream like any other here).
    pub(super) last_stream: Option<u64>,
    pub(super) free_events: Vec<Event>,
    /// Recorded right after every collective launch that is not being captured into a
    /// graph: complete once every collective queued so far has finished (each is ordered
    /// after the previous one), whatever else the streams hold after them. send/recv
    /// kernels, on their own streams, are not behind it. False before the first launch.
    pub(super) collectives_end: bool,
    /// The event `collectives_end` tells about.
    pub(super) end_event: Event,
}

/// The engine an event came from: where it goes back when dropped, and what a wait on it
/// that ran past the group timeout means for the group.
pub trait EventHome: Send + Sync {
    /// Take back `ev`: an event this home made on its device and handed to a `CudaEvent`,
    /// returned once, when that `CudaEvent` drops.
    fn recycle(&self, ev: CUevent);
    /// A CPU wait for this engine's collective gave up after the group timeout: the error
    /// to raise (the engine may abort the group, as the NCCL engine does).
    fn wait_timed_out(&self) -> Error;
}

/// An event that marks the end of an asynchronous collective (of rsccl's CUDA engine or
/// the NCCL engine); goes back to its engine's pool when dropped.
pub struct CudaEvent {
    /// Some until Drop hands it back (or destroys it).
    ev: Option<Event>,
    home: std::sync::Weak<dyn EventHome>,
    dev: Arc<Device>,
    /// Bound of a CPU wait (the group timeout).
    timeout: Duration,
}

impl CudaEvent {
    /// `ev`: an event the caller made on `dev` and hands over (the NCCL engine's; it comes
    /// back to `home` through `EventHome::recycle`, or is destroyed here if `home` is gone).
    pub(crate) fn new(ev: CUevent, home: std::sync::Weak<dyn EventHome>, dev: Arc<Device>, timeout: Duration) -> CudaEvent {
        // SAFETY: the contract of this crate-internal constructor: `ev` is a live event of
        // `dev`'s context that the caller no longer uses or destroys.
        let ev = unsafe { Event::from_raw(ev, dev.clone()) };
        CudaEvent::from_event(ev, home, dev, timeout)
    }

    pub(crate) fn from_event(ev: Event, home: std::sync::Weak<dyn EventHome>, dev: Arc<Device>, timeout: Duration) -> CudaEvent {
        CudaEvent { ev: Some(ev), home, dev, timeout }
    }

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
            e.recycle(ev.into_raw());
        }
    }
}

impl EventHome for CudaEngine {
    // The trait takes the raw handle because the NCCL engine's pool keeps raw handles too;
    // its contract (an event of this home, handed back once) is on `EventHome::recycle`.
    #[allow(clippy::not_unsafe_ptr_arg_deref)]
    fn recycle(&self, ev: CUevent) {
        // SAFETY: only this engine's CudaEvents name it as their home, and each hands back,
        // once, the event this engine made on its device (from its pool, `from_event`).
        let ev = unsafe { Event::from_raw(ev, self.sh.dev.clone()) };
        self.order.lock().free_events.push(ev);
    }

    fn wait_timed_out(&self) -> Error {
        // rsccl's kernels time out by themselves and say so (health); the CPU wait also
        // covers work of others queued before the collective, so this alone does not
        // make the group unusable.
        Error::Timeout(format!("a CUDA collective did not finish within the group timeout ({:.1} s)", self.timeout.as_secs_f64()))
    }
}

impl CudaEngine {
    /// Make `to` wait for the work queued on `from` so far.
    pub(super) fn join(&self, o: &mut Ordering_, from: u64, to: u64) -> Result<()> {
        let ev = o.free_events.pop().map(Ok).unwrap_or_else(|| Event::new(&self.sh.dev))?;
        // SAFETY: valid event and streams; reusing the event after the wait is enqueued is
        // allowed (the wait captured the record).
        let r = unsafe {
            check(cu::cuEventRecord(ev.raw(), from as CUstream), "cuEventRecord")
                .and_then(|_| check(cu::cuStreamWaitEvent(to as CUstream, ev.raw(), 0), "cuStreamWaitEvent"))
        };
        o.free_events.push(ev);
        r
    }
}
