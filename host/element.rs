//! The element types an allreduce accepts, tied to their [`DType`]
//! (accumulated in f32 by every kernel).

#![forbid(unsafe_code)]

use crate::DType;

/// Element types the allreduce accepts (accumulated in f32).
pub trait Element: cudarc::driver::DeviceRepr {
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::Bf16;
}
