//! Turning one allreduce call into kernel launches: which algorithm, which
//! grid, how the message is split into launches, and (pull algorithms) how
//! the input becomes peer-visible.

use cudarc::driver::sys;
use tp_allreduce_kernels::ids::DType;
use tp_allreduce_kernels::layout::{PACK_BYTES, THREADS_PER_BLOCK};
use tp_allreduce_kernels::partition::{div_ceil, packs_for, push_grid};

use super::registry::InputSource;
use super::{CallPlan, Comm};
use crate::algorithm::Algorithm;
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

/// Packs one launch of `algorithm` may handle.
fn launch_capacity_packs(comm: &Comm, algorithm: Algorithm) -> u64 {
    let layout = &comm.setup.layout;
    match algorithm {
        Algorithm::OneShotPush => layout.one_shot_push_max_packs,
        // Ring streams any size through its FIFOs.
        Algorithm::Ring => u64::MAX / 2,
        _ => layout.max_packs,
    }
}

/// Grid of one launch of `algorithm` over `packs` packs.
fn grid_for(comm: &Comm, algorithm: Algorithm, packs: u64) -> u32 {
    let s = &comm.setup;
    let l = &s.layout;
    let world = comm.world as u64;
    let threads = THREADS_PER_BLOCK as u64;
    match algorithm {
        Algorithm::OneShotPull => div_ceil(packs, threads).clamp(1, s.pull_max_blocks as u64) as u32,
        Algorithm::TwoShotPull => div_ceil(div_ceil(packs, world), threads).clamp(1, s.pull_max_blocks as u64) as u32,
        Algorithm::OneShotPush => push_grid(packs, threads, l.one_shot_push_stripe_packs, l.push_blocks),
        Algorithm::TwoShotPush => {
            push_grid(div_ceil(packs, world), threads, l.two_shot_push_stripe_packs, l.push_blocks)
        }
        Algorithm::Hierarchical => {
            push_grid(div_ceil(packs, l.island_size.max(1) as u64), threads, l.hierarchical_stripe_packs, l.push_blocks)
        }
        Algorithm::Ring => {
            let per_block = l.ring_chunk_packs.max(1) * world;
            div_ceil(packs, per_block).clamp(1, s.ring_blocks as u64) as u32
        }
        Algorithm::Nccl => 0,
    }
}

/// Splits `count` elements into launches of at most `cap_packs` packs each
/// (chunk boundaries on pack boundaries keep 16-byte alignment).
fn chunks(count: usize, dtype: DType, cap_packs: u64) -> impl Iterator<Item = (usize, usize)> {
    let per_pack = tp_allreduce_kernels::partition::elems_per_pack(dtype);
    let cap_elems = (cap_packs.min((usize::MAX / PACK_BYTES) as u64) as usize).saturating_mul(per_pack).max(per_pack);
    (0..count).step_by(cap_elems).map(move |start| (start, cap_elems.min(count - start)))
}

impl Comm {
    fn kernel(&self, algorithm: Algorithm, dtype: DType) -> Result<sys::CUfunction> {
        let id = algorithm.kernel().ok_or_else(|| Error::invalid("NCCL has no kernel of ours"))?;
        self.module.function(&crate::kernels::entry_name(id, dtype))
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
        self.setup.available(algorithm).map_err(Error::Unsupported)?;
        let f = self.kernel(algorithm, dtype)?;
        let elem = dtype.size_bytes() as u64;
        for (start, n) in chunks(count, dtype, launch_capacity_packs(self, algorithm)) {
            let grid = grid_for(self, algorithm, packs_for(n as u64, dtype));
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
        self.setup.available(algorithm).map_err(Error::Unsupported)?;
        let f = self.kernel(algorithm, dtype)?;
        let elem = dtype.size_bytes();
        // OneShotPull writes the output while peers still read the input, so
        // in place it must read from a staged copy.
        let must_stage = algorithm == Algorithm::OneShotPull && send == recv;
        let source = self.input_source(send, count * elem, capturing, must_stage)?;
        for (start, n) in chunks(count, dtype, launch_capacity_packs(self, algorithm)) {
            let grid = grid_for(self, algorithm, packs_for(n as u64, dtype));
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
