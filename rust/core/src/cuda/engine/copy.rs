//! Collectives on the copy engines (issue 28): all_gather's and broadcast's data move with cuMemcpyAsync
//! between the symmetric mappings, on one stream per peer so that several copy engines
//! work at once, and no SM touches it. The ranks agree and synchronize with the group's
//! barrier kernel launched with one CTA (`decide::copy_engine` picks the path).
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
//! Buffer reuse: (1) E: no rank still uses its staging for an earlier call (its kernels,
//! or a graph replayed in between: the engine cannot know what ran before, so E is never
//! skipped) when the first push lands. (2) Buffer k % 3 is pushed again in round k+3,
//! queued after the pusher passed B_{k+1}, which the receiver reached only after its
//! copy-out of round k (before B_{k+1} on its T). (3) X, after every rank's last copy-out: the next
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
//! path than a peer's, a kernel's blocks other than 0, or this path's one-CTA barriers,
//! wait for CTAs the peer never runs; they stop at the timeout and poison the group, so
//! every rank's next call raises and nothing runs on the stale staging in between
//! (docs/errors.md; seen at 2 H100s, tests/gpu/test_gpu_faults.py). With cuda_error_teardown, the
//! default, the mismatch ends the process first, as with the kernels. Every wait is a barrier's bounded
//! wait (NOTE [Bounded waits]): a dead, stopped or failed peer makes the barrier kernel
//! fail within the timeout, naming the rank, and a copy always finishes on its own, so
//! nothing stays blocked on the GPU. (Stream memory operations, cuStreamWaitValue32,
//! cannot compare descriptors nor time out, and the watchdog would have to release them;
//! the barrier kernel does both and runs under CUDA graphs as the other kernels do.)
//! SMs: the data moves with none; each barrier holds one CTA of one SM for microseconds.

use cudarc::driver::sys as cu;

use super::abi::Args;
use super::{CudaCall, CudaEngine};
use crate::collective::Kind;
use crate::cuda::decide::{copy_engine, copy_rounds, message_bytes};
use crate::cuda::driver::{check, CUstream, Event};
use crate::cuda::kernels::{Kernel, DESC0_COPY_ENGINE_BIT, DESC0_DTYPE_SHIFT, DESC0_ROOT_SHIFT, STAGE_OFF, THREADS};
use crate::cuda::order::{CudaEvent, EndMark, Order};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// Staging buffers a copy-engine collective cycles through: round j's pushes are queued
/// after barrier B_{j - (BUFFERS - 1)}, so a peer's stream pushes round after round while
/// the barriers run beside it (NOTE [Copy engines]).
const BUFFERS: usize = 3;

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

    /// The all_gather or broadcast of `c` on the copy engines (NOTE [Copy engines]).
    pub(super) fn launch_copy(&self, c: &CudaCall) -> Result<Option<CudaEvent>> {
        let plan = CopyPlan::of(c, self.pool.nranks)?;
        if self.staging_slot(plan.senders(self.pool.nranks)) == 0 {
            return Err(Error::Internal("the copy-engine path found no staging".into()));
        }
        let mut a = self.base;
        a.count = 0;
        a.flags = self.sh.launch_flags();
        a.desc0 = c.kind.code()
            | ((c.dtype as u64) << DESC0_DTYPE_SHIFT)
            | ((c.root as u64) << DESC0_ROOT_SHIFT)
            | (1u64 << DESC0_COPY_ENGINE_BIT);
        a.desc1 = c.count;
        let _ctx = self.sh.dev.bind()?;
        let mut o = self.order.lock();
        // Its SMs: the barriers' one CTA, one after another on the target (NOTE [SM budget]).
        let (l, admitted) = self.begin(&mut o, c, 1)?;
        // Queued in part, the call would leave copies and barriers that no peer matches:
        // the group stops (a CUDA error here means the context is failing anyway).
        if let Err(e) = self.queue_copy(&mut o, c, plan, &a, l.target) {
            return Err(self.poison(e));
        }
        self.end(&mut o, &l, admitted)
    }

    fn queue_copy(&self, o: &mut Order<EndMark>, c: &CudaCall, plan: CopyPlan, a: &Args, t: u64) -> Result<()> {
        let (n, me) = (self.pool.nranks, self.pool.me);
        // Bytes each sender moves to each receiver: every rank's block (all_gather), the
        // root's tensor (broadcast).
        let per_rank = c.count;
        let senders = plan.senders(n);
        let slot = self.staging_slot(senders);
        // Rank `to`'s staging buffer b, the slot that holds rank `from`'s bytes.
        let slot_at = |to: usize, b: usize, from: usize| {
            let index = plan.slot_index(to, from) as u64;
            self.base.peer[to] + STAGE_OFF as u64 + ((b % BUFFERS) as u64 * senders as u64 + index) * slot
        };
        let s = |p: usize| self.copy_streams[p].raw() as u64;
        let local = s(me);
        // The peers this rank pushes to, and those it receives from (with where their
        // bytes go).
        let pushes: Vec<usize> = (0..n).filter(|&p| p != me && plan.sends(me, p)).collect();
        let receives: Vec<(usize, u64)> =
            (0..n).filter(|&q| q != me && plan.sends(q, me)).map(|q| (q, plan.receive_at(c, q, per_rank))).collect();
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
        let push = |o: &mut Order<EndMark>, j: usize| -> Result<Vec<Event>> {
            let (off, len) = rounds[j];
            let mut ends = Vec::with_capacity(pushes.len());
            for &p in &pushes {
                o.join(t, s(p))?;
                copy(slot_at(p, j, me), c.inp + off, len, s(p))?;
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
            // The copy-out, on T itself: B_{k+1} follows it with no event between them.
            for &(q, dst) in &receives {
                copy(dst + off, slot_at(me, k, q), len, t)?;
            }
        }
        o.join(local, t)?;
        // X counts the call (memory_stats: a staged collective of the bytes it delivers).
        let mut x = *a;
        x.count = message_bytes(c.kind, c.count, 1, n);
        self.copy_barrier(&x, t)
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

/// Who moves what in a copy-engine collective: every rank to every peer (all_gather), or
/// the root to every other rank (broadcast). Every rank derives the same rounds from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CopyPlan {
    AllGather,
    Broadcast { root: usize },
}

impl CopyPlan {
    fn of(c: &CudaCall, n: usize) -> Result<CopyPlan> {
        match c.kind {
            Kind::AllGather => Ok(CopyPlan::AllGather),
            Kind::Broadcast if c.root < n => Ok(CopyPlan::Broadcast { root: c.root }),
            k => Err(Error::Internal(format!("{} does not run on the copy engines", k.name()))),
        }
    }

    /// Whether rank `from` pushes to rank `to`.
    fn sends(self, from: usize, to: usize) -> bool {
        match self {
            CopyPlan::AllGather => true,
            CopyPlan::Broadcast { root } => from == root && to != root,
        }
    }

    /// How many ranks push into one rank's buffer: its slots per buffer.
    fn senders(self, n: usize) -> usize {
        match self {
            CopyPlan::AllGather => n - 1,
            CopyPlan::Broadcast { .. } => 1,
        }
    }

    /// The slot of rank `to`'s buffers that rank `from` pushes into.
    fn slot_index(self, to: usize, from: usize) -> usize {
        match self {
            CopyPlan::AllGather => from - usize::from(from > to),
            CopyPlan::Broadcast { .. } => 0,
        }
    }

    /// Where the bytes received from rank `q` go in this rank's output.
    fn receive_at(self, c: &CudaCall, q: usize, per_rank: u64) -> u64 {
        match self {
            CopyPlan::AllGather => c.out + q as u64 * per_rank,
            CopyPlan::Broadcast { .. } => c.out,
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

    /// Every rank pushes into a slot of its own in each receiver's buffer, and the slots
    /// of a buffer are exactly those `senders` counts.
    #[test]
    fn shapes_give_each_sender_its_own_slot() {
        for n in 2..=8 {
            for plan in [CopyPlan::AllGather, CopyPlan::Broadcast { root: 0 }, CopyPlan::Broadcast { root: n - 1 }] {
                for to in 0..n {
                    let mut slots: Vec<usize> = (0..n).filter(|&f| f != to && plan.sends(f, to)).map(|f| plan.slot_index(to, f)).collect();
                    slots.sort();
                    let want = if matches!(plan, CopyPlan::Broadcast { root } if root == to) { 0 } else { plan.senders(n) };
                    assert_eq!(slots, (0..want).collect::<Vec<_>>(), "{plan:?} n={n} to={to}");
                }
            }
        }
    }
}
