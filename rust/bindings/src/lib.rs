use pyo3::prelude::*;
#[pymodule]
fn _rsccl(_m: &Bound<'_, PyModule>) -> PyResult<()> { Ok(()) }
