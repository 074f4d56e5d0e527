//! The one per-call path, after `Comm::all_reduce_raw` validated the
//! arguments: choose the algorithm (forced, else the selection table's
//! entry for this size), dispatch (NCCL, a pull or a push kernel), split the
//! message into launches, make the input peer-visible (pull: registered or
//! staged), launch.

#![allow(unsafe_code)]

pub(super) mod fused;

use cudarc::driver::{sys, DevicePtr, DevicePtrMut};
use tp_allreduce_kernels::ids::{AlgorithmId, DType};
use tp_allreduce_kernels::layout::ErrorRecord;
use tp_allreduce_kernels::layout::{PACK_BYTES, THREADS_PER_BLOCK};
use tp_allreduce_kernels::partition::packs_for;

use super::params;
use super::registry::InputSource;
use super::{CallPlan, Comm, Element, ReduceOp};
use crate::algorithm::Algorithm;
use crate::algorithm::{self, AlgorithmHost};
use crate::driver::{self, KernelArgs};
use crate::error::DeviceFailure;
use crate::error::{Error, Result};

/// The algorithm for one call and the launch shape the tuning table
/// measured for it (sentinel algorithms): the forced algorithm (no tuned
/// shape), else the selection table's choice for this size bucket (no
/// allocation).
pub(super) fn choose(comm: &Comm, bytes: usize, dtype: DType, capturing: bool) -> (Algorithm, Option<(u32, u32)>) {
    match comm.config.algorithm {
        Some(forced) => (forced, None),
        None => {
            let c = comm.selection.lookup(bytes, dtype, capturing);
            (c.algorithm, c.shape)
        }
    }
}

/// [`choose`] with the reason, for callers that want to explain it.
pub(super) fn plan(comm: &Comm, bytes: usize, dtype: DType, capturing: bool, in_place: bool) -> CallPlan {
    let transport = comm.setup.transport;
    if let Some(forced) = comm.config.algorithm {
        return CallPlan { algorithm: forced, transport, reason: "forced by configuration".into() };
    }
    let c = comm.selection.lookup(bytes, dtype, capturing);
    let mut reason = c.reason.clone();
    if in_place && c.algorithm == Algorithm::OneShotPull {
        reason.push_str(" (in place: the input is staged first)");
    }
    CallPlan { algorithm: c.algorithm, transport, reason }
}

/// Splits `count` elements into launches of at most `cap_packs` packs each
/// (chunk boundaries on pack boundaries keep 16-byte alignment).
pub(super) fn chunks(count: usize, dtype: DType, cap_packs: u64) -> impl Iterator<Item = (usize, usize)> {
    let per_pack = tp_allreduce_kernels::partition::elems_per_pack(dtype);
    let cap_elems = (cap_packs.min((usize::MAX / PACK_BYTES) as u64) as usize).saturating_mul(per_pack).max(per_pack);
    (0..count).step_by(cap_elems).map(move |start| (start, cap_elems.min(count - start)))
}

impl Comm {
    /// Allreduce (sum) of `send` into `recv` on the communicator's stream.
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
        self.check()?;
        if count == 0 {
            return Ok(());
        }
        if send == 0 || recv == 0 {
            return Err(Error::invalid("all_reduce: null device pointer"));
        }
        let elem = dtype.size_bytes() as u64;
        if send % elem != 0 || recv % elem != 0 {
            return Err(Error::invalid(format!(
                "all_reduce: pointers must be aligned to the {}-byte element size",
                elem
            )));
        }
        let bytes =
            count.checked_mul(dtype.size_bytes()).ok_or_else(|| Error::invalid("all_reduce: count overflows"))?;
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        // SAFETY: the caller guarantees `stream` is a live stream (contract of this fn).
        let stream_ctx = unsafe { driver::stream_context(stream)? };
        if stream_ctx != self.ctx.cu_ctx() {
            return Err(Error::invalid("all_reduce: the stream belongs to another CUDA context than the communicator"));
        }
        // SAFETY: as above.
        let capture = unsafe { driver::capture_id(stream)? };
        let capturing = capture.is_some();
        // Ranges first: an overrun (wrong count or dtype) is the root cause
        // of an overlap with a neighbouring allocation and says so.
        for (what, ptr) in [("send", send), ("recv", recv)] {
            self.validate_device_range(what, ptr, bytes, count, dtype, capturing)
                .map_err(|m| Error::invalid(format!("all_reduce: {m}")))?;
        }
        let overlap = send != recv && ranges_overlap(send, recv, bytes as u64);
        if overlap {
            return Err(Error::invalid("all_reduce: send and recv overlap without being equal"));
        }
        // SAFETY: pointers and stream validated above; the caller's
        // contract covers their lifetime.
        unsafe { self.call(send, recv, count, dtype, stream, capture) }
    }

    /// Checks that `ptr..ptr+bytes` is device memory of this context (a
    /// wrong count or dtype in the raw API shows up as an overrun). One
    /// range query for `cuMemAlloc` memory. For cuMem memory the driver
    /// reports only the physical chunk holding `ptr`, so a range running
    /// past it is accepted when the chunks mapped after it continue it up
    /// to its end (a few pointer queries per chunk).
    pub(super) fn validate_device_range(
        &self,
        what: &str,
        ptr: u64,
        bytes: usize,
        count: usize,
        dtype: DType,
        capturing: bool,
    ) -> std::result::Result<(), String> {
        match driver::allocation_range(ptr) {
            Ok((base, size)) => {
                let end = ptr.saturating_add(bytes as u64);
                let mut mapped_end = base.saturating_add(size as u64);
                if end > mapped_end && driver::vmm::backing(ptr) == driver::vmm::Backing::Vmm {
                    mapped_end = driver::vmm::mapped_end(mapped_end, end);
                }
                if end > mapped_end {
                    return Err(format!(
                        "{what} holds {} bytes from {ptr:#x}, but {count} x {} needs {bytes} (wrong count or dtype?)",
                        mapped_end.saturating_sub(ptr),
                        dtype.name()
                    ));
                }
                Ok(())
            }
            // Some allocations (e.g. virtual-memory mappings) have no
            // address range; accept them if they belong to this context.
            // Memory a graph allocates while the stream captures
            // (`cuMemAllocAsync` in the capture, e.g. an engine's output
            // tensor) is not known to pointer queries until the graph is
            // instantiated: accepted unchecked while capturing.
            Err(_) => match driver::pointer_context(ptr) {
                Some(c) if c == self.ctx.cu_ctx() => Ok(()),
                None if capturing => Ok(()),
                _ => Err(format!("{what} ({ptr:#x}) is not device memory of the communicator's context")),
            },
        }
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

    /// One validated call: choose, dispatch, launch. A failure that breaks
    /// the communicator (a device timeout seen here, a launch error) marks
    /// it broken.
    ///
    /// `capture`: the stream's capture id (`driver::capture_id`), queried
    /// once by the caller's validation.
    ///
    /// # Safety
    /// As `Comm::all_reduce_raw`, with the arguments already validated.
    pub(super) unsafe fn call(
        &self,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
        capture: Option<u64>,
    ) -> Result<()> {
        let bytes = count * dtype.size_bytes();
        if self.world == 1 {
            if send != recv {
                // SAFETY: live stream of our context; pointers validated.
                unsafe { driver::memcpy_dtod_async(recv, send, bytes, stream)? };
            }
            return Ok(());
        }
        let capturing = capture.is_some();
        let (algorithm, tuned_shape) = choose(self, bytes, dtype, capturing);
        // SAFETY: as above (live stream of our context, validated pointers).
        unsafe {
            self.ordered(stream, capture, || {
                self.dispatch(algorithm, tuned_shape, send, recv, count, dtype, stream, capturing)
            })
        }
        .inspect_err(|e| {
            if e.breaks_communicator() {
                self.mark_broken(e.to_string());
            }
        })
    }

    /// Runs `algorithm` (chosen, ordered) on a validated call: NCCL, a pull
    /// or a push kernel. Also the allreduce of the fused calls' unfused path.
    ///
    /// # Safety
    /// As `Comm::all_reduce_raw`, with the arguments already validated.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn dispatch(
        &self,
        algorithm: Algorithm,
        tuned_shape: Option<(u32, u32)>,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
        capturing: bool,
    ) -> Result<()> {
        match algorithm {
            Algorithm::Nccl => match &self.nccl {
                Some(nccl) => nccl.all_reduce(send, recv, count, dtype, stream),
                None => Err(Error::Nccl("the NCCL algorithm was selected but no NCCL communicator exists".into())),
            },
            a if a.reads_peer_inputs() => self.run_pull(a, send, recv, count, dtype, stream, capturing),
            Algorithm::CopyEngineRing => self.run_copy_engine(send, recv, count, dtype, stream),
            a => self.run_push(a, send, recv, count, dtype, stream, tuned_shape),
        }
    }

    /// Runs `body` (the call's launches on `stream`) ordered after the
    /// rank's previous call. Calls on one rank must not overlap: kernels
    /// keep per-block state (epochs, generations, ring counters, staging)
    /// that assumes they run one after the other.
    ///
    /// * Eager calls: one on another stream than the previous eager call
    ///   waits for that call's work through an event recorded on the
    ///   previous call's stream *during* that call (right after its
    ///   launches), or on the communicator's own stream (alive as long as
    ///   the communicator). A later call never touches an earlier call's
    ///   stream: the caller may have destroyed it since. Streams are told
    ///   apart by their id (`cuStreamGetId`), not their handle, whose
    ///   address a new stream may reuse.
    /// * Captured calls: one on another stream than the previous call of the
    ///   same capture is refused, since the two could run concurrently in
    ///   the graph.
    /// * Eager calls and graph replays cannot be ordered here: the caller
    ///   orders them (documented on `Comm::all_reduce_raw`).
    ///
    /// The order lock is held across `body`, so calls of one communicator
    /// from several threads are serialised on the host too.
    ///
    /// # Safety
    /// `stream` is a live stream of the communicator's context; `body`'s
    /// own contract is the caller's.
    pub(super) unsafe fn ordered(
        &self,
        stream: sys::CUstream,
        capture: Option<u64>,
        body: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let mut order = self.order.lock().map_err(|_| Error::Broken("call-order lock poisoned".into()))?;
        let own_stream = stream == self.stream.cu_stream();
        match capture {
            Some(capture) => {
                // Every stream of one capture is alive while it lasts, so
                // within a capture the handle tells streams apart
                // (`cuStreamGetId` on a capturing stream invalidates the
                // capture).
                let stream_handle = stream as u64;
                if order.last_capture.is_some_and(|c| c.capture == capture && c.stream_handle != stream_handle) {
                    return Err(Error::invalid(
                        "all_reduce: two calls of one communicator were captured on different streams of the same \
                         graph; they could run concurrently and corrupt each other. Capture a communicator's calls \
                         on one stream (join the branches first).",
                    ));
                }
                order.last_capture = Some(CapturedCall { capture, stream_handle });
                body()
            }
            None => {
                // SAFETY: `stream` is live (contract of this fn) and not
                // capturing.
                let stream_id = unsafe { driver::stream_id(stream)? };
                if let Some(prev) = order.last_eager.filter(|p| p.stream_id != stream_id) {
                    let event = order.event(&self.ctx)?;
                    // SAFETY: our own stream lives as long as `self`; `stream`
                    // is live (contract). A call on a foreign stream was
                    // recorded at its end, below.
                    unsafe {
                        if !prev.recorded {
                            event.record(self.stream.cu_stream())?;
                        }
                        event.wait(stream)?;
                    }
                }
                let result = body();
                // A call on a foreign stream records its end now, while the
                // stream is certainly alive (the caller's contract for this
                // call), so that a later call on another stream need not
                // touch it.
                let recorded = !own_stream;
                if recorded {
                    // SAFETY: as above.
                    let record = order.event(&self.ctx).and_then(|event| unsafe { event.record(stream) });
                    if result.is_ok() {
                        record?;
                    }
                }
                order.last_eager = Some(EagerCall { stream_id, recorded });
                result
            }
        }
    }

    /// The host side and kernel of `algorithm` for `dtype`, once the one
    /// availability rule allows it here.
    pub(super) fn prepare(
        &self,
        algorithm: Algorithm,
        dtype: DType,
    ) -> Result<(&'static dyn AlgorithmHost, sys::CUfunction)> {
        algorithm::availability(algorithm, &self.capabilities(), None).map_err(Error::Unsupported)?;
        let host = algorithm::host(algorithm).ok_or_else(|| Error::invalid("NCCL has no kernel of ours"))?;
        Ok((host, self.module.function(&crate::kernels::entry_name(host.kernel(), dtype))?))
    }

    #[allow(clippy::too_many_arguments)]
    fn run_push(
        &self,
        algorithm: Algorithm,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
        tuned_shape: Option<(u32, u32)>,
    ) -> Result<()> {
        let (host, f) = self.prepare(algorithm, dtype)?;
        if host.sentinel() {
            return self.run_sentinel(host, send, recv, count, dtype, stream, tuned_shape);
        }
        let geometry = self.setup.geometry();
        let elem = dtype.size_bytes() as u64;
        for (start, n) in chunks(count, dtype, host.launch_capacity_packs(&geometry)) {
            let grid = host.grid(&geometry, packs_for(n as u64, dtype));
            if grid == 0 {
                return Err(Error::Unsupported(format!(
                    "{algorithm}: a launch of {n} elements does not fit the scratch"
                )));
            }
            let off = start as u64 * elem;
            let args = KernelArgs::new().u64(self.setup.handle.ptr()).u64(send + off).u64(recv + off).u64(n as u64);
            // SAFETY: push kernels take (handle, input, output, count); the
            // pointers are valid for `n` elements (checked by the caller).
            unsafe { driver::launch(f, grid, THREADS_PER_BLOCK, stream, &args)? };
        }
        Ok(())
    }

    /// A sentinel algorithm (OneShotPush, TwoShotPush, Hierarchical):
    /// parameters by value from the rank's template, a launch shape per
    /// launch (configured, tuned or the default rule, within residency). The
    /// host validates what the kernel does not: each launch fits the receive
    /// region (`chunks`) and its shape stays resident.
    #[allow(clippy::too_many_arguments)]
    fn run_sentinel(
        &self,
        host: &dyn AlgorithmHost,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
        tuned_shape: Option<(u32, u32)>,
    ) -> Result<()> {
        let geometry = self.setup.geometry();
        let capacity = host.launch_capacity_packs(&geometry);
        let kernel = host.kernel();
        let name = if kernel == AlgorithmId::OneShotPush && self.world == 2 && self.config.one_shot_push_tp2 {
            crate::kernels::one_shot_push2_entry(dtype)
        } else {
            crate::kernels::entry_name(kernel, dtype)
        };
        let f = self.module.function(&name)?;
        let elem = dtype.size_bytes() as u64;
        for (start, n) in chunks(count, dtype, capacity) {
            let packs = packs_for(n as u64, dtype);
            if packs == 0 || packs > capacity {
                return Err(Error::Unsupported(format!(
                    "{}: a launch of {n} elements does not fit the receive region ({capacity} packs)",
                    host.kernel().kernel_prefix()
                )));
            }
            let default = host.launch_shape(&geometry, packs);
            let (blocks, threads) =
                params::choose_shape(self.config.launch_shape, tuned_shape, default, &geometry.sentinel_resident)?;
            let (input, output) = (send + start as u64 * elem, recv + start as u64 * elem);
            // SAFETY (both launches): each entry takes its parameter struct by
            // value (sizes pinned on both sides, checked against the PTX by
            // the tests: `kernels::param_struct`); the template's addresses
            // are this communicator's mapped regions, alive as long as it is;
            // input and output are valid for `n` elements (checked by the
            // caller); the shape is within the resident cap and the block
            // limit (choose_shape, Config::validate).
            if kernel == AlgorithmId::OneShotPush {
                let p = self.sentinel.one_shot_push(input, output, n as u64);
                unsafe { driver::launch_struct(f, blocks, threads, stream, &p)? };
            } else {
                let hierarchical = kernel == AlgorithmId::Hierarchical;
                let p = self
                    .sentinel
                    .island_push(hierarchical, input, output, n as u64)
                    .ok_or_else(|| Error::Unsupported("hierarchical: this communicator has no islands".into()))?;
                unsafe { driver::launch_struct(f, blocks, threads, stream, &p)? };
            }
        }
        Ok(())
    }

    /// The copy-engine ring: per launch (at most the staging's capacity),
    /// the program of `comm/copy_engine.rs` on the caller's stream and the
    /// rank's helper stream.
    fn run_copy_engine(
        &self,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()> {
        let (host, step) = self.prepare(Algorithm::CopyEngineRing, dtype)?;
        let Some((template, runtime)) = &self.sentinel.copy_engine else {
            return Err(Error::Unsupported("copy-engine-ring: no staging on this communicator".into()));
        };
        let geometry = self.setup.geometry();
        let elem = dtype.size_bytes() as u64;
        for (start, n) in chunks(count, dtype, host.launch_capacity_packs(&geometry)) {
            let (input, output) = (send + start as u64 * elem, recv + start as u64 * elem);
            let pieces = super::copy_engine::pieces(n as u64, dtype, self.world);
            let shape = |packs| host.launch_shape(&geometry, packs);
            let ops = template.program((input, output, n as u64), dtype, pieces, shape);
            // SAFETY: `stream` is a live stream of this context (validated by
            // the caller); the program's addresses are this communicator's
            // mapped regions and the caller's buffers, valid for `n`
            // elements; the program is built by `CopyEngineTemplate::program`.
            unsafe { driver::copy_engine::run(runtime, &ops, step, stream)? };
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn run_pull(
        &self,
        algorithm: Algorithm,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
        capturing: bool,
    ) -> Result<()> {
        let (host, f) = self.prepare(algorithm, dtype)?;
        let geometry = self.setup.geometry();
        let elem = dtype.size_bytes();
        // OneShotPull writes the output while peers still read the input, so
        // in place it must read from a staged copy.
        let must_stage = algorithm == Algorithm::OneShotPull && send == recv;
        let source = self.input_source(send, count * elem, capturing, must_stage)?;
        for (start, n) in chunks(count, dtype, host.launch_capacity_packs(&geometry)) {
            let grid = host.grid(&geometry, packs_for(n as u64, dtype));
            let off = (start * elem) as u64;
            let (entry, peer_offset) = match source {
                InputSource::Staging => {
                    // SAFETY: `stream` is the caller's live stream; staging holds a whole chunk.
                    unsafe { driver::memcpy_dtod_async(self.setup.staging_ptr(), send + off, n * elem, stream)? };
                    (self.setup.table_entry(0), 0)
                }
                InputSource::Table(index) => (self.setup.table_entry(index), off),
            };
            let args = KernelArgs::new()
                .u64(self.setup.handle.ptr())
                .u64(entry)
                .u64(peer_offset)
                .u64(recv + off)
                .u64(n as u64);
            // SAFETY: pull kernels take (handle, peer_inputs, peer_offset,
            // output, count); `entry` is a device table entry whose rank
            // addresses are filled (or zero, which the kernel refuses).
            unsafe { driver::launch(f, grid, THREADS_PER_BLOCK, stream, &args)? };
        }
        Ok(())
    }
}

fn check_op(op: &ReduceOp) -> Result<()> {
    match op {
        ReduceOp::Sum => Ok(()),
        ReduceOp::Prod => Err(Error::Unsupported("ReduceOp::Prod: tp-allreduce implements sum only; use NCCL".into())),
        ReduceOp::Max => Err(Error::Unsupported("ReduceOp::Max: tp-allreduce implements sum only; use NCCL".into())),
        ReduceOp::Min => Err(Error::Unsupported("ReduceOp::Min: tp-allreduce implements sum only; use NCCL".into())),
        ReduceOp::Avg => Err(Error::Unsupported(
            "ReduceOp::Avg: tp-allreduce implements sum only; sum, then scale by 1/world_size".into(),
        )),
    }
}

fn ranges_overlap(a: u64, b: u64, len: u64) -> bool {
    a < b.saturating_add(len) && b < a.saturating_add(len)
}

/// The previous eager call of a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct EagerCall {
    /// `driver::stream_id` of its stream.
    stream_id: u64,
    /// Whether `CallOrder::event` was recorded on its stream at its end
    /// (a foreign stream); else it ran on the communicator's own stream.
    recorded: bool,
}

/// The previous captured call of a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CapturedCall {
    capture: u64,
    /// Its stream's handle (alive while the capture lasts).
    stream_handle: u64,
}

/// What orders a rank's calls across streams (`Comm::ordered`).
#[derive(Default)]
pub(crate) struct CallOrder {
    last_eager: Option<EagerCall>,
    last_capture: Option<CapturedCall>,
    /// Created at the first eager call that needs it (never during a
    /// capture).
    event: Option<driver::Event>,
}

impl CallOrder {
    fn event(&mut self, ctx: &std::sync::Arc<cudarc::driver::CudaContext>) -> Result<&driver::Event> {
        let event = match self.event.take() {
            Some(event) => event,
            None => driver::Event::new(ctx)?,
        };
        Ok(self.event.insert(event))
    }
}
