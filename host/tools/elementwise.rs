//! The elementwise kernels the benchmark and the tests put between
//! allreduces: `affine` (`x * scale + bias`, a stand-in for a model layer)
//! and `sum` (K buffers into one). Safe wrappers over cudarc's
//! `DevicePtr`/`DevicePtrMut` (e.g. [`crate::DeviceBuffer`]); the launches
//! themselves live outside the tools, in the library's `elementwise` module.
#![forbid(unsafe_code)]

pub use crate::driver::elementwise::{affine, affine_in_place, sum};
