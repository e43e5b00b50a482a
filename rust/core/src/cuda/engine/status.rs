//! The status page (host-mapped memory the kernels report errors into and the host writes
//! the abort word into), the group's failure state, and the reports read from it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use parking_lot::Mutex;

use super::abi::{ERR_A2A, ERR_ABORTED, ERR_MISMATCH, ERR_P2P_SIZE, ERR_PEER, ERR_TIMEOUT};
use super::CudaEngine;
use crate::cuda::call::describe;
use crate::cuda::driver::{check, is_capturing, Device, PinnedPage, Stream};
use crate::error::{Error, Result};

/// Pinned host memory the kernels write errors into and the host writes the abort word into.
///
/// Protocol and memory order (host side; the kernel side is in protocol.cuh, `fail` and
/// `report_mismatch`, and the all_to_all and recv checks):
/// - A report is data, then a flag. A kernel writes the data words (descriptors at u64
///   4..5 and 8.., all_to_all's pair and sizes at u64 4..7, send/recv's sizes at u64 48..49),
///   then `__threadfence_system()`, then the code word (ERR, or FATAL through `fail`). The
///   host reads the code word with an Acquire load (`read`) and the data only after seeing a
///   code: the kernel's system-scope fence before its store pairs with the host's acquire
///   (fence-to-acquire synchronization), so the data words are the ones written before that
///   code. x86 orders loads anyway; on an aarch64 host (Grace Hopper) a plain or volatile
///   load would not keep the later data loads behind it, the acquire (LDAR) does.
/// - The host's words (ABORT, and POISON_SRC, the value its copy engine sends to the peers'
///   poison words) carry no data: a kernel that sees ABORT stops, and the cause sits in the
///   engine's mutex. They are stored with Release (`write`) all the same, so whatever the
///   host wrote before is visible to a reader that sees them. POISON_SRC is read by a DMA
///   enqueued after the store; the driver's submission orders the host's earlier stores
///   before the copy starts.
/// - COUNTS is filled by a copy (cuMemcpyDtoHAsync) and read only after its event
///   completed (cuEventQuery), which makes the copy's bytes visible to the host.
/// - The host clears ERR after the collectives queued so far finished (health), so no
///   kernel of those is writing it; a clearing store racing a later kernel's report would
///   lose that report, which is why health waits first.
pub(super) struct HostWords {
    page: PinnedPage,
}

impl HostWords {
    /// A mismatch between ranks' calls (reported once, then cleared).
    pub(super) const ERR: usize = 0;
    /// A timeout or abort (never cleared: the group is unusable).
    pub(super) const FATAL: usize = 1;
    // u32 index 0: the error code; bytes 32..48: this rank's descriptor; bytes 64..320: peers'
    // descriptors (report_mismatch in the kernel source); the abort word lives apart.
    pub(super) const ABORT: usize = 512;
    /// u64 index of 4 words the collective counters are copied into (bytes 3072..3104).
    pub(super) const COUNTS: usize = 384;
    /// u32 index of 1 + this rank's local index, the value copied into peers' poison words
    /// (bytes 3200..3204).
    pub(super) const POISON_SRC: usize = 800;

    pub(super) fn new(dev: &Arc<Device>) -> Result<HostWords> {
        Ok(HostWords { page: PinnedPage::new(dev, 4096)? })
    }

    /// The page's address as the kernels see it.
    pub(super) fn dev(&self) -> u64 {
        self.page.dev_ptr()
    }

    /// A word the kernels write (Acquire: see the protocol above).
    pub(super) fn read(&self, i: usize) -> u32 {
        self.page.u32_at(i).load(Ordering::Acquire)
    }

    /// The i-th u64 of the page (the kernels store descriptors there; read after the
    /// code word that announced them, itself read with Acquire).
    pub(super) fn read64(&self, i: usize) -> u64 {
        self.page.u64_at(i).load(Ordering::Acquire)
    }

    /// Where the collective counters are copied (see COUNTS).
    pub(super) fn counts_ptr(&self) -> *mut std::ffi::c_void {
        self.page.host_ptr(Self::COUNTS * 8)
    }

    /// Where the value peers' poison words get lives (see POISON_SRC).
    pub(super) fn poison_src(&self) -> *const std::ffi::c_void {
        self.page.host_ptr(Self::POISON_SRC * 4)
    }

    /// A word the kernels (ABORT) or the copy engine (POISON_SRC) read, or the clearing of
    /// ERR (Release: see the protocol above).
    pub(super) fn write(&self, i: usize, v: u32) {
        self.page.u32_at(i).store(v, Ordering::Release)
    }
}

pub(super) struct Shared {
    pub(super) dev: Arc<Device>,
    pub(super) words: HostWords,
    /// The first error that made the group unusable (timeouts, aborts, dead peers).
    pub(super) poisoned: Mutex<Option<Error>>,
    pub(super) stop: AtomicBool,
    /// Every local peer's poison word (its block + POISON_OFF, as mapped here); not this
    /// rank's own.
    pub(super) peer_poison: Vec<u64>,
    /// A stream of our own for the copies into `peer_poison` (never blocked by a kernel).
    pub(super) poison_stream: Stream,
    /// Set once this rank has poisoned its peers.
    pub(super) peers_poisoned: AtomicBool,
}

impl Shared {
    /// Write a poison word value (1 + the local index of `culprit`, the rank whose failure
    /// stops the group: this rank, or a peer found dead) into every local peer's block, as
    /// a kernel's `fail()` does: the peers' kernels stop at their next poll
    /// instead of waiting for this rank until their own timeout. Once; never waits.
    ///
    /// Only after a failure or abort that starts on this host side (a dead peer, an NCCL
    /// engine failure, an internal error, a shutdown whose work did not drain): our
    /// kernels stop at the abort word mid-collective, so the peers' kernels of that
    /// collective can never complete and the group is over for them too. A clean
    /// destroy never poisons: peers may still be finishing their own part of the last
    /// collective (a rank leaves its final barrier before others read their flags) or
    /// exchanging send/recv among themselves, which do not involve this rank; poisoning
    /// would turn a clean teardown into errors on healthy peers. Kernel-reported errors
    /// do not come here either: a timeout or size mismatch poisoned the peers on the GPU
    /// already (fail() in the kernel source), and an abort or a peer's poison came from a
    /// host or peer that did.
    ///
    /// Ordering: the word carries no data. Each peer's kernels poll their own word with
    /// ld.volatile every 256 spins (stop_reason); our copy engine's 4-byte write lands in
    /// that memory over the peer mapping and becomes visible to those loads without any
    /// further ordering, and the peer reads the cause from its own fatal word (ERR_PEER
    /// naming this rank), which its kernel writes after seeing ours. The word is only ever
    /// set: a kernel's fail() racing with this store leaves the index of some failed rank,
    /// a correct report either way. The blocks belong to this group alone (a new group maps
    /// new ones), so nothing else ever sees this value.
    pub(super) fn poison_peers(&self, culprit: usize) {
        if self.peer_poison.is_empty() || self.peers_poisoned.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(_ctx) = self.dev.bind() else { return };
        // Once (the swap above), before the copies that read it.
        self.words.write(HostWords::POISON_SRC, 1 + culprit as u32);
        let src = self.words.poison_src();
        for &dst in &self.peer_poison {
            // SAFETY: `src` is 4 bytes of pinned host memory alive as long as `self`;
            // `dst` is a peer's poison word, mapped in this context until the engine's Drop,
            // which synchronizes `poison_stream` before unmapping; a copy (DMA), not a
            // kernel, so it runs even while spinning kernels hold every SM.
            let r = unsafe { cu::cuMemcpyHtoDAsync_v2(dst, src, 4, self.poison_stream.raw()) };
            if r != cu::CUresult::CUDA_SUCCESS {
                tracing::warn!("rsccl: could not poison a local peer's block after an abort ({r:?}); it stops at its own timeout");
            }
        }
    }
}

impl CudaEngine {
    /// Mark the group unusable with `err` (the first error wins) and stop this rank's
    /// queued kernels at their next wait.
    pub(super) fn poison(&self, err: Error) -> Error {
        let e = self.sh.poisoned.lock().get_or_insert(err).clone();
        self.sh.words.write(HostWords::ABORT, 1);
        e
    }

    /// `poison`, for a failure found on the host side: also stop the local peers' kernels
    /// (see Shared::poison_peers for when, and why not after a clean destroy).
    pub(super) fn abort_group(&self, err: Error) -> Error {
        let e = self.poison(err);
        if !self.sh.stop.load(Ordering::Acquire) {
            self.sh.poison_peers(self.pool.me);
        }
        e
    }

    /// The error that made the group unusable: an earlier one, or a timeout or abort a
    /// kernel reported.
    pub(super) fn fatal(&self) -> Result<()> {
        if let Some(e) = self.sh.poisoned.lock().clone() {
            return Err(e);
        }
        let code = self.sh.words.read(HostWords::FATAL);
        if code == 0 {
            return Ok(());
        }
        let (kind, peer) = (code >> 16, (code & 0xffff) as usize);
        let grank = self.local_ranks.get(peer).copied().unwrap_or(peer);
        let me = self.local_ranks[self.pool.me];
        let err = match kind {
            ERR_TIMEOUT => Error::Timeout(format!(
                "a CUDA collective or send/recv on rank {me} waited longer than the group timeout ({:.1} s) for rank {grank}",
                self.timeout.as_secs_f64()
            )),
            ERR_ABORTED => Error::Aborted("the group was aborted".into()),
            // A peer stopped the group; if its process is gone, say so as this rank's own
            // watchdog would have (it may not have polled yet: the peer's poison came first).
            ERR_PEER if self.mesh.gone().contains(&peer) => super::watchdog::gone_error(&self.local_ranks, &self.pids, peer),
            ERR_PEER => Error::Aborted(format!(
                "the group was stopped because of rank {grank}: it failed (a timeout, a send/recv size mismatch, an \
                 abort) or died; see rank {grank}'s error, or its exit"
            )),
            ERR_P2P_SIZE => Error::Mismatch(format!(
                "recv on rank {me}: rank {grank} sent {} bytes, rank {me} expected {} bytes; the group is unusable \
                 (send/recv sizes must match)",
                self.sh.words.read64(48),
                self.sh.words.read64(49)
            )),
            _ => return Err(self.abort_group(Error::Internal(format!("unknown CUDA kernel error code {code:#x}")))),
        };
        // The kernel that reported it poisoned the peers already where needed (fail()).
        Err(self.poison(err))
    }

    /// The error that made the group unusable, if any (a mismatch, which leaves the group
    /// usable, is not one; see `health`).
    pub fn check_fatal(&self) -> Result<()> {
        self.fatal()
    }

    /// Make the group unusable with `err` and stop this rank's queued kernels (the NCCL
    /// engine calls this when a communicator across hosts failed). Returns the first error.
    pub fn abort_with(&self, err: Error) -> Error {
        self.abort_group(err)
    }

    /// Raise the error that made the group unusable, or a mismatch the kernels reported.
    pub fn health(&self) -> Result<()> {
        self.fatal()?;
        let code = self.sh.words.read(HostWords::ERR);
        if code == 0 {
            return Ok(());
        }
        if code >> 16 != ERR_MISMATCH && code >> 16 != ERR_A2A {
            return Err(self.abort_group(Error::Internal(format!("unknown CUDA kernel error code {code:#x}"))));
        }
        let peer = (code & 0xffff) as usize;
        let grank = self.local_ranks.get(peer).copied().unwrap_or(peer);
        let me = self.local_ranks[self.pool.me];
        // Counters stayed in step: report once and keep the group usable. Every block of
        // the mismatched kernel may write the code: wait for the collectives queued so far
        // before clearing it, so it is reported once; a timeout or abort found meanwhile
        // is in its own word and wins. Only the collectives: send/recv kernels (which never
        // write this word) may wait up to the group timeout for their partner on their own
        // streams, and so may the caller's stream behind a blocking send; a device-wide
        // synchronization would wait for them too.
        self.wait_collectives()?;
        self.fatal()?;
        self.sh.words.write(HostWords::ERR, 0);
        if code >> 16 == ERR_A2A {
            // Every rank checked every pair and reports the same lowest bad pair (i, j).
            let w = |i: usize| self.sh.words.read64(i);
            let g = |l: u64| self.local_ranks.get(l as usize).copied().unwrap_or(l as usize);
            return Err(Error::Mismatch(format!(
                "all_to_all: rank {} sends {} bytes to rank {}, which expects {} bytes from it (split sizes must agree)",
                g(w(4)),
                w(6),
                g(w(5)),
                w(7)
            )));
        }
        let (mine, theirs) = self.descriptors(peer)?;
        Err(Error::Mismatch(format!("ranks called different CUDA collectives: rank {grank} called {theirs}, rank {me} called {mine}")))
    }

    /// Wait until every collective kernel launched so far has finished (the event recorded
    /// after the last launch; each launch is ordered after the previous one), at most the
    /// group timeout and a second: the kernels bound their own waits by the timeout, so a
    /// longer wait means something else is wrong, which `fatal` then reports, if the
    /// kernels did. Another thread's launch may re-record the event meanwhile: the wait
    /// then also covers that later collective, which is bounded the same way.
    pub(super) fn wait_collectives(&self) -> Result<()> {
        let _ctx = self.sh.dev.bind()?;
        let ev = {
            let o = self.order.lock();
            // The last launch is being captured (so the mismatch came from a kernel that ran
            // before the capture began, and torch synchronized the device then): nothing to
            // wait for, and querying an event is not allowed during a global-mode capture.
            if o.last_stream.is_some_and(|l| is_capturing(l).unwrap_or(true)) {
                return Ok(());
            }
            o.collectives_end.then(|| o.end_event.raw())
        };
        let Some(ev) = ev else { return Ok(()) };
        let deadline = Instant::now() + self.timeout + Duration::from_secs(1);
        let mut pause = Duration::from_micros(5);
        loop {
            // SAFETY: our own event, alive until Drop (which `&self` outlives).
            match unsafe { cu::cuEventQuery(ev) } {
                cu::CUresult::CUDA_SUCCESS => return Ok(()),
                cu::CUresult::CUDA_ERROR_NOT_READY if Instant::now() < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_micros(500));
                }
                cu::CUresult::CUDA_ERROR_NOT_READY => return Ok(()),
                e => return check(e, "cuEventQuery (end of collectives)"),
            }
        }
    }

    /// (this rank's, `peer`'s) descriptor of a mismatched call, as the kernel stored them
    /// next to the error word (see report_mismatch in the kernel source).
    pub(super) fn descriptors(&self, peer: usize) -> Result<(String, String)> {
        let w = |i: usize| self.sh.words.read64(i);
        Ok((describe(w(4), w(5)), describe(w(8 + 2 * peer), w(9 + 2 * peer))))
    }
}

#[cfg(test)]
mod tests {
    use crate::cuda::call::describe;
    use crate::cuda::decide::message_bytes;
    use crate::cuda::CudaKind;
    use crate::dtype::{DType, ReduceOp};

    #[test]
    fn descriptors_read_back_as_calls() {
        let d0 = CudaKind::AllReduce.code() | ((DType::BF16 as u64) << 8) | ((ReduceOp::Max as u64) << 16);
        assert_eq!(describe(d0, 1000), "all_reduce bfloat16[1000] MAX");
        assert_eq!(describe(CudaKind::Invalid.code(), 0), "an invalid call");
        let r = CudaKind::Reduce.code() | ((DType::F32 as u64) << 8) | ((ReduceOp::Sum as u64) << 16) | (2u64 << 32);
        assert_eq!(describe(r, 7), "reduce float32[7] SUM to local rank 2");
        assert_eq!(describe(CudaKind::Gather.code() | (1u64 << 32), 64), "gather of 64 bytes per rank to local rank 1");
        assert_eq!(message_bytes(CudaKind::Scatter, 64, 1, 4), 256);
    }
}
