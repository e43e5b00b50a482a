//! The host engine: collectives and send/recv among the ranks of one host, through the
//! group's shared region, on two threads per group (collectives in submission order;
//! point-to-point messages progressed concurrently, so a rank can send and receive at
//! once as batch_isend_irecv needs).
//!
//! Collectives run in rounds. In a round a rank writes only the staging of the round's
//! parity (`epoch % 2`), passes the barrier that closes the round, then may read any
//! rank's staging of that parity until it arrives at the next barrier. Why that is safe:
//! the next write to a parity-q buffer happens two rounds later, after the barrier that
//! every rank reaches only once it has finished reading; and the barrier's release/acquire
//! chain (see `ControlBlock`) makes each round's writes visible to every reader.
//!
//! Where each part lives: the shared state, the queues and the engine's entry points here;
//! the collectives' rounds in coll.rs; send/recv in p2p/ (matching, timeouts and failures
//! in p2p/mod.rs, moving a message through its channel in p2p/progress.rs).

mod coll;
mod p2p;
mod translate;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{Engine, GroupStats, MemoryStats, NotRun, Ran};
use crate::bootstrap::LocalMesh;
use crate::collective::op::Op;
use crate::collective::validate;
use crate::collective::Collective;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::memory::layout::{ChannelCtrl, ControlBlock, ERROR_TEXT_BYTES};
use crate::memory::{HostRegion, Layout};
use crate::sync::{futex_wake_all, WaitGuard};
use crate::work::WorkState;

use coll::{collective_thread, execute, BusyToken, CollExec};
use p2p::P2pExec;
pub(crate) use translate::{HostCall, P2p};

/// State shared by the group's threads.
struct Shared {
    region: HostRegion,
    layout: Layout,
    cfg: Config,
    me: usize,
    n: usize,
    mesh: Arc<LocalMesh>,
    pids: Vec<u32>,
    /// Global rank of each group rank, for messages; set (once) only for subgroups.
    global: std::sync::OnceLock<Vec<usize>>,
    shutdown: AtomicBool,
    /// Set once a collective failed in a way that leaves the shared state out of step.
    broken: Mutex<Option<Error>>,
    collectives: AtomicU64,
    p2p_messages: AtomicU64,
    staged_bytes: AtomicU64,
}

impl Shared {
    fn ctrl(&self) -> &ControlBlock {
        // SAFETY: the region starts with a ControlBlock (Layout reserves CONTROL_BYTES at
        // offset 0, page-aligned). Every field other processes write is an atomic or an
        // UnsafeCell, so a shared reference to it is sound; a zeroed block is the valid
        // initial state (memfd pages start zeroed).
        unsafe { &*(self.region.base() as *const ControlBlock) }
    }

    fn channel(&self, src: usize, dst: usize) -> &ChannelCtrl {
        // SAFETY: Layout places a ChannelCtrl at the page-aligned start of every channel;
        // its shared fields are atomics or UnsafeCells, zero is their initial state;
        // src != dst is checked by callers.
        unsafe { &*(self.region.at(self.layout.channel(src, dst)) as *const ChannelCtrl) }
    }

    fn ring(&self, rank: usize) {
        let bell = &self.ctrl().doorbells[rank].0;
        bell.fetch_add(1, Ordering::Release);
        futex_wake_all(bell);
    }

    /// Group rank `r` as messages name it: in a subgroup also its global rank, so a user
    /// reading a timeout knows which process is meant.
    fn who(&self, r: usize) -> String {
        match self.global.get().and_then(|g| g.get(r)) {
            Some(g) => format!("group rank {r} (global rank {g})"),
            None => format!("rank {r}"),
        }
    }

    fn pid(&self, r: usize) -> u32 {
        self.pids.get(r).copied().unwrap_or(0)
    }

    /// Tell every local rank the group is aborted, and why (first writer wins).
    /// abort_flag: 0 = none, 1 = text being written, 2 = text ready.
    fn abort(&self, why: &Error) {
        let c = self.ctrl();
        if c.abort_flag.0.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            let text = why.to_string();
            // SAFETY: only the rank that won the compare_exchange writes these fields,
            // once; readers read them only after observing abort_flag == 2 (Release below).
            unsafe {
                let t = &mut *c.abort_text.get();
                let n = text.len().min(t.len());
                t[..n].copy_from_slice(&text.as_bytes()[..n]);
                *c.abort_len.get() = n as u32;
                *c.abort_rank.get() = self.me as u32;
                *c.abort_class.get() = why.class_code() as u32;
            }
            c.abort_flag.0.store(2, Ordering::Release);
        }
        futex_wake_all(&c.barrier.0);
        for r in 0..self.n {
            self.ring(r);
        }
    }

    fn abort_error(&self) -> Option<Error> {
        let c = self.ctrl();
        let f = c.abort_flag.0.load(Ordering::Acquire);
        if f == 0 {
            return None;
        }
        // The aborting rank is writing its reason (bounded work): give it a moment, and
        // read the reason only once it is published.
        let start = Instant::now();
        while c.abort_flag.0.load(Ordering::Acquire) != 2 {
            if start.elapsed() > Duration::from_millis(200) {
                return Some(Error::PeerFailure("another rank aborted the group (its reason is not published yet)".into()));
            }
            std::thread::yield_now();
        }
        // SAFETY: published before the Release store of abort_flag = 2 observed above,
        // and never written again.
        let (rank, len, class, text) = unsafe { (*c.abort_rank.get(), *c.abort_len.get(), *c.abort_class.get(), *c.abort_text.get()) };
        let text = String::from_utf8_lossy(&text[..(len as usize).min(text.len())]).into_owned();
        let rank = rank as usize;
        Some(Error::from_class_code(class as u8, format!("{} (pid {}) aborted the group: {text}", self.who(rank), self.pid(rank))))
    }

    /// Whom rank `r` waits for, as far as this engine can know: ", which waits for rank 3
    /// (pid 77), which is stopped" — following each rank's `waits_for` word (set by its
    /// send/recv thread) until a rank waits for nobody, or for a rank already named; and
    /// saying of each rank named whether its process is stopped (SIGSTOP, a debugger).
    fn waits_chain(&self, r: usize) -> String {
        let mut out = String::new();
        let mut seen = vec![false; self.n];
        let mut cur = r;
        seen[self.me] = true;
        loop {
            if cur >= self.n {
                break;
            }
            if process_stopped(self.pid(cur)) {
                out.push_str(", which is stopped (SIGSTOP or a debugger)");
                break;
            }
            if seen[cur] {
                break;
            }
            seen[cur] = true;
            let next = self.ctrl().waits_for[cur].0.load(Ordering::Relaxed) as usize;
            if next == 0 || next > self.n {
                break;
            }
            cur = next - 1;
            out.push_str(&format!(", which waits for rank {cur} (pid {})", self.pid(cur)));
            if cur == self.me {
                break;
            }
        }
        out
    }

    fn dead_peers(&self) -> Option<Error> {
        let gone = self.mesh.gone();
        if gone.is_empty() {
            return None;
        }
        let who: Vec<String> = gone.iter().map(|&r| format!("rank {} (pid {})", r, self.pid(r))).collect();
        Some(Error::PeerFailure(format!("{} exited, was killed, or left the group; rank {} cannot continue", who.join(", "), self.me)))
    }
}

impl WaitGuard for Shared {
    fn check(&self) -> Result<()> {
        if self.shutdown.load(Ordering::Acquire) {
            return Err(Error::destroyed_when("while an operation was waiting"));
        }
        if let Some(e) = self.abort_error() {
            return Err(e);
        }
        if let Some(e) = self.dead_peers() {
            return Err(e);
        }
        Ok(())
    }
}

/// Submitted collectives. `closed` is set under the same lock the thread drains under,
/// so a job is either run or failed, never left behind at shutdown. `busy` is the right
/// to run a collective: held by the engine thread for a queued job, or by a caller that
/// found the queue empty and runs its blocking collective on its own thread.
struct Queue<T> {
    items: Mutex<QueueState<T>>,
    cv: Condvar,
}

struct QueueState<T> {
    jobs: VecDeque<T>,
    closed: bool,
    busy: bool,
}

struct CollJob {
    c: Collective,
    timeout: Duration,
    work: Arc<WorkState>,
}

impl Drop for CollJob {
    fn drop(&mut self) {
        // Never leave a Work waiting forever, whatever path dropped this (a panic included).
        self.work.complete(Err(Error::Aborted("the collective was abandoned by the engine".into())));
    }
}

struct P2pJob {
    op: P2p,
    timeout: Duration,
    work: Arc<WorkState>,
}

pub struct HostEngine {
    sh: Arc<Shared>,
    coll: Arc<Queue<CollJob>>,
    exec: Arc<Mutex<CollExec>>,
    p2p: Arc<Mutex<P2pInbox>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// The group's timeout: how long each op run through `Engine` may wait for its peers.
    timeout: Duration,
}

impl HostEngine {
    /// Start the engine of local rank `me` of `n` over a region already shared; its ops
    /// wait `timeout` for their peers.
    pub fn start(
        region: HostRegion,
        layout: Layout,
        cfg: Config,
        me: usize,
        mesh: Arc<LocalMesh>,
        pids: Vec<u32>,
        timeout: Duration,
    ) -> Result<HostEngine> {
        let n = layout.nranks;
        let sh = Arc::new(Shared {
            region,
            layout,
            cfg,
            me,
            n,
            mesh,
            pids,
            global: std::sync::OnceLock::new(),
            shutdown: AtomicBool::new(false),
            broken: Mutex::new(None),
            collectives: AtomicU64::new(0),
            p2p_messages: AtomicU64::new(0),
            staged_bytes: AtomicU64::new(0),
        });
        let coll =
            Arc::new(Queue { items: Mutex::new(QueueState { jobs: VecDeque::new(), closed: false, busy: false }), cv: Condvar::new() });
        let exec = Arc::new(Mutex::new(CollExec {
            sh: sh.clone(),
            epoch: 0,
            seq: 0,
            check_parity: None,
            deadline: Instant::now(),
            timeout: Duration::ZERO,
            kind_name: "",
            headers: Vec::with_capacity(n),
        }));
        let p2p = Arc::new(Mutex::new(P2pInbox { jobs: VecDeque::new(), closed: false }));
        let t1 = {
            let (sh, coll, exec) = (sh.clone(), coll.clone(), exec.clone());
            std::thread::Builder::new()
                .name(format!("rsccl-coll-{me}"))
                .spawn(move || collective_thread(sh, coll, exec))
                .map_err(|e| Error::os("starting the collective thread", e))?
        };
        let t2 = {
            let (sh, p2p) = (sh.clone(), p2p.clone());
            std::thread::Builder::new()
                .name(format!("rsccl-p2p-{me}"))
                .spawn(move || P2pExec::new(sh, p2p).run())
                .map_err(|e| Error::os("starting the send/recv thread", e))?
        };
        Ok(HostEngine { sh, coll, exec, p2p, threads: Mutex::new(vec![t1, t2]), timeout })
    }
}

impl Engine for HostEngine {
    fn name(&self) -> &'static str {
        "host"
    }

    /// `HostCall::from_op` (translate.rs), then queued or, blocking, run now.
    fn run(self: Arc<Self>, op: &mut Op, rank: usize, size: usize) -> std::result::Result<Ran, NotRun> {
        let call = HostCall::from_op(op, rank, size).map_err(NotRun::Arguments)?;
        Ok(self.run_call(call)?)
    }

    /// `Collective::Invalid`: its Work fails with the error the ranks agree on (every
    /// invalid rank's message); blocking, that error is returned.
    fn join_invalid(self: Arc<Self>, op: &Op, error: Error) -> Result<Ran> {
        self.run_call(HostCall::Collective { c: Collective::Invalid { kind: op.kind, error }, blocking: op.blocking })
    }

    fn add_stats(&self, stats: &mut GroupStats) {
        stats.host = self.stats();
    }

    fn name_global_ranks(&self, global: Vec<usize>) {
        let _ = self.sh.global.set(global); // named once, at creation
    }

    fn shutdown(&self) {
        {
            // Under the queue lock: the collective thread either sees the flag before it
            // sleeps or is already asleep and gets this notification.
            let mut q = self.coll.items.lock();
            q.closed = true;
            self.sh.shutdown.store(true, Ordering::Release);
            self.coll.cv.notify_all();
        }
        self.sh.ring(self.sh.me);
        futex_wake_all(&self.sh.ctrl().barrier.0);
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
    }
}

impl HostEngine {
    /// Run a translated call with the group's timeout.
    fn run_call(&self, call: HostCall) -> Result<Ran> {
        Ok(match call {
            HostCall::Collective { c, blocking: true } => {
                self.run_now(c, self.timeout)?;
                Ran::Done
            }
            HostCall::Collective { c, blocking: false } => Ran::Work(self.submit(c, self.timeout)),
            HostCall::P2p(p) => Ran::Work(self.submit_p2p(p, self.timeout)),
        })
    }

    /// Queue collective `c`; its Work completes when it ran.
    pub fn submit(&self, c: Collective, timeout: Duration) -> Arc<WorkState> {
        let work = Arc::new(WorkState::new());
        let job = CollJob { c, timeout, work: work.clone() };
        {
            let mut q = self.coll.items.lock();
            if q.closed {
                drop(q);
                drop(job); // completes the Work with Aborted, outside the lock
                return work;
            }
            q.jobs.push_back(job);
        }
        self.coll.cv.notify_all();
        work
    }

    /// Run `c` and return when it completed, after every collective submitted before it.
    pub fn run_now(&self, c: Collective, timeout: Duration) -> Result<()> {
        {
            let mut q = self.coll.items.lock();
            if q.closed {
                return Err(Error::destroyed());
            }
            if q.busy || !q.jobs.is_empty() {
                drop(q);
                // Earlier collectives are queued: keep the order, wait for ours.
                return self.submit(c, timeout).wait(None);
            }
            q.busy = true;
        }
        // The inline path saves two thread hand-offs per blocking call (the engine
        // thread's wake-up and the completion back to the caller).
        let _token = BusyToken(&self.coll);
        execute(&self.sh, &mut self.exec.lock(), &c, timeout)
    }

    /// Queue a send or recv; its Work completes when the message was moved.
    pub fn submit_p2p(&self, op: P2p, timeout: Duration) -> Arc<WorkState> {
        let work = Arc::new(WorkState::new());
        let what = if matches!(op, P2p::Send { .. }) { "send" } else { "recv" };
        if let Some(Err(e)) = op.peer().map(|p| validate::peer(what, self.sh.me, p as i64, self.sh.n)) {
            work.complete(Err(e));
            return work;
        }
        if let Err(e) = op.check_tag(self.sh.me) {
            // The peer hears of it through the channel between the two, as of a mismatch:
            // its operations on that channel fail with this message instead of waiting
            // (and the channel stays ended, see ChannelCtrl::poisoned).
            // A recv from any source has no one channel: it fails here alone.
            let ch = match op {
                P2p::Send { peer, .. } => Some((self.sh.channel(self.sh.me, peer), peer)),
                P2p::Recv { peer, .. } => Some((self.sh.channel(peer, self.sh.me), peer)),
                P2p::RecvAny { .. } => None,
            };
            if let Some((ch, peer)) = ch {
                poison(ch, &e);
                self.sh.ring(peer);
            }
            work.complete(Err(e));
            return work;
        }
        {
            let mut inbox = self.p2p.lock();
            if !inbox.closed {
                inbox.jobs.push_back(P2pJob { op, timeout, work: work.clone() });
                drop(inbox);
                self.sh.ring(self.sh.me);
                return work;
            }
        }
        work.complete(Err(Error::destroyed()));
        work
    }

    /// What the host engine reserved, mapped and moved.
    pub fn stats(&self) -> MemoryStats {
        MemoryStats {
            host_region_bytes: self.sh.region.len() as u64,
            host_mapped_bytes: self.sh.region.len() as u64,
            collectives: self.sh.collectives.load(Ordering::Relaxed),
            p2p_messages: self.sh.p2p_messages.load(Ordering::Relaxed),
            staged_bytes: self.sh.staged_bytes.load(Ordering::Relaxed),
        }
    }
}

impl Drop for HostEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// New p2p jobs, and whether the engine still takes them (flipped under the same lock,
/// so no job can slip in after the thread's last drain).
struct P2pInbox {
    jobs: VecDeque<P2pJob>,
    closed: bool,
}

impl Drop for P2pInbox {
    fn drop(&mut self) {
        // Jobs still here when the engine goes away (its thread died) must not hang.
        for job in self.jobs.drain(..) {
            job.work.complete(Err(Error::Aborted("the send/recv was abandoned by the engine".into())));
        }
    }
}

/// Whether process `pid` is stopped (state T or t in /proc/<pid>/stat): a peer that waits
/// forever without having died.
fn process_stopped(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // The state follows the command name, which is in parentheses and may hold spaces.
    stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).is_some_and(|st| st == "T" || st == "t")
}

/// `ChannelCtrl::poisoned` while the poisoning end writes the text.
const POISON_WRITING: u32 = u32::MAX;

/// Mark channel `ch` failed with `e`, for whichever side reads it next.
fn poison(ch: &ChannelCtrl, e: &Error) {
    let text = e.to_string();
    let b = &text.as_bytes()[..text.len().min(ERROR_TEXT_BYTES)];
    // Either end may poison; the compare_exchange elects one writer of the text.
    if ch.poisoned.0.compare_exchange(0, POISON_WRITING, Ordering::AcqRel, Ordering::Acquire).is_err() {
        return; // the first failure's text stands
    }
    // SAFETY: only the end that won the compare_exchange writes the text, once; readers
    // read it only after an Acquire load sees the final code (Release store below).
    unsafe {
        let t = &mut *ch.error_text.get();
        t[..b.len()].copy_from_slice(b);
        *ch.error_len.get() = b.len() as u32;
    }
    ch.poisoned.0.store(e.class_code() as u32, Ordering::Release);
}
