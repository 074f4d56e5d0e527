//! `tp_allreduce._core.Id`: the rendezvous id rank 0 creates and the other
//! ranks receive (as its one-line string) through their own channel.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;

use pyo3::basic::CompareOp;
use pyo3::prelude::*;
use tp_allreduce::rendezvous::Id;

use crate::errors::{invalid, IntoPyResult};

/// Where rank 0 listens and which job the ranks belong to. `str(id)` is a
/// one-line ASCII string that `Id.parse` reads back; treat it like a
/// password (it admits a rank to the job).
#[pyclass(name = "Id", module = "tp_allreduce._core", frozen)]
pub struct PyId {
    pub(crate) id: Id,
}

#[pymethods]
impl PyId {
    /// A new id for a Unix-socket rendezvous (ranks on one host). Creates a
    /// private directory under `$XDG_RUNTIME_DIR` or the temp dir; rank 0
    /// removes it once every rank joined.
    #[staticmethod]
    fn new_unix(py: Python<'_>) -> PyResult<PyId> {
        Id::new_unix().py(py).map(|id| PyId { id })
    }

    /// A new id for a TCP rendezvous where rank 0 listens on `addr`
    /// (`"127.0.0.1:29500"`; use loopback).
    #[staticmethod]
    fn new_tcp(py: Python<'_>, addr: &str) -> PyResult<PyId> {
        let parsed: SocketAddr =
            addr.parse().map_err(|_| invalid(py, format!("new_tcp: {addr:?} is not IP:port or [IPv6]:port")))?;
        Ok(PyId { id: Id::new_tcp(parsed) })
    }

    /// Reads an id from its string form; raises `InvalidUsage` on anything
    /// else.
    #[staticmethod]
    fn parse(py: Python<'_>, text: &str) -> PyResult<PyId> {
        text.parse::<Id>().py(py).map(|id| PyId { id })
    }

    /// Removes what a Unix id left on disk when rank 0 died before every
    /// rank joined (a no-op otherwise and for TCP ids).
    fn remove_files(&self) {
        self.id.remove_files();
    }

    fn __str__(&self) -> String {
        self.id.to_string()
    }

    /// Without the secret (`Id`'s `Debug` hides it): a repr ends up in
    /// logs and tracebacks; `str(id)` is the full string to pass on.
    fn __repr__(&self) -> String {
        format!("{:?}", self.id)
    }

    fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> Py<PyAny> {
        let py = other.py();
        let Ok(other) = other.cast::<PyId>() else {
            return py.NotImplemented();
        };
        let equal = self.id == other.get().id;
        match op {
            CompareOp::Eq => equal.into_pyobject(py).map(|b| b.to_owned().into_any().unbind()).unwrap_or(py.None()),
            CompareOp::Ne => (!equal).into_pyobject(py).map(|b| b.to_owned().into_any().unbind()).unwrap_or(py.None()),
            _ => py.NotImplemented(),
        }
    }

    fn __hash__(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.id.hash(&mut h);
        h.finish()
    }
}
