//! The SMs of a GPU that rsccl's kernels of every group of this process draw from (issue
//! 25, place 4): one ledger per device (`DeviceBudget`), each group's share of it
//! (`SmShare`), and the pure choices behind it (`sweep`, `decide`), tested without a GPU.
//!
//! NOTE [SM budget]
//! Why: each group sizes its grids alone (`decide::grids_that_fit`): one collective kernel
//! (cuda_blocks, whole SMs) and all of its send/recv kernels fit on the GPU together. A
//! process with several groups on one GPU (a DeviceMesh: the world, a row and a column
//! group) can have collectives of two or three groups in flight at once on different
//! streams, and 3 x 64 SMs do not fit on 132. Some blocks of a kernel then stay unscheduled
//! while its resident blocks spin-wait on peers on other GPUs, whose own SMs may be held
//! by another group's kernel that waits for blocks stuck here: the GPUs can wait on each
//! other until the group timeout.
//!
//! The ledger: per device, in SMs. Every eager launch of an rsccl kernel (collective kernels,
//! send/recv kernels, the copy-engine paths' one-CTA barriers and send/recv signals, counted
//! as one launch of 1 SM per call: they run one after another on one stream; a copy-engine
//! reduce_scatter as one launch of its reduce kernel's SMs, which runs between those
//! barriers on the same stream, so the largest of them) holds `sms_of(blocks, blocks per SM)`
//! SMs, the same whole-SM count `grids_that_fit` sizes with (more than the kernel may
//! take: counting too much only makes a launch wait), from when it is enqueued until its end
//! event, recorded right after it on its stream (from the group's `Order` pool), is seen
//! complete. Before a launch, under the engine's order lock and then the ledger's lock (that
//! order, always), held until the launch's event is recorded:
//! 1. `sweep`: entries whose end event completed are released (cuEventQuery, oldest first,
//!    not asked where a launch it started after is still running).
//! 2. `decide`: entries the launch already starts after are not counted: those on its target
//!    stream or the caller's (which the target joins, cuda/order.rs), those on the caller's
//!    stream of a blocking call that made it wait, the earlier collectives of its own group
//!    (the chain), and, through each entry's `after` bits, whatever those started after.
//!    The rest may run beside it, counted by chain: a group's collectives run one at a
//!    time, and so do one stream's send/recv kernels, so each chain holds its largest
//!    launch's SMs however deep its queue (`chain_of`). If that and the launch exceed the
//!    group's limit (the GPU's SMs, or its share where ranks share the GPU), its target
//!    stream waits (cuStreamWaitEvent) on the newest launch of another group's chain (which
//!    every older one of it precedes), the chain with the oldest launch first, until what
//!    may still run beside it fits; the chain, and what its newest started after, then
//!    count as started-after for this launch and for every later launch that starts after
//!    it (its `after` bits). Entries of the launch's own group are never waited on: its
//!    collectives are chained already, and one collective with all its send/recv kernels
//!    fits by the group's own sizing, which also lets a send complete before its recv is
//!    posted (eager capacity), so a wait on its own send could close a cycle that rsccl
//!    allows today. A waited entry stays in the ledger for the other streams: it may still
//!    run beside their launches. Only what ends before the launch starts goes uncounted,
//!    and nothing leaves the ledger before its event completed, so the count can be too
//!    high (an extra wait), never too low.
//!
//! The invariant: for every set of rsccl kernels of this process that can be running on the
//! device at once, the last one enqueued counted all the others beside it, so together they
//! fit (except when the group's own kernels alone exceed the limit, which `grids_that_fit`
//! rules out but for rounding: `decide` then waits on every other group and proceeds).
//!
//! Why this cannot deadlock: every wait points from a launch to one enqueued earlier on the
//! same GPU, as stream order and the chain do. When every rank issues the calls of all the
//! groups that share its GPUs in one program order (a send and its recv at the same place),
//! every dependency runs from later to earlier in that order. The earliest unfinished call
//! then depends on nothing unfinished on any GPU; its kernels, with everything that may run
//! beside them, fit, so all their blocks become resident (other work on the GPU ends by
//! itself), each block's peers too, and the call finishes; by induction every call does.
//! When ranks issue them in different orders (rank 0 row then column, rank 1 column then
//! row), a wait on one GPU and a wait on another can form a cycle through the peers'
//! kernels: their bounded waits (NOTE [Bounded waits] in csrc_kernels/protocol.cuh) end
//! at the group timeout, naming the rank waited for. NCCL asks the same of communicators
//! used at once ("Using multiple NCCL communicators concurrently"), and there the kernels
//! of an inconsistent order can hang for good. Without a wait (when they fit) the order
//! does not matter.
//!
//! CUDA graphs: a launch being captured is not counted and waits for nothing (an eager
//! event cannot be waited on inside a capture, and a captured kernel runs only at replay):
//! a replay is ordered by the user's streams, as its capture was. A replay beside eager
//! calls of other groups is the user's to order, as with NCCL. NCCL's own kernels (groups
//! across hosts) are not counted either; the hierarchical path's local kernels are.
//!
//! Cost on the eager fast path: one lock, a query per running stream, one cuEventRecord
//! per launch; no allocation once the ledger's vectors and the pool have grown. A group
//! alone on its device (most jobs: one group per GPU) records nothing: with no other group
//! nothing can run beside its launches but its own, which its sizing fits. When a second
//! group joins, the device is synchronized under the ledger's lock first (`SmShare::join`),
//! so no untracked launch of the first is still running once launches are counted again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use cudarc::driver::sys as cu;
use parking_lot::{Mutex, MutexGuard};

use super::driver::{check, CUstream, Device, Event};
use super::order::{Launch, Order, PER_THREAD_STREAM};
use crate::error::Result;

/// SMs a kernel of `blocks` blocks holds, `per_sm` of them resident per SM (whole SMs, as
/// `decide::grids_that_fit` counts them).
pub fn sms_of(blocks: u32, per_sm: u32) -> u32 {
    blocks.div_ceil(per_sm.max(1))
}

/// One launch still counted against its device: its end event not yet seen complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The device's launch number, increasing.
    pub seq: u64,
    pub group: u64,
    /// Streams whose work queued later starts after this launch ended: its target, and the
    /// caller's stream of a blocking call that waited on it (else the target again).
    pub streams: [u64; 2],
    /// In its group's chain of collectives (false: a send/recv).
    pub chained: bool,
    pub sms: u32,
    /// Earlier launches this one starts after: bit i is launch `seq - 1 - i` (the last 64;
    /// older ones are forgotten, which only counts too much).
    pub after: u64,
}

/// A launch about to be enqueued, as the ledger sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    pub group: u64,
    pub target: u64,
    pub caller: u64,
    pub chained: bool,
    pub sms: u32,
    /// The SMs its group may use: the GPU's, or its share where ranks share the GPU.
    pub limit: u32,
}

/// What a held launch is to a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    /// May run beside it: counted.
    Beside,
    /// Ends before it starts already (stream order, the chain, or what those follow).
    Follows,
    /// Another group's, which its target stream is to wait on.
    Wait,
}

/// `decide`'s answer; its `Scratch::marks` say which held launches to wait on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// The claim's `Held::after`.
    pub after: u64,
    /// Launches to wait on.
    pub waits: usize,
    /// SMs that may run beside it after the waits.
    pub beside: u64,
    /// `beside` + its own SMs within its limit (false only where its own group's launches
    /// beside it exceed the limit: then every other group's are waited on).
    pub fits: bool,
}

/// Bit of launch `seq` in bits relative to launch `next` (bit i: `next - 1 - i`); 0 past 64.
fn bit(next: u64, seq: u64) -> u64 {
    let d = next - 1 - seq;
    if d < 64 {
        1 << d
    } else {
        0
    }
}

/// `h.after` (relative to `h.seq`) relative to launch `next`.
fn rebased(h: &Held, next: u64) -> u64 {
    let d = next - h.seq;
    if d < 64 {
        h.after << d
    } else {
        0
    }
}

/// Which held launches (oldest first) have ended, into `ended`: `query(i)` (cuEventQuery of
/// launch i's end event) is asked only where the answer is not known already: a launch that
/// starts after one still running has not ended. Returns the number of queries.
pub fn sweep(held: &[Held], next: u64, mut query: impl FnMut(usize) -> bool, ended: &mut Vec<bool>) -> usize {
    ended.clear();
    let (mut running, mut asked) = (0u64, 0);
    for (i, h) in held.iter().enumerate() {
        let done = rebased(h, next) & running == 0 && {
            asked += 1;
            query(i)
        };
        if !done {
            running |= bit(next, h.seq);
        }
        ended.push(done);
    }
    asked
}

/// Launches that never run at once: a group's chain of collectives (`(true, group)`), or
/// one stream's send/recv kernels (`(false, stream)`: a (peer, direction)'s own stream).
fn chain_of(h: &Held) -> (bool, u64) {
    if h.chained {
        (true, h.group)
    } else {
        (false, h.streams[0])
    }
}

/// One chain's launches that may run beside a claim: at most one of them runs at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chain {
    key: (bool, u64),
    group: u64,
    /// Its most SMs, its oldest and newest launch (indices into the held launches).
    sms: u32,
    oldest: usize,
    newest: usize,
}

/// `decide`'s working space, kept by the ledger so that a launch allocates nothing.
#[derive(Debug, Default)]
pub struct Scratch {
    /// What each held launch is to the claim (`Mark::Wait`: its target waits on it).
    pub marks: Vec<Mark>,
    chains: Vec<Chain>,
}

impl Scratch {
    /// The chains of the launches marked `Beside`, and the SMs they may hold at once (the
    /// sum of each chain's most).
    fn beside(&mut self, held: &[Held]) -> u64 {
        self.chains.clear();
        for (i, h) in held.iter().enumerate().filter(|(i, _)| self.marks[*i] == Mark::Beside) {
            let key = chain_of(h);
            match self.chains.iter_mut().find(|c| c.key == key) {
                Some(c) => {
                    c.sms = c.sms.max(h.sms);
                    c.newest = i;
                }
                None => self.chains.push(Chain { key, group: h.group, sms: h.sms, oldest: i, newest: i }),
            }
        }
        self.chains.iter().map(|c| c.sms as u64).sum()
    }
}

/// What claim `c` must wait on, with `held` (oldest first, none of them known to have ended)
/// and `next` its launch number: `s.marks[i]` for each held launch (NOTE [SM budget], step
/// 2). What may run beside it is counted by chain (`chain_of`): the launches of one chain
/// run one at a time, so a chain holds its largest launch's SMs, however deep its queue.
/// To take a chain out, the claim waits on its newest launch (which every older one of it
/// precedes); chains of other groups go, the one with the oldest launch first, until the
/// rest fits.
pub fn decide(held: &[Held], next: u64, c: &Claim, s: &mut Scratch) -> Decision {
    s.marks.clear();
    s.marks.resize(held.len(), Mark::Beside);
    let mut after = 0u64;
    // Newest first, so that what a followed launch starts after is known before it comes.
    for (i, h) in held.iter().enumerate().rev() {
        let stream = h.streams.iter().any(|&x| x != PER_THREAD_STREAM && (x == c.target || x == c.caller));
        let chain = c.chained && h.chained && h.group == c.group;
        if stream || chain || after & bit(next, h.seq) != 0 {
            s.marks[i] = Mark::Follows;
            after |= bit(next, h.seq) | rebased(h, next);
        }
    }
    let limit = c.limit as u64;
    let mut waits = 0;
    let mut beside = s.beside(held);
    while beside + c.sms as u64 > limit {
        // `chains` is in the order of each one's oldest launch.
        let Some(w) = s.chains.iter().find(|ch| ch.group != c.group).copied() else { break };
        for (i, h) in held.iter().enumerate().take(w.newest + 1).skip(w.oldest) {
            if s.marks[i] == Mark::Beside && chain_of(h) == w.key {
                s.marks[i] = Mark::Follows;
                after |= bit(next, h.seq);
            }
        }
        s.marks[w.newest] = Mark::Wait;
        waits += 1;
        // What the waited launch starts after ends first too (its own group's, say).
        let covered = rebased(&held[w.newest], next);
        after |= covered;
        for (i, h) in held.iter().enumerate() {
            if s.marks[i] == Mark::Beside && covered & bit(next, h.seq) != 0 {
                s.marks[i] = Mark::Follows;
            }
        }
        beside = s.beside(held);
    }
    // A wait on a launch that a newer waited one starts after is implied by that one's.
    for j in 0..held.len() {
        if s.marks[j] == Mark::Wait
            && (j + 1..held.len()).any(|i| s.marks[i] == Mark::Wait && rebased(&held[i], next) & bit(next, held[j].seq) != 0)
        {
            s.marks[j] = Mark::Follows;
            waits -= 1;
        }
    }
    Decision { after, waits, beside, fits: beside + c.sms as u64 <= limit }
}

/// One device's ledger: the launches of every group of this process still counted.
struct Ledger {
    next: u64,
    held: Vec<Held>,
    /// Each held launch's end event (parallel to `held`), taken from its group's pool.
    events: Vec<Event>,
    /// Events of launches released by another group's sweep, until their group's next
    /// launch takes them back into its pool.
    parked: Vec<(u64, Event)>,
    /// Groups that hold a share (a released event of any other is destroyed).
    live: Vec<u64>,
    scratch: Scratch,
    ended: Vec<bool>,
}

/// The ledger of one CUDA device, shared by every group of the process on it.
pub struct DeviceBudget {
    ordinal: i32,
    sms: u32,
    ledger: Mutex<Ledger>,
}

static BUDGETS: Mutex<Vec<(i32, Weak<DeviceBudget>)>> = Mutex::new(Vec::new());
static GROUPS: AtomicU64 = AtomicU64::new(1);

impl DeviceBudget {
    /// The ledger of `dev` (`sms` SMs), made by the first group on it.
    fn shared(dev: &Device, sms: u32) -> Arc<DeviceBudget> {
        let mut all = BUDGETS.lock();
        all.retain(|(_, b)| b.strong_count() > 0);
        if let Some(b) = all.iter().filter(|(d, _)| *d == dev.ordinal).find_map(|(_, b)| b.upgrade()) {
            return b;
        }
        let ledger = Ledger {
            next: 0,
            held: Vec::with_capacity(64),
            events: Vec::with_capacity(64),
            parked: Vec::with_capacity(64),
            live: Vec::new(),
            scratch: Scratch { marks: Vec::with_capacity(64), chains: Vec::with_capacity(16) },
            ended: Vec::with_capacity(64),
        };
        let b = Arc::new(DeviceBudget { ordinal: dev.ordinal, sms, ledger: Mutex::new(ledger) });
        all.push((dev.ordinal, Arc::downgrade(&b)));
        b
    }
}

/// One group's share of its device's ledger, and what memory_stats reports of it.
pub struct SmShare {
    budget: Arc<DeviceBudget>,
    group: u64,
    /// The SMs the group's launches are held within, with every other group's beside them.
    pub limit: u32,
    /// SMs a collective kernel of the group holds (a copy-engine barrier holds 1).
    pub collective_sms: u32,
    /// Blocks of the group's collective kernels resident per SM, the fewest of any
    /// (`Kernels::min_blocks_per_sm`): the SMs of a grid of another size, `sms_of` (the
    /// copy-engine reduce_scatter's reduce kernel, cuda/engine/copy.rs).
    pub collective_per_sm: u32,
    /// SMs a send/recv kernel of the group holds (a copy-engine send/recv's signals hold 1).
    pub p2p_sms: u32,
    /// Launches that had to wait for another group's.
    waited: AtomicU64,
}

impl SmShare {
    /// Join the ledger of `dev`, a GPU of `sms` SMs, as a new group. A group that was alone
    /// on the device counted none of its launches: the device is synchronized first, under
    /// the ledger's lock, so that none of them still runs when counting starts again.
    pub fn join(dev: &Device, sms: u32, limit: u32, collective_per_sm: u32, collective_sms: u32, p2p_sms: u32) -> Result<SmShare> {
        let budget = DeviceBudget::shared(dev, sms);
        let group = GROUPS.fetch_add(1, Ordering::Relaxed);
        let mut g = budget.ledger.lock();
        if g.live.len() == 1 {
            let _ctx = dev.bind()?;
            // SAFETY: a plain synchronize of the context `dev` just made current.
            check(unsafe { cu::cuCtxSynchronize() }, "cuCtxSynchronize (SM budget: a second group joins the device)")?;
        }
        g.live.push(group);
        drop(g);
        Ok(SmShare { budget, group, limit, collective_sms, collective_per_sm, p2p_sms, waited: AtomicU64::new(0) })
    }

    /// The device's SM count.
    pub fn device_sms(&self) -> u32 {
        self.budget.sms
    }

    /// How many of the group's launches waited for another group's.
    pub fn waits(&self) -> u64 {
        self.waited.load(Ordering::Relaxed)
    }

    /// Before an eager launch of `sms` SMs on `l.target`, after `Order::begin` and under the
    /// lock of `o` (the group's): release what ended, make the target wait on what must end
    /// first (NOTE [SM budget]). The returned admission holds the device's ledger until
    /// `hold` records the launch's end; dropped without it (the launch failed), it records
    /// nothing.
    pub fn admit(&self, o: &mut Order, l: &Launch, sms: u32) -> Result<Admission<'_>> {
        let mut g = self.budget.ledger.lock();
        // Alone on the device: nothing to count (the module's note, "Cost").
        if g.live.len() == 1 && g.held.is_empty() && g.parked.is_empty() {
            let held = Held { seq: g.next, group: self.group, streams: [l.target; 2], chained: l.chained(), sms, after: 0 };
            return Ok(Admission { ledger: g, held, alone: true });
        }
        let Ledger { next, held, events, parked, live, scratch, ended } = &mut *g;
        let mut i = 0;
        while i < parked.len() {
            if parked[i].0 == self.group {
                o.give_back(parked.swap_remove(i).1);
            } else {
                i += 1;
            }
        }
        sweep(held, *next, |i| query_ended(&events[i]), ended);
        let mut i = 0;
        for &done in ended.iter() {
            if !done {
                i += 1;
                continue;
            }
            let (h, ev) = (held.remove(i), events.remove(i));
            if h.group == self.group {
                o.give_back(ev);
            } else if live.contains(&h.group) {
                parked.push((h.group, ev));
            }
        }
        let c = Claim { group: self.group, target: l.target, caller: l.caller, chained: l.chained(), sms, limit: self.limit };
        let d = decide(held, *next, &c, scratch);
        for (ev, _) in events.iter().zip(scratch.marks.iter()).filter(|(_, m)| **m == Mark::Wait) {
            // SAFETY: a live event of this device, recorded (the ledger holds only recorded
            // ones); `l.target` is a live stream of its context (`Order::begin` used it).
            check(unsafe { cu::cuStreamWaitEvent(l.target as CUstream, ev.raw(), 0) }, "cuStreamWaitEvent (SM budget)")?;
        }
        if d.waits > 0 {
            self.waited.fetch_add(1, Ordering::Relaxed);
        }
        if !d.fits {
            tracing::debug!(
                device = self.budget.ordinal,
                sms,
                beside = d.beside,
                limit = self.limit,
                "rsccl: a launch runs beside more of its own group's SMs than the limit"
            );
        }
        let also = if !l.asynchronous && l.target != l.caller { l.caller } else { l.target };
        let h = Held { seq: *next, group: self.group, streams: [l.target, also], chained: l.chained(), sms, after: d.after };
        Ok(Admission { ledger: g, held: h, alone: false })
    }
}

impl Drop for SmShare {
    fn drop(&mut self) {
        let mut g = self.budget.ledger.lock();
        g.live.retain(|&x| x != self.group);
        g.parked.retain(|(x, _)| *x != self.group);
    }
}

/// A launch admitted to its device's ledger (holding its lock) until `hold`.
pub struct Admission<'a> {
    ledger: MutexGuard<'a, Ledger>,
    held: Held,
    /// Its group is alone on the device: nothing is recorded.
    alone: bool,
}

impl Admission<'_> {
    /// After the launch was enqueued: record its end on its target, with an event of the
    /// group's pool `o`, and count it until that event completes.
    pub fn hold(mut self, o: &mut Order) -> Result<()> {
        if self.alone {
            return Ok(());
        }
        let ev = o.record(self.held.streams[0])?;
        let g = &mut *self.ledger;
        g.held.push(self.held);
        g.events.push(ev);
        g.next += 1;
        Ok(())
    }
}

/// Whether `ev`'s record completed (an error, a failed context, counts as ended: nothing
/// of it runs any more).
fn query_ended(ev: &Event) -> bool {
    // SAFETY: a live event of the ledger's device, whose context the caller made current.
    let r = unsafe { cu::cuEventQuery(ev.raw()) };
    r != cu::CUresult::CUDA_ERROR_NOT_READY
}

#[cfg(test)]
mod tests {
    use super::*;

    const INTERNAL: [u64; 3] = [101, 102, 103];

    fn held(seq: u64, group: u64, stream: u64, sms: u32, after: u64) -> Held {
        Held { seq, group, streams: [stream, stream], chained: true, sms, after }
    }

    fn claim(group: u64, stream: u64, sms: u32) -> Claim {
        Claim { group, target: stream, caller: stream, chained: true, sms, limit: 132 }
    }

    /// Run `decide` and return (decision, indices marked Wait).
    fn run(h: &[Held], next: u64, c: &Claim) -> (Decision, Vec<usize>) {
        let mut s = Scratch::default();
        let d = decide(h, next, c, &mut s);
        let w = s.marks.iter().enumerate().filter(|(_, m)| **m == Mark::Wait).map(|(i, _)| i).collect();
        (d, w)
    }

    #[test]
    fn whole_sms_per_kernel() {
        assert_eq!(sms_of(64, 1), 64);
        assert_eq!(sms_of(32, 2), 16);
        assert_eq!(sms_of(9, 2), 5);
        assert_eq!(sms_of(1, 1), 1); // a copy-engine barrier
        assert_eq!(sms_of(7, 0), 7); // never a division by zero
    }

    #[test]
    fn three_groups_of_64_sms_on_132() {
        // Groups 1 and 2 fit together (128); group 3 waits on the oldest, group 1's.
        let h = [held(0, 1, INTERNAL[0], 64, 0), held(1, 2, INTERNAL[1], 64, 0)];
        let (d, w) = run(&h, 2, &claim(3, INTERNAL[2], 64));
        assert_eq!((d.waits, d.beside, d.fits, w), (1, 64, true, vec![0]));
        assert_eq!(d.after, bit(2, 0));
        // The second one alone fits beside group 1's: no wait.
        let (d, w) = run(&h[..1], 1, &claim(2, INTERNAL[1], 64));
        assert_eq!((d.waits, d.fits, w), (0, true, vec![]));
    }

    #[test]
    fn what_a_launch_starts_after_is_not_counted() {
        // Round 2 of the three groups. Group 3's first waits on group 1's first (bit 1 of
        // seq 2: launch 0).
        let h = [held(0, 1, INTERNAL[0], 64, 0), held(1, 2, INTERNAL[1], 64, 0), held(2, 3, INTERNAL[2], 64, 1 << 1)];
        // Group 1, round 2, follows its first (the chain); beside it may run 2's and 3's
        // (128): it waits on the chain with the oldest launch, group 2's.
        let (d, w) = run(&h, 3, &claim(1, INTERNAL[0], 64));
        assert_eq!((d.waits, d.beside, w), (1, 64, vec![1]));
        let a2 = Held { seq: 3, group: 1, streams: [INTERNAL[0]; 2], chained: true, sms: 64, after: d.after };
        // Group 2, round 2, follows its first (the chain); beside it may run group 1's
        // chain (its first and second: one at a time, 64) and 3's first (64): too many.
        // Group 1's chain has the oldest launch: it waits on that chain's newest, 1's
        // second, which also ends after its first. 3's first may run beside it.
        let h2 = [h[0], h[1], h[2], a2];
        let (d, w) = run(&h2, 4, &claim(2, INTERNAL[1], 64));
        assert_eq!((d.waits, d.beside, d.fits, w), (1, 64, true, vec![3]));
        assert_eq!(d.after, bit(4, 0) | bit(4, 1) | bit(4, 3));
        // Group 3, round 2, follows its first, and through it 1's first; beside it: 2's
        // first and 1's second: it waits on the older chain's, 2's.
        let (d, w) = run(&h2, 4, &claim(3, INTERNAL[2], 64));
        assert_eq!((d.waits, d.beside, w), (1, 64, vec![1]));
        // A wait on a launch that another waited one starts after is not made twice.
        let (d, w) = run(&h2, 4, &Claim { limit: 64, ..claim(3, INTERNAL[2], 64) });
        assert_eq!((d.waits, d.beside, d.fits, w), (1, 0, true, vec![3]));
    }

    #[test]
    fn a_deep_queue_counts_once() {
        // The CPU ran ten rounds ahead of the GPU: groups 1 and 2 have ten collectives
        // queued each, of which one at a time runs.
        let h: Vec<Held> = (0..20).map(|k| held(k, 1 + k % 2, INTERNAL[(k % 2) as usize], 32, 0)).collect();
        let (d, w) = run(&h, 20, &claim(3, INTERNAL[2], 32));
        assert_eq!((d.waits, d.beside, d.fits, w), (0, 64, true, vec![]));
        // Of 64 SMs each: it waits on group 1's newest, the chain with the oldest launch.
        let h: Vec<Held> = h.iter().map(|x| Held { sms: 64, ..*x }).collect();
        let (d, w) = run(&h, 20, &claim(3, INTERNAL[2], 64));
        assert_eq!((d.waits, d.beside, w), (1, 64, vec![18]));
    }

    #[test]
    fn never_waits_on_its_own_group() {
        // Group 1 has a collective and both send/recv kernels (16 SMs each) in flight on its
        // own streams; group 2's collective and group 1's next send do not fit together.
        let p2p = |seq, stream| Held { seq, group: 1, streams: [stream, stream], chained: false, sms: 16, after: 0 };
        let h = [held(0, 2, INTERNAL[1], 64, 0), held(1, 1, INTERNAL[0], 64, 0), p2p(2, 201), p2p(3, 202)];
        let send = Claim { group: 1, target: 201, caller: 7, chained: false, sms: 16, limit: 132 };
        // Beside it: group 2's 64, its own collective's 64, its recv's 16 (the earlier send is
        // on its stream): 144 + 16 > 132: it waits on group 2's only.
        let (d, w) = run(&h, 4, &send);
        assert_eq!((d.waits, d.beside, d.fits, w), (1, 80, true, vec![0]));
        // Only its own group's in flight, too many for the limit: no wait, not "fits".
        let (d, w) = run(&h[1..], 4, &Claim { limit: 90, ..send });
        assert_eq!((d.waits, d.fits, w), (0, false, vec![]));
        // A collective of group 1 follows its own chain: its earlier collective is not
        // counted, its send/recv are, group 2's is waited on.
        let (d, w) = run(&h, 4, &claim(1, INTERNAL[0], 64));
        assert_eq!((d.waits, d.beside, w), (1, 32, vec![0]));
    }

    #[test]
    fn send_recv_beside_two_collectives() {
        // Two groups' collectives (128 of 132 SMs) and a send of 16 SMs: it waits on the
        // older collective, then fits beside the other.
        let h = [held(0, 1, INTERNAL[0], 64, 0), held(1, 2, INTERNAL[1], 64, 0)];
        let send = Claim { group: 3, target: 301, caller: 7, chained: false, sms: 16, limit: 132 };
        let (d, w) = run(&h, 2, &send);
        assert_eq!((d.waits, d.beside, w), (1, 64, vec![0]));
        // Of 2 SMs, it fits beside both.
        let (d, _) = run(&h, 2, &Claim { sms: 2, ..send });
        assert_eq!((d.waits, d.fits), (0, true));
    }

    #[test]
    fn the_caller_stream_orders_like_the_target() {
        // Group 1's blocking collective ran on the internal stream and the caller's stream 7
        // waited on it; group 2's launch from stream 7 starts after it: nothing to wait on.
        let h = [Held { seq: 0, group: 1, streams: [INTERNAL[0], 7], chained: true, sms: 64, after: 0 }, held(1, 3, 9, 64, 0)];
        let c = Claim { group: 2, target: INTERNAL[1], caller: 7, chained: true, sms: 64, limit: 132 };
        let (d, w) = run(&h, 2, &c);
        assert_eq!((d.waits, d.beside, w), (0, 64, vec![]));
        // The per-thread default stream is never "the same stream".
        let h = [held(0, 1, PER_THREAD_STREAM, 64, 0), held(1, 3, 9, 64, 0)];
        let c = Claim { target: PER_THREAD_STREAM, caller: PER_THREAD_STREAM, ..c };
        assert_eq!(run(&h, 2, &c).1, vec![0]);
    }

    #[test]
    fn completed_launches_are_released_and_running_streams_asked_once() {
        // Stream A: launches 0, 2 (2 after 0); stream B: 1, 3 (3 after 1). A has ended, B's
        // first is still running: 3 is known to be running without a query.
        let h = [held(0, 1, 1, 64, 0), held(1, 2, 2, 64, 0), held(2, 1, 1, 64, 1 << 1), held(3, 2, 2, 64, 1 << 1)];
        let mut ended = Vec::new();
        let mut asked = Vec::new();
        let n = sweep(
            &h,
            4,
            |i| {
                asked.push(i);
                h[i].streams[0] == 1
            },
            &mut ended,
        );
        assert_eq!((n, asked, ended), (3, vec![0, 1, 2], vec![true, false, true, false]));
        // What is left is one chain, one launch at a time: a third group's 64 fits beside.
        let left = [h[1], h[3]];
        let (d, w) = run(&left, 4, &claim(3, 3, 64));
        assert_eq!((d.waits, d.beside, w), (0, 64, vec![]));
    }

    #[test]
    fn old_launches_are_forgotten_safely() {
        // A launch 100 launches back is past the bits: counted, and waited on if needed.
        let h = [held(0, 1, 1, 64, 0), held(99, 2, 2, 64, 0)];
        let (d, w) = run(&h, 100, &claim(3, 3, 64));
        assert_eq!((d.waits, w, d.fits), (1, vec![0], true));
        assert_eq!(d.after, 0); // past the window: later launches count it again
    }
}
