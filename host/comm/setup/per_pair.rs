//! The per-pair transport (`Transport::PerPair`): P2P inside islands,
//! host-staged across them, for machines where only the pairs that cross
//! an island boundary (typically the CPU socket) lack P2P. Without it such a
//! machine would run host-staged as a whole.
//!
//! What changes against plain P2P: each rank maps the device regions of its
//! island-mates only; a second, host-memory *cross region* per rank (pinned,
//! or POSIX shared memory across processes) holds its abort word (offset 0,
//! readable by every rank) and the Hierarchical kernel's cross slots (from
//! `CROSS_SLOTS_OFFSET`, two halves); every rank maps every cross region.
//! The transfer check runs inside each island (its device P2P paths); the
//! cross regions are host memory, reached as the host-staged transport
//! reaches its regions. Only Hierarchical runs over it (and NCCL).

#![forbid(unsafe_code)]

use std::mem::size_of;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use tp_allreduce_kernels::layout::{DeviceHandle, ScratchLayout, MAX_RANKS};
use tp_allreduce_kernels::shares::cross_half_bytes;

use super::super::ipc::{self, PeerMapping, Region};
use super::super::p2p_check;
use super::super::p2p_check::TransportProblem;
use super::super::shm::{self, SharedHostRegion};
use super::placement::Placement;
use crate::algorithm::{CrossRegions, IslandSplit, CROSS_SLOTS_OFFSET};
use crate::config::Config;
use crate::driver::{self, DeviceMemory, KernelModule, PinnedHostMemory};
use crate::error::Result;
use crate::rendezvous::{all_gather_json, Rendezvous};

/// Whether the per-pair transport fits: islands exist and every pair
/// without P2P crosses an island boundary (pairs inside islands all have
/// it). Pure.
pub(crate) fn fits(unreachable: &[(usize, usize)], split: Option<IslandSplit>) -> bool {
    match split {
        Some(s) if s.splits() => !unreachable.is_empty() && unreachable.iter().all(|&(a, b)| !s.together(a, b)),
        _ => false,
    }
}

/// A rank's cross region and its mappings of every peer's.
pub(crate) struct CrossSetup {
    pub region: Region,
    pub mappings: Vec<PeerMapping>,
    pub regions: CrossRegions,
}

/// Bytes of a cross region: the abort word's line, then two halves of
/// cross slots.
pub(crate) fn cross_region_bytes(layout: &ScratchLayout, split: &IslandSplit) -> (u64, u64) {
    let half = cross_half_bytes(&split.sizes(), split.count(), layout.hierarchical_share_packs);
    (CROSS_SLOTS_OFFSET + 2 * half, half)
}

/// Allocates this rank's cross region (abort word 0, slots EMPTY), offers
/// it, maps every peer's and all-gathers how that went.
pub(super) fn map_cross_regions(
    ctx: &Arc<CudaContext>,
    (rank, world): (usize, usize),
    rdv: &dyn Rendezvous,
    placement: &Placement,
    (layout, split): (&ScratchLayout, &IslandSplit),
) -> Result<(CrossSetup, Vec<TransportProblem>)> {
    let (bytes, half) = cross_region_bytes(layout, split);
    let bytes = bytes as usize;
    let all_local = placement.same_process.iter().all(|s| *s);
    let region = if all_local {
        Region::Pinned(PinnedHostMemory::alloc(ctx, bytes)?)
    } else {
        Region::Shared(SharedHostRegion::create(ctx, &shm::region_name(&placement.job, &format!("x{rank}"))?, bytes)?)
    };
    driver::memset_d8(region.device_ptr(), 0, CROSS_SLOTS_OFFSET as usize)?;
    driver::memset_d8(region.device_ptr() + CROSS_SLOTS_OFFSET, 0xFF, bytes - CROSS_SLOTS_OFFSET as usize)?;
    let offer = ipc::offer_region(ctx, &region, bytes, &placement.same_process).map_err(|e| e.to_string());
    let offers: Vec<std::result::Result<ipc::BufferOffer, String>> = all_gather_json(rdv, &offer)?;
    let mut problems = Vec::new();
    let mut bases = vec![region.device_ptr(); world];
    let mut mappings: Vec<PeerMapping> = (0..world).map(|_| PeerMapping::None).collect();
    for (p, offer) in offers.iter().enumerate().filter(|(p, _)| *p != rank) {
        let imported = offer
            .as_ref()
            .map_err(|why| crate::error::Error::Ipc(format!("offering its cross region failed: {why}")))
            .and_then(|o| ipc::descriptor_for_peer(o, placement.same_process[p]).map(|desc| (desc, o.bytes)))
            .and_then(|(desc, bytes)| ipc::import(ctx, &desc, bytes));
        match imported {
            Ok((base, mapping)) => (bases[p], mappings[p]) = (base, mapping),
            Err(e) => problems.push(TransportProblem { rank, peer: p, what: format!("cross region: {e}") }),
        }
    }
    let mut all: Vec<TransportProblem> = all_gather_json(rdv, &problems)?.into_iter().flatten().collect();
    if let Region::Shared(s) = &region {
        s.unlink();
    }
    all.sort();
    all.dedup();
    let regions = CrossRegions { bases, half_bytes: half };
    Ok((CrossSetup { region, mappings, regions }, all))
}

/// The transfer check inside this rank's island: the check kernel runs on
/// a handle renumbered to the island (rank = index in the island, world =
/// its size, its members' signal blocks), so it only touches island-mates.
/// Problems name global ranks.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_island(
    stream: &Arc<CudaStream>,
    module: &KernelModule,
    (base, local_state, error_record): (u64, u64, u64),
    (rank, split): (usize, &IslandSplit),
    peer_bases: &[u64],
    rdv: &dyn Rendezvous,
    salts: (u32, u32),
    config: &Config,
) -> Result<Vec<TransportProblem>> {
    let members = split.members(split.island_of(rank));
    let mut h = DeviceHandle {
        rank: split.index_of(rank) as u32,
        world_size: members.len() as u32,
        timeout_ns: config.timeout.as_nanos().min(u64::MAX as u128) as u64,
        local_state,
        error_record,
        ..DeviceHandle::default()
    };
    for (q, &m) in members.iter().enumerate().take(MAX_RANKS) {
        h.signals[q] = peer_bases[m];
    }
    let handle = DeviceMemory::alloc_zeroed(stream.context(), size_of::<DeviceHandle>())?;
    driver::write_struct(handle.ptr(), &h)?;
    let local = (h.rank as usize, members.len());
    p2p_check::run_among(stream, module, (base, local_state, &handle), local, &members, rdv, salts)
}
