//! Where Python sees operations complete. Engine threads never run Python code: a
//! completion callback (which settles torch futures, whose `.then` callbacks may issue
//! and wait on further collectives, as PowerSGD's comm hook does) runs on a pool thread.
//! The pool grows when every thread is busy, so a callback that blocks on another
//! operation's completion never waits for itself.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

type Job = Box<dyn FnOnce() + Send>;

struct Pool {
    state: Mutex<State>,
    cv: Condvar,
}

struct State {
    jobs: VecDeque<Job>,
    idle: usize,
    threads: usize,
}

/// Idle pool threads exit after this long, down to one.
const IDLE_EXIT: Duration = Duration::from_secs(30);

fn pool() -> &'static Arc<Pool> {
    static POOL: OnceLock<Arc<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        Arc::new(Pool { state: Mutex::new(State { jobs: VecDeque::new(), idle: 0, threads: 0 }), cv: Condvar::new() })
    })
}

/// Run `job` on a completion thread.
pub fn dispatch(job: Job) {
    let p = pool();
    let spawn = {
        let mut st = p.state.lock();
        st.jobs.push_back(job);
        if st.idle > 0 {
            false
        } else {
            st.threads += 1;
            true
        }
    };
    if spawn {
        let p2 = p.clone();
        let started = std::thread::Builder::new().name("rsccl-completion".into()).spawn(move || worker(p2));
        if started.is_err() {
            // Out of threads: the queued job runs when a busy thread frees up.
            p.state.lock().threads -= 1;
            tracing::error!("could not start a completion thread");
        }
    } else {
        p.cv.notify_one();
    }
}

fn worker(p: Arc<Pool>) {
    let mut st = p.state.lock();
    loop {
        if let Some(job) = st.jobs.pop_front() {
            drop(st);
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                tracing::error!("a completion callback panicked");
            }
            st = p.state.lock();
            continue;
        }
        st.idle += 1;
        let timed_out = p.cv.wait_for(&mut st, IDLE_EXIT).timed_out();
        st.idle -= 1;
        if timed_out && st.jobs.is_empty() && st.threads > 1 {
            st.threads -= 1;
            return;
        }
    }
}
