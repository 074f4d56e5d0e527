//! Element types as the small integer codes the raw API takes (the
//! library's `DType` discriminants), and the argument checks every raw call
//! makes before touching the driver.

use pyo3::prelude::*;
use tp_allreduce::DType;

use crate::errors::invalid;

/// The `DType` for a code, or `InvalidUsage` naming the valid codes.
pub fn dtype_from_code(py: Python<'_>, code: u32) -> PyResult<DType> {
    DType::from_u32(code).ok_or_else(|| {
        let valid: Vec<String> = DType::ALL.iter().map(|d| format!("{} = {}", *d as u32, d.name())).collect();
        invalid(py, format!("unknown dtype code {code} (valid: {})", valid.join(", ")))
    })
}

/// The checks of a raw allreduce that need no GPU: a known dtype, non-null
/// pointers aligned to the element size, a byte count that fits. Returns
/// the dtype. (The library checks the same again, plus that the pointers
/// are device memory of the right context and large enough.)
pub fn check_call_args(py: Python<'_>, send: u64, recv: u64, count: usize, dtype: u32) -> PyResult<DType> {
    let dtype = dtype_from_code(py, dtype)?;
    if count == 0 {
        return Ok(dtype);
    }
    if send == 0 || recv == 0 {
        return Err(invalid(py, "all_reduce: null device pointer"));
    }
    let elem = dtype.size_bytes() as u64;
    if send % elem != 0 || recv % elem != 0 {
        return Err(invalid(
            py,
            format!("all_reduce: pointers must be aligned to the {elem}-byte size of {}", dtype.name()),
        ));
    }
    let bytes = count
        .checked_mul(dtype.size_bytes())
        .filter(|b| send.checked_add(*b as u64).is_some() && recv.checked_add(*b as u64).is_some())
        .ok_or_else(|| {
            invalid(py, format!("all_reduce: {count} elements of {} overflow the address space", dtype.name()))
        })?;
    let (a, b) = (send, recv);
    if a != b && a < b + bytes as u64 && b < a + bytes as u64 {
        return Err(invalid(py, "all_reduce: send and recv overlap without being equal"));
    }
    Ok(dtype)
}
