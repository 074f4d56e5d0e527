//! Turning one allreduce call into kernel launches: which algorithm, which
//! grid, how the message is split into launches, and (pull algorithms) how
//! the input becomes peer-visible.

use cudarc::driver::sys;
use tp_allreduce_kernels::ids::DType;
use tp_allreduce_kernels::layout::{PACK_BYTES, THREADS_PER_BLOCK};
use tp_allreduce_kernels::partition::packs_for;

use super::registry::InputSource;
use super::{CallPlan, Comm};
use crate::algorithm::Algorithm;
use crate::algorithms::{self, AlgorithmHost};
use crate::driver::{self, KernelArgs};
use crate::error::{Error, Result};

/// The algorithm for one call: the forced one, else the selection table's
/// choice for this size bucket (no allocation).
pub(super) fn choose(comm: &Comm, bytes: usize, dtype: DType, capturing: bool) -> Algorithm {
    comm.config.algorithm.unwrap_or_else(|| comm.selection.lookup(bytes, dtype, capturing).algorithm)
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
fn chunks(count: usize, dtype: DType, cap_packs: u64) -> impl Iterator<Item = (usize, usize)> {
    let per_pack = tp_allreduce_kernels::partition::elems_per_pack(dtype);
    let cap_elems = (cap_packs.min((usize::MAX / PACK_BYTES) as u64) as usize).saturating_mul(per_pack).max(per_pack);
    (0..count).step_by(cap_elems).map(move |start| (start, cap_elems.min(count - start)))
}

impl Comm {
    /// The host side and kernel of `algorithm` for `dtype`, once the one
    /// availability rule allows it here.
    fn prepare(&self, algorithm: Algorithm, dtype: DType) -> Result<(&'static dyn AlgorithmHost, sys::CUfunction)> {
        algorithms::availability(algorithm, &self.capabilities(), None).map_err(Error::Unsupported)?;
        let host = algorithms::host(algorithm).ok_or_else(|| Error::invalid("NCCL has no kernel of ours"))?;
        Ok((host, self.module.function(&crate::kernels::entry_name(host.kernel(), dtype))?))
    }

    pub(super) fn run_push(
        &self,
        algorithm: Algorithm,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()> {
        let (host, f) = self.prepare(algorithm, dtype)?;
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

    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_pull(
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
