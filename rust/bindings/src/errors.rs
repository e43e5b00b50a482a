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
        Error::Timeout(_) => PyTimeoutError::new_err(msg),
        Error::PeerFailure(_) => PeerFailureError::new_err(msg),
        Error::Aborted(_) => GroupAbortedError::new_err(msg),
        Error::Os { .. } | Error::Cuda(_) | Error::Internal(_) => PyRuntimeError::new_err(msg),
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
