//! The one place core errors become Python exceptions: bad arguments ValueError/TypeError,
//! timeouts TimeoutError, everything else RuntimeError (with rsccl's subclasses so users
//! can catch a dead peer specifically).

use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use rsccl_core::Error;

pyo3::create_exception!(_rsccl, PeerFailureError, PyRuntimeError, "A peer rank died, left, or aborted the group.");
pyo3::create_exception!(_rsccl, GroupAbortedError, PyRuntimeError, "The group was aborted by an earlier error.");

pub fn to_py(e: Error) -> PyErr {
    let msg = format!("rsccl: {e}");
    match e {
        Error::InvalidArgument(_) | Error::Mismatch(_) | Error::Config(_) => PyValueError::new_err(msg),
        Error::InvalidType(_) => PyTypeError::new_err(msg),
        Error::Timeout(_) => PyTimeoutError::new_err(torch_timeout_wording(msg)),
        Error::PeerFailure(_) => PeerFailureError::new_err(msg),
        Error::Aborted(_) => GroupAbortedError::new_err(msg),
        Error::Os { .. } | Error::Cuda(_) | Error::Internal(_) => PyRuntimeError::new_err(msg),
    }
}

/// torch's tests and users' tools recognize a timeout by " Timed out " (gloo's wording;
/// torch matches `" (Timed out|closed|timeout) "`): every TimeoutError says it, and keeps
/// rsccl's detail (who was waited for, in which call).
fn torch_timeout_wording(msg: String) -> String {
    if msg.contains(" Timed out ") {
        msg
    } else if msg.contains(" timed out ") {
        msg.replacen(" timed out ", " Timed out ", 1)
    } else {
        format!("rsccl: Timed out - {}", msg.trim_start_matches("rsccl: "))
    }
}

pub trait IntoPyResult<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for rsccl_core::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
