//! Waiting on words in shared memory: spin briefly, yield, then sleep on a futex.
//!
//! Ranks of a host share one region; a waiting rank must not burn a core (4 ranks on a
//! 2-core machine must stay fast), so after `spin_count` polls it sleeps on the word with
//! FUTEX_WAIT (not FUTEX_PRIVATE: the word is in a MAP_SHARED memfd mapping, and the
//! kernel keys shared futexes by the backing page, so a wake from any process reaches it).
//! Sleeps are sliced (`SLICE`) so the caller can check the deadline, the abort flag and
//! whether peers are still alive between slices.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Longest single futex sleep; bounds how late a dead peer or an abort is noticed.
pub const SLICE: Duration = Duration::from_millis(50);

/// Sleep while `*word == expected`, at most `timeout`. Spurious returns are fine: callers loop.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call (a reference);
    // FUTEX_WAIT only reads it and compares with `expected`; `ts` outlives the call.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wake every sleeper on `word` (in any process mapping the same page).
pub fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: `word` is a valid aligned u32; FUTEX_WAKE does not access memory through it
    // beyond using its address as the key.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32);
    }
}

/// What a waiter checks between sleeps: the group's abort flag and its peers' liveness.
pub trait WaitGuard {
    /// Return an error if the wait should stop now (abort, dead peer, shutdown).
    fn check(&self) -> Result<()>;
}

/// Wait until `ready(word.load(Acquire))` holds. `describe` builds the timeout message
/// (it is called only on timeout, so it may inspect shared state to name missing ranks).
pub fn wait_until(
    word: &AtomicU32,
    ready: impl Fn(u32) -> bool,
    spin_count: u32,
    deadline: Instant,
    guard: &dyn WaitGuard,
    describe: impl FnOnce() -> String,
) -> Result<()> {
    for i in 0..spin_count {
        if ready(word.load(Ordering::Acquire)) {
            return Ok(());
        }
        if i % 64 == 63 {
            // Oversubscribed hosts (more ranks than cores): let the rank we wait for run.
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    loop {
        let seen = word.load(Ordering::Acquire);
        if ready(seen) {
            return Ok(());
        }
        guard.check()?;
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout(describe()));
        }
        futex_wait(word, seen, SLICE.min(deadline - now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    struct Never;
    impl WaitGuard for Never {
        fn check(&self) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn wakes_on_store_and_times_out() {
        let w = Arc::new(AtomicU32::new(0));
        let w2 = w.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            w2.store(5, Ordering::Release);
            futex_wake_all(&w2);
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        wait_until(&w, |v| v == 5, 10, deadline, &Never, || "x".into()).unwrap();
        t.join().unwrap();
        let start = Instant::now();
        let e = wait_until(&w, |v| v == 6, 10, start + Duration::from_millis(60), &Never, || "late".into());
        assert!(matches!(e, Err(Error::Timeout(m)) if m == "late"));
        assert!(start.elapsed() >= Duration::from_millis(60));
    }
}
