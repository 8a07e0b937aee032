//! Core errors → Python exceptions. The classes live in `kvtier/_errors.py` (so they can inherit from both
//! `KvtierError` and the builtin they refine); this file only picks the class and its arguments.

use kvtier_core::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// Error of binding methods: a core error (converted to kvtier's classes) or a Python error raised while
/// converting arguments, passed through unchanged.
pub enum PyKvErr {
    /// From kvtier-core.
    Core(Error),
    /// Already a Python exception.
    Py(PyErr),
}

impl From<Error> for PyKvErr {
    fn from(e: Error) -> Self {
        PyKvErr::Core(e)
    }
}

impl From<PyErr> for PyKvErr {
    fn from(e: PyErr) -> Self {
        PyKvErr::Py(e)
    }
}

fn build(py: Python<'_>, e: &Error) -> PyResult<PyErr> {
    let errors = py.import("kvtier._errors")?;
    let msg = e.to_string();
    let value = match e {
        Error::InvalidArgument { .. } => errors.getattr("InvalidArgumentError")?.call1((msg,))?,
        Error::Os { source, .. } => {
            let errno = source.raw_os_error().unwrap_or(0);
            errors.getattr("_os_error")?.call1((errno, msg))?
        }
        Error::HugePagesUnavailable(_) => {
            errors.getattr("HugePagesUnavailableError")?.call1((msg,))?
        }
        Error::CudaUnavailable(_) => errors.getattr("CudaUnavailableError")?.call1((msg,))?,
        Error::Cuda { .. } => errors.getattr("CudaError")?.call1((msg,))?,
        Error::Closed(_) => errors.getattr("ClosedError")?.call1((msg,))?,
        _ => errors.getattr("KvtierError")?.call1((msg,))?,
    };
    Ok(PyErr::from_value(value))
}

impl From<PyKvErr> for PyErr {
    fn from(e: PyKvErr) -> PyErr {
        match e {
            PyKvErr::Py(e) => e,
            PyKvErr::Core(e) => Python::attach(|py| {
                build(py, &e).unwrap_or_else(|import_err| {
                    PyRuntimeError::new_err(format!(
                        "{e} (and kvtier._errors failed: {import_err})"
                    ))
                })
            }),
        }
    }
}

/// Result alias for binding methods.
pub type KvResult<T> = Result<T, PyKvErr>;
