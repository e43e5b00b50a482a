//! What memory_stats reports: the pool, the grids, and the kernels' own counters.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;

use super::status::HostWords;
use super::CudaEngine;
use crate::cuda::decide::{grid, SMALL_GRID_MAX_BYTES};
use crate::cuda::driver::{check, is_capturing};
use crate::cuda::kernels::{Kernel, CTR_OFF, FLAGS_BYTES, MAX_BLOCKS, STAGE_OFF, STATS_OFF};
use crate::error::{Error, Result};
use crate::memory::device_heap::Heap;

/// Counters reported by memory_stats.
#[derive(Debug, Default, Clone, Copy)]
pub struct CudaStats {
    pub device: i32,
    pub va_reserved_bytes: u64,
    pub mapped_own_bytes: u64,
    pub mapped_peer_bytes: u64,
    pub in_use_bytes: u64,
    pub kernel_image_bytes: u64,
    pub collectives: u64,
    pub pool_bytes: u64,
    pub pool_allocated_bytes: u64,
    pub pool_peak_bytes: u64,
    pub inplace_collectives: u64,
    pub inplace_bytes: u64,
    pub staged_collectives: u64,
    pub staged_bytes: u64,
    /// Blocks of each send/recv kernel: cuda_p2p_blocks, or fewer where the GPU could not
    /// hold them all at once (`p2p_blocks_that_fit`).
    pub p2p_blocks: u32,
    /// Blocks of each collective kernel: cuda_blocks, or fewer where ranks share a GPU.
    pub blocks: u32,
    /// Blocks of a collective kernel of at most `small_max_bytes` (`decide::grid`): at most
    /// `blocks`.
    pub small_blocks: u32,
    pub small_max_bytes: u64,
    /// cuda_low_latency_max_bytes: all_reduce, reduce_scatter (output) and all_gather
    /// (input) up to this size per rank run the low-latency kernels, on the small grid
    /// (0: never).
    pub low_latency_max_bytes: u64,
    /// cuda_copy_engine_min_bytes: all_gather, reduce_scatter, broadcast and send/recv from
    /// this size move on the copy engines (0: never), with one-CTA barrier or signal kernels
    /// (and reduce_scatter's local reduce kernel) (NOTE [Copy engines], NOTE [Copy-engine
    /// send/recv]).
    pub copy_engine_min_bytes: u64,
    /// cuda_ring_min_bytes: reduce_scatter (input) and all_reduce from this size run as a
    /// ring, rounding float16/bfloat16 partial sums at each hop (NOTE [Ring]; 0: never).
    pub ring_min_bytes: u64,
    /// Ranks of this group on this rank's GPU, itself included (1: a GPU of its own).
    pub gpu_sharers: u32,
    /// The device's SMs, which rsccl's kernels of every group of the process draw from
    /// (NOTE [SM budget] in cuda/budget.rs).
    pub sms: u32,
    /// The SMs this group's launches are held within, with every other group's kernels
    /// beside them: the device's, or this rank's share where ranks share the GPU.
    pub sm_budget: u32,
    /// SMs each launch of this group holds: a collective kernel, a send/recv kernel.
    pub collective_sms: u32,
    pub p2p_sms: u32,
    /// This group's launches that had to wait for another group's kernels to end first.
    pub sm_budget_waits: u64,
}

impl CudaEngine {
    /// The kernels' counters (STATS_OFF), counted on the GPU so that CUDA graph replays
    /// count too. Read with an asynchronous copy into the pinned page, on the internal
    /// stream ordered after the last launch (so after every kernel of the group), then
    /// polled: no device-wide synchronization, so other work and other threads' graph
    /// captures are left alone. While the internal stream or the last launch's stream is
    /// being captured the last values read are returned instead.
    pub(super) fn kernel_counts(&self) -> [u64; 4] {
        let read = || -> Result<[u64; 4]> {
            let _ctx = self.sh.dev.bind()?;
            let internal = self.internal.raw() as u64;
            // An error (the legacy stream during a global-mode capture) counts as capturing.
            let capturing = |s: u64| is_capturing(s).unwrap_or(true);
            let ev = {
                let mut o = self.order.lock();
                if capturing(internal) {
                    return Err(Error::Internal("capturing".into()));
                }
                if let Some(last) = o.last_stream().filter(|&l| l != internal) {
                    if capturing(last) {
                        return Err(Error::Internal("capturing".into()));
                    }
                    o.join(last, internal)?;
                }
                let dst = self.sh.words.counts_ptr();
                // SAFETY: copies 32 bytes of our own block (mapped for this device) into the
                // pinned page (32 free bytes at COUNTS), on our live stream.
                check(
                    unsafe {
                        cu::cuMemcpyDtoHAsync_v2(dst, self.pool.block_addr(self.pool.me) + STATS_OFF as u64, 32, self.internal.raw())
                    },
                    "cuMemcpyDtoHAsync (collective counters)",
                )?;
                o.record(internal)?
            };
            let deadline = Instant::now() + self.timeout + Duration::from_secs(1);
            let done = loop {
                // SAFETY: valid event.
                match unsafe { cu::cuEventQuery(ev.raw()) } {
                    cu::CUresult::CUDA_SUCCESS => break Ok(()),
                    cu::CUresult::CUDA_ERROR_NOT_READY if Instant::now() < deadline => std::thread::sleep(Duration::from_micros(20)),
                    cu::CUresult::CUDA_ERROR_NOT_READY => break Err(Error::Timeout("reading the collective counters".into())),
                    e => break check(e, "cuEventQuery"),
                }
            };
            self.order.lock().give_back(ev);
            done?;
            Ok(std::array::from_fn(|i| self.sh.words.read64(HostWords::COUNTS + i)))
        };
        let mut last = self.last_counts.lock();
        if let Ok(v) = read() {
            *last = v;
        }
        *last
    }

    pub fn stats(&self) -> CudaStats {
        let n = self.pool.nranks as u64;
        let block = self.pool.block as u64;
        let [inplace_n, inplace_b, total_n, total_b] = self.kernel_counts();
        let (pool_alloc, pool_peak) = self.heap.as_ref().map(|h| h.usage()).unwrap_or((0, 0));
        CudaStats {
            device: self.sh.dev.ordinal,
            va_reserved_bytes: self.pool.reserved_bytes() as u64,
            mapped_own_bytes: block,
            mapped_peer_bytes: block * (n - 1),
            in_use_bytes: (STAGE_OFF as u64) + 2 * self.blocks as u64 * self.base.stage_per_block + self.p2p_bytes as u64,
            kernel_image_bytes: self.kernels.cubin_bytes as u64,
            collectives: self.collectives.load(Ordering::Relaxed),
            pool_bytes: self.pool.pool_bytes as u64,
            pool_allocated_bytes: pool_alloc,
            pool_peak_bytes: pool_peak,
            inplace_collectives: inplace_n,
            inplace_bytes: inplace_b,
            staged_collectives: total_n.saturating_sub(inplace_n),
            staged_bytes: total_b.saturating_sub(inplace_b),
            p2p_blocks: self.p2p_blocks,
            blocks: self.blocks,
            small_blocks: grid(Kernel::Barrier, 0, self.blocks),
            low_latency_max_bytes: self.low_latency_max as u64,
            small_max_bytes: SMALL_GRID_MAX_BYTES,
            copy_engine_min_bytes: self.copy_engine_min,
            ring_min_bytes: self.ring_min,
            gpu_sharers: self.gpu_sharers,
            sms: self.sm.device_sms(),
            sm_budget: self.sm.limit,
            collective_sms: self.sm.collective_sms,
            p2p_sms: self.sm.p2p_sms,
            sm_budget_waits: self.sm.waits(),
        }
    }

    /// Bytes of the pool per rank (0: none), without reading the device.
    pub fn pool_bytes(&self) -> usize {
        self.pool.pool_bytes
    }

    /// The pool behind rsccl.mem_pool(), if the group has one.
    pub fn heap(&self) -> Option<&Arc<Heap>> {
        self.heap.as_ref()
    }

    /// For the GPU tests only (the epoch wrap, NOTE [Low latency epochs] in
    /// csrc_kernels/protocol.cuh): once every kernel of the device is done, set every CUDA
    /// block's barrier epoch to `epoch`, and every barrier flag of this rank's block to it,
    /// as if every block of every rank had just passed barrier `epoch`. Every rank of the
    /// group must call it between the same two collectives, with the same `epoch`, and
    /// none may launch again before all did (the caller's host barrier): a peer's signal
    /// that landed before this rank's flags were set would be lost. The epoch at which
    /// each block last rewrote its low-latency regions stays as it was: a test that jumps
    /// by 2^32 - x must pass an epoch 2^30 or more from it on its way, as real epochs do.
    pub fn set_epochs_for_test(&self, epoch: u32) -> Result<()> {
        let _ctx = self.sh.dev.bind()?;
        // SAFETY: no arguments; the context is current.
        check(unsafe { cu::cuCtxSynchronize() }, "cuCtxSynchronize (set_epochs_for_test)")?;
        let own = self.pool.block_addr(self.pool.me);
        let mut ctr = vec![0u32; 2 * MAX_BLOCKS as usize];
        let ctr_bytes = ctr.len() * 4;
        // SAFETY: `ctr` holds ctr_bytes bytes; the counters are ctr_bytes bytes of our own
        // block at CTR_OFF (abi.cuh), mapped in this context; synchronous copies.
        check(
            unsafe { cu::cuMemcpyDtoH_v2(ctr.as_mut_ptr() as *mut std::ffi::c_void, own + CTR_OFF as u64, ctr_bytes) },
            "cuMemcpyDtoH (counters)",
        )?;
        for b in 0..MAX_BLOCKS as usize {
            ctr[2 * b] = epoch;
        }
        // SAFETY: as above.
        check(
            unsafe { cu::cuMemcpyHtoD_v2(own + CTR_OFF as u64, ctr.as_ptr() as *const std::ffi::c_void, ctr_bytes) },
            "cuMemcpyHtoD (counters)",
        )?;
        let flags = vec![epoch; FLAGS_BYTES / 4];
        // SAFETY: the flags are the first FLAGS_BYTES bytes of our own block (abi.cuh),
        // mapped in this context; `flags` holds that many bytes.
        check(unsafe { cu::cuMemcpyHtoD_v2(own, flags.as_ptr() as *const std::ffi::c_void, FLAGS_BYTES) }, "cuMemcpyHtoD (flags)")?;
        // A copy from pageable memory may return before it landed: wait for it, so that a
        // peer's signal after the caller's host barrier is never overwritten.
        // SAFETY: no arguments; the context is current.
        check(unsafe { cu::cuCtxSynchronize() }, "cuCtxSynchronize (set_epochs_for_test)")
    }
}
