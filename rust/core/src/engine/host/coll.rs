//! The host engine's collectives: the thread that runs them in submission order, and
//! `CollExec`, which runs one in rounds over the staging buffers (see the parity rule in
//! the engine's module doc).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{CollJob, Queue, Shared};
use crate::collective::{agree, choose_allreduce, reduce::reduce, AllReduceAlgo, Buf, Collective};
use crate::error::{Error, Result};
use crate::memory::layout::CollHeader;
use crate::sync::{futex_wake_all, wait_until};

pub(super) fn collective_thread(sh: Arc<Shared>, q: Arc<Queue<CollJob>>, exec: Arc<Mutex<CollExec>>) {
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
pub(super) struct BusyToken<'a>(pub(super) &'a Queue<CollJob>);

impl Drop for BusyToken<'_> {
    fn drop(&mut self) {
        self.0.items.lock().busy = false;
        self.0.cv.notify_all();
    }
}

/// Run one collective with the group's abort bookkeeping; shared by the engine thread and
/// callers running inline.
pub(super) fn execute(sh: &Shared, exec: &mut CollExec, c: &Collective, timeout: Duration) -> Result<()> {
    let broken = sh.broken.lock().clone();
    match broken {
        Some(e) => Err(Error::Aborted(format!("the group was aborted by an earlier error: {e}"))),
        None if sh.shutdown.load(Ordering::Acquire) => Err(Error::destroyed()),
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
pub(super) struct CollExec {
    pub(super) sh: Arc<Shared>,
    pub(super) epoch: u32,
    pub(super) seq: u64,
    /// Parity whose headers the next barrier must check (the collective's first round).
    pub(super) check_parity: Option<usize>,
    pub(super) deadline: Instant,
    pub(super) timeout: Duration,
    pub(super) kind_name: &'static str,
    /// Every rank's header of the current collective, for the agreement check.
    pub(super) headers: Vec<CollHeader>,
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
pub(super) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
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
                Collective::AllGather { input, output, .. } => self.gather(*input, Some(*output)),
                Collective::ReduceScatter { input, output, dtype, op } => self.reduce_scatter(*input, *output, *dtype, *op),
                Collective::AllToAll { input, output, recv_bytes, send_bytes, .. } => {
                    self.all_to_all(*input, *output, send_bytes, recv_bytes)
                }
                Collective::Gather { input, output, root, .. } => self.gather(*input, output.filter(|_| me == *root)),
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

    /// all_gather (`output` on every rank) and gather (`output` on the root alone): every
    /// rank stages its input chunk by chunk, and the ranks with an output copy out all of them.
    unsafe fn gather(&mut self, input: Buf, output: Option<Buf>) -> Result<()> {
        let (me, n) = (self.sh.me, self.sh.n);
        for (off, m) in chunks(input.len, self.half()) {
            let q = self.parity();
            copy(self.slot(me, q), input.ptr.add(off), m);
            self.staged(m);
            self.sync()?;
            if let Some(out) = output {
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
