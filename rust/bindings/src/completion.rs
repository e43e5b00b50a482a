//! Where Python sees operations complete. Engine threads never run Python code: a
//! completion callback (which settles torch futures, whose `.then` callbacks may issue
//! and wait on further collectives, as PowerSGD's comm hook does) runs on a pool thread.
//! When no pool thread is waiting for work, a new one starts, so a callback that blocks
//! on another operation's completion never waits for itself. There is no cap: a cap
//! would queue the very completions that blocked callbacks wait for, and deadlock. The
//! number of threads is bounded by the callbacks blocked at once; idle ones exit.
//!
//! At interpreter exit `finish` waits for callbacks in flight, then keeps every later
//! completion out of Python: a thread entering Python while it finalizes takes the
//! process down.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

type Job = Box<dyn FnOnce() + Send>;

struct Pool {
    state: Mutex<State>,
    /// Workers wait here for jobs.
    work: Condvar,
    /// `drain` waits here for the pool to go quiet.
    quiet: Condvar,
}

struct State {
    jobs: VecDeque<Job>,
    threads: usize,
    running: usize,
    closed: bool,
}

/// Idle pool threads exit after this long, down to one.
const IDLE_EXIT: Duration = Duration::from_secs(30);

fn pool() -> &'static Arc<Pool> {
    static POOL: OnceLock<Arc<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        Arc::new(Pool {
            state: Mutex::new(State { jobs: VecDeque::new(), threads: 0, running: 0, closed: false }),
            work: Condvar::new(),
            quiet: Condvar::new(),
        })
    })
}

/// Run `job` on a completion thread; after `close`, drop it unrun.
pub fn dispatch(job: Job) {
    let p = pool();
    let mut st = p.state.lock();
    if st.closed {
        drop(st);
        // Dropping the job would release Python objects without an interpreter.
        std::mem::forget(job);
        return;
    }
    st.jobs.push_back(job);
    // notify_one reports whether a waiting worker was woken; under the lock, each
    // dispatch wakes a distinct waiter, so no job is left without one.
    if p.work.notify_one() {
        return;
    }
    st.threads += 1;
    drop(st);
    let p2 = p.clone();
    if std::thread::Builder::new().name("rsccl-completion".into()).spawn(move || worker(p2)).is_err() {
        p.state.lock().threads -= 1;
        tracing::error!("could not start a completion thread; the job waits for a busy one");
    }
}

fn worker(p: Arc<Pool>) {
    let mut st = p.state.lock();
    loop {
        if let Some(job) = st.jobs.pop_front() {
            if st.closed {
                std::mem::forget(job); // see `dispatch`
                continue;
            }
            st.running += 1;
            drop(st);
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                tracing::error!("a completion callback panicked");
            }
            st = p.state.lock();
            st.running -= 1;
            if st.running == 0 && st.jobs.is_empty() {
                p.quiet.notify_all();
            }
            continue;
        }
        let deadline = Instant::now() + IDLE_EXIT;
        if p.work.wait_until(&mut st, deadline).timed_out() && st.jobs.is_empty() && st.threads > 1 {
            st.threads -= 1;
            return;
        }
    }
}

/// At interpreter exit: wait (at most `limit`; call without the GIL) until no callback
/// runs or waits to run, then keep every later completion out of Python. Returns whether
/// the pool went quiet in time.
pub fn finish(limit: Duration) -> bool {
    let p = pool();
    let deadline = Instant::now() + limit;
    let mut st = p.state.lock();
    let mut quiet = true;
    while st.running > 0 || !st.jobs.is_empty() {
        if p.quiet.wait_until(&mut st, deadline).timed_out() {
            quiet = false;
            break;
        }
    }
    // Under the same lock as the check above, so nothing slips in between.
    st.closed = true;
    for job in st.jobs.drain(..) {
        std::mem::forget(job);
    }
    quiet
}
