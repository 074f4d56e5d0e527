//! [`AnyBuffer`]: a [`DeviceBuffer`] whose element type is chosen at run
//! time (`--dtype`), with the typed calls the tools make on it: allreduce
//! through [`Comm::all_reduce`], through NCCL, and the elementwise `affine`.
#![forbid(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::{sys, CudaStream};
use half::{bf16, f16};

use tp_allreduce::buffer::DeviceBuffer;
use tp_allreduce::comm::{Comm, ReduceOp};
use tp_allreduce::driver::elementwise;
use tp_allreduce::error::{Error, Result};
use tp_allreduce::nccl::NcclComm;
use tp_allreduce::{Collective, DType};

/// A device buffer of f32, f16 or bf16.
#[derive(Debug)]
pub enum AnyBuffer {
    F32(DeviceBuffer<f32>),
    F16(DeviceBuffer<f16>),
    Bf16(DeviceBuffer<bf16>),
}

/// `$body` with `$b` bound to the typed buffer, whatever the variant.
macro_rules! each {
    ($value:expr, $b:ident => $body:expr) => {
        match $value {
            AnyBuffer::F32($b) => $body,
            AnyBuffer::F16($b) => $body,
            AnyBuffer::Bf16($b) => $body,
        }
    };
}

impl AnyBuffer {
    /// `count` elements of `dtype` with unspecified contents.
    pub fn alloc(stream: &Arc<CudaStream>, dtype: DType, count: usize) -> Result<AnyBuffer> {
        Ok(match dtype {
            DType::F32 => AnyBuffer::F32(DeviceBuffer::alloc(stream, count)?),
            DType::F16 => AnyBuffer::F16(DeviceBuffer::alloc(stream, count)?),
            DType::Bf16 => AnyBuffer::Bf16(DeviceBuffer::alloc(stream, count)?),
        })
    }

    /// A buffer holding `bytes` (element bit patterns of `dtype`).
    pub fn from_bytes(stream: &Arc<CudaStream>, dtype: DType, bytes: &[u8]) -> Result<AnyBuffer> {
        let mut buffer = Self::alloc(stream, dtype, bytes.len() / dtype.size_bytes())?;
        buffer.copy_bytes_from_host(bytes)?;
        Ok(buffer)
    }

    pub fn dtype(&self) -> DType {
        match self {
            AnyBuffer::F32(_) => DType::F32,
            AnyBuffer::F16(_) => DType::F16,
            AnyBuffer::Bf16(_) => DType::Bf16,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        each!(self, b => cudarc::driver::DeviceSlice::len(b))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn num_bytes(&self) -> usize {
        self.len() * self.dtype().size_bytes()
    }

    pub fn device_address(&self) -> sys::CUdeviceptr {
        each!(self, b => b.device_address())
    }

    pub fn copy_bytes_from_host(&mut self, bytes: &[u8]) -> Result<()> {
        each!(self, b => b.copy_bytes_from_host(bytes))
    }

    pub fn to_host_bytes(&self) -> Result<Vec<u8>> {
        each!(self, b => b.to_host_bytes())
    }

    /// Sets every byte (0x7F poisons: huge or NaN, never a valid sum here).
    pub fn fill_bytes(&mut self, value: u8) -> Result<()> {
        each!(self, b => b.fill_bytes(value))
    }
}

fn mismatch(what: &str, a: &AnyBuffer, b: &AnyBuffer) -> Error {
    Error::invalid(format!("{what}: buffers of {} and {} elements", a.dtype().name(), b.dtype().name()))
}

/// `comm.all_reduce(input, output)` (sum) on the communicator's stream.
pub fn all_reduce(comm: &Comm, input: &AnyBuffer, output: &mut AnyBuffer) -> Result<()> {
    let op = ReduceOp::Sum;
    match (input, output) {
        (AnyBuffer::F32(i), AnyBuffer::F32(o)) => comm.all_reduce(i, o, &op),
        (AnyBuffer::F16(i), AnyBuffer::F16(o)) => comm.all_reduce(i, o, &op),
        (AnyBuffer::Bf16(i), AnyBuffer::Bf16(o)) => comm.all_reduce(i, o, &op),
        (i, o) => Err(mismatch("all_reduce", i, o)),
    }
}

/// NCCL's sum allreduce of `input` into `output` on `stream`.
pub fn nccl_all_reduce(nccl: &NcclComm, input: &AnyBuffer, output: &mut AnyBuffer, stream: &CudaStream) -> Result<()> {
    if input.dtype() != output.dtype() || input.len() != output.len() {
        return Err(mismatch("NCCL all_reduce", input, output));
    }
    nccl.all_reduce(input.device_address(), output.device_address(), input.len(), input.dtype(), stream.cu_stream())
}

/// `collective` of `input` into `output` (sum) on the communicator's
/// stream: the allreduce, the all-gather (`output` holds `world` inputs)
/// or the reduce-scatter (`input` holds `world` outputs).
pub fn run(comm: &Comm, collective: Collective, input: &AnyBuffer, output: &mut AnyBuffer) -> Result<()> {
    let op = ReduceOp::Sum;
    match (collective, input, output) {
        (Collective::AllReduce, i, o) => all_reduce(comm, i, o),
        (Collective::AllGather, AnyBuffer::F32(i), AnyBuffer::F32(o)) => comm.all_gather(i, o),
        (Collective::AllGather, AnyBuffer::F16(i), AnyBuffer::F16(o)) => comm.all_gather(i, o),
        (Collective::AllGather, AnyBuffer::Bf16(i), AnyBuffer::Bf16(o)) => comm.all_gather(i, o),
        (Collective::ReduceScatter, AnyBuffer::F32(i), AnyBuffer::F32(o)) => comm.reduce_scatter(i, o, &op),
        (Collective::ReduceScatter, AnyBuffer::F16(i), AnyBuffer::F16(o)) => comm.reduce_scatter(i, o, &op),
        (Collective::ReduceScatter, AnyBuffer::Bf16(i), AnyBuffer::Bf16(o)) => comm.reduce_scatter(i, o, &op),
        (_, i, o) => Err(mismatch(collective.name(), i, o)),
    }
}

/// NCCL's `collective` (sum) of `input` into `output` on `stream`, shaped
/// as in [`run`].
pub fn nccl_run(
    nccl: &NcclComm,
    collective: Collective,
    input: &AnyBuffer,
    output: &mut AnyBuffer,
    stream: &CudaStream,
) -> Result<()> {
    if input.dtype() != output.dtype() {
        return Err(mismatch(collective.name(), input, output));
    }
    let (send, recv, dtype, s) = (input.device_address(), output.device_address(), input.dtype(), stream.cu_stream());
    match collective {
        Collective::AllReduce => nccl_all_reduce(nccl, input, output, stream),
        Collective::AllGather => nccl.all_gather(send, recv, input.len(), dtype, s),
        Collective::ReduceScatter => nccl.reduce_scatter(send, recv, output.len(), dtype, s),
    }
}

/// `output = input * scale + bias` on `stream` (capturable).
pub fn affine(
    stream: &Arc<CudaStream>,
    input: &AnyBuffer,
    output: &mut AnyBuffer,
    scale: f32,
    bias: f32,
) -> Result<()> {
    match (input, output) {
        (AnyBuffer::F32(i), AnyBuffer::F32(o)) => elementwise::affine(stream, i, o, scale, bias),
        (AnyBuffer::F16(i), AnyBuffer::F16(o)) => elementwise::affine(stream, i, o, scale, bias),
        (AnyBuffer::Bf16(i), AnyBuffer::Bf16(o)) => elementwise::affine(stream, i, o, scale, bias),
        (i, o) => Err(mismatch("affine", i, o)),
    }
}

/// `$call` with `$i, $r, $w, $n` bound to four typed buffers of one element
/// type (`Err` when the types differ).
macro_rules! each4 {
    ($what:expr, ($a:expr, $b:expr, $c:expr, $d:expr), ($i:ident, $r:ident, $w:ident, $n:ident) => $call:expr) => {
        match ($a, $b, $c, $d) {
            (AnyBuffer::F32($i), AnyBuffer::F32($r), AnyBuffer::F32($w), AnyBuffer::F32($n)) => $call,
            (AnyBuffer::F16($i), AnyBuffer::F16($r), AnyBuffer::F16($w), AnyBuffer::F16($n)) => $call,
            (AnyBuffer::Bf16($i), AnyBuffer::Bf16($r), AnyBuffer::Bf16($w), AnyBuffer::Bf16($n)) => $call,
            (i, _, _, n) => Err(mismatch($what, i, n)),
        }
    };
}

/// [`Comm::all_reduce_add_rms_norm`] on buffers of one run-time dtype.
pub fn all_reduce_add_rms_norm(
    comm: &Comm,
    input: &AnyBuffer,
    residual: &mut AnyBuffer,
    weight: &AnyBuffer,
    eps: f32,
    normed: &mut AnyBuffer,
    opts: &tp_allreduce::FusedOptions,
) -> Result<()> {
    each4!("all_reduce_add_rms_norm", (input, residual, weight, normed), (i, r, w, n) =>
        comm.all_reduce_add_rms_norm(i, r, w, eps, n, opts))
}

/// [`Comm::add_rms_norm`] (the separate epilogue kernel) on buffers of one
/// run-time dtype.
pub fn add_rms_norm(
    comm: &Comm,
    sum: &AnyBuffer,
    residual: &mut AnyBuffer,
    weight: &AnyBuffer,
    eps: f32,
    normed: &mut AnyBuffer,
    opts: &tp_allreduce::FusedOptions,
) -> Result<()> {
    each4!("add_rms_norm", (sum, residual, weight, normed), (s, r, w, n) => comm.add_rms_norm(s, r, w, eps, n, opts))
}
