//! Completion of one submitted operation: its result, waiters, and callbacks. The tensors
//! an operation reads and writes are kept alive by the Python Work that owns this state
//! until `complete` has run, so an engine thread never touches freed memory.

use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

type Callback = Box<dyn FnOnce(&Result<()>) + Send>;

#[derive(Default)]
struct Inner {
    result: Option<Result<()>>,
    callbacks: Vec<Callback>,
}

#[derive(Default)]
pub struct WorkState {
    inner: Mutex<Inner>,
    cv: Condvar,
}

impl WorkState {
    pub fn new() -> Self {
        Self::default()
    }

    /// A state that is already complete with `r`.
    pub fn completed(r: Result<()>) -> Self {
        let w = Self::default();
        w.inner.lock().result = Some(r);
        w
    }

    /// Record the result, wake waiters, then run callbacks (outside the lock, in the
    /// completing thread).
    pub fn complete(&self, r: Result<()>) {
        let callbacks = {
            let mut g = self.inner.lock();
            if g.result.is_some() {
                return;
            }
            g.result = Some(r.clone());
            std::mem::take(&mut g.callbacks)
        };
        self.cv.notify_all();
        for cb in callbacks {
            run_callback(cb, &r);
        }
    }

    pub fn is_completed(&self) -> bool {
        self.inner.lock().result.is_some()
    }

    /// The result if completed.
    pub fn result(&self) -> Option<Result<()>> {
        self.inner.lock().result.clone()
    }

    /// Block until completed (or `timeout`), then return the result.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let mut g = self.inner.lock();
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        while g.result.is_none() {
            match deadline {
                None => self.cv.wait(&mut g),
                Some(d) => {
                    if self.cv.wait_until(&mut g, d).timed_out() && g.result.is_none() {
                        return Err(Error::Timeout(format!(
                            "Work.wait: Timed out after {:.3} s; the operation is still running",
                            timeout.unwrap_or_default().as_secs_f64()
                        )));
                    }
                }
            }
        }
        g.result.clone().expect("set above")
    }

    /// Run `cb` once the operation completes (at once if it already has).
    pub fn on_complete(&self, cb: Callback) {
        let done = {
            let mut g = self.inner.lock();
            match &g.result {
                Some(r) => Some(r.clone()),
                None => {
                    g.callbacks.push(cb);
                    return;
                }
            }
        };
        if let Some(r) = done {
            run_callback(cb, &r);
        }
    }
}

/// A panicking callback (e.g. one entering Python while it finalizes) must not take the
/// engine thread with it: the other Works it will complete would wait forever.
fn run_callback(cb: Callback, r: &Result<()>) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(r))).is_err() {
        tracing::error!("a completion callback panicked; continuing");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn wait_callbacks_and_timeout() {
        let w = Arc::new(WorkState::new());
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        w.on_complete(Box::new(move |r| {
            assert!(r.is_ok());
            h.fetch_add(1, Ordering::SeqCst);
        }));
        assert!(matches!(w.wait(Some(Duration::from_millis(10))), Err(Error::Timeout(_))));
        let w2 = w.clone();
        std::thread::spawn(move || w2.complete(Ok(()))).join().unwrap();
        w.wait(None).unwrap();
        let h = hits.clone();
        w.on_complete(Box::new(move |_| {
            h.fetch_add(1, Ordering::SeqCst);
        }));
        assert_eq!(hits.load(Ordering::SeqCst), 2);
        w.complete(Err(Error::Internal("ignored: already complete".into())));
        assert!(w.result().unwrap().is_ok());
    }
}
