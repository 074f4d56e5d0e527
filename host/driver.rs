//! Every CUDA driver call of the library goes through this module: one
//! checked wrapper (`cu!`), device queries that need no context, the
//! current-context guard, RAII owners for the memory the library allocates
//! or maps (`driver/memory.rs`), and kernel-module loading and launch
//! (`driver/module.rs`: every launch checks its arguments against the
//! parameters the entry's PTX declares).
//! No other module of the library calls the driver directly. `unsafe` is
//! confined to this module, `nccl`, `comm::call` (the raw entry points and
//! the call pipeline's launches) and `comm::shm` (libc); every other module
//! file says `#![forbid(unsafe_code)]`.
//!
//! # The current context
//! The driver keeps one *current context* per thread, and so does every
//! caller that mixes this library with the CUDA runtime (PyTorch, candle):
//! changing it behind the caller's back silently moves their later work to
//! another GPU. So the library never leaves a context bound: every public
//! entry point and every helper that needs one holds a [`CurrentContext`]
//! guard, which binds the context it needs and restores the caller's on
//! drop (also on error paths). Devices are identified with `cuDeviceGet` /
//! `cuDeviceGetUuid` and peer access is enabled between existing contexts,
//! so init creates no context on any GPU.
//!
//! The driver is loaded at run time (cudarc's dynamic loading), so the crate
//! builds and its CPU tests run on machines without CUDA; [`driver_available`]
//! probes for it without panicking.

#![allow(unsafe_code)]

pub mod copy_engine;
#[cfg(feature = "internals")]
pub mod elementwise;
mod memory;
mod module;
pub mod vmm;

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaContext};

use crate::error::{Error, Result};

pub use memory::{
    allocation_range, buffer_id, ipc_export, is_pool_memory, memory_location, pointer_context, DeviceMemory,
    HostRegistration, IpcMapping, MemoryLocation, PinnedHostMemory,
};
pub use module::{entry_signatures, launch, launch_by_value, Kernel, KernelArgs, KernelModule, ParamStruct, Signature};

/// Turns a driver status into a `Result`, naming the call.
pub(crate) fn check(call: &'static str, status: sys::CUresult) -> Result<()> {
    if status == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let e = cudarc::driver::DriverError(status);
    let message = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    Err(Error::Driver { call, code: format!("{status:?}"), message })
}

/// `cu!(cuFoo(a, b))` calls `sys::cuFoo(a, b)` and checks the status.
macro_rules! cu {
    ($call:ident ( $($arg:expr),* $(,)? )) => {
        // SAFETY: the caller of `cu!` upholds the driver call's contract
        // (valid handles and pointers); see the enclosing function.
        $crate::driver::check(stringify!($call), unsafe { cudarc::driver::sys::$call($($arg),*) })
    };
}
pub(crate) use cu;

/// Whether a CUDA driver can be loaded and initialised. Never panics.
pub fn driver_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        // Candle builds link libcuda (cudarc `dynamic-linking`): no probe.
        #[cfg(not(feature = "candle"))]
        // SAFETY: only tries to dlopen candidate library names.
        if !unsafe { sys::is_culib_present() } {
            return false;
        }
        std::panic::catch_unwind(|| cudarc::driver::result::init().is_ok()).unwrap_or(false)
    })
}

/// `Ok(())` when the driver is usable, else `Error::NoDriver`.
pub fn require_driver() -> Result<()> {
    if driver_available() {
        Ok(())
    } else {
        Err(Error::NoDriver("libcuda could not be loaded or cuInit failed (no NVIDIA driver or no GPU visible)".into()))
    }
}

/// Number of CUDA devices, 0 without a driver.
pub fn device_count() -> usize {
    if !driver_available() {
        return 0;
    }
    CudaContext::device_count().map(|n| n.max(0) as usize).unwrap_or(0)
}

/// Binds `ctx` to the calling thread and leaves it bound (the CLI tools'
/// helper for threads they own). The library itself uses
/// [`CurrentContext::bind`], which restores the caller's context.
pub fn bind(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread().map_err(|e| crate::error::driver("cuCtxSetCurrent", e))
}

/// The calling thread's current context (null when none is bound).
pub fn current_context() -> Result<sys::CUcontext> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    cu!(cuCtxGetCurrent(&mut ctx))?;
    Ok(ctx)
}

/// Binds a context to the calling thread for the guard's lifetime: created
/// with the context a call needs, it saves the thread's current context
/// (`cuCtxGetCurrent`) and sets it back on drop (`cuCtxSetCurrent`, null
/// included), so a library call never changes the caller's current context,
/// whichever path it returns by. Guards nest (inner ones restore first) and
/// stay on the thread that created them (not `Send`).
#[must_use = "the context is restored when the guard is dropped"]
pub struct CurrentContext {
    previous: sys::CUcontext,
    _not_send: PhantomData<*const ()>,
}

impl CurrentContext {
    /// Makes `ctx` current until the guard is dropped.
    pub fn bind(ctx: &CudaContext) -> Result<CurrentContext> {
        Self::bind_raw(ctx.cu_ctx())
    }

    fn bind_raw(ctx: sys::CUcontext) -> Result<CurrentContext> {
        let previous = current_context()?;
        if previous != ctx {
            cu!(cuCtxSetCurrent(ctx))?;
        }
        Ok(CurrentContext { previous, _not_send: PhantomData })
    }

    /// Saves the current context without changing it; the drop restores it
    /// (for code that calls something which may bind another, e.g. a drop).
    pub fn keep() -> Result<CurrentContext> {
        let previous = current_context()?;
        Ok(CurrentContext { previous, _not_send: PhantomData })
    }
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        // Cheap when nothing changed in between (one thread-local read).
        if current_context().ok() != Some(self.previous) {
            // SAFETY: `previous` was current on this thread when the guard was
            // made (or null); callers keep their contexts alive across calls.
            let _ = unsafe { sys::cuCtxSetCurrent(self.previous) };
        }
    }
}

/// Restores, when dropped, the context that was current when
/// [`save`](Self::save) was last called; does nothing if it never was. For
/// owners whose fields bind contexts while they are dropped (cudarc's
/// stream and context drops bind theirs): declared as the owner's *last*
/// field, it is dropped after all of them.
#[derive(Default)]
pub struct RestoreOnDrop {
    saved: Option<usize>,
}

impl RestoreOnDrop {
    /// Remembers the calling thread's current context.
    pub fn save(&mut self) {
        self.saved = current_context().ok().map(|c| c as usize);
    }
}

impl Drop for RestoreOnDrop {
    fn drop(&mut self) {
        if let Some(ctx) = self.saved {
            // SAFETY: the context was current on this thread in `save` (or
            // null); the owner's drop runs on the same thread.
            let _ = unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) };
        }
    }
}

pub(crate) fn device_attribute(ctx: &CudaContext, attr: sys::CUdevice_attribute) -> Result<i32> {
    ctx.attribute(attr).map_err(|e| crate::error::driver("cuDeviceGetAttribute", e))
}

/// The SMs kernels of `ctx` may run on: the device's, or fewer where the
/// context is limited (an MPS client with
/// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` or an execution-affinity context:
/// `cuCtxGetExecAffinity`). Residency caps are computed from it: a cap
/// taken from the whole device would let a launch's blocks wait for blocks
/// that never fit. A driver without the query gives the device's count.
/// (Green contexts are not seen: cudarc 0.19 wraps primary contexts only.)
pub(crate) fn context_sm_count(ctx: &CudaContext) -> Result<u32> {
    let device = device_attribute(ctx, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32;
    bind(ctx)?;
    // cudarc's dynamic loading panics on a missing symbol (drivers before
    // CUDA 11.4): treat that as "not limited".
    let limited = std::panic::catch_unwind(|| {
        // SAFETY: a zeroed parameter block is a valid out-parameter; the
        // context is current (bound above).
        let mut param: sys::CUexecAffinityParam = unsafe { std::mem::zeroed() };
        let r = unsafe {
            sys::cuCtxGetExecAffinity(&mut param, sys::CUexecAffinityType::CU_EXEC_AFFINITY_TYPE_SM_COUNT)
        };
        // SAFETY: the union's only member, zeroed above and filled by the
        // driver on success.
        let sms = unsafe { param.param.smCount.val };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(sms)
    })
    .ok()
    .flatten();
    Ok(match limited {
        Some(n) if n > 0 => n.min(device),
        _ => device,
    })
}

/// Waits for all work of the current context (every stream).
pub fn context_synchronize() -> Result<()> {
    cu!(cuCtxSynchronize())
}

/// The context of a stream.
///
/// # Safety
/// `stream` must be a live stream handle of this process (or null).
pub unsafe fn stream_context(stream: sys::CUstream) -> Result<sys::CUcontext> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    cu!(cuStreamGetCtx(stream, &mut ctx))?;
    Ok(ctx)
}

/// The stream's identity for the life of the process (`cuStreamGetId`): a
/// handle's address may be reused by a stream created after it was
/// destroyed, an id never is.
///
/// # Safety
/// `stream` must be a live stream handle of this process (or null) that is
/// not capturing: on a capturing stream the query invalidates the capture
/// (seen on an H200, CUDA 13.0 driver).
pub unsafe fn stream_id(stream: sys::CUstream) -> Result<u64> {
    let mut id: std::ffi::c_ulonglong = 0;
    cu!(cuStreamGetId(stream, &mut id))?;
    Ok(id)
}

/// Whether `stream` is capturing into a graph right now.
///
/// # Safety
/// `stream` must be a live stream handle of this process (or null).
pub unsafe fn is_capturing(stream: sys::CUstream) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    cu!(cuStreamIsCapturing(stream, &mut status))?;
    match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(false),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Ok(true),
        _ => Err(Error::invalid(
            "the stream's graph capture was invalidated by an earlier error; end the capture and retry",
        )),
    }
}

/// The synchronous helpers below queue their work on the legacy default
/// stream of the current context and wait for that stream only. Waiting
/// matters: `cuMemset*` on device memory and pageable `cuMemcpyHtoD` may
/// return before the memory is written, and the library's streams (like
/// cudarc's) are non-blocking, so nothing else would order the write before
/// kernels on them. Waiting for the whole context instead could block on
/// another in-process rank's collective that waits for this thread.
const LEGACY_STREAM: sys::CUstream = std::ptr::null_mut();

/// Copies `src` to device memory; returns once it is there.
pub fn memcpy_htod(dst: sys::CUdeviceptr, src: &[u8]) -> Result<()> {
    cu!(cuMemcpyHtoDAsync_v2(dst, src.as_ptr() as *const c_void, src.len(), LEGACY_STREAM))?;
    cu!(cuStreamSynchronize(LEGACY_STREAM))
}

/// Writes `value` to the u32 at `dst` now, on `stream` (a non-blocking
/// stream of `dst`'s context, so the write is not queued behind kernels on
/// the legacy stream or the caller's streams), and waits for it.
pub fn write_u32_now(stream: &cudarc::driver::CudaStream, dst: sys::CUdeviceptr, value: u32) -> Result<()> {
    let _bound = CurrentContext::bind(stream.context())?;
    let bytes = value.to_ne_bytes();
    cu!(cuMemcpyHtoDAsync_v2(dst, bytes.as_ptr() as *const c_void, bytes.len(), stream.cu_stream()))?;
    cu!(cuStreamSynchronize(stream.cu_stream()))
}

/// Copies device memory to `dst` (synchronous for pageable memory; like
/// every copy it is not ordered after work on non-blocking streams, so
/// synchronise the producing stream first).
pub fn memcpy_dtoh(dst: &mut [u8], src: sys::CUdeviceptr) -> Result<()> {
    cu!(cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len()))
}

/// # Safety
/// `stream` must be a live stream handle of the current context; `dst` and
/// `src` valid for `bytes` until the copy runs.
pub unsafe fn memcpy_dtod_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    cu!(cuMemcpyDtoDAsync_v2(dst, src, bytes, stream))
}

/// Fills device memory; returns once it is written.
pub fn memset_d8(dst: sys::CUdeviceptr, value: u8, bytes: usize) -> Result<()> {
    cu!(cuMemsetD8Async(dst, value, bytes, LEGACY_STREAM))?;
    cu!(cuStreamSynchronize(LEGACY_STREAM))
}

/// # Safety
/// `stream` must be a live stream handle of the current context; `dst`
/// valid for `bytes` until the memset runs.
pub unsafe fn memset_d8_async(dst: sys::CUdeviceptr, value: u8, bytes: usize, stream: sys::CUstream) -> Result<()> {
    cu!(cuMemsetD8Async(dst, value, bytes, stream))
}

/// Waits for all work queued on `stream`.
pub fn synchronize(stream: &cudarc::driver::CudaStream) -> Result<()> {
    let _bound = CurrentContext::bind(stream.context())?;
    cu!(cuStreamSynchronize(stream.cu_stream()))
}

/// Captures the work `body` queues on `stream` into a graph. The capture is
/// always ended, also when `body` fails (its error is returned then), so the
/// stream never stays in capture mode.
pub fn capture(
    stream: &Arc<cudarc::driver::CudaStream>,
    mode: sys::CUstreamCaptureMode,
    body: impl FnOnce() -> Result<()>,
) -> Result<cudarc::driver::CudaGraph> {
    stream.begin_capture(mode).map_err(|e| crate::error::driver("cuStreamBeginCapture", e))?;
    let captured = body();
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(|e| crate::error::driver("cuStreamEndCapture", e))?;
    captured?;
    graph.ok_or_else(|| Error::InvalidUsage("empty capture".into()))
}

/// `cuDriverGetVersion`: the CUDA version of the installed driver
/// (13000 = 13.0).
pub fn driver_version() -> Result<i32> {
    let mut version = 0i32;
    cu!(cuDriverGetVersion(&mut version))?;
    Ok(version)
}

/// Waits for all work queued on a raw stream handle.
///
/// # Safety
/// `stream` must be a live stream handle of this process (or null).
pub unsafe fn stream_synchronize(stream: sys::CUstream) -> Result<()> {
    cu!(cuStreamSynchronize(stream))
}

/// Copies a `#[repr(C)]` value to device memory (synchronously).
pub fn write_struct<T: Copy>(dst: sys::CUdeviceptr, value: &T) -> Result<()> {
    // SAFETY: `T: Copy` and `#[repr(C)]` by the callers' contract; we only
    // read its bytes.
    let bytes = unsafe { std::slice::from_raw_parts(value as *const T as *const u8, std::mem::size_of::<T>()) };
    memcpy_htod(dst, bytes)
}

/// Reads a `#[repr(C)]` plain-old-data value from device memory.
pub fn read_struct<T: Copy + Default>(src: sys::CUdeviceptr) -> Result<T> {
    let mut value = T::default();
    // SAFETY: `T` is plain old data; every bit pattern the device wrote is a
    // valid `T` for the callers' types (integers only).
    let bytes = unsafe { std::slice::from_raw_parts_mut(&mut value as *mut T as *mut u8, std::mem::size_of::<T>()) };
    memcpy_dtoh(bytes, src)?;
    Ok(value)
}

// ---------------------------------------------------------------- devices (no context needed)

/// The device handle of CUDA ordinal `ordinal` (`cuDeviceGet`).
pub fn device(ordinal: usize) -> Result<sys::CUdevice> {
    let mut dev: sys::CUdevice = 0;
    cu!(cuDeviceGet(&mut dev, ordinal as i32))?;
    Ok(dev)
}

/// The device's UUID as 32 lowercase hex digits (`cuDeviceGetUuid`).
pub fn device_uuid(dev: sys::CUdevice) -> Result<String> {
    let uuid = cudarc::driver::result::device::get_uuid(dev).map_err(|e| crate::error::driver("cuDeviceGetUuid", e))?;
    Ok(uuid.bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect())
}

/// The ordinal of the visible device with this UUID (as [`device_uuid`]
/// writes it), if this process sees it. Creates no context.
pub fn ordinal_with_uuid(uuid: &str) -> Result<Option<usize>> {
    for ordinal in 0..device_count() {
        if device_uuid(device(ordinal)?)? == uuid {
            return Ok(Some(ordinal));
        }
    }
    Ok(None)
}

/// The device's PCI bus id as the driver writes it (`0000:1A:00.0`).
pub fn pci_bus_id(dev: sys::CUdevice) -> Result<String> {
    let mut buf = [0 as std::ffi::c_char; 32];
    cu!(cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32 - 1, dev))?;
    // SAFETY: the driver wrote a NUL-terminated string of at most 31 bytes
    // into `buf`, whose last byte stays NUL.
    Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

/// What the driver reports about one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub name: String,
    pub compute_capability: (u32, u32),
    pub pci_bus_id: String,
    pub memory_bytes: u64,
}

/// Name, compute capability, PCI bus id and memory of `dev`.
pub fn device_info(dev: sys::CUdevice) -> Result<DeviceInfo> {
    use cudarc::driver::result::device as d;
    let name = d::get_name(dev).unwrap_or_else(|_| "unknown NVIDIA GPU".into());
    let attribute = |a| {
        // SAFETY: `dev` is a device handle from cuDeviceGet.
        unsafe { d::get_attribute(dev, a) }.map(|v| v.max(0) as u32).unwrap_or(0)
    };
    let major = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    let minor = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    // SAFETY: as above.
    let memory_bytes = unsafe { d::total_mem(dev) }.unwrap_or(0) as u64;
    Ok(DeviceInfo { name, compute_capability: (major, minor), pci_bus_id: pci_bus_id(dev)?, memory_bytes })
}

/// Whether `dev` can access memory of `peer` (`cuDeviceCanAccessPeer`).
pub fn can_access_peer(dev: sys::CUdevice, peer: sys::CUdevice) -> Result<bool> {
    let mut can: i32 = 0;
    cu!(cuDeviceCanAccessPeer(&mut can, dev, peer))?;
    Ok(can != 0)
}

/// `CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED` for the pair, `None` when the
/// driver does not know the attribute (old drivers).
pub fn p2p_access_supported(dev: sys::CUdevice, peer: sys::CUdevice) -> Option<bool> {
    let mut supported: i32 = 0;
    let attribute = sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED;
    cu!(cuDeviceGetP2PAttribute(&mut supported, attribute, dev, peer)).ok().map(|()| supported != 0)
}

// ---------------------------------------------------------------- peer access

/// A reference on a device's primary context (`cuDevicePrimaryCtxRetain`),
/// released on drop. Retaining never binds the context to any thread.
pub struct RetainedPrimaryContext {
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a retained context handle may be used and released from any thread.
unsafe impl Send for RetainedPrimaryContext {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for RetainedPrimaryContext {}

impl RetainedPrimaryContext {
    /// Retains `dev`'s primary context if it exists already (never creates
    /// one: that would cost memory on a GPU this process does not use).
    pub fn if_active(dev: sys::CUdevice) -> Result<Option<RetainedPrimaryContext>> {
        let (mut flags, mut active) = (0u32, 0i32);
        cu!(cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active))?;
        if active == 0 {
            return Ok(None);
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        cu!(cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
        Ok(Some(RetainedPrimaryContext { dev, ctx }))
    }

    pub fn context(&self) -> sys::CUcontext {
        self.ctx
    }
}

impl Drop for RetainedPrimaryContext {
    fn drop(&mut self) {
        // SAFETY: retained once in `if_active`, released once here.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

/// Enables access from `ctx` to the device memory at `addr`, which belongs
/// to a live context of this process on another device
/// (`cuCtxEnablePeerAccess` to the context owning `addr`; already enabled
/// counts as success). When that context is its device's primary context,
/// returns a reference that keeps it alive while the caller maps the memory.
pub fn enable_peer_access_to(ctx: &CudaContext, addr: sys::CUdeviceptr) -> Result<Option<RetainedPrimaryContext>> {
    let (MemoryLocation::Device { ordinal }, Some(owner)) = (memory_location(addr)?, pointer_context(addr)) else {
        return Err(Error::invalid(format!("enabling peer access: {addr:#x} is not device memory")));
    };
    let peer_dev = device(ordinal)?;
    if !can_access_peer(ctx.cu_device(), peer_dev)? {
        return Err(Error::Unsupported(format!(
            "device {} cannot access device {ordinal} (no P2P); use the host-staged transport",
            ctx.ordinal()
        )));
    }
    let keep_alive = RetainedPrimaryContext::if_active(peer_dev)?.filter(|p| p.context() == owner);
    let _bound = CurrentContext::bind(ctx)?;
    // SAFETY: `owner` is the live context owning `addr` (its rank is in the
    // middle of the same collective step) and `ctx` is current.
    let status = unsafe { sys::cuCtxEnablePeerAccess(owner, 0) };
    if status != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        check("cuCtxEnablePeerAccess", status)?;
    }
    Ok(keep_alive)
}

/// The id of the graph capture `stream` takes part in, `None` when it is
/// not capturing; an invalidated capture is an error.
///
/// # Safety
/// `stream` must be a live stream handle of this process (or null).
pub unsafe fn capture_id(stream: sys::CUstream) -> Result<Option<u64>> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    cu!(cuStreamGetCaptureInfo_v3(
        stream,
        &mut status,
        &mut id,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut()
    ))?;
    match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(None),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Ok(Some(id)),
        _ => Err(Error::invalid(
            "the stream's graph capture was invalidated by an earlier error; end the capture and retry",
        )),
    }
}

/// A CUDA event without timing, for ordering work across streams.
pub struct Event {
    ctx: Arc<CudaContext>,
    event: sys::CUevent,
}

// SAFETY: a CUevent handle may be used from any thread of the process.
unsafe impl Send for Event {}
// SAFETY: as above; the driver serialises operations on one event.
unsafe impl Sync for Event {}

impl Event {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Event> {
        bind(ctx)?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        cu!(cuEventCreate(&mut event, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32))?;
        Ok(Event { ctx: ctx.clone(), event })
    }

    /// Records the event on `stream` (what a later [`Event::wait`] waits for).
    ///
    /// # Safety
    /// `stream` is a live stream of the event's context.
    pub unsafe fn record(&self, stream: sys::CUstream) -> Result<()> {
        cu!(cuEventRecord(self.event, stream))
    }

    /// Makes `stream` wait for the event's latest record (nothing, if it was
    /// never recorded). The stream that recorded it may have been destroyed
    /// since: the event is ours, the wait touches only it and `stream`.
    ///
    /// # Safety
    /// As [`Event::record`].
    pub unsafe fn wait(&self, stream: sys::CUstream) -> Result<()> {
        cu!(cuStreamWaitEvent(stream, self.event, 0))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: created by cuEventCreate in this context, destroyed once.
            let _ = unsafe { sys::cuEventDestroy_v2(self.event) };
        }
    }
}
