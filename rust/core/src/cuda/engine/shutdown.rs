//! Shutdown: let queued work drain (or stop it), then release what the engine holds.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;

use super::events::new_event;
use super::status::HostWords;
use super::CudaEngine;
use crate::cuda::driver::CUstream;

impl CudaEngine {
    /// Let queued kernels finish (up to the group timeout), then stop them and the
    /// watchdog. Idempotent; resources are freed when the last reference drops.
    pub fn shutdown(&self) {
        {
            let _o = self.order.lock();
            if self.sh.stop.swap(true, Ordering::AcqRel) {
                return;
            }
        }
        if let Some(h) = self.watchdog.lock().take() {
            let _ = h.join();
        }
        let Ok(_ctx) = self.sh.dev.bind() else { return };
        let o = self.order.lock();
        let mut pending = vec![self.internal as u64];
        pending.extend(self.p2p_streams.iter().filter(|s| !s.is_null()).map(|&s| s as u64));
        if let Some(last) = o.last_stream.filter(|&l| l != self.internal as u64) {
            pending.push(last);
        }
        // Queued kernels get the group timeout to finish, then the abort word stops their
        // waits. Work of others queued on the caller's stream may still never finish
        // (a hung kernel of another library): after a further grace period the memory
        // is left mapped (leaked) rather than freed under a kernel that may still use it.
        let deadline = Instant::now() + self.timeout;
        let give_up = deadline + Duration::from_secs(10);
        let mut drained = true;
        for s in pending {
            let Ok(ev) = new_event() else { continue };
            // SAFETY: valid event and stream (streams outlive the group: torch never
            // destroys its pool streams; ours is destroyed in Drop).
            if unsafe { cu::cuEventRecord(ev, s as CUstream) } == cu::CUresult::CUDA_SUCCESS {
                // SAFETY: valid event.
                while unsafe { cu::cuEventQuery(ev) } == cu::CUresult::CUDA_ERROR_NOT_READY {
                    let now = Instant::now();
                    if now > deadline {
                        self.sh.words.write(HostWords::ABORT, 1);
                        // Our work did not drain: a real failure (not a clean destroy), and
                        // the collective our stopped kernels leave unfinished can never
                        // complete on the peers either (Shared::poison_peers).
                        self.sh.poison_peers(self.pool.me);
                    }
                    if now > give_up {
                        drained = false;
                        break;
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
            // SAFETY: the event is ours; a pending record on it is harmless.
            unsafe { cu::cuEventDestroy_v2(ev) };
        }
        if !drained {
            tracing::warn!("rsccl: GPU work did not finish at shutdown; leaving the group's CUDA memory mapped");
            self.undrained.store(true, Ordering::Release);
        }
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        self.shutdown();
        if self.undrained.load(Ordering::Acquire) {
            return; // pool and module are ManuallyDrop: leaked on purpose (see shutdown)
        }
        // SAFETY: dropped exactly once, here; nothing runs on them (shutdown drained; the
        // copies into peers' poison words, the last users of the peer mappings, are
        // waited for first: 4-byte DMA writes, which end by themselves).
        unsafe {
            if let Ok(_ctx) = self.sh.dev.bind() {
                cu::cuStreamSynchronize(self.sh.poison_stream);
                cu::cuStreamDestroy_v2(self.sh.poison_stream);
            }
            std::mem::ManuallyDrop::drop(&mut self.kernels);
            std::mem::ManuallyDrop::drop(&mut self.pool);
        }
        // The mapping goes now, or when torch returns the pool's last segment.
        if let Some(h) = self.heap.take() {
            h.close();
        }
        let Ok(_ctx) = self.sh.dev.bind() else { return };
        // SAFETY: every kernel of ours finished (shutdown waited); the stream and events
        // are ours. The pool and module are released after this, by their own Drop.
        unsafe {
            cu::cuStreamSynchronize(self.internal);
            let o = self.order.get_mut();
            for ev in o.free_events.drain(..) {
                cu::cuEventDestroy_v2(ev);
            }
            cu::cuEventDestroy_v2(o.end_event);
            cu::cuStreamDestroy_v2(self.internal);
            for &st in self.p2p_streams.iter().filter(|s| !s.is_null()) {
                cu::cuStreamSynchronize(st);
                cu::cuStreamDestroy_v2(st);
            }
        }
    }
}
