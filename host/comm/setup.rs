//! Communicator initialisation, the same for ranks that are threads of one
//! process and for ranks that are processes ([`build`]):
//!
//! 1. **Placement** (all-gather, `setup/placement.rs`): process token, GPU UUID, SM count,
//!    occupancy, configuration shape. Ranks sharing a GPU are counted and the
//!    per-launch block limits agreed so that every block of every rank can be
//!    resident at once (the cross-rank barriers need it).
//! 2. **Reachability** (all-gather): which peers each rank can reach with
//!    P2P; the first transport is chosen ([`initial_transport`]).
//! 3. **Allocate** the rank's peer-visible region (signal block | scratch |
//!    staging) with `cuMemAlloc` (pinned host memory for HostStaged), its
//!    private state, the device handle, the error record and the table of
//!    registered buffers.
//! 4. **Map** (all-gather): every rank offers its region (an address for
//!    peers in its process, an IPC handle or shared-memory name for the
//!    others, see `ipc.rs`), maps every peer's region and all-gathers how
//!    that went.
//! 5. **P2P check** (`p2p_check.rs`): the real protocol moves a known
//!    pattern over every pair.
//!
//! A problem in step 4 or 5 on any rank is seen by all of them; `verdict`
//! (`setup/transport.rs`)
//! then switches an `Auto` communicator to HostStaged on every rank
//! (repeating steps 3-5) or fails a forced transport on every rank with an
//! error naming the pair. Everything allocated or opened is owned by RAII
//! values and released on every path; the caller's current context is
//! restored on return.

#![forbid(unsafe_code)]

use std::mem::{offset_of, size_of};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaStream};
use serde::{Deserialize, Serialize};
use tp_allreduce_kernels::layout::{
    Control, DeviceHandle, ErrorRecord, IslandLayout, LocalState, PeerPointers, ScratchConfig, ScratchLayout,
    SignalBlock, PACK_BYTES, SENTINEL_EMPTY_WORD,
};

use super::ipc::{self, BufferOffer, PeerMapping, Region};
use super::p2p_check::{self, TransportProblem};
use super::shm::SharedHostRegion;
use super::teardown::LocalGroup;
use crate::algorithm::{Geometry, IslandSplit, RankMemory, ResidentBlocks, Transport, CE_MAX_PIECES};
use crate::config::{Config, TransportPreference};
use crate::driver::{self, CurrentContext, DeviceMemory, KernelModule, PinnedHostMemory};
use crate::error::{Error, Result};
use crate::rendezvous::{all_gather_json, Rendezvous};
use crate::test_hooks;
use per_pair::CrossSetup;
use placement::{agree_placement, Placement};
use transport::{initial_transport, verdict, Step, Verdict};

pub(crate) mod per_pair;
mod placement;
mod transport;

/// A random token identifying this process (pids collide across containers).
pub(crate) fn process_token() -> &'static str {
    static TOKEN: OnceLock<String> = OnceLock::new();
    TOKEN.get_or_init(|| {
        let mut bytes = [0u8; 16];
        if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
            use std::io::Read;
            let _ = f.read_exact(&mut bytes);
        }
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let mixed = u128::from_le_bytes(bytes) ^ t ^ ((std::process::id() as u128) << 64);
        format!("{mixed:032x}")
    })
}

/// Offsets inside a rank's peer-visible region.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RegionOffsets {
    pub scratch: usize,
    pub staging: usize,
    pub total: usize,
}

/// Everything a rank holds after init.
pub(crate) struct Setup {
    pub transport: Transport,
    pub transport_reason: String,
    pub ranks_on_device: usize,
    /// NCCL backs the `Nccl` algorithm: the same on every rank (no two
    /// ranks share a GPU and every rank asks for it).
    pub nccl_eligible: bool,
    pub same_process: Vec<bool>,
    /// Ranks in other processes of this pid namespace (the watchdog).
    pub watched_peers: Vec<(usize, crate::comm::watchdog::ProcessIdentity)>,
    pub layout: ScratchLayout,
    /// The islands Hierarchical runs on (two or more), if any.
    pub island_split: Option<IslandSplit>,
    /// The per-pair transport's host-memory cross regions.
    pub cross: Option<CrossSetup>,
    pub offsets: RegionOffsets,
    pub pull_max_blocks: u32,
    pub ring_blocks: u32,
    /// Fused calls may spread rows over thread-block clusters (agreed by
    /// every rank: `Placement::fused_clusters`).
    pub fused_clusters: bool,
    /// Shared with the teardown, which frees it once no peer can touch it.
    pub region: Arc<Region>,
    /// Held for their `Drop` (peers' regions stay mapped while we run).
    pub peer_mappings: Vec<PeerMapping>,
    /// This process's ranks of the communicator (see `teardown.rs`); taken
    /// by the communicator's drop or `close`.
    pub local_group: Option<Arc<LocalGroup>>,
    pub local_state: DeviceMemory,
    pub handle: DeviceMemory,
    /// Shared with the watchdog, which may publish a record into it.
    pub error_record: Arc<PinnedHostMemory>,
    pub table: DeviceMemory,
    pub table_capacity: usize,
    /// Extra mappings opened for registered buffers (kept alive).
    pub registered_mappings: Mutex<Vec<PeerMapping>>,
    /// Every rank's region as this rank maps it (sentinel parameter templates).
    pub region_bases: Vec<u64>,
    /// Resident blocks of a sentinel kernel per block size (launch shapes).
    pub sentinel_resident: ResidentBlocks,
}

impl Setup {
    /// What the watchdog raises when a peer process is gone.
    pub fn abort_targets(&self, rank: usize) -> crate::comm::watchdog::AbortTargets {
        use std::mem::offset_of;
        use tp_allreduce_kernels::layout::Control;
        let control = self.local_state.ptr() + offset_of!(LocalState, control) as u64;
        crate::comm::watchdog::AbortTargets {
            rank,
            record: self.error_record.clone(),
            error_claim: control + offset_of!(Control, error_claim) as u64,
            control_abort: control + offset_of!(Control, abort) as u64,
            signal_abort: self.region.device_ptr() + offset_of!(SignalBlock, abort) as u64,
        }
    }

    /// What launch grids and capacities follow from (set at init).
    pub fn geometry(&self) -> Geometry {
        Geometry {
            world: self.same_process.len() as u32,
            layout: self.layout,
            pull_max_blocks: self.pull_max_blocks,
            ring_blocks: self.ring_blocks,
            sentinel_resident: self.sentinel_resident,
        }
    }

    /// Device address of registered-buffer table entry `index`.
    pub fn table_entry(&self, index: usize) -> u64 {
        self.table.ptr() + (index * size_of::<PeerPointers>()) as u64
    }

    pub fn staging_ptr(&self) -> u64 {
        self.region.device_ptr() + self.offsets.staging as u64
    }
}

/// Runs the init sequence (module docs) for `rank` on `stream`.
pub(crate) fn build(
    stream: &Arc<CudaStream>,
    rank: usize,
    world: usize,
    rdv: &dyn Rendezvous,
    config: &Config,
    module: &Arc<KernelModule>,
) -> Result<Setup> {
    let ctx = stream.context().clone();
    let _bound = CurrentContext::bind(&ctx)?;
    let placement = agree_placement(&ctx, module, rank, rdv, config)?;
    // Joined before the next round, so no rank of this process can leave
    // before every one of them has joined.
    let local_group = super::teardown::join(&placement.job, placement.same_process.iter().any(|same| !same));
    let split = island_split(world, config)?;
    let unreachable = reachability(&ctx, &placement, rdv, split)?;
    let (mut transport, mut reason) = initial_transport(config.transport, &unreachable, split)?;
    if config.transport == TransportPreference::Auto && transport != Transport::PeerToPeer {
        log::warn!("rank {rank}: {reason} (slower than P2P)");
    }
    let islands = island_layout(rank, split);
    let resident = placement::resident_blocks(module, placement.hellos[rank].sms, placement.ranks_on_device)?;
    loop {
        let mut attempt = allocate(&ctx, (rank, world), config, transport, &placement, split)?;
        let (mut problems, peer_bases) =
            map_peers(&ctx, (rank, world), rdv, (transport, split), &placement, &mut attempt)?;
        let mut cross = None;
        if let (Transport::PerPair, Some(s), true) = (transport, split, problems.is_empty()) {
            let (c, more) = per_pair::map_cross_regions(&ctx, (rank, world), rdv, &placement, (&attempt.layout, &s))?;
            (cross, problems) = (Some(c), more);
        }
        let mut step = Step::Map;
        if problems.is_empty() {
            write_handle(&attempt, (rank, world), transport, &peer_bases, &islands, config)?;
            if config.check_p2p {
                step = Step::Check;
                let ptrs = (attempt.region.device_ptr(), attempt.local_state.ptr(), &attempt.handle);
                let salts = (placement.salt, p2p_check_salt(transport, rank, placement.salt));
                problems = match (transport, split) {
                    (Transport::PerPair, Some(s)) => {
                        let ptrs = (ptrs.0, ptrs.1, attempt.error_record.device_ptr());
                        per_pair::check_island(stream, module, ptrs, (rank, &s), &peer_bases, rdv, salts, config)?
                    }
                    _ => p2p_check::run(stream, module, ptrs, (rank, world), rdv, salts)?,
                };
            }
        }
        match verdict(config.transport, transport, step, &problems) {
            Verdict::Keep => {
                if transport != Transport::PeerToPeer {
                    if let Some(why) = relaxed_ordering_enabled() {
                        log::warn!(
                            "rank {rank}: {why}: the host-staged protocol assumes a GPU's posted writes to host \
                             memory stay in order (ARCHITECTURE.md, the memory-ordering contract); with relaxed \
                             ordering a call can lose a payload and fail with a timeout"
                        );
                    }
                }
                let sentinel = (peer_bases, resident);
                let mut setup = attempt.into_setup(transport, reason, &placement, config, sentinel);
                (setup.island_split, setup.cross) = (split, cross);
                return Ok(Setup { local_group: Some(local_group), ..setup });
            }
            // `attempt` is dropped here: its memory and mappings released.
            Verdict::FallBack(why) => {
                log::warn!("rank {rank}: {why} (slower than P2P)");
                (transport, reason) = (Transport::HostStaged, why);
            }
            Verdict::Fail(e) => return Err(e),
        }
    }
}

/// Why this host's NVIDIA driver may set PCIe Relaxed Ordering on the GPU's
/// outbound writes, if it says so: `EnablePCIERelaxedOrderingMode: 1` in
/// `/proc/driver/nvidia/params` (its default is 0, docs/SOURCES.md \[F43\]).
/// `None` when the file says 0 or cannot be read.
fn relaxed_ordering_enabled() -> Option<String> {
    let params = std::fs::read_to_string("/proc/driver/nvidia/params").ok()?;
    relaxed_ordering_in(&params)
}

/// [`relaxed_ordering_enabled`] of the file's text. Pure.
fn relaxed_ordering_in(params: &str) -> Option<String> {
    let line = params.lines().find(|l| l.trim_start().starts_with("EnablePCIERelaxedOrderingMode:"))?;
    let value = line.split(':').nth(1)?.trim();
    (value != "0").then(|| format!("the NVIDIA driver sets PCIe Relaxed Ordering ({})", line.trim()))
}

/// The salt this rank's check kernel runs with (another one only under a
/// test hook, on the P2P transport).
fn p2p_check_salt(transport: Transport, rank: usize, salt: u32) -> u32 {
    match transport {
        Transport::PeerToPeer | Transport::PerPair => test_hooks::p2p_check_kernel_salt(rank, salt),
        Transport::HostStaged => salt,
    }
}

/// Step 2: the rank pairs without P2P access. Devices are identified by
/// UUID (`cuDeviceGet` + `cuDeviceGetUuid`), so no context is created on
/// any GPU. (A test hook removes the pairs across islands.)
fn reachability(
    ctx: &CudaContext,
    placement: &Placement,
    rdv: &dyn Rendezvous,
    split: Option<IslandSplit>,
) -> Result<Vec<(usize, usize)>> {
    let my_uuid = driver::device_uuid(ctx.cu_device())?;
    let mut reach = Vec::with_capacity(placement.hellos.len());
    for h in &placement.hellos {
        let ok = if h.device_uuid == my_uuid {
            true
        } else {
            match driver::ordinal_with_uuid(&h.device_uuid)? {
                Some(ordinal) => driver::can_access_peer(ctx.cu_device(), driver::device(ordinal)?)?,
                // Not visible here (per-process CUDA_VISIBLE_DEVICES): mapping
                // and the transfer check decide.
                None => true,
            }
        };
        reach.push(ok);
    }
    let reach_all: Vec<Vec<bool>> = all_gather_json(rdv, &reach)?;
    let hook = split.filter(|_| test_hooks::no_p2p_across_islands());
    Ok(reach_all
        .iter()
        .enumerate()
        .flat_map(|(r, row)| {
            let cut = move |p: usize| hook.is_some_and(|s| !s.together(r, p));
            row.iter().enumerate().filter(move |(p, ok)| !**ok || cut(*p)).map(move |(p, _)| (r, p))
        })
        .collect())
}

/// The islands of the configuration (`Config::islands`, resolved at init
/// from the topology unless configured, else `Config::island_size`): two
/// or more, or none.
fn island_split(world: usize, config: &Config) -> Result<Option<IslandSplit>> {
    let split = match (&config.islands, config.island_size) {
        (Some(groups), _) => IslandSplit::from_groups(groups, world),
        (None, Some(m)) => IslandSplit::consecutive(m, world),
        (None, None) => return Ok(None),
    };
    split.map(|s| s.splits().then_some(s)).map_err(Error::invalid)
}

/// The handle's island table (members of each island; `island_size` only
/// when all islands have the same size). No kernel reads it any more.
fn island_layout(rank: usize, split: Option<IslandSplit>) -> IslandLayout {
    let mut layout = IslandLayout::default();
    let Some(s) = split else { return layout };
    let equal = (0..s.count()).all(|g| s.size(g) == s.size(0));
    layout.island_size = if equal { s.size(0) as u32 } else { 0 };
    layout.island_count = s.count() as u32;
    layout.my_island = s.island_of(rank) as u32;
    layout.my_index = s.index_of(rank) as u32;
    for g in 0..s.count() {
        for (i, r) in s.members(g).into_iter().enumerate() {
            layout.members[g][i] = r as u8;
        }
    }
    layout
}

/// One try of steps 3-5 with one transport.
struct Attempt {
    layout: ScratchLayout,
    offsets: RegionOffsets,
    region: Region,
    peer_mappings: Vec<PeerMapping>,
    local_state: DeviceMemory,
    handle: DeviceMemory,
    error_record: PinnedHostMemory,
    table: DeviceMemory,
}

impl Attempt {
    fn into_setup(
        self,
        transport: Transport,
        transport_reason: String,
        placement: &Placement,
        config: &Config,
        (region_bases, sentinel_resident): (Vec<u64>, ResidentBlocks),
    ) -> Setup {
        Setup {
            transport,
            transport_reason,
            ranks_on_device: placement.ranks_on_device,
            nccl_eligible: placement.nccl_eligible,
            same_process: placement.same_process.clone(),
            watched_peers: crate::comm::watchdog::peers_to_watch(
                &placement.hellos.iter().map(|h| h.process_identity).collect::<Vec<_>>(),
                &placement.same_process,
                crate::comm::watchdog::ProcessIdentity::of_self(),
            ),
            layout: self.layout,
            island_split: None,
            cross: None,
            offsets: self.offsets,
            pull_max_blocks: placement.pull_max_blocks,
            ring_blocks: placement.ring_blocks,
            fused_clusters: placement.fused_clusters,
            region: Arc::new(self.region),
            peer_mappings: self.peer_mappings,
            local_group: None,
            local_state: self.local_state,
            handle: self.handle,
            error_record: Arc::new(self.error_record),
            table: self.table,
            table_capacity: config.max_registered_buffers,
            registered_mappings: Mutex::new(Vec::new()),
            region_bases,
            sentinel_resident,
        }
    }
}

impl Setup {
    /// This rank's memory as the sentinel templates need it.
    pub(crate) fn memory(&self) -> RankMemory {
        RankMemory {
            region_bases: self.region_bases.clone(),
            scratch_offset: self.offsets.scratch as u64,
            layout: self.layout,
            local_state: self.local_state.ptr(),
            error_record: self.error_record.device_ptr(),
        }
    }
}

fn align(v: usize, a: usize) -> usize {
    v.div_ceil(a) * a
}

/// Step 3: this rank's memory for one transport, zero-filled (OneShotPush
/// receive buffers "empty").
fn allocate(
    ctx: &Arc<CudaContext>,
    (rank, world): (usize, usize),
    config: &Config,
    transport: Transport,
    placement: &Placement,
    split: Option<IslandSplit>,
) -> Result<Attempt> {
    let pack = PACK_BYTES as u64;
    let p2p = transport == Transport::PeerToPeer;
    let layout = ScratchLayout::new(&ScratchConfig {
        world_size: world as u32,
        max_packs: config.max_chunk_bytes as u64 / pack,
        one_shot_push_max_packs: config.one_shot_push_capacity(world) as u64 / pack,
        ring_blocks: placement.ring_blocks,
        ring_slots: config.ring_slots,
        ring_chunk_packs: config.ring_chunk_bytes as u64 / pack,
        island_sizes: split.map_or([0; tp_allreduce_kernels::layout::MAX_RANKS], |s| s.sizes()),
        island_count: split.map_or(0, |s| s.count() as u32),
        // The copy-engine ring needs one rank per GPU: between ranks of one
        // GPU the copies run on its SMs and compete with the step kernels
        // that wait for them (seen: a timeout with 6 ranks on one H200).
        copy_engine_pieces: if p2p && placement.one_rank_per_gpu { CE_MAX_PIECES } else { 0 },
        enable_two_shot_pull: p2p,
        enable_two_shot_push: true,
        enable_ring: true,
    });
    let scratch = align(size_of::<SignalBlock>(), 256);
    let staging = align(scratch + layout.total_bytes as usize, 256);
    let staging_bytes = if p2p { config.max_chunk_bytes } else { 0 };
    let offsets = RegionOffsets { scratch, staging, total: staging + staging_bytes };

    let all_local = placement.same_process.iter().all(|s| *s);
    let region = match transport {
        Transport::PeerToPeer | Transport::PerPair => Region::Device(DeviceMemory::alloc_zeroed(ctx, offsets.total)?),
        Transport::HostStaged if all_local => Region::Pinned(PinnedHostMemory::alloc(ctx, offsets.total)?),
        Transport::HostStaged => {
            let name = super::shm::region_name(&placement.job, &rank.to_string())?;
            Region::Shared(SharedHostRegion::create(ctx, &name, offsets.total)?)
        }
    };
    // The sentinel receive regions (OneShotPush, TwoShotPush, Hierarchical,
    // adjacent) start out "empty"; the copy-engine ring's handshake starts
    // raised ("your staging is free").
    let sentinel_bytes = (layout.ring_offset - layout.one_shot_push_offset) as usize;
    let scratch_ptr = region.device_ptr() + offsets.scratch as u64;
    if sentinel_bytes > 0 {
        debug_assert_eq!(SENTINEL_EMPTY_WORD, 0xFFFF_FFFF);
        driver::memset_d8(scratch_ptr + layout.one_shot_push_offset, 0xFF, sentinel_bytes)?;
    }
    if layout.copy_engine_pieces > 0 {
        driver::memcpy_htod(scratch_ptr + layout.copy_engine_handshake_offset, &1u32.to_ne_bytes())?;
    }
    let local_state = DeviceMemory::alloc_zeroed(ctx, size_of::<LocalState>())?;
    if let Some(seed) = config.test_initial_counter {
        // Before step 4: no peer can have written a flag of this region yet.
        seed_counters(region.device_ptr(), local_state.ptr(), seed)?;
    }
    Ok(Attempt {
        layout,
        offsets,
        region,
        peer_mappings: Vec::new(),
        local_state,
        handle: DeviceMemory::alloc_zeroed(ctx, size_of::<DeviceHandle>())?,
        error_record: PinnedHostMemory::alloc(ctx, size_of::<ErrorRecord>())?,
        table: DeviceMemory::alloc_zeroed(ctx, config.max_registered_buffers * size_of::<PeerPointers>())?,
    })
}

/// What a rank publishes in step 4.
#[derive(Serialize, Deserialize)]
enum RegionOffer {
    Ready(BufferOffer),
    /// The cross-process form could not be made (a transport problem).
    ExportFailed(String),
}

/// Step 4: offer this rank's region, map every peer's and all-gather how it
/// went. Returns every rank's problems and the peers' region addresses here.
fn map_peers(
    ctx: &Arc<CudaContext>,
    (rank, world): (usize, usize),
    rdv: &dyn Rendezvous,
    (transport, split): (Transport, Option<IslandSplit>),
    placement: &Placement,
    attempt: &mut Attempt,
) -> Result<(Vec<TransportProblem>, Vec<u64>)> {
    let same_process = &placement.same_process;
    let offer = match ipc::offer_region(ctx, &attempt.region, attempt.offsets.total, same_process) {
        Ok(offer) => RegionOffer::Ready(offer),
        Err(e) => RegionOffer::ExportFailed(e.to_string()),
    };
    let offers: Vec<RegionOffer> = all_gather_json(rdv, &offer)?;
    let mut problems = Vec::new();
    let mut peer_bases = vec![attempt.region.device_ptr(); world];
    attempt.peer_mappings = (0..world).map(|_| PeerMapping::None).collect();
    for (p, offer) in offers.iter().enumerate().filter(|(p, _)| *p != rank) {
        // Per-pair transport: only island-mates map each other's region.
        if transport == Transport::PerPair && !split.is_some_and(|s| s.together(rank, p)) {
            peer_bases[p] = 0;
            continue;
        }
        let imported = match offer {
            RegionOffer::ExportFailed(why) => {
                problems.push(TransportProblem {
                    rank: p,
                    peer: p,
                    what: format!("offering its region failed: {why}"),
                });
                continue;
            }
            _ if transport == Transport::PeerToPeer && test_hooks::region_import_fails(rank) => {
                Err(Error::Ipc("opening the peer's region failed (injected by a test hook)".into()))
            }
            RegionOffer::Ready(offer) => {
                ipc::descriptor_for_peer(offer, same_process[p]).and_then(|desc| ipc::import(ctx, &desc, offer.bytes))
            }
        };
        match imported {
            Ok((base, mapping)) => (peer_bases[p], attempt.peer_mappings[p]) = (base, mapping),
            Err(e) => problems.push(TransportProblem { rank, peer: p, what: e.to_string() }),
        }
    }
    // Every rank has tried to map every region once this returns: the
    // shared-memory names can go, so nothing is left behind if a process
    // dies later, and every rank knows whether all mappings worked.
    let mut all: Vec<TransportProblem> = all_gather_json(rdv, &problems)?.into_iter().flatten().collect();
    if let Region::Shared(s) = &attempt.region {
        s.unlink();
    }
    // A failed export is reported by every rank that saw it: keep one.
    all.sort();
    all.dedup();
    Ok((all, peer_bases))
}

/// Writes the device handle (every rank's region) and, for P2P, table
/// entry 0 (every rank's staging buffer, read by pull algorithms on eager
/// calls).
fn write_handle(
    attempt: &Attempt,
    (rank, world): (usize, usize),
    transport: Transport,
    peer_bases: &[u64],
    islands: &IslandLayout,
    config: &Config,
) -> Result<()> {
    let mut h = DeviceHandle {
        rank: rank as u32,
        world_size: world as u32,
        timeout_ns: config.wait_bounds_ns().0,
        launch_timeout_ns: config.wait_bounds_ns().1,
        local_state: attempt.local_state.ptr(),
        error_record: attempt.error_record.device_ptr(),
        scratch_layout: attempt.layout,
        islands: *islands,
        ..DeviceHandle::default()
    };
    for (p, base) in peer_bases.iter().enumerate() {
        h.signals[p] = *base;
        h.scratch[p] = base + attempt.offsets.scratch as u64;
    }
    driver::write_struct(attempt.handle.ptr(), &h)?;
    if transport == Transport::PeerToPeer {
        let mut staging = PeerPointers::default();
        for (p, base) in peer_bases.iter().enumerate() {
            staging.ptrs[p] = base + attempt.offsets.staging as u64;
        }
        driver::write_struct(attempt.table.ptr(), &staging)?;
    }
    Ok(())
}

/// Test-only: starts every protocol counter of this rank at `seed` (see
/// `Config::test_initial_counter`): the OneShotPush generations, the flag
/// kernels' per-block epochs and every flag of the signal block, the
/// ring's message counters. Must run before any peer can write this
/// rank's flags (init, before the region descriptors are exchanged).
pub(crate) fn seed_counters(signal_block: u64, local_state: u64, seed: u32) -> Result<()> {
    let flags_words = offset_of!(SignalBlock, abort) / 4;
    driver::memcpy_htod(signal_block, bytemuck::cast_slice(&vec![seed; flags_words]))?;
    // LocalState: every u32 up to the P2P check results is a counter,
    // except the control words other than the generations.
    let mut words = vec![seed; offset_of!(LocalState, p2p_flag_seen) / 4];
    // In the control words only the generations are counters (abort,
    // arrivals and the error claim start at 0).
    let control = offset_of!(LocalState, control) / 4;
    let generations = control + offset_of!(Control, generation) / 4;
    for (i, w) in words.iter_mut().enumerate().skip(control).take(size_of::<Control>() / 4) {
        if !(generations..generations + 3).contains(&i) {
            *w = 0;
        }
    }
    driver::memcpy_htod(local_state, bytemuck::cast_slice(&words))
}

#[cfg(test)]
mod tests;
