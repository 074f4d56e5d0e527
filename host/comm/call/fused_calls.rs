//! The fused calls: allreduce + residual add (+ RMSNorm), the epilogue of a
//! tensor-parallel transformer layer's row-parallel projection.
//!
//! ```text
//!   all_reduce_add_rms_norm(input, residual, weight, eps, normed), rows x hidden:
//!     residual <- sum over ranks of input + residual            (one rounding)
//!     normed   <- residual * rsqrt(mean(residual^2) + eps) * w  (w = weight, or 1 + weight)
//!   all_reduce_add(input, residual): the first line only.
//! ```
//!
//! The fused epilogue is an option of the allreduce on the one call
//! pipeline (`call/mod.rs`): validate, order after the rank's previous
//! call, choose (the fused selection table, whose times include the
//! epilogue), then run the algorithm's fused kernels
//! (`RankAlgorithm::run_fused`: OneShotPush, OneShotPull, and TwoShotPush /
//! Hierarchical when switched on) or the chosen allreduce followed by the
//! separate `add_rms_norm` kernel (`algorithm/epilogue.rs`). Graph capture
//! and buffer registration work exactly as for `all_reduce`: the push
//! kernels read only local memory and library scratch, the pull kernel
//! reads peers' inputs, registered or staged like a plain pull call.
//! Here: the entry points (typed and raw) and `plan_fused`.

use cudarc::driver::{sys, DevicePtr, DevicePtrMut};

use super::validate::typed_shape;
use super::{Comm, Request};
use crate::algorithm::epilogue::{EpilogueCall, EpilogueShape, FusedOptions, FusedPath};
use crate::algorithm::{Algorithm, Transport};
use crate::comm::Element;
use crate::driver;
use crate::error::Result;
use crate::DType;

/// What a fused call will do: the allreduce algorithm, whether its kernel
/// runs the epilogue (else the separate `add_rms_norm` kernel follows it),
/// and why.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedPlan {
    pub algorithm: Algorithm,
    pub transport: Transport,
    pub fused: bool,
    pub reason: String,
}

impl Comm {
    /// Allreduce (sum) of `input` (`rows x hidden`, `hidden = weight.len()`)
    /// plus `residual`, then RMSNorm: `residual` becomes the sum plus the
    /// residual, `normed` its RMSNorm scaled by `weight` (or `1 + weight`,
    /// [`FusedOptions::weight_offset`]). f32 accumulation, one rounding per
    /// output. `residual` and `weight` must hold the same values on every
    /// rank (as in tensor parallelism); the outputs are then bitwise equal
    /// on every rank. With the fused two-shot push and hierarchical kernels
    /// the owner of each row adds *its* residual and weight and the other
    /// ranks copy the result, so ranks that pass different residuals all
    /// get the owner's (the one-shot kernels add each rank's own). `input`
    /// is left unchanged unless `normed` is written over it. Collective,
    /// like `all_reduce`; capturable in CUDA graphs (see `all_reduce_raw`).
    pub fn all_reduce_add_rms_norm<I, R, W, N, T>(
        &self,
        input: &I,
        residual: &mut R,
        weight: &W,
        eps: f32,
        normed: &mut N,
        opts: &FusedOptions,
    ) -> Result<()>
    where
        I: DevicePtr<T>,
        R: DevicePtrMut<T>,
        W: DevicePtr<T>,
        N: DevicePtrMut<T>,
        T: Element,
    {
        let what = "all_reduce_add_rms_norm";
        let others = [("residual", residual.len()), ("normed", normed.len())];
        let (rows, hidden) = typed_shape(what, input.len(), weight.len(), &others)?;
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        let (i, _gi) = input.device_ptr(&self.stream);
        let (r, _gr) = residual.device_ptr_mut(&self.stream);
        let (w, _gw) = weight.device_ptr(&self.stream);
        let (n, _gn) = normed.device_ptr_mut(&self.stream);
        let stream = self.stream.cu_stream();
        // SAFETY: pointers of live cudarc buffers of the checked lengths,
        // borrowed for the (stream-ordered) call.
        unsafe { self.all_reduce_add_rms_norm_raw(i, r, w, n, rows, hidden, eps, T::DTYPE, opts, stream) }
    }

    /// [`all_reduce_add_rms_norm`](Self::all_reduce_add_rms_norm) with
    /// `normed` written over `input`.
    pub fn all_reduce_add_rms_norm_in_place<B, R, W, T>(
        &self,
        input: &mut B,
        residual: &mut R,
        weight: &W,
        eps: f32,
        opts: &FusedOptions,
    ) -> Result<()>
    where
        B: DevicePtrMut<T>,
        R: DevicePtrMut<T>,
        W: DevicePtr<T>,
        T: Element,
    {
        let what = "all_reduce_add_rms_norm_in_place";
        let (rows, hidden) = typed_shape(what, input.len(), weight.len(), &[("residual", residual.len())])?;
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        let (i, _gi) = input.device_ptr_mut(&self.stream);
        let (r, _gr) = residual.device_ptr_mut(&self.stream);
        let (w, _gw) = weight.device_ptr(&self.stream);
        let stream = self.stream.cu_stream();
        // SAFETY: as in `all_reduce_add_rms_norm`; normed == input is allowed.
        unsafe { self.all_reduce_add_rms_norm_raw(i, r, w, i, rows, hidden, eps, T::DTYPE, opts, stream) }
    }

    /// Allreduce (sum) of `input` (`rows x hidden`) added to `residual`
    /// (no normalisation). `hidden` shapes the work (a block owns whole
    /// rows) and must divide `input.len()`. `residual` must hold the same
    /// values on every rank (with the fused two-shot push and hierarchical
    /// kernels the owner of each row adds its residual for every rank; see
    /// [`all_reduce_add_rms_norm`](Self::all_reduce_add_rms_norm)). `input`
    /// is consumed: the unfused path reduces it in place, the fused
    /// hierarchical kernel keeps island partial sums in it, the others
    /// leave it unchanged.
    pub fn all_reduce_add<B, R, T>(
        &self,
        input: &mut B,
        residual: &mut R,
        hidden: usize,
        opts: &FusedOptions,
    ) -> Result<()>
    where
        B: DevicePtrMut<T>,
        R: DevicePtrMut<T>,
        T: Element,
    {
        let (rows, hidden) = typed_shape("all_reduce_add", input.len(), hidden, &[("residual", residual.len())])?;
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        let (i, _gi) = input.device_ptr_mut(&self.stream);
        let (r, _gr) = residual.device_ptr_mut(&self.stream);
        let stream = self.stream.cu_stream();
        // SAFETY: as in `all_reduce_add_rms_norm`.
        unsafe { self.all_reduce_add_raw(i, r, rows, hidden, T::DTYPE, opts, stream) }
    }

    /// The separate epilogue kernel alone, on the communicator's stream (not
    /// collective): `residual += sum`, `normed = RMSNorm(residual) * w`,
    /// exactly as the unfused path runs it after an allreduce (ours or
    /// NCCL's). `hidden = weight.len()`.
    pub fn add_rms_norm<S, R, W, N, T>(
        &self,
        sum: &S,
        residual: &mut R,
        weight: &W,
        eps: f32,
        normed: &mut N,
        opts: &FusedOptions,
    ) -> Result<()>
    where
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
        W: DevicePtr<T>,
        N: DevicePtrMut<T>,
        T: Element,
    {
        let others = [("residual", residual.len()), ("normed", normed.len())];
        let (rows, hidden) = typed_shape("add_rms_norm", sum.len(), weight.len(), &others)?;
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        let (s, _gs) = sum.device_ptr(&self.stream);
        let (r, _gr) = residual.device_ptr_mut(&self.stream);
        let (w, _gw) = weight.device_ptr(&self.stream);
        let (n, _gn) = normed.device_ptr_mut(&self.stream);
        let stream = self.stream.cu_stream();
        // SAFETY: as in `all_reduce_add_rms_norm`.
        unsafe { self.add_rms_norm_raw(s, r, w, n, rows, hidden, eps, T::DTYPE, opts, stream) }
    }

    /// Raw-pointer form of [`all_reduce_add_rms_norm`](Self::all_reduce_add_rms_norm),
    /// for callers not on cudarc. `normed` may equal `input` (in place) or
    /// must not overlap it; `residual` and `weight` overlap nothing else.
    ///
    /// # Safety
    /// Device pointers of this communicator's context: `input`, `residual`
    /// and `normed` valid for `rows * hidden` elements of `dtype`, `weight`
    /// for `hidden`, until the work queued on `stream` completes. `stream`:
    /// a live stream of the context. Every rank issues the same calls
    /// (rows, hidden, dtype, options), like any collective. Streams as for
    /// `Comm::all_reduce_raw`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_reduce_add_rms_norm_raw(
        &self,
        input: sys::CUdeviceptr,
        residual: sys::CUdeviceptr,
        weight: sys::CUdeviceptr,
        normed: sys::CUdeviceptr,
        rows: usize,
        hidden: usize,
        eps: f32,
        dtype: DType,
        opts: &FusedOptions,
        stream: sys::CUstream,
    ) -> Result<()> {
        let shape = EpilogueShape { rows, hidden, dtype, norm: true };
        let call = EpilogueCall { input, residual, weight, normed, shape, eps, opts: *opts };
        // SAFETY: the caller's contract; validated before any device work.
        unsafe { self.collective(Request::fused("all_reduce_add_rms_norm", call), stream) }
    }

    /// Raw-pointer form of [`all_reduce_add`](Self::all_reduce_add).
    ///
    /// # Safety
    /// As [`all_reduce_add_rms_norm_raw`](Self::all_reduce_add_rms_norm_raw)
    /// (`input` may be overwritten with the sum).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_reduce_add_raw(
        &self,
        input: sys::CUdeviceptr,
        residual: sys::CUdeviceptr,
        rows: usize,
        hidden: usize,
        dtype: DType,
        opts: &FusedOptions,
        stream: sys::CUstream,
    ) -> Result<()> {
        let shape = EpilogueShape { rows, hidden, dtype, norm: false };
        let call = EpilogueCall { input, residual, weight: 0, normed: 0, shape, eps: 0.0, opts: *opts };
        // SAFETY: the caller's contract; validated before any device work.
        unsafe { self.collective(Request::fused("all_reduce_add", call), stream) }
    }

    /// The separate epilogue kernel alone (not collective): `residual +=
    /// sum`, `normed = RMSNorm(residual) * weight` on `stream`, exactly as
    /// the unfused path runs it after an allreduce (ours or NCCL's). Any
    /// alignment; `normed` may equal `sum`.
    ///
    /// # Safety
    /// As [`all_reduce_add_rms_norm_raw`](Self::all_reduce_add_rms_norm_raw),
    /// with `sum` in place of `input`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn add_rms_norm_raw(
        &self,
        sum: sys::CUdeviceptr,
        residual: sys::CUdeviceptr,
        weight: sys::CUdeviceptr,
        normed: sys::CUdeviceptr,
        rows: usize,
        hidden: usize,
        eps: f32,
        dtype: DType,
        opts: &FusedOptions,
        stream: sys::CUstream,
    ) -> Result<()> {
        let shape = EpilogueShape { rows, hidden, dtype, norm: true };
        let call = EpilogueCall { input: sum, residual, weight, normed, shape, eps, opts: *opts };
        if rows == 0 {
            return self.check();
        }
        let request = Request::fused("add_rms_norm", call);
        let buffers = self.check_request(&request)?;
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        // SAFETY: the caller's contract.
        unsafe { self.validate(&request, buffers, stream)? };
        // SAFETY: validated pointers and stream (caller's contract).
        unsafe { self.launch_epilogue(&call, sum, stream) }
    }

    /// What a fused call of `rows x hidden` elements would do (16-byte
    /// aligned buffers, RMSNorm): the algorithm, fused or not, and why.
    pub fn plan_fused(&self, rows: usize, hidden: usize, dtype: DType, capturing: bool) -> FusedPlan {
        let shape = EpilogueShape { rows, hidden, dtype, norm: true };
        let transport = self.setup.transport;
        let (algorithm, reason) = match self.forced_for(tp_allreduce_kernels::ids::Collective::AllReduce) {
            Some(forced) => (forced, "forced by configuration".to_string()),
            None => {
                let c = self.fused_selection.lookup(shape.bytes(), dtype, capturing);
                (c.algorithm, c.reason.clone())
            }
        };
        match self.fused_path(algorithm, &shape) {
            FusedPath::Unfused(why) => FusedPlan {
                algorithm,
                transport,
                fused: false,
                reason: format!("{reason}; then the separate add_rms_norm kernel: {why}"),
            },
            FusedPath::Fused { rows_per_launch } => {
                let rows = (rows as u64).min(rows_per_launch);
                let launch = self.algorithms.get(algorithm).map(|side| side.describe_fused(&shape, rows));
                let launch = launch.unwrap_or_default();
                FusedPlan { algorithm, transport, fused: true, reason: format!("{reason}; epilogue fused{launch}") }
            }
        }
    }
}
