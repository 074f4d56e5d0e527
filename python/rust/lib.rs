//! `tp_allreduce._core`: the torch-free layer of the Python package.
//!
//! * [`id::PyId`] — the rendezvous id (create, parse, print).
//! * [`communicator::PyCommunicator`] — one rank, from (rank, world size,
//!   id, device ordinal), with raw-pointer calls.
//! * dtype codes and argument checks, driver probes.
//!
//! Library errors become the exception classes of `tp_allreduce.errors`
//! (see [`errors`]). Nothing here panics on bad input or a missing driver.
//!
//! Logging: the library's records (the `log` facade) reach Python's
//! `logging` through `pyo3-log`, under the records' targets with `.` for
//! `::` (`tp_allreduce.comm.group`, `tp_allreduce.comm.setup`, ...; the
//! binding's own: `tp_allreduce.python`), so `logging.getLogger
//! ("tp_allreduce")` configures them all. The bridge asks Python's loggers
//! for their level on every record (no cached levels: reconfiguring
//! `logging` later takes effect); records are rare (communicator creation,
//! fallbacks).

mod communicator;
mod device;
mod dtype;
mod errors;
mod id;

use pyo3::prelude::*;
use tp_allreduce::DType;

/// Whether a CUDA driver can be loaded and initialised in this process.
#[pyfunction]
fn driver_available() -> bool {
    device::driver_available()
}

/// Whether the allocation holding device pointer `ptr` can be exported
/// with legacy CUDA IPC (False for PyTorch's expandable segments).
#[pyfunction]
fn pointer_is_ipc_exportable(py: Python<'_>, ptr: u64) -> PyResult<bool> {
    if ptr == 0 {
        return Err(errors::invalid(py, "pointer_is_ipc_exportable: null pointer"));
    }
    device::require_driver().map_err(|e| errors::to_py_err(py, e))?;
    Ok(device::pointer_is_ipc_exportable(ptr))
}

/// Bytes per element of a dtype code.
#[pyfunction]
fn dtype_size(py: Python<'_>, code: u32) -> PyResult<usize> {
    Ok(dtype::dtype_from_code(py, code)?.size_bytes())
}

/// Short name (`f32`, `f16`, `bf16`) of a dtype code.
#[pyfunction]
fn dtype_name(py: Python<'_>, code: u32) -> PyResult<&'static str> {
    Ok(dtype::dtype_from_code(py, code)?.name())
}

/// Checks raw allreduce arguments the way `Communicator.all_reduce` does
/// before touching the GPU; returns the dtype's short name.
#[pyfunction]
fn check_call_args(py: Python<'_>, send_ptr: u64, recv_ptr: u64, count: usize, dtype: u32) -> PyResult<&'static str> {
    Ok(dtype::check_call_args(py, send_ptr, recv_ptr, count, dtype)?.name())
}

/// Emits one record through the Rust `log` facade, as the library does
/// (target `tp_allreduce.python`; `level`: `error`, `warn`, `info`,
/// `debug`, `trace`). For tests of the logging bridge.
#[pyfunction]
fn _emit_log(py: Python<'_>, level: &str, message: &str) -> PyResult<()> {
    let level: log::Level = level.parse().map_err(|_| errors::invalid(py, format!("unknown log level {level:?}")))?;
    // Released like every library call: the bridge takes the GIL back itself.
    let message = message.to_owned();
    py.detach(move || log::log!(target: communicator::LOG_TARGET, level, "{message}"));
    Ok(())
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // A second install (the module initialised again in another
    // interpreter) keeps the first logger: nothing to do.
    let _ = pyo3_log::Logger::new(m.py(), pyo3_log::Caching::Loggers)?.install();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DTYPE_F32", DType::F32 as u32)?;
    m.add("DTYPE_F16", DType::F16 as u32)?;
    m.add("DTYPE_BF16", DType::Bf16 as u32)?;
    m.add("DEFAULT_CAPTURE_COPY_BYTES", communicator::DEFAULT_CAPTURE_COPY_BYTES)?;
    m.add_class::<id::PyId>()?;
    m.add_class::<communicator::PyCommunicator>()?;
    m.add_class::<communicator::PyPreparedRank>()?;
    m.add_function(wrap_pyfunction!(driver_available, m)?)?;
    m.add_function(wrap_pyfunction!(pointer_is_ipc_exportable, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_size, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_name, m)?)?;
    m.add_function(wrap_pyfunction!(check_call_args, m)?)?;
    m.add_function(wrap_pyfunction!(_emit_log, m)?)?;
    Ok(())
}
