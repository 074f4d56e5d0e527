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
//!
//! # Teardown
//! Dropping a communicator waits for its context's work; the memory peers
//! touch is freed only when no peer can touch it any more (the last
//! communicator of the group in this process, after bounded barriers with
//! ranks in other processes). Dropping the ranks of an in-process group one
//! after the other, in any order, right after unsynchronised calls is safe.
//! [`Comm::close`] does the same and reports errors.

mod call;
mod fd_passing;
mod group;
mod ipc;
mod measure;
mod p2p_check;
mod registry;
mod selection_setup;
pub(crate) mod setup;
mod shm;
mod teardown;
mod vmm_buffers;
pub(crate) mod watchdog;

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream};
pub use cudarc::nccl::ReduceOp;

pub use crate::algorithm::epilogue::FusedOptions;
pub use crate::config::{Config, TransportPreference};
pub use crate::element::Element;
pub use call::{CollectivePlan, FusedPlan};
pub use measure::SelectionSource;

use crate::algorithm::launch::ByDtype;
use crate::algorithm::{Algorithm, RankAlgorithms, Transport};
use crate::driver::{self, DeviceMemory, Kernel};
use crate::error::{Error, Result};

/// One rank of a communicator.
pub struct Comm {
    rank: usize,
    world: usize,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    config: Config,
    setup: setup::Setup,
    /// Every algorithm's side of this rank (templates, kernels), built at
    /// init: a call looks nothing up by name.
    algorithms: RankAlgorithms,
    /// The separate epilogue kernel of the unfused path, per dtype.
    add_rms_norm: ByDtype<Kernel>,
    /// The sentinel kernels' trace ring (`Config::trace`),
    /// `TRACE_RECORDS` records.
    trace: Option<DeviceMemory>,
    registry: Mutex<registry::Registry>,
    broken: Mutex<Option<String>>,
    order: Mutex<call::CallOrder>,
    /// This rank's turns on its GPU with other communicators' ranks there.
    device_turn: call::DeviceTurn,
    rendezvous: Arc<dyn crate::rendezvous::Rendezvous>,
    nccl: Option<crate::nccl::NcclComm>,
    selection: crate::select::selection::SelectionTable,
    /// The same for fused calls (`all_reduce_add_rms_norm`, `call/fused_calls.rs`).
    fused_selection: crate::select::selection::SelectionTable,
    /// Ours or NCCL's per block size for the all-gather and reduce-scatter.
    collective_table: crate::select::selection::CollectiveTable,
    topology: crate::select::topology::Topology,
    /// Where `selection` comes from, and the measured table behind it
    /// (measured `auto`, `measure.rs`).
    selection_source: measure::SelectionSource,
    measured: Option<crate::select::tuning::TuningTable>,
    notes: Vec<String>,
    /// Watches the peers in other processes (stopped first at teardown).
    watchdog: Option<watchdog::Watchdog>,
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
    #[cfg(feature = "internals")]
    #[doc(hidden)]
    pub fn topology(&self) -> &crate::select::topology::Topology {
        &self.topology
    }

    /// The precomputed algorithm choice per size bucket.
    #[cfg(feature = "internals")]
    #[doc(hidden)]
    pub fn selection(&self) -> &crate::select::selection::SelectionTable {
        &self.selection
    }

    /// The precomputed choice per size bucket for fused calls
    /// (`all_reduce_add_rms_norm`): times include the epilogue.
    #[cfg(feature = "internals")]
    #[doc(hidden)]
    pub fn fused_selection(&self) -> &crate::select::selection::SelectionTable {
        &self.fused_selection
    }

    /// Ours or NCCL's per block size for the all-gather and reduce-scatter
    /// (built at init from the cost model).
    pub fn collective_table(&self) -> &crate::select::selection::CollectiveTable {
        &self.collective_table
    }

    /// What init decided and why (tuning table used or not, NCCL, topology).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// The NCCL communicator behind the `Nccl` algorithm, if one was created.
    #[cfg(feature = "internals")]
    #[doc(hidden)]
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

    /// Forces an algorithm for later calls of its collective (NCCL: of
    /// every collective; `None`: back to the selection). Takes effect
    /// immediately on this rank; every rank must do the same.
    pub fn set_algorithm(&mut self, algorithm: Option<Algorithm>) -> Result<()> {
        if let Some(a) = algorithm {
            crate::algorithm::availability(a, &self.capabilities(), None).map_err(Error::Unsupported)?;
        }
        self.config.algorithm = algorithm;
        Ok(())
    }

    /// The algorithm forced for calls of `collective`, if any.
    pub(crate) fn forced_for(&self, collective: tp_allreduce_kernels::ids::Collective) -> Option<Algorithm> {
        self.config.algorithm.filter(|a| *a == Algorithm::Nccl || a.collective() == collective)
    }

    /// Forces the launch shape `(blocks, threads)` of later sentinel
    /// (OneShotPush) launches on this rank (`None`: tuning table, else the
    /// default rule). Ranks may use different shapes: the protocol only
    /// needs the same calls on every rank. A shape that does not stay
    /// resident fails the call that would use it.
    pub fn set_launch_shape(&mut self, shape: Option<(u32, u32)>) -> Result<()> {
        if let Some(s) = shape {
            crate::env::check_launch_shape(s).map_err(|why| Error::invalid(format!("launch shape: {why}")))?;
        }
        self.config.launch_shape = shape;
        Ok(())
    }

    /// Most blocks of `threads` threads a sentinel launch may use on this
    /// rank (they stay resident with the other ranks sharing the GPU); 0
    /// for an unsupported block size.
    #[cfg(feature = "internals")]
    #[doc(hidden)]
    pub fn max_sentinel_blocks(&self, threads: u32) -> u32 {
        self.setup.sentinel_resident.cap(threads)
    }

    /// What this communicator offers, the input of the one availability
    /// rule (`algorithm::availability`).
    pub(crate) fn capabilities(&self) -> crate::algorithm::Capabilities {
        crate::algorithm::Capabilities {
            world: self.world,
            transport: self.setup.transport,
            islands: self.setup.island_split,
            one_shot_push_max_bytes: self.setup.layout.one_shot_push_max_packs as usize
                * tp_allreduce_kernels::partition::PACK_BYTES,
            copy_engine: self.setup.layout.copy_engine_pieces > 0,
            nccl_available: self.nccl.is_some(),
        }
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

    /// The per-launch timestamps the sentinel kernels recorded since the
    /// last call (`Config::trace`; one record per generation modulo
    /// `TRACE_RECORDS`, unused ones zero), once the work queued so far on
    /// the communicator's stream completed; the ring is cleared. `None` when
    /// tracing is off. Diagnostics (`bench --trace`); call it only while
    /// this rank's calls are idle.
    #[cfg(feature = "internals")]
    #[doc(hidden)]
    pub fn take_trace_records(&self) -> Result<Option<Vec<tp_allreduce_kernels::params::TraceRecord>>> {
        let _bound = driver::CurrentContext::bind(&self.ctx)?;
        driver::synchronize(&self.stream)?;
        let Some(ring) = &self.trace else { return Ok(None) };
        use tp_allreduce_kernels::params::{TraceRecord, TRACE_RECORDS};
        const WORDS: usize = std::mem::size_of::<TraceRecord>() / 8;
        let mut raw = vec![0u64; TRACE_RECORDS * WORDS];
        driver::memcpy_dtoh(bytemuck::cast_slice_mut(&mut raw), ring.ptr())?;
        let records = raw
            .chunks_exact(WORDS)
            .map(|w| TraceRecord {
                entry_ns: w[0],
                loaded_ns: w[1],
                first_store_ns: w[2],
                last_poll_ns: w[3],
                exit_ns: w[4],
                generation: w[5] as u32,
                shape: (w[5] >> 32) as u32,
                _pad: [0; 2],
            })
            .collect();
        driver::memset_d8(ring.ptr(), 0, TRACE_RECORDS * std::mem::size_of::<TraceRecord>())?;
        Ok(Some(records))
    }

    /// Test-only: this rank's protocol counters after its stream's work:
    /// the OneShotPush generation, block 0's barrier epoch (pull), the
    /// TwoShotPush and Hierarchical generations, ring messages sent and
    /// received (see `Config::test_initial_counter`).
    #[cfg(feature = "internals")]
    #[doc(hidden)]
    pub fn test_counters(&self) -> Result<[u32; 6]> {
        use std::mem::offset_of;
        use tp_allreduce_kernels::layout::LocalState;
        use tp_allreduce_kernels::params::Control;
        let _bound = driver::CurrentContext::bind(&self.ctx)?;
        driver::synchronize(&self.stream)?;
        let base = self.setup.local_state.ptr();
        let read = |offset: usize| -> Result<u32> {
            let mut word = [0u8; 4];
            driver::memcpy_dtoh(&mut word, base + offset as u64)?;
            Ok(u32::from_ne_bytes(word))
        };
        Ok([
            read(offset_of!(LocalState, control) + offset_of!(Control, generation))?,
            read(offset_of!(LocalState, barrier_epoch))?,
            read(offset_of!(LocalState, control) + offset_of!(Control, generation) + 4)?,
            read(offset_of!(LocalState, control) + offset_of!(Control, generation) + 8)?,
            read(offset_of!(LocalState, ring_sent))?,
            read(offset_of!(LocalState, ring_received))?,
        ])
    }

    /// Waits for the communicator's stream, then checks for device errors.
    pub fn synchronize(&self) -> Result<()> {
        let _context = driver::CurrentContext::bind(&self.ctx)?;
        let synced = driver::synchronize(&self.stream);
        self.check()?;
        synced
    }

    pub(super) fn mark_broken(&self, why: String) {
        if let Ok(mut b) = self.broken.lock() {
            if b.is_none() {
                *b = Some(why);
            }
        }
    }
}

impl Comm {
    /// Collective teardown that reports what went wrong: what `drop` does
    /// (see [`Drop`](#impl-Drop-for-Comm)), with the rendezvous timeout as
    /// the bound of each barrier. Returns the first error of waiting for the
    /// device or of the barriers (a rank of another process that did not
    /// arrive is named); the memory is released in every case. Call it on
    /// every rank, like `drop`. In a group of ranks of one process, only the
    /// last one to go runs the barriers, so only its `close` can report them.
    pub fn close(mut self) -> Result<()> {
        let bound = self.config.rendezvous_timeout;
        self.leave(bound)
    }

    /// Waits for this rank's device work, then hands its peer-visible
    /// memory to the process's group of ranks (`teardown.rs`), which frees
    /// it once no peer can touch it any more. Idempotent.
    fn leave(&mut self, bound: std::time::Duration) -> Result<()> {
        // Peers exit after teardown: nothing to watch from here on.
        drop(self.watchdog.take());
        let Some(group) = self.setup.local_group.take() else {
            return Ok(());
        };
        // A call or a graph replay may have run on any stream of the
        // context: wait for all of them.
        let synced = driver::CurrentContext::bind(&self.ctx).and_then(|_context| driver::context_synchronize());
        let registered = self.setup.registered_mappings.get_mut().map(std::mem::take).unwrap_or_default();
        // The per-pair transport's cross region goes with the region.
        let (cross_region, cross_mappings) = self.setup.cross.take().map(|c| (c.region, c.mappings)).unzip();
        let departed = teardown::Departed {
            memory: Box::new((self.setup.region.clone(), cross_region)),
            mappings: Box::new((std::mem::take(&mut self.setup.peer_mappings), registered, cross_mappings)),
            rendezvous: group.meets_other_processes().then(|| self.rendezvous.clone()),
        };
        let released = group.leave(departed, bound);
        synced.and(released)
    }
}

/// Dropping a communicator waits for all work of its CUDA context (a call
/// may have run on any of its streams), then releases its memory in a way
/// that is safe while peers still run:
///
/// * Ranks of this process: the memory peers write into (flags, credits,
///   pushed data) stays allocated until the last communicator of the group
///   in this process is dropped, so dropping ranks one after the other from
///   one thread, in any order, right after unsynchronised calls, is safe;
///   a rank that keeps calling after a peer left gets `Error::Timeout` and
///   writes only into memory that is still allocated.
/// * Ranks in other processes: the last communicator of this process meets
///   them in two barriers (work done; mappings of each other's memory
///   closed) before freeing, each bounded by min(rendezvous timeout, 10 s);
///   a dead peer costs that bound, never a hang. Errors are ignored;
///   [`Comm::close`] reports them.
impl Drop for Comm {
    fn drop(&mut self) {
        self.restore_context.save();
        let bound = self.config.rendezvous_timeout.min(teardown::DROP_BARRIER_BOUND);
        let _ = self.leave(bound);
    }
}
