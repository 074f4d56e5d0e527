//! The communicator: one per rank. Shaped like `cudarc::nccl::Comm` so code
//! written against it (candle, mistral.rs) can switch with few changes:
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use cudarc::driver::CudaContext;
//! # use tp_allreduce::{Comm, Config, ReduceOp};
//! # fn main() -> tp_allreduce::Result<()> {
//! // In-process: one rank per stream (like ncclCommInitAll).
//! let ctx = CudaContext::new(0).unwrap();
//! let streams = vec![ctx.new_stream().unwrap(), ctx.new_stream().unwrap()];
//! let comms = Comm::from_streams(streams.clone(), Config::default())?;
//! let send = streams[0].clone_htod(&[1.0f32; 1024]).unwrap();
//! let mut recv = streams[0].alloc_zeros::<f32>(1024).unwrap();
//! comms[0].all_reduce(&send, &mut recv, &ReduceOp::Sum)?; // (and the same on rank 1)
//! # Ok(()) }
//! ```
//!
//! Multi-process: `Comm::from_rank(stream, rank, world_size, id)` with an
//! [`Id`](crate::rendezvous::Id) created by rank 0 and passed to the others.
//!
//! # Which buffers may be passed
//! Any device buffer of the communicator's context. Push algorithms read the
//! input locally and write into library-owned scratch, so they need nothing
//! else. Pull algorithms read peers' *inputs*: an input that is not
//! registered is first copied into the rank's staging buffer (one extra
//! device copy); `register_buffer` makes a buffer zero-copy; in a captured
//! graph each call records its input and `register_graph_buffers` (after
//! capture, on every rank) makes the replays zero-copy. See ARCHITECTURE.md.

mod call;
mod group;
mod ipc;
mod p2p_check;
mod registry;
mod selection_setup;
pub(crate) mod setup;
mod shm;
#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod test_hooks;
#[cfg(not(feature = "tools"))]
mod test_hooks;

use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaStream, DevicePtr, DevicePtrMut};
pub use cudarc::nccl::ReduceOp;
use tp_allreduce_kernels::layout::ErrorRecord;

pub use crate::config::{Config, TransportPreference};

use crate::algorithm::{Algorithm, Transport};
use crate::driver::{self, KernelModule};
use crate::error::{DeviceFailure, Error, Result};
use crate::DType;

/// Element types the allreduce accepts (accumulated in f32).
pub trait Element: cudarc::driver::DeviceRepr {
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::Bf16;
}

/// One rank of a communicator.
pub struct Comm {
    rank: usize,
    world: usize,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    module: Arc<KernelModule>,
    config: Config,
    setup: setup::Setup,
    registry: Mutex<registry::Registry>,
    broken: Mutex<Option<String>>,
    rendezvous: Box<dyn crate::rendezvous::Rendezvous>,
    nccl: Option<crate::nccl::NcclComm>,
    selection: crate::select::selection::SelectionTable,
    topology: crate::select::topology::Topology,
    notes: Vec<String>,
    /// Last field: restores the caller's current context after every other field's drop.
    restore_context: driver::RestoreOnDrop,
}

/// What a call will do: the algorithm, how the input reaches peers, why.
#[derive(Clone, Debug, PartialEq)]
pub struct CallPlan {
    pub algorithm: Algorithm,
    pub transport: Transport,
    pub reason: String,
}

impl Comm {
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world
    }

    pub fn stream(&self) -> Arc<CudaStream> {
        self.stream.clone()
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The transport the communicator settled on at init.
    pub fn transport(&self) -> Transport {
        self.setup.transport
    }

    /// Why the transport was chosen (e.g. the P2P check failed on a pair).
    pub fn transport_reason(&self) -> &str {
        &self.setup.transport_reason
    }

    /// How many ranks of this communicator share this rank's GPU.
    pub fn ranks_on_device(&self) -> usize {
        self.setup.ranks_on_device
    }

    /// The rank view of the machine the selection models.
    pub fn topology(&self) -> &crate::select::topology::Topology {
        &self.topology
    }

    /// The precomputed algorithm choice per size bucket.
    pub fn selection(&self) -> &crate::select::selection::SelectionTable {
        &self.selection
    }

    /// What init decided and why (tuning table used or not, NCCL, topology).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// The NCCL communicator behind the `Nccl` algorithm, if one was created.
    pub fn nccl(&self) -> Option<&crate::nccl::NcclComm> {
        self.nccl.as_ref()
    }

    /// Whether an NCCL communicator backs the `Nccl` algorithm.
    pub fn has_nccl(&self) -> bool {
        self.nccl.is_some()
    }

    /// Collective: every rank's `mine`, in rank order, through the
    /// communicator's rendezvous (small host-side messages only).
    pub fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.rendezvous.all_gather(mine)
    }

    /// Forces an algorithm for later calls (`None`: back to the selection).
    /// Takes effect immediately on this rank; every rank must do the same.
    pub fn set_algorithm(&mut self, algorithm: Option<Algorithm>) -> Result<()> {
        if let Some(a) = algorithm {
            self.setup.available(a).map_err(Error::Unsupported)?;
        }
        self.config.algorithm = algorithm;
        Ok(())
    }

    /// Allreduce (sum) of `send` into `recv` on the communicator's stream.
    pub fn all_reduce<S: DevicePtr<T>, R: DevicePtrMut<T>, T: Element>(
        &self,
        send: &S,
        recv: &mut R,
        op: &ReduceOp,
    ) -> Result<()> {
        check_op(op)?;
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        if send.len() != recv.len() {
            return Err(Error::invalid(format!(
                "all_reduce: send has {} elements, recv has {}",
                send.len(),
                recv.len()
            )));
        }
        let count = send.len();
        let (src, _src_guard) = send.device_ptr(&self.stream);
        let (dst, _dst_guard) = recv.device_ptr_mut(&self.stream);
        // SAFETY: both pointers come from live cudarc buffers of `count`
        // elements, borrowed for the duration of the (stream-ordered) call.
        unsafe { self.all_reduce_raw(src, dst, count, T::DTYPE, self.stream.cu_stream()) }
    }

    /// In-place allreduce (sum) of `buf`.
    pub fn all_reduce_in_place<R: DevicePtrMut<T>, T: Element>(&self, buf: &mut R, op: &ReduceOp) -> Result<()> {
        check_op(op)?;
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        let count = buf.len();
        let (ptr, _guard) = buf.device_ptr_mut(&self.stream);
        // SAFETY: as in `all_reduce`.
        unsafe { self.all_reduce_raw(ptr, ptr, count, T::DTYPE, self.stream.cu_stream()) }
    }

    /// Allreduce (sum) of raw device pointers, for callers not on cudarc.
    ///
    /// # Safety
    /// `send` and `recv` must be device pointers of this communicator's
    /// context, valid for `count` elements of `dtype` until the work queued on
    /// `stream` completes (they may be equal for in-place). `stream` must be a
    /// live stream of the communicator's context. Every rank must issue the
    /// same sequence of calls (sizes and dtypes).
    pub unsafe fn all_reduce_raw(
        &self,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.check()?;
        if count == 0 {
            return Ok(());
        }
        if send == 0 || recv == 0 {
            return Err(Error::invalid("all_reduce: null device pointer"));
        }
        let elem = dtype.size_bytes() as u64;
        if send % elem != 0 || recv % elem != 0 {
            return Err(Error::invalid(format!(
                "all_reduce: pointers must be aligned to the {}-byte element size",
                elem
            )));
        }
        let bytes =
            count.checked_mul(dtype.size_bytes()).ok_or_else(|| Error::invalid("all_reduce: count overflows"))?;
        let overlap = send != recv && ranges_overlap(send, recv, bytes as u64);
        if overlap {
            return Err(Error::invalid("all_reduce: send and recv overlap without being equal"));
        }
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        for (what, ptr) in [("send", send), ("recv", recv)] {
            self.validate_device_range(what, ptr, bytes, count, dtype)?;
        }
        // SAFETY: the caller guarantees `stream` is a live stream (contract of this fn).
        let stream_ctx = unsafe { driver::stream_context(stream)? };
        if stream_ctx != self.ctx.cu_ctx() {
            return Err(Error::invalid("all_reduce: the stream belongs to another CUDA context than the communicator"));
        }
        if self.world == 1 {
            if send != recv {
                // SAFETY: live stream of our context; pointers checked above.
                unsafe { driver::memcpy_dtod_async(recv, send, bytes, stream)? };
            }
            return Ok(());
        }
        // SAFETY: as above.
        let capturing = unsafe { driver::is_capturing(stream)? };
        match call::choose(self, bytes, dtype, capturing) {
            Algorithm::Nccl => self.nccl_all_reduce(send, recv, count, dtype, stream),
            a if a.reads_peer_inputs() => self.run_pull(a, send, recv, count, dtype, stream, capturing),
            a => self.run_push(a, send, recv, count, dtype, stream),
        }
        .inspect_err(|e| {
            if e.breaks_communicator() {
                self.mark_broken(e.to_string());
            }
        })
    }

    /// The plan for a call of `bytes` (what `all_reduce` would do).
    pub fn plan_call(&self, bytes: usize, dtype: DType, capturing: bool, in_place: bool) -> CallPlan {
        call::plan(self, bytes, dtype, capturing, in_place)
    }

    /// Checks the error record the kernels write (no synchronisation).
    /// After an error the communicator is unusable and every call fails.
    pub fn check(&self) -> Result<()> {
        if let Some(why) = self.broken.lock().map_err(|_| Error::Broken("state lock poisoned".into()))?.as_ref() {
            return Err(Error::Broken(why.clone()));
        }
        if let Some(failure) = self.read_error_record() {
            let err = failure.into_error();
            self.mark_broken(err.to_string());
            return Err(err);
        }
        Ok(())
    }

    /// Waits for the communicator's stream, then checks for device errors.
    pub fn synchronize(&self) -> Result<()> {
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        let synced = driver::synchronize(&self.stream);
        self.check()?;
        synced
    }

    /// Checks that `ptr..ptr+bytes` is device memory of this context (a
    /// wrong count or dtype in the raw API shows up as an overrun).
    fn validate_device_range(&self, what: &str, ptr: u64, bytes: usize, count: usize, dtype: DType) -> Result<()> {
        match driver::allocation_range(ptr) {
            Ok((base, size)) => {
                if ptr + bytes as u64 > base + size as u64 {
                    return Err(Error::invalid(format!(
                        "all_reduce: {what} holds {} bytes from {ptr:#x}, but {count} x {} needs {bytes} \
                         (wrong count or dtype?)",
                        base + size as u64 - ptr,
                        dtype.name()
                    )));
                }
                Ok(())
            }
            // Some allocations (e.g. virtual-memory mappings) have no
            // address range; accept them if they belong to this context.
            Err(_) => match driver::pointer_context(ptr) {
                Some(c) if c == self.ctx.cu_ctx() => Ok(()),
                _ => Err(Error::invalid(format!(
                    "all_reduce: {what} ({ptr:#x}) is not device memory of the communicator's context"
                ))),
            },
        }
    }

    fn read_error_record(&self) -> Option<DeviceFailure> {
        let rec = self.setup.error_record.host_ptr() as *const ErrorRecord;
        // SAFETY: `rec` points to the pinned, mapped record owned by `setup`;
        // the device writes `published` last with a release store, so after
        // observing it (volatile read + acquire fence) the fields are complete.
        unsafe {
            let published = std::ptr::read_volatile(&(*rec).published);
            if published == 0 {
                return None;
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            let copy = std::ptr::read_volatile(rec);
            Some(DeviceFailure::from_record(&copy))
        }
    }

    fn mark_broken(&self, why: String) {
        if let Ok(mut b) = self.broken.lock() {
            if b.is_none() {
                *b = Some(why);
            }
        }
    }

    fn nccl_all_reduce(
        &self,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()> {
        match &self.nccl {
            Some(nccl) => nccl.all_reduce(send, recv, count, dtype, stream),
            None => Err(Error::Nccl("the NCCL algorithm was selected but no NCCL communicator exists".into())),
        }
    }
}

fn check_op(op: &ReduceOp) -> Result<()> {
    match op {
        ReduceOp::Sum => Ok(()),
        ReduceOp::Prod => Err(Error::Unsupported("ReduceOp::Prod: tp-allreduce implements sum only; use NCCL".into())),
        ReduceOp::Max => Err(Error::Unsupported("ReduceOp::Max: tp-allreduce implements sum only; use NCCL".into())),
        ReduceOp::Min => Err(Error::Unsupported("ReduceOp::Min: tp-allreduce implements sum only; use NCCL".into())),
        ReduceOp::Avg => Err(Error::Unsupported(
            "ReduceOp::Avg: tp-allreduce implements sum only; sum, then scale by 1/world_size".into(),
        )),
    }
}

fn ranges_overlap(a: u64, b: u64, len: u64) -> bool {
    a < b.saturating_add(len) && b < a.saturating_add(len)
}

impl Drop for Comm {
    fn drop(&mut self) {
        // Outstanding work may still use our memory: wait for the stream
        // (errors are ignored: nothing useful can be done in drop).
        self.restore_context.save();
        if let Ok(_context) = driver::CurrentContext::bind(&self.ctx) {
            let _ = driver::synchronize(&self.stream);
        }
    }
}
