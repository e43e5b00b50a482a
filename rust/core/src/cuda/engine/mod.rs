//! The CUDA engine of a group on one host: the symmetric pool, the loaded kernels, an
//! internal stream, and its launches on them in the order cuda/order.rs keeps.
//!
//! Streams: the launch order both CUDA engines share (cuda/order.rs): a launch's target
//! stream (the caller's for blocking calls with `cuda_sync_stream = 1`, else the internal
//! one), the chain that orders every collective after the previous one (the kernels'
//! per-block counters assume it, NOTE [Lockstep blocks] in csrc_kernels/protocol.cuh),
//! and the caller's ordering after it. This engine adds, after each collective captured
//! into a graph, the references the graph takes (graphs.rs); after an eager one, nothing.
//! Each eager launch is also admitted to its device's ledger of SMs, shared by every group
//! of the process (`admit`, cuda/budget.rs, NOTE [SM budget]): it may wait there on the GPU
//! for other groups' kernels, so that the kernels in flight at once always fit.
//!
//! Errors: kernels never spin unbounded. A wait that times out, sees the abort word, or
//! finds that a peer called another collective writes a code into host-mapped memory; a
//! kernel that starts in a failed group, or while another kernel of the group runs on this
//! GPU, reports that and writes nothing (NOTE [Kernel entry] in csrc_kernels/protocol.cuh).
//! The watchdog thread reads those reports within milliseconds: by default
//! (cuda_error_teardown) a failure ends the process, as NCCL's async error handling does,
//! and the failed kernel holds its stream until then; otherwise the host raises it at the
//! next launch or when a Work is waited on. The watchdog also sets the abort word as soon
//! as a local peer process is gone, so kernels stop within milliseconds instead of running
//! into the timeout.
//!
//! The parts, by concern: `abi` (the kernels' argument blocks and error codes), `create`
//! (building the engine and agreeing on the grids), `status` (the host-mapped status page,
//! the group's failure state and its reports), `launch` (the one launch entry, every
//! kind: collectives and calls with chunks here, send/recv in `p2p`; and where the Work's
//! events come home), `copy` (collectives on the copy engines), `p2p`
//! (send/recv), `copy_p2p` (send/recv on the copy engines), `run` (the `Engine` trait), `stats`, `shutdown` (drain and teardown) and
//! `watchdog`. The pure choices (algorithm, placement,
//! grids, staging) live in `cuda::decide`. `translate` turns the op record into
//! `CudaCall` (cuda/call.rs), the one call record both device engines launch.

mod abi;
mod copy;
mod copy_p2p;
mod create;
mod graphs;
mod launch;
mod p2p;
mod run;
mod shutdown;
mod stats;
mod status;
mod translate;
mod watchdog;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use super::budget::SmShare;
pub use super::call::CudaCall;
pub use super::decide::{
    auto_one_shot_max, choose_allreduce, grids_that_fit, message_bytes, p2p_blocks_that_fit, p2p_chunk, placement, stage_per_block,
};
use super::driver::Stream;
use super::kernels::{Family, Kernel, Kernels};
use super::order::Order;
use crate::dtype::{DType, ReduceOp};
use crate::memory::device_heap::Heap;
use crate::memory::device_pool::SymmetricPool;
use abi::Args;
pub use stats::CudaStats;
use status::Shared;

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
    /// Shared with the process's other groups on this device, and with CUDA graphs that
    /// hold this group's kernels (graphs.rs).
    kernels: std::mem::ManuallyDrop<Arc<Kernels>>,
    undrained: AtomicBool,
    internal: Stream,
    order: Mutex<Order>,
    base: Args,
    /// Blocks of every collective kernel: cuda_blocks, or fewer where ranks share a GPU
    /// (`grids_that_fit`).
    blocks: u32,
    /// The group's share of its device's ledger of SMs (NOTE [SM budget]): every eager
    /// launch is admitted there (`admit`).
    sm: SmShare,
    /// Ranks of this group on this rank's GPU (itself included; 1 unless allow_shared_gpu).
    gpu_sharers: u32,
    one_shot_max: usize,
    /// cuda_low_latency_max_bytes (0: never), `decide::kernel`.
    low_latency_max: usize,
    sync_on_caller: bool,
    local_ranks: Vec<usize>,
    collectives: std::sync::atomic::AtomicU64,
    watchdog: Mutex<Option<JoinHandle<()>>>,
    timeout: Duration,
    /// send/recv: a stream per (peer, direction), index 2 * peer + (1 for recv); None for
    /// this rank itself.
    p2p_streams: Vec<Option<Stream>>,
    /// Copy-engine collectives: a stream per local rank p, for the pulls from p (this
    /// rank's own: its local copy), NOTE [Copy engines].
    copy_streams: Vec<Stream>,
    /// cuda_copy_engine_min_bytes (0: never), `decide::copy_engine`.
    copy_engine_min: u64,
    /// cuda_ring_min_bytes (0: never), `decide::ring`.
    ring_min: u64,
    inbox_off: u64,
    chunk: u64,
    p2p_blocks: u32,
    p2p_bytes: usize,
}

impl CudaEngine {
    /// Whether rsccl's reduce-scatter kernel reduces `dtype` with `op`.
    pub fn supports_reduce_scatter(&self, dtype: DType, op: ReduceOp) -> bool {
        self.kernels.get(Kernel::Reduce(Family::ReduceScatter), dtype, op).is_some()
    }

    /// The number of local ranks (GPUs of this host in the group).
    pub fn local_size(&self) -> usize {
        self.pool.nranks
    }
}
