//! send/recv: one kernel per call, on the (peer, direction)'s own stream; from
//! cuda_copy_engine_min_bytes on, copies and signal kernels on that stream instead
//! (copy_p2p.rs).

use super::abi::P2pArgs;
use super::{CudaCall, CudaEngine};
use crate::collective::validate;
use crate::collective::Kind;
use crate::cuda::driver::is_capturing;
use crate::cuda::kernels::Kernel;
use crate::cuda::order::{CudaEvent, Launch};
use crate::error::{Error, Result};

impl CudaEngine {
    /// Launch one send or recv (`c`, on `kernel`: `c.count` bytes at `c.inp` or `c.out`
    /// with group rank `c.root`) on that (peer, direction)'s own stream, after the work
    /// queued on the caller's `c.stream`. Returns the end event of an asynchronous call; a
    /// blocking one makes the caller's stream wait.
    pub(super) fn launch_p2p(&self, c: &CudaCall, kernel: Kernel) -> Result<Option<CudaEvent>> {
        let (n, me) = (self.pool.nranks, self.pool.me);
        let send = c.kind == Kind::Send;
        // Peers are group ranks (the NCCL engine passes its group's, of this host); the
        // kernels know local indices.
        let peer = self.local_ranks.iter().position(|&r| r == c.root).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "rank {}: CUDA {} rank {}: not a rank of this host in this group",
                self.local_ranks[me],
                if send { "send to" } else { "recv from" },
                c.root
            ))
        })?;
        validate::peer(if send { "CUDA send" } else { "CUDA recv" }, me, peer as i64, n)?;
        self.refuse_if_stopped()?;
        let mut x = P2pArgs { a: self.base, inbox_off: self.inbox_off, chunk: self.chunk };
        if send {
            x.a.inp = c.inp;
        } else {
            x.a.out = c.out;
        }
        x.a.count = c.count;
        x.a.root = peer as u32;
        x.a.desc0 = c.kind.code();
        x.a.flags = self.sh.launch_flags();
        let func = self.kernels.get(kernel, c.dtype, c.op).ok_or_else(|| Error::Internal(format!("no {} kernel", c.kind.name())))?;
        let target = self.p2p_streams[2 * peer + (!send) as usize]
            .as_ref()
            .map(|s| s.raw() as u64)
            .ok_or_else(|| Error::Internal(format!("no send/recv stream for local rank {peer}")))?;
        let l = Launch::send_recv(c.stream, target, c.asynchronous);
        let on_copy_engines = self.p2p_on_copy_engines(c.kind, c.count);
        let ev = {
            let _ctx = self.sh.dev.bind()?;
            let mut o = self.order.lock();
            o.begin(&l, &self.sh.stop)?;
            // On the copy engines only the signal kernels hold an SM, one CTA at a time.
            let admitted = self.admit(&mut o, &l, if on_copy_engines { 1 } else { self.sm.p2p_sms })?;
            if on_copy_engines {
                // Queued in part, the message would leave copies and signals that the peer
                // never matches: the group stops (a CUDA error here means the context is
                // failing anyway), as a copy-engine collective does.
                if let Err(e) = self.queue_copy_p2p(&x, send, l.target) {
                    return Err(self.poison(e));
                }
            } else {
                let arg_ptr = &mut x as *mut P2pArgs as *mut std::ffi::c_void;
                // SAFETY: `func` takes one `P2pArgs` by value (a kernel of shape `Peer`,
                // checked in `launch`; same layout as the source's struct); `arg_ptr` points
                // at it for the call; 512 threads match the bounds; `l.target` is this
                // engine's stream of the (peer, direction), in the context bound above.
                unsafe { Self::launch_kernel(func, self.p2p_blocks, l.target, arg_ptr, c.kind) }?;
            }
            // Admitted: an eager launch (`admit` asked), so no second capture query.
            let capturing = match admitted {
                Some(a) => {
                    a.hold(&mut o)?;
                    false
                }
                None => is_capturing(l.target).unwrap_or(false),
            };
            // A capture of the send/recv (joined to the caller's captured stream): the graph
            // keeps what the kernel uses alive (graphs.rs).
            o.end(&l, |_| if capturing { self.keep_for_graph(l.target) } else { Ok(()) })?
        };
        // Only a fatal error stops a send/recv: a collectives' mismatch is reported by the
        // collective's own launch or Work, never by a send that is already queued (the
        // caller could retry it and send twice).
        if let Err(e) = self.fatal() {
            if let Some(ev) = &ev {
                let _ = ev.synchronize();
            }
            return Err(e);
        }
        Ok(ev)
    }
}
