//! The pure choices of the CUDA engines, tested without a GPU: the all_reduce algorithm
//! (one-shot vs two-shot), placement (which buffers a call offers in place), the bytes a
//! call moves, the staging split, the send/recv inbox chunk, the send/recv grid and the
//! grids of ranks that share a GPU. (Hierarchical vs flat, the NCCL engine's choice, lives
//! in nccl_engine/choice.rs.)
//!
//! And what each kind is to the CUDA engines, in one place: its count (`cuda_count`), the
//! bytes it moves (`message_bytes`), its block-per-rank buffer (`blocks_per_rank`), rsccl's
//! kernel (`kernel`), NCCL's call (`nccl_call`) and its words in mismatch messages
//! (`call_in_words`). These are the CUDA side's only
//! matches on the kind, each exhaustive: a new kind makes the compiler point here.
//!
//! What each device engine can run at all (`can_run`: the dtypes and ops it reduces) lives
//! here too, once for both engines; and whether the GPUs of a host can reach each other
//! (`check_peer_access`).

use super::call::CudaCall;
use super::kernels::{self, Family, Kernel, Shape, STAGE_OFF};
use crate::collective::Kind;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// What one rank's driver says of its GPU and a local peer's: whether its GPU can map and
/// access the peer's memory (cuDeviceCanAccessPeer). One byte each in the creation's
/// exchange (`CudaEngine::create`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Reach {
    /// The two ranks share one GPU (allow_shared_gpu): nothing to ask.
    SameGpu = 0,
    Yes = 1,
    No = 2,
    /// The peer's GPU is not visible to this process (CUDA_VISIBLE_DEVICES differs between
    /// the ranks), so its driver cannot be asked; the mapping itself will tell.
    Unknown = 3,
}

impl Reach {
    pub fn from_code(c: u8) -> Reach {
        match c {
            0 => Reach::SameGpu,
            1 => Reach::Yes,
            2 => Reach::No,
            _ => Reach::Unknown,
        }
    }
}

/// A local rank's GPU as the messages name it: the rank (in the group), the device
/// ordinal in that rank's own process, and the PCI bus id (the same in every process).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalGpu {
    pub rank: usize,
    pub ordinal: i32,
    pub bus: String,
}

impl std::fmt::Display for LocalGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} (cuda:{}, PCI {})", self.rank, self.ordinal, self.bus)
    }
}

/// Whether every local rank's GPU can reach every other's, from every rank's answers
/// (`reach[i][j]`: what rank i's driver said of its GPU reaching rank j's): rsccl's
/// kernels read and write the peers' memory directly, which needs peer access both ways.
/// The first pair that cannot is an error naming both ranks and GPUs, and what to do.
/// Every rank has every answer, so every rank raises the same error. Ranks on one GPU
/// (`SameGpu`) and peers a rank cannot see (`Unknown`) pass.
pub fn check_peer_access(gpus: &[LocalGpu], reach: &[Vec<Reach>]) -> Result<()> {
    for (i, row) in reach.iter().enumerate() {
        for (j, r) in row.iter().enumerate() {
            if i == j || *r != Reach::No {
                continue;
            }
            let (a, b) = (&gpus[i], &gpus[j]);
            // A set-up error every rank raises alike (as two ranks on one GPU): a ValueError,
            // not a driver failure that would wait to see whether a peer died.
            return Err(Error::Config(format!(
                "the GPU of {a} cannot access the memory of the GPU of {b}: the driver reports no peer access                  between them (cuDeviceCanAccessPeer; PCIe GPUs without P2P, or P2P disabled by the system, the                  driver or a VM), and rsccl's CUDA engine reads and writes the memory of the other GPUs of its host                  directly. Run the CUDA collectives of such GPUs on NCCL, which can go through host memory:                  init_process_group(backend=\"cpu:rsccl,cuda:nccl\") (or backend=\"nccl\"), or put only GPUs that                  reach each other in one rsccl group (`nvidia-smi topo -p2p r` shows which do)"
            )));
        }
    }
    Ok(())
}

/// A device engine, as far as what it can run goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceEngine {
    /// rsccl's kernels: a group on one host.
    Rsccl,
    /// NCCL: a group that spans hosts. Its hierarchical path uses rsccl's kernels inside
    /// each host only for what they reduce and runs the rest flat (nccl_engine/choice.rs),
    /// so what it runs is what NCCL runs.
    Nccl,
}

/// Whether `engine` can run a `kind` call on `dtype` with `op`, or the `InvalidType` error
/// that says what it takes (naming `rank`, the caller). Kinds that move bytes run on any
/// dtype; reductions need the engine's kernels (rsccl: its table, `kernels::check_reduces`;
/// NCCL: its types and ops), and an op defined on the dtype (`ReduceOp::check`: AVG on
/// integers would truncate).
///
/// A fact of the engine, not of the rank: every rank of a group that passed the same dtype
/// and op (as torch requires) gets the same answer. So `Group::run` asks before anything
/// is exchanged, and a call that the group's engine cannot run is refused by every rank
/// (`Engine::refuse`), leaving the group usable with no stale error.
pub fn can_run(engine: DeviceEngine, kind: Kind, dtype: DType, op: ReduceOp, rank: usize) -> Result<()> {
    if !kind.has_op() {
        return Ok(());
    }
    let named = |e: Error| Error::InvalidType(format!("{}: rank {rank} {e}", kind.name()));
    match engine {
        DeviceEngine::Rsccl => kernels::check_reduces(dtype, op).map_err(named),
        // What NCCL reduces: the NCCL columns of the dtype and reduce-op tables (dtype.rs).
        DeviceEngine::Nccl => {
            let list = |l: &mut dyn Iterator<Item = &'static str>| l.collect::<Vec<_>>().join(", ");
            if !dtype.nccl_reduces() {
                let take = list(&mut DType::ALL.iter().filter(|d| d.nccl_reduces()).map(|d| d.name()));
                return Err(named(Error::InvalidType(format!(
                    "passed {}; NCCL, which runs the CUDA collectives of a group that spans hosts, reduces {take}",
                    dtype.name()
                ))));
            }
            if !op.in_nccl() {
                let take = list(&mut ReduceOp::ALL.iter().filter(|o| o.in_nccl()).map(|o| o.name()));
                return Err(named(Error::InvalidType(format!(
                    "passed ReduceOp.{} on {}; NCCL, which runs the CUDA collectives of a group that spans hosts, reduces with {take}",
                    op.name(),
                    dtype.name()
                ))));
            }
            op.check(dtype).map_err(named)
        }
    }
}

/// The bytes per (peer slot, CUDA block, inbox slot) of the send/recv inbox: P2P_DEPTH
/// slots per peer and block (NOTE [Point to point] in csrc_kernels/send_recv.cu), or why the
/// settings leave too little.
pub fn p2p_chunk(p2p_bytes: usize, local_ranks: usize, blocks: u32) -> Result<usize> {
    let slots = local_ranks.saturating_sub(1).max(1);
    let depth = kernels::abi::P2P_DEPTH as usize;
    let chunk = (p2p_bytes / (slots * depth * blocks as usize)) & !255;
    // 2 KiB: with four slots (P2P_DEPTH 4, before 2 at a 4 KiB floor) every inbox that
    // worked before still does (1 MiB at 4 ranks and 22 blocks: 3840 bytes).
    if chunk < 2048 {
        return Err(Error::Config(format!(
            "cuda_p2p_bytes = {p2p_bytes} leaves {chunk} bytes per send/recv chunk for {slots} peers x \
             cuda_p2p_blocks = {blocks} x {depth} slots: raise cuda_p2p_bytes or lower cuda_p2p_blocks"
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

/// The one-shot limit when `cuda_allreduce_one_shot_max_bytes` is 0 (auto), by the number
/// of local ranks. From `python -m rsccl.bench --device cuda --sweep-one-shot` on 2 and 4
/// H200s (2026-11-21): at 2 ranks one-shot was faster up to 1 MiB (11.0 vs 14.1 us) and
/// even at 4 MiB (26.6 vs 26.0 us), two-shot from 16 MiB; at 4 ranks the two were within
/// noise up to 1 MiB and two-shot won from 4 MiB (33.9 vs 60.5 us). One-shot moves
/// (ranks - 1) x the message over each GPU's links, so its range shrinks with more ranks;
/// beyond 4 ranks nothing was measured yet and 256 KiB is a guess on that trend. Under CUDA
/// graphs on 4 H100s (2026-11-27, docs/performance.md, `--sweep-one-shot`) these limits still
/// pick the faster kernel or one within 0.7 us: at 2 ranks one-shot took 16.1 us against
/// two-shot's 17.6 at 1 MiB and 28.7 against 29.3 at 4 MiB; at 4 ranks 11.6 against 18.8 at
/// 256 KiB and 23.6 against 20.3 at 1 MiB.
pub fn auto_one_shot_max(local_ranks: usize) -> usize {
    match local_ranks {
        0..=2 => 2 << 20,
        3..=4 => 512 << 10,
        _ => 256 << 10,
    }
}

/// Which all_reduce kernel runs a message of `bytes` (a pure function: tested without a GPU).
/// `one_shot_max` 0 means auto (`auto_one_shot_max`). Up to `low_latency_max` (the setting
/// cuda_low_latency_max_bytes, at most LL_MAX_BYTES; 0: never) the one-shot's low-latency
/// form (NOTE [Low latency] in csrc_kernels/low_latency.cuh), where the one-shot applies at all (a
/// `one_shot_max` below it keeps two-shot). On 4 H100s under CUDA graphs (2026-11-27,
/// docs/performance.md) it took 6.5-7.3 us at 2 GPUs up to 16 KiB against the one-shot's
/// 8.2-8.7, and 8.5-9.1 at 4 GPUs against 9.4-10.4.
pub fn choose_allreduce(bytes: usize, local_ranks: usize, one_shot_max: usize, low_latency_max: usize) -> Family {
    let limit = if one_shot_max == 0 { auto_one_shot_max(local_ranks) } else { one_shot_max };
    if bytes > limit {
        Family::TwoShot
    } else if low_latency_max > 0 && bytes <= low_latency_max {
        Family::LowLatency
    } else {
        Family::OneShot
    }
}

/// The bytes a call moves per rank, as memory_stats counts them and the in-place threshold
/// compares: the all_reduce / broadcast tensor, the all_gather output, the reduce_scatter
/// input.
pub fn message_bytes(kind: Kind, count: u64, elem: usize, world: usize) -> u64 {
    match kind {
        Kind::AllReduce => count * elem as u64,
        Kind::ReduceScatter => count * (elem * world) as u64,
        Kind::AllGather | Kind::Gather | Kind::Scatter => count * world as u64,
        Kind::Broadcast => count,
        Kind::Reduce => count * elem as u64,
        Kind::Send | Kind::Recv => count,
        Kind::AllToAll | Kind::Barrier | Kind::Invalid => 0,
    }
}

/// What a CUDA call's `count` is, from the op's buffers (`inp_bytes`, `out_bytes`) and
/// its dtype's `elem` size: elements for reductions, bytes for operations that move bytes
/// (per rank where the buffer holds one block per rank), nothing for calls without a size
/// of their own.
pub fn cuda_count(kind: Kind, inp_bytes: u64, out_bytes: u64, elem: u64) -> u64 {
    match kind {
        Kind::AllReduce | Kind::Reduce => inp_bytes / elem,
        Kind::ReduceScatter => out_bytes / elem,
        Kind::AllGather | Kind::Gather | Kind::Broadcast | Kind::Send => inp_bytes,
        Kind::Scatter | Kind::Recv => out_bytes,
        Kind::Barrier | Kind::Invalid | Kind::AllToAll => 0,
    }
}

/// Which buffer of a call holds one block per rank, each the size of the other buffer:
/// the sizes the kernels cannot check, which `CudaCall::from_op` does (the host engine
/// checks its own in `check_local`). None where no such relation holds on every rank (gather and
/// scatter have it at the root only, where the front end builds that buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocks {
    Output,
    Input,
}

pub fn blocks_per_rank(kind: Kind) -> Option<Blocks> {
    match kind {
        Kind::AllGather => Some(Blocks::Output),
        Kind::ReduceScatter => Some(Blocks::Input),
        Kind::AllReduce
        | Kind::Broadcast
        | Kind::Reduce
        | Kind::Gather
        | Kind::Scatter
        | Kind::Barrier
        | Kind::Invalid
        | Kind::AllToAll
        | Kind::Send
        | Kind::Recv => None,
    }
}

/// Which of rsccl's kernels runs a call on one host (the index of the kernels' table,
/// `Kernels::get`), for a `kind` call of `count` (`CudaCall::count`) of `elem`-byte
/// elements. all_reduce picks its kernel by its bytes with `one_shot_max` and
/// `low_latency_max` (`choose_allreduce`); reduce_scatter and all_gather take their
/// low-latency kernels (NOTE [Low latency] in csrc_kernels/low_latency.cuh) where what each rank
/// sends each peer, the output shard or the input, is at most `low_latency_max` (0: never).
pub fn kernel(kind: Kind, count: u64, elem: usize, local_ranks: usize, one_shot_max: usize, low_latency_max: usize) -> Kernel {
    let low_latency = |bytes: u64| low_latency_max > 0 && bytes <= low_latency_max as u64;
    match kind {
        Kind::AllReduce => Kernel::Reduce(choose_allreduce((count * elem as u64) as usize, local_ranks, one_shot_max, low_latency_max)),
        Kind::ReduceScatter if low_latency(count * elem as u64) => Kernel::Reduce(Family::ReduceScatterLowLatency),
        Kind::ReduceScatter => Kernel::Reduce(Family::ReduceScatter),
        Kind::Reduce => Kernel::Reduce(Family::Reduce),
        // all_gather's count is its input's bytes.
        Kind::AllGather if low_latency(count) => Kernel::AllGatherLowLatency,
        Kind::AllGather => Kernel::AllGather,
        Kind::Broadcast => Kernel::Broadcast,
        Kind::Gather => Kernel::Gather,
        Kind::Scatter => Kernel::Scatter,
        Kind::Barrier | Kind::Invalid => Kernel::Barrier,
        Kind::AllToAll => Kernel::AllToAll,
        Kind::Send => Kernel::Send,
        Kind::Recv => Kernel::Recv,
    }
}

/// Every kernel a `kind` call may run on one host (what `kernel` picks at some size or
/// setting): the warm-up launches each (`CudaEngine::warm_up`), so that none is loaded or
/// first run inside a user's call.
pub fn kernels_of(kind: Kind) -> &'static [Kernel] {
    match kind {
        Kind::AllReduce => &[Kernel::Reduce(Family::LowLatency), Kernel::Reduce(Family::OneShot), Kernel::Reduce(Family::TwoShot)],
        Kind::ReduceScatter => &[Kernel::Reduce(Family::ReduceScatterLowLatency), Kernel::Reduce(Family::ReduceScatter)],
        Kind::AllGather => &[Kernel::AllGatherLowLatency, Kernel::AllGather],
        Kind::Reduce => &[Kernel::Reduce(Family::Reduce)],
        Kind::Broadcast => &[Kernel::Broadcast],
        Kind::Gather => &[Kernel::Gather],
        Kind::Scatter => &[Kernel::Scatter],
        Kind::Barrier | Kind::Invalid => &[Kernel::Barrier],
        Kind::AllToAll => &[Kernel::AllToAll],
        Kind::Send => &[Kernel::Send],
        Kind::Recv => &[Kernel::Recv],
    }
}

/// The grid (CUDA blocks) of collective kernel `k` for a call of `bytes`
/// (`message_bytes`), in a group whose collective grid is `blocks`: SMALL_GRID blocks up to
/// SMALL_GRID_MAX_BYTES and for every low-latency kernel, the group's grid above (a pure
/// function of the call, so every rank of a call picks the same one; ranks whose calls
/// differ may not, NOTE [Grids] in csrc_kernels/protocol.cuh). all_to_all keeps the group's
/// grid: its size is in its chunks, not in its descriptor. send/recv never come here
/// (`p2p_blocks`).
pub fn grid(k: Kernel, bytes: u64, blocks: u32) -> u32 {
    if k.is_low_latency() {
        return low_latency_grid(blocks);
    }
    // The kernels whose size is in the descriptor (`Shape::Collective`); not those with a
    // chunk per peer nor send/recv.
    if k.shape() == Shape::Collective && bytes <= SMALL_GRID_MAX_BYTES {
        blocks.min(SMALL_GRID)
    } else {
        blocks
    }
}

/// The grid of every low-latency kernel in a group whose collective grid is `blocks`: the
/// small grid. The kernels size each block's region of their slots by it, and every kernel
/// gets it in `Args::flags` (FLAG_LL_GRID_SHIFT) to keep those regions fresh (NOTE [Low
/// latency epochs] in csrc_kernels/protocol.cuh).
pub fn low_latency_grid(blocks: u32) -> u32 {
    blocks.min(SMALL_GRID)
}

/// The grid of a small collective (`grid`), and the largest message that gets it. On 4
/// H100s (2026-11-27, bf16, under CUDA graphs, docs/performance.md): a sweep of
/// `cuda_blocks` 8 / 16 / 32 / 64 in one call, then main against this grid side by side.
/// Up to 64 KiB, 16 blocks took 8.9-9.2 us per all_reduce against 9.2-9.5 on 64,
/// reduce_scatter 10.3-10.9 against 11.0-11.6, all_gather 9.0-9.6 against 9.3-10.1; at 256
/// KiB all_reduce (one-shot) lost on 16 blocks (12.8 against 11.2 us), so the small grid
/// stops at 64 KiB; from 1 MiB 16 blocks lost 5-15% (all_reduce 4 MiB 40.9 against 37.6
/// us). 8 blocks were no faster than 16. At 2 H100s 16 and 64 were within 0.5 us to 64 KiB.
/// So 48 of the 64 SMs go back to the caller's compute for every call up to 64 KiB.
pub const SMALL_GRID: u32 = 16;
pub const SMALL_GRID_MAX_BYTES: u64 = 64 << 10;

/// Whether a call moves its data on the GPU's copy engines (cuda/engine/copy.rs,
/// cuda/engine/copy_p2p.rs) rather than in rsccl's kernels: all_gather whose gathered
/// output, reduce_scatter whose input (`message_bytes`; its reduction then runs in a small
/// kernel on local memory), broadcast whose tensor, or a send's or recv's message is at
/// least `min_bytes` (the setting cuda_copy_engine_min_bytes; 0: never), with peers to
/// move it to. Every rank decides alike: the call and the setting are the same on every
/// rank (the setting is one of Config::layout_settings), and the barrier kernels compare
/// the descriptors, which say which path a rank took (DESC0_COPY_ENGINE_BIT). A send and its recv decide from
/// their own sizes: equal sizes choose alike, and sizes that differ are the recv's size
/// error on either path (NOTE [Copy-engine send/recv] in csrc_kernels/send_recv.cu).
pub fn copy_engine(kind: Kind, bytes: u64, local_ranks: usize, min_bytes: u64) -> bool {
    matches!(kind, Kind::AllGather | Kind::ReduceScatter | Kind::Broadcast | Kind::Send | Kind::Recv)
        && local_ranks > 1
        && min_bytes > 0
        && bytes >= min_bytes
}

/// Whether a call runs its kernel on the ring schedule (NOTE [Ring] in csrc_kernels/ring.cuh),
/// on the group's grid: reduce_scatter and two-shot all_reduce whose message
/// (`message_bytes`) is at least `min_bytes` (cuda_ring_min_bytes; 0: never), with a peer to
/// send to. all_gather keeps its direct kernel: as a ring it was no faster (4 H100s,
/// 2026-11-27, docs/performance.md). The kernel learns it from DESC0_RING_BIT, which its
/// first barrier compares, so a rank that decided otherwise is a mismatch; every rank
/// decides alike (the call and the setting are the same on every rank).
pub fn ring(k: Kernel, bytes: u64, local_ranks: usize, min_bytes: u64) -> bool {
    matches!(k, Kernel::Reduce(Family::ReduceScatter) | Kernel::Reduce(Family::TwoShot))
        && local_ranks > 1
        && min_bytes > 0
        && bytes >= min_bytes
}

/// A copy-engine collective's rounds: `slot` bytes of staging per round and sender,
/// `per_rank` bytes to move from each sender: the (offset, bytes) of each round. A message
/// of at least COPY_MIN_ROUNDS x COPY_MIN_STEP bytes goes in at least COPY_MIN_ROUNDS
/// equal rounds (multiples of 64 KiB, the last one what remains), so that pushes, barriers
/// and copy-outs overlap and the last copy-out is short; a smaller one in rounds of at
/// least COPY_MIN_STEP, where a push outlasts a barrier. None when there is nothing to move.
pub fn copy_rounds(per_rank: u64, slot: u64) -> impl Iterator<Item = (u64, u64)> {
    let even = per_rank.div_ceil(COPY_MIN_ROUNDS).next_multiple_of(64 << 10);
    let step = even.max(COPY_MIN_STEP).min(slot).max(1);
    (0..per_rank.div_ceil(step)).map(move |k| (k * step, step.min(per_rank - k * step)))
}

/// Rounds a large copy-engine message is cut into at least (`copy_rounds`).
pub const COPY_MIN_ROUNDS: u64 = 4;
/// The least bytes of a copy-engine round below the staging slot (`copy_rounds`). On 2
/// H100s (2026-11-26, bf16, bench): rounds of at least 4 MiB made broadcast 64 MiB 301 GB/s
/// against 275 with rounds of the whole slot (21 MiB), but 16 MiB slower (189 against 197:
/// four rounds of 4 MiB wait on their barriers), so a round stays at 16 MiB or more.
pub const COPY_MIN_STEP: u64 = 16 << 20;

/// Which NCCL call runs a kind in a group across hosts (cuda/nccl_engine/launch.rs makes
/// it, on the flat communicator unless the hierarchical path takes the call).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NcclCall {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Reduce,
    /// A one-element all_reduce on scratch memory (the barrier and the invalid call).
    Barrier,
    /// One NCCL group of sends and receives between the root and every rank.
    Rooted,
    /// One NCCL group of sends and receives with every peer, a chunk each (a call with
    /// chunks).
    AllToAll,
    /// The communicator of the ordered pair (`launch_p2p`).
    P2p,
}

pub fn nccl_call(kind: Kind) -> NcclCall {
    match kind {
        Kind::AllReduce => NcclCall::AllReduce,
        Kind::ReduceScatter => NcclCall::ReduceScatter,
        Kind::AllGather => NcclCall::AllGather,
        Kind::Broadcast => NcclCall::Broadcast,
        Kind::Reduce => NcclCall::Reduce,
        Kind::Barrier | Kind::Invalid => NcclCall::Barrier,
        Kind::Gather | Kind::Scatter => NcclCall::Rooted,
        Kind::AllToAll => NcclCall::AllToAll,
        Kind::Send | Kind::Recv => NcclCall::P2p,
    }
}

/// A call in words, from what a kernel descriptor holds (`count` is its second word), for
/// mismatch messages (cuda/call.rs `describe`).
pub fn call_in_words(kind: Kind, dtype: &str, op: &str, root: u32, count: u64) -> String {
    let name = kind.name();
    match kind {
        Kind::Barrier | Kind::Invalid | Kind::AllToAll => name.to_string(),
        Kind::AllReduce | Kind::ReduceScatter => format!("{name} {dtype}[{count}] {op}"),
        Kind::Reduce => format!("{name} {dtype}[{count}] {op} to local rank {root}"),
        Kind::Broadcast => format!("{name} of {count} bytes from local rank {root}"),
        Kind::Gather => format!("{name} of {count} bytes per rank to local rank {root}"),
        Kind::Scatter => format!("{name} of {count} bytes per rank from local rank {root}"),
        Kind::AllGather | Kind::Send | Kind::Recv => format!("{name} of {count} bytes per rank"),
    }
}

/// The largest all_reduce (bytes) that runs in place at more than 2 local ranks, less one:
/// from this size on, the staged two-shot is faster there than the one-pass in-place kernel
/// (4 H100s, 2026-11-27: a sweep, then an A/B of two runs each with and without in place,
/// 64 MiB / 256 MiB / 1 GiB staged 340-343 / 1,275-1,303 / 4,990-5,027 us against in place
/// 359-361 / 1,369-1,379 / 5,341-5,344 us; docs/performance.md). At 2 ranks in place was
/// as fast or faster (231 against 256 us at 64 MiB) and stays at every size.
pub const ALLREDUCE_IN_PLACE_MAX_BYTES: u64 = 64 << 20;

/// Which buffers a call offers to use in place, as (place_in, place_out) for the kernel:
/// offset + 1 of the buffer in the rank's block, 0 for "not offered". `in_pool(ptr, len)`
/// gives a buffer's offset if it lies inside the pool. A pure function (tested without a
/// GPU); what it returns may differ between ranks, and the kernels settle it together.
/// Every rank calls it with the same kind, kernel and sizes, so calls under the threshold
/// or of a kernel without an in-place algorithm (one-shot, the low-latency kernels) offer
/// nothing on every rank.
pub fn placement(c: &CudaCall, k: Kernel, world: usize, min_bytes: u64, in_pool: &dyn Fn(u64, u64) -> Option<u64>) -> (u64, u64) {
    let elem = c.dtype.size();
    let msg = message_bytes(c.kind, c.count, elem, world);
    if msg == 0 || msg < min_bytes || k.is_low_latency() {
        return (0, 0);
    }
    let at = |ptr: u64, len: u64| in_pool(ptr, len).map(|o| o + 1);
    match c.kind {
        Kind::AllReduce if k == Kernel::Reduce(Family::TwoShot) && (world <= 2 || msg < ALLREDUCE_IN_PLACE_MAX_BYTES) => {
            match (at(c.inp, msg), at(c.out, msg)) {
                (Some(i), Some(o)) => (i, o),
                _ => (0, 0),
            }
        }
        Kind::ReduceScatter => (at(c.inp, msg).unwrap_or(0), 0),
        Kind::AllGather | Kind::Broadcast => (0, at(c.out, msg).unwrap_or(0)),
        _ => (0, 0),
    }
}

/// Staging bytes per CUDA block and parity for a buffer of `buffer_bytes` and `blocks`
/// blocks: what remains after the control area, split in 2 * blocks, in 256-byte units.
pub fn stage_per_block(buffer_bytes: usize, blocks: u32) -> usize {
    (buffer_bytes.saturating_sub(STAGE_OFF) / (2 * blocks as usize)) & !255
}

#[cfg(test)]
mod tests;
