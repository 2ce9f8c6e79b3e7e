//! The library's errors as Python exceptions, with the library's messages.
//!
//! | `MoeError` | Python |
//! | --- | --- |
//! | `Shape`, `DType`, `ExpertOutOfRange`, `NonFinite`, `Config`, `Format`, `Json` | `ValueError` |
//! | `Comm` (a rank failed, a deadline passed) | `moeflow.CommunicationError` (a `RuntimeError`) |
//! | `Io` | `OSError` (`FileNotFoundError` for a missing file) |
//! | `OutOfMemory`, `DeviceOutOfMemory` | `MemoryError` |
//! | `Unsupported` | `NotImplementedError` (a `RuntimeError`) |
//! | `NonFiniteOutput` | `RuntimeError` |

use moeflow::MoeError;
use pyo3::exceptions::{
    PyFileNotFoundError, PyMemoryError, PyNotImplementedError, PyOSError, PyRuntimeError, PyValueError,
};
use pyo3::PyErr;

pyo3::create_exception!(
    moeflow,
    CommunicationError,
    PyRuntimeError,
    "A collective between ranks failed: a rank died or failed, or a deadline passed."
);

/// The Python exception for `e`, carrying its message.
pub fn to_py(e: MoeError) -> PyErr {
    let msg = e.to_string();
    match e {
        MoeError::Shape { .. }
        | MoeError::DType { .. }
        | MoeError::ExpertOutOfRange { .. }
        | MoeError::NonFinite { .. }
        | MoeError::Config(_)
        | MoeError::Format(_)
        | MoeError::Json { .. } => PyValueError::new_err(msg),
        MoeError::Comm { .. } => CommunicationError::new_err(msg),
        MoeError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            PyFileNotFoundError::new_err(msg)
        }
        MoeError::Io { .. } => PyOSError::new_err(msg),
        MoeError::OutOfMemory { .. } | MoeError::DeviceOutOfMemory { .. } => PyMemoryError::new_err(msg),
        MoeError::Unsupported(_) => PyNotImplementedError::new_err(msg),
        MoeError::NonFiniteOutput { .. } => PyRuntimeError::new_err(msg),
    }
}

/// `Result<T, MoeError>` → `PyResult<T>`.
pub trait IntoPy<T> {
    /// The value, or the Python exception for the error.
    fn py_err(self) -> pyo3::PyResult<T>;
}

impl<T> IntoPy<T> for moeflow::Result<T> {
    fn py_err(self) -> pyo3::PyResult<T> {
        self.map_err(to_py)
    }
}

/// A `ValueError` with `msg`.
pub fn bad_input(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}
