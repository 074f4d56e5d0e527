//! The few CUDA driver calls the binding makes itself (everything else goes
//! through the library): saving and restoring the calling thread's current
//! context, stream capture status, IPC exportability of a pointer, one async
//! copy, stream synchronisation, and the device buffer the capture copy uses.
//!
//! libcuda is loaded at run time; every function here must only be called
//! after [`require_driver`] succeeded (cudarc panics when the library is
//! missing).

use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaContext, DriverError};
use tp_allreduce::Error;

/// Whether libcuda can be loaded and initialised. Never panics.
pub fn driver_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        // SAFETY: only tries to dlopen the candidate library names.
        if !unsafe { sys::is_culib_present() } {
            return false;
        }
        std::panic::catch_unwind(|| cudarc::driver::result::init().is_ok()).unwrap_or(false)
    })
}

/// `Ok(())` when the driver is usable, else `Error::NoDriver`.
pub fn require_driver() -> Result<(), Error> {
    if driver_available() {
        Ok(())
    } else {
        Err(Error::NoDriver("libcuda could not be loaded or cuInit failed (no NVIDIA driver or no GPU visible)".into()))
    }
}

/// A failed driver call as the library's error.
pub fn driver_error(call: &'static str, e: DriverError) -> Error {
    let message = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    Error::Driver { call, code: format!("{:?}", e.0), message }
}

fn check(call: &'static str, result: sys::CUresult) -> Result<(), Error> {
    match result {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        code => Err(driver_error(call, DriverError(code))),
    }
}

/// The calling thread's current CUDA context, put back on drop. The
/// library binds the communicator's context to the calling thread; PyTorch
/// reads its current device from the current context, so every call from
/// Python runs inside one of these and leaves the device as it found it.
pub struct CurrentContext(sys::CUcontext);

impl CurrentContext {
    pub fn save() -> CurrentContext {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one handle into `ctx`; on failure `ctx` stays null
        // (restoring null unbinds, which is what "no current context" was).
        let _ = unsafe { sys::cuCtxGetCurrent(&mut ctx) };
        CurrentContext(ctx)
    }
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        // SAFETY: the handle was current on this thread when saved; the
        // context outlives the call (primary contexts stay retained by the
        // communicator or by PyTorch).
        let _ = unsafe { sys::cuCtxSetCurrent(self.0) };
    }
}

pub fn bind(ctx: &CudaContext) -> Result<(), Error> {
    ctx.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))
}

/// Whether `stream` is capturing a CUDA graph.
pub fn stream_is_capturing(stream: sys::CUstream) -> Result<bool, Error> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller passes a live stream (contract of the raw API).
    check("cuStreamIsCapturing", unsafe { sys::cuStreamIsCapturing(stream, &mut status) })?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Whether the allocation holding `ptr` can be exported with legacy CUDA
/// IPC (`cuIpcGetMemHandle`). False for virtual-memory (cuMem) mappings,
/// which is what PyTorch's `expandable_segments:True` allocates, for
/// stream-ordered pool memory, and for anything the driver does not know.
pub fn pointer_is_ipc_exportable(ptr: u64) -> bool {
    let mut capable: i32 = 0;
    // SAFETY: this attribute is written as a C int.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            &mut capable as *mut i32 as *mut std::ffi::c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
            ptr,
        )
    };
    r == sys::CUresult::CUDA_SUCCESS && capable != 0
}

/// Stream-ordered device-to-device copy (capturable).
///
/// # Safety
/// `dst` and `src` must be device memory valid for `bytes` until the copy
/// completes; `stream` must be a live stream of the current context.
pub unsafe fn memcpy_dtod_async(dst: u64, src: u64, bytes: usize, stream: sys::CUstream) -> Result<(), Error> {
    // SAFETY: forwarded contract.
    check("cuMemcpyDtoDAsync", unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream) })
}

/// Waits for `stream`.
///
/// # Safety
/// `stream` must be a live stream (or null: the legacy default stream).
pub unsafe fn stream_synchronize(stream: sys::CUstream) -> Result<(), Error> {
    // SAFETY: forwarded contract.
    check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream) })
}

/// Device memory from `cuMemAlloc` (exportable over CUDA IPC, unlike
/// PyTorch's expandable segments), freed on drop.
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: u64,
    bytes: usize,
}

impl DeviceBuffer {
    pub fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceBuffer, Error> {
        bind(ctx)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: writes one device pointer; `bytes` > 0 is the caller's.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) })?;
        Ok(DeviceBuffer { ctx: ctx.clone(), ptr, bytes })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _restore = CurrentContext::save();
        if bind(&self.ctx).is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}
