//! The CUDA engine of a group on one host: the symmetric pool, the loaded kernels, an
//! internal stream, and the ordering rules between them and the caller's streams.
//!
//! Streams: every kernel of a group must run after the previous one (the kernels' per-block
//! counters assume it, NOTE [Lockstep blocks] in csrc_kernels/protocol.cuh). A launch goes to the caller's
//! current stream (blocking calls, `cuda_sync_stream = 1`) or to the internal stream (after
//! an event makes it wait for the caller's stream). When a launch goes to a different
//! stream than the previous launch, the new stream first waits on an event recorded on the
//! old one. No tensor is marked on a stream: the Python Work keeps its tensors until the
//! consumer stream is ordered after the collective.
//!
//! Errors: kernels never spin unbounded. A wait that times out, sees the abort word, or
//! finds that a peer called another collective writes a code into host-mapped memory; the
//! host reads it before every launch and when a Work is waited on. A watchdog thread sets
//! the abort word as soon as a local peer process is gone, so kernels stop within
//! milliseconds instead of running into the timeout.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use parking_lot::Mutex;

use super::call::describe;
pub use super::call::{CudaCall, CudaKind};
use super::driver::{check, is_capturing, CUevent, CUstream, Device};
use super::heap::Heap;
use super::kernels::{Family, Kernels, MAX_BLOCKS, MAX_RANKS, POISON_OFF, STAGE_OFF, STATS_OFF, THREADS};
use super::pool::SymmetricPool;
use crate::bootstrap::LocalMesh;
use crate::config::Config;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// The kernel argument block (the source's `struct Args`, same layout).
#[repr(C)]
#[derive(Clone, Copy)]
struct Args {
    peer: [u64; MAX_RANKS],
    inp: u64,
    out: u64,
    count: u64,
    stage_per_block: u64,
    err_host: u64,
    abort_host: u64,
    timeout_ns: u64,
    desc0: u64,
    desc1: u64,
    place_in: u64,
    place_out: u64,
    rank: u32,
    world: u32,
    root: u32,
    pad: u32,
}

/// The all_to_all kernel's argument block (the source's `struct A2aArgs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct A2aArgs {
    a: Args,
    send: [u64; MAX_RANKS],
    send_n: [u64; MAX_RANKS],
    recv: [u64; MAX_RANKS],
    recv_n: [u64; MAX_RANKS],
}

/// The send/recv kernels' argument block (the source's `struct P2pArgs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct P2pArgs {
    a: Args,
    inbox_off: u64,
    chunk: u64,
}

const ERR_TIMEOUT: u32 = 1;
const ERR_ABORTED: u32 = 2;
const ERR_MISMATCH: u32 = 3;
const ERR_PEER: u32 = 4;
const ERR_P2P_SIZE: u32 = 5;
const ERR_A2A: u32 = 6;

/// One all_to_all: per peer (local index), the chunk this rank sends (address, bytes) and
/// where the chunk from that peer lands (address, bytes).
#[derive(Debug, Clone, Default)]
pub struct AllToAll {
    pub send: Vec<u64>,
    pub send_bytes: Vec<u64>,
    pub recv: Vec<u64>,
    pub recv_bytes: Vec<u64>,
}

/// The bytes per (peer slot, CUDA block, parity) of the send/recv inbox (NOTE [Point to
/// point] in csrc_kernels/protocol.cuh), or why the settings leave too little.
pub fn p2p_chunk(p2p_bytes: usize, local_ranks: usize, blocks: u32) -> Result<usize> {
    let slots = local_ranks.saturating_sub(1).max(1);
    let chunk = (p2p_bytes / (slots * 2 * blocks as usize)) & !255;
    if chunk < 4096 {
        return Err(Error::Config(format!(
            "cuda_p2p_bytes = {p2p_bytes} leaves {chunk} bytes per send/recv chunk for {slots} peers x \
             cuda_p2p_blocks = {blocks} x 2: raise cuda_p2p_bytes or lower cuda_p2p_blocks"
        )));
    }
    Ok(chunk)
}

/// Blocks of each send/recv kernel such that all of them that one rank may have running
/// at once, one per (peer, direction), 2 x (local ranks - 1), fit on the GPU together with
/// one collective kernel (`collective_blocks`): `sms` SMs; a collective's blocks take whole
/// SMs (`collective_per_sm` of them per SM: they ask for one block per SM and hold most of
/// its registers, so no send/recv block shares their SM), and the other SMs hold
/// `p2p_per_sm` send/recv blocks each. At most `setting`; 0 when not even one block each
/// fits. A pure function (tested without a GPU).
///
/// Why all at once: a send waits for its receiver's kernel, which may sit behind that
/// rank's other send/recv kernels; if those hold every SM while they wait for peers in
/// turn, nothing moves until the timeout. With every kernel resident, each one makes
/// progress whenever its partner does, so no cycle of waits can form from a lack of SMs.
/// (Other work on the GPU, e.g. the caller's compute kernels, only delays ours: it ends by
/// itself and frees its SMs.)
pub fn p2p_blocks_that_fit(
    setting: u32,
    local_ranks: usize,
    sms: u32,
    p2p_per_sm: u32,
    collective_blocks: u32,
    collective_per_sm: u32,
) -> u32 {
    let kernels = 2 * local_ranks.saturating_sub(1) as u64;
    if kernels == 0 {
        return setting; // no peer: send/recv never run
    }
    if collective_per_sm == 0 {
        return 0; // a collective kernel cannot run at all
    }
    let collective_sms = (collective_blocks as u64).div_ceil(collective_per_sm as u64);
    let slots = (sms as u64).saturating_sub(collective_sms) * p2p_per_sm as u64;
    (slots / kernels).min(setting as u64) as u32
}

/// The grids of one rank, (collective blocks, send/recv blocks), when `sharers` ranks of
/// the group (this one included) run on its GPU of `sms` SMs. A pure function (tested
/// without a GPU).
///
/// On a GPU of its own (`sharers` <= 1) the collective grid is `cuda_blocks` and the
/// send/recv grid `p2p_blocks_that_fit`, as always.
///
/// Ranks that share a GPU (`allow_shared_gpu`) each get `sms / sharers` SMs and size both
/// grids to fit in that share: first one block for each of the 2 x (local ranks - 1)
/// send/recv kernels, then the collective's blocks (at most `cuda_blocks`) on the SMs left,
/// then the send/recv grid again (`p2p_blocks_that_fit` on the share). Why this never
/// deadlocks: the kernels of different ranks wait for one another (barriers, send/recv
/// handshakes), so a waiting block only makes progress if its partner blocks can run too.
/// The shares are disjoint and together no larger than the GPU, so every kernel that every
/// co-located rank may have in flight at once (one collective and its send/recv kernels)
/// can be resident at the same time: under MPS, where the ranks' kernels run side by side,
/// they all fit together; time-sliced (no MPS), each rank's context holds at most its own
/// share and the others run in their turns. (A single rank's collectives run one after the
/// other, as on a GPU of its own; other work on the GPU only delays ours.) (0, 0) when a
/// share cannot hold even one block of each kernel.
pub fn grids_that_fit(
    cuda_blocks: u32,
    p2p_setting: u32,
    local_ranks: usize,
    sms: u32,
    p2p_per_sm: u32,
    collective_per_sm: u32,
    sharers: u32,
) -> (u32, u32) {
    if sharers <= 1 {
        return (cuda_blocks, p2p_blocks_that_fit(p2p_setting, local_ranks, sms, p2p_per_sm, cuda_blocks, collective_per_sm));
    }
    let share = sms / sharers;
    let kernels = 2 * local_ranks.saturating_sub(1) as u32;
    let p2p_sms = match (kernels, p2p_per_sm) {
        (0, _) => 0,
        (_, 0) => return (0, 0),
        (k, per) => k.div_ceil(per),
    };
    let collective = cuda_blocks.min(share.saturating_sub(p2p_sms).saturating_mul(collective_per_sm));
    if collective == 0 {
        return (0, 0);
    }
    (collective, p2p_blocks_that_fit(p2p_setting, local_ranks, share, p2p_per_sm, collective, collective_per_sm))
}

/// The grids every local rank uses, (collective blocks, send/recv blocks): `grids_that_fit`
/// on each rank's GPU, the least of each (ranks pair their blocks one to one, and senders
/// and receivers must split messages alike), or an error on every rank alike when some GPU
/// cannot hold even one block per kernel. `sharers` is how many of the group's ranks use
/// this rank's GPU.
fn agree_grids(
    dev: &Device,
    kernels: &Kernels,
    mesh: &LocalMesh,
    local_ranks: &[usize],
    cfg: &Config,
    sharers: u32,
    deadline: Instant,
) -> Result<(u32, u32)> {
    let n = mesh.size();
    let (sms, per_sm, coll_per_sm) = {
        let _ctx = dev.bind()?;
        let sms = dev.attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(0) as u32;
        let p2p = Kernels::min_blocks_per_sm([kernels.send, kernels.recv])?;
        let coll = Kernels::min_blocks_per_sm(kernels.collectives())?;
        (sms, p2p, coll)
    };
    let (coll_fit, p2p_fit) = grids_that_fit(cfg.cuda_blocks, cfg.cuda_p2p_blocks, n, sms, per_sm, coll_per_sm, sharers);
    let mut msg = [0u8; 64];
    msg[..4].copy_from_slice(b"RSP2");
    for (k, v) in [p2p_fit, sms, per_sm, coll_per_sm, coll_fit, sharers].into_iter().enumerate() {
        msg[4 + 4 * k..8 + 4 * k].copy_from_slice(&v.to_le_bytes());
    }
    let got = mesh.all_gather(&msg, None, deadline)?;
    let word = |m: &[u8; 64], k: usize| u32::from_le_bytes(m[4 + 4 * k..8 + 4 * k].try_into().unwrap_or_default());
    let least = |k: usize| got.iter().enumerate().map(|(j, (m, _))| (j, word(m, k))).min_by_key(|&(_, f)| f).unwrap_or((0, 0));
    let ((j, p2p), (_, coll)) = (least(0), least(4));
    if p2p == 0 || coll == 0 {
        let j = if p2p == 0 { j } else { least(4).0 };
        let m = &got[j].0;
        let who = local_ranks.get(j).copied().unwrap_or(j);
        let sharing = word(m, 5);
        if sharing > 1 {
            return Err(Error::Config(format!(
                "{sharing} ranks of this group share the GPU of rank {who} ({} SMs, {} send/recv and {} collective blocks \
                 per SM): each rank's share of {} SMs cannot hold one collective kernel and {} send/recv kernels (one per \
                 local peer and direction) of even one block at once, which ranks on one GPU need to never wait on a kernel \
                 that cannot start: put fewer ranks on each GPU",
                word(m, 1),
                word(m, 2),
                word(m, 3),
                word(m, 1) / sharing,
                2 * (n - 1)
            )));
        }
        return Err(Error::Config(format!(
            "the GPU of rank {who} ({} SMs, {} send/recv and {} collective blocks per SM) cannot hold one collective \
             kernel (cuda_blocks = {}) and {} send/recv kernels (one per local peer and direction) of even one block \
             at once, which send/recv need to never wait on a kernel that cannot start: lower cuda_blocks",
            word(m, 1),
            word(m, 2),
            word(m, 3),
            cfg.cuda_blocks,
            2 * (n - 1)
        )));
    }
    if coll < cfg.cuda_blocks {
        tracing::info!(
            setting = cfg.cuda_blocks,
            effective = coll,
            "rsccl: collective kernels use {coll} blocks, not cuda_blocks = {}, so that the kernels of every rank sharing a GPU fit on it at once",
            cfg.cuda_blocks
        );
    }
    if p2p < cfg.cuda_p2p_blocks {
        tracing::info!(
            setting = cfg.cuda_p2p_blocks,
            effective = p2p,
            "rsccl: send/recv kernels use {p2p} blocks, not cuda_p2p_blocks = {}, so that all {} of them and a collective fit on the GPU at once",
            cfg.cuda_p2p_blocks,
            2 * (n - 1)
        );
    }
    Ok((coll, p2p))
}

/// The one-shot limit when `cuda_allreduce_one_shot_max_bytes` is 0 (auto), by the number
/// of local ranks. From `python -m rsccl.bench --device cuda --sweep-one-shot` on 2 and 4
/// H200s (2026-11-21): at 2 ranks one-shot was faster up to 1 MiB (11.0 vs 14.1 us) and
/// even at 4 MiB (26.6 vs 26.0 us), two-shot from 16 MiB; at 4 ranks the two were within
/// noise up to 1 MiB and two-shot won from 4 MiB (33.9 vs 60.5 us). One-shot moves
/// (ranks - 1) x the message over each GPU's links, so its range shrinks with more ranks;
/// beyond 4 ranks nothing was measured yet and 256 KiB is a guess on that trend.
pub fn auto_one_shot_max(local_ranks: usize) -> usize {
    match local_ranks {
        0..=2 => 2 << 20,
        3..=4 => 512 << 10,
        _ => 256 << 10,
    }
}

/// Which all_reduce kernel runs a message of `bytes` (a pure function: tested without a GPU).
/// `one_shot_max` 0 means auto (`auto_one_shot_max`).
pub fn choose_allreduce(bytes: usize, local_ranks: usize, one_shot_max: usize) -> Family {
    let limit = if one_shot_max == 0 { auto_one_shot_max(local_ranks) } else { one_shot_max };
    if bytes <= limit {
        Family::OneShot
    } else {
        Family::TwoShot
    }
}

/// The bytes a call moves per rank, as memory_stats counts them and the in-place threshold
/// compares: the all_reduce / broadcast tensor, the all_gather output, the reduce_scatter
/// input.
pub fn message_bytes(kind: CudaKind, count: u64, elem: usize, world: usize) -> u64 {
    match kind {
        CudaKind::AllReduce => count * elem as u64,
        CudaKind::ReduceScatter => count * (elem * world) as u64,
        CudaKind::AllGather | CudaKind::Gather | CudaKind::Scatter => count * world as u64,
        CudaKind::Broadcast => count,
        CudaKind::Reduce => count * elem as u64,
        CudaKind::Send | CudaKind::Recv => count,
        CudaKind::AllToAll | CudaKind::Barrier | CudaKind::Invalid => 0,
    }
}

/// Which buffers a call offers to use in place, as (place_in, place_out) for the kernel:
/// offset + 1 of the buffer in the rank's block, 0 for "not offered". `in_pool(ptr, len)`
/// gives a buffer's offset if it lies inside the pool. A pure function (tested without a
/// GPU); what it returns may differ between ranks, and the kernels settle it together.
/// Every rank calls it with the same kind, family and sizes, so calls under the threshold
/// or of a family without an in-place algorithm (one-shot) offer nothing on every rank.
pub fn placement(c: &CudaCall, fam: Option<Family>, world: usize, min_bytes: u64, in_pool: &dyn Fn(u64, u64) -> Option<u64>) -> (u64, u64) {
    let elem = c.dtype.size();
    let msg = message_bytes(c.kind, c.count, elem, world);
    if msg == 0 || msg < min_bytes {
        return (0, 0);
    }
    let at = |ptr: u64, len: u64| in_pool(ptr, len).map(|o| o + 1);
    match c.kind {
        CudaKind::AllReduce if fam == Some(Family::TwoShot) => match (at(c.inp, msg), at(c.out, msg)) {
            (Some(i), Some(o)) => (i, o),
            _ => (0, 0),
        },
        CudaKind::ReduceScatter => (at(c.inp, msg).unwrap_or(0), 0),
        CudaKind::AllGather | CudaKind::Broadcast => (0, at(c.out, msg).unwrap_or(0)),
        _ => (0, 0),
    }
}

/// Staging bytes per CUDA block and parity for a buffer of `buffer_bytes` and `blocks`
/// blocks: what remains after the control area, split in 2 * blocks, in 256-byte units.
pub fn stage_per_block(buffer_bytes: usize, blocks: u32) -> usize {
    (buffer_bytes.saturating_sub(STAGE_OFF) / (2 * blocks as usize)) & !255
}

/// Pinned host memory the kernels write errors into and the host writes the abort word into.
struct HostWords {
    host: *mut u32,
    dev: u64,
}

impl HostWords {
    /// A mismatch between ranks' calls (reported once, then cleared).
    const ERR: usize = 0;
    /// A timeout or abort (never cleared: the group is unusable).
    const FATAL: usize = 1;
    // u32 index 0: the error code; bytes 32..48: this rank's descriptor; bytes 64..320: peers'
    // descriptors (report_mismatch in the kernel source); the abort word lives apart.
    const ABORT: usize = 512;
    /// u64 index of 4 words the collective counters are copied into (bytes 3072..3104).
    const COUNTS: usize = 384;
    /// u32 index of 1 + this rank's local index, the value copied into peers' poison words
    /// (bytes 3200..3204).
    const POISON_SRC: usize = 800;

    fn new() -> Result<HostWords> {
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: allocates 4 KiB of pinned, device-mapped host memory into `p`.
        check(unsafe { cu::cuMemHostAlloc(&mut p, 4096, cu::CU_MEMHOSTALLOC_DEVICEMAP | cu::CU_MEMHOSTALLOC_PORTABLE) }, "cuMemHostAlloc")?;
        // SAFETY: `p` points at 4096 writable bytes.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, 4096) };
        // Owned from here, so a failure below frees the page (Drop).
        let mut w = HostWords { host: p as *mut u32, dev: 0 };
        // SAFETY: `p` was allocated with DEVICEMAP above.
        check(unsafe { cu::cuMemHostGetDevicePointer_v2(&mut w.dev, p, 0) }, "cuMemHostGetDevicePointer")?;
        Ok(w)
    }

    fn read(&self, i: usize) -> u32 {
        // SAFETY: in bounds of the 4 KiB allocation; volatile because the GPU writes it.
        unsafe { std::ptr::read_volatile(self.host.add(i)) }
    }

    /// The i-th u64 of the page (the kernels store descriptors there).
    fn read64(&self, i: usize) -> u64 {
        // SAFETY: i < 512 keeps it inside the 4 KiB page; volatile because the GPU writes it.
        unsafe { std::ptr::read_volatile((self.host as *const u64).add(i)) }
    }

    /// Where the collective counters are copied (see COUNTS).
    fn counts_ptr(&self) -> *mut std::ffi::c_void {
        // SAFETY: COUNTS + 4 u64 = 3104 bytes, inside the 4 KiB page.
        unsafe { (self.host as *mut u64).add(Self::COUNTS) as *mut std::ffi::c_void }
    }

    /// Where the value peers' poison words get lives (see POISON_SRC).
    fn poison_src(&self) -> *const std::ffi::c_void {
        // SAFETY: 3204 bytes, inside the 4 KiB page.
        unsafe { self.host.add(Self::POISON_SRC) as *const std::ffi::c_void }
    }

    fn write(&self, i: usize, v: u32) {
        // SAFETY: as above; the GPU polls it with volatile loads.
        unsafe { std::ptr::write_volatile(self.host.add(i), v) }
    }
}

impl Drop for HostWords {
    fn drop(&mut self) {
        // SAFETY: frees the allocation made in `new`; no kernel runs any more.
        unsafe { cu::cuMemFreeHost(self.host as *mut std::ffi::c_void) };
    }
}

struct Ordering_ {
    /// The stream of the previous launch (None before the first; 0 is the legacy default
    /// stream, a stream like any other here).
    last_stream: Option<u64>,
    free_events: Vec<CUevent>,
    /// Recorded right after every collective launch that is not being captured into a
    /// graph: complete once every collective queued so far has finished (each is ordered
    /// after the previous one), whatever else the streams hold after them. send/recv
    /// kernels, on their own streams, are not behind it. None before the first launch.
    collectives_end: Option<CUevent>,
    /// The event `collectives_end` is recorded into (owned; destroyed in Drop).
    end_event: CUevent,
}

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
    /// Ranks of this group on this rank's GPU, itself included (1: a GPU of its own).
    pub gpu_sharers: u32,
}

struct Shared {
    dev: Arc<Device>,
    words: HostWords,
    /// The first error that made the group unusable (timeouts, aborts, dead peers).
    poisoned: Mutex<Option<Error>>,
    stop: AtomicBool,
    /// Every local peer's poison word (its block + POISON_OFF, as mapped here); not this
    /// rank's own.
    peer_poison: Vec<u64>,
    /// A stream of our own for the copies into `peer_poison` (never blocked by a kernel).
    poison_stream: CUstream,
    /// Set once this rank has poisoned its peers.
    peers_poisoned: AtomicBool,
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
    fn poison_peers(&self, culprit: usize) {
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
            let r = unsafe { cu::cuMemcpyHtoDAsync_v2(dst, src, 4, self.poison_stream) };
            if r != cu::CUresult::CUDA_SUCCESS {
                tracing::warn!("rsccl: could not poison a local peer's block after an abort ({r:?}); it stops at its own timeout");
            }
        }
    }
}

// SAFETY: HostWords is a pointer to pinned memory valid for the engine's life, accessed with
// volatile loads/stores only; the rest is Sync already.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

pub struct CudaEngine {
    sh: Arc<Shared>,
    /// Freed in Drop only if shutdown drained the GPU work (else deliberately leaked).
    /// The pool's heap holds it too while torch holds pool memory.
    pool: std::mem::ManuallyDrop<Arc<SymmetricPool>>,
    heap: Option<Arc<Heap>>,
    inplace_min: u64,
    /// The kernels' counters as last read (returned during graph capture): in-place
    /// collectives and bytes, all collectives and bytes (see STATS_OFF).
    last_counts: Mutex<[u64; 4]>,
    kernels: std::mem::ManuallyDrop<Kernels>,
    undrained: AtomicBool,
    internal: CUstream,
    order: Mutex<Ordering_>,
    base: Args,
    /// Blocks of every collective kernel: cuda_blocks, or fewer where ranks share a GPU
    /// (`grids_that_fit`).
    blocks: u32,
    /// Ranks of this group on this rank's GPU (itself included; 1 unless allow_shared_gpu).
    gpu_sharers: u32,
    one_shot_max: usize,
    sync_on_caller: bool,
    local_ranks: Vec<usize>,
    collectives: std::sync::atomic::AtomicU64,
    watchdog: Mutex<Option<JoinHandle<()>>>,
    timeout: Duration,
    /// send/recv: a stream per (peer, direction), index 2 * peer + (1 for recv); null for
    /// this rank itself.
    p2p_streams: Vec<CUstream>,
    inbox_off: u64,
    chunk: u64,
    p2p_blocks: u32,
    p2p_bytes: usize,
}

// SAFETY: the raw handles (stream, events) are driver objects usable from any thread; all
// mutable state is behind mutexes or atomics.
unsafe impl Send for CudaEngine {}
// SAFETY: as above.
unsafe impl Sync for CudaEngine {}

/// The engine an event came from: where it goes back when dropped, and what a wait on it
/// that ran past the group timeout means for the group.
pub trait EventHome: Send + Sync {
    fn recycle(&self, ev: CUevent);
    /// A CPU wait for this engine's collective gave up after the group timeout: the error
    /// to raise (the engine may abort the group, as the NCCL engine does).
    fn wait_timed_out(&self) -> Error;
}

/// An event that marks the end of an asynchronous collective (of rsccl's CUDA engine or
/// the NCCL engine); goes back to its engine's pool when dropped.
pub struct CudaEvent {
    ev: CUevent,
    home: std::sync::Weak<dyn EventHome>,
    dev: Arc<Device>,
    /// Bound of a CPU wait (the group timeout).
    timeout: Duration,
}

// SAFETY: an event handle may be used from any thread.
unsafe impl Send for CudaEvent {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    pub(crate) fn new(ev: CUevent, home: std::sync::Weak<dyn EventHome>, dev: Arc<Device>, timeout: Duration) -> CudaEvent {
        CudaEvent { ev, home, dev, timeout }
    }

    /// Whether the collective has finished on the GPU.
    pub fn query(&self) -> Result<bool> {
        let _ctx = self.dev.bind()?;
        // SAFETY: valid event handle.
        let r = unsafe { cu::cuEventQuery(self.ev) };
        match r {
            cu::CUresult::CUDA_SUCCESS => Ok(true),
            cu::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => check(e, "cuEventQuery").map(|_| false),
        }
    }

    /// Make `stream` wait for the collective (no CPU wait).
    pub fn wait_on(&self, stream: u64) -> Result<()> {
        let _ctx = self.dev.bind()?;
        // SAFETY: valid event; `stream` is a live stream of this context (the caller's).
        check(unsafe { cu::cuStreamWaitEvent(stream as CUstream, self.ev, 0) }, "cuStreamWaitEvent")
    }

    /// Block the CPU until the collective finished, at most the group timeout (polling,
    /// not cuEventSynchronize, so a collective that never ends cannot hang the caller).
    pub fn synchronize(&self) -> Result<()> {
        let _ctx = self.dev.bind()?;
        let deadline = Instant::now() + self.timeout;
        let mut pause = Duration::from_micros(5);
        loop {
            // SAFETY: valid event handle.
            match unsafe { cu::cuEventQuery(self.ev) } {
                cu::CUresult::CUDA_SUCCESS => return Ok(()),
                cu::CUresult::CUDA_ERROR_NOT_READY if Instant::now() < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_micros(500));
                }
                cu::CUresult::CUDA_ERROR_NOT_READY => {
                    return Err(match self.home.upgrade() {
                        Some(h) => h.wait_timed_out(),
                        None => Error::Timeout(format!(
                            "a CUDA collective did not finish within the group timeout ({:.1} s)",
                            self.timeout.as_secs_f64()
                        )),
                    })
                }
                e => return check(e, "cuEventQuery"),
            }
        }
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        match self.home.upgrade() {
            Some(e) => e.recycle(self.ev),
            None => {
                if let Ok(_ctx) = self.dev.bind() {
                    // SAFETY: the engine is gone, so this event is ours alone.
                    unsafe { cu::cuEventDestroy_v2(self.ev) };
                }
            }
        }
    }
}

impl EventHome for CudaEngine {
    fn recycle(&self, ev: CUevent) {
        self.order.lock().free_events.push(ev);
    }

    fn wait_timed_out(&self) -> Error {
        // rsccl's kernels time out by themselves and say so (health); the CPU wait also
        // covers work of others queued before the collective, so this alone does not
        // make the group unusable.
        Error::Timeout(format!("a CUDA collective did not finish within the group timeout ({:.1} s)", self.timeout.as_secs_f64()))
    }
}

impl CudaEngine {
    /// Build the engine of local rank `mesh.local_index()` on `device`: map the pool with
    /// every local peer, load the kernels, and (if configured) run a warm-up of every
    /// kernel family. Blocks until every local rank has done the same, or the deadline.
    pub fn create(
        device: i32,
        mesh: Arc<LocalMesh>,
        local_ranks: Vec<usize>,
        cfg: &Config,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<Arc<CudaEngine>> {
        let n = mesh.size();
        if n > MAX_RANKS {
            return Err(Error::Config(format!("rsccl's CUDA kernels support up to {MAX_RANKS} GPUs per host, this group has {n}")));
        }
        if cfg.cuda_blocks > MAX_BLOCKS {
            return Err(Error::Config(format!("cuda_blocks = {} is over {MAX_BLOCKS}", cfg.cuda_blocks)));
        }
        let dev = Arc::new(Device::open(device)?);
        // The GPUs of a group must be distinct unless allow_shared_gpu: two ranks on one GPU is
        // usually a set-up mistake (a missing torch.cuda.set_device). With the option, ranks
        // that share a GPU size their grids to a share of it (`grids_that_fit`).
        let bus = dev.pci_bus_id()?;
        let mut msg = [0u8; 64];
        msg[..4].copy_from_slice(b"RSD1");
        let b = bus.as_bytes();
        msg[4..4 + b.len().min(40)].copy_from_slice(&b[..b.len().min(40)]);
        let got = mesh.all_gather(&msg, None, deadline)?;
        if !cfg.allow_shared_gpu {
            for (j, (m, _)) in got.iter().enumerate() {
                for (k, (m2, _)) in got.iter().enumerate().skip(j + 1) {
                    if m[4..44] == m2[4..44] {
                        return Err(Error::InvalidArgument(format!(
                            "group ranks {} and {} both use the GPU at PCI {}: call torch.cuda.set_device(local_rank) \
                             before init_process_group/new_group, so each rank has its own GPU (or set allow_shared_gpu \
                             / RSCCL_ALLOW_SHARED_GPU=1 to run several ranks on one GPU, for tests and debugging)",
                            local_ranks[j],
                            local_ranks[k],
                            String::from_utf8_lossy(&m[4..44]).trim_end_matches('\0')
                        )));
                    }
                }
            }
        }
        let me = mesh.local_index();
        let sharers = got.iter().filter(|(m, _)| m[4..44] == got[me].0[4..44]).count() as u32;
        let kernels = Kernels::load(&dev)?;
        let (blocks, p2p_blocks) = agree_grids(&dev, &kernels, &mesh, &local_ranks, cfg, sharers, deadline)?;
        // A block: the collectives' part (control and staging, cuda_buffer_bytes), the
        // send/recv inbox (cuda_p2p_bytes, split by the effective send/recv grid), then
        // the pool.
        let chunk = p2p_chunk(cfg.cuda_p2p_bytes, n, p2p_blocks)?;
        let inbox_off = cfg.cuda_buffer_bytes.div_ceil(4096) * 4096;
        let pool = Arc::new(SymmetricPool::create(
            dev.clone(),
            &mesh,
            inbox_off + cfg.cuda_p2p_bytes,
            cfg.cuda_pool_bytes,
            cfg.max_cuda_va_bytes,
            deadline,
        )?);
        let spb = stage_per_block(cfg.cuda_buffer_bytes, blocks);
        if spb < 4096 {
            return Err(Error::Config(format!(
                "cuda_buffer_bytes = {} leaves {spb} bytes of staging per block for {blocks} blocks (cuda_blocks = {}): \
                 raise cuda_buffer_bytes or lower cuda_blocks",
                cfg.cuda_buffer_bytes, cfg.cuda_blocks
            )));
        }
        let _ctx = dev.bind()?;
        let words = HostWords::new()?;
        let mut free_events = Vec::new();
        // One more than the pool of 8: the last becomes `Ordering_::end_event`.
        for _ in 0..9 {
            match new_event() {
                Ok(e) => free_events.push(e),
                Err(err) => {
                    // SAFETY: events created just above, used by nothing yet.
                    free_events.into_iter().for_each(|e| unsafe {
                        cu::cuEventDestroy_v2(e);
                    });
                    return Err(err);
                }
            }
        }
        let mut internal: CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; a non-blocking stream does not sync with stream 0.
        if let Err(err) =
            check(unsafe { cu::cuStreamCreate(&mut internal, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }, "cuStreamCreate")
        {
            // SAFETY: as above.
            free_events.into_iter().for_each(|e| unsafe {
                cu::cuEventDestroy_v2(e);
            });
            return Err(err);
        }
        let mut poison_stream: CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; a non-blocking stream.
        if let Err(err) = check(
            unsafe { cu::cuStreamCreate(&mut poison_stream, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
            "cuStreamCreate (abort)",
        ) {
            // SAFETY: the events and stream created above, used by nothing yet.
            unsafe {
                free_events.into_iter().for_each(|e| {
                    cu::cuEventDestroy_v2(e);
                });
                cu::cuStreamDestroy_v2(internal);
            }
            return Err(err);
        }
        // One stream per (peer, direction) for send/recv: index 2 * peer + (1 for recv).
        let mut p2p_streams: Vec<CUstream> = vec![std::ptr::null_mut(); 2 * n];
        for (k, st) in p2p_streams.iter_mut().enumerate() {
            if k / 2 == mesh.local_index() {
                continue;
            }
            // SAFETY: out-pointer into the vector; a non-blocking stream.
            let r =
                check(unsafe { cu::cuStreamCreate(st, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }, "cuStreamCreate (send/recv)");
            if let Err(err) = r {
                // SAFETY: streams and events created above, used by nothing yet.
                unsafe {
                    p2p_streams.iter().filter(|s| !s.is_null()).for_each(|&s| {
                        cu::cuStreamDestroy_v2(s);
                    });
                    free_events.into_iter().for_each(|e| {
                        cu::cuEventDestroy_v2(e);
                    });
                    cu::cuStreamDestroy_v2(internal);
                    cu::cuStreamDestroy_v2(poison_stream);
                }
                return Err(err);
            }
        }
        let mut peer = [0u64; MAX_RANKS];
        for (j, p) in peer.iter_mut().enumerate().take(n) {
            *p = pool.block_addr(j);
        }
        let base = Args {
            peer,
            inp: 0,
            out: 0,
            count: 0,
            stage_per_block: spb as u64,
            err_host: words.dev + (HostWords::ERR * 4) as u64,
            abort_host: words.dev + (HostWords::ABORT * 4) as u64,
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
            desc0: 0,
            desc1: 0,
            place_in: 0,
            place_out: 0,
            rank: mesh.local_index() as u32,
            world: n as u32,
            root: 0,
            pad: 0,
        };
        let heap = (pool.pool_bytes > 0).then(|| Arc::new(Heap::new(pool.clone(), device)));
        tracing::info!(
            device,
            local_ranks = n,
            va_reserved = pool.reserved_bytes(),
            mapped_own = pool.block,
            mapped_peers = pool.block * (n - 1),
            staging = pool.pool_off,
            pool = pool.pool_bytes,
            kernel_image = kernels.cubin_bytes,
            blocks,
            p2p_blocks,
            gpu_sharers = sharers,
            "rsccl: CUDA engine ready: reserved {} MiB of GPU address space, mapped {} MiB own ({} MiB staging + {} MiB pool) and {} MiB of {} peers{}",
            pool.reserved_bytes() >> 20,
            pool.block >> 20,
            pool.pool_off >> 20,
            pool.pool_bytes >> 20,
            (pool.block * (n - 1)) >> 20,
            n - 1,
            if sharers > 1 {
                format!("; {sharers} ranks share this GPU (allow_shared_gpu): {blocks} collective and {p2p_blocks} send/recv blocks per kernel, timings are not meaningful")
            } else {
                String::new()
            }
        );
        words.write(HostWords::POISON_SRC, 1 + mesh.local_index() as u32);
        let sh = Arc::new(Shared {
            dev: dev.clone(),
            words,
            poisoned: Mutex::new(None),
            stop: AtomicBool::new(false),
            peer_poison: (0..n).filter(|&j| j != mesh.local_index()).map(|j| pool.block_addr(j) + POISON_OFF as u64).collect(),
            poison_stream,
            peers_poisoned: AtomicBool::new(false),
        });
        // From here the engine owns the events (Drop destroys them, end_event included).
        let end_event = free_events.pop().ok_or_else(|| Error::Internal("no event made".into()))?;
        let engine = Arc::new(CudaEngine {
            sh: sh.clone(),
            pool: std::mem::ManuallyDrop::new(pool),
            heap,
            inplace_min: cfg.cuda_inplace_min_bytes as u64,
            last_counts: Mutex::new([0; 4]),
            kernels: std::mem::ManuallyDrop::new(kernels),
            undrained: AtomicBool::new(false),
            internal,
            order: Mutex::new(Ordering_ { last_stream: None, free_events, collectives_end: None, end_event }),
            base,
            blocks,
            gpu_sharers: sharers,
            one_shot_max: cfg.cuda_allreduce_one_shot_max_bytes,
            sync_on_caller: cfg.cuda_sync_stream,
            local_ranks: local_ranks.clone(),
            collectives: Default::default(),
            watchdog: Mutex::new(None),
            timeout,
            p2p_streams,
            inbox_off: inbox_off as u64,
            chunk: chunk as u64,
            p2p_blocks,
            p2p_bytes: cfg.cuda_p2p_bytes,
        });
        drop(_ctx);
        let wd = {
            let sh = sh.clone();
            let mesh = mesh.clone();
            std::thread::Builder::new()
                .name("rsccl-cuda-watchdog".into())
                .spawn(move || watchdog(sh, mesh, local_ranks))
                .map_err(|e| Error::os("starting the CUDA watchdog thread", e))?
        };
        *engine.watchdog.lock() = Some(wd);
        if cfg.cuda_warmup {
            engine.warm_up()?;
        }
        Ok(engine)
    }

    /// One collective of every kernel family, on the internal stream, then wait: the
    /// first real collective finds the kernels resident and the signal pads in use.
    fn warm_up(self: &Arc<Self>) -> Result<()> {
        let stream = self.internal as u64;
        let call = |kind, dtype, op, count| CudaCall { kind, dtype, op, root: 0, inp: 0, out: 0, count, stream, asynchronous: false };
        // Zero-length calls run every barrier path without touching user memory.
        for c in [
            call(CudaKind::Barrier, DType::U8, ReduceOp::Sum, 0),
            call(CudaKind::AllReduce, DType::BF16, ReduceOp::Sum, 0),
            call(CudaKind::AllGather, DType::U8, ReduceOp::Sum, 0),
            call(CudaKind::ReduceScatter, DType::BF16, ReduceOp::Sum, 0),
            call(CudaKind::Broadcast, DType::U8, ReduceOp::Sum, 0),
            call(CudaKind::Gather, DType::U8, ReduceOp::Sum, 0),
            call(CudaKind::Scatter, DType::U8, ReduceOp::Sum, 0),
            call(CudaKind::Reduce, DType::BF16, ReduceOp::Sum, 0),
        ] {
            self.launch(&c)?;
        }
        let n = self.pool.nranks;
        let none = AllToAll { send: vec![0; n], send_bytes: vec![0; n], recv: vec![0; n], recv_bytes: vec![0; n] };
        self.launch_all_to_all(&none, stream, false)?;
        // An empty send to every peer and recv from every peer: one step each, so the
        // pairs' sequence numbers stay in step. Each is a blocking launch on the internal
        // stream, so the GPU runs them one after the other in this order on every rank;
        // that cannot deadlock because an empty send completes without its receiver (one
        // step, within the two a sender may run ahead), so every recv finds its send.
        for peer in (0..n).filter(|&p| p != self.pool.me) {
            self.launch_p2p(true, 0, 0, peer, stream, false)?;
            self.launch_p2p(false, 0, 0, peer, stream, false)?;
        }
        let _ctx = self.sh.dev.bind()?;
        // SAFETY: the internal stream is live.
        check(unsafe { cu::cuStreamSynchronize(self.internal) }, "cuStreamSynchronize (warm-up)")?;
        self.health()
    }

    /// Mark the group unusable with `err` (the first error wins) and stop this rank's
    /// queued kernels at their next wait.
    fn poison(&self, err: Error) -> Error {
        let e = self.sh.poisoned.lock().get_or_insert(err).clone();
        self.sh.words.write(HostWords::ABORT, 1);
        e
    }

    /// `poison`, for a failure found on the host side: also stop the local peers' kernels
    /// (see Shared::poison_peers for when, and why not after a clean destroy).
    fn abort_group(&self, err: Error) -> Error {
        let e = self.poison(err);
        if !self.sh.stop.load(Ordering::Acquire) {
            self.sh.poison_peers(self.pool.me);
        }
        e
    }

    /// The error that made the group unusable: an earlier one, or a timeout or abort a
    /// kernel reported.
    fn fatal(&self) -> Result<()> {
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

    /// Whether rsccl's reduce-scatter kernel reduces `dtype` with `op`.
    pub fn supports_reduce_scatter(&self, dtype: DType, op: ReduceOp) -> bool {
        self.kernels.reduce(Family::ReduceScatter, dtype, op).is_some()
    }

    /// The number of local ranks (GPUs of this host in the group).
    pub fn local_size(&self) -> usize {
        self.pool.nranks
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
    fn wait_collectives(&self) -> Result<()> {
        let _ctx = self.sh.dev.bind()?;
        let ev = {
            let o = self.order.lock();
            // The last launch is being captured (so the mismatch came from a kernel that ran
            // before the capture began, and torch synchronized the device then): nothing to
            // wait for, and querying an event is not allowed during a global-mode capture.
            if o.last_stream.is_some_and(|l| is_capturing(l).unwrap_or(true)) {
                return Ok(());
            }
            o.collectives_end
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
    fn descriptors(&self, peer: usize) -> Result<(String, String)> {
        let w = |i: usize| self.sh.words.read64(i);
        Ok((describe(w(4), w(5)), describe(w(8 + 2 * peer), w(9 + 2 * peer))))
    }

    /// Launch one collective. Returns the end event for an asynchronous call (the Work
    /// waits on it); a blocking call is ordered before the caller's later work already.
    pub fn launch(self: &Arc<Self>, c: &CudaCall) -> Result<Option<CudaEvent>> {
        // A group that failed (timeout, dead peer) runs nothing more. A mismatch that a
        // kernel reported is raised after this launch: ranks notice it at different calls
        // (the GPU reports it asynchronously), so every rank must still launch the same
        // kernels for the group to stay in step.
        self.fatal()?;
        let ev = self.launch_inner(c, None)?;
        self.checked(ev)
    }

    /// Launch one all_to_all (see `AllToAll`; every list has one entry per local rank).
    pub fn launch_all_to_all(self: &Arc<Self>, x: &AllToAll, stream: u64, asynchronous: bool) -> Result<Option<CudaEvent>> {
        let n = self.pool.nranks;
        if [&x.send, &x.send_bytes, &x.recv, &x.recv_bytes].iter().any(|v| v.len() != n) {
            return Err(Error::InvalidArgument(format!("all_to_all needs one chunk per rank of the group ({n})")));
        }
        self.fatal()?;
        let ev = self.launch_inner(&CudaCall::bare(CudaKind::AllToAll, 0, stream, asynchronous), Some(x))?;
        self.checked(ev)
    }

    /// Launch one send (`send`) or recv of `bytes` at `ptr` with local rank `peer`, on that
    /// (peer, direction)'s own stream, after the work queued on the caller's `stream`.
    /// Returns the end event of an asynchronous call; a blocking one makes `stream` wait.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_p2p(
        self: &Arc<Self>,
        send: bool,
        ptr: u64,
        bytes: u64,
        peer: usize,
        stream: u64,
        asynchronous: bool,
    ) -> Result<Option<CudaEvent>> {
        let (n, me) = (self.pool.nranks, self.pool.me);
        let what = if send { "send to" } else { "recv from" };
        if peer >= n || peer == me {
            return Err(Error::InvalidArgument(format!("CUDA {what} local rank {peer}: not a peer of local rank {me} in a group of {n}")));
        }
        self.fatal()?;
        let kind = if send { CudaKind::Send } else { CudaKind::Recv };
        let mut x = P2pArgs { a: self.base, inbox_off: self.inbox_off, chunk: self.chunk };
        if send {
            x.a.inp = ptr;
        } else {
            x.a.out = ptr;
        }
        x.a.count = bytes;
        x.a.root = peer as u32;
        x.a.desc0 = kind.code();
        let func = if send { self.kernels.send } else { self.kernels.recv };
        let target = self.p2p_streams[2 * peer + (!send) as usize] as u64;
        let ev = {
            let _ctx = self.sh.dev.bind()?;
            let mut o = self.order.lock();
            if self.sh.stop.load(Ordering::Acquire) {
                return Err(Error::Aborted("the group was destroyed".into()));
            }
            self.join(&mut o, stream, target)?;
            let mut arg_ptr = &mut x as *mut P2pArgs as *mut std::ffi::c_void;
            // SAFETY: `func` takes one `P2pArgs` by value (same layout as the source's
            // struct); `arg_ptr` points at it for the call; 512 threads match the bounds.
            check(
                unsafe {
                    cu::cuLaunchKernel(
                        func,
                        self.p2p_blocks,
                        1,
                        1,
                        THREADS,
                        1,
                        1,
                        0,
                        target as CUstream,
                        &mut arg_ptr,
                        std::ptr::null_mut(),
                    )
                },
                &format!("launching rsccl's CUDA {}", kind.name()),
            )?;
            let ev = o.free_events.pop().map(Ok).unwrap_or_else(new_event)?;
            // SAFETY: valid event and stream.
            check(unsafe { cu::cuEventRecord(ev, target as CUstream) }, "cuEventRecord")?;
            if asynchronous {
                {
                    let home: std::sync::Weak<dyn EventHome> = Arc::downgrade(self) as std::sync::Weak<dyn EventHome>;
                    Some(CudaEvent::new(ev, home, self.sh.dev.clone(), self.timeout))
                }
            } else {
                // SAFETY: valid event and caller stream; the wait captures the record.
                let r = check(unsafe { cu::cuStreamWaitEvent(stream as CUstream, ev, 0) }, "cuStreamWaitEvent");
                o.free_events.push(ev);
                r?;
                None
            }
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

    /// After a launch: raise an error a kernel reported, once the launched work is done
    /// with the caller's tensors.
    fn checked(&self, ev: Option<CudaEvent>) -> Result<Option<CudaEvent>> {
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

    fn launch_inner(self: &Arc<Self>, c: &CudaCall, a2a: Option<&AllToAll>) -> Result<Option<CudaEvent>> {
        let mut family = None;
        let func = match c.kind {
            CudaKind::AllReduce => {
                let fam = choose_allreduce(c.count as usize * c.dtype.size(), self.pool.nranks, self.one_shot_max);
                family = Some(fam);
                self.kernels.reduce(fam, c.dtype, c.op)
            }
            CudaKind::ReduceScatter => self.kernels.reduce(Family::ReduceScatter, c.dtype, c.op),
            CudaKind::AllGather => Some(self.kernels.all_gather),
            CudaKind::Broadcast => Some(self.kernels.broadcast),
            CudaKind::Gather => Some(self.kernels.gather),
            CudaKind::Scatter => Some(self.kernels.scatter),
            CudaKind::Reduce => self.kernels.reduce(Family::Reduce, c.dtype, c.op),
            CudaKind::AllToAll if a2a.is_some() => Some(self.kernels.all_to_all),
            CudaKind::AllToAll | CudaKind::Send | CudaKind::Recv => {
                return Err(Error::Internal(format!("{} is launched through its own entry point", c.kind.name())))
            }
            CudaKind::Barrier | CudaKind::Invalid => Some(self.kernels.barrier),
        }
        .ok_or_else(|| {
            Error::InvalidType(format!("rsccl's CUDA {} does not support {} with {}", c.kind.name(), c.dtype.name(), c.op.name()))
        })?;
        let mut a = self.base;
        a.inp = c.inp;
        a.out = c.out;
        a.count = c.count;
        a.root = c.root as u32;
        a.desc0 = c.kind.code() | ((c.dtype as u64) << 8) | ((c.op as u64) << 16) | ((c.root as u64) << 32);
        a.desc1 = c.count;
        if matches!(c.kind, CudaKind::Barrier | CudaKind::Invalid | CudaKind::AllToAll) {
            a.desc0 = c.kind.code();
            a.desc1 = 0;
        }
        let mut tail = a2a.map(|x| {
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
            (a.place_in, a.place_out) = placement(c, family, self.pool.nranks, self.inplace_min, &in_pool);
        }
        let _ctx = self.sh.dev.bind()?;
        let caller = c.stream;
        let internal = self.internal as u64;
        let target = if c.asynchronous || !self.sync_on_caller { internal } else { caller };
        let mut o = self.order.lock();
        // Shutdown sets `stop` under this lock: no launch starts after it.
        if self.sh.stop.load(Ordering::Acquire) {
            return Err(Error::Aborted("the group was destroyed".into()));
        }
        if target != caller {
            // The internal stream waits for everything the caller queued before the call
            // (and joins the caller's graph capture, if any).
            self.join(&mut o, caller, target)?;
        }
        // The previous rsccl kernel ran on another stream: order this one after it. (Under
        // graph capture only streams of the same capture can be joined, which the caller's
        // stream tells; torch synchronizes the device before capture begins.)
        if let Some(last) = o.last_stream {
            if last != target && last != caller && is_capturing(last)? == is_capturing(caller)? {
                self.join(&mut o, last, target)?;
            }
        }
        let mut arg_ptr = match tail.as_mut() {
            Some(t) => t as *mut A2aArgs as *mut std::ffi::c_void,
            None => &mut a as *mut Args as *mut std::ffi::c_void,
        };
        // SAFETY: `func` takes one `Args` (or, for all_to_all, one `A2aArgs`) by value, same
        // layout as the source's struct; `arg_ptr` points at it for the call; the grid
        // matches every kernel's launch bounds.
        check(
            unsafe {
                cu::cuLaunchKernel(func, self.blocks, 1, 1, THREADS, 1, 1, 0, target as CUstream, &mut arg_ptr, std::ptr::null_mut())
            },
            &format!("launching rsccl's CUDA {}", c.kind.name()),
        )?;
        o.last_stream = Some(target);
        self.collectives.fetch_add(1, Ordering::Relaxed);
        // Mark the end of the collectives queued so far (health waits on it). Not while
        // capturing: a captured record cannot be queried, and a captured kernel runs only
        // at replay; the event then keeps marking the last launch that really ran (torch
        // synchronizes the device before a capture begins). An error here (the legacy
        // stream during a global-mode capture) counts as capturing.
        if !is_capturing(target).unwrap_or(true) {
            // SAFETY: our own event and a live stream of this context.
            check(unsafe { cu::cuEventRecord(o.end_event, target as CUstream) }, "cuEventRecord (end of collectives)")?;
            o.collectives_end = Some(o.end_event);
        }
        if target == caller {
            return Ok(None);
        }
        let ev = o.free_events.pop().map(Ok).unwrap_or_else(new_event)?;
        // SAFETY: valid event and stream.
        check(unsafe { cu::cuEventRecord(ev, target as CUstream) }, "cuEventRecord")?;
        if c.asynchronous {
            let home: std::sync::Weak<dyn EventHome> = Arc::downgrade(self) as std::sync::Weak<CudaEngine>;
            return Ok(Some(CudaEvent::new(ev, home, self.sh.dev.clone(), self.timeout)));
        }
        // SAFETY: valid event and caller stream; the wait captures the event's current
        // state, so the event can be reused right away.
        let r = check(unsafe { cu::cuStreamWaitEvent(caller as CUstream, ev, 0) }, "cuStreamWaitEvent");
        o.free_events.push(ev);
        r.map(|_| None)
    }

    /// Make `to` wait for the work queued on `from` so far.
    fn join(&self, o: &mut Ordering_, from: u64, to: u64) -> Result<()> {
        let ev = o.free_events.pop().map(Ok).unwrap_or_else(new_event)?;
        // SAFETY: valid event and streams; reusing the event after the wait is enqueued is
        // allowed (the wait captured the record).
        let r = unsafe {
            check(cu::cuEventRecord(ev, from as CUstream), "cuEventRecord")
                .and_then(|_| check(cu::cuStreamWaitEvent(to as CUstream, ev, 0), "cuStreamWaitEvent"))
        };
        o.free_events.push(ev);
        r
    }

    /// The kernels' counters (STATS_OFF), counted on the GPU so that CUDA graph replays
    /// count too. Read with an asynchronous copy into the pinned page, on the internal
    /// stream ordered after the last launch (so after every kernel of the group), then
    /// polled: no device-wide synchronization, so other work and other threads' graph
    /// captures are left alone. While the internal stream or the last launch's stream is
    /// being captured the last values read are returned instead.
    fn kernel_counts(&self) -> [u64; 4] {
        let read = || -> Result<[u64; 4]> {
            let _ctx = self.sh.dev.bind()?;
            let internal = self.internal as u64;
            // An error (the legacy stream during a global-mode capture) counts as capturing.
            let capturing = |s: u64| is_capturing(s).unwrap_or(true);
            let ev = {
                let mut o = self.order.lock();
                if capturing(internal) {
                    return Err(Error::Internal("capturing".into()));
                }
                if let Some(last) = o.last_stream.filter(|&l| l != internal) {
                    if capturing(last) {
                        return Err(Error::Internal("capturing".into()));
                    }
                    self.join(&mut o, last, internal)?;
                }
                let ev = o.free_events.pop().map(Ok).unwrap_or_else(new_event)?;
                let dst = self.sh.words.counts_ptr();
                // SAFETY: copies 32 bytes of our own block (mapped for this device) into the
                // pinned page (32 free bytes at COUNTS), on our live stream; the event is ours.
                let r = unsafe {
                    check(
                        cu::cuMemcpyDtoHAsync_v2(dst, self.pool.block_addr(self.pool.me) + STATS_OFF as u64, 32, self.internal),
                        "cuMemcpyDtoHAsync (collective counters)",
                    )
                    .and_then(|_| check(cu::cuEventRecord(ev, self.internal), "cuEventRecord"))
                };
                if let Err(e) = r {
                    o.free_events.push(ev);
                    return Err(e);
                }
                ev
            };
            let deadline = Instant::now() + self.timeout + Duration::from_secs(1);
            let done = loop {
                // SAFETY: valid event.
                match unsafe { cu::cuEventQuery(ev) } {
                    cu::CUresult::CUDA_SUCCESS => break Ok(()),
                    cu::CUresult::CUDA_ERROR_NOT_READY if Instant::now() < deadline => std::thread::sleep(Duration::from_micros(20)),
                    cu::CUresult::CUDA_ERROR_NOT_READY => break Err(Error::Timeout("reading the collective counters".into())),
                    e => break check(e, "cuEventQuery"),
                }
            };
            self.order.lock().free_events.push(ev);
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
            gpu_sharers: self.gpu_sharers,
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

fn new_event() -> Result<CUevent> {
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    check(unsafe { cu::cuEventCreate(&mut e, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, "cuEventCreate")?;
    Ok(e)
}

fn watchdog(sh: Arc<Shared>, mesh: Arc<LocalMesh>, local_ranks: Vec<usize>) {
    // Read while the connections are up: a peer that died can no longer be asked.
    let pids: Vec<Option<u32>> = (0..mesh.size()).map(|j| mesh.peer_pid(j)).collect();
    while !sh.stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(50));
        let gone = mesh.gone();
        if let Some(&j) = gone.first() {
            let mut p = sh.poisoned.lock();
            if p.is_none() {
                let pid = pids.get(j).copied().flatten().map(|pid| format!("pid {pid}, ")).unwrap_or_default();
                *p = Some(Error::PeerFailure(format!(
                    "rank {} ({pid}local rank {j}) is gone: its process exited or closed its connection",
                    local_ranks.get(j).copied().unwrap_or(j)
                )));
            }
            drop(p);
            // Kernels poll this word while they wait and return (see the kernel source).
            sh.words.write(HostWords::ABORT, 1);
            // The other peers see the death themselves within one poll; this stops their
            // kernels that wait on this rank's sooner, naming the dead rank as the cause.
            sh.poison_peers(j);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allreduce_algorithm_follows_threshold() {
        assert_eq!(choose_allreduce(1024, 4, 256 << 10), Family::OneShot);
        assert_eq!(choose_allreduce(256 << 10, 4, 256 << 10), Family::OneShot);
        assert_eq!(choose_allreduce((256 << 10) + 2, 4, 256 << 10), Family::TwoShot);
        assert_eq!(choose_allreduce(2, 2, 1), Family::TwoShot);
        // Auto: the measured crossover per number of ranks.
        assert_eq!(choose_allreduce(2 << 20, 2, 0), Family::OneShot);
        assert_eq!(choose_allreduce(4 << 20, 2, 0), Family::TwoShot);
        assert_eq!(choose_allreduce(1 << 20, 4, 0), Family::TwoShot);
        assert_eq!(choose_allreduce(512 << 10, 4, 0), Family::OneShot);
        assert_eq!(choose_allreduce(512 << 10, 8, 0), Family::TwoShot);
    }

    #[test]
    fn placement_offers_only_eligible_pool_buffers() {
        // A pool at [1000, 1000 + 100 MiB) of a block starting at 0.
        let pool = |ptr: u64, len: u64| (ptr >= 1000 && ptr + len <= 1000 + (100 << 20)).then_some(ptr);
        let call = |kind, count, inp, out| CudaCall {
            kind,
            dtype: DType::BF16,
            op: ReduceOp::Sum,
            root: 0,
            inp,
            out,
            count,
            stream: 0,
            asynchronous: false,
        };
        let mib = 1u64 << 20;
        let two = Some(Family::TwoShot);
        // all_reduce: both buffers in the pool, two-shot, over the threshold.
        let ar = call(CudaKind::AllReduce, 4 * mib / 2, 2048, 2048);
        assert_eq!(placement(&ar, two, 4, mib, &pool), (2049, 2049));
        assert_eq!(placement(&ar, Some(Family::OneShot), 4, mib, &pool), (0, 0));
        assert_eq!(placement(&ar, two, 4, 8 * mib, &pool), (0, 0), "under the threshold");
        assert_eq!(placement(&call(CudaKind::AllReduce, 4 * mib / 2, 2048, 1 << 40), two, 4, mib, &pool), (0, 0));
        // A buffer that runs past the end of the pool is not in it.
        assert_eq!(placement(&call(CudaKind::AllReduce, 60 * mib, 2048, 2048), two, 4, mib, &pool), (0, 0));
        // reduce_scatter offers its input (world x count elements), all_gather and
        // broadcast their output.
        let rs = call(CudaKind::ReduceScatter, mib, 4096, 1 << 40);
        assert_eq!(placement(&rs, None, 4, mib, &pool), (4097, 0));
        let ag = call(CudaKind::AllGather, mib, 1 << 40, 4096);
        assert_eq!(placement(&ag, None, 4, 4 * mib, &pool), (0, 4097), "the output is 4 MiB");
        let bc = call(CudaKind::Broadcast, 2 * mib, 8192, 8192);
        assert_eq!(placement(&bc, None, 2, mib, &pool), (0, 8193));
        assert_eq!(placement(&call(CudaKind::Barrier, 0, 0, 0), None, 2, 0, &pool), (0, 0));
        assert_eq!(message_bytes(CudaKind::ReduceScatter, 10, 2, 4), 80);
    }

    #[test]
    fn staging_split_fits_the_buffer() {
        for (buf, blocks) in [(32usize << 20, 32u32), (2 << 20, 64), (4 << 20, 1)] {
            let spb = stage_per_block(buf, blocks);
            assert!(spb > 0 && spb % 256 == 0);
            assert!(STAGE_OFF + 2 * blocks as usize * spb <= buf);
        }
    }

    #[test]
    fn args_layout_matches_the_kernel_source() {
        // 16 peers + 11 u64 fields + 4 u32 fields, as in `struct Args` of the .cu file.
        assert_eq!(std::mem::size_of::<Args>(), 16 * 8 + 11 * 8 + 16);
        let src = super::super::kernels::SOURCE;
        assert!(src.contains("u64 desc1;") && src.contains("u64 place_in;") && src.contains("u64 place_out;"));
        assert!(src.contains(&format!("#define STAGE_OFF {STAGE_OFF}")) && src.contains(&format!("#define STATS_OFF {STATS_OFF}")));
        // The all_to_all and send/recv blocks: Args then their own fields.
        assert_eq!(std::mem::size_of::<A2aArgs>(), std::mem::size_of::<Args>() + 4 * MAX_RANKS * 8);
        assert_eq!(std::mem::size_of::<P2pArgs>(), std::mem::size_of::<Args>() + 16);
        assert!(src.contains("struct A2aArgs {\n    Args a;\n    u64 send[MAX_RANKS];\n    u64 send_n[MAX_RANKS];\n    u64 recv[MAX_RANKS];\n    u64 recv_n[MAX_RANKS];"));
        assert!(src.contains("struct P2pArgs {\n    Args a;\n    u64 inbox_off;"));
    }

    #[test]
    fn control_areas_do_not_overlap() {
        // The block's control areas as the kernel source defines them, in order, each with
        // its size: flags, stats (+ poison word), counters, descriptors, send/recv, tables.
        let src = super::super::kernels::SOURCE;
        let def = |name: &str| -> usize {
            let line = src.lines().find(|l| l.starts_with(&format!("#define {name} "))).expect(name);
            line.split_whitespace().nth(2).unwrap().parse().expect(name)
        };
        let (max_blocks, max_ranks) = (MAX_BLOCKS as usize, MAX_RANKS);
        let areas = [
            (0, max_blocks * max_ranks * 4),
            (STATS_OFF, 256 + 4),
            (def("CTR_OFF"), max_blocks * 8),
            (def("DESC_OFF"), 2 * max_blocks * max_ranks * def("DESC_WORDS") * 8),
            (def("P2P_OFF"), 4 * 4096 + max_blocks * max_ranks * 2 * 8),
            (def("A2A_OFF"), 2 * max_blocks * 2 * max_ranks * 8),
        ];
        for w in areas.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{:?} overlaps {:?}", w[0], w[1]);
        }
        let last = areas[areas.len() - 1];
        assert!(last.0 + last.1 <= STAGE_OFF);
        assert!(src.contains("#define POISON_OFF (STATS_OFF + 256)") && POISON_OFF == STATS_OFF + 256);
    }

    #[test]
    fn p2p_inbox_split() {
        // 16 MiB among 3 peers x 32 blocks x 2 parities: 87296 bytes (a 256 multiple).
        assert_eq!(p2p_chunk(16 << 20, 4, 32).unwrap(), ((16 << 20) / (3 * 64)) & !255);
        assert!(p2p_chunk(16 << 20, 4, 32).unwrap() * 3 * 64 <= 16 << 20);
        // One rank: one slot, never divided by zero.
        assert!(p2p_chunk(1 << 20, 1, 1).is_ok());
        let e = p2p_chunk(1 << 20, 16, 64).unwrap_err().to_string();
        assert!(e.contains("cuda_p2p_bytes") && e.contains("cuda_p2p_blocks"), "{e}");
    }

    #[test]
    fn p2p_grid_fits_beside_a_collective() {
        // H200: 132 SMs, 2 send/recv blocks of 512 threads per SM (about 52 registers), a
        // collective of 32 blocks at one per SM: 100 SMs, 200 slots for 2 x (L - 1) kernels.
        let fit = |setting, l, sms, p2p, coll, coll_sm| p2p_blocks_that_fit(setting, l, sms, p2p, coll, coll_sm);
        assert_eq!(fit(32, 2, 132, 2, 32, 1), 32, "2 kernels: the setting fits");
        assert_eq!(fit(32, 4, 132, 2, 32, 1), 32, "6 x 32 = 192 <= 200");
        assert_eq!(fit(64, 4, 132, 2, 32, 1), 33, "6 x 64 does not fit; 6 x 33 = 198 does");
        assert_eq!(fit(32, 8, 132, 2, 32, 1), 14, "14 kernels x 14 = 196 <= 200");
        assert_eq!(fit(32, 16, 132, 2, 32, 1), 6, "30 x 6 = 180");
        assert_eq!(fit(32, 4, 132, 2, 32, 2), 32, "two collective blocks per SM: 16 SMs taken");
        assert_eq!(fit(64, 8, 132, 2, 64, 1), 9, "64 collective blocks leave 68 SMs: 136 / 14");
        for (setting, l, sms, p2p, coll, coll_sm) in
            [(32, 8, 132, 2, 64, 1), (64, 4, 132, 2, 64, 1), (7, 5, 20, 3, 17, 2), (64, 16, 132, 1, 64, 1)]
        {
            let b = fit(setting, l, sms, p2p, coll, coll_sm);
            let free = (sms - coll.div_ceil(coll_sm)) * p2p;
            assert!(b <= setting);
            assert!(2 * (l as u32 - 1) * b <= free, "{setting} {l} {sms} {p2p} {coll}: {b}");
            assert!(2 * (l as u32 - 1) * (b + 1) > free || b == setting, "the most that fit");
        }
        // Nothing fits: 0 (creation fails with a message), never a wrap-around.
        assert_eq!(fit(32, 8, 16, 2, 64, 1), 0);
        assert_eq!(fit(32, 8, 132, 0, 64, 1), 0, "a send/recv kernel that cannot run at all");
        assert_eq!(fit(32, 8, 132, 2, 64, 0), 0, "a collective that cannot run at all");
        assert_eq!(fit(32, 16, 20, 2, 8, 1), 0, "30 kernels on 24 slots");
        // One rank: no send/recv, the setting stands.
        assert_eq!(fit(32, 1, 1, 1, 64, 1), 32);
        // The inbox follows the effective grid: fewer blocks, larger chunks, same capacity.
        let (eff, set) = (fit(64, 4, 132, 2, 32, 1), 64);
        let (c_eff, c_set) = (p2p_chunk(16 << 20, 4, eff).unwrap(), p2p_chunk(16 << 20, 4, set).unwrap());
        assert!(c_eff > c_set && c_eff % 256 == 0 && c_eff * 3 * 2 * eff as usize <= 16 << 20);
    }

    #[test]
    fn shared_gpu_grids_fit_in_each_ranks_share() {
        // A GPU of its own: the collective grid is the setting, send/recv as before.
        let g = |blocks, p2p, l, sms, p2p_sm, coll_sm, sharers| grids_that_fit(blocks, p2p, l, sms, p2p_sm, coll_sm, sharers);
        assert_eq!(g(64, 32, 4, 132, 2, 1, 1), (64, p2p_blocks_that_fit(32, 4, 132, 2, 64, 1)));
        assert_eq!(g(64, 32, 8, 16, 2, 1, 1), (64, 0), "unshared and too small: refused, as before");
        // H100 (132 SMs), 2 send/recv and 1 collective block per SM: 2 ranks get 66 SMs
        // each, 4 get 33, 8 get 16 (the measured-safe 4 x 8 and 8 x 4 blocks are below these).
        assert_eq!(g(64, 32, 2, 132, 2, 1, 2), (64, 2), "66 SMs: 1 for send/recv, 64 collective, 2 left");
        assert_eq!(g(64, 32, 4, 132, 2, 1, 4), (30, 1), "33 SMs: 3 for 6 send/recv kernels");
        assert_eq!(g(64, 32, 8, 132, 2, 1, 8), (9, 1), "16 SMs: 7 for 14 send/recv kernels");
        assert_eq!(g(64, 32, 16, 132, 2, 1, 16), (0, 0), "8 SMs cannot hold 30 send/recv kernels");
        assert_eq!(g(4, 32, 4, 132, 2, 1, 4), (4, (33 - 4) * 2 / 6), "a smaller setting stands");
        assert_eq!(g(64, 32, 4, 132, 0, 1, 4), (0, 0), "a send/recv kernel that cannot run");
        // The invariant: every co-located rank's collective and send/recv kernels fit on the
        // GPU together, each at least one block, collective blocks taking whole SMs.
        for sms in [1u32, 7, 20, 78, 108, 132, 144] {
            for l in 2..=16usize {
                for sharers in 2..=l as u32 {
                    for (p2p_sm, coll_sm) in [(1, 1), (2, 1), (3, 2), (4, 1)] {
                        for (blocks, p2p) in [(64, 32), (8, 4), (1, 1)] {
                            let (c, p) = g(blocks, p2p, l, sms, p2p_sm, coll_sm, sharers);
                            if c == 0 || p == 0 {
                                assert_eq!((c, p), (0, 0));
                                continue;
                            }
                            assert!(c <= blocks && p <= p2p);
                            let sms_per_rank = c.div_ceil(coll_sm) + (2 * (l as u32 - 1) * p).div_ceil(p2p_sm);
                            assert!(sharers * sms_per_rank <= sms, "{sms} SMs, {l} ranks, {sharers} sharers: {c} + {p}");
                        }
                    }
                }
            }
        }
    }

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
