//! The launch path of the NCCL engine: its place in the launch order (cuda/order.rs), the
//! watchdog's tracking events, and the flat NCCL calls (collectives, gather/scatter and
//! all_to_all as groups of sends and receives).

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use cudarc::nccl::sys as nc;

use super::choice::CrossHost;
use super::{NcclEngine, Shared, Tracked};
use crate::collective::Kind;
use crate::cuda::decide::{can_run, nccl_call, DeviceEngine, NcclCall};
use crate::cuda::driver::{is_capturing, Event};
use crate::cuda::nccl::{nccl_dtype, nccl_op};
use crate::cuda::order::{Launch, Order};
use crate::cuda::{CudaCall, CudaEvent};
use crate::error::{Error, Result};

impl NcclEngine {
    fn path(&self, c: &CudaCall) -> Result<CrossHost> {
        // Group::run asked the same (Engine::can_run) before translating the op; this
        // guards a call that reaches `Engine::run` any other way.
        can_run(DeviceEngine::Nccl, c.kind, c.dtype, c.op, self.sh.rank)?;
        Ok(self.hierarchical().map_or(CrossHost::Flat, |h| h.path(c)))
    }

    /// An error of a launch that may have left peers waiting makes the group unusable;
    /// one found before anything was enqueued (a bad argument) leaves it as it was.
    pub(super) fn failing_group(&self, r: Result<Option<CudaEvent>>) -> Result<Option<CudaEvent>> {
        match r {
            Ok(ev) => Ok(ev),
            Err(e) if e.keeps_group_usable() => Err(e),
            Err(e) => Err(self.sh.fail(e)),
        }
    }

    /// A collective or a call with chunks (send/recv: `launch_p2p`).
    pub(super) fn launch_inner(&self, c: &CudaCall) -> Result<Option<CudaEvent>> {
        let path = self.path(c)?;
        let sh = &self.sh;
        let _ctx = sh.dev.bind()?;
        let l = Launch::collective(c.stream, c.asynchronous, self.sync_on_caller, self.internal.raw() as u64);
        // Every communicator handle used below is read (`live()`, `raw()`) under this, so
        // no abort or close frees it meanwhile (Shared::abort_comms).
        let _gate = sh.gate.read();
        let mut o = sh.order.lock();
        o.begin(&l, &sh.stop)?;
        let start = sh.track_start(&mut o, l.target)?;
        let enqueued = match path {
            CrossHost::Flat => self.enqueue_flat(c, l.target),
            CrossHost::Hierarchical => {
                let r = match self.hierarchical() {
                    Some(h) => h.enqueue(c, l.target),
                    None => Err(Error::Internal("hierarchical path without its engines".into())),
                };
                if r.is_ok() {
                    self.hierarchical.fetch_add(1, Ordering::Relaxed);
                }
                r
            }
        };
        if let Err(e) = enqueued {
            // Recorded on the stream already: harmless to reuse (a later record replaces it).
            if let Some(start) = start {
                o.give_back(start);
            }
            return Err(e);
        }
        self.collectives.fetch_add(1, Ordering::Relaxed);
        // The watchdog names a call with chunks by the bytes this rank sends.
        let count = c.chunks.as_ref().map_or(c.count, |x| x.send_bytes.iter().sum());
        o.end(&l, |o| sh.track_end(o, start, l.target, (c.kind, count, None)))
    }

    /// One NCCL collective over every rank, on `stream`.
    fn enqueue_flat(&self, c: &CudaCall, stream: u64) -> Result<()> {
        let comm = &self.sh.flat;
        let raw = comm.live()?;
        let f = comm.fns();
        let s = stream as nc::cudaStream_t;
        let (inp, out, n) = (c.inp as *const c_void, c.out as *mut c_void, c.count as usize);
        let u8_ = nc::ncclDataType_t::ncclUint8;
        let dt = nccl_dtype(c.dtype).unwrap_or(u8_);
        let op = nccl_op(c.op).unwrap_or(nc::ncclRedOp_t::ncclSum);
        let root = c.root as i32;
        let what = format!("NCCL {} (flat)", c.kind.name());
        // SAFETY (every call below): `raw` is a live communicator (aborts wait for the
        // gate the caller holds shared, see Shared::abort_comms); the pointers are device
        // buffers of the sizes the Python layer checked (count as CudaCall documents:
        // elements for reductions, bytes for the rest); `s` is a live stream of the
        // communicator's device.
        let r = unsafe {
            match nccl_call(c.kind) {
                NcclCall::AllReduce => (f.all_reduce)(inp, out, n, dt, op, raw, s),
                NcclCall::ReduceScatter => (f.reduce_scatter)(inp, out, n, dt, op, raw, s),
                NcclCall::AllGather => (f.all_gather)(inp, out, n, u8_, raw, s),
                NcclCall::Broadcast => (f.broadcast)(inp, out, n, u8_, root, raw, s),
                NcclCall::Reduce => (f.reduce)(inp, out, n, dt, op, root, raw, s),
                NcclCall::Barrier => {
                    let p = self.scratch.ptr() as *mut c_void;
                    (f.all_reduce)(p, p, 1, nc::ncclDataType_t::ncclFloat32, nc::ncclRedOp_t::ncclSum, raw, s)
                }
                NcclCall::Rooted => return self.enqueue_rooted_p2p(c, stream),
                NcclCall::AllToAll => return self.enqueue_all_to_all(c, stream),
                NcclCall::P2p => {
                    return Err(Error::InvalidType(format!(
                        "CUDA {} in a group that spans hosts is not supported (NCCL engine)",
                        c.kind.name()
                    )))
                }
            }
        };
        comm.check(r, &what)
    }

    /// gather / scatter as one NCCL group of sends and receives (count = bytes per rank):
    /// the root receives from (sends to) every rank, itself included, every rank sends to
    /// (receives from) the root.
    fn enqueue_rooted_p2p(&self, c: &CudaCall, stream: u64) -> Result<()> {
        let comm = &self.sh.flat;
        let raw = comm.live()?;
        let f = comm.fns();
        let s = stream as nc::cudaStream_t;
        let n = c.count as usize;
        if n == 0 {
            return Ok(());
        }
        let u8_ = nc::ncclDataType_t::ncclUint8;
        let (me, root, size) = (comm.rank, c.root, comm.nranks);
        let gather = c.kind == Kind::Gather;
        // SAFETY (both blocks): as in enqueue_flat; the root's buffer holds `size` blocks
        // of `n` bytes (the Python layer allocated it so), block r at r * n.
        let r = f.group(|first| unsafe {
            if me == root {
                for peer in 0..size {
                    let at = (peer * n) as u64;
                    first.keep(if gather {
                        (f.recv)((c.out + at) as *mut c_void, n, u8_, peer as i32, raw, s)
                    } else {
                        (f.send)((c.inp + at) as *const c_void, n, u8_, peer as i32, raw, s)
                    });
                }
            }
            first.keep(if gather {
                (f.send)(c.inp as *const c_void, n, u8_, root as i32, raw, s)
            } else {
                (f.recv)(c.out as *mut c_void, n, u8_, root as i32, raw, s)
            });
        });
        comm.check(r, &format!("NCCL {} (send/recv)", c.kind.name()))
    }

    /// A call with chunks (all_to_all) as one NCCL group on the flat communicator: a send
    /// of every non-empty chunk to its peer and a receive of every non-empty chunk from its
    /// peer, this rank's own chunk included (NCCL matches a send to self with the receive
    /// from self in the same group, as torch's NCCL all_to_all does). Empty chunks are
    /// skipped on both sides, which agree when the splits do.
    fn enqueue_all_to_all(&self, c: &CudaCall, stream: u64) -> Result<()> {
        let x = c.chunks.as_ref().ok_or_else(|| Error::Internal(format!("{} without its chunks", c.kind.name())))?;
        let comm = &self.sh.flat;
        let raw = comm.live()?;
        let f = comm.fns();
        let s = stream as nc::cudaStream_t;
        let u8_ = nc::ncclDataType_t::ncclUint8;
        let r = f.group(|first| {
            for peer in 0..comm.nranks {
                let (sb, rb) = (x.send_bytes[peer] as usize, x.recv_bytes[peer] as usize);
                // SAFETY (both calls): as in enqueue_flat; every chunk is a device range of
                // the bytes given next to it, inside the tensors the Python layer checked
                // and keeps alive.
                if sb > 0 {
                    first.keep(unsafe { (f.send)(x.send[peer] as *const c_void, sb, u8_, peer as i32, raw, s) });
                }
                if rb > 0 {
                    // SAFETY: as above.
                    first.keep(unsafe { (f.recv)(x.recv[peer] as *mut c_void, rb, u8_, peer as i32, raw, s) });
                }
            }
        });
        comm.check(r, &format!("NCCL {} (send/recv)", c.kind.name()))
    }
}

impl Shared {
    /// Before a launch on `target`: the event the watchdog ages it from, recorded now (its
    /// start on the GPU, once the work queued ahead of it is done). None while `target` is
    /// being captured into a graph: the launch runs when the graph is replayed, and a
    /// captured record cannot be queried.
    pub(super) fn track_start(&self, o: &mut Order, target: u64) -> Result<Option<Event>> {
        if is_capturing(target)? {
            return Ok(None);
        }
        o.record(target).map(Some)
    }

    /// After the launch on `target` (`start` from `track_start`): its end event, and the
    /// launch, `(kind, count, peer)`, handed to the watchdog.
    pub(super) fn track_end(&self, o: &mut Order, start: Option<Event>, target: u64, what: (Kind, u64, Option<usize>)) -> Result<()> {
        let Some(start) = start else { return Ok(()) };
        let ev = match o.record(target) {
            Ok(ev) => ev,
            Err(e) => {
                o.give_back(start);
                return Err(e);
            }
        };
        let (kind, count, peer) = what;
        self.pending.lock().push_back(Tracked { start, ev, started: None, kind, count, peer });
        Ok(())
    }
}
