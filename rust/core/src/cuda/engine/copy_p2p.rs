//! send/recv on the copy engines (issue 28): a message of at least
//! cuda_copy_engine_min_bytes moves with cuMemcpyDtoDAsync through the pair's region of the
//! receiver's send/recv inbox, and the one-block kernel rs_p2p_signal orders the steps
//! (NOTE [Copy-engine send/recv] in csrc_kernels/send_recv.cu: the protocol, its ordering
//! argument, what a size mismatch and a failure do). Everything of a call is queued on the
//! (peer, direction) stream the kernels use (p2p.rs), so the ordering with the caller and
//! the Work is theirs (cuda/order.rs, `Launch::send_recv`).

use super::abi::P2pArgs;
use super::copy::copy;
use super::CudaEngine;
use crate::collective::Kind;
use crate::cuda::decide::copy_engine;
use crate::cuda::kernels::abi as kabi;
use crate::cuda::kernels::Kernel;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

impl CudaEngine {
    /// Whether a send or recv of `bytes` runs on the copy engines (`decide::copy_engine`
    /// with this group's setting; each side decides from its own size).
    pub(super) fn p2p_on_copy_engines(&self, kind: Kind, bytes: u64) -> bool {
        copy_engine(kind, bytes, self.pool.nranks, self.copy_engine_min)
    }

    /// Queue the send (`send`) or recv that `x` describes (as for rs_send / rs_recv: the
    /// peer's local index in `a.root`, the message's bytes in `a.count`) on the copy
    /// engines, all of it on `stream`, that (peer, direction)'s own (NOTE [Copy-engine
    /// send/recv]). The caller holds the ordering lock with the context bound.
    pub(super) fn queue_copy_p2p(&self, x: &P2pArgs, send: bool, stream: u64) -> Result<()> {
        let signal = self
            .kernels
            .get(Kernel::P2pSignal, DType::U8, ReduceOp::Sum)
            .ok_or_else(|| Error::Internal("no send/recv signal kernel".into()))?;
        let (me, peer) = (self.pool.me, x.a.root as usize);
        let (sender, receiver) = if send { (me, peer) } else { (peer, me) };
        let n = x.a.count;
        // The pair's region of the receiver's inbox (csrc_kernels' p2p_slot for every block
        // and inbox slot: P2P_DEPTH chunks per block), used as two halves.
        let half = self.chunk * self.p2p_blocks as u64 * kabi::P2P_DEPTH / 2;
        let slot = (sender - (sender > receiver) as usize) as u64;
        let region = self.base.peer[receiver] + self.inbox_off + slot * 2 * half;
        let steps = n.div_ceil(half);
        if half == 0 || steps == 0 || steps > u32::MAX as u64 {
            return Err(Error::Internal(format!("a copy-engine send/recv of {n} bytes in halves of {half}")));
        }
        // Step j's bytes of the message, and its half of the region. The half follows j
        // (the host does not know the counters on the GPU); within a message that
        // alternates as the step parity does, and DRAIN frees both halves before step 0.
        let step = |j: u64| (j * half, half.min(n - j * half), region + (j & 1) * half);
        let kind = if send { Kind::Send } else { Kind::Recv };
        let signal_at = |mode: u64, j: u64| -> Result<()> {
            let mut y = *x;
            y.a.desc0 = mode | ((self.p2p_blocks as u64) << kabi::P2P_CE_BLOCKS_SHIFT);
            y.a.desc1 = j | (steps << 32);
            let arg = &mut y as *mut P2pArgs as *mut std::ffi::c_void;
            // SAFETY: rs_p2p_signal takes one `P2pArgs` by value (a kernel of shape `Peer`,
            // the source's layout); `arg` points at `y` for the call; one block of THREADS
            // threads is within its launch bounds; `stream` is this engine's stream of the
            // (peer, direction), in the context the caller bound.
            unsafe { Self::launch_kernel(signal, 1, stream, arg, kind) }
        };
        if send {
            signal_at(kabi::P2P_CE_DRAIN, 0)?;
            for j in 0..steps {
                let (off, len, at) = step(j);
                copy(at, x.a.inp + off, len, stream)?;
                signal_at(kabi::P2P_CE_READY, j)?;
            }
        } else {
            for j in 0..steps {
                signal_at(kabi::P2P_CE_ARRIVED, j)?;
                let (off, len, at) = step(j);
                copy(x.a.out + off, at, len, stream)?;
            }
            signal_at(kabi::P2P_CE_FINISH, 0)?;
        }
        Ok(())
    }
}
