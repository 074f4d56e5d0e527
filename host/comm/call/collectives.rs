//! The entry points of the collectives beside the allreduce, on the same
//! pipeline (validate -> order -> choose -> run):
//!
//! ```text
//!   all_gather(send, recv):     recv = [send of rank 0][send of rank 1]...   (n each)
//!   reduce_scatter(send, recv): recv = sum over ranks of block `rank` of send (n of world x n)
//! ```
//!
//! Ours: `algorithm/all_gather_push.rs`, `reduce_scatter_push.rs` (one hop,
//! payload completion, in one-shot push's receive region); NCCL's where
//! they cannot run (the per-pair transport, one-shot push's region
//! disabled). Graph-capturable; nothing needs registering (the kernels read
//! only local memory).

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use tp_allreduce_kernels::ids::{Collective, DType};

use super::{Choice, Comm, Request};
use crate::algorithm::Algorithm;
use crate::comm::{Element, ReduceOp};

use crate::driver;
use crate::error::{Error, Result};

/// What an all-gather or reduce-scatter will run here, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectivePlan {
    /// Ours (`Algorithm::AllGatherPush`, `Algorithm::ReduceScatterPush`) or
    /// `Algorithm::Nccl`.
    pub algorithm: Algorithm,
    pub reason: String,
}

impl Comm {
    /// All-gather of `send` (n elements on every rank) into `recv` (world x
    /// n: rank r's `send` at `[r n, (r + 1) n)`) on the communicator's
    /// stream.
    ///
    /// A copy, bit for bit, whatever the bits: NaNs with any payload,
    /// all-ones words and integers or packed data viewed as `f32`/`f16`/
    /// `bf16` arrive unchanged (the dtype only sets the element size).
    pub fn all_gather<S: DevicePtr<T>, R: DevicePtrMut<T>, T: Element>(&self, send: &S, recv: &mut R) -> Result<()> {
        let n = send.len();
        if recv.len() != n.saturating_mul(self.world) {
            return Err(Error::invalid(format!(
                "all_gather: recv has {} elements, world size x send = {} x {n} needed",
                recv.len(),
                self.world
            )));
        }
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        let (src, _src_guard) = send.device_ptr(&self.stream);
        let (dst, _dst_guard) = recv.device_ptr_mut(&self.stream);
        // SAFETY: both pointers come from live cudarc buffers of the checked
        // lengths, borrowed for the duration of the (stream-ordered) call.
        unsafe { self.all_gather_raw(src, dst, n, T::DTYPE, self.stream.cu_stream()) }
    }

    /// Reduce-scatter (sum) of `send` (world x n elements) into `recv` (n:
    /// the sum over ranks of block `rank` of `send`) on the communicator's
    /// stream.
    ///
    /// NaNs: a sum with a NaN term is a NaN, but its payload bits are not
    /// preserved (as for [`Comm::all_reduce`]): move packed data with
    /// [`Comm::all_gather`], which copies every bit.
    pub fn reduce_scatter<S: DevicePtr<T>, R: DevicePtrMut<T>, T: Element>(
        &self,
        send: &S,
        recv: &mut R,
        op: &ReduceOp,
    ) -> Result<()> {
        super::validate::check_op(op)?;
        let n = recv.len();
        if send.len() != n.saturating_mul(self.world) {
            return Err(Error::invalid(format!(
                "reduce_scatter: send has {} elements, world size x recv = {} x {n} needed",
                send.len(),
                self.world
            )));
        }
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        let (src, _src_guard) = send.device_ptr(&self.stream);
        let (dst, _dst_guard) = recv.device_ptr_mut(&self.stream);
        // SAFETY: as in `all_gather`.
        unsafe { self.reduce_scatter_raw(src, dst, n, T::DTYPE, self.stream.cu_stream()) }
    }

    /// All-gather of raw device pointers: rank r's `count` elements at
    /// `send` land at element `r * count` of every rank's `recv` (`world *
    /// count` elements); in place when `send` is this rank's block of
    /// `recv`.
    ///
    /// # Safety
    /// As `Comm::all_reduce_raw`, with `recv` valid for `world * count`
    /// elements.
    pub unsafe fn all_gather_raw(
        &self,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()> {
        let request = Request { what: "all_gather", collective: Collective::AllGather, send, recv, count, dtype, epilogue: None };
        // SAFETY: the caller's contract.
        unsafe { self.collective(request, stream) }
    }

    /// Reduce-scatter (sum) of raw device pointers: share r (`count`
    /// elements from element `r * count`) of the sum of every rank's `send`
    /// (`world * count` elements) lands in rank r's `recv`; in place when
    /// `recv` is this rank's share of `send`.
    ///
    /// # Safety
    /// As `Comm::all_reduce_raw`, with `send` valid for `world * count`
    /// elements.
    pub unsafe fn reduce_scatter_raw(
        &self,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()> {
        let request =
            Request { what: "reduce_scatter", collective: Collective::ReduceScatter, send, recv, count, dtype, epilogue: None };
        // SAFETY: the caller's contract.
        unsafe { self.collective(request, stream) }
    }

    /// All-gather or reduce-scatter of `count` elements a rank between
    /// slices (each from its start element) on `stream`, a stream of the
    /// communicator's context that need not be its own (an engine's, e.g.
    /// candle's). Both ranges are checked against the slices: the small
    /// side holds `count`, the large side `world x count` elements.
    pub fn gather_scatter_slices_on<T: Element>(
        &self,
        collective: Collective,
        send: (&CudaSlice<T>, usize),
        recv: (&mut CudaSlice<T>, usize),
        count: usize,
        stream: &std::sync::Arc<CudaStream>,
    ) -> Result<()> {
        let whole = count.saturating_mul(self.world);
        let (send_len, recv_len) = match collective {
            Collective::AllGather => (count, whole),
            Collective::ReduceScatter => (whole, count),
            Collective::AllReduce => {
                return Err(Error::invalid("gather_scatter_slices_on: all-gather or reduce-scatter only"))
            }
        };
        let fits = |len: usize, start: usize, n: usize| start.checked_add(n).is_some_and(|end| end <= len);
        let ((src, src_start), (dst, dst_start)) = (send, recv);
        if !fits(src.len(), src_start, send_len) || !fits(dst.len(), dst_start, recv_len) {
            return Err(Error::invalid(format!("{}: the range reaches past the end of a buffer", collective.name())));
        }
        let elem = T::DTYPE.size_bytes() as u64;
        let (send_ptr, _src_guard) = src.device_ptr(stream);
        let (recv_ptr, _dst_guard) = dst.device_ptr_mut(stream);
        let (send_ptr, recv_ptr) = (send_ptr + src_start as u64 * elem, recv_ptr + dst_start as u64 * elem);
        // SAFETY: both ranges lie inside live buffers borrowed for the call
        // (checked above); `stream` is a live stream (its context is checked
        // by the pipeline).
        unsafe {
            match collective {
                Collective::AllGather => self.all_gather_raw(send_ptr, recv_ptr, count, T::DTYPE, stream.cu_stream()),
                _ => self.reduce_scatter_raw(send_ptr, recv_ptr, count, T::DTYPE, stream.cu_stream()),
            }
        }
    }

    /// What an all-gather or reduce-scatter of `block_bytes` per rank (the
    /// all-gather's send, the reduce-scatter's receive) runs on this
    /// communicator in graph replay (`capturing`) or eagerly, and why.
    pub fn plan_collective(&self, collective: Collective, block_bytes: usize, capturing: bool) -> CollectivePlan {
        let name = collective.name();
        let entry = self.collective_table.lookup(collective, block_bytes, capturing);
        let figures = entry
            .map(|c| format!(" (model: ours {:.1} us, NCCL's {:.1} us)", c.ours_us, c.nccl_us))
            .unwrap_or_default();
        match self.choose_other(collective, block_bytes, capturing) {
            Ok(Choice { algorithm: Algorithm::Nccl, .. }) => {
                let why = match self.other_algorithm(collective) {
                    Ok(Algorithm::Nccl) if self.config.algorithm == Some(Algorithm::Nccl) => "forced".to_string(),
                    Ok(Algorithm::Nccl) => "none of ours runs here".to_string(),
                    _ => format!("NCCL's ring predicted faster{figures}"),
                };
                CollectivePlan { algorithm: Algorithm::Nccl, reason: format!("{name}: NCCL's ({why})") }
            }
            Ok(c) => CollectivePlan {
                algorithm: c.algorithm,
                reason: format!("{name}: {}, one hop with payload completion{figures}", c.algorithm),
            },
            Err(why) => CollectivePlan { algorithm: Algorithm::Nccl, reason: format!("unavailable: {why}") },
        }
    }
}
