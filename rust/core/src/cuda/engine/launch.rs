//! The engine's one launch entry (`launch`, every kind), and the launch of a collective or
//! a call with chunks: the kernel, its arguments, and its place in the launch order
//! (cuda/order.rs) with this engine's marks; where the Work's events come home. (send/recv:
//! p2p.rs.)

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use cudarc::driver::sys as cu;

use super::abi::{A2aArgs, Args};
use super::{CudaCall, CudaEngine};
use crate::collective::Kind;
use crate::cuda::budget::{sms_of, Admission};
use crate::cuda::decide::{grid, kernel, message_bytes, placement, ring};
use crate::cuda::driver::{check, is_capturing, CUstream, Event, Function};
use crate::cuda::kernels::{Kernel, Shape, DESC0_DTYPE_SHIFT, DESC0_OP_SHIFT, DESC0_RING_BIT, DESC0_ROOT_SHIFT, MAX_RANKS, THREADS};
use crate::cuda::order::{CudaEvent, EventHome, Launch, Order};
use crate::error::{Error, Result};

impl CudaEngine {
    /// Launch one call of any kind, by the shape of the kernel that runs it
    /// (`decide::kernel`): send/recv on their (peer, direction)'s stream (`launch_p2p`),
    /// the rest on the collective grid. Returns the end event for an asynchronous call (the
    /// Work waits on it); a blocking call is ordered before the caller's later work already.
    pub fn launch(&self, c: &CudaCall) -> Result<Option<CudaEvent>> {
        let kernel = kernel(c.kind, c.count, c.dtype.size(), self.pool.nranks, self.one_shot_max, self.low_latency_max);
        if kernel.shape() != c.shape() {
            return Err(Error::Internal(format!(
                "a {} call of shape {:?} for a kernel of shape {:?}",
                c.kind.name(),
                c.shape(),
                kernel.shape()
            )));
        }
        if kernel.shape() == Shape::Peer {
            return self.launch_p2p(c, kernel);
        }
        let n = self.pool.nranks;
        if c.chunks.as_ref().is_some_and(|x| !x.one_per_rank(n)) {
            return Err(Error::InvalidArgument(format!("{} needs one chunk per rank of the group ({n})", c.kind.name())));
        }
        // A group that failed (timeout, dead peer) runs nothing more. A mismatch that a
        // kernel reported is raised after this launch: ranks notice it at different calls
        // (the GPU reports it asynchronously), so every rank must still launch the same
        // kernels for the group to stay in step.
        self.refuse_if_stopped()?;
        let ev = self.launch_inner(c, kernel)?;
        self.checked(ev)
    }
    /// After a launch: raise an error a kernel reported, once the launched work is done
    /// with the caller's tensors.
    pub(super) fn checked(&self, ev: Option<CudaEvent>) -> Result<Option<CudaEvent>> {
        if let Err(e) = self.health() {
            // The caller drops its tensors when this raises: the kernel must be done
            // with them first (an error stops it at its next wait, so this is short).
            if let Some(ev) = &ev {
                let _ = ev.synchronize();
            }
            return Err(e);
        }
        Ok(ev)
    }

    /// A collective or a call with chunks on `kernel` (its shape is the call's: `launch`).
    pub(super) fn launch_inner(&self, c: &CudaCall, kernel: Kernel) -> Result<Option<CudaEvent>> {
        if self.on_copy_engines(c) {
            return self.launch_copy(c);
        }
        let func = self.kernels.get(kernel, c.dtype, c.op).ok_or_else(|| {
            Error::InvalidType(format!("rsccl's CUDA {} does not support {} with {}", c.kind.name(), c.dtype.name(), c.op.name()))
        })?;
        let mut a = self.base;
        a.inp = c.inp;
        a.out = c.out;
        a.count = c.count;
        a.root = c.root as u32;
        a.flags = self.sh.launch_flags();
        // What the peers compare (NOTE [Agreement] in csrc_kernels/protocol.cuh).
        (a.desc0, a.desc1) = if kernel.describes_size() {
            let desc0 = c.kind.code()
                | ((c.dtype as u64) << DESC0_DTYPE_SHIFT)
                | ((c.op as u64) << DESC0_OP_SHIFT)
                | ((c.root as u64) << DESC0_ROOT_SHIFT);
            (desc0, c.count)
        } else {
            (c.kind.code(), 0)
        };
        // A call with chunks: its kernel takes them after `Args` (`A2aArgs`).
        let mut tail = c.chunks.as_ref().map(|x| {
            let mut t = A2aArgs { a, send: [0; MAX_RANKS], send_n: [0; MAX_RANKS], recv: [0; MAX_RANKS], recv_n: [0; MAX_RANKS] };
            t.send[..x.send.len()].copy_from_slice(&x.send);
            t.send_n[..x.send_bytes.len()].copy_from_slice(&x.send_bytes);
            t.recv[..x.recv.len()].copy_from_slice(&x.recv);
            t.recv_n[..x.recv_bytes.len()].copy_from_slice(&x.recv_bytes);
            t
        });
        if let Some(heap) = &self.heap {
            let own = self.pool.block_addr(self.pool.me);
            let in_pool = |ptr: u64, len: u64| heap.contains(ptr, len).then(|| ptr - own);
            (a.place_in, a.place_out) = placement(c, kernel, self.pool.nranks, self.inplace_min, &in_pool);
        }
        // Small calls on a small grid (`decide::grid`); the kernels put it in the descriptor
        // they compare (NOTE [Grids] in csrc_kernels/protocol.cuh).
        let msg = message_bytes(c.kind, c.count, c.dtype.size(), self.pool.nranks);
        if ring(kernel, msg, self.pool.nranks, self.ring_min) {
            a.desc0 |= 1u64 << DESC0_RING_BIT;
        }
        let blocks = grid(kernel, msg, self.blocks);
        let _ctx = self.sh.dev.bind()?;
        let mut o = self.order.lock();
        let (l, admitted) = self.begin(&mut o, c, sms_of(blocks, self.sm.collective_per_sm))?;
        let arg_ptr = match tail.as_mut() {
            Some(t) => t as *mut A2aArgs as *mut c_void,
            None => &mut a as *mut Args as *mut c_void,
        };
        // SAFETY: `func` takes one `Args` by value, or one `A2aArgs` where the call has
        // chunks (its kernel's shape is the call's, checked in `launch`), same layout as the
        // source's struct; `arg_ptr` points at it for the call; the grid matches every
        // kernel's launch bounds (at most the group's grid); `l.target` is the caller's
        // stream or the internal one, in the context bound above.
        unsafe { Self::launch_kernel(func, blocks, l.target, arg_ptr, c.kind) }?;
        self.end(&mut o, &l, admitted)
    }

    /// Launch `func` on `target` with `blocks` blocks of THREADS threads, its argument
    /// block at `args` (a `kind` call, as the error names it).
    ///
    /// # Safety
    /// `func` takes one argument block by value with the layout of the one `args` points
    /// at, which stays alive for the call; `blocks` and THREADS are within the kernel's
    /// launch bounds; `target` is a live stream of the kernel's context, made current.
    pub(super) unsafe fn launch_kernel(func: Function, blocks: u32, target: u64, mut args: *mut c_void, kind: Kind) -> Result<()> {
        // SAFETY: the caller's contract (above); the driver copies the argument block at
        // the call, from the one-entry parameter array `&mut args` (alive for the call).
        let r =
            unsafe { cu::cuLaunchKernel(func.raw(), blocks, 1, 1, THREADS, 1, 1, 0, target as CUstream, &mut args, std::ptr::null_mut()) };
        check(r, &format!("launching rsccl's CUDA {}", kind.name()))
    }

    /// Before a launch, under the ordering lock: the stream it goes to (the caller's, or
    /// the internal one after it), ordered after the caller's queued work and after the
    /// group's previous launch, and after what must end first for its `sms` SMs to fit
    /// beside the other groups' kernels (`admit`).
    pub(super) fn begin(&self, o: &mut Order, c: &CudaCall, sms: u32) -> Result<(Launch, Option<Admission<'_>>)> {
        let l = Launch::collective(c.stream, c.asynchronous, self.sync_on_caller, self.internal.raw() as u64);
        o.begin(&l, &self.sh.stop)?;
        let admitted = self.admit(o, &l, sms)?;
        Ok((l, admitted))
    }

    /// An eager launch of `sms` SMs on `l.target`, after `Order::begin`: admitted to the
    /// device's ledger of SMs (NOTE [SM budget] in cuda/budget.rs). Not while capturing: a
    /// captured kernel runs only at replay, ordered by the user's streams, and an eager
    /// event cannot be waited on inside a capture. An error (the legacy stream during a
    /// global-mode capture) counts as capturing, as in `end`. The legacy default stream
    /// (handle 0, torch's default stream) is never captured itself, so a launch there
    /// skips the query (issue 27: an eager call's only driver calls are then the launch and
    /// the context check); a launch there during another thread's capture behaves as
    /// before, with or without the query (legal beside torch's non-blocking capture
    /// streams; an error beside a blocking one, now raised by the ledger or the launch).
    pub(super) fn admit(&self, o: &mut Order, l: &Launch, sms: u32) -> Result<Option<Admission<'_>>> {
        if l.target != 0 && is_capturing(l.target).unwrap_or(true) {
            return Ok(None);
        }
        self.sm.admit(o, l, sms).map(Some)
    }

    /// After the launch (or the copies and barriers of a copy-engine collective) on
    /// `l.target`: its end in the device's ledger (`admitted`), what a graph keeps, then
    /// the caller's ordering (`Order::end`). Nothing is recorded for the health check: it
    /// records its own event when it must wait (`wait_collectives`), so an eager blocking
    /// call costs one driver launch, and a capture query off the legacy stream (issue 27).
    pub(super) fn end(&self, o: &mut Order, l: &Launch, admitted: Option<Admission<'_>>) -> Result<Option<CudaEvent>> {
        // Admitted: an eager launch (`admit` asked), so no second capture query.
        let capturing = match admitted {
            Some(a) => {
                a.hold(o)?;
                Ok(false)
            }
            None => is_capturing(l.target),
        };
        self.collectives.fetch_add(1, Ordering::Relaxed);
        o.end(l, |_| {
            // The graph keeps what the kernel uses alive (graphs.rs). An error here (the
            // legacy stream during a global-mode capture) counts as capturing.
            match capturing {
                Ok(true) => self.keep_for_graph(l.target),
                Ok(false) | Err(_) => Ok(()),
            }
        })
    }
}

impl EventHome for CudaEngine {
    fn recycle(&self, ev: Event) {
        self.order.lock().give_back(ev);
    }

    fn wait_timed_out(&self) -> Error {
        // rsccl's kernels time out by themselves and say so (health); the CPU wait also
        // covers work of others queued before the collective, so this alone does not
        // make the group unusable.
        Error::Timeout(format!("a CUDA collective did not finish within the group timeout ({:.1} s)", self.timeout.as_secs_f64()))
    }
}
