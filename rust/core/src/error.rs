//! rsccl's one error type. User errors (bad arguments, ranks that disagree) and
//! failures of the job (timeouts, dead peers) are distinct variants so the
//! bindings can map each to the right Python exception; `Internal` is a bug in rsccl.

use std::io;

/// Every failure rsccl reports. Messages are complete sentences a user can act on.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A value the caller passed is wrong (maps to ValueError).
    #[error("{0}")]
    InvalidArgument(String),
    /// A dtype or reduce op that rsccl does not support (maps to TypeError).
    #[error("{0}")]
    InvalidType(String),
    /// Ranks of one group called mismatching collectives (maps to ValueError).
    #[error("{0}")]
    Mismatch(String),
    /// A configuration value (Options or RSCCL_* variable) is invalid (maps to ValueError).
    #[error("{0}")]
    Config(String),
    /// A wait ran past the group's timeout (maps to TimeoutError).
    #[error("{0}")]
    Timeout(String),
    /// A peer died, left, or aborted the group (maps to RuntimeError).
    #[error("{0}")]
    PeerFailure(String),
    /// The group was aborted earlier and can run nothing more (maps to RuntimeError).
    #[error("{0}")]
    Aborted(String),
    /// An operating-system call failed; `context` says what rsccl was doing.
    #[error("{context}: {source}")]
    Os { context: String, source: std::sync::Arc<io::Error> },
    /// A CUDA driver or NVRTC call failed; the message names the call and the cause.
    #[error("{0}")]
    Cuda(String),
    /// A broken invariant inside rsccl: a bug to report.
    #[error("internal error in rsccl (please report): {0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Wrap the last OS error (errno) with what was being done.
    pub fn last_os(context: impl Into<String>) -> Self {
        Error::Os { context: context.into(), source: std::sync::Arc::new(io::Error::last_os_error()) }
    }

    pub fn os(context: impl Into<String>, source: io::Error) -> Self {
        Error::Os { context: context.into(), source: std::sync::Arc::new(source) }
    }

    /// The group was destroyed (or is being), so it runs nothing more: the one spelling of
    /// this message, used by every engine.
    pub fn destroyed() -> Self {
        Error::Aborted("the group was destroyed".into())
    }

    /// The group was destroyed at the moment `when` says ("before this send/recv completed").
    pub fn destroyed_when(when: &str) -> Self {
        Error::Aborted(format!("the group was destroyed {when}"))
    }

    /// Whether the group can keep running collectives after this error: argument and
    /// agreement errors are detected by every rank at the same step, so the shared state
    /// stays consistent; anything else leaves the group aborted.
    pub fn keeps_group_usable(&self) -> bool {
        matches!(self, Error::InvalidArgument(_) | Error::InvalidType(_) | Error::Mismatch(_) | Error::Config(_))
    }

    /// This rank's own argument error, naming it ("rank 2: ..."), as the host engine's
    /// agreed errors do; unchanged if it names the rank already, or is not an argument error.
    pub fn naming_rank(self, rank: usize) -> Error {
        let named = |m: &str| m.starts_with(&format!("rank {rank}:")) || m.contains(&format!("rank {rank} "));
        match self {
            Error::InvalidArgument(m) if !named(&m) => Error::InvalidArgument(format!("rank {rank}: {m}")),
            Error::InvalidType(m) if !named(&m) => Error::InvalidType(format!("rank {rank}: {m}")),
            other => other,
        }
    }

    /// The error a new call gets from a group that an earlier failure stopped: the same
    /// class, saying that this call did not run and which failure stopped the group (the
    /// earlier error itself went to the call, or the Work, it happened in). A destroyed
    /// group says so as it is.
    pub fn stopped_earlier(self) -> Error {
        let say = |m: String| format!("this call did not run: an earlier failure stopped the group: {m}");
        match self {
            Error::Aborted(m) if m.starts_with("the group was destroyed") => Error::Aborted(m),
            Error::InvalidArgument(m) => Error::InvalidArgument(say(m)),
            Error::InvalidType(m) => Error::InvalidType(say(m)),
            Error::Mismatch(m) => Error::Mismatch(say(m)),
            Error::Config(m) => Error::Config(say(m)),
            Error::Timeout(m) => Error::Timeout(say(m)),
            Error::PeerFailure(m) => Error::PeerFailure(say(m)),
            Error::Cuda(m) => Error::Cuda(say(m)),
            other => Error::Aborted(say(other.to_string())),
        }
    }

    /// One byte that travels in collective headers, so every rank raises the same class.
    pub fn class_code(&self) -> u8 {
        match self {
            Error::InvalidArgument(_) => 1,
            Error::InvalidType(_) => 2,
            Error::Mismatch(_) => 3,
            Error::Timeout(_) => 5,
            _ => 4,
        }
    }

    /// Rebuild an error of the class `code` (see `class_code`) around `message`.
    pub fn from_class_code(code: u8, message: String) -> Self {
        match code {
            1 => Error::InvalidArgument(message),
            2 => Error::InvalidType(message),
            3 => Error::Mismatch(message),
            5 => Error::Timeout(message),
            _ => Error::PeerFailure(message),
        }
    }
}

/// Attach context to OS-level results.
pub trait OsContext<T> {
    fn os_context(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> OsContext<T> for io::Result<T> {
    fn os_context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::os(context(), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_names_itself_once() {
        let e = Error::InvalidArgument("all_reduce takes exactly one tensor per rank, got 2".into()).naming_rank(1);
        assert_eq!(e.to_string(), "rank 1: all_reduce takes exactly one tensor per rank, got 2");
        assert!(
            matches!(e.clone().naming_rank(1), Error::InvalidArgument(m) if m == "rank 1: all_reduce takes exactly one tensor per rank, got 2")
        );
        let e = Error::InvalidType("all_reduce: rank 12 passed float64".into()).naming_rank(1);
        assert_eq!(e.to_string(), "rank 1: all_reduce: rank 12 passed float64", "rank 12 is not rank 1");
        let e = Error::InvalidType("all_reduce: rank 3 passed float64".into()).naming_rank(3);
        assert_eq!(e.to_string(), "all_reduce: rank 3 passed float64");
        assert!(matches!(Error::Timeout("t".into()).naming_rank(0), Error::Timeout(m) if m == "t"), "only argument errors");
    }

    /// A call refused after an earlier failure keeps its class and names that failure.
    #[test]
    fn a_call_after_a_failure_names_it() {
        let e = Error::Mismatch("recv on rank 1: rank 0 sent 4000 bytes, rank 1 expected 3996 bytes".into()).stopped_earlier();
        assert!(
            matches!(&e, Error::Mismatch(m) if m.starts_with("this call did not run: an earlier failure") && m.ends_with("expected 3996 bytes")),
            "{e}"
        );
        assert!(matches!(Error::Timeout("t".into()).stopped_earlier(), Error::Timeout(m) if m.ends_with(": t")));
        assert!(matches!(Error::destroyed().stopped_earlier(), Error::Aborted(m) if m == "the group was destroyed"));
        assert!(matches!(Error::Internal("x".into()).stopped_earlier(), Error::Aborted(m) if m.contains("please report")));
    }

    /// Python's tests match these words (GroupAbortedError, "destroyed").
    #[test]
    fn destroyed_is_one_aborted_message() {
        assert!(matches!(Error::destroyed(), Error::Aborted(m) if m == "the group was destroyed"));
        let e = Error::destroyed_when("before this send/recv completed");
        assert!(matches!(e, Error::Aborted(m) if m == "the group was destroyed before this send/recv completed"));
    }
}
