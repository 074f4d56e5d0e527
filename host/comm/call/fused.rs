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
//! The per-call path is the allreduce's (`call.rs`): validate, order after
//! the rank's previous call, choose (the fused selection table, whose
//! times include the epilogue), then run one of the paths of
//! `algorithm::fused` (fused OneShotPush / OneShotPull / TwoShotPush /
//! Hierarchical kernels, or the chosen allreduce followed by the separate
//! `add_rms_norm` kernel). Graph capture and buffer registration work
//! exactly as for `all_reduce`: the push kernels read only local memory
//! and library scratch, the pull kernel reads peers' inputs, registered or
//! staged like a plain pull call.
//! Part of the call room (`comm/call/`, where `unsafe` is allowed): the
//! raw-pointer forms and the launches.

use cudarc::driver::{sys, DevicePtr, DevicePtrMut};
use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::params::{
    FusedEpilogue, FusedIslandPushParams, FusedOneShotPushParams, EPILOGUE_NORM, EPILOGUE_SPREAD_PUSH,
    EPILOGUE_WEIGHT_OFFSET,
};

use super::choose;
use super::{Comm, Element};
pub use crate::algorithm::fused::FusedOptions;
use crate::algorithm::fused::{
    check_call, cluster_launch, default_threads, epilogue_threads, fused_path, island_blocks, normed_slot_bytes,
    push_launch, row_blocks, spread_push_blocks, ClusterLaunch, EpiloguePointers, EpilogueShape, FusedCapacities,
    FusedPath, PushRowSplit, EPILOGUE_MAX_BLOCKS,
};
use crate::algorithm::{Algorithm, Transport};
use crate::comm::registry::InputSource;
use crate::driver::{self, KernelArgs};
use crate::error::{Error, Result};
use crate::kernels::{
    add_rms_norm_entry, fused_island_push_entry, fused_one_shot_pull_entry, fused_one_shot_push_entry,
};
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

/// One validated fused call (device pointers of this rank).
#[derive(Clone, Copy, Debug)]
struct EpilogueCall {
    input: u64,
    residual: u64,
    /// 0 without RMSNorm.
    weight: u64,
    /// 0 without RMSNorm.
    normed: u64,
    shape: EpilogueShape,
    eps: f32,
    opts: FusedOptions,
}

impl EpilogueCall {
    fn flags(&self) -> u32 {
        let mut f = 0;
        if self.shape.norm {
            f |= EPILOGUE_NORM;
            if self.opts.weight_offset {
                f |= EPILOGUE_WEIGHT_OFFSET;
            }
        }
        f
    }

    /// Where the unfused path's allreduce puts the sum: `normed` (the
    /// separate kernel then overwrites it), or `input` in place without
    /// RMSNorm.
    fn sum_destination(&self) -> u64 {
        if self.shape.norm {
            self.normed
        } else {
            self.input
        }
    }

    /// Byte offset of row `row`.
    fn row_offset(&self, row: u64) -> u64 {
        row * (self.shape.hidden * self.shape.dtype.size_bytes()) as u64
    }

    /// The epilogue of the launch over rows `row0..row0 + rows`.
    fn epilogue(&self, row0: u64, rows: u64) -> FusedEpilogue {
        let off = self.row_offset(row0);
        let normed = if self.shape.norm { self.normed + off } else { 0 };
        FusedEpilogue {
            residual_in: self.residual + off,
            residual_out: self.residual + off,
            weight: self.weight,
            normed,
            rows: rows as u32,
            hidden: self.shape.hidden as u32,
            eps: self.eps,
            flags: self.flags(),
        }
    }

    /// `normed` written over `input` (the one overlap `check_call` allows).
    fn in_place(&self) -> bool {
        self.shape.norm && self.normed == self.input
    }

    /// Threads per block of the fused kernels for this call.
    fn threads(&self, row_packs: u64) -> u32 {
        self.opts.threads.unwrap_or_else(|| default_threads(row_packs))
    }
}

/// The grid of one fused OneShotPush launch (`Comm::push_grid`).
enum PushGrid {
    /// Each row over a thread-block cluster.
    Cluster(ClusterLaunch),
    /// A block per row (`blocks` at least the rows, or looping over
    /// them), of the `split` entry and `threads` threads; `spread`: the
    /// push spread over all `blocks` (`EPILOGUE_SPREAD_PUSH`).
    Rows { split: PushRowSplit, threads: u32, blocks: u32, spread: bool },
}

/// `(first row, rows)` of each launch over `rows` rows, `per_launch` each.
fn row_chunks(rows: usize, per_launch: u64) -> impl Iterator<Item = (u64, u64)> {
    let rows = rows as u64;
    let step = per_launch.clamp(1, u32::MAX as u64);
    (0..rows).step_by(step as usize).map(move |r| (r, step.min(rows - r)))
}

/// `(rows, hidden)` of typed buffers: `input.len() == rows * hidden`, every
/// other row-shaped buffer of the same length.
fn typed_shape(what: &str, input: usize, hidden: usize, others: &[(&str, usize)]) -> Result<(usize, usize)> {
    if hidden == 0 {
        return Err(Error::invalid(format!("{what}: hidden (the weight's length) must be at least 1")));
    }
    if input % hidden != 0 {
        return Err(Error::invalid(format!(
            "{what}: input has {input} elements, not a whole number of rows of {hidden}"
        )));
    }
    for (name, len) in others {
        if *len != input {
            return Err(Error::invalid(format!("{what}: {name} has {len} elements, input {input}")));
        }
    }
    Ok((input / hidden, hidden))
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
        unsafe { self.fused_call("all_reduce_add_rms_norm", &call, stream) }
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
        unsafe { self.fused_call("all_reduce_add", &call, stream) }
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
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        self.validate_epilogue("add_rms_norm", &call, stream)?;
        // SAFETY: validated pointers and stream (caller's contract).
        unsafe { self.launch_epilogue(&call, sum, stream) }
    }

    /// What a fused call of `rows x hidden` elements would do (16-byte
    /// aligned buffers, RMSNorm): the algorithm, fused or not, and why.
    pub fn plan_fused(&self, rows: usize, hidden: usize, dtype: DType, capturing: bool) -> FusedPlan {
        let shape = EpilogueShape { rows, hidden, dtype, norm: true };
        let transport = self.setup.transport;
        let (algorithm, reason) = match self.config.algorithm {
            Some(forced) => (forced, "forced by configuration".to_string()),
            None => {
                let c = self.fused_selection.lookup(shape.bytes(), dtype, capturing);
                (c.algorithm, c.reason.clone())
            }
        };
        match fused_path(algorithm, &shape, &self.fused_capacities(), self.config.fused_island_kernels) {
            FusedPath::Unfused(why) => FusedPlan {
                algorithm,
                transport,
                fused: false,
                reason: format!("{reason}; then the separate add_rms_norm kernel: {why}"),
            },
            FusedPath::Push { rows_per_launch } => {
                let rows = (rows as u64).min(rows_per_launch);
                let spread = match self.push_grid(shape.row_packs().unwrap_or(0), rows, None, false) {
                    PushGrid::Cluster(c) => format!(
                        "; each row over a thread-block cluster of {} blocks x {} threads",
                        c.blocks_per_cluster, c.threads
                    ),
                    PushGrid::Rows { spread: true, blocks, .. } => format!(
                        "; the push spread over {blocks} blocks, a block per row for the rest \
                         (outputs apart from the input)"
                    ),
                    PushGrid::Rows { spread: false, .. } => String::new(),
                };
                FusedPlan { algorithm, transport, fused: true, reason: format!("{reason}; epilogue fused{spread}") }
            }
            _ => FusedPlan { algorithm, transport, fused: true, reason: format!("{reason}; epilogue fused") },
        }
    }

    /// The cluster launch of a fused OneShotPush launch over `rows` rows of
    /// `row_packs` packs, if it takes one: every rank's GPU runs clusters
    /// (`Setup::fused_clusters`, the same choice on every rank) and the
    /// call does not fix the block size.
    fn push_cluster(&self, row_packs: u64, rows: u64, threads_override: Option<u32>) -> Option<ClusterLaunch> {
        if !self.setup.fused_clusters || threads_override.is_some() {
            return None;
        }
        cluster_launch(row_packs, rows, self.setup.geometry().pull_max_blocks)
    }

    /// The grid of a fused OneShotPush launch over `rows` rows of
    /// `row_packs` packs: rows over clusters, else a block per row, its
    /// push spread over more blocks (`Config::fused_spread_push`) unless
    /// `normed` is written over the input (`in_place`). The same kernel
    /// and reduction tree on every rank; only the spread may differ.
    fn push_grid(&self, row_packs: u64, rows: u64, threads_override: Option<u32>, in_place: bool) -> PushGrid {
        if let Some(c) = self.push_cluster(row_packs, rows, threads_override) {
            return PushGrid::Cluster(c);
        }
        let two_ranks = self.world == 2 && self.config.one_shot_push_tp2;
        let (split, threads) = push_launch(row_packs, two_ranks, threads_override);
        let cap = self.push_cap(split, threads);
        let spread_blocks =
            if self.config.fused_spread_push && !in_place { spread_push_blocks(rows, row_packs, cap) } else { None };
        match spread_blocks {
            Some(blocks) => {
                let split = if split == PushRowSplit::Wide { PushRowSplit::WideSpread } else { split };
                PushGrid::Rows { split, threads, blocks, spread: true }
            }
            None => PushGrid::Rows { split, threads, blocks: row_blocks(rows, cap), spread: false },
        }
    }

    /// Most resident blocks of a fused OneShotPush launch of `threads`
    /// threads (`split` entries).
    fn push_cap(&self, split: PushRowSplit, threads: u32) -> u32 {
        let geometry = self.setup.geometry();
        match split {
            // Blocks of up to 1024 threads: the resident bound of that size.
            PushRowSplit::Wide | PushRowSplit::WideSpread => {
                geometry.pull_max_blocks.min(geometry.sentinel_resident.cap(threads))
            }
            PushRowSplit::Short | PushRowSplit::Long | PushRowSplit::Cluster => geometry.pull_max_blocks,
        }
    }

    /// What bounds one launch of each fused kernel: the OneShotPush receive
    /// region, the pull staging, the island push regions (from the
    /// templates the kernels run with).
    fn fused_capacities(&self) -> FusedCapacities {
        let layout = &self.setup.layout;
        FusedCapacities {
            push_packs: layout.one_shot_push_max_packs,
            pull_packs: layout.max_packs,
            two_shot_push: self.sentinel.island_capacity(false).unwrap_or_default(),
            hierarchical: self.sentinel.island_capacity(true),
        }
    }

    /// Everything the driver can check of a validated-looking call: the
    /// pure checks, the buffers' extents in this context, the stream's
    /// context.
    /// Returns the stream's capture id (`driver::capture_id`).
    fn validate_epilogue(&self, what: &str, call: &EpilogueCall, stream: sys::CUstream) -> Result<Option<u64>> {
        let p =
            EpiloguePointers { input: call.input, residual: call.residual, weight: call.weight, normed: call.normed };
        // SAFETY: the caller guarantees `stream` is a live stream.
        let stream_ctx = unsafe { driver::stream_context(stream)? };
        if stream_ctx != self.ctx.cu_ctx() {
            return Err(Error::invalid(format!(
                "{what}: the stream belongs to another CUDA context than the communicator"
            )));
        }
        // SAFETY: as above.
        let capture = unsafe { driver::capture_id(stream)? };
        let capturing = capture.is_some();
        let dtype = call.shape.dtype;
        let extent = |name: &str, ptr: u64, bytes: u64| {
            let count = bytes as usize / dtype.size_bytes();
            self.validate_device_range(name, ptr, bytes as usize, count, dtype, capturing)
        };
        check_call(what, &p, &call.shape, call.eps, &call.opts, &extent).map_err(|m| {
            if m.starts_with(what) {
                Error::InvalidUsage(m)
            } else {
                Error::invalid(format!("{what}: {m}"))
            }
        })?;
        Ok(capture)
    }

    /// The per-call path of the fused calls (module docs).
    ///
    /// # Safety
    /// As `all_reduce_add_rms_norm_raw`.
    unsafe fn fused_call(&self, what: &str, call: &EpilogueCall, stream: sys::CUstream) -> Result<()> {
        self.check()?;
        if call.shape.rows == 0 {
            return Ok(());
        }
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        let capture = self.validate_epilogue(what, call, stream)?;
        if self.world == 1 {
            // The sum is the input: the epilogue alone.
            // SAFETY: validated pointers and stream.
            return unsafe { self.launch_epilogue(call, call.input, stream) };
        }
        let capturing = capture.is_some();
        let shape = &call.shape;
        let (algorithm, tuned_shape) = if call.opts.unfused {
            choose(self, shape.bytes(), shape.dtype, capturing)
        } else {
            match self.config.algorithm {
                Some(forced) => (forced, None),
                None => {
                    let c = self.fused_selection.lookup(shape.bytes(), shape.dtype, capturing);
                    (c.algorithm, c.shape)
                }
            }
        };
        let path = if call.opts.unfused {
            FusedPath::Unfused("asked for (FusedOptions::unfused)".into())
        } else {
            fused_path(algorithm, shape, &self.fused_capacities(), self.config.fused_island_kernels)
        };
        // SAFETY: validated pointers and stream; `ordered` orders the call.
        unsafe {
            self.ordered(stream, capture, || match path {
                FusedPath::Push { rows_per_launch } => self.run_fused_push(call, rows_per_launch, stream),
                FusedPath::Pull { rows_per_launch } => self.run_fused_pull(call, rows_per_launch, stream, capturing),
                FusedPath::Island { rows_per_launch } => {
                    self.run_fused_island(algorithm, call, rows_per_launch, stream)
                }
                FusedPath::Unfused(_) => {
                    let sum = call.sum_destination();
                    let count = shape.count();
                    self.dispatch(algorithm, tuned_shape, call.input, sum, count, shape.dtype, stream, capturing)
                        .and_then(|()| self.launch_epilogue(call, sum, stream))
                }
            })
        }
        .inspect_err(|e| {
            if e.breaks_communicator() {
                self.mark_broken(e.to_string());
            }
        })
    }

    /// Fused OneShotPush: launches of `rows_per_launch` whole rows (any
    /// pointer alignment: the kernel goes element by element through a
    /// misaligned view).
    ///
    /// # Safety
    /// As `fused_call`, after validation and ordering.
    unsafe fn run_fused_push(&self, call: &EpilogueCall, rows_per_launch: u64, stream: sys::CUstream) -> Result<()> {
        self.prepare(Algorithm::OneShotPush, call.shape.dtype)?;
        let hidden = call.shape.hidden as u64;
        let row_packs = call.shape.row_packs().unwrap_or(0);
        let two_ranks = self.world == 2 && self.config.one_shot_push_tp2;
        for (row0, rows) in row_chunks(call.shape.rows, rows_per_launch) {
            let push = self.sentinel.one_shot_push(call.input + call.row_offset(row0), 0, rows * hidden);
            let mut p = FusedOneShotPushParams { push, epilogue: call.epilogue(row0, rows), ..Default::default() };
            match self.push_grid(row_packs, rows, call.opts.threads, call.in_place()) {
                PushGrid::Cluster(c) => {
                    p.cluster_blocks = c.blocks_per_cluster;
                    p.cluster_slice_packs = c.slice_packs(row_packs);
                    let entry = fused_one_shot_push_entry(call.shape.dtype, two_ranks, PushRowSplit::Cluster);
                    let f = self.module.function(&entry)?;
                    // SAFETY: as below; the entry is a cluster entry (loaded
                    // only where the device runs clusters: `fused_clusters`),
                    // the grid is one cluster of `blocks_per_cluster <= 8`
                    // blocks per row, at most `pull_max_blocks` blocks of at
                    // most 512 threads, and a thread per pack of its block's
                    // slice of a row (the parameters state the same shape:
                    // the kernel traps on a disagreement).
                    unsafe {
                        driver::launch_struct_clustered(f, c.blocks(rows), c.threads, c.blocks_per_cluster, stream, &p)?
                    };
                }
                PushGrid::Rows { split, threads, blocks, spread } => {
                    if spread {
                        p.epilogue.flags |= EPILOGUE_SPREAD_PUSH;
                    }
                    let f = self.module.function(&fused_one_shot_push_entry(call.shape.dtype, two_ranks, split))?;
                    // SAFETY: the entry takes one FusedOneShotPushParams by
                    // value (sizes pinned on both sides and checked against
                    // the PTX); the template's addresses are this
                    // communicator's mapped regions; the pointers are
                    // validated for every row; `rows` rows fit the receive
                    // region (fused_path); at most `push_cap` blocks stay
                    // resident with the other ranks of the GPU (the fused
                    // entries are among those it is computed from);
                    // `threads` covers a row (check_threads); with the
                    // spread push `normed` is not written over `input`
                    // (push_grid), and no other output overlaps it
                    // (check_call).
                    unsafe { driver::launch_struct(f, blocks, threads, stream, &p)? };
                }
            }
        }
        Ok(())
    }

    /// Fused TwoShotPush or Hierarchical (`algorithm`): launches of
    /// `rows_per_launch` whole rows, cut into shares of whole rows
    /// (`algorithm::fused::share_rows`), a grid over this rank's owned rows.
    /// Hierarchical keeps the island partials of its owned rows in
    /// `normed` (or `input` without RMSNorm) between its phases B and C.
    ///
    /// # Safety
    /// As `fused_call`, after validation and ordering.
    unsafe fn run_fused_island(
        &self,
        algorithm: Algorithm,
        call: &EpilogueCall,
        rows_per_launch: u64,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.prepare(algorithm, call.shape.dtype)?;
        let hierarchical = algorithm == Algorithm::Hierarchical;
        let kernel = if hierarchical { AlgorithmId::Hierarchical } else { AlgorithmId::TwoShotPush };
        let f = self.module.function(&fused_island_push_entry(kernel, call.shape.dtype))?;
        let hidden = call.shape.hidden as u64;
        let threads = call.threads(call.shape.row_packs().unwrap_or(0));
        let cap = self.setup.geometry().pull_max_blocks;
        for (row0, rows) in row_chunks(call.shape.rows, rows_per_launch) {
            let input = call.input + call.row_offset(row0);
            let epilogue = call.epilogue(row0, rows);
            let partials = if call.shape.norm { epilogue.normed } else { input };
            let push = self
                .sentinel
                .island_push(hierarchical, input, partials, rows * hidden)
                .ok_or_else(|| Error::invalid(format!("{algorithm}: this communicator has no islands")))?;
            let blocks = island_blocks(rows, push.shares as u64, push.owned as u64, cap);
            let p = FusedIslandPushParams {
                push,
                epilogue,
                normed_slot_bytes: normed_slot_bytes(push.share_cap),
                _pad0: 0,
            };
            // SAFETY: the entry takes one FusedIslandPushParams by value
            // (sizes pinned on both sides and checked against the PTX); the
            // template's addresses are this communicator's mapped regions;
            // the pointers are validated for every row; a share of `rows`
            // rows fits half a receive position range (fused_path), which
            // `normed_slot_bytes` splits; at most `pull_max_blocks` blocks
            // of at most 512 threads stay resident with the other ranks of
            // the GPU (the fused entries are among those it is computed
            // from); `threads` covers a row (check_threads) and is the same
            // on every rank (the reduction tree).
            unsafe { driver::launch_struct(f, blocks, threads, stream, &p)? };
        }
        Ok(())
    }

    /// Fused OneShotPull: the input registered or staged like a plain pull
    /// call's (staged when `normed` is written over it: peers read it until
    /// the end barrier), launches of `rows_per_launch` whole rows.
    ///
    /// # Safety
    /// As `fused_call`, after validation and ordering.
    unsafe fn run_fused_pull(
        &self,
        call: &EpilogueCall,
        rows_per_launch: u64,
        stream: sys::CUstream,
        capturing: bool,
    ) -> Result<()> {
        self.prepare(Algorithm::OneShotPull, call.shape.dtype)?;
        let f = self.module.function(&fused_one_shot_pull_entry(call.shape.dtype))?;
        let must_stage = call.in_place();
        let source = self.input_source(call.input, call.shape.bytes(), capturing, must_stage)?;
        let row_packs = call.shape.row_packs().unwrap_or(0);
        let threads = call.threads(row_packs);
        let cap = self.setup.geometry().pull_max_blocks;
        for (row0, rows) in row_chunks(call.shape.rows, rows_per_launch) {
            let off = call.row_offset(row0);
            let (entry, peer_offset) = match source {
                InputSource::Staging => {
                    let bytes = (rows as usize) * call.shape.hidden * call.shape.dtype.size_bytes();
                    // SAFETY: `stream` is live; the staging buffer holds a
                    // whole launch (rows_per_launch from its capacity).
                    unsafe { driver::memcpy_dtod_async(self.setup.staging_ptr(), call.input + off, bytes, stream)? };
                    (self.setup.table_entry(0), 0)
                }
                InputSource::Table(index) => (self.setup.table_entry(index), off),
            };
            let e = call.epilogue(row0, rows);
            let args = KernelArgs::new()
                .u64(self.setup.handle.ptr())
                .u64(entry)
                .u64(peer_offset)
                .u64(e.residual_in)
                .u64(e.residual_out)
                .u64(e.weight)
                .u64(e.normed)
                .u32(e.rows)
                .u32(e.hidden)
                .f32(e.eps)
                .u32(e.flags);
            // SAFETY: the entry takes (handle, peer_inputs, peer_offset,
            // residual_in, residual_out, weight, normed, rows, hidden, eps,
            // flags); the table entry's addresses are filled (or zero, which
            // the kernel refuses); the grid is the same on every rank.
            unsafe { driver::launch(f, row_blocks(rows, cap), threads, stream, &args)? };
        }
        Ok(())
    }

    /// The separate epilogue kernel over the whole call, reading the sum
    /// at `sum`.
    ///
    /// # Safety
    /// Validated pointers and a live stream of the context.
    unsafe fn launch_epilogue(&self, call: &EpilogueCall, sum: u64, stream: sys::CUstream) -> Result<()> {
        let shape = &call.shape;
        let f = self.module.function(&add_rms_norm_entry(shape.dtype))?;
        let blocks = (shape.rows as u64).clamp(1, EPILOGUE_MAX_BLOCKS as u64) as u32;
        let args = KernelArgs::new()
            .u64(sum)
            .u64(call.residual)
            .u64(call.residual)
            .u64(call.weight)
            .u64(if shape.norm { call.normed } else { 0 })
            .u32(shape.rows as u32)
            .u32(shape.hidden as u32)
            .f32(call.eps)
            .u32(call.flags());
        // SAFETY: add_rms_norm takes (sum, residual_in, residual_out,
        // weight, normed, rows, hidden, eps, flags); every pointer covers
        // the call (validated); any grid and a block of whole warps up to
        // 512 threads.
        unsafe { driver::launch(f, blocks, epilogue_threads(shape.hidden, shape.dtype), stream, &args) }
    }
}
