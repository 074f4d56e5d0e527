//! NCCL, loaded at run time through cudarc: the fallback algorithm and the
//! benchmark's baseline. Absence of libnccl is not an error: callers get
//! `None` and say so.
//!
//! cudarc looks for `libnccl.so` (and versioned names ending in `.so.1`,
//! `.so.9`..`.so.12`, `.so.<cuda major>`); NCCL wheels ship `libnccl.so.2`, so
//! put a `libnccl.so` symlink to it on `LD_LIBRARY_PATH` (`.ci/main.sh` and
//! `benches/gpu/steps.sh` do this).

#![allow(unsafe_code)]

use std::mem::MaybeUninit;
use std::sync::Arc;

use cudarc::driver::{sys, CudaStream};
use cudarc::nccl::{result, sys as nsys};

use crate::driver;
use crate::error::{Error, Result};
use crate::rendezvous::Rendezvous;
use crate::DType;

/// Whether libnccl can be loaded.
pub fn available() -> bool {
    // Candle builds link libnccl (cudarc `dynamic-linking`): it is there.
    #[cfg(feature = "candle")]
    return true;
    // SAFETY: only tries to dlopen candidate library names.
    #[cfg(not(feature = "candle"))]
    std::panic::catch_unwind(|| unsafe { nsys::is_culib_present() }).unwrap_or(false)
}

/// NCCL's version as `major.minor.patch`, when loadable.
pub fn version() -> Option<String> {
    if !available() {
        return None;
    }
    let v = std::panic::catch_unwind(result::get_nccl_version).ok()?.ok()?;
    Some(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
}

fn nccl_err(call: &str, e: result::NcclError) -> Error {
    Error::Nccl(format!("{call} failed: {:?}", e.0))
}

fn nccl_dtype(dtype: DType) -> nsys::ncclDataType_t {
    match dtype {
        DType::F32 => nsys::ncclDataType_t::ncclFloat32,
        DType::F16 => nsys::ncclDataType_t::ncclFloat16,
        DType::Bf16 => nsys::ncclDataType_t::ncclBfloat16,
    }
}

/// One rank of an NCCL communicator. Dropping it destroys the communicator
/// without panicking (unlike `cudarc::nccl::Comm`).
pub struct NcclComm {
    comm: nsys::ncclComm_t,
    pub rank: usize,
    pub world: usize,
}

// SAFETY: an ncclComm_t may be used from any thread, one call at a time;
// every method takes `&self` and NCCL serialises per communicator.
unsafe impl Send for NcclComm {}
// SAFETY: as above.
unsafe impl Sync for NcclComm {}

impl NcclComm {
    /// Collective over `rdv`: rank 0 creates the unique id, all ranks join.
    /// `Ok(None)` when libnccl is not available.
    pub fn from_rendezvous(stream: &Arc<CudaStream>, rdv: &dyn Rendezvous) -> Result<Option<NcclComm>> {
        let have = available();
        // Every rank must agree, or the ones with NCCL would block in init.
        let all: Vec<Vec<u8>> = rdv.all_gather(&[have as u8])?;
        if all.iter().any(|v| v.first() != Some(&1)) {
            return Ok(None);
        }
        let id_bytes = if rdv.rank() == 0 {
            let id = result::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
            id.internal.iter().map(|c| *c as u8).collect::<Vec<u8>>()
        } else {
            Vec::new()
        };
        let ids = rdv.all_gather(&id_bytes)?;
        let root = &ids[0];
        if root.len() != 128 {
            return Err(Error::Nccl("rank 0 sent a malformed NCCL unique id".into()));
        }
        let mut id = nsys::ncclUniqueId { internal: [0; 128] };
        for (d, s) in id.internal.iter_mut().zip(root.iter()) {
            *d = *s as std::ffi::c_char;
        }
        // NCCL binds the device it joins from the current context; restore
        // the caller's afterwards.
        let _context = driver::CurrentContext::bind(stream.context())?;
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` receives a new communicator on success.
        unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), rdv.world_size() as i32, id, rdv.rank() as i32)
                .map_err(|e| nccl_err("ncclCommInitRank", e))?;
            Ok(Some(NcclComm { comm: comm.assume_init(), rank: rdv.rank(), world: rdv.world_size() }))
        }
    }

    /// In-process communicators over distinct devices (`ncclCommInitAll`).
    pub fn init_all(ordinals: &[usize]) -> Result<Vec<NcclComm>> {
        if !available() {
            return Err(Error::Nccl("libnccl not found (cudarc looks for libnccl.so on LD_LIBRARY_PATH)".into()));
        }
        let mut comms = vec![std::ptr::null_mut(); ordinals.len()];
        let devs: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        // SAFETY: `comms` has one slot per device.
        unsafe {
            result::comm_init_all(comms.as_mut_ptr(), devs.len() as i32, devs.as_ptr())
                .map_err(|e| nccl_err("ncclCommInitAll", e))?;
        }
        let world = ordinals.len();
        Ok(comms.into_iter().enumerate().map(|(rank, comm)| NcclComm { comm, rank, world }).collect())
    }

    /// Sum allreduce on `stream`.
    pub fn all_reduce(
        &self,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller guarantees the pointers are valid device buffers
        // of `count` elements on this communicator's device.
        unsafe {
            result::all_reduce(
                send as *const std::ffi::c_void,
                recv as *mut std::ffi::c_void,
                count,
                nccl_dtype(dtype),
                nsys::ncclRedOp_t::ncclSum,
                self.comm,
                stream as nsys::cudaStream_t,
            )
            .map(|_| ())
            .map_err(|e| nccl_err("ncclAllReduce", e))
        }
    }

    /// All-gather of `count` elements a rank on `stream`.
    pub fn all_gather(
        &self,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller guarantees `send` holds `count` and `recv`
        // `world x count` elements on this communicator's device.
        unsafe {
            result::all_gather(
                send as *const std::ffi::c_void,
                recv as *mut std::ffi::c_void,
                count,
                nccl_dtype(dtype),
                self.comm,
                stream as nsys::cudaStream_t,
            )
            .map(|_| ())
            .map_err(|e| nccl_err("ncclAllGather", e))
        }
    }

    /// Sum reduce-scatter into `count` elements a rank on `stream`.
    pub fn reduce_scatter(
        &self,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller guarantees `send` holds `world x count` and
        // `recv` `count` elements on this communicator's device.
        unsafe {
            result::reduce_scatter(
                send as *const std::ffi::c_void,
                recv as *mut std::ffi::c_void,
                count,
                nccl_dtype(dtype),
                nsys::ncclRedOp_t::ncclSum,
                self.comm,
                stream as nsys::cudaStream_t,
            )
            .map(|_| ())
            .map_err(|e| nccl_err("ncclReduceScatter", e))
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: the communicator is destroyed once; errors are ignored.
        let _ = unsafe { result::comm_destroy(self.comm) };
    }
}
