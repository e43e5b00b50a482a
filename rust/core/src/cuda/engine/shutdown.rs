//! Shutdown: let queued work drain (or stop it), then release what the engine holds.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;

use super::status::HostWords;
use super::CudaEngine;
use crate::cuda::driver::{CUstream, Event};

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
        let mut pending = vec![self.internal.raw() as u64];
        pending.extend(self.p2p_streams.iter().flatten().map(|s| s.raw() as u64));
        pending.extend(self.copy_streams.iter().map(|s| s.raw() as u64));
        if let Some(last) = o.last_stream().filter(|&l| l != self.internal.raw() as u64) {
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
            let Ok(ev) = Event::new(&self.sh.dev) else { continue };
            // SAFETY: valid event and stream (streams outlive the group: torch never
            // destroys its pool streams; ours is destroyed in Drop).
            if unsafe { cu::cuEventRecord(ev.raw(), s as CUstream) } == cu::CUresult::CUDA_SUCCESS {
                // SAFETY: valid event.
                while unsafe { cu::cuEventQuery(ev.raw()) } == cu::CUresult::CUDA_ERROR_NOT_READY {
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
            // Dropping `ev` destroys it; a pending record on it is harmless.
        }
        if !drained {
            tracing::warn!("rsccl: GPU work did not finish at shutdown; leaving the group's CUDA memory mapped");
            self.undrained.store(true, Ordering::Release);
            return;
        }
        // A CUDA graph that still holds this group's kernels keeps their memory (graphs.rs);
        // a replay of it must not run them (NOTE [Kernel entry]): it stops at their entry.
        self.sh.mark_destroyed();
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        self.shutdown();
        if self.undrained.load(Ordering::Acquire) {
            // Pool and module are ManuallyDrop: leaked on purpose (see shutdown). The
            // streams and events are released by their own Drop: the driver lets a stream
            // or event with pending work go once that work is done.
            return;
        }
        // SAFETY: dropped exactly once, here; nothing runs on them (shutdown drained; the
        // copies into peers' poison words, the last users of the peer mappings, are
        // waited for first: 4-byte DMA writes, which end by themselves).
        unsafe {
            if let Ok(_ctx) = self.sh.dev.bind() {
                self.sh.poison_stream.synchronize();
            }
            std::mem::ManuallyDrop::drop(&mut self.kernels);
            std::mem::ManuallyDrop::drop(&mut self.pool);
        }
        // The mapping goes now, or when torch returns the pool's last segment.
        if let Some(h) = self.heap.take() {
            h.close();
        }
        let Ok(_ctx) = self.sh.dev.bind() else { return };
        // Every kernel of ours finished (shutdown waited); the streams and events are
        // destroyed after this by their own Drop (Stream, Event), the poison stream with
        // `Shared`.
        self.internal.synchronize();
        for st in self.p2p_streams.iter().flatten() {
            st.synchronize();
        }
    }
}
