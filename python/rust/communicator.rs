//! `tp_allreduce._core.Communicator`: one rank of a multi-process
//! communicator, driven with raw device pointers and raw stream handles
//! (what `tensor.data_ptr()` and `torch.cuda.current_stream().cuda_stream`
//! give), so this layer needs no PyTorch.
//!
//! Every call that can block (init, collectives, registration,
//! synchronisation) releases the GIL, and every call leaves the calling
//! thread's current CUDA context (PyTorch's current device) as it found it.
//!
//! # Capture copy (expandable segments)
//! Pull algorithms read peers' inputs, which in a captured graph means
//! registering them after capture with CUDA IPC. Memory that legacy IPC
//! cannot export (PyTorch's `expandable_segments:True`, stream-ordered
//! pools) cannot be registered. The communicator therefore owns a
//! `cuMemAlloc` buffer of `capture_copy_bytes`, registered once at init
//! (collective). A call captured on a stream whose plan is a pull algorithm
//! and whose input is not exportable captures a copy of the input into that
//! buffer and reduces from there (chunked if larger); nothing of it needs
//! registration after capture. Push algorithms and eager calls need no
//! registration at all (eager inputs are staged by the library itself).
//!
//! # Teardown
//! `close()` runs the library's collective teardown (`Comm::close`) with
//! the GIL released and raises what it reports (a device error, a peer
//! that did not arrive). Dropping the object does the same with errors
//! ignored, also with the GIL released, except while the interpreter
//! finalizes (then no other Python thread can run anyway, and a thread
//! that gave the GIL away could not take it back).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaStream};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tp_allreduce::rendezvous::Id;
use tp_allreduce::{Algorithm, Collective, Comm, Config, DType, Error, FusedOptions};

use crate::device::{self, CurrentContext, DeviceBuffer};
use crate::dtype::{check_call_args, dtype_from_code};
use crate::errors::{invalid, to_py_err, IntoPyResult};
use crate::id::PyId;

/// Default size of the capture-copy buffer (the engines' custom-allreduce
/// limit is 8 MiB).
pub const DEFAULT_CAPTURE_COPY_BYTES: usize = 8 << 20;

/// Where the binding's own records go (`tp_allreduce.python` in Python's
/// `logging`); the library's records carry their module paths
/// (`tp_allreduce.comm.setup`, ...).
pub const LOG_TARGET: &str = "tp_allreduce::python";

/// What a rank sets up on its own before it joins the others: driver,
/// device context, stream, configuration. Everything that can fail before
/// rank 0 listens fails here, so that `from_group` can tell the other ranks
/// through the process group instead of leaving them waiting in the
/// rendezvous.
struct Prepared {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    config: Config,
}

impl Prepared {
    /// `batch_invariant` turns `Config::batch_invariant` on (it is never
    /// turned off here: `TP_ALLREDUCE_BATCH_INVARIANT=1` also turns it on).
    fn new(ordinal: usize, algorithm: Option<Algorithm>, batch_invariant: bool) -> Result<Prepared, Error> {
        device::require_driver()?;
        let _restore = CurrentContext::save();
        let ctx = CudaContext::new(ordinal).map_err(|e| device::driver_error("cuDevicePrimaryCtxRetain", e))?;
        let stream = ctx.new_stream().map_err(|e| device::driver_error("cuStreamCreate", e))?;
        let mut config = Config::from_env()?;
        if algorithm.is_some() {
            config.algorithm = algorithm;
        }
        config.batch_invariant |= batch_invariant;
        config.validate()?;
        Ok(Prepared { ctx, stream, config })
    }
}

/// What a live communicator holds.
struct Inner {
    // Field order is drop order: the communicator (which waits for its
    // stream and meets its peers in the teardown barriers) before the
    // buffers its peers may have mapped.
    comm: Comm,
    copy_buffer: Option<DeviceBuffer>,
    /// A capture-copy buffer whose registration failed after some peer may
    /// have mapped it, and that could not be released early (see
    /// `register_copy_buffer`): freed after the communicator's teardown,
    /// whose second barrier means no peer maps it any more.
    parked: Option<DeviceBuffer>,
    captured_copies: AtomicU64,
    /// The first captured copy was reported (one warning per communicator).
    copy_warned: AtomicBool,
    ctx: Arc<CudaContext>,
}

impl Inner {
    fn join(prepared: Prepared, rank: usize, world: usize, id: Id, capture_copy_bytes: usize) -> Result<Inner, Error> {
        let Prepared { ctx, stream, config } = prepared;
        let _restore = CurrentContext::save();
        let comm = Comm::from_rank_with_config(stream, rank, world, id, config)?;
        let (copy_buffer, parked) = if capture_copy_bytes > 0 && world > 1 {
            match register_copy_buffer(&comm, &ctx, capture_copy_bytes) {
                Ok(buffers) => buffers,
                Err((e, buffer)) => {
                    // The teardown first: peers may map the buffer until its
                    // second barrier.
                    drop(comm);
                    drop(buffer);
                    return Err(e);
                }
            }
        } else {
            (None, None)
        };
        Ok(Inner {
            comm,
            copy_buffer,
            parked,
            captured_copies: AtomicU64::new(0),
            copy_warned: AtomicBool::new(false),
            ctx,
        })
    }

    /// # Safety
    /// As `Comm::all_reduce_raw`: live device pointers of this context,
    /// valid for `count` elements until the stream's work completes; a
    /// live stream of this context.
    unsafe fn all_reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<(), Error> {
        if count == 0 {
            return Ok(());
        }
        device::bind(&self.ctx)?;
        let elem = dtype.size_bytes();
        let bytes = count.checked_mul(elem).ok_or_else(|| Error::InvalidUsage("all_reduce: count overflows".into()))?;
        let buffer = match &self.copy_buffer {
            Some(b) if device::stream_is_capturing(stream)? && self.needs_copy(send, bytes, dtype, send == recv) => b,
            // SAFETY: forwarded contract.
            _ => return unsafe { self.comm.all_reduce_raw(send, recv, count, dtype, stream) },
        };
        // Captured pull call on memory peers cannot map: reduce from the
        // registered buffer, one buffer-full at a time (stream order
        // serialises the chunks; a pull kernel returns only after every
        // peer finished reading its input, so the buffer is free again).
        if !self.copy_warned.swap(true, Ordering::Relaxed) {
            log::warn!(
                target: LOG_TARGET,
                "rank {}: a captured {} call on memory CUDA IPC cannot export (PyTorch's expandable segments or \
                 a memory pool) is captured as a copy of its input into the communicator's buffer: one extra \
                 device copy per replay (reported once per communicator; `captured_copies` counts them)",
                self.comm.rank(),
                self.comm.plan_call(bytes, dtype, true, send == recv).algorithm,
            );
        }
        let chunk = (buffer.bytes() / 16 * 16 / elem).max(1);
        let mut start = 0;
        while start < count {
            let n = chunk.min(count - start);
            let offset = (start * elem) as u64;
            // SAFETY: `send + offset` holds `n` elements (caller's contract),
            // the buffer holds `chunk` >= `n`; `stream` is live.
            unsafe {
                device::memcpy_dtod_async(buffer.ptr(), send + offset, n * elem, stream)?;
                self.comm.all_reduce_raw(buffer.ptr(), recv + offset, n, dtype, stream)?;
            }
            self.captured_copies.fetch_add(1, Ordering::Relaxed);
            start += n;
        }
        Ok(())
    }

    /// Whether a call captured on `send` would make the library record an
    /// input that registration cannot export.
    fn needs_copy(&self, send: u64, bytes: usize, dtype: DType, in_place: bool) -> bool {
        let plan = self.comm.plan_call(bytes, dtype, true, in_place);
        plan.algorithm.reads_peer_inputs() && !device::pointer_is_ipc_exportable(send)
    }

    fn register_graph_buffers(&self) -> Result<usize, Error> {
        device::bind(&self.ctx)?;
        self.comm.register_graph_buffers()
    }

    /// Releases every registration (collective), then registers the
    /// capture-copy buffer again so later captures can use it.
    fn deregister_buffers(&self) -> Result<usize, Error> {
        device::bind(&self.ctx)?;
        let released = self.comm.deregister_buffers()?;
        if let Some(b) = &self.copy_buffer {
            self.comm.register_buffer(b.ptr(), b.bytes())?;
        }
        Ok(released)
    }

    fn synchronize(&self, stream: Option<u64>) -> Result<(), Error> {
        match stream {
            None => self.comm.synchronize(),
            Some(s) => {
                device::bind(&self.ctx)?;
                // SAFETY: the caller passes a live stream (raw API contract).
                let synced = unsafe { device::stream_synchronize(s as usize as sys::CUstream) };
                self.comm.check()?;
                synced
            }
        }
    }
}

/// Allocates the capture-copy buffer and registers it (collective):
/// `(registered, parked)`. Ranks first agree that every one of them
/// allocated, so none is left waiting in the registration; a failed
/// allocation or registration leaves the communicator without the buffer
/// (with a warning), never a rank hung.
///
/// A registration that failed may have failed after some peers mapped the
/// buffer (a rank's import failed while others' succeeded), and CUDA leaves
/// freeing memory that another process still maps undefined. So the buffer
/// is freed only once no peer can map it: every rank saw the failure (the
/// registration's steps all-gather their outcomes), so every rank runs
/// `deregister_buffers` (collective; it closes every rank's mappings of
/// registered buffers and returns once all did), and then frees it. If that
/// fails too, the buffer is parked until the communicator's teardown. An
/// error that breaks the communicator is returned with the buffer, for the
/// caller to free after dropping the communicator.
#[allow(clippy::type_complexity)]
fn register_copy_buffer(
    comm: &Comm,
    ctx: &Arc<CudaContext>,
    bytes: usize,
) -> Result<(Option<DeviceBuffer>, Option<DeviceBuffer>), (Error, Option<DeviceBuffer>)> {
    let bytes = bytes.div_ceil(16) * 16;
    let allocated = DeviceBuffer::alloc(ctx, bytes);
    let everyone = comm.all_gather_bytes(&[allocated.is_ok() as u8]).map_err(|e| (e, None))?;
    let unusable = |why: String| {
        log::warn!(
            target: LOG_TARGET,
            "rank {}: no capture-copy buffer ({why}): a captured pull call on memory CUDA IPC cannot export \
             will fail at register_graph_buffers (force a push algorithm, or use memory that can be exported)",
            comm.rank()
        );
    };
    let buffer = match allocated {
        Ok(b) => b,
        Err(e) => {
            unusable(format!("allocating {bytes} bytes failed: {e}"));
            return Ok((None, None));
        }
    };
    if let Some(rank) = everyone.iter().position(|v| v.first() != Some(&1)) {
        // Never offered to any peer: nobody maps it; freed here.
        unusable(format!("rank {rank} could not allocate it"));
        return Ok((None, None));
    }
    match comm.register_buffer(buffer.ptr(), buffer.bytes()) {
        Ok(()) => Ok((Some(buffer), None)),
        Err(e) if e.breaks_communicator() => Err((e, Some(buffer))),
        Err(e) => match comm.deregister_buffers() {
            Ok(_) => {
                unusable(format!("registering it failed: {e}; released"));
                Ok((None, None))
            }
            Err(again) => {
                unusable(format!(
                    "registering it failed: {e}; releasing the registrations failed too ({again}), so its \
                     {bytes} bytes stay allocated until the communicator is closed"
                ));
                Ok((None, Some(buffer)))
            }
        },
    }
}

fn parse_id(py: Python<'_>, id: &Bound<'_, PyAny>) -> PyResult<Id> {
    if let Ok(i) = id.cast::<PyId>() {
        Ok(i.get().id.clone())
    } else if let Ok(s) = id.extract::<String>() {
        s.parse::<Id>().py(py)
    } else {
        Err(invalid(py, "id must be a tp_allreduce Id or its string"))
    }
}

fn parse_algorithm(py: Python<'_>, algorithm: Option<&str>) -> PyResult<Option<Algorithm>> {
    match algorithm.map(str::trim) {
        None | Some("") | Some("auto") => Ok(None),
        Some(name) => name.parse::<Algorithm>().py(py).map(Some),
    }
}

/// A rank's local setup, before it joins the others: the driver, a context
/// and a stream on `device`, the configuration (`TP_ALLREDUCE_*`, with
/// `algorithm` forced when given). `join` then makes the communicator
/// (once). `Communicator(...)` does both; launchers that can tell the
/// other ranks about a failure (`tp_allreduce.torch.Communicator.from_group`
/// does, through the process group) run this step on every rank first, so
/// that no rank waits in the rendezvous for one that already failed.
#[pyclass(name = "PreparedRank", module = "tp_allreduce._core")]
pub struct PyPreparedRank {
    prepared: Mutex<Option<Prepared>>,
    ordinal: usize,
}

#[pymethods]
impl PyPreparedRank {
    #[new]
    #[pyo3(signature = (device, *, algorithm=None, batch_invariant=false))]
    fn new(py: Python<'_>, device: usize, algorithm: Option<&str>, batch_invariant: bool) -> PyResult<PyPreparedRank> {
        let algorithm = parse_algorithm(py, algorithm)?;
        let prepared = py.detach(move || Prepared::new(device, algorithm, batch_invariant)).py(py)?;
        Ok(PyPreparedRank { prepared: Mutex::new(Some(prepared)), ordinal: device })
    }

    /// The CUDA device ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.ordinal
    }

    /// Joins rank `rank` of `world_size` through `id` (collective, as
    /// `Communicator(...)`). A prepared rank joins once.
    #[pyo3(signature = (rank, world_size, id, *, capture_copy_bytes=DEFAULT_CAPTURE_COPY_BYTES))]
    fn join(
        &self,
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        id: &Bound<'_, PyAny>,
        capture_copy_bytes: usize,
    ) -> PyResult<PyCommunicator> {
        let id = parse_id(py, id)?;
        let prepared = self
            .prepared
            .lock()
            .map_err(|_| to_py_err(py, Error::Broken("state lock poisoned".into())))?
            .take()
            .ok_or_else(|| invalid(py, "this PreparedRank already joined (prepare a new one)"))?;
        PyCommunicator::join(py, prepared, (rank, world_size, id), self.ordinal, capture_copy_bytes)
    }

    fn __repr__(&self) -> String {
        let used = self.prepared.lock().map(|g| g.is_none()).unwrap_or(true);
        format!("PreparedRank(device={}{})", self.ordinal, if used { ", joined" } else { "" })
    }
}

/// One rank of a communicator (collective constructor).
#[pyclass(name = "Communicator", module = "tp_allreduce._core")]
pub struct PyCommunicator {
    inner: Mutex<Option<Arc<Inner>>>,
    rank: usize,
    world: usize,
    ordinal: usize,
}

impl PyCommunicator {
    fn live(&self, py: Python<'_>) -> PyResult<Arc<Inner>> {
        let guard = self.inner.lock().map_err(|_| to_py_err(py, Error::Broken("state lock poisoned".into())))?;
        guard.clone().ok_or_else(|| invalid(py, "the communicator is closed"))
    }

    /// Runs `f` on the live communicator without the GIL, its context
    /// current for the call (the caller's restored after).
    fn on_device<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&Inner) -> Result<R, Error> + Send) -> PyResult<R> {
        let inner = self.live(py)?;
        py.detach(move || {
            let _restore = CurrentContext::save();
            device::bind(&inner.ctx)?;
            f(&inner)
        })
        .py(py)
    }

    fn join(
        py: Python<'_>,
        prepared: Prepared,
        (rank, world, id): (usize, usize, Id),
        ordinal: usize,
        capture_copy_bytes: usize,
    ) -> PyResult<PyCommunicator> {
        let owned = (rank == 0).then(|| id.clone());
        let inner = py.detach(move || Inner::join(prepared, rank, world, id, capture_copy_bytes)).py(py);
        match inner {
            Ok(inner) => Ok(PyCommunicator { inner: Mutex::new(Some(Arc::new(inner))), rank, world, ordinal }),
            Err(e) => {
                if let Some(id) = owned {
                    remove_id_files_of_rank_0(rank, &id);
                }
                Err(e)
            }
        }
    }
}

/// Rank 0 owns a Unix id's private directory (`Id.new_unix` created it and
/// rank 0's rendezvous removes it once every rank joined): when rank 0's
/// construction fails, nobody else would remove it, so it goes now (a
/// no-op for TCP ids and when the rendezvous already removed it). The
/// other ranks then fail to reach rank 0, as they would anyway.
fn remove_id_files_of_rank_0(rank: usize, id: &Id) {
    if rank == 0 {
        id.remove_files();
    }
}

#[pymethods]
impl PyCommunicator {
    /// Joins rank `rank` of `world_size` through `id` (an `Id` or its
    /// string) on CUDA device `device` (an ordinal of this process). Every
    /// rank must call it; it returns once all joined (bounded by the
    /// rendezvous timeout). `algorithm` forces one algorithm for every call
    /// (`None` or `"auto"`: the library's selection); `capture_copy_bytes`
    /// sizes the buffer that lets graphs capture calls on memory CUDA IPC
    /// cannot export (0 disables it). The same as
    /// `PreparedRank(device, algorithm=...).join(rank, world_size, id, ...)`.
    #[new]
    #[pyo3(signature = (rank, world_size, id, device, *, algorithm=None, capture_copy_bytes=DEFAULT_CAPTURE_COPY_BYTES, batch_invariant=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        id: &Bound<'_, PyAny>,
        device: usize,
        algorithm: Option<&str>,
        capture_copy_bytes: usize,
        batch_invariant: bool,
    ) -> PyResult<PyCommunicator> {
        let id = parse_id(py, id)?;
        let prepared = parse_algorithm(py, algorithm)
            .and_then(|algorithm| py.detach(move || Prepared::new(device, algorithm, batch_invariant)).py(py));
        match prepared {
            Ok(prepared) => PyCommunicator::join(py, prepared, (rank, world_size, id), device, capture_copy_bytes),
            Err(e) => {
                remove_id_files_of_rank_0(rank, &id);
                Err(e)
            }
        }
    }

    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.world
    }

    /// The CUDA device ordinal the communicator runs on.
    #[getter]
    fn device(&self) -> usize {
        self.ordinal
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.lock().map(|g| g.is_none()).unwrap_or(true)
    }

    /// The transport chosen at init (`p2p` or `host-staged`) and why.
    #[getter]
    fn transport(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.live(py)?.comm.transport().to_string())
    }

    #[getter]
    fn transport_reason(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.live(py)?.comm.transport_reason().to_string())
    }

    /// What init decided and why (tuning table, NCCL, topology).
    #[getter]
    fn notes(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        Ok(self.live(py)?.comm.notes().to_vec())
    }

    /// Bytes of the capture-copy buffer (0: none).
    #[getter]
    fn capture_copy_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.live(py)?.copy_buffer.as_ref().map_or(0, DeviceBuffer::bytes))
    }

    /// Captured calls (chunks) that went through the capture copy.
    #[getter]
    fn captured_copies(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.live(py)?.captured_copies.load(Ordering::Relaxed))
    }

    /// Distinct captured inputs waiting for `register_graph_buffers`.
    #[getter]
    fn pending_graph_buffers(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.live(py)?.comm.pending_graph_buffers())
    }

    /// What a call of `nbytes` would do: `(algorithm, transport, reason)`.
    #[pyo3(signature = (nbytes, dtype, capturing=false, in_place=false))]
    fn plan(
        &self,
        py: Python<'_>,
        nbytes: usize,
        dtype: u32,
        capturing: bool,
        in_place: bool,
    ) -> PyResult<(String, String, String)> {
        let dtype = dtype_from_code(py, dtype)?;
        let p = self.live(py)?.comm.plan_call(nbytes, dtype, capturing, in_place);
        Ok((p.algorithm.to_string(), p.transport.to_string(), p.reason))
    }

    /// What an all-gather (`collective` `"all-gather"`, `block_bytes` the
    /// send of one rank) or reduce-scatter (`"reduce-scatter"`, the receive
    /// of one rank) would run: `(algorithm, reason)`; `"nccl"` where NCCL's
    /// ring is predicted or measured faster, or where none of ours runs.
    #[pyo3(signature = (collective, block_bytes, capturing=false))]
    fn plan_collective(
        &self,
        py: Python<'_>,
        collective: &str,
        block_bytes: usize,
        capturing: bool,
    ) -> PyResult<(String, String)> {
        let collective = match collective {
            "all-gather" => Collective::AllGather,
            "reduce-scatter" => Collective::ReduceScatter,
            other => {
                return Err(invalid(py, format!("plan_collective: `{other}` is not `all-gather` or `reduce-scatter`")))
            }
        };
        let p = self.live(py)?.comm.plan_collective(collective, block_bytes, capturing);
        Ok((p.algorithm.to_string(), p.reason))
    }

    /// Allreduce (sum) of `count` elements of `dtype` (a dtype code) from
    /// device pointer `send_ptr` into `recv_ptr` (equal for in place),
    /// queued on the stream `stream_ptr` (0: the legacy default stream).
    /// Collective: every rank issues the same calls in the same order.
    /// Pointers must be device memory of the communicator's device (checked)
    /// and stay valid until the stream's work completes; the stream handle
    /// must be a live stream of that device (not checkable: a made-up handle
    /// is undefined behaviour, as in every CUDA API).
    fn all_reduce(
        &self,
        py: Python<'_>,
        send_ptr: u64,
        recv_ptr: u64,
        count: usize,
        dtype: u32,
        stream_ptr: u64,
    ) -> PyResult<()> {
        let dtype = check_call_args(py, send_ptr, recv_ptr, count, dtype)?;
        let inner = self.live(py)?;
        py.detach(move || {
            let _restore = CurrentContext::save();
            // SAFETY: the raw API's contract, documented above and passed on
            // to the caller; the pointers are range-checked by the library.
            unsafe { inner.all_reduce(send_ptr, recv_ptr, count, dtype, stream_ptr as usize as sys::CUstream) }
        })
        .py(py)
    }

    /// Allreduce (sum) of `input_ptr` (`rows x hidden` elements of dtype
    /// code `dtype`), plus the residual, then RMSNorm, on the stream
    /// `stream_ptr`: `residual_ptr` becomes sum + residual, `normed_ptr`
    /// its RMSNorm scaled by the weight (`hidden` elements at `weight_ptr`;
    /// `1 + weight` with `weight_offset`, as Gemma). `normed_ptr` may equal
    /// `input_ptr`. `unfused` runs our allreduce, then the separate kernel.
    /// The residual and weight must be the same on every rank (the fused
    /// two-shot push and hierarchical kernels add the row owner's for
    /// every rank). Collective, capturable; pointers as for `all_reduce`.
    #[pyo3(signature = (input_ptr, residual_ptr, weight_ptr, normed_ptr, rows, hidden, eps, dtype, stream_ptr, *, weight_offset=false, unfused=false))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_add_rms_norm(
        &self,
        py: Python<'_>,
        input_ptr: u64,
        residual_ptr: u64,
        weight_ptr: u64,
        normed_ptr: u64,
        rows: usize,
        hidden: usize,
        eps: f32,
        dtype: u32,
        stream_ptr: u64,
        weight_offset: bool,
        unfused: bool,
    ) -> PyResult<()> {
        let dtype = dtype_from_code(py, dtype)?;
        let opts = FusedOptions { weight_offset, unfused, ..FusedOptions::default() };
        self.on_device(py, move |inner| {
            let stream = stream_ptr as usize as sys::CUstream;
            // SAFETY: the raw API's contract (as `all_reduce`); the library
            // checks the pointers' extents, alignment and overlaps.
            unsafe {
                inner.comm.all_reduce_add_rms_norm_raw(
                    input_ptr,
                    residual_ptr,
                    weight_ptr,
                    normed_ptr,
                    rows,
                    hidden,
                    eps,
                    dtype,
                    &opts,
                    stream,
                )
            }
        })
    }

    /// Allreduce (sum) of `input_ptr` (`rows x hidden`) added into
    /// `residual_ptr` (no normalisation). `input_ptr` is consumed (the
    /// unfused path reduces it in place).
    #[pyo3(signature = (input_ptr, residual_ptr, rows, hidden, dtype, stream_ptr))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_add(
        &self,
        py: Python<'_>,
        input_ptr: u64,
        residual_ptr: u64,
        rows: usize,
        hidden: usize,
        dtype: u32,
        stream_ptr: u64,
    ) -> PyResult<()> {
        let dtype = dtype_from_code(py, dtype)?;
        self.on_device(py, move |inner| {
            let stream = stream_ptr as usize as sys::CUstream;
            let opts = FusedOptions::default();
            // SAFETY: as `all_reduce_add_rms_norm`.
            unsafe { inner.comm.all_reduce_add_raw(input_ptr, residual_ptr, rows, hidden, dtype, &opts, stream) }
        })
    }

    /// All-gather of `count` elements a rank from `send_ptr` into
    /// `recv_ptr` (`world_size x count`, rank r's block at `r x count`) on
    /// the stream `stream_ptr`. `send_ptr` may be block `rank` of
    /// `recv_ptr` (in place). Pointers as for `all_reduce`.
    fn all_gather(
        &self,
        py: Python<'_>,
        send_ptr: u64,
        recv_ptr: u64,
        count: usize,
        dtype: u32,
        stream_ptr: u64,
    ) -> PyResult<()> {
        let dtype = check_call_args(py, send_ptr, recv_ptr, count, dtype)?;
        self.on_device(py, move |inner| {
            // SAFETY: as `all_reduce`; the library checks both ranges.
            unsafe { inner.comm.all_gather_raw(send_ptr, recv_ptr, count, dtype, stream_ptr as usize as sys::CUstream) }
        })
    }

    /// Reduce-scatter (sum): `send_ptr` holds `world_size x count`
    /// elements, `recv_ptr` receives the sum over ranks of block `rank`
    /// (`count` elements) on the stream `stream_ptr`. `recv_ptr` may be
    /// block `rank` of `send_ptr` (in place). Pointers as for `all_reduce`.
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send_ptr: u64,
        recv_ptr: u64,
        count: usize,
        dtype: u32,
        stream_ptr: u64,
    ) -> PyResult<()> {
        let dtype = check_call_args(py, send_ptr, recv_ptr, count, dtype)?;
        self.on_device(py, move |inner| {
            // SAFETY: as `all_gather`.
            unsafe {
                inner.comm.reduce_scatter_raw(send_ptr, recv_ptr, count, dtype, stream_ptr as usize as sys::CUstream)
            }
        })
    }

    /// What a fused call of `rows x hidden` would do:
    /// `(algorithm, transport, fused, reason)`.
    #[pyo3(signature = (rows, hidden, dtype, capturing=false))]
    fn plan_fused(
        &self,
        py: Python<'_>,
        rows: usize,
        hidden: usize,
        dtype: u32,
        capturing: bool,
    ) -> PyResult<(String, String, bool, String)> {
        let dtype = dtype_from_code(py, dtype)?;
        let p = self.live(py)?.comm.plan_fused(rows, hidden, dtype, capturing);
        Ok((p.algorithm.to_string(), p.transport.to_string(), p.fused, p.reason))
    }

    /// Collective, after capturing the same graph on every rank: registers
    /// the captured inputs so replays read them in place. Returns how many
    /// distinct inputs were registered.
    fn register_graph_buffers(&self, py: Python<'_>) -> PyResult<usize> {
        let inner = self.live(py)?;
        py.detach(move || {
            let _restore = CurrentContext::save();
            inner.register_graph_buffers()
        })
        .py(py)
    }

    /// Collective: releases every registration (graphs captured before can
    /// no longer be replayed). Waits for all work on the device.
    fn deregister_buffers(&self, py: Python<'_>) -> PyResult<usize> {
        let inner = self.live(py)?;
        py.detach(move || {
            let _restore = CurrentContext::save();
            inner.deregister_buffers()
        })
        .py(py)
    }

    /// Makes `ptr..ptr+nbytes` readable by peers' pull kernels without a
    /// staging copy (collective; keep it allocated until
    /// `deregister_buffers` or `close` on every rank).
    fn register_buffer(&self, py: Python<'_>, ptr: u64, nbytes: usize) -> PyResult<()> {
        self.on_device(py, move |inner| inner.comm.register_buffer(ptr, nbytes))
    }

    /// Waits for `stream_ptr` (or the communicator's own stream when
    /// `None`), then raises if a kernel recorded an error (timeout, peer
    /// abort).
    #[pyo3(signature = (stream_ptr=None))]
    fn synchronize(&self, py: Python<'_>, stream_ptr: Option<u64>) -> PyResult<()> {
        let inner = self.live(py)?;
        py.detach(move || {
            let _restore = CurrentContext::save();
            inner.synchronize(stream_ptr)
        })
        .py(py)
    }

    /// Raises if a kernel recorded an error (no synchronisation).
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.live(py)?;
        inner.comm.check().py(py)
    }

    /// Every rank's `data`, in rank order (collective; small messages).
    fn all_gather_bytes<'py>(&self, py: Python<'py>, data: Vec<u8>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let inner = self.live(py)?;
        let all = py.detach(move || inner.comm.all_gather_bytes(&data)).py(py)?;
        Ok(all.iter().map(|b| PyBytes::new(py, b)).collect())
    }

    /// Collective teardown: waits for all work on the device, meets the
    /// other ranks (bounded), then releases the communicator. Raises what
    /// went wrong (a device error, a rank that did not arrive); the
    /// communicator is released either way. Call it on every rank; graphs
    /// captured with it must not be replayed afterwards. Closing twice is a
    /// no-op. The GIL is released while it waits.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let taken = self.inner.lock().map(|mut g| g.take()).unwrap_or(None);
        match taken {
            Some(inner) => py.detach(move || release(inner)).py(py),
            None => Ok(()),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "Communicator(rank={}, world_size={}, device={}{})",
            self.rank,
            self.world,
            self.ordinal,
            if self.closed() { ", closed" } else { "" }
        )
    }
}

impl Drop for PyCommunicator {
    /// Runs from the object's deallocation, which holds the GIL. Dropping
    /// the communicator waits for the device and meets the peers in the
    /// teardown barriers (each bounded by 10 s): that runs with the GIL
    /// released, so every other Python thread keeps running. Not while the
    /// interpreter finalizes: then no other Python thread runs any more,
    /// and a thread that released the GIL may not get it back (CPython ends
    /// or blocks such threads). Errors are ignored here; `close()` reports
    /// them. No call can be running (it would hold a reference to this
    /// object), so this is the last holder of the communicator.
    fn drop(&mut self) {
        let Some(inner) = self.inner.get_mut().ok().and_then(Option::take) else { return };
        let mut inner = Some(inner);
        let _ = Python::try_attach(|py| {
            if !interpreter_finalizing(py) {
                let inner = inner.take();
                py.detach(move || drop_inner(inner));
            }
        });
        drop_inner(inner);
    }
}

/// Drops the communicator (its teardown: `Drop for Comm`), then the
/// buffers peers may have mapped, with the caller's current context kept.
fn drop_inner(inner: Option<Arc<Inner>>) {
    let _restore = CurrentContext::save();
    drop(inner);
}

/// Whether the interpreter is finalizing (`sys.is_finalizing()`; any
/// failure to ask counts as yes). An exception already being raised when
/// the object is deallocated is kept as it was.
fn interpreter_finalizing(py: Python<'_>) -> bool {
    let pending = PyErr::take(py);
    let finalizing = py
        .import("sys")
        .and_then(|sys| sys.call_method0("is_finalizing"))
        .and_then(|answer| answer.is_truthy())
        .unwrap_or(true);
    if let Some(e) = pending {
        e.restore(py);
    }
    finalizing
}

/// The collective teardown that reports its errors (`Comm::close`), then
/// the buffers peers may have mapped: after the teardown's second barrier
/// no peer maps them any more.
/// A call still running on another thread holds the communicator too: wait
/// for it (calls are bounded by the library's timeouts); if it is still
/// running after that, the communicator is released when it returns.
fn release(inner: Arc<Inner>) -> Result<(), Error> {
    let config = inner.comm.config();
    let bound = config.rendezvous_timeout + config.launch_timeout;
    let deadline = Instant::now() + bound;
    let mut inner = inner;
    let inner = loop {
        match Arc::try_unwrap(inner) {
            Ok(only) => break only,
            Err(shared) if Instant::now() >= deadline => {
                drop(shared);
                return Err(Error::InvalidUsage(format!(
                    "close: another thread was still in a call on this communicator after {} s; the communicator \
                     is released when that call returns",
                    bound.as_secs()
                )));
            }
            Err(shared) => {
                inner = shared;
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    };
    let _restore = CurrentContext::save();
    let Inner { comm, copy_buffer, parked, .. } = inner;
    let closed = comm.close();
    drop(copy_buffer);
    drop(parked);
    closed
}
