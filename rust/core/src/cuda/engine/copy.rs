//! Collectives on the copy engines (issue 28): all_gather's, reduce_scatter's and broadcast's data move with
//! cuMemcpyAsync between the symmetric mappings, on one stream per peer so that several copy engines
//! work at once, and no SM moves it between GPUs (reduce_scatter reduces what arrived in a small local
//! kernel, issue 26). The ranks agree and synchronize with the group's barrier kernel launched with
//! one CTA (`decide::copy_engine` picks the path).
//!
//! NOTE [Copy engines]
//! Protocol (all_gather, `B` bytes per rank): the staging is cut into BUFFERS (3) buffers
//! of one slot per peer, `S` bytes each (`staging_slot`); round k moves bytes [o_k, o_k +
//! n_k) of every rank's block (n_k <= S: `decide::copy_rounds`, at least 4 rounds for a
//! large message) through buffer k % BUFFERS. Streams: the collective's stream T, a stream
//! P_p per peer p (pushes to p) and a local stream L (this rank's own block).
//!   L: after T's queued work, this rank's own block, input -> output.
//!   T: barrier E.
//!   P_p, after E (rounds 0 and 1) or B_{k-2} (round k): push this rank's bytes of round
//!     k into p's buffer k % 3, slot of this rank (the copy engine writes over NVLink). A
//!     push waits on a barrier two rounds back, so the peer's stream pushes round after
//!     round while each barrier runs beside the next round's push.
//!   T, round k: wait for every P_p (this rank's pushes of round k); barrier B_k; then the
//!     copy-out: every peer's slot of this rank's buffer k % 3 into the output (on T, so
//!     B_{k+1} follows it in stream order).
//!   T: wait for L; barrier X (which counts the call in memory_stats, as kernels count
//!     theirs: on the GPU, so that graph replays count).
//! Broadcast is the same protocol with one sender: only the root pushes (its tensor, in
//! rounds, to every peer), each buffer has one slot, and only the other ranks copy out
//! (`CopyPlan`). The rounds, and so the barriers, are the same on every rank, as are the
//! descriptors, which carry the root: ranks that name different roots are a mismatch.
//! Reduce_scatter (`B` = bytes of the output, one block of the input) is all_gather's
//! protocol with two changes: P_p pushes bytes [p B + o_k, +n_k) of this rank's input (p's
//! block) into p's buffer k % 3, slot of this rank, as all_gather's slots; and on T after
//! B_k, in place of the copy-out, the reduce kernel (rs_ce_reduce, REDUCE_BLOCKS CTAs)
//! computes output [o_k, +n_k) = op over, in rank order, this rank's own block of the input
//! at o_k and every peer's slot of buffer k % 3, as the reduce_scatter kernel reduces (AVG:
//! the sum, divided by the ranks at the end). It reads and writes only local memory (the
//! staging and the caller's tensors) and sets or waits on no flag: no new cross-GPU
//! protocol. L has nothing to copy (no own block to deliver: the reduction writes it), and
//! no push reads this rank's own block, so the output may be that block (in place): the
//! reduction's threads each read a pack before they write it. The descriptors carry the op
//! as well (ranks that pass different ops are a mismatch at E), and the reduce kernel takes
//! its op from the same descriptor.
//! Pushing or pulling made no difference on 4 H100s (both about 185 GB/s into each GPU at
//! 256 MiB-1 GiB, docs/performance.md, issue 28): pushes keep every peer's bytes of a round
//! in one place, so a rank sends its input once per peer and needs no staging copy first.
//! The barriers are rs_barrier with one CTA (block 0's flags and counters: the kernels'
//! NOTE [Barrier protocol], NOTE [Lockstep blocks]: every rank launches the same sequence,
//! so block 0's epochs stay in step and the other blocks' are untouched).
//! Ordering: a barrier kernel starts after the work queued before it on T completed (the
//! pushes, joined by events), and its st.release.sys / the peer barrier's ld.acquire.sys
//! order those completed writes before everything the peer queues after its barrier
//! kernel ended (the copy-out reads only its own memory, written by the peers' pushes).
//! Reduce_scatter's reduce kernel of round k takes the copy-out's place exactly: it is
//! queued on T after B_k and before B_{k+1}, it reads only this rank's own memory (the
//! peers' pushes of round k into buffer k % 3, ordered before it by B_k as the copy-out's
//! reads are, and this rank's own input), and B_{k+1} starts only after it completed (stream
//! order, no event between them). So every argument below that names the copy-out of round
//! k holds for it word for word.
//! Buffer reuse: (1) E: no rank still uses its staging for an earlier call (its kernels,
//! or a graph replayed in between: the engine cannot know what ran before, so E is never
//! skipped) when the first push lands. (2) Buffer k % 3 is pushed again in round k+3,
//! queued after the pusher passed B_{k+1}, which the receiver reached only after its
//! copy-out (reduce_scatter: its reduce kernel) of round k (before B_{k+1} on its T). (3) X,
//! after every rank's last copy-out (or reduce kernel): the next
//! kernel may push into a peer's staging before its own first barrier (reduce_scatter's
//! push(0): its step parity says that half is free, which holds only if nobody reads it
//! after the last barrier of the call before), so no copy-out may outlive the call's last
//! barrier. (Without X, all_gather on the copy engines then reduce_scatter came out wrong
//! in the bench's overlap check on 4 H100s.)
//! Agreement and failures: every barrier carries the call's descriptor with
//! DESC0_COPY_ENGINE_BIT, so a rank that called another collective, or the same one on
//! the other path, is a mismatch at the next barrier (NOTE [Agreement]). A push writes only
//! into the slot of its own rank in a peer's staging, never outside it, so a mismatched
//! call can spoil only the output of a call that raises. After a mismatch the group may
//! not stay usable, as it does with the kernels: when the ranks' calls took different
//! paths, or a rank's next call (queued before it heard of the mismatch) takes another
//! path than a peer's, this path's later one-CTA barriers wait for barriers the peer never
//! runs (a kernel's other blocks do not: the one-CTA barrier that finds the mismatch
//! stands in for them, NOTE [Grids]); they stop at the timeout and poison the group, so
//! every rank's next call raises and nothing runs on the stale staging in between
//! (docs/errors.md; seen at 2 H100s, tests/gpu/test_gpu_faults.py). With cuda_error_teardown, the
//! default, the mismatch ends the process first, as with the kernels. Every wait is a barrier's bounded
//! wait (NOTE [Bounded waits]): a dead, stopped or failed peer makes the barrier kernel
//! fail within the timeout, naming the rank, and a copy always finishes on its own, so
//! nothing stays blocked on the GPU. (Stream memory operations, cuStreamWaitValue32,
//! cannot compare descriptors nor time out, and the watchdog would have to release them;
//! the barrier kernel does both and runs under CUDA graphs as the other kernels do.)
//! SMs: the data moves with none; each barrier holds one CTA of one SM for microseconds;
//! reduce_scatter's reduce kernel holds REDUCE_BLOCKS CTAs (at most the collective grid)
//! for each round's reduction, and the SM budget counts the call as its SMs
//! (`launch_copy`, NOTE [SM budget]).

use cudarc::driver::sys as cu;

use super::abi::{Args, CeReduceArgs};
use super::{CudaCall, CudaEngine};
use crate::collective::Kind;
use crate::cuda::budget::sms_of;
use crate::cuda::decide::{copy_engine, copy_rounds, message_bytes};
use crate::cuda::driver::{check, CUstream, Event, Function};
use crate::cuda::kernels::{
    Family, Kernel, DESC0_COPY_ENGINE_BIT, DESC0_DTYPE_SHIFT, DESC0_OP_SHIFT, DESC0_ROOT_SHIFT, STAGE_OFF, THREADS,
};
use crate::cuda::order::{CudaEvent, Order};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// Staging buffers a copy-engine collective cycles through: round j's pushes are queued
/// after barrier B_{j - (BUFFERS - 1)}, so a peer's stream pushes round after round while
/// the barriers run beside it (NOTE [Copy engines]).
const BUFFERS: usize = 3;

/// The grid of reduce_scatter's reduce kernel on the copy engines (rs_ce_reduce, one per
/// round; fewer where the group's collective grid is smaller, as where ranks share a GPU).
/// A round's reduction reads the ranks' bytes of the round from local memory and writes
/// one share, (ranks + 1) x the round's output bytes, while the copy engines push the next
/// round over NVLink at a few hundred GB/s into each GPU (docs/performance.md); it must
/// keep up with that, not with HBM. 16 CTAs of 512 threads keep 16 x 512 x 8 16-byte loads
/// in flight (reduce_packs: 8 per thread), 1 MiB, which by Little's law (about 1 us of
/// latency) sustains on the order of 1 TB/s, above the 3 x 300 GB/s that 2 ranks need; and
/// it leaves 116 of an H100's 132 SMs to the caller's compute, where the kernels' path
/// holds cuda_blocks (64) of them for the whole call. A guess from that arithmetic, not yet
/// measured: the bench (docs/cuda.md) is where to tune it.
const REDUCE_BLOCKS: u32 = 16;

impl CudaEngine {
    /// Whether `c` runs on the copy engines (`decide::copy_engine` with this group's setting).
    pub(super) fn on_copy_engines(&self, c: &CudaCall) -> bool {
        let bytes = message_bytes(c.kind, c.count, c.dtype.size(), self.pool.nranks);
        copy_engine(c.kind, bytes, self.pool.nranks, self.copy_engine_min)
    }

    /// Bytes of staging: that of every CUDA block and both parities, taken as one
    /// contiguous range (NOTE [Block layout]; the copy-engine path owns all of it between
    /// its barriers).
    fn staging_bytes(&self) -> u64 {
        2 * self.blocks as u64 * self.base.stage_per_block
    }

    /// Bytes a rank receives from each of `senders` peers per round: the staging cut into
    /// BUFFERS buffers of `senders` slots, in 256-byte units.
    fn staging_slot(&self, senders: usize) -> u64 {
        (self.staging_bytes() / (BUFFERS as u64 * senders.max(1) as u64)) & !255
    }

    /// The reduce kernel's grid (`REDUCE_BLOCKS`, within the group's collective grid).
    fn reduce_blocks(&self) -> u32 {
        REDUCE_BLOCKS.min(self.blocks).max(1)
    }

    /// The all_gather, reduce_scatter or broadcast of `c` on the copy engines (NOTE [Copy
    /// engines]).
    pub(super) fn launch_copy(&self, c: &CudaCall) -> Result<Option<CudaEvent>> {
        let plan = CopyPlan::of(c, self.pool.nranks)?;
        if self.staging_slot(plan.senders(self.pool.nranks)) == 0 {
            return Err(Error::Internal("the copy-engine path found no staging".into()));
        }
        // reduce_scatter's reduce kernel: fails here, before anything is queued, where the
        // kernels do not reduce the dtype with the op (`can_run` refused it before already).
        let reduce = match plan {
            CopyPlan::ReduceScatter => {
                Some(self.kernels.get(Kernel::Reduce(Family::CopyEngineReduce), c.dtype, c.op).ok_or_else(|| {
                    Error::InvalidType(format!("rsccl's CUDA {} does not support {} with {}", c.kind.name(), c.dtype.name(), c.op.name()))
                })?)
            }
            _ => None,
        };
        let mut a = self.base;
        a.count = 0;
        a.flags = self.sh.launch_flags();
        // The op too where the call reduces: the ranks compare it at E, and the reduce
        // kernel reads it from there (NOTE [Reduce op at run time]).
        let op = if c.kind.has_op() { (c.op as u64) << DESC0_OP_SHIFT } else { 0 };
        a.desc0 = c.kind.code()
            | ((c.dtype as u64) << DESC0_DTYPE_SHIFT)
            | op
            | ((c.root as u64) << DESC0_ROOT_SHIFT)
            | (1u64 << DESC0_COPY_ENGINE_BIT);
        a.desc1 = c.count;
        let _ctx = self.sh.dev.bind()?;
        let mut o = self.order.lock();
        // Its SMs (NOTE [SM budget]): the barriers' one CTA, and reduce_scatter's reduce
        // kernels, one after another on the target, so the largest of them.
        let sms = match reduce {
            Some(_) => sms_of(self.reduce_blocks(), self.sm.collective_per_sm).max(1),
            None => 1,
        };
        let (l, admitted) = self.begin(&mut o, c, sms)?;
        // Queued in part, the call would leave copies and barriers that no peer matches:
        // the group stops (a CUDA error here means the context is failing anyway).
        if let Err(e) = self.queue_copy(&mut o, c, plan, &a, reduce, l.target) {
            return Err(self.poison(e));
        }
        self.end(&mut o, &l, admitted)
    }

    fn queue_copy(&self, o: &mut Order, c: &CudaCall, plan: CopyPlan, a: &Args, reduce: Option<Function>, t: u64) -> Result<()> {
        let (n, me) = (self.pool.nranks, self.pool.me);
        // Bytes each sender moves to each receiver: every rank's block (all_gather), the
        // root's tensor (broadcast), a block of the output (reduce_scatter).
        let per_rank = plan.per_rank(c);
        let senders = plan.senders(n);
        let slot = self.staging_slot(senders);
        // Rank `to`'s staging buffer b (its slot 0), and the slot that holds rank `from`'s
        // bytes.
        let buffer_at = |to: usize, b: usize| self.base.peer[to] + STAGE_OFF as u64 + (b % BUFFERS) as u64 * senders as u64 * slot;
        let slot_at = |to: usize, b: usize, from: usize| buffer_at(to, b) + plan.slot_index(to, from) as u64 * slot;
        let s = |p: usize| self.copy_streams[p].raw() as u64;
        let local = s(me);
        // The peers this rank pushes to, and those it receives from (with where their
        // bytes go).
        let pushes: Vec<usize> = (0..n).filter(|&p| p != me && plan.sends(me, p)).collect();
        let receives: Vec<(usize, u64)> =
            (0..n).filter(|&q| q != me && plan.sends(q, me)).filter_map(|q| Some((q, plan.receive_at(c, q, per_rank)?))).collect();
        // This rank's own block of an all_gather: a local copy beside the rest (none when
        // the input is that block already, as FSDP2's all-gather passes it).
        if let Some((dst, src)) = plan.own_copy(c, me, per_rank) {
            o.join(t, local)?;
            copy(dst, src, per_rank, local)?;
        }
        self.copy_barrier(a, t)?;
        let rounds: Vec<(u64, u64)> = copy_rounds(per_rank, slot).collect();
        // Round j's pushes, queued after the barrier last queued on T; the events that mark
        // their end on each peer's stream (T waits on them before B_j, when later pushes
        // may already be queued behind them).
        let push = |o: &mut Order, j: usize| -> Result<Vec<Event>> {
            let (off, len) = rounds[j];
            let mut ends = Vec::with_capacity(pushes.len());
            for &p in &pushes {
                o.join(t, s(p))?;
                copy(slot_at(p, j, me), plan.send_from(c, p, per_rank) + off, len, s(p))?;
                ends.push(o.record(s(p))?);
            }
            Ok(ends)
        };
        let mut pushed: std::collections::VecDeque<Vec<Event>> = Default::default();
        for j in 0..rounds.len().min(BUFFERS - 1) {
            pushed.push_back(push(o, j)?);
        }
        for (k, &(off, len)) in rounds.iter().enumerate() {
            for ev in pushed.pop_front().unwrap_or_default() {
                o.wait_then_free(ev, t)?;
            }
            self.copy_barrier(a, t)?;
            if k + BUFFERS - 1 < rounds.len() {
                pushed.push_back(push(o, k + BUFFERS - 1)?);
            }
            // The copy-out, or reduce_scatter's reduction, on T itself: B_{k+1} follows it
            // with no event between them.
            match reduce {
                Some(f) => self.copy_reduce(f, a, c, plan.send_from(c, me, per_rank) + off, c.out + off, len, buffer_at(me, k), slot, t)?,
                None => {
                    for &(q, dst) in &receives {
                        copy(dst + off, slot_at(me, k, q), len, t)?;
                    }
                }
            }
        }
        o.join(local, t)?;
        // X counts the call (memory_stats: a staged collective of the bytes it delivers).
        let mut x = *a;
        x.count = message_bytes(c.kind, c.count, c.dtype.size(), n);
        self.copy_barrier(&x, t)
    }

    /// reduce_scatter on the copy engines, round by round: rs_ce_reduce on `stream`, the
    /// round's `bytes` of this rank's own block (`own`) and of every peer's slot (`slots`,
    /// `slot` bytes apart) reduced with the call's op into `out` (NOTE [Copy engines]).
    #[allow(clippy::too_many_arguments)]
    fn copy_reduce(
        &self,
        f: Function,
        a: &Args,
        c: &CudaCall,
        own: u64,
        out: u64,
        bytes: u64,
        slots: u64,
        slot: u64,
        stream: u64,
    ) -> Result<()> {
        let mut x = CeReduceArgs { a: *a, slots, slot_bytes: slot };
        x.a.inp = own;
        x.a.out = out;
        x.a.count = bytes / c.dtype.size() as u64;
        let arg = &mut x as *mut CeReduceArgs as *mut std::ffi::c_void;
        // SAFETY: rs_ce_reduce_<dtype> (`f`, looked up for the call's dtype and op) takes one
        // `CeReduceArgs` by value, the source's layout (checked at build time); `arg` points
        // at it for the call; the grid is at most the collective grid of THREADS-thread
        // blocks, within its launch bounds; `stream` is the collective's target, a live
        // stream of the context bound by the caller. What it reads and writes lies in this
        // rank's staging and the caller's tensors, alive as for the copies (`copy`).
        unsafe { Self::launch_kernel(f, self.reduce_blocks(), stream, arg, c.kind) }
    }

    /// At group creation: one small copy from every peer's staging into this rank's on each
    /// copy stream, so that the first collective on the copy engines finds the peer
    /// mappings in use. No kernel reads staging during the warm-up (its calls are empty).
    pub(super) fn warm_copy_engines(&self) -> Result<()> {
        let half = self.staging_bytes() / 2;
        let bytes = half.min(4096);
        for p in 0..self.pool.nranks {
            let from = self.base.peer[p] + STAGE_OFF as u64;
            copy(self.base.peer[self.pool.me] + STAGE_OFF as u64 + half, from, bytes, self.copy_streams[p].raw() as u64)?;
        }
        for s in &self.copy_streams {
            check(s.synchronize(), "cuStreamSynchronize (copy-engine warm-up)")?;
        }
        Ok(())
    }

    /// One barrier of a copy-engine collective: rs_barrier with one CTA on `stream`,
    /// carrying the call's descriptor (NOTE [Copy engines]).
    fn copy_barrier(&self, a: &Args, stream: u64) -> Result<()> {
        let barrier =
            self.kernels.get(Kernel::Barrier, DType::U8, ReduceOp::Sum).ok_or_else(|| Error::Internal("no barrier kernel".into()))?;
        let mut a = *a;
        let mut arg = &mut a as *mut Args as *mut std::ffi::c_void;
        // SAFETY: rs_barrier takes one `Args` by value, the source's layout; `arg` points at
        // it for the call; one block of THREADS threads is within its launch bounds, and
        // block 0's flags and counters are the ones a one-block kernel uses.
        check(
            unsafe { cu::cuLaunchKernel(barrier.raw(), 1, 1, 1, THREADS, 1, 1, 0, stream as CUstream, &mut arg, std::ptr::null_mut()) },
            "launching rsccl's copy-engine barrier",
        )
    }
}

/// `bytes` from `src` to `dst` on `stream`: device addresses of this context (own memory or
/// a peer's mapping, NOTE [Block layout]).
pub(super) fn copy(dst: u64, src: u64, bytes: u64, stream: u64) -> Result<()> {
    // SAFETY: both ranges lie in memory mapped in this context for as long as the stream
    // can run the copy: the caller's tensors (kept by the Work until the stream is ordered
    // after the call) and the group's symmetric blocks (kept while work of the group can
    // run, shutdown.rs, graphs.rs); the stream is a live stream of this context.
    check(unsafe { cu::cuMemcpyDtoDAsync_v2(dst, src, bytes as usize, stream as CUstream) }, "cuMemcpyDtoDAsync (copy engines)")
}

/// Who moves what in a copy-engine collective: every rank to every peer (all_gather: its
/// block; reduce_scatter: the peer's block of its input), or the root to every other rank
/// (broadcast). Every rank derives the same rounds from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CopyPlan {
    AllGather,
    /// Each rank reduces the peers' slots with its own block instead of a copy-out.
    ReduceScatter,
    Broadcast {
        root: usize,
    },
}

impl CopyPlan {
    fn of(c: &CudaCall, n: usize) -> Result<CopyPlan> {
        match c.kind {
            Kind::AllGather => Ok(CopyPlan::AllGather),
            Kind::ReduceScatter => Ok(CopyPlan::ReduceScatter),
            Kind::Broadcast if c.root < n => Ok(CopyPlan::Broadcast { root: c.root }),
            k => Err(Error::Internal(format!("{} does not run on the copy engines", k.name()))),
        }
    }

    /// Whether rank `from` pushes to rank `to`.
    fn sends(self, from: usize, to: usize) -> bool {
        match self {
            CopyPlan::AllGather | CopyPlan::ReduceScatter => true,
            CopyPlan::Broadcast { root } => from == root && to != root,
        }
    }

    /// How many ranks push into one rank's buffer: its slots per buffer.
    fn senders(self, n: usize) -> usize {
        match self {
            CopyPlan::AllGather | CopyPlan::ReduceScatter => n - 1,
            CopyPlan::Broadcast { .. } => 1,
        }
    }

    /// The slot of rank `to`'s buffers that rank `from` pushes into.
    fn slot_index(self, to: usize, from: usize) -> usize {
        match self {
            CopyPlan::AllGather | CopyPlan::ReduceScatter => from - usize::from(from > to),
            CopyPlan::Broadcast { .. } => 0,
        }
    }

    /// Bytes each sender moves to each receiver: every rank's block (all_gather), a block of
    /// the output (reduce_scatter: `count` elements), the root's tensor (broadcast).
    fn per_rank(self, c: &CudaCall) -> u64 {
        match self {
            CopyPlan::ReduceScatter => c.count * c.dtype.size() as u64,
            CopyPlan::AllGather | CopyPlan::Broadcast { .. } => c.count,
        }
    }

    /// Where the bytes a rank pushes to rank `to` start in its input: its input
    /// (all_gather, broadcast), `to`'s block of it (reduce_scatter; for `to` = the rank
    /// itself, the block it reduces with the peers').
    fn send_from(self, c: &CudaCall, to: usize, per_rank: u64) -> u64 {
        match self {
            CopyPlan::ReduceScatter => c.inp + to as u64 * per_rank,
            CopyPlan::AllGather | CopyPlan::Broadcast { .. } => c.inp,
        }
    }

    /// Where the copy-out puts the bytes received from rank `q` in this rank's output; None
    /// for reduce_scatter, which has no copy-out (its reduce kernel reads them in the
    /// staging).
    fn receive_at(self, c: &CudaCall, q: usize, per_rank: u64) -> Option<u64> {
        match self {
            CopyPlan::AllGather => Some(c.out + q as u64 * per_rank),
            CopyPlan::Broadcast { .. } => Some(c.out),
            CopyPlan::ReduceScatter => None,
        }
    }

    /// This rank's own copy, (to, from), when it has one to make.
    fn own_copy(self, c: &CudaCall, me: usize, per_rank: u64) -> Option<(u64, u64)> {
        let own = c.out + me as u64 * per_rank;
        (self == CopyPlan::AllGather && per_rank > 0 && c.inp != own).then_some((own, c.inp))
    }
}

#[cfg(test)]
mod tests {
    use super::CopyPlan;
    use crate::collective::Kind;
    use crate::cuda::call::CudaCall;
    use crate::dtype::{DType, ReduceOp};

    /// Every rank pushes into a slot of its own in each receiver's buffer, and the slots
    /// of a buffer are exactly those `senders` counts.
    #[test]
    fn shapes_give_each_sender_its_own_slot() {
        for n in 2..=8 {
            for plan in [CopyPlan::AllGather, CopyPlan::ReduceScatter, CopyPlan::Broadcast { root: 0 }, CopyPlan::Broadcast { root: n - 1 }]
            {
                for to in 0..n {
                    let mut slots: Vec<usize> = (0..n).filter(|&f| f != to && plan.sends(f, to)).map(|f| plan.slot_index(to, f)).collect();
                    slots.sort();
                    let want = if matches!(plan, CopyPlan::Broadcast { root } if root == to) { 0 } else { plan.senders(n) };
                    assert_eq!(slots, (0..want).collect::<Vec<_>>(), "{plan:?} n={n} to={to}");
                }
            }
        }
    }

    /// reduce_scatter: `B` bytes per rank (the output, count x dtype); rank r sends rank p
    /// p's block of its input, [p B, (p + 1) B), and reduces its own block, r's, with what
    /// it received (`send_from(c, r, ..)`), so the blocks a rank pushes and the one it
    /// reduces tile its input once. No copy-out, no own copy (the reduction writes the
    /// output, which may be that own block: in place).
    #[test]
    fn reduce_scatter_sends_each_peer_its_block() {
        for (dtype, count) in [(DType::BF16, 1000u64), (DType::F32, 3), (DType::I64, 1 << 20)] {
            for n in 2..=8usize {
                let per = count * dtype.size() as u64;
                let inp = 1u64 << 40;
                for me in 0..n {
                    for out in [inp + 7 * per * n as u64, inp + me as u64 * per] {
                        let c = CudaCall { dtype, op: ReduceOp::Avg, inp, out, ..CudaCall::bare(Kind::ReduceScatter, count, 0, false) };
                        let plan = CopyPlan::of(&c, n).unwrap();
                        assert_eq!(plan, CopyPlan::ReduceScatter);
                        assert_eq!(plan.per_rank(&c), per);
                        let mut starts: Vec<u64> = (0..n).map(|p| plan.send_from(&c, p, per)).collect();
                        starts.sort();
                        assert_eq!(starts, (0..n as u64).map(|p| inp + p * per).collect::<Vec<_>>());
                        assert_eq!(plan.send_from(&c, me, per), inp + me as u64 * per);
                        assert!((0..n).all(|q| plan.receive_at(&c, q, per).is_none()));
                        assert_eq!(plan.own_copy(&c, me, per), None);
                    }
                }
            }
        }
    }
}
