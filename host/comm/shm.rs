//! POSIX shared memory registered with CUDA: the HostStaged transport's
//! peer-visible region when ranks are separate processes. The creator
//! unlinks the name as soon as every rank has mapped it, so a crash later
//! leaves nothing behind in /dev/shm.
//!
//! Names carry random bits ([`region_name`]), so no one can create an
//! object under a name a rank is about to use. A peer names the object and
//! its size; before mapping it, an opener checks (`fstat`) that it belongs
//! to this user, is closed to others (the creator makes it 0600) and holds
//! exactly that many bytes: mapping more than an object holds and touching
//! the rest raises SIGBUS.
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

/// A fresh name for a region of job `job` (rank 0's id, public): `what`
/// (the rank, say) and 64 random bits. Another user sees rank 0's object
/// in /dev/shm; with names made of the job and the rank alone, they could
/// create the others' first and fail their init (`O_EXCL`). Peers learn a
/// name only from the authenticated rendezvous.
pub(crate) fn region_name(job: &str, what: &str) -> Result<String> {
    Ok(format!("/tpar-{job}-{what}-{}", crate::rendezvous::hex(&crate::rendezvous::random_bytes::<8>()?)))
}

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

/// Why an opened shared-memory object (`st`) is not one to map as `bytes`
/// bytes of a peer's region, if it is not: another owner, open to other
/// users, or another size.
fn refuse_opened(name: &str, st: &libc::stat, bytes: usize) -> Option<Error> {
    let (uid, own) = (st.st_uid, nix::unistd::geteuid().as_raw());
    let mode = st.st_mode & 0o7777;
    let why = if uid != own {
        format!("it belongs to uid {uid}, and this process runs as uid {own} (it was not made by a rank of this job)")
    } else if mode & 0o077 != 0 {
        format!("its mode is {mode:o}, open to other users (the creating rank makes it 600)")
    } else if st.st_size < 0 || st.st_size as u64 != bytes as u64 {
        format!(
            "it holds {} bytes and the peer announced {bytes} (mapping past its end would raise SIGBUS)",
            st.st_size
        )
    } else {
        return None;
    };
    Some(Error::Ipc(format!("refusing to map shared memory {name}: {why}")))
}

/// Opens (or, for the owner, creates and sizes) the shared-memory object
/// `cname` and maps `bytes` of it; an opener checks the object first (see
/// [`refuse_opened`]). The owner's name is removed again when a step fails.
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
        if !owner {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) != 0 {
                let e = std::io::Error::last_os_error();
                libc::close(fd);
                return Err(Error::io(format!("fstat({name})"), e));
            }
            if let Some(err) = refuse_opened(name, &st, bytes) {
                libc::close(fd);
                return Err(err);
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::sync::atomic::AtomicUsize;

    /// A fresh name, unlinked when dropped.
    struct Name(String, CString);

    impl Name {
        fn new() -> Name {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let name = format!("/tpar-shm-test-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
            let c = CString::new(name.clone()).unwrap();
            Name(name, c)
        }

        /// Where Linux shows the object.
        fn path(&self) -> std::path::PathBuf {
            std::path::Path::new("/dev/shm").join(&self.0[1..])
        }

        fn open(&self, bytes: usize) -> Result<Mapping> {
            map_shared(&self.1, &self.0, bytes, false)
        }
    }

    impl Drop for Name {
        fn drop(&mut self) {
            // SAFETY: valid C string.
            unsafe { libc::shm_unlink(self.1.as_ptr()) };
        }
    }

    /// A peer announces more bytes than the object holds: mapping it and
    /// touching the end would raise SIGBUS, so the opener refuses it (and
    /// an object larger than announced too: the sizes must agree).
    #[test]
    fn an_object_of_another_size_than_announced_is_refused() {
        let name = Name::new();
        let _owner = map_shared(&name.1, &name.0, 4096, true).unwrap();
        let err = name.open(1 << 20).err().expect("mapped 1 MiB of a 4 KiB object");
        assert!(err.to_string().contains("holds 4096 bytes and the peer announced 1048576"), "{err}");
        assert!(name.open(1024).is_err(), "mapped 1 KiB of a 4 KiB object");
        name.open(4096).unwrap();
    }

    /// An object of another user (one this user may still open: root, or
    /// one opened to everyone) is refused.
    #[test]
    fn an_object_of_another_user_is_refused() {
        let name = Name::new();
        let _owner = map_shared(&name.1, &name.0, 4096, true).unwrap();
        if let Err(e) = std::os::unix::fs::chown(name.path(), Some(65534), Some(65534)) {
            println!("an_object_of_another_user_is_refused: skipped: cannot chown {}: {e}", name.path().display());
            return;
        }
        let err = name.open(4096).err().expect("opened an object of uid 65534");
        assert!(err.to_string().contains("uid 65534"), "{err}");
    }

    /// An object that others may read or write (not what the creator made,
    /// 0600) is refused.
    #[test]
    fn an_object_open_to_others_is_refused() {
        let name = Name::new();
        let _owner = map_shared(&name.1, &name.0, 4096, true).unwrap();
        std::fs::set_permissions(name.path(), std::fs::Permissions::from_mode(0o666)).unwrap();
        let err = name.open(4096).err().expect("opened an object of mode 0666");
        assert!(err.to_string().contains("mode is 666"), "{err}");
    }

    /// Names are not derivable from what other users see: `/tpar-<job>-0`
    /// shows rank 0's job id and the scheme in /dev/shm, and a name made of
    /// the job and the rank alone let another user create rank 1's object
    /// first (`O_EXCL` then fails rank 1's init: a denial of service). Each
    /// name carries 64 random bits, and peers learn it only through the
    /// authenticated rendezvous.
    #[test]
    fn region_names_are_not_predictable() {
        let job = "0123456789abcdef";
        let names: Vec<String> = (0..64).map(|_| region_name(job, "1").unwrap()).collect();
        let unique: std::collections::HashSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        for name in &names {
            let suffix = name.strip_prefix("/tpar-0123456789abcdef-1-").unwrap_or_else(|| panic!("{name}"));
            assert!(suffix.len() == 16 && suffix.bytes().all(|b| b.is_ascii_hexdigit()), "{name}");
            assert!(name.len() < 255 && !name[1..].contains('/'), "{name}");
        }
    }
}
