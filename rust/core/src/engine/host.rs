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

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{Engine, MemoryStats, P2p};
use crate::bootstrap::LocalMesh;
use crate::collective::{agree, choose_allreduce, reduce::reduce, AllReduceAlgo, Buf, Collective};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::memory::layout::{ChannelCtrl, CollHeader, ControlBlock, MsgHeader, ERROR_TEXT_BYTES};
use crate::memory::{HostRegion, Layout};
use crate::sync::{futex_wait, futex_wake_all, wait_until, WaitGuard, SLICE};
use crate::work::WorkState;

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
            return Err(Error::Aborted("the group was destroyed while an operation was waiting".into()));
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
}

impl HostEngine {
    /// Start the engine of local rank `me` of `n` over a region already shared.
    pub fn start(region: HostRegion, layout: Layout, cfg: Config, me: usize, mesh: Arc<LocalMesh>, pids: Vec<u32>) -> Result<HostEngine> {
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
        Ok(HostEngine { sh, coll, exec, p2p, threads: Mutex::new(vec![t1, t2]) })
    }
}

impl Engine for HostEngine {
    fn submit(&self, c: Collective, timeout: Duration) -> Arc<WorkState> {
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

    fn run_now(&self, c: Collective, timeout: Duration) -> Result<()> {
        {
            let mut q = self.coll.items.lock();
            if q.closed {
                return Err(Error::Aborted("the group was destroyed".into()));
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

    fn submit_p2p(&self, op: P2p, timeout: Duration) -> Arc<WorkState> {
        let work = Arc::new(WorkState::new());
        if let Some(peer) = op.peer().filter(|&p| p >= self.sh.n || p == self.sh.me) {
            work.complete(Err(Error::InvalidArgument(format!(
                "send/recv peer {peer} is invalid for rank {} of a group of size {}",
                self.sh.me, self.sh.n
            ))));
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
        work.complete(Err(Error::Aborted("the group was destroyed".into())));
        work
    }

    fn stats(&self) -> MemoryStats {
        MemoryStats {
            host_region_bytes: self.sh.region.len() as u64,
            host_mapped_bytes: self.sh.region.len() as u64,
            collectives: self.sh.collectives.load(Ordering::Relaxed),
            p2p_messages: self.sh.p2p_messages.load(Ordering::Relaxed),
            staged_bytes: self.sh.staged_bytes.load(Ordering::Relaxed),
        }
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

impl Drop for HostEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn collective_thread(sh: Arc<Shared>, q: Arc<Queue<CollJob>>, exec: Arc<Mutex<CollExec>>) {
    loop {
        let job = {
            let mut st = q.items.lock();
            loop {
                // `busy` means a caller is running a collective inline: wait for it, so
                // collectives keep their submission order.
                if !st.busy {
                    if let Some(j) = st.jobs.pop_front() {
                        st.busy = true;
                        break Some(j);
                    }
                }
                if st.closed && st.jobs.is_empty() {
                    break None;
                }
                q.cv.wait(&mut st);
            }
        };
        let Some(job) = job else { return };
        let r = {
            let _token = BusyToken(&q);
            execute(&sh, &mut exec.lock(), &job.c, job.timeout)
        };
        job.work.complete(r);
    }
}

/// The right to run collectives, released when dropped, unwinding included: a holder that
/// never gave it back would stall every later collective and shutdown.
struct BusyToken<'a>(&'a Queue<CollJob>);

impl Drop for BusyToken<'_> {
    fn drop(&mut self) {
        self.0.items.lock().busy = false;
        self.0.cv.notify_all();
    }
}

/// Run one collective with the group's abort bookkeeping; shared by the engine thread and
/// callers running inline.
fn execute(sh: &Shared, exec: &mut CollExec, c: &Collective, timeout: Duration) -> Result<()> {
    let broken = sh.broken.lock().clone();
    match broken {
        Some(e) => Err(Error::Aborted(format!("the group was aborted by an earlier error: {e}"))),
        None if sh.shutdown.load(Ordering::Acquire) => Err(Error::Aborted("the group was destroyed".into())),
        None => {
            // A panic here is a bug; it must become an error, not a Work that never completes.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| exec.run(c, timeout)))
                .unwrap_or_else(|_| Err(Error::Internal("a collective panicked; see stderr".into())));
            if let Err(e) = &r {
                if !e.keeps_group_usable() {
                    tracing::warn!(rank = sh.me, error = %e, "collective failed; aborting the group");
                    *sh.broken.lock() = Some(e.clone());
                    sh.abort(e);
                }
            }
            r
        }
    }
}

/// Runs collectives; owns the barrier epoch and the collective sequence number.
struct CollExec {
    sh: Arc<Shared>,
    epoch: u32,
    seq: u64,
    /// Parity whose headers the next barrier must check (the collective's first round).
    check_parity: Option<usize>,
    deadline: Instant,
    timeout: Duration,
    kind_name: &'static str,
    /// Every rank's header of the current collective, for the agreement check.
    headers: Vec<CollHeader>,
}

/// Chunks of `count` elements, `per` at a time; at least one (possibly empty) chunk so
/// every collective has a round that carries its header.
fn chunks(count: usize, per: usize) -> impl Iterator<Item = (usize, usize)> {
    let per = per.max(1);
    let n = count.div_ceil(per).max(1);
    (0..n).map(move |i| (i * per, per.min(count - (i * per).min(count))))
}

/// # Safety
/// `src` valid for `len` reads, `dst` for `len` writes, not overlapping.
#[inline]
unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
    if len > 0 {
        std::ptr::copy_nonoverlapping(src, dst, len);
    }
}

impl CollExec {
    fn parity(&self) -> usize {
        (self.epoch & 1) as usize
    }

    fn slot(&self, rank: usize, parity: usize) -> *mut u8 {
        self.sh.region.at(self.sh.layout.coll_slot(rank, parity))
    }

    fn half(&self) -> usize {
        self.sh.layout.coll_half
    }

    /// Close the current round: the barrier of `ControlBlock`, then (first round of a
    /// collective) the agreement check on every rank's header.
    fn sync(&mut self) -> Result<()> {
        let (me, n) = (self.sh.me, self.sh.n);
        let parity = self.parity();
        self.epoch = self.epoch.wrapping_add(1);
        let epoch = self.epoch;
        let ctrl = self.sh.ctrl();
        ctrl.arrivals[me].0.store(epoch, Ordering::Relaxed);
        let target = epoch.wrapping_mul(n as u32);
        let prev = ctrl.barrier.0.fetch_add(1, Ordering::AcqRel);
        if prev.wrapping_add(1) == target {
            futex_wake_all(&ctrl.barrier.0);
        } else {
            let sh = self.sh.clone();
            let (seq, kind, timeout) = (self.seq, self.kind_name, self.timeout);
            wait_until(
                &ctrl.barrier.0,
                |v| v.wrapping_sub(target) as i32 >= 0,
                self.sh.cfg.spin_count,
                self.deadline,
                &*self.sh,
                || {
                    let c = sh.ctrl();
                    let missing: Vec<String> = (0..n)
                        .filter(|&r| (c.arrivals[r].0.load(Ordering::Relaxed).wrapping_sub(epoch) as i32) < 0)
                        .map(|r| format!("{} (pid {}){}", sh.who(r), sh.pid(r), sh.waits_chain(r)))
                        .collect();
                    format!(
                        "{}: Timed out after {:.1} s in {kind} (collective #{seq} of this group) \
                         waiting for {}: they have not called it",
                        sh.who(me),
                        timeout.as_secs_f64(),
                        missing.join(", ")
                    )
                },
            )?;
        }
        // A rank that arrives after the others aborted can find the barrier complete (their
        // arrivals counted); the abort flag, set before they left, tells it the truth.
        if let Some(e) = self.sh.abort_error() {
            return Err(e);
        }
        if let Some(p) = self.check_parity.take() {
            debug_assert_eq!(p, parity);
            // Reused buffer: the collective path allocates nothing.
            self.headers.clear();
            for r in 0..n {
                // SAFETY: headers of this parity were written before the barrier just
                // passed and are not rewritten until the barrier after next.
                let h = unsafe { std::ptr::read(self.sh.region.at(self.sh.layout.header(p, r)) as *const CollHeader) };
                self.headers.push(h);
            }
            agree(&self.headers)?;
        }
        Ok(())
    }

    fn header(&self, parity: usize, rank: usize) -> CollHeader {
        // SAFETY: see `sync`: read within the window in which headers are stable.
        unsafe { std::ptr::read(self.sh.region.at(self.sh.layout.header(parity, rank)) as *const CollHeader) }
    }

    fn run(&mut self, c: &Collective, timeout: Duration) -> Result<()> {
        let (me, n) = (self.sh.me, self.sh.n);
        if let Some(e) = self.sh.abort_error() {
            return Err(e);
        }
        self.seq += 1;
        self.timeout = timeout;
        self.deadline = Instant::now() + timeout;
        self.kind_name = c.kind().name();
        self.sh.collectives.fetch_add(1, Ordering::Relaxed);
        let local = c.check_local(me, n);
        let q = self.parity();
        let h = c.header(self.seq, &local);
        // SAFETY: this rank's header slot of parity q is ours to write in this round.
        unsafe { std::ptr::write(self.sh.region.at(self.sh.layout.header(q, me)) as *mut CollHeader, h) };
        self.check_parity = Some(q);
        if local.is_err() {
            // Take part in the agreement step so every rank raises this error.
            return self.sync();
        }
        // SAFETY (for every `copy` and `reduce` below): user buffers are valid for their
        // `len` (the Python Work keeps the tensors alive); offsets stay within `len` by the
        // chunk arithmetic and `check_local`/`agree`; staging offsets stay within one half
        // because every per-round amount is bounded by `half()`.
        unsafe {
            match c {
                Collective::AllReduce { buf, dtype, op } => self.all_reduce(*buf, *dtype, *op),
                Collective::Broadcast { buf, root, .. } => self.broadcast(*buf, *root),
                Collective::Reduce { buf, dtype, op, root } => self.reduce_to_root(*buf, *dtype, *op, *root),
                Collective::AllGather { input, output, .. } => self.all_gather(*input, *output),
                Collective::ReduceScatter { input, output, dtype, op } => self.reduce_scatter(*input, *output, *dtype, *op),
                Collective::AllToAll { input, output, recv_bytes, send_bytes, .. } => {
                    self.all_to_all(*input, *output, send_bytes, recv_bytes)
                }
                Collective::Gather { input, output, root, .. } => self.gather(*input, *output, *root),
                Collective::Scatter { input, output, root, .. } => self.scatter(*input, *output, *root),
                Collective::Barrier => self.sync(),
                Collective::Invalid { error, .. } => Err(error.clone()),
            }
        }
    }

    fn staged(&self, bytes: usize) {
        self.sh.staged_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    unsafe fn all_reduce(&mut self, buf: Buf, dtype: crate::dtype::DType, op: crate::dtype::ReduceOp) -> Result<()> {
        let (me, n) = (self.sh.me, self.sh.n);
        let es = dtype.size();
        let count = buf.len / es;
        let (algo, why) = choose_allreduce(buf.len, n, self.sh.cfg.allreduce_one_shot_max_bytes, self.half());
        tracing::trace!(bytes = buf.len, ?algo, why, "all_reduce");
        let mut ins = [std::ptr::null::<u8>(); crate::memory::layout::MAX_LOCAL_RANKS];
        if algo == AllReduceAlgo::OneShot {
            let q = self.parity();
            copy(self.slot(me, q), buf.ptr, buf.len);
            self.staged(buf.len);
            self.sync()?;
            for (r, p) in ins.iter_mut().enumerate().take(n) {
                *p = self.slot(r, q);
            }
            reduce(buf.ptr, &ins[..n], count, dtype, op, n);
            return Ok(());
        }
        // Segments start on 64-byte boundaries so ranks never share a cache line.
        let align = (64 / es).max(1);
        for (off, m) in chunks(count, self.half() / es) {
            let q = self.parity();
            copy(self.slot(me, q), buf.ptr.add(off * es), m * es);
            self.staged(m * es);
            self.sync()?;
            let seg = m.div_ceil(n).div_ceil(align) * align;
            let q2 = self.parity();
            let (lo, hi) = ((me * seg).min(m), ((me + 1) * seg).min(m));
            for (r, p) in ins.iter_mut().enumerate().take(n) {
                *p = self.slot(r, q).add(lo * es);
            }
            reduce(self.slot(me, q2).add(lo * es), &ins[..n], hi - lo, dtype, op, n);
            self.sync()?;
            for k in 0..n {
                let (lo, hi) = ((k * seg).min(m), ((k + 1) * seg).min(m));
                copy(buf.ptr.add((off + lo) * es), self.slot(k, q2).add(lo * es), (hi - lo) * es);
            }
        }
        Ok(())
    }

    unsafe fn broadcast(&mut self, buf: Buf, root: usize) -> Result<()> {
        let me = self.sh.me;
        for (off, m) in chunks(buf.len, self.half()) {
            let q = self.parity();
            if me == root {
                copy(self.slot(root, q), buf.ptr.add(off), m);
                self.staged(m);
            }
            self.sync()?;
            if me != root {
                copy(buf.ptr.add(off), self.slot(root, q), m);
            }
        }
        Ok(())
    }

    unsafe fn reduce_to_root(&mut self, buf: Buf, dtype: crate::dtype::DType, op: crate::dtype::ReduceOp, root: usize) -> Result<()> {
        let (me, n) = (self.sh.me, self.sh.n);
        let es = dtype.size();
        let mut ins = [std::ptr::null::<u8>(); crate::memory::layout::MAX_LOCAL_RANKS];
        for (off, m) in chunks(buf.len / es, self.half() / es) {
            let q = self.parity();
            copy(self.slot(me, q), buf.ptr.add(off * es), m * es);
            self.staged(m * es);
            self.sync()?;
            if me == root {
                for (r, p) in ins.iter_mut().enumerate().take(n) {
                    *p = self.slot(r, q);
                }
                reduce(buf.ptr.add(off * es), &ins[..n], m, dtype, op, n);
            }
        }
        Ok(())
    }

    unsafe fn all_gather(&mut self, input: Buf, output: Buf) -> Result<()> {
        let (me, n) = (self.sh.me, self.sh.n);
        for (off, m) in chunks(input.len, self.half()) {
            let q = self.parity();
            copy(self.slot(me, q), input.ptr.add(off), m);
            self.staged(m);
            self.sync()?;
            for k in 0..n {
                copy(output.ptr.add(k * input.len + off), self.slot(k, q), m);
            }
        }
        Ok(())
    }

    unsafe fn reduce_scatter(&mut self, input: Buf, output: Buf, dtype: crate::dtype::DType, op: crate::dtype::ReduceOp) -> Result<()> {
        let (me, n) = (self.sh.me, self.sh.n);
        let es = dtype.size();
        let count = output.len / es;
        let mut ins = [std::ptr::null::<u8>(); crate::memory::layout::MAX_LOCAL_RANKS];
        for (off, m) in chunks(count, self.half() / (n * es)) {
            let q = self.parity();
            for r in 0..n {
                copy(self.slot(me, q).add(r * m * es), input.ptr.add((r * count + off) * es), m * es);
            }
            self.staged(n * m * es);
            self.sync()?;
            for (k, p) in ins.iter_mut().enumerate().take(n) {
                *p = self.slot(k, q).add(me * m * es);
            }
            reduce(output.ptr.add(off * es), &ins[..n], m, dtype, op, n);
        }
        Ok(())
    }

    unsafe fn gather(&mut self, input: Buf, output: Option<Buf>, root: usize) -> Result<()> {
        let (me, n) = (self.sh.me, self.sh.n);
        for (off, m) in chunks(input.len, self.half()) {
            let q = self.parity();
            copy(self.slot(me, q), input.ptr.add(off), m);
            self.staged(m);
            self.sync()?;
            if let (true, Some(out)) = (me == root, output) {
                for k in 0..n {
                    copy(out.ptr.add(k * input.len + off), self.slot(k, q), m);
                }
            }
        }
        Ok(())
    }

    unsafe fn scatter(&mut self, input: Option<Buf>, output: Buf, root: usize) -> Result<()> {
        let (me, n) = (self.sh.me, self.sh.n);
        for (off, m) in chunks(output.len, self.half() / n) {
            let q = self.parity();
            if let (true, Some(inp)) = (me == root, input) {
                for k in 0..n {
                    copy(self.slot(root, q).add(k * m), inp.ptr.add(k * output.len + off), m);
                }
                self.staged(n * m);
            }
            self.sync()?;
            copy(output.ptr.add(off), self.slot(root, q).add(me * m), m);
        }
        Ok(())
    }

    unsafe fn all_to_all(&mut self, input: Buf, output: Buf, send: &[u64], recv: &[u64]) -> Result<()> {
        let (me, n) = (self.sh.me, self.sh.n);
        // Each round moves up to `w` bytes on every (src, dst) pair; w is a multiple of
        // 64 so every window starts element-aligned.
        let w = (self.half() / n) & !63;
        let offsets = |v: &[u64]| {
            let mut o = Vec::with_capacity(v.len());
            let mut acc = 0usize;
            for x in v {
                o.push(acc);
                acc += *x as usize;
            }
            o
        };
        let (soff, roff) = (offsets(send), offsets(recv));
        let mut rounds = 1usize;
        let mut t = 0usize;
        while t < rounds {
            let q = self.parity();
            for j in 0..n {
                let total = send[j] as usize;
                let lo = (t * w).min(total);
                let len = w.min(total - lo);
                copy(self.slot(me, q).add(j * w), input.ptr.add(soff[j] + lo), len);
                self.staged(len);
            }
            self.sync()?;
            if t == 0 {
                let most = (0..n).flat_map(|r| self.header(q, r).send_bytes.into_iter().take(n)).max().unwrap_or(0);
                rounds = (most as usize).div_ceil(w).max(1);
            }
            for i in 0..n {
                let total = recv[i] as usize;
                let lo = (t * w).min(total);
                let len = w.min(total - lo);
                copy(output.ptr.add(roff[i] + lo), self.slot(i, q).add(me * w), len);
            }
            t += 1;
        }
        Ok(())
    }
}

/// One send or recv in progress.
struct Pending {
    op: P2p,
    deadline: Instant,
    timeout: Duration,
    work: Arc<WorkState>,
    /// Chunks moved so far.
    done: usize,
    /// Sends: the channel's chunk counter after this message's last chunk; the send is
    /// complete once the receiver has acked up to it.
    end: Option<u32>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        // Never leave a Work waiting forever, whatever path dropped this (a panic included).
        self.work.complete(Err(Error::Aborted("the send/recv was abandoned by the engine".into())));
    }
}

impl Pending {
    fn buf(&self) -> Buf {
        match &self.op {
            P2p::Send { buf, .. } | P2p::Recv { buf, .. } | P2p::RecvAny { buf, .. } => *buf,
        }
    }

    fn tag_dtype(&self) -> (i64, crate::dtype::DType) {
        match &self.op {
            P2p::Send { tag, dtype, .. } | P2p::Recv { tag, dtype, .. } | P2p::RecvAny { tag, dtype, .. } => (*tag, *dtype),
        }
    }

    fn started(&self) -> bool {
        self.done > 0
    }

    fn describe(&self) -> String {
        let (what, dir) = match &self.op {
            P2p::Send { peer, .. } => ("send", format!("to rank {peer}")),
            P2p::Recv { peer, .. } => ("recv", format!("from rank {peer}")),
            P2p::RecvAny { .. } => ("recv", "from any rank".to_string()),
        };
        let (tag, dtype) = self.tag_dtype();
        format!("{what} of {} {} elements {dir} (tag {tag})", self.buf().len / dtype.size(), dtype.name())
    }
}

/// Progresses every pending send and recv of this rank.
///
/// Semantics: messages from one rank to another travel in order through their channel. A
/// message goes to the oldest pending recv from that rank with the same tag (as gloo
/// matches). A send completes once the receiver has taken the whole message: into the
/// matching recv (a size or dtype objection then fails the send too), or, when no recv
/// matches it while a recv for another tag waits behind it, into a holding buffer (see
/// `Unexpected`; a later mismatch then fails only the recv). A send that the receiver
/// never takes times out.
struct P2pExec {
    sh: Arc<Shared>,
    incoming: Arc<Mutex<P2pInbox>>,
    sends: Vec<VecDeque<Pending>>,
    recvs: Vec<VecDeque<Pending>>,
    /// The recv being filled from each source's channel (matched by tag).
    active: Vec<Option<Pending>>,
    send_next: Vec<u32>,
    recv_next: Vec<u32>,
    /// A channel direction that failed mid-message cannot be trusted again.
    send_broken: Vec<Option<Error>>,
    recv_broken: Vec<Option<Error>>,
    /// Messages taken out of a channel before a recv with their tag was posted (see
    /// `Unexpected`), oldest first, per source; and their total size.
    unexpected: Vec<VecDeque<Unexpected>>,
    unexpected_bytes: Vec<usize>,
    /// Recvs from any source (`P2p::RecvAny`), oldest first: a message none of the
    /// recvs posted for its sender matches goes to the oldest of these with its tag.
    any: VecDeque<Pending>,
}

/// A message whose tag no posted recv matched while a recv for another tag waited behind
/// it. It is copied out of the channel (and acked, so its send completes) so that later
/// messages are not stuck behind it, as gloo, which matches by tag, would deliver them.
/// Bounded by `UNEXPECTED_LIMIT` per source; past that the channel waits.
struct Unexpected {
    tag: i64,
    dtype: u8,
    total: usize,
    data: Vec<u8>,
    chunks: usize,
    complete: bool,
}

const UNEXPECTED_LIMIT: usize = 64 << 20;

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

fn complete_all(items: impl IntoIterator<Item = Pending>, e: &Error) {
    for p in items {
        p.work.complete(Err(e.clone()));
    }
}

impl P2pExec {
    fn new(sh: Arc<Shared>, incoming: Arc<Mutex<P2pInbox>>) -> P2pExec {
        let n = sh.n;
        P2pExec {
            sh,
            incoming,
            sends: (0..n).map(|_| VecDeque::new()).collect(),
            recvs: (0..n).map(|_| VecDeque::new()).collect(),
            active: (0..n).map(|_| None).collect(),
            send_next: vec![0; n],
            recv_next: vec![0; n],
            send_broken: vec![None; n],
            recv_broken: vec![None; n],
            unexpected: (0..n).map(|_| VecDeque::new()).collect(),
            unexpected_bytes: vec![0; n],
            any: VecDeque::new(),
        }
    }

    fn pending(&self) -> bool {
        self.sends.iter().chain(self.recvs.iter()).chain(std::iter::once(&self.any)).any(|q| !q.is_empty())
            || self.active.iter().any(Option::is_some)
            || self.unexpected.iter().any(|q| q.back().is_some_and(|u| !u.complete))
    }

    fn run(mut self) {
        let me = self.sh.me;
        let sh = self.sh.clone();
        let mut last_check = Instant::now();
        loop {
            let bell_word: &AtomicU32 = &sh.ctrl().doorbells[me].0;
            let bell = bell_word.load(Ordering::Acquire);
            if sh.shutdown.load(Ordering::Acquire) {
                let late: Vec<P2pJob> = {
                    let mut inbox = self.incoming.lock();
                    inbox.closed = true;
                    inbox.jobs.drain(..).collect()
                };
                // Completing runs Python callbacks: never while holding the inbox lock.
                let e = Error::Aborted("the group was destroyed before this send/recv completed".into());
                for job in late {
                    job.work.complete(Err(e.clone()));
                }
                self.fail_everything(&e);
                return;
            }
            let new: Vec<P2pJob> = self.incoming.lock().jobs.drain(..).collect();
            for job in new {
                let peer = match &job.op {
                    P2p::Send { peer, .. } | P2p::Recv { peer, .. } => Some(*peer),
                    P2p::RecvAny { .. } => None,
                };
                let is_send = matches!(job.op, P2p::Send { .. });
                let p = Pending {
                    deadline: Instant::now() + job.timeout,
                    timeout: job.timeout,
                    op: job.op,
                    work: job.work,
                    done: 0,
                    end: None,
                };
                match peer {
                    None => self.any.push_back(p),
                    Some(peer) if is_send => self.sends[peer].push_back(p),
                    Some(peer) => self.recvs[peer].push_back(p),
                }
            }
            let mut progressed = false;
            for j in 0..sh.n {
                if j != me {
                    progressed |= self.progress_send(j);
                    progressed |= self.progress_recv(j);
                }
            }
            let pending = self.pending();
            self.publish_waits_for();
            // Deadlines and dead peers are checked at least every SLICE, also while a
            // long transfer on another channel keeps making progress.
            if pending && (!progressed || last_check.elapsed() >= SLICE) {
                last_check = Instant::now();
                self.expire();
                if let Some(e) = sh.dead_peers() {
                    for r in sh.mesh.gone() {
                        // What the peer completed before it left still counts.
                        self.progress_send(r);
                        self.progress_recv(r);
                        self.fail_peer(r, &e);
                    }
                }
            }
            if progressed {
                continue;
            }
            if pending {
                // Brief spin: the peer usually answers within microseconds.
                for _ in 0..sh.cfg.spin_count.min(4096) {
                    if bell_word.load(Ordering::Acquire) != bell {
                        break;
                    }
                    std::hint::spin_loop();
                }
            }
            if bell_word.load(Ordering::Acquire) == bell {
                futex_wait(bell_word, bell, if pending { SLICE } else { Duration::from_secs(1) });
            }
        }
    }

    /// Publish whom this rank's oldest pending send or recv waits for (see
    /// `ControlBlock::waits_for`).
    fn publish_waits_for(&self) {
        let oldest = (0..self.sh.n)
            .flat_map(|r| {
                let s = self.sends[r].front().map(|p| (p.deadline, r));
                let v = self.recvs[r].front().or(self.active[r].as_ref()).map(|p| (p.deadline, r));
                s.into_iter().chain(v)
            })
            .min();
        let word = oldest.map_or(0, |(_, r)| r as u32 + 1);
        let w = &self.sh.ctrl().waits_for[self.sh.me].0;
        if w.load(Ordering::Relaxed) != word {
            w.store(word, Ordering::Relaxed);
        }
    }

    fn fail_everything(&mut self, e: &Error) {
        complete_all(self.any.drain(..), e);
        for r in 0..self.sh.n {
            complete_all(self.sends[r].drain(..), e);
            complete_all(self.recvs[r].drain(..), e);
            complete_all(self.active[r].take(), e);
        }
    }

    fn fail_peer(&mut self, r: usize, e: &Error) {
        if self.unexpected[r].back().is_some_and(|u| !u.complete) {
            let u = self.unexpected[r].pop_back().expect("checked"); // a partial message is of no use
            self.unexpected_bytes[r] -= u.total;
        }
        complete_all(self.sends[r].drain(..), e);
        complete_all(self.recvs[r].drain(..), e);
        complete_all(self.active[r].take(), e);
        self.send_broken[r] = Some(e.clone());
        self.recv_broken[r] = Some(e.clone());
    }

    /// Fail operations past their deadline. One that had moved part of its message
    /// poisons its channel, so the peer fails now rather than at its own timeout.
    fn expire(&mut self) {
        let now = Instant::now();
        let me = self.sh.me;
        while let Some(i) = self.any.iter().position(|p| now >= p.deadline) {
            let p = self.any.remove(i).expect("index in range");
            let e = Error::Timeout(format!(
                "{}: {}: Timed out after {:.1} s: no rank sent a matching message",
                self.sh.who(me),
                p.describe(),
                p.timeout.as_secs_f64()
            ));
            p.work.complete(Err(e));
        }
        for r in 0..self.sh.n {
            if r == me {
                continue;
            }
            // An operation that completed since the last look must not be failed.
            self.progress_send(r);
            self.progress_recv(r);
            let recv_note = self.channel_note(r);
            let chain = self.sh.waits_chain(r);
            let timed_out = |p: &Pending, is_send: bool| {
                let waiting = if is_send { "" } else { recv_note.as_str() };
                Error::Timeout(format!(
                    "{}: {}: Timed out after {:.1} s: {} {}{waiting}{chain}",
                    self.sh.who(me),
                    p.describe(),
                    p.timeout.as_secs_f64(),
                    self.sh.who(r),
                    if is_send { "posted no matching recv" } else { "sent nothing matching" }
                ))
            };
            let mut failed: Vec<(Pending, Error)> = Vec::new();
            let mut i = 0;
            while i < self.sends[r].len() {
                if now >= self.sends[r][i].deadline {
                    let p = self.sends[r].remove(i).expect("index in range");
                    let e = timed_out(&p, true);
                    if p.started() {
                        poison(self.sh.channel(me, r), &e);
                        self.sh.ring(r);
                        self.send_broken[r] = Some(e.clone());
                    }
                    failed.push((p, e));
                } else {
                    i += 1;
                }
            }
            let mut i = 0;
            while i < self.recvs[r].len() {
                if now >= self.recvs[r][i].deadline {
                    let p = self.recvs[r].remove(i).expect("index in range");
                    let e = timed_out(&p, false);
                    failed.push((p, e));
                } else {
                    i += 1;
                }
            }
            if self.active[r].as_ref().is_some_and(|p| now >= p.deadline) {
                let p = self.active[r].take().expect("checked");
                let e = timed_out(&p, false);
                poison(self.sh.channel(r, me), &e);
                self.sh.ring(r);
                self.recv_broken[r] = Some(e.clone());
                failed.push((p, e));
            }
            for (p, e) in failed {
                p.work.complete(Err(e));
            }
        }
    }

    /// For a recv timeout: what is waiting in the channel from `r`, if anything.
    fn channel_note(&self, r: usize) -> String {
        let held: Vec<String> = self.unexpected[r].iter().map(|u| u.tag.to_string()).collect();
        if !held.is_empty() {
            return format!(" (messages from rank {r} with tags [{}] arrived and wait for matching recvs)", held.join(", "));
        }
        let ch = self.sh.channel(r, self.sh.me);
        let g = self.recv_next[r];
        if (ch.sent.0.load(Ordering::Acquire).wrapping_sub(g) as i32) <= 0 {
            return String::new();
        }
        // SAFETY: chunk g is published (Acquire load above) and not rewritten until acked.
        let h = unsafe { std::ptr::read(ch.headers[(g & 1) as usize].get()) };
        let dt = crate::dtype::DType::from_code(h.dtype);
        format!(
            " (a message of {} {} elements with tag {} from rank {r} is waiting: no recv matched its tag)",
            h.total_bytes / dt.map_or(1, |d| d.size()) as u64,
            dt.map_or("?", |d| d.name()),
            h.tag
        )
    }

    fn chunks_of(len: usize, half: usize) -> usize {
        len.div_ceil(half).max(1)
    }

    fn poisoned(&self, src: usize, dst: usize) -> Option<Error> {
        let ch = self.sh.channel(src, dst);
        let code = ch.poisoned.0.load(Ordering::Acquire);
        if code == 0 || code == POISON_WRITING {
            return None; // not poisoned, or the text is not published yet: look again later
        }
        // SAFETY: the text was written before the Release store of `poisoned` that the
        // Acquire load above observed, and is never written again.
        let (len, text) = unsafe { (*ch.error_len.get() as usize, *ch.error_text.get()) };
        let len = len.min(ERROR_TEXT_BYTES);
        Some(Error::from_class_code(code as u8, String::from_utf8_lossy(&text[..len]).into_owned()))
    }

    fn progress_send(&mut self, j: usize) -> bool {
        let me = self.sh.me;
        let half = self.sh.layout.p2p_half;
        if self.sends[j].is_empty() {
            return false;
        }
        if self.send_broken[j].is_none() {
            self.send_broken[j] = self.poisoned(me, j);
        }
        if let Some(e) = &self.send_broken[j] {
            let e = Error::from_class_code(e.class_code(), format!("send to rank {j} failed: {e}"));
            complete_all(self.sends[j].drain(..), &e);
            return true;
        }
        let ch = self.sh.channel(me, j);
        let mut progressed = false;
        while let Some(p) = self.sends[j].front_mut() {
            let buf = p.buf();
            let (tag, dtype) = p.tag_dtype();
            let total_chunks = Self::chunks_of(buf.len, half);
            while p.done < total_chunks {
                let g = self.send_next[j];
                if g.wrapping_sub(ch.acked.0.load(Ordering::Acquire)) >= 2 {
                    break;
                }
                let h = (g & 1) as usize;
                let lo = p.done * half;
                let len = half.min(buf.len - lo.min(buf.len));
                // SAFETY: half h of channel me->j (and its header) is ours until the
                // receiver acks chunk g (protocol in ChannelCtrl); `buf` is valid for its
                // len (the Python Work holds the tensor).
                unsafe {
                    ch.headers[h].get().write(MsgHeader { tag, total_bytes: buf.len as u64, dtype: dtype as u8, _pad: [0; 7] });
                    copy(self.sh.region.at(self.sh.layout.channel_half(me, j, h)), buf.ptr.add(lo), len);
                }
                ch.sent.0.store(g.wrapping_add(1), Ordering::Release);
                self.sh.ring(j);
                self.send_next[j] = g.wrapping_add(1);
                p.done += 1;
                progressed = true;
            }
            if p.done < total_chunks {
                break;
            }
            let end = *p.end.get_or_insert(self.send_next[j]);
            if (ch.acked.0.load(Ordering::Acquire).wrapping_sub(end) as i32) < 0 {
                break;
            }
            let p = self.sends[j].pop_front().expect("front exists");
            self.sh.p2p_messages.fetch_add(1, Ordering::Relaxed);
            self.sh.staged_bytes.fetch_add(buf.len as u64, Ordering::Relaxed);
            p.work.complete(Ok(()));
            progressed = true;
        }
        progressed
    }

    /// Complete recv `p` with message `msg` that rank `i` sent before the recv was posted
    /// (held aside), or with the mismatch error when its size or dtype differs.
    fn deliver_held(&self, p: Pending, i: usize, msg: &Unexpected) {
        let buf = p.buf();
        if msg.data.len() != buf.len || msg.dtype != p.tag_dtype().1 as u8 {
            let e = self.mismatch(&p, i, msg.data.len() as u64, msg.dtype);
            p.work.complete(Err(e));
        } else {
            // SAFETY: `buf` is valid for its len (kept alive by the Work), equal to the data's.
            unsafe { copy(buf.ptr, msg.data.as_ptr(), buf.len) };
            p.work.complete(Ok(()));
        }
    }

    fn mismatch(&self, p: &Pending, i: usize, total_bytes: u64, dtype_code: u8) -> Error {
        let (tag, _) = p.tag_dtype();
        let sent_dt = crate::dtype::DType::from_code(dtype_code);
        Error::Mismatch(format!(
            "rank {} posted a {}, but rank {i} sent {} {} elements (tag {tag})",
            self.sh.me,
            p.describe(),
            total_bytes / sent_dt.map_or(1, |d| d.size()) as u64,
            sent_dt.map_or("?", |d| d.name()),
        ))
    }

    /// Give pending recvs from `i` the complete held messages with their tags.
    fn match_unexpected(&mut self, i: usize) -> bool {
        let mut progressed = false;
        let mut k = 0;
        while k < self.recvs[i].len() {
            let tag = self.recvs[i][k].tag_dtype().0;
            let Some(u) = self.unexpected[i].iter().position(|u| u.complete && u.tag == tag) else {
                k += 1;
                continue;
            };
            let msg = self.unexpected[i].remove(u).expect("index in range");
            self.unexpected_bytes[i] -= msg.total;
            let p = self.recvs[i].remove(k).expect("index in range");
            self.deliver_held(p, i, &msg);
            progressed = true;
        }
        // Then recvs from any source, oldest first.
        let mut k = 0;
        while k < self.any.len() {
            let tag = self.any[k].tag_dtype().0;
            let Some(u) = self.unexpected[i].iter().position(|u| u.complete && u.tag == tag) else {
                k += 1;
                continue;
            };
            let msg = self.unexpected[i].remove(u).expect("index in range");
            self.unexpected_bytes[i] -= msg.total;
            let p = self.any.remove(k).expect("index in range");
            set_source(&p, i);
            self.deliver_held(p, i, &msg);
            progressed = true;
        }
        progressed
    }

    fn progress_recv(&mut self, i: usize) -> bool {
        let me = self.sh.me;
        let half = self.sh.layout.p2p_half;
        let capturing = self.unexpected[i].back().is_some_and(|u| !u.complete);
        if self.recvs[i].is_empty() && self.active[i].is_none() && !capturing && self.any.is_empty() {
            return false;
        }
        // Messages already held are delivered even if the channel has failed since.
        let mut progressed = self.match_unexpected(i);
        if self.recv_broken[i].is_none() {
            self.recv_broken[i] = self.poisoned(i, me);
        }
        if let Some(e) = &self.recv_broken[i] {
            let e = Error::from_class_code(e.class_code(), format!("recv from rank {i} failed: {e}"));
            if self.unexpected[i].back().is_some_and(|u| !u.complete) {
                let u = self.unexpected[i].pop_back().expect("checked"); // never completes now
                self.unexpected_bytes[i] -= u.total;
            }
            progressed |= !self.recvs[i].is_empty() || self.active[i].is_some();
            complete_all(self.recvs[i].drain(..), &e);
            complete_all(self.active[i].take(), &e);
            return progressed;
        }
        let sh = self.sh.clone();
        let ch = sh.channel(i, me);
        loop {
            let g = self.recv_next[i];
            if (ch.sent.0.load(Ordering::Acquire).wrapping_sub(g) as i32) <= 0 {
                break;
            }
            let h = (g & 1) as usize;
            let capturing = self.unexpected[i].back().is_some_and(|u| !u.complete);
            if self.active[i].is_none() && !capturing {
                // SAFETY: chunk g is published (Acquire load of `sent` above); the sender
                // does not touch half h until we ack it.
                let hdr = unsafe { std::ptr::read(ch.headers[h].get()) };
                // The oldest recv posted for this sender with the tag, else the oldest
                // recv from any source with it.
                let matched = match self.recvs[i].iter().position(|p| p.tag_dtype().0 == hdr.tag) {
                    Some(idx) => self.recvs[i].remove(idx),
                    None => self.any.iter().position(|p| p.tag_dtype().0 == hdr.tag).and_then(|idx| self.any.remove(idx)),
                };
                if let Some(p) = matched {
                    set_source(&p, i);
                    if hdr.total_bytes != p.buf().len as u64 || hdr.dtype != p.tag_dtype().1 as u8 {
                        let e = self.mismatch(&p, i, hdr.total_bytes, hdr.dtype);
                        poison(ch, &e);
                        self.sh.ring(i);
                        self.recv_broken[i] = Some(e.clone());
                        p.work.complete(Err(e));
                        return true;
                    }
                    self.active[i] = Some(p);
                } else if (!self.recvs[i].is_empty() || !self.any.is_empty())
                    && self.unexpected_bytes[i] + hdr.total_bytes as usize <= UNEXPECTED_LIMIT
                {
                    // A recv for another tag (from this sender or from any) waits behind
                    // this message: hold it aside.
                    self.unexpected_bytes[i] += hdr.total_bytes as usize;
                    self.unexpected[i].push_back(Unexpected {
                        tag: hdr.tag,
                        dtype: hdr.dtype,
                        total: hdr.total_bytes as usize,
                        data: Vec::with_capacity(hdr.total_bytes as usize),
                        chunks: 0,
                        complete: false,
                    });
                } else {
                    break; // no recv for this tag yet: the message waits in the channel
                }
            }
            let src = self.sh.region.at(self.sh.layout.channel_half(i, me, h));
            let done_now = if let Some(p) = self.active[i].as_mut() {
                let buf = p.buf();
                let lo = p.done * half;
                let len = half.min(buf.len - lo.min(buf.len));
                // SAFETY: as above; `buf` is valid for its len (kept alive by the Work).
                unsafe { copy(buf.ptr.add(lo), src, len) };
                p.done += 1;
                p.done == Self::chunks_of(buf.len, half)
            } else {
                let u = self.unexpected[i].back_mut().expect("capturing");
                let total = u.total;
                let len = half.min(total - u.data.len());
                // SAFETY: as above; the chunk holds `len` valid bytes of the message.
                u.data.extend_from_slice(unsafe { std::slice::from_raw_parts(src, len) });
                u.chunks += 1;
                u.complete = u.chunks == Self::chunks_of(total, half);
                false
            };
            ch.acked.0.store(g.wrapping_add(1), Ordering::Release);
            self.sh.ring(i);
            self.recv_next[i] = g.wrapping_add(1);
            progressed = true;
            if done_now {
                let p = self.active[i].take().expect("set above");
                p.work.complete(Ok(()));
            }
            if self.unexpected[i].back().is_some_and(|u| u.complete) {
                progressed |= self.match_unexpected(i);
            }
        }
        progressed
    }
}

/// Record the sender of a recv from any source (no-op for other operations); the Release
/// store is seen by whoever reads `source` after the Work completed.
fn set_source(p: &Pending, rank: usize) {
    if let P2p::RecvAny { source, .. } = &p.op {
        source.store(rank, Ordering::Release);
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
