//! torch's c10d Store seen from the core: the core calls it with the GIL released, so
//! every call attaches to the interpreter for its duration.

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use rsccl_core::bootstrap::Store;
use rsccl_core::{Error, Result};

pub struct PyStore(pub Py<PyAny>);

fn store_error(py: Python<'_>, what: &str, e: PyErr) -> Error {
    let text = e.value(py).to_string();
    if text.to_ascii_lowercase().contains("timeout") || e.is_instance_of::<pyo3::exceptions::PyTimeoutError>(py) {
        Error::Timeout(format!("{what}: {text}"))
    } else {
        Error::PeerFailure(format!("{what}: {text}"))
    }
}

impl Store for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        Python::attach(|py| {
            self.0
                .call_method1(py, "set", (key, PyBytes::new(py, value)))
                .map(|_| ())
                .map_err(|e| store_error(py, &format!("store.set({key:?})"), e))
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        Python::attach(|py| {
            self.0
                .call_method1(py, "add", (key, delta))
                .and_then(|v| v.extract::<i64>(py))
                .map_err(|e| store_error(py, &format!("store.add({key:?})"), e))
        })
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        Python::attach(|py| {
            let wait = || -> PyResult<Vec<u8>> {
                let td = py.import("datetime")?.getattr("timedelta")?.call1((0, timeout.as_secs_f64()))?;
                self.0.call_method1(py, "wait", (vec![key], td))?;
                self.0.call_method1(py, "get", (key,))?.extract::<Vec<u8>>(py)
            };
            wait().map_err(|e| store_error(py, &format!("store.get({key:?})"), e))
        })
    }
}
