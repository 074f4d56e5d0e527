//! Constructors: ranks as threads of one process (like `ncclCommInitAll`)
//! and ranks as processes (like `ncclCommInitRank`), and the collective
//! registration helpers for in-process groups. Both paths run the same
//! initialisation (`setup::build`); only the rendezvous differs.

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{sys, CudaStream};
use tp_allreduce_kernels::layout::MAX_RANKS;

use super::selection_setup as selector;
use super::{registry::Registry, setup, Comm};
use crate::algorithm::entries::add_rms_norm_entry;
use crate::algorithm::launch::{ByDtype, RankSetup};
use crate::algorithm::RankAlgorithms;
use crate::config::Config;
use crate::driver::{self, DeviceMemory, KernelModule};
use crate::error::{Error, Result};
use crate::rendezvous::{self, Id, Rendezvous};

impl Comm {
    /// Initialises rank `rank` of `world_size` over an existing rendezvous
    /// (the plug for users' own channels). Collective.
    pub fn from_rendezvous(stream: Arc<CudaStream>, rendezvous: Box<dyn Rendezvous>, config: Config) -> Result<Comm> {
        // Everything below indexes what the rendezvous gathers by rank.
        let rendezvous: Box<dyn Rendezvous> = Box::new(rendezvous::Counted(rendezvous));
        let rank = rendezvous.rank();
        let world = rendezvous.world_size();
        config.validate()?;
        if world == 0 || world > MAX_RANKS || rank >= world {
            return Err(Error::invalid(format!(
                "rank {rank} of world size {world}: the world size must be in 1..={MAX_RANKS} and rank < world size"
            )));
        }
        driver::require_driver()?;
        let ctx = stream.context().clone();
        let _context = driver::CurrentContext::bind(&ctx)?;
        let module = KernelModule::for_context(&ctx)?;
        let (view, mut notes) = selector::rank_view(&ctx, rank, world, &*rendezvous)?;
        let mut config = config;
        if let Some((split, note)) = selector::islands(&view, &config, world)? {
            config.islands = Some(split.groups());
            notes.push(note);
        }
        let setup = setup::build(&stream, rank, world, &*rendezvous, &config, &module)?;
        let trace = if config.trace {
            use tp_allreduce_kernels::params::{TraceRecord, TRACE_RECORDS};
            Some(DeviceMemory::alloc_zeroed(&ctx, TRACE_RECORDS * std::mem::size_of::<TraceRecord>())?)
        } else {
            None
        };
        let memory = setup.memory();
        let algorithms = RankAlgorithms::prepare(&RankSetup {
            rank,
            world,
            transport: setup.transport,
            islands: setup.island_split,
            memory: &memory,
            cross: setup.cross.as_ref().map(|c| &c.regions),
            geometry: setup.geometry(),
            handle: setup.handle.ptr(),
            wait_bounds_ns: config.wait_bounds_ns(),
            trace: trace.as_ref().map(DeviceMemory::ptr),
            one_shot_push_tp2: config.one_shot_push_tp2,
            fused_spread_push: config.fused_spread_push,
            fused_island_kernels: config.fused_island_kernels,
            fused_clusters: setup.fused_clusters,
            module: &module,
            ctx: &ctx,
        })?;
        let add_rms_norm = ByDtype::kernels(&module, add_rms_norm_entry)?;
        // Decided from the gathered placement, the same on every rank: NCCL's
        // creation is collective.
        let nccl = if setup.nccl_eligible {
            match crate::nccl::NcclComm::from_rendezvous(&stream, &*rendezvous) {
                Ok(n) => n,
                Err(e) => {
                    log::warn!(
                        "rank {rank}: NCCL could not be set up ({e}); sizes where NCCL is faster run this \
                         library's algorithms instead"
                    );
                    notes.push(format!("NCCL fallback unavailable: {e}"));
                    None
                }
            }
        } else {
            None
        };
        let (selection, fused_selection, topology, more, table_source, tune_file) =
            selector::build_table(view, &setup, &config, nccl.is_some(), &*rendezvous)?;
        notes.extend(more);
        let collective_table = crate::select::selection::CollectiveTable::build(
            &crate::select::cost_model::CostModel::default(),
            &topology,
            selection.constraints(),
        );
        // The ranks of one communicator in this process share its local
        // group: its id names the communicator in the device's turns.
        let group_identity = setup.local_group.as_ref().map_or(0, |g| g.id());
        let device_turn = super::call::DeviceTurn::register(&ctx, group_identity, config.launch_timeout)?;
        let watchdog = super::watchdog::Watchdog::start(&ctx, setup.watched_peers.clone(), setup.abort_targets(rank))?;
        log::info!(
            "communicator rank {rank} of {world} on GPU {}: transport {}{} ({}); algorithms from {table_source}; \
             bf16 eager: {}; all-gather per block, graph: {}; NCCL {}",
            ctx.ordinal(),
            setup.transport,
            match (setup.transport, setup.island_split) {
                (crate::algorithm::Transport::PerPair, Some(s)) =>
                    format!(" (P2P inside islands {s}, host-staged across)"),
                _ => String::new(),
            },
            setup.transport_reason,
            selection.describe(crate::DType::Bf16, false),
            collective_table.describe(tp_allreduce_kernels::ids::Collective::AllGather, true),
            if nccl.is_some() { "available" } else { "not available" },
        );
        let mut comm = Comm {
            rank,
            world,
            ctx,
            stream,
            config,
            setup,
            algorithms,
            add_rms_norm,
            trace,
            registry: Mutex::new(Registry::default()),
            broken: Mutex::new(None),
            order: Mutex::new(Default::default()),
            device_turn,
            rendezvous: Arc::from(rendezvous),
            nccl,
            selection,
            fused_selection,
            collective_table,
            topology,
            selection_source: match tune_file {
                Some(path) => super::SelectionSource::TuneTable(path),
                None => super::SelectionSource::Model,
            },
            measured: None,
            notes,
            watchdog,
            restore_context: driver::RestoreOnDrop::default(),
        };
        // Measured `auto` (collective; rank 0 decides whether and what).
        comm.measure_at_start()?;
        Ok(comm)
    }

    /// Multi-process: rank `rank` of `world_size`, one per process, joined
    /// through `id` (created by rank 0 with [`Id::new_unix`] or
    /// [`Id::new_tcp`] and passed to the other ranks). Collective.
    pub fn from_rank(stream: Arc<CudaStream>, rank: usize, world_size: usize, id: Id) -> Result<Comm> {
        Self::from_rank_with_config(stream, rank, world_size, id, Config::from_env()?)
    }

    pub fn from_rank_with_config(
        stream: Arc<CudaStream>,
        rank: usize,
        world_size: usize,
        id: Id,
        config: Config,
    ) -> Result<Comm> {
        let rdv = rendezvous::connect(&id, rank, world_size, config.rendezvous_timeout)?;
        Self::from_rendezvous(stream, rdv, config)
    }

    /// In-process: one rank per stream (ranks may share a device). Blocks
    /// while all ranks initialise (one thread each).
    pub fn from_streams(streams: Vec<Arc<CudaStream>>, config: Config) -> Result<Vec<Comm>> {
        let world = streams.len();
        if world == 0 || world > MAX_RANKS {
            return Err(Error::invalid(format!("from_streams: 1..={MAX_RANKS} streams, got {world}")));
        }
        let rdvs = rendezvous::in_process_group(world, config.rendezvous_timeout);
        let results: Vec<Result<Comm>> = std::thread::scope(|scope| {
            let handles: Vec<_> = streams
                .into_iter()
                .zip(rdvs)
                .map(|(stream, rdv)| {
                    let config = config.clone();
                    scope.spawn(move || Comm::from_rendezvous(stream, rdv, config))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(Error::Broken("rank init thread panicked".into()))))
                .collect()
        });
        // Report the root cause: a rank's own failure rather than the
        // rendezvous errors it caused on the others.
        let mut comms = Vec::with_capacity(world);
        let mut first_err: Option<Error> = None;
        for r in results {
            match r {
                Ok(c) => comms.push(c),
                Err(e) => {
                    let secondary = matches!(e, Error::Rendezvous(_) | Error::RendezvousTimeout { .. });
                    if first_err.is_none() || (!secondary && first_err.as_ref().is_some_and(is_rendezvous_error)) {
                        first_err = Some(e);
                    }
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(comms),
        }
    }

    /// Runs a collective method on every rank of an in-process group at once
    /// (one thread per rank) and returns rank 0's result or the first error.
    pub fn group_call<T: Send>(comms: &[Comm], f: impl Fn(&Comm) -> Result<T> + Sync) -> Result<Vec<T>> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = comms.iter().map(|c| scope.spawn(|| f(c))).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(Error::Broken("rank thread panicked".into()))))
                .collect()
        })
    }

    /// [`register_graph_buffers`](Self::register_graph_buffers) on every rank
    /// of an in-process group.
    pub fn register_graph_buffers_group(comms: &[Comm]) -> Result<usize> {
        Ok(Self::group_call(comms, |c| c.register_graph_buffers())?.first().copied().unwrap_or(0))
    }

    /// [`deregister_buffers`](Self::deregister_buffers) on every rank of an
    /// in-process group; returns rank 0's count.
    pub fn deregister_buffers_group(comms: &[Comm]) -> Result<usize> {
        Ok(Self::group_call(comms, |c| c.deregister_buffers())?.first().copied().unwrap_or(0))
    }

    /// [`register_buffer`](Self::register_buffer) on every rank of an
    /// in-process group; `buffers[r]` is rank r's buffer.
    pub fn register_buffer_group(comms: &[Comm], buffers: &[(sys::CUdeviceptr, usize)]) -> Result<()> {
        if buffers.len() != comms.len() {
            return Err(Error::invalid("register_buffer_group: one buffer per rank"));
        }
        std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .iter()
                .zip(buffers.iter())
                .map(|(c, &(p, n))| scope.spawn(move || c.register_buffer(p, n)))
                .collect();
            for h in handles {
                h.join().unwrap_or_else(|_| Err(Error::Broken("rank thread panicked".into())))?;
            }
            Ok(())
        })
    }

    /// The rendezvous timeout in effect (for callers building their own).
    pub fn rendezvous_timeout(&self) -> Duration {
        self.config.rendezvous_timeout
    }
}

fn is_rendezvous_error(e: &Error) -> bool {
    matches!(e, Error::Rendezvous(_) | Error::RendezvousTimeout { .. })
}
