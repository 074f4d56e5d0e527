//! POSIX shared memory registered with CUDA: the HostStaged transport's
//! peer-visible region when ranks are separate processes. The creator
//! unlinks the name as soon as every rank has mapped it, so a crash later
//! leaves nothing behind in /dev/shm.
//!
//! The `unsafe` here is the libc side only (`shm_open`, `mmap`); the CUDA
//! registration goes through the driver module ([`HostRegistration`]).

#![allow(unsafe_code)]

use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::driver::HostRegistration;
use crate::error::{Error, Result};

pub(crate) struct SharedHostRegion {
    name: String,
    /// Dropped before the memory is unmapped (see `Drop`).
    registration: Option<HostRegistration>,
    mapping: Mapping,
    unlinked: AtomicBool,
}

/// An `mmap` of a shared-memory object, unmapped on drop.
struct Mapping {
    host: *mut c_void,
    bytes: usize,
}

// SAFETY: the mapping is plain shared memory; the raw pointer is only handed
// to the driver and to `munmap`.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `SharedHostRegion::map` with this length, unmapped once.
        unsafe { libc::munmap(self.host, self.bytes) };
    }
}

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
        let mapping = map_shared(&cname, name, bytes, owner)?;
        // On a failure below, dropping `region` unmaps and (owner) unlinks.
        let mut region = SharedHostRegion {
            name: name.to_string(),
            registration: None,
            mapping,
            // Not yet unlinked only for the owner; the drop unlinks it.
            unlinked: AtomicBool::new(!owner),
        };
        // SAFETY: `region.mapping` covers `bytes` bytes and outlives the
        // registration (dropped first, see `Drop`).
        region.registration = Some(unsafe { HostRegistration::register(ctx, region.mapping.host, bytes) }?);
        Ok(region)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn device_ptr(&self) -> u64 {
        self.registration.as_ref().map_or(0, HostRegistration::device_ptr)
    }

    /// Removes the name (the memory stays mapped where it is mapped).
    pub fn unlink(&self) {
        if !self.unlinked.swap(true, Ordering::AcqRel) {
            if let Ok(c) = CString::new(self.name.clone()) {
                // SAFETY: valid C string.
                unsafe { libc::shm_unlink(c.as_ptr()) };
            }
        }
    }
}

impl Drop for SharedHostRegion {
    fn drop(&mut self) {
        // Unregister while the memory is still mapped; `mapping` unmaps after.
        self.registration = None;
        self.unlink();
    }
}

/// Opens (or, for the owner, creates and sizes) the shared-memory object
/// `cname` and maps `bytes` of it. The owner's name is removed again when a
/// step fails.
fn map_shared(cname: &CString, name: &str, bytes: usize, owner: bool) -> Result<Mapping> {
    let flags = if owner { libc::O_CREAT | libc::O_EXCL | libc::O_RDWR } else { libc::O_RDWR };
    let unlink_if_owner = || {
        if owner {
            // SAFETY: valid C string.
            unsafe { libc::shm_unlink(cname.as_ptr()) };
        }
    };
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
            unlink_if_owner();
            return Err(Error::io(format!("ftruncate({name})"), e));
        }
        let host = libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
        libc::close(fd);
        if host == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            unlink_if_owner();
            return Err(Error::io(format!("mmap({name})"), e));
        }
        Ok(Mapping { host, bytes })
    }
}
