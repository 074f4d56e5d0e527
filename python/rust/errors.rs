//! Library errors as Python exceptions. The classes live in
//! `tp_allreduce/errors.py` (so they can also derive from the matching
//! built-in exceptions: `InvalidUsage` is a `ValueError`, timeouts are
//! `TimeoutError`s); every exception carries the library's message.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use tp_allreduce::Error;

/// The Python class (in `tp_allreduce.errors`) for a library error.
pub fn class_name(e: &Error) -> &'static str {
    #[allow(unreachable_patterns)]
    match e {
        Error::Driver { .. } => "DriverError",
        Error::NoDriver(_) => "NoDriverError",
        Error::InvalidUsage(_) => "InvalidUsage",
        Error::Unsupported(_) => "Unsupported",
        Error::Timeout(_) => "DeviceTimeout",
        Error::PeerAborted(_) => "PeerAborted",
        Error::Device(_) => "DeviceError",
        Error::Broken(_) => "CommunicatorBroken",
        Error::Rendezvous(_) | Error::Protocol { .. } => "RendezvousError",
        Error::RendezvousTimeout { .. } => "RendezvousTimeout",
        Error::Ipc(_) => "IpcError",
        Error::P2pCheck { .. } => "P2pCheckError",
        Error::Nccl(_) => "NcclError",
        Error::Config(_) => "ConfigError",
        Error::Io { .. } => "IoError",
        // Variants added to the library later map to the base class.
        _ => "TpAllreduceError",
    }
}

/// Builds the Python exception for `e` (falls back to `RuntimeError` if the
/// errors module cannot be imported, which only a broken install causes).
pub fn to_py_err(py: Python<'_>, e: Error) -> PyErr {
    let message = e.to_string();
    let name = class_name(&e);
    let made = (|| -> PyResult<PyErr> {
        let cls = py.import("tp_allreduce.errors")?.getattr(name)?;
        Ok(PyErr::from_value(cls.call1((message.clone(),))?))
    })();
    made.unwrap_or_else(|_| PyRuntimeError::new_err(format!("{name}: {message}")))
}

/// `InvalidUsage` with `message`.
pub fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    to_py_err(py, Error::InvalidUsage(message.into()))
}

/// Maps a library result to a Python one.
pub trait IntoPyResult<T> {
    fn py(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, Error> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py_err(py, e))
    }
}
