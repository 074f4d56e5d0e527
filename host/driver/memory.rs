//! RAII owners of the memory the library allocates, registers or maps, and
//! the pointer queries (`cuPointerGetAttribute`, `cuMemGetAddressRange`).
//! Every owner releases its memory on drop with its context bound for the
//! call only: dropping one never changes the thread's current context.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use super::{cu, memset_d8, CurrentContext};
use crate::error::{Error, Result};

/// Device memory from `cuMemAlloc` (exportable over CUDA IPC, unlike
/// stream-ordered pool memory). Freed on drop.
pub struct DeviceMemory {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DeviceMemory {
    pub fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        let _bound = CurrentContext::bind(ctx)?;
        let mut ptr: sys::CUdeviceptr = 0;
        cu!(cuMemAlloc_v2(&mut ptr, bytes.max(1)))?;
        Ok(DeviceMemory { ctx: ctx.clone(), ptr, bytes })
    }

    /// Allocates and zero-fills; returns once the zeros are in memory.
    pub fn alloc_zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        let m = Self::alloc(ctx, bytes)?;
        let _bound = CurrentContext::bind(ctx)?;
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
        if let Ok(_bound) = CurrentContext::bind(&self.ctx) {
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
        let _bound = CurrentContext::bind(ctx)?;
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

    /// Writes `record` into this memory as a kernel would publish it: every
    /// field, then `published` last behind a release fence (the host reader
    /// checks `published` first). Refuses memory too small for a record.
    pub fn publish_error_record(&self, record: &tp_allreduce_kernels::layout::ErrorRecord) -> Result<()> {
        use tp_allreduce_kernels::layout::ErrorRecord;
        if self.bytes < std::mem::size_of::<ErrorRecord>() {
            return Err(Error::invalid("pinned memory too small for an error record"));
        }
        let dst = self.host as *mut ErrorRecord;
        let mut fields = *record;
        fields.published = 0;
        // SAFETY: `dst` is this allocation (checked large enough, aligned by
        // cuMemHostAlloc); volatile writes because a device thread may read
        // or write the same record concurrently.
        unsafe {
            std::ptr::write_volatile(dst, fields);
            std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
            std::ptr::write_volatile(std::ptr::addr_of_mut!((*dst).published), 1);
        }
        Ok(())
    }
}

impl Drop for PinnedHostMemory {
    fn drop(&mut self) {
        if let Ok(_bound) = CurrentContext::bind(&self.ctx) {
            // SAFETY: `host` came from cuMemHostAlloc and is freed once.
            let _ = unsafe { sys::cuMemFreeHost(self.host) };
        }
    }
}

/// Host memory the caller owns (e.g. a shared-memory mapping), page-locked
/// and mapped into every context (`cuMemHostRegister(PORTABLE | DEVICEMAP)`).
/// Unregistered on drop; the caller unmaps the memory afterwards.
pub struct HostRegistration {
    ctx: Arc<CudaContext>,
    host: *mut c_void,
    device: sys::CUdeviceptr,
}

// SAFETY: the registration is a handle on memory the owner keeps mapped; the
// raw pointer is only passed back to the driver.
unsafe impl Send for HostRegistration {}
// SAFETY: as above.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Registers `bytes` bytes at `host`.
    ///
    /// # Safety
    /// `host..host+bytes` must be a mapping of this process that stays mapped
    /// until the returned value is dropped.
    pub unsafe fn register(ctx: &Arc<CudaContext>, host: *mut c_void, bytes: usize) -> Result<Self> {
        let _bound = CurrentContext::bind(ctx)?;
        cu!(cuMemHostRegister_v2(host, bytes, sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP))?;
        let mut device: sys::CUdeviceptr = 0;
        if let Err(e) = cu!(cuMemHostGetDevicePointer_v2(&mut device, host, 0)) {
            // SAFETY: undoing the registration made above.
            unsafe { sys::cuMemHostUnregister(host) };
            return Err(e);
        }
        Ok(HostRegistration { ctx: ctx.clone(), host, device })
    }

    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.device
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if let Ok(_bound) = CurrentContext::bind(&self.ctx) {
            // SAFETY: registered in `register`, unregistered once.
            let _ = unsafe { sys::cuMemHostUnregister(self.host) };
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
        let _bound = CurrentContext::bind(ctx)?;
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
        if let Ok(_bound) = CurrentContext::bind(&self.ctx) {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// Exports the allocation starting at `base` (which must be the start of a
/// `cuMemAlloc` allocation) as a 64-byte IPC handle.
pub fn ipc_export(ctx: &CudaContext, base: sys::CUdeviceptr) -> Result<[u8; 64]> {
    let _bound = CurrentContext::bind(ctx)?;
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
pub(super) unsafe fn pointer_attribute<T: Copy>(
    ptr: sys::CUdeviceptr,
    attribute: sys::CUpointer_attribute,
    init: T,
) -> Result<T> {
    let mut value = init;
    cu!(cuPointerGetAttribute(&mut value as *mut T as *mut c_void, attribute, ptr))?;
    Ok(value)
}

/// The context owning device pointer `ptr`, if it is one.
pub fn pointer_context(ptr: sys::CUdeviceptr) -> Option<sys::CUcontext> {
    // SAFETY: the context attribute is a CUcontext.
    let ctx =
        unsafe { pointer_attribute(ptr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_CONTEXT, std::ptr::null_mut()) };
    ctx.ok().filter(|c: &sys::CUcontext| !c.is_null())
}

/// Where the memory behind an address lives, as far as peer access cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryLocation {
    /// Host memory (pinned, registered or mapped). Every context that maps
    /// it reaches it through the host: no peer access is involved, even
    /// though the driver reports the ordinal of the allocating device.
    Host,
    /// Device memory of the device with this ordinal.
    Device { ordinal: usize },
    /// Anything else (managed memory, arrays, unknown addresses).
    Other,
}

/// Where the memory at `ptr` lives (`CU_POINTER_ATTRIBUTE_MEMORY_TYPE`,
/// `..._DEVICE_ORDINAL`, `..._IS_MANAGED`).
pub fn memory_location(ptr: sys::CUdeviceptr) -> Result<MemoryLocation> {
    // SAFETY: the memory type attribute is a CUmemorytype (an unsigned int).
    let kind = unsafe { pointer_attribute(ptr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, 0u32) }?;
    // SAFETY: the managed attribute is an int (a boolean).
    let managed = unsafe { pointer_attribute(ptr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED, 0i32) }?;
    if managed != 0 {
        return Ok(MemoryLocation::Other);
    }
    if kind == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 {
        return Ok(MemoryLocation::Host);
    }
    if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Ok(MemoryLocation::Other);
    }
    // SAFETY: the device ordinal attribute is an int.
    let ordinal =
        unsafe { pointer_attribute(ptr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, -1i32) }?;
    Ok(usize::try_from(ordinal).map_or(MemoryLocation::Other, |ordinal| MemoryLocation::Device { ordinal }))
}
