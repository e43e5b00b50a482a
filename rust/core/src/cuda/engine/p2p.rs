//! send/recv: one kernel per call, on the (peer, direction)'s own stream.

use cudarc::driver::sys as cu;

use super::abi::P2pArgs;
use super::CudaEngine;
use crate::collective::validate;
use crate::collective::Kind;
use crate::cuda::driver::{check, is_capturing, CUstream};
use crate::cuda::kernels::{Kernel, THREADS};
use crate::cuda::order::{CudaEvent, Launch};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

impl CudaEngine {
    /// Launch one send (`send`) or recv of `bytes` at `ptr` with local rank `peer`, on that
    /// (peer, direction)'s own stream, after the work queued on the caller's `stream`.
    /// Returns the end event of an asynchronous call; a blocking one makes `stream` wait.
    pub fn launch_p2p(&self, send: bool, ptr: u64, bytes: u64, peer: usize, stream: u64, asynchronous: bool) -> Result<Option<CudaEvent>> {
        let (n, me) = (self.pool.nranks, self.pool.me);
        // Local ranks: the NCCL engine passes this host's share of its group.
        validate::peer(if send { "CUDA send" } else { "CUDA recv" }, me, peer as i64, n)?;
        self.fatal()?;
        let kind = if send { Kind::Send } else { Kind::Recv };
        let mut x = P2pArgs { a: self.base, inbox_off: self.inbox_off, chunk: self.chunk };
        if send {
            x.a.inp = ptr;
        } else {
            x.a.out = ptr;
        }
        x.a.count = bytes;
        x.a.root = peer as u32;
        x.a.desc0 = kind.code();
        x.a.flags = self.sh.launch_flags();
        let func = self
            .kernels
            .get(if send { Kernel::Send } else { Kernel::Recv }, DType::U8, ReduceOp::Sum)
            .ok_or_else(|| Error::Internal("no send/recv kernel".into()))?;
        let target = self.p2p_streams[2 * peer + (!send) as usize]
            .as_ref()
            .map(|s| s.raw() as u64)
            .ok_or_else(|| Error::Internal(format!("no send/recv stream for local rank {peer}")))?;
        let l = Launch::send_recv(stream, target, asynchronous);
        let ev = {
            let _ctx = self.sh.dev.bind()?;
            let mut o = self.order.lock();
            o.begin(&l, &self.sh.stop)?;
            let mut arg_ptr = &mut x as *mut P2pArgs as *mut std::ffi::c_void;
            // SAFETY: `func` takes one `P2pArgs` by value (same layout as the source's
            // struct); `arg_ptr` points at it for the call; 512 threads match the bounds.
            check(
                unsafe {
                    cu::cuLaunchKernel(
                        func.raw(),
                        self.p2p_blocks,
                        1,
                        1,
                        THREADS,
                        1,
                        1,
                        0,
                        l.target as CUstream,
                        &mut arg_ptr,
                        std::ptr::null_mut(),
                    )
                },
                &format!("launching rsccl's CUDA {}", kind.name()),
            )?;
            // A capture of the send/recv (joined to the caller's captured stream): the graph
            // keeps what the kernel uses alive (graphs.rs).
            o.end(&l, |_| if is_capturing(l.target).unwrap_or(false) { self.keep_for_graph(l.target) } else { Ok(()) })?
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
