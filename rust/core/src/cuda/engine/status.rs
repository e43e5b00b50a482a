//! The status page (host-mapped memory the kernels report errors into and the host writes
//! the abort word into), the group's failure state, and the reports read from it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use parking_lot::Mutex;

use super::abi::{
    ERR_A2A, ERR_ABORTED, ERR_CONCURRENT, ERR_MISMATCH, ERR_P2P_SIZE, ERR_PEER, ERR_TIMEOUT, FLAG_HOLD_ON_ERROR, FLAG_LL_GRID_SHIFT,
};
use super::CudaEngine;
use crate::bootstrap::LocalMesh;
use crate::collective::Kind;
use crate::cuda::decide::call_in_words;
use crate::cuda::driver::{check, is_capturing, Device, PinnedPage, Stream};
use crate::cuda::kernels::{DESC0_COPY_ENGINE_BIT, DESC0_DTYPE_SHIFT, DESC0_OP_SHIFT, DESC0_ROOT_SHIFT, POISON_DESTROYED};
use crate::dtype::{DType, ReduceOp};
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
/// - The host's words (ABORT, and POISON_SRC / OWN_POISON_SRC, the values its copy engine
///   sends to the peers' and its own poison words) carry no data: a kernel that sees ABORT stops, and the cause sits in the
///   engine's mutex. They are stored with Release (`write`) all the same, so whatever the
///   host wrote before is visible to a reader that sees them. POISON_SRC is read by a DMA
///   enqueued after the store; the driver's submission orders the host's earlier stores
///   before the copy starts.
/// - COUNTS is filled by a copy (cuMemcpyDtoHAsync) and read only after its event
///   completed (cuEventQuery), which makes the copy's bytes visible to the host.
///   OWN_POISON_READ likewise, read after its stream reported the copy complete
///   (`Shared::cause_in_own_word`).
/// - The host clears ERR after the collectives queued so far finished (health), so no
///   kernel of those is writing it; a clearing store racing a later kernel's report would
///   lose that report, which is why health waits first.
pub(super) struct HostWords {
    page: PinnedPage,
}

/// How long the watchdog waits for the copy of this rank's own poison word when it finds a
/// peer gone (`Shared::cause_in_own_word`); past it, the exit is named.
const OWN_WORD_WAIT: Duration = Duration::from_millis(500);

/// The fields of a FATAL code (abi.cuh, at the error codes): (kind, peer, cause, named).
/// Bits 16-19 are the kind and the low 16 the peer; for ERR_PEER, bits 20-23 are the
/// culprit's cause (an ERR_* code; 0 when a host poisoned with no cause, a mismatch's kind
/// when the host of the rank that found it did, `cause_poison`) and bits 24-31 are 1 + the
/// rank that cause names (0: none), as fail() in csrc_kernels/protocol.cuh packs them.
pub(super) fn fatal_fields(code: u32) -> (u32, usize, u32, usize) {
    ((code >> 16) & 0xf, (code & 0xffff) as usize, (code >> 20) & 0xf, (code >> 24) as usize)
}

/// The poison value that tells the peers of local rank `me` why it stops the group, for a
/// mismatch its kernel reported (ERR word `code`: the kind in bits 16-19, the rank it names
/// in the low bits): 1 + `me`, the kind as the cause, 1 + that rank, as fail() in
/// csrc_kernels/protocol.cuh packs a timeout's (`Shared::mismatch_failed`).
pub(super) fn cause_poison(me: usize, code: u32) -> u32 {
    (1 + me as u32) | (((code >> 16) & 0xf) << 16) | ((1 + (code & 0xff)) << 24)
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
    /// u32 index of the value copied into peers' poison words: 1 + the culprit's local
    /// index, and a mismatch's cause above it (`cause_poison`; bytes 3200..3204).
    pub(super) const POISON_SRC: usize = 800;
    /// u32 index of the value copied into this rank's own poison word (1 + the culprit's
    /// local index, or POISON_DESTROYED at a clean destroy; bytes 3204..3208).
    pub(super) const OWN_POISON_SRC: usize = 801;
    /// u32 index of POISON_DESTROYED, copied into this rank's own poison word when the group
    /// is destroyed (bytes 3208..3212).
    pub(super) const DESTROYED_SRC: usize = 802;
    /// u32 index this rank's own poison word is copied into when the watchdog finds a peer
    /// gone (bytes 3212..3216; `Shared::cause_in_own_word`).
    pub(super) const OWN_POISON_READ: usize = 803;

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

    /// Where host word `i` lives, for a copy into it (OWN_POISON_READ).
    pub(super) fn dst(&self, i: usize) -> *mut std::ffi::c_void {
        self.page.host_ptr(i * 4)
    }

    /// Where the value of host word `i` lives (POISON_SRC, OWN_POISON_SRC: read by copies).
    pub(super) fn src(&self, i: usize) -> *const std::ffi::c_void {
        self.page.host_ptr(i * 4)
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
    /// This rank's own poison word (NOTE [Kernel entry] in csrc_kernels/protocol.cuh).
    pub(super) own_poison: u64,
    /// A stream of our own for the copies into the poison words (never blocked by a kernel).
    pub(super) poison_stream: Stream,
    /// Set once this rank has poisoned its peers.
    pub(super) peers_poisoned: AtomicBool,
    /// Set once this rank has poisoned its own word.
    pub(super) own_poisoned: AtomicBool,
    /// Who is who, for the errors: the group ranks of the local ranks, their pids (read
    /// at creation), their connections, this rank's local index, and the group timeout.
    pub(super) local_ranks: Vec<usize>,
    pub(super) pids: Vec<Option<u32>>,
    pub(super) mesh: Arc<LocalMesh>,
    pub(super) me: usize,
    pub(super) timeout: Duration,
    /// cuda_error_teardown: a failure that a kernel of this rank reports ends the process
    /// (`tear_down`), once the group is made (`armed`: a failure while it is created is
    /// raised by the creation).
    pub(super) teardown: bool,
    /// The grid of the group's low-latency kernels (`decide::low_latency_grid`), which
    /// every launch passes in Args::flags (NOTE [Low latency epochs]).
    pub(super) ll_grid: u32,
    pub(super) armed: AtomicBool,
    /// Held by the thread that tells the peers of a mismatch before the teardown, until the
    /// process ends (`mismatch_failed`): the watchdog and a caller's health check may both
    /// find the mismatch, and the second must not end the process before the first's
    /// copies landed.
    pub(super) telling_peers: Mutex<()>,
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
    /// destroy never poisons the peers: they may still be finishing their own part of the
    /// last collective (a rank leaves its final barrier before others read their flags) or
    /// exchanging send/recv among themselves, which do not involve this rank; poisoning
    /// would turn a clean teardown into errors on healthy peers. Kernel-reported errors
    /// do not come here either: a timeout or size mismatch poisoned the peers on the GPU
    /// already (fail() in the kernel source), and an abort or a peer's poison came from a
    /// host or peer that did. (A mismatch of calls, which no kernel poisons for, reaches the
    /// peers with its cause before a teardown: `mismatch_failed`.)
    ///
    /// Ordering: the word carries no data. Each peer's kernels poll their own word with
    /// ld.volatile every 256 spins (stop_reason) and read it at entry (NOTE [Kernel
    /// entry]); our copy engine's 4-byte write lands in that memory over the peer mapping
    /// and becomes visible to those loads without any further ordering, and the peer reads
    /// the cause from its own fatal word (ERR_PEER naming this rank), which its kernel
    /// writes after seeing ours. The word is only ever set: a kernel's fail() racing with
    /// this store leaves the index of some failed rank, a correct report either way. The
    /// blocks belong to this group alone (a new group maps new ones), so nothing else ever
    /// sees this value.
    pub(super) fn poison_peers(&self, culprit: usize) {
        self.poison_peers_with(1 + culprit as u32);
    }

    /// `poison_peers` with the whole poison value: 1 + the culprit's local index, and in
    /// the high bits the culprit's cause and the rank it names, as fail() packs them
    /// (`cause_poison`). False if the peers were poisoned already (or there are none).
    fn poison_peers_with(&self, value: u32) -> bool {
        if self.peer_poison.is_empty() || self.peers_poisoned.swap(true, Ordering::AcqRel) {
            return false;
        }
        // Once (the swap above), before the copies that read it.
        self.words.write(HostWords::POISON_SRC, value);
        for &dst in &self.peer_poison {
            self.copy_word(HostWords::POISON_SRC, dst);
        }
        true
    }

    /// A mismatch this rank's kernel reported (ERR word `code`: different collectives, or
    /// all_to_all splits that disagree), as the error to raise; with cuda_error_teardown the
    /// process ends here (`kernel_failed`).
    ///
    /// Before it ends, the local peers' poison words get the cause (`cause_poison`), and the
    /// copies are waited for (at most OWN_WORD_WAIT). Every rank compares every peer's
    /// descriptor, but not at the same moment: a peer whose kernel has not reached that
    /// barrier yet (ranks time-sliced on one GPU, say) would otherwise see this process
    /// gone and name its exit, not the mismatch behind it. With the cause in its word, its
    /// kernel stops with ERR_PEER naming the mismatch (fail() packs the cause into its fatal
    /// word), and its watchdog, if it sees this process gone first, reads the cause from its
    /// own word (`cause_in_own_word`). Ordering: the copies complete (cuStreamQuery) before
    /// this process ends, so the word is in the peer's memory before the peer can see the
    /// exit; the rest is `poison_peers`'s argument. Without teardown nothing is poisoned:
    /// the counters stayed in step and the group stays usable (`CudaEngine::health`).
    pub(super) fn mismatch_failed(&self, code: u32) -> Error {
        let err = self.mismatch_error(code);
        if self.teardown && self.armed.load(Ordering::Acquire) {
            // Held until the process ends (kernel_failed below): a second thread that found
            // the mismatch waits here rather than end the process before the copies land.
            let _telling = self.telling_peers.lock();
            if self.poison_peers_with(cause_poison(self.me, code)) {
                self.poison_stream_done(OWN_WORD_WAIT);
            }
            return self.kernel_failed(err);
        }
        err
    }

    /// Whether the copies queued on the poison stream have completed, polled for at most
    /// `within` (never a blocking synchronize: a wedged driver or MPS server must not keep
    /// the watchdog or a teardown waiting). Completion makes the copies' bytes visible to
    /// the host and their stores to the GPUs' later readers.
    fn poison_stream_done(&self, within: Duration) -> bool {
        let Ok(_ctx) = self.dev.bind() else { return false };
        let deadline = Instant::now() + within;
        loop {
            // SAFETY: a live stream of the context bound above.
            match unsafe { cu::cuStreamQuery(self.poison_stream.raw()) } {
                cu::CUresult::CUDA_SUCCESS => return true,
                cu::CUresult::CUDA_ERROR_NOT_READY if Instant::now() < deadline => std::thread::sleep(Duration::from_micros(200)),
                _ => return false,
            }
        }
    }

    /// Set this rank's own poison word (once): every later kernel of the group on this GPU,
    /// an eager launch or a CUDA graph's replay, then stops at its entry and writes nothing
    /// (NOTE [Kernel entry]). `value` is 1 + the culprit's local index, or POISON_DESTROYED
    /// when the group was destroyed. Same ordering as `poison_peers`: the word carries no
    /// data, and the kernels' loads see the copy's store once it lands.
    pub(super) fn poison_own(&self, value: u32) {
        if self.own_poisoned.swap(true, Ordering::AcqRel) {
            return;
        }
        self.words.write(HostWords::OWN_POISON_SRC, value);
        self.copy_word(HostWords::OWN_POISON_SRC, self.own_poison);
    }

    /// At a clean destroy, after the group's work drained: this rank's own poison word
    /// becomes POISON_DESTROYED, so that a CUDA graph replayed later stops at its kernels'
    /// entry (NOTE [Kernel entry]). Waits for the copy: the engine's memory may be released
    /// right after.
    pub(super) fn mark_destroyed(&self) {
        self.words.write(HostWords::DESTROYED_SRC, POISON_DESTROYED);
        self.copy_word(HostWords::DESTROYED_SRC, self.own_poison);
        if let Ok(_ctx) = self.dev.bind() {
            self.poison_stream.synchronize();
        }
    }

    /// Copy host word `src` into the device word `dst` (a poison word) on the poison stream.
    fn copy_word(&self, src: usize, dst: u64) {
        let Ok(_ctx) = self.dev.bind() else { return };
        // SAFETY: the source is 4 bytes of pinned host memory alive as long as `self`;
        // `dst` is a poison word of a block mapped in this context until the pool is
        // dropped, after `poison_stream` is synchronized (CudaEngine's Drop); a copy (DMA),
        // not a kernel, so it runs even while spinning kernels hold every SM.
        let r = unsafe { cu::cuMemcpyHtoDAsync_v2(dst, self.words.src(src), 4, self.poison_stream.raw()) };
        if r != cu::CUresult::CUDA_SUCCESS {
            tracing::warn!("rsccl: could not set a poison word after a failure ({r:?}); kernels stop at their own timeout");
        }
    }

    /// The failure another rank's kernel recorded in this rank's own poison word (a
    /// timeout, a send/recv size mismatch, two collectives at once; or a mismatch of calls,
    /// which its host wrote before its teardown: `mismatch_failed`), as the error a kernel of
    /// this rank reports on finding it (`fatal_error`); None when the word is empty, was set
    /// by a host (no cause: an abort, a dead peer), or could not be read.
    ///
    /// The watchdog asks this when it finds a peer gone. A rank whose kernel timed out writes
    /// every rank's poison word (fail() in csrc_kernels/protocol.cuh) and is then ended by its
    /// own teardown: a peer whose kernel had not yet run to its next stop check (ranks
    /// time-sliced on one GPU, say) sees the process gone first, and would name the exit,
    /// not the timeout behind it. Ordering: fail() stores the poison words and fences
    /// (system scope) before its process can end; its FATAL word is written just before
    /// them, so a teardown that acts within those few stores can leave the word empty, and
    /// then the exit is named. The copy runs on the poison stream (never behind a kernel)
    /// and is read after the stream reported it complete (cuStreamQuery, which makes its
    /// bytes visible here), within OWN_WORD_WAIT.
    pub(super) fn cause_in_own_word(&self) -> Option<Error> {
        let _ctx = self.dev.bind().ok()?;
        // SAFETY: the destination is 4 bytes of this engine's pinned page, alive as long as
        // `self`; the source is this rank's own poison word, mapped in this context until the
        // pool is dropped, after `poison_stream` is synchronized (CudaEngine's Drop). The
        // copy is waited for below, before the word is read.
        let r =
            unsafe { cu::cuMemcpyDtoHAsync_v2(self.words.dst(HostWords::OWN_POISON_READ), self.own_poison, 4, self.poison_stream.raw()) };
        if r != cu::CUresult::CUDA_SUCCESS {
            return None;
        }
        // Polled, not synchronized: the watchdog never blocks on the GPU (a wedged driver or
        // MPS server would keep it from reading the kernels' reports and its shutdown from
        // joining it). A copy not done by then is left to finish into a word nobody reads
        // again (the watchdog asks once).
        if !self.poison_stream_done(OWN_WORD_WAIT) {
            return None;
        }
        let p = self.words.read(HostWords::OWN_POISON_READ);
        let peer = p.checked_sub(1).filter(|_| p != POISON_DESTROYED)?;
        if (peer >> 16) & 0xf == 0 {
            return None;
        }
        // The FATAL code fail() builds from a poison word less one (abi.cuh).
        self.fatal_error((ERR_PEER << 16) | (((peer >> 16) & 0xf) << 20) | ((peer >> 24) << 24) | (peer & 0xffff))
    }

    /// Mark the group unusable with `err` (the first error wins), stop this rank's queued
    /// kernels at their next wait, and refuse its later kernels at their entry.
    pub(super) fn poison(&self, err: Error) -> Error {
        let e = self.poisoned.lock().get_or_insert(err).clone();
        self.words.write(HostWords::ABORT, 1);
        self.poison_own(1 + self.me as u32);
        e
    }

    /// The kernels' FLAG_* bits for a launch now.
    pub(super) fn launch_flags(&self) -> u32 {
        let hold = if self.teardown && self.armed.load(Ordering::Acquire) { FLAG_HOLD_ON_ERROR } else { 0 };
        hold | self.ll_grid << FLAG_LL_GRID_SHIFT
    }

    /// A failure that a kernel of this rank reported (its result was not computed): with
    /// cuda_error_teardown (the default, once the group is made), end the process, so that
    /// nothing goes on computing with that result, as NCCL's watchdog does under
    /// TORCH_NCCL_ASYNC_ERROR_HANDLING; else hand the error back, to be raised.
    pub(super) fn kernel_failed(&self, err: Error) -> Error {
        if self.teardown && self.armed.load(Ordering::Acquire) {
            self.tear_down(&err);
        }
        err
    }

    fn tear_down(&self, err: &Error) -> ! {
        let me = self.local_ranks.get(self.me).copied().unwrap_or(self.me);
        let msg = format!(
            "rsccl: rank {me}: a CUDA collective or send/recv of this process group failed on the GPU: {err}. \
             Ending the process, so that nothing computes on with the result it did not produce \
             (cuda_error_teardown = 1, the default, as NCCL's TORCH_NCCL_ASYNC_ERROR_HANDLING; with \
             rsccl.Options(cuda_error_teardown=0) or RSCCL_CUDA_ERROR_TEARDOWN=0 the error is raised at the group's \
             next call or Work.wait instead)"
        );
        tracing::error!("{msg}");
        eprintln!("{msg}");
        std::process::abort();
    }

    /// The error a fatal code of the status page stands for (FATAL word), or None for 0.
    pub(super) fn fatal_error(&self, code: u32) -> Option<Error> {
        if code == 0 {
            return None;
        }
        let (kind, peer, cause, named) = fatal_fields(code);
        let grank = self.local_ranks.get(peer).copied().unwrap_or(peer);
        let me = self.local_ranks[self.me];
        let gnamed = named.checked_sub(1).map(|n| self.local_ranks.get(n).copied().unwrap_or(n));
        Some(match kind {
            ERR_TIMEOUT => Error::Timeout(format!(
                "a CUDA collective or send/recv on rank {me} waited longer than the group timeout ({:.1} s) for rank {grank}",
                self.timeout.as_secs_f64()
            )),
            ERR_ABORTED => Error::Aborted("the group was aborted".into()),
            // A peer stopped the group with no cause of its own (its host's abort, or a dead
            // rank it saw): if its process is gone, say so as this rank's own watchdog would
            // have (it may not have polled yet: the peer's poison came first). A peer that
            // failed with a cause (a timeout, a size mismatch, two collectives at once) is
            // named with that cause below, even where it or the rank it waited for has exited
            // since: a late rank is ended by the very poison that names it, so its exit says
            // nothing new.
            ERR_PEER if cause == 0 && self.mesh.gone().contains(&peer) => gone_error(&self.local_ranks, &self.pids, peer),
            // This rank's own word: the host stopped the group (its own error is raised
            // first, where it has one).
            ERR_PEER if peer == self.me && cause == 0 => {
                Error::Aborted(format!("the group had failed on rank {me} before this CUDA call ran"))
            }
            // Another rank's kernel (or this rank's earlier one) timed out: every rank names
            // the rank that was waited for, as the one that timed out does.
            ERR_PEER if cause == ERR_TIMEOUT && gnamed.is_some() => Error::Timeout(format!(
                "a CUDA collective or send/recv on rank {grank} waited longer than the group timeout ({:.1} s) for \
                 rank {}, and stopped the group: this CUDA call on rank {me} did not complete",
                self.timeout.as_secs_f64(),
                gnamed.unwrap_or(peer)
            )),
            ERR_PEER if cause == ERR_P2P_SIZE && gnamed.is_some() => Error::Mismatch(format!(
                "a recv on rank {grank} found that rank {} sent a different number of bytes, which stopped the group \
                 (send/recv sizes must match): this CUDA call on rank {me} did not complete",
                gnamed.unwrap_or(peer)
            )),
            // A peer's kernel found that it and rank `named` called different collectives,
            // and its host stopped the group before ending the process (`mismatch_failed`).
            // Aborted, not Mismatch: the group is stopped (a mismatch this rank found itself
            // leaves it usable where the ranks do not tear down).
            ERR_PEER if cause == ERR_MISMATCH && gnamed.is_some() => Error::Aborted(format!(
                "ranks called different CUDA collectives: rank {grank} found that rank {} called another collective \
                 than it did, and stopped the group (see rank {grank}'s error for both calls): this CUDA call on rank \
                 {me} did not complete",
                gnamed.unwrap_or(peer)
            )),
            ERR_PEER if cause == ERR_A2A && gnamed.is_some() => Error::Aborted(format!(
                "all_to_all: rank {grank} found that the ranks' split sizes disagree (rank {} among them), and stopped \
                 the group (see rank {grank}'s error for the sizes): this CUDA call on rank {me} did not complete",
                gnamed.unwrap_or(peer)
            )),
            ERR_PEER if cause == ERR_CONCURRENT => Error::Aborted(format!(
                "two CUDA collectives of this group ran at the same time on rank {grank}'s GPU, which stopped the \
                 group: this CUDA call on rank {me} did not complete (see rank {grank}'s error)"
            )),
            ERR_PEER => Error::Aborted(format!(
                "the group was stopped because of rank {grank}: it failed (a timeout, a send/recv size mismatch, two \
                 collectives at once, an abort) or died; see rank {grank}'s error, or its exit"
            )),
            ERR_P2P_SIZE => Error::Mismatch(format!(
                "recv on rank {me}: rank {grank} sent {} bytes, rank {me} expected {} bytes; the group is unusable \
                 (send/recv sizes must match)",
                self.words.read64(48),
                self.words.read64(49)
            )),
            ERR_CONCURRENT => Error::Aborted(format!(
                "two CUDA collectives of this group ran at the same time on rank {me}'s GPU, which the group's \
                 kernels cannot tell apart: a collective was started while an earlier one of the same group was \
                 still running on another stream. The usual cause is a CUDA graph replayed while an async \
                 collective of the group was not yet waited for (call work.wait() before graph.replay()), or two \
                 graphs holding collectives of one group replayed on different streams without ordering them \
                 (replay them on one stream, or make one stream wait for the other). The group is unusable"
            )),
            _ => Error::Internal(format!("unknown CUDA kernel error code {code:#x}")),
        })
    }

    /// The error a mismatch code of the status page (ERR word) stands for.
    pub(super) fn mismatch_error(&self, code: u32) -> Error {
        let w = |i: usize| self.words.read64(i);
        let g = |l: u64| self.local_ranks.get(l as usize).copied().unwrap_or(l as usize);
        match code >> 16 {
            // Every rank checked every pair and reports the same lowest bad pair (i, j).
            ERR_A2A => Error::Mismatch(format!(
                "all_to_all: rank {} sends {} bytes to rank {}, which expects {} bytes from it (split sizes must agree)",
                g(w(4)),
                w(6),
                g(w(5)),
                w(7)
            )),
            ERR_MISMATCH => {
                let peer = (code & 0xffff) as usize;
                let (mine, theirs) = (describe(w(4), w(5)), describe(w(8 + 2 * peer), w(9 + 2 * peer)));
                Error::Mismatch(format!(
                    "ranks called different CUDA collectives: rank {} called {theirs}, rank {} called {mine}",
                    g(peer as u64),
                    g(self.me as u64)
                ))
            }
            _ => Error::Internal(format!("unknown CUDA kernel error code {code:#x}")),
        }
    }
}

/// The error naming local peer `j`, whose process is gone (`pids`: each local peer's pid,
/// read while the connections were up).
pub(super) fn gone_error(local_ranks: &[usize], pids: &[Option<u32>], j: usize) -> Error {
    let pid = pids.get(j).copied().flatten().map(|pid| format!("pid {pid}, ")).unwrap_or_default();
    Error::PeerFailure(format!(
        "rank {} ({pid}local rank {j}) is gone: its process exited or closed its connection",
        local_ranks.get(j).copied().unwrap_or(j)
    ))
}

/// A kernel descriptor (the two words every rank publishes at a barrier) in words, for
/// mismatch messages.
fn describe(d0: u64, d1: u64) -> String {
    let Some(k) = Kind::from_code((d0 & 0xff) as u8) else {
        return "an unknown call".to_string();
    };
    let dtype = DType::from_code(((d0 >> DESC0_DTYPE_SHIFT) & 0xff) as u8).map(|d| d.name()).unwrap_or("?");
    let op = ReduceOp::from_code(((d0 >> DESC0_OP_SHIFT) & 0xff) as u8).map(|o| o.name()).unwrap_or("?");
    let call = call_in_words(k, dtype, op, ((d0 >> DESC0_ROOT_SHIFT) & 0xffff) as u32, d1);
    if d0 >> DESC0_COPY_ENGINE_BIT & 1 == 1 {
        return format!("{call} on the copy engines");
    }
    call
}

impl CudaEngine {
    /// Mark the group unusable with `err` (the first error wins) and stop this rank's
    /// queued kernels at their next wait (and later ones at their entry).
    pub(super) fn poison(&self, err: Error) -> Error {
        self.sh.poison(err)
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

    /// The error that made the group unusable: an earlier one, or a failure a kernel
    /// reported (then `kernel_failed`: by default the process ends).
    pub(super) fn fatal(&self) -> Result<()> {
        if let Some(e) = self.sh.poisoned.lock().clone() {
            return Err(e);
        }
        let Some(err) = self.sh.fatal_error(self.sh.words.read(HostWords::FATAL)) else {
            return Ok(());
        };
        if let Error::Internal(_) = err {
            return Err(self.abort_group(err));
        }
        // The kernel that reported it poisoned the peers already where needed (fail()).
        Err(self.poison(self.sh.kernel_failed(err)))
    }

    /// At a new call's entry: refused, naming the failure, when an earlier one stopped the
    /// group (`Error::stopped_earlier`: after a send/recv size mismatch, say, the next
    /// send/recv says so instead of repeating the mismatch as if it were its own).
    pub(super) fn refuse_if_stopped(&self) -> Result<()> {
        self.fatal().map_err(Error::stopped_earlier)
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
        // With cuda_error_teardown the kernel holds its stream until the host acts: the
        // process ends here (or in the watchdog, whichever reads the word first).
        let err = self.sh.mismatch_failed(code);
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
        Err(err)
    }

    /// Wait until every collective kernel launched so far has finished, at most the group
    /// timeout and a second: the kernels bound their own waits by the timeout, so a longer
    /// wait means something else is wrong, which `fatal` then reports, if the kernels did.
    ///
    /// The wait is on an event recorded now, under the order's lock, on the stream of the
    /// last collective: each collective is ordered after the previous one, so that event
    /// completes once all of them finished. Launches record nothing for this (it runs only
    /// after a kernel reported a mismatch), so an eager call pays one driver launch. The
    /// event also covers what the caller queued on that stream after the last collective:
    /// work bounded like any kernel, or a blocking send/recv waiting for its partner, which
    /// its own kernel bounds by the group timeout too; either way the deadline below ends
    /// the wait (if that send/recv times out meanwhile, `fatal` then raises its timeout
    /// rather than the mismatch). The chain's stream is never the per-thread default
    /// stream (`Launch::collective`), so naming it from this thread is right. A later
    /// launch on another thread is ordered after the record, not before: its kernel, if
    /// it mismatches as well, reports again at the next check.
    pub(super) fn wait_collectives(&self) -> Result<()> {
        let _ctx = self.sh.dev.bind()?;
        let ev = {
            let mut o = self.order.lock();
            match o.last_stream() {
                None => return Ok(()),
                // The last launch is being captured (so the mismatch came from a kernel that
                // ran before the capture began, and torch synchronized the device then):
                // nothing to wait for, and recording into a capture would add to the graph.
                // (A capture begun without that synchronization, CUDAGraph.capture_begin
                // called alone, may see the mismatch reported once more, at a later call.)
                Some(l) if is_capturing(l).unwrap_or(true) => return Ok(()),
                Some(l) => o.record(l)?,
            }
        };
        let deadline = Instant::now() + self.timeout + Duration::from_secs(1);
        let mut pause = Duration::from_micros(5);
        let done = loop {
            // SAFETY: an event of the order's pool, recorded above; it goes back below.
            match unsafe { cu::cuEventQuery(ev.raw()) } {
                cu::CUresult::CUDA_SUCCESS => break Ok(()),
                cu::CUresult::CUDA_ERROR_NOT_READY if Instant::now() < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_micros(500));
                }
                cu::CUresult::CUDA_ERROR_NOT_READY => break Ok(()),
                e => break check(e, "cuEventQuery (end of collectives)"),
            }
        };
        self.order.lock().give_back(ev);
        done
    }
}

#[cfg(test)]
mod tests {
    use super::{
        cause_poison, describe, fatal_fields, DESC0_COPY_ENGINE_BIT, ERR_A2A, ERR_CONCURRENT, ERR_MISMATCH, ERR_PEER, ERR_TIMEOUT,
    };
    use crate::collective::Kind;
    use crate::cuda::decide::message_bytes;
    use crate::dtype::{DType, ReduceOp};

    #[test]
    fn fatal_codes_carry_the_culprits_cause() {
        // fail() on a rank poisoned by local rank 1, which timed out waiting for rank 3:
        // the poison word is (1 + 1) | ERR_TIMEOUT << 16 | (1 + 3) << 24; stop_reason hands
        // fail() that word less one, and fail() packs the code as below.
        let poison: u32 = 2 | (ERR_TIMEOUT << 16) | (4 << 24);
        let who = poison - 1;
        let code = (ERR_PEER << 16) | (((who >> 16) & 0xf) << 20) | ((who >> 24) << 24) | (who & 0xffff);
        assert_eq!(fatal_fields(code), (ERR_PEER, 1, ERR_TIMEOUT, 4));
        // The host's poison (1 + culprit, no cause) and plain codes keep their old meaning.
        assert_eq!(fatal_fields((ERR_PEER << 16) | 2), (ERR_PEER, 2, 0, 0));
        assert_eq!(fatal_fields((ERR_TIMEOUT << 16) | 3), (ERR_TIMEOUT, 3, 0, 0));
        assert_eq!(fatal_fields((ERR_CONCURRENT << 16) | 15), (ERR_CONCURRENT, 15, 0, 0));
    }

    #[test]
    fn a_mismatch_reaches_the_peers_with_its_cause() {
        // Local rank 2's kernel found that local rank 5 called something else (ERR word
        // ERR_MISMATCH << 16 | 5); its host poisons the peers with cause_poison, and a peer's
        // fail() packs that word less one as it does a timeout's.
        for (kind, named) in [(ERR_MISMATCH, 5u32), (ERR_A2A, 0), (ERR_MISMATCH, 7)] {
            let who = cause_poison(2, (kind << 16) | named) - 1;
            let code = (ERR_PEER << 16) | (((who >> 16) & 0xf) << 20) | ((who >> 24) << 24) | (who & 0xffff);
            assert_eq!(fatal_fields(code), (ERR_PEER, 2, kind, 1 + named as usize));
        }
    }

    #[test]
    fn descriptors_read_back_as_calls() {
        let d0 = Kind::AllReduce.code() | ((DType::BF16 as u64) << 8) | ((ReduceOp::Max as u64) << 16);
        assert_eq!(describe(d0, 1000), "all_reduce bfloat16[1000] MAX");
        assert_eq!(describe(Kind::Invalid.code(), 0), "an invalid call");
        let r = Kind::Reduce.code() | ((DType::F32 as u64) << 8) | ((ReduceOp::Sum as u64) << 16) | (2u64 << 32);
        assert_eq!(describe(r, 7), "reduce float32[7] SUM to local rank 2");
        assert_eq!(describe(Kind::Gather.code() | (1u64 << 32), 64), "gather of 64 bytes per rank to local rank 1");
        let ce = Kind::AllGather.code() | (1u64 << DESC0_COPY_ENGINE_BIT);
        assert_eq!(describe(ce, 64), "all_gather of 64 bytes per rank on the copy engines");
        assert_eq!(message_bytes(Kind::Scatter, 64, 1, 4), 256);
    }
}
