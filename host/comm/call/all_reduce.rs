//! The allreduce's entry points: typed (cudarc buffers) and raw (device
//! pointers, any stream of the context). Each describes its call and hands
//! it to the pipeline (`call/mod.rs`).

use cudarc::driver::{sys, DevicePtr, DevicePtrMut};
use tp_allreduce_kernels::ids::DType;

use super::validate::check_op;
use super::{Comm, Request};
use crate::comm::{Element, ReduceOp};
use crate::driver;
use crate::error::{Error, Result};

impl Comm {
    /// Allreduce (sum) of `send` into `recv` on the communicator's stream.
    ///
    /// NaNs: a sum with a NaN term is a NaN, but NaN payload bits are not
    /// preserved (an element whose bits are all ones travels as the type's
    /// quiet NaN: the all-ones pattern marks "not arrived" on the wire).
    /// Every rank gets the same bits.
    pub fn all_reduce<S: DevicePtr<T>, R: DevicePtrMut<T>, T: Element>(
        &self,
        send: &S,
        recv: &mut R,
        op: &ReduceOp,
    ) -> Result<()> {
        check_op(op)?;
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        if send.len() != recv.len() {
            return Err(Error::invalid(format!(
                "all_reduce: send has {} elements, recv has {}",
                send.len(),
                recv.len()
            )));
        }
        let count = send.len();
        let (src, _src_guard) = send.device_ptr(&self.stream);
        let (dst, _dst_guard) = recv.device_ptr_mut(&self.stream);
        // SAFETY: both pointers come from live cudarc buffers of `count`
        // elements, borrowed for the duration of the (stream-ordered) call.
        unsafe { self.all_reduce_raw(src, dst, count, T::DTYPE, self.stream.cu_stream()) }
    }

    /// In-place allreduce (sum) of `buf`.
    pub fn all_reduce_in_place<R: DevicePtrMut<T>, T: Element>(&self, buf: &mut R, op: &ReduceOp) -> Result<()> {
        check_op(op)?;
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        let count = buf.len();
        let (ptr, _guard) = buf.device_ptr_mut(&self.stream);
        // SAFETY: as in `all_reduce`.
        unsafe { self.all_reduce_raw(ptr, ptr, count, T::DTYPE, self.stream.cu_stream()) }
    }

    /// Allreduce (sum) of raw device pointers, for callers not on cudarc.
    ///
    /// # Safety
    /// `send` and `recv` must be device pointers of this communicator's
    /// context, valid for `count` elements of `dtype` until the work queued on
    /// `stream` completes (they may be equal for in-place). `stream` must be a
    /// live stream of the communicator's context. Every rank must issue the
    /// same sequence of calls (sizes and dtypes).
    ///
    /// # Streams
    /// A rank's calls must not run concurrently. Calls on one stream are
    /// ordered by it; an eager call on a different stream than the previous
    /// eager call waits for that stream; two calls captured into one graph
    /// on different streams are refused (`Error::InvalidUsage`). What the
    /// library cannot see is the caller's to order: replaying a captured
    /// graph while an eager call (or another replay of a graph with this
    /// communicator) runs on another stream.
    pub unsafe fn all_reduce_raw(
        &self,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.collective(Request::all_reduce("all_reduce", send, recv, count, dtype), stream) }
    }

    /// Allreduce (sum) of `count` elements of `send` from element
    /// `send_start` (`None`: in place) into `recv` from element
    /// `recv_start`, queued on `stream`: a stream of the communicator's
    /// context that need not be its own (an engine's stream, e.g. candle's).
    /// Both ranges are checked against the slices.
    pub fn all_reduce_slices_on<T: Element>(
        &self,
        send: Option<(&cudarc::driver::CudaSlice<T>, usize)>,
        recv: (&mut cudarc::driver::CudaSlice<T>, usize),
        count: usize,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<()> {
        let (dst, dst_start) = recv;
        let fits = |len: usize, start: usize| start.checked_add(count).is_some_and(|end| end <= len);
        if !fits(dst.len(), dst_start) || send.is_some_and(|(src, start)| !fits(src.len(), start)) {
            return Err(Error::invalid("all_reduce: the range reaches past the end of a buffer"));
        }
        let elem = T::DTYPE.size_bytes() as u64;
        // The guards record the use on `stream` and live until the call is
        // queued.
        let (recv_ptr, _dst_guard) = dst.device_ptr_mut(stream);
        let recv_ptr = recv_ptr + dst_start as u64 * elem;
        let (send_ptr, _src_guard) = match send {
            Some((src, start)) => {
                let (p, g) = src.device_ptr(stream);
                (p + start as u64 * elem, Some(g))
            }
            None => (recv_ptr, None),
        };
        // SAFETY: both ranges lie inside live buffers borrowed for the call
        // (checked above), `stream` is a live stream (its context is checked
        // by `all_reduce_raw`).
        unsafe { self.all_reduce_raw(send_ptr, recv_ptr, count, T::DTYPE, stream.cu_stream()) }
    }
}
