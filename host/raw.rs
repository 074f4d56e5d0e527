//! For callers not on cudarc's typed buffers: raw device pointers and
//! streams (the `*_raw` methods of [`Comm`](crate::Comm) take them), an
//! owned `cuMemAlloc` allocation, the synchronous copies and fills the
//! examples and tests use, device queries that never panic, and graph
//! capture of a closure.

#![forbid(unsafe_code)]

pub use cudarc::driver::sys::{CUdeviceptr, CUstream};

pub use crate::buffer::{DeviceView, DeviceViewMut};
pub use crate::driver::{
    capture, context_synchronize, device_count, driver_available, memcpy_dtoh, memcpy_htod, memset_d8, memset_d8_async,
    require_driver, DeviceMemory,
};
