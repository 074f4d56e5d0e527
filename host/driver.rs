//! Every CUDA driver call of the library goes through this module: one
//! checked wrapper ([`cu!`]), RAII owners for the memory the library
//! allocates or maps, kernel-module loading once per context, and launch.
//!
//! The driver is loaded at run time (cudarc's dynamic loading), so the crate
//! builds and its CPU tests run on machines without CUDA; [`driver_available`]
//! probes for it without panicking.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaContext};

use crate::error::{Error, Result};
use crate::kernels::EmbeddedPtx;

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

pub(crate) fn bind(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread().map_err(|e| crate::error::driver("cuCtxSetCurrent", e))
}

pub(crate) fn device_attribute(ctx: &CudaContext, attr: sys::CUdevice_attribute) -> Result<i32> {
    ctx.attribute(attr).map_err(|e| crate::error::driver("cuDeviceGetAttribute", e))
}

/// Device memory from `cuMemAlloc` (exportable over CUDA IPC, unlike
/// stream-ordered pool memory). Freed on drop with its context bound.
pub struct DeviceMemory {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DeviceMemory {
    pub fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        bind(ctx)?;
        let mut ptr: sys::CUdeviceptr = 0;
        cu!(cuMemAlloc_v2(&mut ptr, bytes.max(1)))?;
        Ok(DeviceMemory { ctx: ctx.clone(), ptr, bytes })
    }

    /// Allocates and zero-fills; returns once the zeros are in memory.
    pub fn alloc_zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        let m = Self::alloc(ctx, bytes)?;
        memset_d8(m.ptr, 0, m.bytes.max(1))?;
        Ok(m)
    }

    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// Pinned host memory mapped into the device address space
/// (`cuMemHostAlloc(PORTABLE | DEVICEMAP)`), zero-filled.
pub struct PinnedHostMemory {
    ctx: Arc<CudaContext>,
    host: *mut c_void,
    device: sys::CUdeviceptr,
    bytes: usize,
}

// SAFETY: the allocation is plain memory owned by this value; the raw pointer
// is only dereferenced through methods that take `&self`/`&mut self`.
unsafe impl Send for PinnedHostMemory {}
// SAFETY: as above; concurrent readers only perform volatile reads.
unsafe impl Sync for PinnedHostMemory {}

impl PinnedHostMemory {
    pub fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        bind(ctx)?;
        let mut host: *mut c_void = std::ptr::null_mut();
        cu!(cuMemHostAlloc(&mut host, bytes.max(1), sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP))?;
        // SAFETY: `host` points to `bytes` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes.max(1)) };
        let mut device: sys::CUdeviceptr = 0;
        if let Err(e) = cu!(cuMemHostGetDevicePointer_v2(&mut device, host, 0)) {
            // SAFETY: freeing the allocation made above.
            unsafe { sys::cuMemFreeHost(host) };
            return Err(e);
        }
        Ok(PinnedHostMemory { ctx: ctx.clone(), host, device, bytes })
    }

    pub fn host_ptr(&self) -> *mut c_void {
        self.host
    }

    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.device
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for PinnedHostMemory {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: `host` came from cuMemHostAlloc and is freed once.
            let _ = unsafe { sys::cuMemFreeHost(self.host) };
        }
    }
}

/// A peer's allocation opened with `cuIpcOpenMemHandle`; closed on drop
/// (never `cuMemFree`d: it belongs to the exporting process).
pub struct IpcMapping {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
}

impl IpcMapping {
    pub fn open(ctx: &Arc<CudaContext>, handle: &[u8; 64]) -> Result<Self> {
        bind(ctx)?;
        let mut raw = sys::CUipcMemHandle { reserved: [0; 64] };
        for (d, s) in raw.reserved.iter_mut().zip(handle.iter()) {
            *d = *s as std::ffi::c_char;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        cu!(cuIpcOpenMemHandle_v2(&mut ptr, raw, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32))
            .map_err(|e| match &e {
                // Measured on an H200 (driver 580): a peer freed a buffer this
                // process still maps and a new allocation took its address.
                Error::Driver { code, .. } if code.contains("ALREADY_MAPPED") => Error::Ipc(format!(
                    "opening a peer's memory handle failed ({e}): this process still maps an earlier buffer of \
                     that peer at the same place, so the peer freed a registered buffer without \
                     deregister_buffers() first; call deregister_buffers() on every rank before freeing \
                     registered buffers (CUDA leaves freeing memory that peers still map undefined)"
                )),
                _ => Error::Ipc(format!(
                    "opening a peer's memory handle failed ({e}); if ranks run in containers, they need a shared \
                     IPC namespace (--ipc=host) and the same GPU visibility"
                )),
            })?;
        Ok(IpcMapping { ctx: ctx.clone(), ptr })
    }

    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// Exports the allocation starting at `base` (which must be the start of a
/// `cuMemAlloc` allocation) as a 64-byte IPC handle.
pub fn ipc_export(ctx: &CudaContext, base: sys::CUdeviceptr) -> Result<[u8; 64]> {
    bind(ctx)?;
    let mut raw = sys::CUipcMemHandle { reserved: [0; 64] };
    cu!(cuIpcGetMemHandle(&mut raw, base)).map_err(|e| {
        Error::Ipc(format!(
            "cannot export device memory at {base:#x} over CUDA IPC ({e}). Memory from stream-ordered pools \
             (cuMemAllocAsync, cudarc's CudaStream::alloc) and from expandable segments cannot be exported: \
             allocate buffers that peers must read with cuMemAlloc (cudarc::driver::result::malloc_sync), or \
             use a push algorithm, which needs no registration"
        ))
    })?;
    let mut out = [0u8; 64];
    for (d, s) in out.iter_mut().zip(raw.reserved.iter()) {
        *d = *s as u8;
    }
    Ok(out)
}

/// Start address and size of the allocation containing `ptr`.
pub fn allocation_range(ptr: sys::CUdeviceptr) -> Result<(sys::CUdeviceptr, usize)> {
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    cu!(cuMemGetAddressRange_v2(&mut base, &mut size, ptr))?;
    Ok((base, size))
}

/// Whether `ptr` belongs to a stream-ordered memory pool (not exportable
/// with legacy CUDA IPC).
pub fn is_pool_memory(ptr: sys::CUdeviceptr) -> bool {
    // SAFETY: the mempool attribute is a CUmemoryPool.
    let pool = unsafe {
        pointer_attribute(
            ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            std::ptr::null_mut::<sys::CUmemPoolHandle_st>(),
        )
    };
    matches!(pool, Ok(p) if !p.is_null())
}

/// The driver's id of the allocation holding `ptr`
/// (`CU_POINTER_ATTRIBUTE_BUFFER_ID`): unique for the life of the process,
/// so a freed address that a new allocation reuses gets a new id.
pub fn buffer_id(ptr: sys::CUdeviceptr) -> Result<u64> {
    // SAFETY: the buffer id attribute is an unsigned long long.
    unsafe { pointer_attribute(ptr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID, 0u64) }
}

/// One `cuPointerGetAttribute` value, starting from `init`.
///
/// # Safety
/// `T` must be the C type the driver writes for `attribute`.
pub(crate) unsafe fn pointer_attribute<T: Copy>(
    ptr: sys::CUdeviceptr,
    attribute: sys::CUpointer_attribute,
    init: T,
) -> Result<T> {
    let mut value = init;
    cu!(cuPointerGetAttribute(&mut value as *mut T as *mut c_void, attribute, ptr))?;
    Ok(value)
}

/// Waits for all work of the current context (every stream).
pub fn context_synchronize() -> Result<()> {
    cu!(cuCtxSynchronize())
}

/// The context owning device pointer `ptr`, if it is one.
pub fn pointer_context(ptr: sys::CUdeviceptr) -> Option<sys::CUcontext> {
    // SAFETY: the context attribute is a CUcontext.
    let ctx =
        unsafe { pointer_attribute(ptr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_CONTEXT, std::ptr::null_mut()) };
    ctx.ok().filter(|c: &sys::CUcontext| !c.is_null())
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
    bind(stream.context())?;
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

/// Enables access from `ctx` to memory of `peer` (both in this process).
pub fn enable_peer_access(ctx: &Arc<CudaContext>, peer: &CudaContext) -> Result<()> {
    if ctx.cu_device() == peer.cu_device() {
        return Ok(());
    }
    let mut can: i32 = 0;
    cu!(cuDeviceCanAccessPeer(&mut can, ctx.cu_device(), peer.cu_device()))?;
    if can == 0 {
        return Err(Error::Unsupported(format!(
            "device {} cannot access device {} (no P2P); use the host-staged transport",
            ctx.ordinal(),
            peer.ordinal()
        )));
    }
    bind(ctx)?;
    // SAFETY: both contexts are live (held by the caller).
    let status = unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) };
    if status == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    check("cuCtxEnablePeerAccess", status)
}

/// The library's kernels loaded into one context.
pub struct KernelModule {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    functions: HashMap<String, sys::CUfunction>,
    pub arch: &'static str,
}

// SAFETY: CUmodule/CUfunction handles are usable from any thread once the
// owning context is bound; the map is immutable after load.
unsafe impl Send for KernelModule {}
// SAFETY: as above.
unsafe impl Sync for KernelModule {}

impl KernelModule {
    /// The module for `ctx`, loaded once per context and kept for the life
    /// of the process. (Unloading when the last user drops it would make a
    /// later call reload it — possibly inside a stream capture, where a
    /// module load invalidates the capture.)
    pub fn for_context(ctx: &Arc<CudaContext>) -> Result<Arc<KernelModule>> {
        static CACHE: OnceLock<Mutex<HashMap<usize, Arc<KernelModule>>>> = OnceLock::new();
        let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
        let key = ctx.cu_ctx() as usize;
        let mut map = cache.lock().map_err(|_| Error::Broken("kernel module cache poisoned".into()))?;
        if let Some(m) = map.get(&key) {
            return Ok(m.clone());
        }
        let (major, minor) = ctx.compute_capability().map_err(|e| crate::error::driver("cuDeviceGetAttribute", e))?;
        let ptx = crate::kernels::choose(major as u32, minor as u32).ok_or_else(|| {
            Error::Unsupported(format!(
                "device {} has compute capability {major}.{minor}; this build has PTX for {} (sm_80 or newer is supported; \
                 set TP_ALLREDUCE_PTX_ARCHS when building to add architectures)",
                ctx.ordinal(),
                crate::kernels::embedded().iter().map(|p| p.arch).collect::<Vec<_>>().join(", ")
            ))
        })?;
        let module = Arc::new(Self::load(ctx, ptx)?);
        map.insert(key, module.clone());
        Ok(module)
    }

    fn load(ctx: &Arc<CudaContext>, ptx: EmbeddedPtx) -> Result<KernelModule> {
        bind(ctx)?;
        let mut image = ptx.text.as_bytes().to_vec();
        image.push(0);
        let mut log = vec![0u8; 16 * 1024];
        let mut options =
            [sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER, sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
        let mut values = [log.as_mut_ptr() as *mut c_void, log.len() as *mut c_void];
        let mut module: sys::CUmodule = std::ptr::null_mut();
        let loaded = cu!(cuModuleLoadDataEx(
            &mut module,
            image.as_ptr() as *const c_void,
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr()
        ));
        if let Err(e) = loaded {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            return Err(Error::Unsupported(format!(
                "loading the {} PTX failed: {e}; JIT log: {}",
                ptx.arch,
                String::from_utf8_lossy(&log[..end]).trim()
            )));
        }
        let mut functions = HashMap::new();
        for name in crate::kernels::expected_entries() {
            let cname = std::ffi::CString::new(name.clone()).expect("entry names have no NUL");
            let mut f: sys::CUfunction = std::ptr::null_mut();
            cu!(cuModuleGetFunction(&mut f, module, cname.as_ptr()))?;
            functions.insert(name, f);
        }
        Ok(KernelModule { ctx: ctx.clone(), module, functions, arch: ptx.arch })
    }

    pub fn function(&self, name: &str) -> Result<sys::CUfunction> {
        self.functions
            .get(name)
            .copied()
            .ok_or_else(|| Error::Unsupported(format!("kernel `{name}` is not in the loaded PTX ({})", self.arch)))
    }

    /// Most blocks of `THREADS_PER_BLOCK` threads of kernel `name` one SM
    /// holds at once.
    pub fn max_blocks_per_sm(&self, name: &str, threads: u32) -> Result<u32> {
        let f = self.function(name)?;
        bind(&self.ctx)?;
        let mut blocks: i32 = 0;
        cu!(cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, f, threads as i32, 0))?;
        Ok(blocks.max(0) as u32)
    }
}

impl Drop for KernelModule {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: the module was loaded by us and is unloaded once.
            let _ = unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

/// A kernel argument list: each entry points at one argument value, which
/// must outlive the launch call (the driver copies them at launch).
pub struct KernelArgs {
    values: Vec<u64>,
    kinds: Vec<ArgKind>,
}

#[derive(Clone, Copy)]
enum ArgKind {
    U64,
    U32,
    F32,
}

impl KernelArgs {
    pub fn new() -> Self {
        KernelArgs { values: Vec::with_capacity(8), kinds: Vec::with_capacity(8) }
    }
    pub fn u64(mut self, v: u64) -> Self {
        self.values.push(v);
        self.kinds.push(ArgKind::U64);
        self
    }
    pub fn u32(mut self, v: u32) -> Self {
        self.values.push(v as u64);
        self.kinds.push(ArgKind::U32);
        self
    }
    pub fn f32(mut self, v: f32) -> Self {
        self.values.push(v.to_bits() as u64);
        self.kinds.push(ArgKind::F32);
        self
    }
}

impl Default for KernelArgs {
    fn default() -> Self {
        Self::new()
    }
}

/// Launches `f` with a 1-D grid on `stream`.
///
/// # Safety
/// `args` must match the kernel's parameter list (types and order) and every
/// pointer argument must be valid for the kernel's accesses.
pub unsafe fn launch(
    f: sys::CUfunction,
    grid: u32,
    block: u32,
    stream: sys::CUstream,
    args: &KernelArgs,
) -> Result<()> {
    // u32 arguments must be passed as 4-byte values; keep separate storage.
    let mut small: Vec<u32> = Vec::with_capacity(args.values.len());
    for (v, k) in args.values.iter().zip(args.kinds.iter()) {
        if matches!(k, ArgKind::U32 | ArgKind::F32) {
            small.push(*v as u32);
        }
    }
    let mut ptrs: Vec<*mut c_void> = Vec::with_capacity(args.values.len());
    let mut s = 0;
    for (i, k) in args.kinds.iter().enumerate() {
        match k {
            ArgKind::U64 => ptrs.push(&args.values[i] as *const u64 as *mut c_void),
            ArgKind::U32 | ArgKind::F32 => {
                ptrs.push(&small[s] as *const u32 as *mut c_void);
                s += 1;
            }
        }
    }
    cu!(cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, stream, ptrs.as_mut_ptr(), std::ptr::null_mut()))
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

    /// Makes `waiter` wait for everything queued on `signaller` so far.
    ///
    /// # Safety
    /// Both must be live streams of the event's context.
    pub unsafe fn order(&self, signaller: sys::CUstream, waiter: sys::CUstream) -> Result<()> {
        cu!(cuEventRecord(self.event, signaller))?;
        cu!(cuStreamWaitEvent(waiter, self.event, 0))
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

/// Launches `f` with a 1-D grid of `grid` blocks of `block` threads on
/// `stream`, passing `params` **by value** as the kernel's one parameter
/// (`kernelParams = [&params]`; the driver copies the bytes into the
/// kernel's parameter space at launch, so `params` only has to live for
/// this call — a graph capture records the copy).
///
/// # Safety
/// * `f`'s only parameter must be a `.param .align 16 .b8 [size_of::<P>()]`
///   with `P`'s layout (the PTX tests compare the sizes for every sentinel
///   entry; the layout is shared through `tp_allreduce_kernels::params`).
/// * Every address in `params` must be valid for the kernel's accesses for
///   as long as the launch (or any replay of a graph capturing it) runs.
/// * `grid` and `block` must be a shape the kernel supports (the caller
///   checks residency and the block limit: the kernel validates nothing).
pub unsafe fn launch_struct<P: Copy>(
    f: sys::CUfunction,
    grid: u32,
    block: u32,
    stream: sys::CUstream,
    params: &P,
) -> Result<()> {
    let mut args = [params as *const P as *mut c_void];
    cu!(cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, stream, args.as_mut_ptr(), std::ptr::null_mut()))
}
