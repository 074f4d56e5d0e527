//! The allreduce as [candle](https://github.com/huggingface/candle) ops
//! (cargo feature `candle`), shaped like the NCCL ops that candle's
//! `llama_multiprocess` example and mistral.rs's `SumAllReduce` build on
//! `cudarc::nccl::Comm`, so an engine switches by swapping the communicator:
//!
//! * [`AllReduce`]: sum over the ranks, as a [`CustomOp1`] (out of place:
//!   allocates the output) and an [`InplaceOp1`] (overwrites the tensor).
//! * [`AllGather`], [`ReduceScatter`]: the collectives beside it, over
//!   dimension 0, as [`CustomOp1`]s.
//! * [`FusedAddRmsNorm`]: the transformer layer's epilogue, allreduce then
//!   `residual += x` then `RMSNorm(residual) * weight` (see its docs: an
//!   unfused composition for now).
//! * [`encode_id`] / [`decode_id`]: the rendezvous [`Id`] as the 128-byte
//!   payload in which engines pass an NCCL unique id to their workers.
//!
//! Tensors must be contiguous CUDA tensors of f32, f16 or bf16 on the
//! communicator's device; anything else is a candle error, never a panic.
//!
//! # Streams and CUDA graphs
//! The ops run on the tensor's candle stream (`CudaDevice::cuda_stream()`),
//! ordered with candle's kernels on it. Build the communicator on that
//! stream (`Comm::from_rank(device.cuda_stream(), ...)`, see
//! `examples/candle_tp.rs`): candle-core 0.11 and this crate use the same
//! cudarc (0.19.10), so the stream is the same type. When the engine
//! captures a CUDA graph around the model, the allreduce is captured with it
//! (the output allocation becomes a graph memory node, as for candle's own
//! ops); after the capture call [`Comm::register_graph_buffers`] on every
//! rank before the first replay. candle's tensors come from the
//! stream-ordered pool, which cannot be exported to peers: pull algorithms
//! stage such inputs with a captured copy, push algorithms read them in
//! place. As for any candle capture: turn cudarc's event tracking off
//! (`CudaDevice::disable_event_tracking`) and keep candle's parameter cache
//! on (`CudaDevice::enable_cuda_graph_htod_cache`) over an eager warm-up and
//! the capture.

#![forbid(unsafe_code)]

mod gather_scatter;
mod norm;
#[cfg(test)]
mod tests;

use std::ffi::c_char;
use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaDType;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, InplaceOp1, Layout, Shape, Tensor};
use cudarc::driver::{CudaSlice, CudaStream};

pub use gather_scatter::{AllGather, ReduceScatter};
pub use norm::FusedAddRmsNorm;

use crate::comm::{Comm, Element};
use crate::rendezvous::Id;
use crate::DType;

/// The name candle reports for the ops' errors.
const ALL_REDUCE_OP: &str = "tp-allreduce all_reduce";

/// Bytes of the id payload engines pass to their workers (the size of an
/// NCCL unique id, `[c_char; 128]`).
pub const ID_PAYLOAD_BYTES: usize = 128;

/// The input of a call: a slice and its start element (`None`: in place).
type Slot<'a, T> = Option<(&'a CudaSlice<T>, usize)>;
/// The output of a call: a slice and its start element.
type SlotMut<'a, T> = (&'a mut CudaSlice<T>, usize);
type Res = crate::Result<()>;

/// The call the ops make, per element type: `Comm` in the library (its
/// safe [`Comm::all_reduce_slices_on`]); a recording fake in the CPU tests,
/// so that the ops' checks run without a GPU. (One method per type: a
/// generic method would make the trait unusable as `dyn`.)
trait SliceAllReduce: Send + Sync {
    fn f32(&self, send: Slot<'_, f32>, recv: SlotMut<'_, f32>, count: usize, stream: &Arc<CudaStream>) -> Res;
    fn f16(
        &self,
        send: Slot<'_, half::f16>,
        recv: SlotMut<'_, half::f16>,
        count: usize,
        stream: &Arc<CudaStream>,
    ) -> Res;
    fn bf16(
        &self,
        send: Slot<'_, half::bf16>,
        recv: SlotMut<'_, half::bf16>,
        count: usize,
        stream: &Arc<CudaStream>,
    ) -> Res;
}

impl SliceAllReduce for Comm {
    fn f32(&self, send: Slot<'_, f32>, recv: SlotMut<'_, f32>, count: usize, stream: &Arc<CudaStream>) -> Res {
        self.all_reduce_slices_on(send, recv, count, stream)
    }
    fn f16(
        &self,
        send: Slot<'_, half::f16>,
        recv: SlotMut<'_, half::f16>,
        count: usize,
        stream: &Arc<CudaStream>,
    ) -> Res {
        self.all_reduce_slices_on(send, recv, count, stream)
    }
    fn bf16(
        &self,
        send: Slot<'_, half::bf16>,
        recv: SlotMut<'_, half::bf16>,
        count: usize,
        stream: &Arc<CudaStream>,
    ) -> Res {
        self.all_reduce_slices_on(send, recv, count, stream)
    }
}

/// The element types of the ops, each routed to its method of
/// [`SliceAllReduce`].
trait OpElement: CudaDType + Element + cudarc::driver::ValidAsZeroBits {
    fn reduce(
        comm: &dyn SliceAllReduce,
        send: Slot<'_, Self>,
        recv: SlotMut<'_, Self>,
        count: usize,
        stream: &Arc<CudaStream>,
    ) -> Res;
}

/// `OpElement` for `$t`, routed to `SliceAllReduce::$method`.
macro_rules! op_element {
    ($t:ty, $method:ident) => {
        impl OpElement for $t {
            fn reduce(
                c: &dyn SliceAllReduce,
                s: Slot<'_, $t>,
                r: SlotMut<'_, $t>,
                n: usize,
                st: &Arc<CudaStream>,
            ) -> Res {
                c.$method(s, r, n, st)
            }
        }
    };
}
op_element!(f32, f32);
op_element!(half::f16, f16);
op_element!(half::bf16, bf16);

/// Sum allreduce of a tensor over the ranks of a [`Comm`].
///
/// ```ignore
/// let all_reduce = AllReduce::new(comm.clone());
/// let y = all_reduce.all_reduce(&x)?;      // out of place
/// all_reduce.all_reduce_in_place(&x)?;     // x overwritten with the sum
/// ```
#[derive(Clone)]
pub struct AllReduce {
    comm: Arc<dyn SliceAllReduce>,
}

impl std::fmt::Debug for AllReduce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AllReduce")
    }
}

impl AllReduce {
    pub fn new(comm: Arc<Comm>) -> Self {
        AllReduce { comm }
    }

    /// The sum over the ranks of `xs`, in a new tensor (the [`CustomOp1`]).
    pub fn all_reduce(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        xs.apply_op1_no_bwd(self)
    }

    /// Overwrites `xs` with the sum over the ranks (the [`InplaceOp1`]);
    /// every tensor sharing its storage sees the result.
    pub fn all_reduce_in_place(&self, xs: &Tensor) -> candle_core::Result<()> {
        xs.inplace_op1(self)
    }

    /// Allreduce of `count` elements from `src` (slice and start element)
    /// into `dst` from element `dst_offset` (`src` `None`: in place) on
    /// `stream`, the buffers' candle stream.
    fn reduce_slices<T: OpElement>(
        &self,
        src: Option<(&CudaSlice<T>, usize)>,
        dst: &mut CudaSlice<T>,
        dst_offset: usize,
        count: usize,
        stream: &Arc<CudaStream>,
    ) -> candle_core::Result<()> {
        let src_len = src.map_or(0, |(slice, start)| slice.len().saturating_sub(start));
        if dst.len().saturating_sub(dst_offset) < count || (src.is_some() && src_len < count) {
            candle_core::bail!("{ALL_REDUCE_OP}: the layout reaches past the end of the tensor's storage");
        }
        T::reduce(&*self.comm, src, (dst, dst_offset), count, stream).map_err(to_candle)
    }

    /// The out-of-place op for element type `T`.
    fn out_of_place<T: OpElement>(
        &self,
        storage: &CudaStorage,
        start: usize,
        count: usize,
    ) -> candle_core::Result<CudaStorage> {
        let device = storage.device().clone();
        // Zeroed (a memset on the stream; the allreduce overwrites it). One
        // element at least: the driver refuses empty allocations.
        let mut out = device.alloc_zeros::<T>(count.max(1))?;
        self.reduce_slices(Some((storage.as_cuda_slice::<T>()?, start)), &mut out, 0, count, &device.cuda_stream())?;
        Ok(CudaStorage::wrap_cuda_slice(out, device))
    }

    /// The in-place op for element type `T`.
    fn in_place<T: OpElement>(&self, storage: &mut CudaStorage, start: usize, count: usize) -> candle_core::Result<()> {
        let stream = storage.device().cuda_stream();
        self.reduce_slices(None, storage.as_cuda_slice_mut::<T>()?, start, count, &stream)
    }
}

impl CustomOp1 for AllReduce {
    fn name(&self) -> &'static str {
        ALL_REDUCE_OP
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(ALL_REDUCE_OP))
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (dtype, start, count) = check_input(ALL_REDUCE_OP, storage.dtype(), layout)?;
        let out = match dtype {
            DType::F32 => self.out_of_place::<f32>(storage, start, count)?,
            DType::F16 => self.out_of_place::<half::f16>(storage, start, count)?,
            DType::Bf16 => self.out_of_place::<half::bf16>(storage, start, count)?,
        };
        Ok((out, layout.shape().clone()))
    }
}

impl InplaceOp1 for AllReduce {
    fn name(&self) -> &'static str {
        ALL_REDUCE_OP
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        Err(on_cpu(ALL_REDUCE_OP))
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let (dtype, start, count) = check_input(ALL_REDUCE_OP, storage.dtype(), layout)?;
        match dtype {
            DType::F32 => self.in_place::<f32>(storage, start, count),
            DType::F16 => self.in_place::<half::f16>(storage, start, count),
            DType::Bf16 => self.in_place::<half::bf16>(storage, start, count),
        }
    }
}

/// The allreduce's element type for a candle dtype: f32, f16 and bf16 (the
/// sum is accumulated in f32); other dtypes are refused.
pub fn dtype_of(dtype: candle_core::DType) -> Option<DType> {
    match dtype {
        candle_core::DType::F32 => Some(DType::F32),
        candle_core::DType::F16 => Some(DType::F16),
        candle_core::DType::BF16 => Some(DType::Bf16),
        _ => None,
    }
}

/// The checks every op makes before touching the device: a supported dtype
/// and a contiguous layout. Returns the dtype, the start offset and the
/// element count.
fn check_input(
    op: &'static str,
    dtype: candle_core::DType,
    layout: &Layout,
) -> candle_core::Result<(DType, usize, usize)> {
    let Some(ours) = dtype_of(dtype) else {
        return Err(candle_core::Error::UnsupportedDTypeForOp(dtype, op).bt());
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(candle_core::Error::RequiresContiguous { op }.bt());
    };
    Ok((ours, start, end - start))
}

/// The error for a tensor on the CPU.
fn on_cpu(op: &'static str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "{op}: the tensor is on the CPU; the allreduce needs a CUDA tensor on the communicator's device"
    ))
    .bt()
}

/// A communicator error as a candle error (the source stays downcastable
/// to [`crate::Error`]).
fn to_candle(e: crate::Error) -> candle_core::Error {
    candle_core::Error::Cuda(Box::new(e)).bt()
}

/// The id as the 128-byte payload engines pass an NCCL unique id in
/// (`[c_char; 128]`, e.g. mistral.rs's worker environment): the id's text,
/// NUL-padded. Fails when the text is longer than 127 bytes: a Unix id whose
/// directory (`$XDG_RUNTIME_DIR`, else the temp dir) is longer than 52
/// bytes; use a shorter one or a TCP id ([`Id::new_tcp`], always short
/// enough).
pub fn encode_id(id: &Id) -> crate::Result<[c_char; ID_PAYLOAD_BYTES]> {
    let text = id.to_string();
    if text.len() >= ID_PAYLOAD_BYTES {
        return Err(crate::Error::invalid(format!(
            "the rendezvous id is {} bytes (not shown: it holds a secret), longer than the {}-byte payload \
             allows; create it under a shorter $XDG_RUNTIME_DIR or use a TCP id",
            text.len(),
            ID_PAYLOAD_BYTES - 1
        )));
    }
    let mut out = [0 as c_char; ID_PAYLOAD_BYTES];
    for (o, b) in out.iter_mut().zip(text.bytes()) {
        *o = b as c_char;
    }
    Ok(out)
}

/// The id back from [`encode_id`]'s payload.
pub fn decode_id(payload: &[c_char; ID_PAYLOAD_BYTES]) -> crate::Result<Id> {
    let bytes: Vec<u8> = payload.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    if bytes.len() == ID_PAYLOAD_BYTES {
        return Err(crate::Error::invalid("id payload is not NUL-terminated"));
    }
    let text = std::str::from_utf8(&bytes).map_err(|_| crate::Error::invalid("id payload is not ASCII"))?;
    text.parse()
}
