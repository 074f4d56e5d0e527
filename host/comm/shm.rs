//! POSIX shared memory registered with CUDA: the HostStaged transport's
//! peer-visible region when ranks are separate processes. The creator
//! unlinks the name as soon as every rank has mapped it, so a crash later
//! leaves nothing behind in /dev/shm.

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use crate::driver;
use crate::error::{Error, Result};

pub(crate) struct SharedHostRegion {
    ctx: Arc<CudaContext>,
    name: String,
    host: *mut c_void,
    device: u64,
    bytes: usize,
    unlinked: std::sync::atomic::AtomicBool,
}

// SAFETY: the mapping is plain shared memory; the raw pointer is only handed
// to the device and to the drop below.
unsafe impl Send for SharedHostRegion {}
// SAFETY: as above.
unsafe impl Sync for SharedHostRegion {}

impl SharedHostRegion {
    pub fn create(ctx: &Arc<CudaContext>, name: &str, bytes: usize) -> Result<Self> {
        Self::map(ctx, name, bytes, true)
    }

    pub fn open(ctx: &Arc<CudaContext>, name: &str, bytes: usize) -> Result<Self> {
        if !name.starts_with("/tpar-") || name.contains("..") || name[1..].contains('/') {
            return Err(Error::Protocol { from: "peer".into(), what: format!("bad shared memory name {name:?}") });
        }
        Self::map(ctx, name, bytes, false)
    }

    fn map(ctx: &Arc<CudaContext>, name: &str, bytes: usize, owner: bool) -> Result<Self> {
        let cname = CString::new(name).map_err(|_| Error::invalid("shared memory name contains NUL"))?;
        let flags = if owner { libc::O_CREAT | libc::O_EXCL | libc::O_RDWR } else { libc::O_RDWR };
        // SAFETY: plain libc calls with a valid C string; every failure path
        // releases what was acquired before it.
        unsafe {
            let fd = libc::shm_open(cname.as_ptr(), flags, 0o600);
            if fd < 0 {
                return Err(Error::io(format!("shm_open({name})"), std::io::Error::last_os_error()));
            }
            if owner && libc::ftruncate(fd, bytes as libc::off_t) != 0 {
                let e = std::io::Error::last_os_error();
                libc::close(fd);
                libc::shm_unlink(cname.as_ptr());
                return Err(Error::io(format!("ftruncate({name})"), e));
            }
            let host =
                libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
            libc::close(fd);
            if host == libc::MAP_FAILED {
                let e = std::io::Error::last_os_error();
                if owner {
                    libc::shm_unlink(cname.as_ptr());
                }
                return Err(Error::io(format!("mmap({name})"), e));
            }
            let cleanup = |host: *mut c_void| {
                libc::munmap(host, bytes);
                if owner {
                    libc::shm_unlink(cname.as_ptr());
                }
            };
            if let Err(e) = driver::bind(ctx) {
                cleanup(host);
                return Err(e);
            }
            let reg = sys::cuMemHostRegister_v2(
                host,
                bytes,
                sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
            );
            if let Err(e) = driver::check("cuMemHostRegister", reg) {
                cleanup(host);
                return Err(e);
            }
            let mut device: sys::CUdeviceptr = 0;
            if let Err(e) =
                driver::check("cuMemHostGetDevicePointer", sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0))
            {
                sys::cuMemHostUnregister(host);
                cleanup(host);
                return Err(e);
            }
            Ok(SharedHostRegion {
                ctx: ctx.clone(),
                name: name.to_string(),
                host,
                device,
                bytes,
                unlinked: std::sync::atomic::AtomicBool::new(!owner),
            })
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn device_ptr(&self) -> u64 {
        self.device
    }

    /// Removes the name (the memory stays mapped where it is mapped).
    pub fn unlink(&self) {
        if !self.unlinked.swap(true, std::sync::atomic::Ordering::AcqRel) {
            if let Ok(c) = CString::new(self.name.clone()) {
                // SAFETY: valid C string.
                unsafe { libc::shm_unlink(c.as_ptr()) };
            }
        }
    }
}

impl Drop for SharedHostRegion {
    fn drop(&mut self) {
        if driver::bind(&self.ctx).is_ok() {
            // SAFETY: registered in `map`, unregistered once.
            unsafe { sys::cuMemHostUnregister(self.host) };
        }
        // SAFETY: mapped in `map` with this length.
        unsafe { libc::munmap(self.host, self.bytes) };
        self.unlink();
    }
}
