//! The call pipeline, the one path of every collective call:
//!
//! ```text
//!   entry point (all_reduce*, all_reduce_add*, ...: a Request)
//!     -> validate   pointers, sizes, overlaps (pure), the stream's context and
//!                   capture, each buffer's extent (driver)        validate.rs
//!     -> order      after the rank's previous call, whatever its stream   order.rs
//!     -> choose     the forced algorithm, else the selection table's entry
//!                   for this size (the fused table with the epilogue)
//!     -> run        NCCL, or the algorithm's side of the rank: its launches,
//!                   issued here; with the epilogue, its fused kernels or the
//!                   separate add_rms_norm kernel after the allreduce
//! ```
//!
//! The collective is a kind of call (allreduce; all-gather and
//! reduce-scatter, `collectives.rs`, public once an algorithm implements
//! them), the fused epilogue an option of the allreduce. The algorithms describe their launches
//! (`algorithm::launch::Launch`); this room issues them: `unsafe` is
//! allowed here (the raw entry points, the launches, the error record).

#![allow(unsafe_code)]

mod all_reduce;
mod collectives;
mod device_order;
mod fused_calls;
mod order;
mod validate;

pub use collectives::CollectivePlan;
pub use fused_calls::FusedPlan;
pub(crate) use device_order::DeviceTurn;
pub(crate) use order::CallOrder;

use cudarc::driver::sys;
use tp_allreduce_kernels::ids::{Collective, DType};
use tp_allreduce_kernels::layout::ErrorRecord;

use super::registry::InputSource;
use super::{CallPlan, Comm};
use crate::algorithm::epilogue::{no_fused_kernel, EpilogueCall, FusedPath};
use crate::algorithm::launch::{Call, Launch, PeerInput};
use crate::algorithm::{self, Algorithm};
use crate::driver;
use crate::error::{DeviceFailure, Error, Result};
use validate::{bad_overlap, buffer_shape, check_call, check_pointers, BufferShape, EpiloguePointers};

/// One collective call as its entry point describes it (device pointers of
/// this rank).
#[derive(Clone, Copy, Debug)]
struct Request {
    /// The entry point, for error messages.
    what: &'static str,
    collective: Collective,
    send: u64,
    recv: u64,
    /// Elements each rank contributes (the allreduce's message).
    count: usize,
    dtype: DType,
    /// The fused epilogue (allreduce only): `send` is its input, `recv`
    /// where the unfused path's allreduce puts the sum.
    epilogue: Option<EpilogueCall>,
}

impl Request {
    fn all_reduce(what: &'static str, send: u64, recv: u64, count: usize, dtype: DType) -> Request {
        Request { what, collective: Collective::AllReduce, send, recv, count, dtype, epilogue: None }
    }

    fn fused(what: &'static str, e: EpilogueCall) -> Request {
        // Saturating: the validation refuses sizes that overflow.
        let (count, dtype) = (e.shape.rows.saturating_mul(e.shape.hidden), e.shape.dtype);
        let recv = e.sum_destination();
        Request { what, collective: Collective::AllReduce, send: e.input, recv, count, dtype, epilogue: Some(e) }
    }

    /// Nothing to do (no elements; with the epilogue: no rows, while
    /// rows of no elements are an error).
    fn empty(&self) -> bool {
        match &self.epilogue {
            Some(e) => e.shape.rows == 0,
            None => self.count == 0,
        }
    }
}

/// What the choose step decided.
struct Choice {
    algorithm: Algorithm,
    /// The launch shape the tuning table measured (sentinel algorithms).
    tuned_shape: Option<(u32, u32)>,
    /// With the epilogue: whether the algorithm's fused kernels run it.
    fused: Option<FusedPath>,
}

impl Comm {
    /// The pipeline (module docs) for one call.
    ///
    /// # Safety
    /// The entry point's contract: device pointers of this communicator's
    /// context valid for the call's buffers until the work queued on
    /// `stream` completes, `stream` a live stream of the context.
    unsafe fn collective(&self, request: Request, stream: sys::CUstream) -> Result<()> {
        self.check()?;
        if request.empty() {
            return Ok(());
        }
        let buffers = self.check_request(&request)?;
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        // SAFETY: the caller's contract.
        let capture = unsafe { self.validate(&request, buffers, stream)? };
        if self.world == 1 {
            // SAFETY: validated pointers and stream.
            return unsafe { self.alone(&request, stream) };
        }
        let capturing = capture.is_some();
        let choice = self.choose(&request, capturing)?;
        // SAFETY: validated pointers and stream; `ordered` orders the call.
        unsafe { self.ordered(stream, capture, || self.run(&request, &choice, stream, capturing)) }.inspect_err(|e| {
            if e.breaks_communicator() {
                self.mark_broken(e.to_string());
            }
        })
    }

    /// Validate, the part that needs no driver: the buffers' pointers and
    /// sizes (the epilogue's are checked with their extents, in
    /// [`validate`](Self::validate)).
    fn check_request<'r>(&self, r: &'r Request) -> Result<std::result::Result<BufferShape, &'r EpilogueCall>> {
        Ok(match &r.epilogue {
            None => {
                let shape = buffer_shape(r.collective, r.count, self.rank, self.world);
                Ok(check_pointers(r.what, (r.send, r.recv), shape, r.dtype)?)
            }
            Some(e) => Err(e),
        })
    }

    /// Validate, with the context bound: the stream's context and capture,
    /// the buffers' extents and overlaps (with the epilogue, every check of
    /// its arguments). Returns the stream's capture id.
    ///
    /// # Safety
    /// `stream` is a live stream (the entry point's contract).
    unsafe fn validate(
        &self,
        r: &Request,
        buffers: std::result::Result<BufferShape, &EpilogueCall>,
        stream: sys::CUstream,
    ) -> Result<Option<u64>> {
        let what = r.what;
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
        let dtype = r.dtype;
        let extent = |name: &str, ptr: u64, bytes: u64| {
            let count = bytes as usize / dtype.size_bytes();
            self.validate_device_range(name, ptr, bytes as usize, count, dtype, capturing)
        };
        match buffers {
            Err(e) => {
                let p = EpiloguePointers { input: e.input, residual: e.residual, weight: e.weight, normed: e.normed };
                check_call(what, &p, &e.shape, e.eps, &e.opts, &extent).map_err(|m| {
                    if m.starts_with(what) {
                        Error::InvalidUsage(m)
                    } else {
                        Error::invalid(format!("{what}: {m}"))
                    }
                })?;
            }
            Ok(shape) => {
                // Ranges first: an overrun (wrong count or dtype) is the root
                // cause of an overlap with a neighbouring allocation and says so.
                let elem = dtype.size_bytes() as u64;
                for (name, ptr, count) in [("send", r.send, shape.send), ("recv", r.recv, shape.recv)] {
                    extent(name, ptr, count as u64 * elem).map_err(|m| Error::invalid(format!("{what}: {m}")))?;
                }
                if bad_overlap(r.send, r.recv, &shape, dtype) {
                    let allowed = if r.collective == Collective::AllReduce { "being equal" } else { "in place" };
                    return Err(Error::invalid(format!("{what}: send and recv overlap without {allowed}")));
                }
            }
        }
        Ok(capture)
    }

    /// A world of one: the input is the result; with the epilogue, its
    /// kernel alone.
    ///
    /// # Safety
    /// Validated pointers and a live stream of the context.
    unsafe fn alone(&self, r: &Request, stream: sys::CUstream) -> Result<()> {
        if let Some(e) = &r.epilogue {
            // SAFETY: the caller's contract.
            return unsafe { self.launch_epilogue(e, e.input, stream) };
        }
        if r.send != r.recv {
            let bytes = r.count * r.dtype.size_bytes();
            // SAFETY: live stream of our context; pointers validated.
            unsafe { driver::memcpy_dtod_async(r.recv, r.send, bytes, stream)? };
        }
        Ok(())
    }

    /// Choose: the algorithm for the call and the launch shape the tuning
    /// table measured for it (sentinel algorithms): the forced algorithm
    /// (no tuned shape), else the selection table's choice for this size
    /// bucket (no allocation); with the epilogue, the fused table's, and
    /// whether the algorithm's fused kernels run it.
    fn choose(&self, r: &Request, capturing: bool) -> Result<Choice> {
        if r.collective != Collective::AllReduce {
            let block_bytes = r.count * r.dtype.size_bytes();
            return self.choose_other(r.collective, block_bytes, capturing);
        }
        let bytes = r.count * r.dtype.size_bytes();
        let fused_table = r.epilogue.is_some_and(|e| !e.opts.unfused);
        let forced = self.forced_for(Collective::AllReduce);
        let (algorithm, tuned_shape) = match forced {
            Some(forced) => (forced, None),
            None => {
                let table = if fused_table { &self.fused_selection } else { &self.selection };
                let c = table.lookup(bytes, r.dtype, capturing);
                (c.algorithm, c.shape)
            }
        };
        let fused = r.epilogue.map(|e| match e.opts.unfused {
            true => FusedPath::Unfused("asked for (FusedOptions::unfused)".into()),
            false => self.fused_path(algorithm, &e.shape),
        });
        Ok(Choice { algorithm, tuned_shape, fused })
    }

    /// The all-gather or reduce-scatter of `block_bytes` per rank: the
    /// forced algorithm when it implements the collective (forced NCCL:
    /// NCCL's), else the collective table's choice when it can run here,
    /// else the first of ours that can, else NCCL's.
    fn choose_other(&self, collective: Collective, block_bytes: usize, capturing: bool) -> Result<Choice> {
        let algorithm = self.other_algorithm(collective).map_err(Error::Unsupported)?;
        let forced = self.forced_for(collective).is_some();
        let algorithm = match self.collective_table.lookup(collective, block_bytes, capturing) {
            Some(c) if !forced && c.algorithm == Algorithm::Nccl && self.nccl.is_some() => Algorithm::Nccl,
            _ => algorithm,
        };
        Ok(Choice { algorithm, tuned_shape: None, fused: None })
    }

    /// The algorithm of ours (or NCCL's) an all-gather or reduce-scatter
    /// runs when sizes play no part, or why none runs.
    pub(super) fn other_algorithm(&self, collective: Collective) -> std::result::Result<Algorithm, String> {
        let caps = self.capabilities();
        if self.config.algorithm == Some(Algorithm::Nccl) && self.nccl.is_some() {
            return Ok(Algorithm::Nccl);
        }
        let forced = self.config.algorithm.filter(|a| a.collective() == collective);
        let ours = forced.or_else(|| {
            Algorithm::OURS
                .into_iter()
                .find(|a| a.collective() == collective && algorithm::availability(*a, &caps, None).is_ok())
        });
        match (ours, &self.nccl) {
            (Some(a), _) => Ok(a),
            (None, Some(_)) => Ok(Algorithm::Nccl),
            (None, None) => {
                let why: Vec<String> = Algorithm::OURS
                    .into_iter()
                    .filter(|a| a.collective() == collective)
                    .filter_map(|a| algorithm::availability(a, &caps, None).err())
                    .collect();
                Err(format!("no {} algorithm runs on this communicator ({}), and NCCL is unavailable", collective.name(), why.join("; ")))
            }
        }
    }

    /// Whether `algorithm` runs a fused call of `shape` in its own kernels.
    fn fused_path(&self, algorithm: Algorithm, shape: &crate::algorithm::epilogue::EpilogueShape) -> FusedPath {
        self.algorithms
            .get(algorithm)
            .and_then(|side| side.fused_path(shape))
            .unwrap_or_else(|| no_fused_kernel(algorithm))
    }

    /// Run (chosen, ordered): NCCL or the algorithm's launches; with the
    /// epilogue, the fused launches or the separate kernel after the sum.
    ///
    /// # Safety
    /// Validated pointers and a live stream of the context.
    unsafe fn run(&self, r: &Request, choice: &Choice, stream: sys::CUstream, capturing: bool) -> Result<()> {
        let algorithm = choice.algorithm;
        if let (Some(e), Some(FusedPath::Fused { rows_per_launch })) = (&r.epilogue, &choice.fused) {
            algorithm::availability(algorithm, &self.capabilities(), None).map_err(Error::Unsupported)?;
            let side = self.algorithms.get(algorithm).ok_or_else(|| not_prepared(algorithm))?;
            let peer_input = self.peer_input(algorithm, e.input, r.count, r.dtype, capturing, e.in_place())?;
            let call = self.call(r, choice, peer_input);
            // SAFETY: the algorithm's launches use the validated buffers
            // and this communicator's regions (see `issue`).
            return side.run_fused(&call, e, *rows_per_launch, &mut |launch| unsafe { self.issue(launch, stream) });
        }
        // SAFETY: the caller's contract.
        unsafe { self.run_plain(r, choice, stream, capturing)? };
        match &r.epilogue {
            // SAFETY: as above; the sum is at `recv`.
            Some(e) => unsafe { self.launch_epilogue(e, r.recv, stream) },
            None => Ok(()),
        }
    }

    /// The allreduce (or the collective) itself, by NCCL or by `choice`'s
    /// algorithm.
    ///
    /// # Safety
    /// As [`run`](Self::run).
    unsafe fn run_plain(&self, r: &Request, choice: &Choice, stream: sys::CUstream, capturing: bool) -> Result<()> {
        let algorithm = choice.algorithm;
        if algorithm == Algorithm::Nccl {
            return match (&self.nccl, r.collective) {
                (Some(nccl), Collective::AllReduce) => nccl.all_reduce(r.send, r.recv, r.count, r.dtype, stream),
                (Some(nccl), Collective::AllGather) => nccl.all_gather(r.send, r.recv, r.count, r.dtype, stream),
                (Some(nccl), Collective::ReduceScatter) => {
                    nccl.reduce_scatter(r.send, r.recv, r.count, r.dtype, stream)
                }
                (None, _) => Err(Error::Nccl("the NCCL algorithm was selected but no NCCL communicator exists".into())),
            };
        }
        algorithm::availability(algorithm, &self.capabilities(), None).map_err(Error::Unsupported)?;
        let side = self.algorithms.get(algorithm).ok_or_else(|| not_prepared(algorithm))?;
        let peer_input = self.peer_input(algorithm, r.send, r.count, r.dtype, capturing, r.send == r.recv)?;
        let call = self.call(r, choice, peer_input);
        // SAFETY: the algorithm's launches use the validated buffers and
        // this communicator's regions (see `issue`).
        side.run(&call, &mut |launch| unsafe { self.issue(launch, stream) })
    }

    fn call(&self, r: &Request, choice: &Choice, peer_input: PeerInput) -> Call {
        Call {
            input: r.send,
            output: r.recv,
            count: r.count,
            dtype: r.dtype,
            forced_shape: self.config.launch_shape,
            tuned_shape: choice.tuned_shape,
            peer_input,
        }
    }

    /// Where peers read this rank's input for a call of `algorithm`: its
    /// own business for push algorithms; for pull algorithms a registered
    /// buffer or the staging (always staged when the algorithm writes its
    /// output over the input it still lends, `over_input`).
    fn peer_input(
        &self,
        algorithm: Algorithm,
        input: u64,
        count: usize,
        dtype: DType,
        capturing: bool,
        over_input: bool,
    ) -> Result<PeerInput> {
        let Some(host) = algorithm::host(algorithm).filter(|h| h.reads_peer_inputs()) else {
            return Ok(PeerInput::Local);
        };
        let must_stage = host.stages_in_place() && over_input;
        Ok(match self.input_source(input, count * dtype.size_bytes(), capturing, must_stage)? {
            InputSource::Staging => {
                PeerInput::Staged { staging: self.setup.staging_ptr(), entry: self.setup.table_entry(0) }
            }
            InputSource::Table(index) => PeerInput::Registered { entry: self.setup.table_entry(index) },
        })
    }

    /// Issues one launch of an algorithm on the call's stream.
    ///
    /// # Safety
    /// `stream` is a live stream of this context; the launch comes from an
    /// algorithm's side of this rank for a validated call: its addresses
    /// are the call's buffers (offsets within the call's elements) and this
    /// communicator's mapped regions (alive as long as it is), its grid is
    /// one the kernel supports (within residency and the block limits).
    unsafe fn issue(&self, launch: Launch<'_>, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the contract above; the driver checks each kernel's
        // arguments against the parameters its PTX declares.
        unsafe {
            match launch {
                Launch::ByValue { kernel, grid, params } => {
                    driver::launch_by_value(kernel, grid.blocks, grid.threads, grid.cluster, stream, params)
                }
                Launch::Args { kernel, grid, args } => driver::launch(kernel, grid.blocks, grid.threads, stream, args),
                Launch::Copy { dst, src, bytes } => driver::memcpy_dtod_async(dst, src, bytes, stream),
                Launch::CopyEngine { runtime, ops, step } => driver::copy_engine::run(runtime, ops, step, stream),
            }
        }
    }

    /// The separate epilogue kernel over the whole call, reading the sum
    /// at `sum`.
    ///
    /// # Safety
    /// Validated pointers and a live stream of the context.
    unsafe fn launch_epilogue(&self, e: &EpilogueCall, sum: u64, stream: sys::CUstream) -> Result<()> {
        let (blocks, threads, args) = e.separate_kernel(sum);
        // SAFETY: add_rms_norm takes (sum, residual_in, residual_out,
        // weight, normed, rows, hidden, eps, flags); every pointer covers
        // the call (validated); any grid and a block of whole warps up to
        // 512 threads.
        unsafe { driver::launch(self.add_rms_norm.get(e.shape.dtype), blocks, threads, stream, &args) }
    }

    /// The plan for a call of `bytes` (what `all_reduce` would do).
    pub fn plan_call(&self, bytes: usize, dtype: DType, capturing: bool, in_place: bool) -> CallPlan {
        let transport = self.setup.transport;
        if let Some(forced) = self.forced_for(Collective::AllReduce) {
            return CallPlan { algorithm: forced, transport, reason: "forced by configuration".into() };
        }
        let c = self.selection.lookup(bytes, dtype, capturing);
        let mut reason = c.reason.clone();
        if in_place && c.algorithm == Algorithm::OneShotPull {
            reason.push_str(" (in place: the input is staged first)");
        }
        CallPlan { algorithm: c.algorithm, transport, reason }
    }

    pub(super) fn read_error_record(&self) -> Option<DeviceFailure> {
        let rec = self.setup.error_record.host_ptr() as *const ErrorRecord;
        // SAFETY: `rec` points to the pinned, mapped record owned by `setup`;
        // the device writes `published` last with a release store, so after
        // observing it (volatile read + acquire fence) the fields are complete.
        unsafe {
            let published = std::ptr::read_volatile(&(*rec).published);
            if published == 0 {
                return None;
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            let copy = std::ptr::read_volatile(rec);
            Some(DeviceFailure::from_record(&copy))
        }
    }
}

fn not_prepared(algorithm: Algorithm) -> Error {
    Error::Unsupported(format!("{algorithm}: not set up on this communicator"))
}
