//! Communicator initialisation, the same for ranks that are threads of one
//! process and for ranks that are processes:
//!
//! 1. Round 1 (rendezvous all-gather): process token, GPU UUID, SM count,
//!    occupancy, configuration shape. Ranks sharing a GPU are counted and the
//!    per-launch block limits agreed so that every block of every rank can be
//!    resident at once (the cross-rank barriers need it).
//! 2. Round 2: which peers each rank can reach with P2P; the transport is
//!    chosen (P2P only if every pair can).
//! 3. Allocate the rank's peer-visible region (signal block | scratch |
//!    staging) with `cuMemAlloc` (or pinned host memory for HostStaged), its
//!    private state, the device handle, the error record and the table of
//!    registered buffers.
//! 4. Round 3: region descriptors — a plain address for ranks in the same
//!    process, a CUDA IPC handle for other processes (shared memory name for
//!    HostStaged). Each rank maps every peer's region.
//! 5. P2P check: a known pattern written to and read from every peer; a
//!    failing pair switches an `Auto` communicator to HostStaged (all ranks
//!    agree) and fails a forced-P2P one with `Error::P2pCheck`.
//!
//! Everything allocated or opened is owned by RAII values and released on
//! every error path.

use std::collections::BTreeSet;
use std::mem::{offset_of, size_of};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaContext, CudaStream};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::layout::{
    p2p_pattern, DeviceHandle, ErrorRecord, IslandLayout, LocalState, PeerPointers, ScratchConfig, ScratchLayout,
    SignalBlock, MAX_RANKS, P2P_CHECK_WORDS, PACK_BYTES, SENTINEL_EMPTY_WORD, THREADS_PER_BLOCK,
};

use super::shm::SharedHostRegion;
use crate::algorithm::Transport;
use crate::algorithms::Geometry;
use crate::config::{Config, TransportPreference};
use crate::driver::{self, DeviceMemory, IpcMapping, KernelArgs, KernelModule, PinnedHostMemory};
use crate::error::{Error, Result};
use crate::rendezvous::Rendezvous;

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

/// A rank's own peer-visible memory.
pub(crate) enum Region {
    Device(DeviceMemory),
    Pinned(PinnedHostMemory),
    Shared(SharedHostRegion),
}

impl Region {
    pub fn device_ptr(&self) -> u64 {
        match self {
            Region::Device(m) => m.ptr(),
            Region::Pinned(m) => m.device_ptr(),
            Region::Shared(m) => m.device_ptr(),
        }
    }
}

/// How a peer reaches a buffer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, Hash)]
pub(crate) enum BufferDescriptor {
    /// Same process: the address itself.
    Local { addr: u64 },
    /// CUDA IPC handle of the allocation starting `offset` bytes before it.
    Ipc { handle: Vec<u8>, offset: u64 },
    /// POSIX shared memory (HostStaged across processes).
    Shm { name: String, bytes: u64 },
}

/// Keeps a peer mapping alive (held only for its `Drop`).
pub(crate) enum PeerMapping {
    None,
    Ipc(#[allow(dead_code)] Arc<IpcMapping>),
    Shm(#[allow(dead_code)] SharedHostRegion),
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Hello {
    process: String,
    device_uuid: String,
    ordinal: usize,
    cc: (i32, i32),
    sms: u32,
    blocks_per_sm: u32,
    shape: String,
    salt: u32,
    job: String,
}

/// Everything a rank holds after init.
pub(crate) struct Setup {
    pub transport: Transport,
    pub transport_reason: String,
    pub ranks_on_device: usize,
    pub same_process: Vec<bool>,
    pub layout: ScratchLayout,
    pub islands: IslandLayout,
    pub offsets: RegionOffsets,
    pub pull_max_blocks: u32,
    pub ring_blocks: u32,
    pub region: Region,
    /// Held for their `Drop` (peers' regions stay mapped while we run).
    pub _peer_mappings: Vec<PeerMapping>,
    pub local_state: DeviceMemory,
    pub handle: DeviceMemory,
    pub error_record: PinnedHostMemory,
    pub table: DeviceMemory,
    pub table_capacity: usize,
    /// Extra mappings opened for registered buffers (kept alive).
    pub registered_mappings: Mutex<Vec<PeerMapping>>,
    /// Every rank's region as this rank maps it (sentinel parameter templates).
    pub region_bases: Vec<u64>,
    /// Resident blocks of a sentinel kernel per block size (launch shapes).
    pub sentinel_resident: crate::algorithms::ResidentBlocks,
}

impl Setup {
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

pub(crate) fn gather_json<T: Serialize + DeserializeOwned>(rdv: &dyn Rendezvous, value: &T) -> Result<Vec<T>> {
    let mine = serde_json::to_vec(value).map_err(|e| Error::Rendezvous(format!("encoding init data: {e}")))?;
    let all = rdv.all_gather(&mine)?;
    all.iter()
        .enumerate()
        .map(|(rank, bytes)| {
            serde_json::from_slice(bytes).map_err(|e| Error::Protocol {
                from: format!("rank {rank}"),
                what: format!("undecodable init data: {e}"),
            })
        })
        .collect()
}

fn uuid_hex(ctx: &CudaContext) -> Result<String> {
    let uuid = ctx.uuid().map_err(|e| crate::error::driver("cuDeviceGetUuid", e))?;
    Ok(uuid.bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect())
}

/// The local device with this UUID, if visible to this process.
fn local_device_by_uuid(uuid: &str) -> Option<usize> {
    let n = driver::device_count();
    (0..n).find(|&i| CudaContext::new(i).ok().and_then(|c| uuid_hex(&c).ok()).as_deref() == Some(uuid))
}

pub(crate) fn build(
    stream: &Arc<CudaStream>,
    rank: usize,
    world: usize,
    rdv: &dyn Rendezvous,
    config: &Config,
    module: &Arc<KernelModule>,
) -> Result<Setup> {
    let ctx = stream.context().clone();
    driver::bind(&ctx)?;

    // ---- Round 1: who is where, and the block limits.
    let sms = driver::device_attribute(&ctx, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
    let mut blocks_per_sm = u32::MAX;
    for name in crate::kernels::hot_entries() {
        blocks_per_sm = blocks_per_sm.min(module.max_blocks_per_sm(&name, THREADS_PER_BLOCK)?);
    }
    let salt: u32 = rand_u32();
    let hello = Hello {
        process: process_token().to_string(),
        device_uuid: uuid_hex(&ctx)?,
        ordinal: ctx.ordinal(),
        cc: ctx.compute_capability().map_err(|e| crate::error::driver("cuDeviceGetAttribute", e))?,
        sms,
        blocks_per_sm,
        shape: config.shape_fingerprint(),
        salt,
        job: format!("{:016x}", (salt as u64) << 32 | rand_u32() as u64),
    };
    let hellos = gather_json(rdv, &hello)?;
    for (r, h) in hellos.iter().enumerate() {
        if h.shape != hello.shape {
            return Err(Error::invalid(format!(
                "rank {r} uses a different configuration than rank {rank}:\n  rank {r}: {}\n  rank {rank}: {}",
                h.shape, hello.shape
            )));
        }
    }
    let salt = hellos[0].salt;
    let job = hellos[0].job.clone();
    let same_process: Vec<bool> = hellos.iter().map(|h| h.process == hello.process).collect();
    let ranks_on = |uuid: &str| hellos.iter().filter(|h| h.device_uuid == uuid).count();
    let ranks_on_device = ranks_on(&hello.device_uuid);
    // Every rank's blocks must fit on its GPU together with the blocks of
    // the other ranks sharing it; all ranks use the smallest such limit.
    let resident_limit = hellos
        .iter()
        .map(|h| (h.sms as usize * h.blocks_per_sm.max(1) as usize / ranks_on(&h.device_uuid)).max(1))
        .min()
        .unwrap_or(1) as u32;
    let push_blocks = config.push_blocks.min(resident_limit);
    let sentinel_resident = super::params::resident_blocks(module, sms, ranks_on_device)?;
    let pull_max_blocks = config.pull_max_blocks.min(resident_limit);
    let ring_blocks = config.ring_blocks.min(resident_limit);

    // ---- Round 2: P2P reachability and the transport.
    let mut reach = Vec::with_capacity(world);
    for h in &hellos {
        let ok = if h.device_uuid == hello.device_uuid {
            true
        } else {
            match local_device_by_uuid(&h.device_uuid) {
                Some(ordinal) => {
                    let peer =
                        CudaContext::new(ordinal).map_err(|e| crate::error::driver("cuDevicePrimaryCtxRetain", e))?;
                    let mut can = 0i32;
                    driver::cu!(cuDeviceCanAccessPeer(&mut can, ctx.cu_device(), peer.cu_device()))?;
                    can != 0
                }
                // Not visible here (per-process CUDA_VISIBLE_DEVICES): the
                // IPC open and the transfer check decide.
                None => true,
            }
        };
        reach.push(ok);
    }
    let reach_all: Vec<Vec<bool>> = gather_json(rdv, &reach)?;
    let unreachable: Vec<(usize, usize)> = reach_all
        .iter()
        .enumerate()
        .flat_map(|(r, row)| row.iter().enumerate().filter(|(_, ok)| !**ok).map(move |(p, _)| (r, p)))
        .collect();
    let (mut transport, mut reason) = match config.transport {
        TransportPreference::Force(t) => (t, format!("forced to {t} by configuration")),
        TransportPreference::Auto if unreachable.is_empty() => {
            (Transport::PeerToPeer, "every pair reports P2P access".to_string())
        }
        TransportPreference::Auto => {
            (Transport::HostStaged, format!("no P2P access between ranks {:?}: host-staged transport", unreachable))
        }
    };
    if transport == Transport::PeerToPeer && !unreachable.is_empty() {
        return Err(Error::Unsupported(format!(
            "P2P transport forced, but these rank pairs have no P2P access: {unreachable:?}"
        )));
    }

    // Islands for Hierarchical: consecutive ranks.
    let islands = island_layout(rank, world, config.island_size)?;

    loop {
        let attempt = allocate_and_map(
            &ctx,
            rank,
            world,
            rdv,
            config,
            transport,
            &same_process,
            &islands,
            (push_blocks, ring_blocks),
            &job,
        )?;
        let (verdict_ok, detail) = if config.check_p2p {
            p2p_check(&attempt, stream, module, rank, world, rdv, salt)?
        } else {
            (true, String::new())
        };
        if verdict_ok {
            return Ok(Setup {
                transport,
                transport_reason: reason,
                ranks_on_device,
                same_process,
                layout: attempt.layout,
                islands,
                offsets: attempt.offsets,
                pull_max_blocks,
                ring_blocks,
                region: attempt.region,
                _peer_mappings: attempt.peer_mappings,
                local_state: attempt.local_state,
                handle: attempt.handle,
                error_record: attempt.error_record,
                table: attempt.table,
                table_capacity: config.max_registered_buffers,
                registered_mappings: Mutex::new(Vec::new()),
                region_bases: attempt.region_bases,
                sentinel_resident,
            });
        }
        match (config.transport, transport) {
            (TransportPreference::Auto, Transport::PeerToPeer) => {
                reason = format!("P2P transfer check failed ({detail}): host-staged transport");
                transport = Transport::HostStaged;
                // `attempt` is dropped here: its memory and mappings released.
            }
            _ => {
                let (r, p) = first_bad_pair(&detail);
                return Err(Error::P2pCheck { rank: r, peer: p, what: detail });
            }
        }
    }
}

fn first_bad_pair(detail: &str) -> (usize, usize) {
    // detail starts with "rank R <- rank P" (see p2p_check).
    let nums: Vec<usize> =
        detail.split(|c: char| !c.is_ascii_digit()).filter(|s| !s.is_empty()).filter_map(|s| s.parse().ok()).collect();
    (nums.first().copied().unwrap_or(0), nums.get(1).copied().unwrap_or(0))
}

fn island_layout(rank: usize, world: usize, island_size: Option<usize>) -> Result<IslandLayout> {
    let mut layout = IslandLayout::default();
    let Some(m) = island_size else {
        return Ok(layout);
    };
    if m < 2 || m >= world || world % m != 0 {
        return Err(Error::invalid(format!(
            "island_size {m} must divide the world size {world} into at least two islands of at least two ranks"
        )));
    }
    layout.island_size = m as u32;
    layout.island_count = (world / m) as u32;
    layout.my_island = (rank / m) as u32;
    layout.my_index = (rank % m) as u32;
    for r in 0..world {
        layout.members[r / m][r % m] = r as u8;
    }
    Ok(layout)
}

fn rand_u32() -> u32 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let token = u128::from_str_radix(process_token(), 16).unwrap_or(0);
    let mut x = (t ^ token ^ (t >> 64)) as u64;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x as u32
}

struct Attempt {
    layout: ScratchLayout,
    offsets: RegionOffsets,
    region: Region,
    peer_mappings: Vec<PeerMapping>,
    local_state: DeviceMemory,
    handle: DeviceMemory,
    error_record: PinnedHostMemory,
    table: DeviceMemory,
    region_bases: Vec<u64>,
}

fn align(v: usize, a: usize) -> usize {
    v.div_ceil(a) * a
}

#[allow(clippy::too_many_arguments)]
fn allocate_and_map(
    ctx: &Arc<CudaContext>,
    rank: usize,
    world: usize,
    rdv: &dyn Rendezvous,
    config: &Config,
    transport: Transport,
    same_process: &[bool],
    islands: &IslandLayout,
    (push_blocks, ring_blocks): (u32, u32),
    job: &str,
) -> Result<Attempt> {
    let pack = PACK_BYTES as u64;
    let layout = ScratchLayout::new(&ScratchConfig {
        world_size: world as u32,
        max_packs: config.max_chunk_bytes as u64 / pack,
        one_shot_push_max_packs: config.one_shot_push_capacity(world) as u64 / pack,
        push_blocks,
        ring_blocks,
        ring_slots: config.ring_slots,
        ring_chunk_packs: config.ring_chunk_bytes as u64 / pack,
        island_size: islands.island_size,
        enable_two_shot_pull: transport == Transport::PeerToPeer,
        enable_two_shot_push: true,
        enable_ring: true,
    });
    let scratch = align(size_of::<SignalBlock>(), 256);
    let staging = align(scratch + layout.total_bytes as usize, 256);
    let staging_bytes = if transport == Transport::PeerToPeer { config.max_chunk_bytes } else { 0 };
    let offsets = RegionOffsets { scratch, staging, total: staging + staging_bytes };

    // The rank's peer-visible region, zero-filled.
    let all_local = same_process.iter().all(|s| *s);
    let region = match transport {
        Transport::PeerToPeer => Region::Device(DeviceMemory::alloc_zeroed(ctx, offsets.total)?),
        Transport::HostStaged if all_local => Region::Pinned(PinnedHostMemory::alloc(ctx, offsets.total)?),
        Transport::HostStaged => {
            Region::Shared(SharedHostRegion::create(ctx, &format!("/tpar-{job}-{rank}"), offsets.total)?)
        }
    };
    let base = region.device_ptr();
    // OneShotPush receive buffers start out "empty".
    let one_shot_push_bytes = (layout.two_shot_push_offset - layout.one_shot_push_offset) as usize;
    if one_shot_push_bytes > 0 {
        let start = base + offsets.scratch as u64 + layout.one_shot_push_offset;
        debug_assert_eq!(SENTINEL_EMPTY_WORD, 0xFFFF_FFFF);
        driver::memset_d8(start, 0xFF, one_shot_push_bytes)?;
    }

    let local_state = DeviceMemory::alloc_zeroed(ctx, size_of::<LocalState>())?;
    if let Some(seed) = config.test_initial_counter {
        super::params::seed_counters(base, local_state.ptr(), seed)?;
    }
    let handle = DeviceMemory::alloc_zeroed(ctx, size_of::<DeviceHandle>())?;
    let error_record = PinnedHostMemory::alloc(ctx, size_of::<ErrorRecord>())?;
    let table = DeviceMemory::alloc_zeroed(ctx, config.max_registered_buffers * size_of::<PeerPointers>())?;

    // ---- Round 3: region descriptors, then map every peer's region.
    let mine = match (&region, transport) {
        (Region::Shared(s), _) => BufferDescriptor::Shm { name: s.name().to_string(), bytes: offsets.total as u64 },
        _ => {
            // Ranks of this process use the address; others get an IPC handle
            // (device memory only; pinned memory is only used when every
            // rank is local).
            let handle = if transport == Transport::PeerToPeer && !all_local {
                Some(driver::ipc_export(ctx, base)?)
            } else {
                None
            };
            match handle {
                Some(h) => BufferDescriptor::Ipc { handle: h.to_vec(), offset: 0 },
                None => BufferDescriptor::Local { addr: base },
            }
        }
    };
    let descriptors: Vec<(BufferDescriptor, u64)> = gather_json(rdv, &(mine.clone(), base))?;
    let mut peer_bases = Vec::with_capacity(world);
    let mut peer_mappings = Vec::with_capacity(world);
    for (p, (desc, addr)) in descriptors.iter().enumerate() {
        if p == rank {
            peer_bases.push(base);
            peer_mappings.push(PeerMapping::None);
            continue;
        }
        let (peer_base, mapping) = import(ctx, desc, *addr, same_process[p], offsets.total as u64)?;
        peer_bases.push(peer_base);
        peer_mappings.push(mapping);
    }
    // Everyone has mapped every region: shared-memory names can go now, so
    // nothing is left behind if a process dies later.
    rdv.barrier()?;
    if let Region::Shared(s) = &region {
        s.unlink();
    }

    // The device handle.
    let mut h = DeviceHandle {
        rank: rank as u32,
        world_size: world as u32,
        timeout_ns: config.timeout.as_nanos().min(u64::MAX as u128) as u64,
        local_state: local_state.ptr(),
        error_record: error_record.device_ptr(),
        scratch_layout: layout,
        islands: *islands,
        ..DeviceHandle::default()
    };
    for (p, base) in peer_bases.iter().enumerate() {
        h.signals[p] = *base;
        h.scratch[p] = base + offsets.scratch as u64;
    }
    driver::write_struct(handle.ptr(), &h)?;
    // Table entry 0: every rank's staging buffer (pull algorithms, eager).
    if transport == Transport::PeerToPeer {
        let mut staging = PeerPointers::default();
        for (p, base) in peer_bases.iter().enumerate() {
            staging.ptrs[p] = base + offsets.staging as u64;
        }
        driver::write_struct(table.ptr(), &staging)?;
    }
    Ok(Attempt {
        layout,
        offsets,
        region,
        peer_mappings,
        local_state,
        handle,
        error_record,
        table,
        region_bases: peer_bases,
    })
}

/// Maps a peer's buffer described by `desc` into this rank.
pub(crate) fn import(
    ctx: &Arc<CudaContext>,
    desc: &BufferDescriptor,
    addr: u64,
    same_process: bool,
    bytes: u64,
) -> Result<(u64, PeerMapping)> {
    match desc {
        BufferDescriptor::Local { addr: a } => {
            if !same_process {
                return Err(Error::Ipc("a peer in another process sent a local address".into()));
            }
            // Same process: enable P2P when the buffer lives on another GPU.
            enable_access_to(ctx, *a)?;
            Ok((*a, PeerMapping::None))
        }
        BufferDescriptor::Ipc { handle, offset } => {
            let handle: [u8; 64] = handle
                .as_slice()
                .try_into()
                .map_err(|_| Error::Protocol { from: "peer".into(), what: "IPC handle is not 64 bytes".into() })?;
            let mapping = open_ipc_cached(ctx, &handle)?;
            Ok((mapping.ptr() + offset, PeerMapping::Ipc(mapping)))
        }
        BufferDescriptor::Shm { name, bytes: b } => {
            let _ = (addr, bytes);
            let region = SharedHostRegion::open(ctx, name, *b as usize)?;
            Ok((region.device_ptr(), PeerMapping::Shm(region)))
        }
    }
}

fn enable_access_to(ctx: &Arc<CudaContext>, addr: u64) -> Result<()> {
    // SAFETY: the device ordinal attribute is an int.
    let ordinal = unsafe {
        driver::pointer_attribute(addr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, -1i32)
    };
    let ordinal = match ordinal {
        Ok(o) if o >= 0 && o as usize != ctx.ordinal() => o,
        // Host memory, or memory of this GPU: nothing to enable.
        _ => return Ok(()),
    };
    let peer = CudaContext::new(ordinal as usize).map_err(|e| crate::error::driver("cuDevicePrimaryCtxRetain", e))?;
    driver::enable_peer_access(ctx, &peer)
}

/// IPC mappings are opened once per (context, handle) in the process.
fn open_ipc_cached(ctx: &Arc<CudaContext>, handle: &[u8; 64]) -> Result<Arc<IpcMapping>> {
    type Cache = Mutex<std::collections::HashMap<(usize, [u8; 64]), std::sync::Weak<IpcMapping>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut map = cache.lock().map_err(|_| Error::Broken("IPC cache poisoned".into()))?;
    let key = (ctx.cu_ctx() as usize, *handle);
    if let Some(m) = map.get(&key).and_then(std::sync::Weak::upgrade) {
        return Ok(m);
    }
    let m = Arc::new(IpcMapping::open(ctx, handle)?);
    map.insert(key, Arc::downgrade(&m));
    Ok(m)
}

/// Writes/reads a pattern over every pair; returns (all ok, first failure).
fn p2p_check(
    attempt: &Attempt,
    stream: &Arc<CudaStream>,
    module: &KernelModule,
    rank: usize,
    world: usize,
    rdv: &dyn Rendezvous,
    salt: u32,
) -> Result<(bool, String)> {
    let base = attempt.region.device_ptr();
    let outbox: Vec<u32> = (0..P2P_CHECK_WORDS as u32).map(|w| p2p_pattern(rank as u32, u32::MAX, w, salt)).collect();
    driver::memcpy_htod(base + offset_of!(SignalBlock, p2p_outbox) as u64, bytemuck::cast_slice(&outbox))?;
    rdv.barrier()?;
    let f = module.function(AlgorithmId::P2pCheck.kernel_prefix())?;
    let args = KernelArgs::new().u64(attempt.handle.ptr()).u32(salt);
    // SAFETY: p2p_check(handle, salt) matches these arguments; the handle
    // points at fully initialised state.
    unsafe { driver::launch(f, 1, P2P_CHECK_WORDS as u32, stream.cu_stream(), &args)? };
    driver::synchronize(stream)?;
    rdv.barrier()?;
    let mut problems: BTreeSet<String> = BTreeSet::new();
    let mut inbox = vec![0u32; MAX_RANKS * P2P_CHECK_WORDS];
    driver::memcpy_dtoh(bytemuck::cast_slice_mut(&mut inbox), base + offset_of!(SignalBlock, p2p_inbox) as u64)?;
    let mut read_back = vec![0u32; MAX_RANKS * P2P_CHECK_WORDS];
    driver::memcpy_dtoh(
        bytemuck::cast_slice_mut(&mut read_back),
        attempt.local_state.ptr() + offset_of!(LocalState, p2p_read_back) as u64,
    )?;
    for p in 0..world {
        let wrote = &inbox[p * P2P_CHECK_WORDS..(p + 1) * P2P_CHECK_WORDS];
        let bad_w =
            (0..P2P_CHECK_WORDS).filter(|&w| wrote[w] != p2p_pattern(p as u32, rank as u32, w as u32, salt)).count();
        if bad_w > 0 {
            problems.insert(format!(
                "rank {rank} <- rank {p}: {bad_w}/{P2P_CHECK_WORDS} words written by rank {p} arrived wrong"
            ));
        }
        let read = &read_back[p * P2P_CHECK_WORDS..(p + 1) * P2P_CHECK_WORDS];
        let bad_r =
            (0..P2P_CHECK_WORDS).filter(|&w| read[w] != p2p_pattern(p as u32, u32::MAX, w as u32, salt)).count();
        if bad_r > 0 {
            problems.insert(format!(
                "rank {rank} <- rank {p}: {bad_r}/{P2P_CHECK_WORDS} words read from rank {p} were wrong"
            ));
        }
    }
    let all: Vec<Vec<String>> = gather_json(rdv, &problems.into_iter().collect::<Vec<_>>())?;
    let flat: Vec<String> = all.into_iter().flatten().collect();
    // The check touched only the inbox/outbox words, never a protocol flag.
    Ok((flat.is_empty(), flat.join("; ")))
}
