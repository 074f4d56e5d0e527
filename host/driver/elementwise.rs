//! Typed launch wrappers for the elementwise kernels: `sum` (K buffers into
//! one, accumulated in f32 — the reduction every allreduce kernel reuses)
//! and `affine` (`x * scale + bias`, the stand-in for a model layer between
//! two allreduces in tests and the verify-pass benchmark).
//!
//! Used by the tool and the tests only (compiled with the `internals`
//! feature). It lives in the driver room because its `unsafe` is a kernel
//! launch.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use tp_allreduce_kernels::layout::THREADS_PER_BLOCK;
use tp_allreduce_kernels::partition::{div_ceil, packs_for};

use crate::driver::{self, DeviceMemory, KernelArgs, KernelModule};
use crate::element::Element;
use crate::error::{Error, Result};
use crate::DType;

fn grid(count: usize, dtype: DType) -> u32 {
    div_ceil(packs_for(count as u64, dtype), THREADS_PER_BLOCK as u64).clamp(1, 65_535) as u32
}

/// `output = inputs[0] + inputs[1] + ...` elementwise (f32 accumulation in
/// input order, one rounding). Allocates a small device array for the input
/// pointers, so it is not for use inside graph capture.
pub fn sum<T: Element, I: DevicePtr<T>, O: DevicePtrMut<T>>(
    stream: &Arc<CudaStream>,
    inputs: &[&I],
    output: &mut O,
) -> Result<()> {
    let count = output.len();
    if inputs.is_empty() {
        return Err(Error::invalid("sum: no inputs"));
    }
    if let Some(bad) = inputs.iter().position(|i| i.len() != count) {
        return Err(Error::invalid(format!("sum: input {bad} has {} elements, output {count}", inputs[bad].len())));
    }
    let mut guards = Vec::with_capacity(inputs.len());
    let mut ptrs = Vec::with_capacity(inputs.len());
    for i in inputs {
        let (p, g) = i.device_ptr(stream);
        ptrs.push(p);
        guards.push(g);
    }
    let (out, _g) = output.device_ptr_mut(stream);
    // SAFETY: pointers come from live cudarc buffers of `count` elements.
    unsafe { sum_raw(stream, &ptrs, out, count, T::DTYPE) }
}

/// Raw form of [`sum`].
///
/// # Safety
/// Every pointer must be a device buffer of `count` elements of `dtype` in
/// the stream's context, valid until the stream reaches the kernel's end.
unsafe fn sum_raw(
    stream: &Arc<CudaStream>,
    inputs: &[sys::CUdeviceptr],
    output: sys::CUdeviceptr,
    count: usize,
    dtype: DType,
) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    let module = KernelModule::for_context(stream.context())?;
    let kernel = module.kernel(&format!("sum_{}", dtype.name()))?;
    let table = DeviceMemory::alloc(stream.context(), inputs.len() * 8)?;
    driver::memcpy_htod(table.ptr(), bytemuck::cast_slice(inputs))?;
    let args = KernelArgs::new().u64(table.ptr()).u32(inputs.len() as u32).u64(output).u64(count as u64);
    driver::launch(&kernel, grid(count, dtype), THREADS_PER_BLOCK, stream.cu_stream(), &args)?;
    // The pointer table must outlive the kernel.
    driver::synchronize(stream)
}

/// `output = input * scale + bias` elementwise (in f32, one rounding).
/// Capturable in a CUDA graph.
pub fn affine<T: Element, I: DevicePtr<T>, O: DevicePtrMut<T>>(
    stream: &Arc<CudaStream>,
    input: &I,
    output: &mut O,
    scale: f32,
    bias: f32,
) -> Result<()> {
    if input.len() != output.len() {
        return Err(Error::invalid("affine: input and output lengths differ"));
    }
    let count = input.len();
    let (i, _gi) = input.device_ptr(stream);
    let (o, _go) = output.device_ptr_mut(stream);
    // SAFETY: pointers come from live cudarc buffers of `count` elements.
    unsafe { affine_raw(stream.context(), stream.cu_stream(), i, o, count, T::DTYPE, scale, bias) }
}

/// `buffer = buffer * scale + bias` elementwise (in f32, one rounding).
/// Capturable in a CUDA graph.
pub fn affine_in_place<T: Element, B: DevicePtrMut<T>>(
    stream: &Arc<CudaStream>,
    buffer: &mut B,
    scale: f32,
    bias: f32,
) -> Result<()> {
    let count = buffer.len();
    let (p, _g) = buffer.device_ptr_mut(stream);
    // SAFETY: the pointer comes from a live buffer of `count` elements;
    // the kernel allows input == output.
    unsafe { affine_raw(stream.context(), stream.cu_stream(), p, p, count, T::DTYPE, scale, bias) }
}

/// Raw form of [`affine`] on any stream of `ctx`.
///
/// # Safety
/// As [`sum_raw`]; `input` may equal `output`.
#[allow(clippy::too_many_arguments)]
unsafe fn affine_raw(
    ctx: &Arc<CudaContext>,
    stream: sys::CUstream,
    input: sys::CUdeviceptr,
    output: sys::CUdeviceptr,
    count: usize,
    dtype: DType,
    scale: f32,
    bias: f32,
) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    let module = KernelModule::for_context(ctx)?;
    let kernel = module.kernel(&format!("affine_{}", dtype.name()))?;
    let args = KernelArgs::new().u64(input).u64(output).u64(count as u64).f32(scale).f32(bias);
    driver::launch(&kernel, grid(count, dtype), THREADS_PER_BLOCK, stream, &args)
}
