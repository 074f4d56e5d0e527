//! How a rank's buffers reach its peers: what a rank offers for a buffer
//! (its region at init, registered buffers later), which form each peer
//! takes, and mapping a peer's buffer into this rank.
//!
//! A buffer's [`BufferOffer`] carries its address (for peers in the same
//! process) and, when some peer runs in another process, a cross-process
//! form: a CUDA IPC handle of the allocation (device memory) or the name of
//! a POSIX shared-memory object (host-staged across processes). Each peer
//! takes the form that fits *its* relation to the owner
//! ([`descriptor_for_peer`]): with mixed placement (some ranks share a
//! process, some do not) a same-process peer uses the address (a process
//! cannot `cuIpcOpenMemHandle` its own allocation) and the others the
//! handle.
//!
//! Registered buffers of cuMem (VMM) memory — PyTorch's expandable
//! segments — have no IPC handle: their physical chunks travel as file
//! descriptors over the owner's own socket, and a peer maps them into a
//! range of its own (`vmm_buffers.rs`); the offer says where in those runs
//! each buffer lies ([`CrossProcess::Vmm`]).
//!
//! Same-process device memory of another GPU needs peer access from this
//! rank's context to the owner's; host memory never does
//! ([`peer_access_needed`]); cuMem memory is mapped again for the peer's
//! device instead (peer access does not cover it), from the chunks its
//! owner listed in its offer (only the owner's context finds them).

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cudarc::driver::CudaContext;
use serde::{Deserialize, Serialize};

use super::shm::SharedHostRegion;
use super::vmm_buffers::{self, VmmExport, VmmExports};
use crate::driver::vmm::{self, Backing, VmmChunk, VmmMapping};
use crate::driver::{self, DeviceMemory, IpcMapping, MemoryLocation, PinnedHostMemory, RetainedPrimaryContext};
use crate::error::{Error, Result};

/// A rank's own peer-visible memory (signal block | scratch | staging).
pub(crate) enum Region {
    /// Device memory (`cuMemAlloc`): the P2P transport.
    Device(DeviceMemory),
    /// Pinned host memory: host-staged, every rank in this process.
    Pinned(PinnedHostMemory),
    /// Shared host memory: host-staged with ranks in other processes.
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

/// What a rank publishes for one of its buffers.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct BufferOffer {
    /// The buffer's address in the owner's process.
    pub addr: u64,
    /// Its length (what a peer maps of a cuMem buffer).
    pub bytes: u64,
    /// How a peer in another process maps it; `None` when every peer shares
    /// the owner's process.
    pub cross_process: Option<CrossProcess>,
    /// cuMem memory with a peer in the owner's process: the chunks behind
    /// it, found by the owner (a context of another device cannot find
    /// them). `None` otherwise.
    pub vmm_chunks: Option<Vec<VmmChunk>>,
}

/// The cross-process form of a buffer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) enum CrossProcess {
    /// CUDA IPC handle of the allocation starting `offset` bytes before the buffer.
    Ipc { handle: Vec<u8>, offset: u64 },
    /// POSIX shared memory of `bytes` bytes (host-staged across processes).
    Shm { name: String, bytes: u64 },
    /// cuMem memory: `offset` bytes into run `run` of the owner's
    /// [`VmmExport`] of this registration step.
    Vmm { run: u32, offset: u64 },
}

/// What a rank publishes in one registration step: its buffers, in order,
/// and the cuMem chunks behind those that are cuMem memory.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct StepOffer {
    pub buffers: Vec<BufferOffer>,
    pub vmm: Option<VmmExport>,
}

/// How one peer reaches a buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum BufferDescriptor {
    /// Same process: the address itself (and, for cuMem memory, which is
    /// mapped again for another device, its chunks).
    Local { addr: u64, vmm_chunks: Option<Vec<VmmChunk>> },
    /// Another process: the IPC handle or shared-memory name.
    Remote(CrossProcess),
}

/// Whether the ranks' buffers need a cross-process form: some peer of some
/// rank runs in another process (`same_process[p]`: rank p shares this
/// rank's process).
pub(crate) fn cross_process_needed(same_process: &[bool]) -> bool {
    same_process.iter().any(|same| !same)
}

/// The form of `offer` a peer uses: the address when it shares the owner's
/// process, else the cross-process form (an error when the owner sent none,
/// which only a misbehaving or mismatched peer does).
pub(crate) fn descriptor_for_peer(offer: &BufferOffer, same_process: bool) -> Result<BufferDescriptor> {
    if same_process {
        return Ok(BufferDescriptor::Local { addr: offer.addr, vmm_chunks: offer.vmm_chunks.clone() });
    }
    match &offer.cross_process {
        Some(form) => Ok(BufferDescriptor::Remote(form.clone())),
        None => Err(Error::Protocol {
            from: "peer".into(),
            what: "a rank in another process offered only a same-process address".into(),
        }),
    }
}

/// What this rank offers for its region.
pub(crate) fn offer_region(
    ctx: &CudaContext,
    region: &Region,
    bytes: usize,
    same_process: &[bool],
) -> Result<BufferOffer> {
    let addr = region.device_ptr();
    let cross_process = match region {
        _ if !cross_process_needed(same_process) => None,
        Region::Device(_) => Some(CrossProcess::Ipc { handle: driver::ipc_export(ctx, addr)?.to_vec(), offset: 0 }),
        Region::Shared(s) => Some(CrossProcess::Shm { name: s.name().to_string(), bytes: bytes as u64 }),
        Region::Pinned(_) => {
            return Err(Error::Unsupported(
                "pinned host memory cannot be shared with another process (internal: use shared memory)".into(),
            ))
        }
    };
    Ok(BufferOffer { addr, bytes: bytes as u64, cross_process, vmm_chunks: None })
}

/// What this rank offers for the registered device buffers `buffers`
/// (address, bytes) of one step, and the cuMem chunks it must then serve
/// to the ranks in other processes. `cuMemAlloc` memory goes as an IPC
/// handle, exported afresh every time, never cached by address: a freed
/// buffer's address is reused by later allocations, and a cached handle
/// would make peers read the freed one. cuMem memory goes as descriptors
/// (see `vmm_buffers.rs`); anything else cannot reach another process.
/// cuMem buffers list their chunks for the peers in this process. Called
/// with the owner's context current.
pub(crate) fn offer_step(
    ctx: &CudaContext,
    buffers: &[(u64, usize)],
    same_process: &[bool],
) -> Result<(StepOffer, Option<VmmExports>)> {
    let peers_in_process = same_process.iter().filter(|&&same| same).count() > 1;
    let mut offers = buffers
        .iter()
        .map(|&(addr, bytes)| {
            let vmm_chunks = if peers_in_process && vmm::backing(addr) == Backing::Vmm {
                Some(vmm_buffers::chunks_for_peers_in_process(addr, bytes)?)
            } else {
                None
            };
            Ok(BufferOffer { addr, bytes: bytes as u64, cross_process: None, vmm_chunks })
        })
        .collect::<Result<Vec<_>>>()?;
    if !cross_process_needed(same_process) {
        return Ok((StepOffer { buffers: offers, vmm: None }, None));
    }
    let mut cumem = Vec::new();
    for (i, offer) in offers.iter_mut().enumerate() {
        let ptr = offer.addr;
        match vmm::backing(ptr) {
            Backing::Vmm => cumem.push(i),
            Backing::LegacyIpc => {
                let (base, _) = driver::allocation_range(ptr)?;
                let handle = driver::ipc_export(ctx, base)?.to_vec();
                offer.cross_process = Some(CrossProcess::Ipc { handle, offset: ptr - base });
            }
            _ => {
                let why = vmm_buffers::cross_process_obstacle(ptr, offer.bytes as usize).unwrap_or_default();
                return Err(Error::Unsupported(format!(
                    "{why}; allocate buffers that peers in other processes read with cuMemAlloc or cuMemCreate \
                     (with a POSIX file-descriptor handle type), or leave them unregistered (they are staged)"
                )));
            }
        }
    }
    if cumem.is_empty() {
        return Ok((StepOffer { buffers: offers, vmm: None }, None));
    }
    let list: Vec<(u64, usize)> = cumem.iter().map(|&i| (offers[i].addr, offers[i].bytes as usize)).collect();
    let exported = vmm_buffers::export(&list)?;
    for (&i, at) in cumem.iter().zip(exported.placements) {
        offers[i].cross_process = Some(CrossProcess::Vmm { run: at.run, offset: at.offset });
    }
    Ok((StepOffer { buffers: offers, vmm: Some(exported.published) }, Some(exported.exports)))
}

/// Keeps a peer's buffer mapped in this rank (held only for its `Drop`).
pub(crate) enum PeerMapping {
    /// This rank's own buffer, or a same-process buffer that needs nothing.
    None,
    /// A same-process buffer on another GPU: keeps the owner's primary
    /// context (which this rank's context has peer access to) alive.
    PeerContext(#[allow(dead_code)] RetainedPrimaryContext),
    Ipc(#[allow(dead_code)] Arc<IpcMapping>),
    Shm(#[allow(dead_code)] SharedHostRegion),
    /// cuMem chunks mapped into a range of this rank's own.
    Vmm(#[allow(dead_code)] VmmMapping),
}

/// Maps a peer's buffer of `bytes` bytes described by `desc` into this
/// rank; returns its address here. A cuMem buffer of another process needs
/// its owner's runs mapped first: see [`import_registered`].
pub(crate) fn import(ctx: &Arc<CudaContext>, desc: &BufferDescriptor, bytes: u64) -> Result<(u64, PeerMapping)> {
    import_registered(ctx, desc, &[], bytes)
}

/// [`import`], where `runs` holds where this rank mapped each run of the
/// owner's [`VmmExport`] of the step, and its length. An offset the peer
/// sent that puts the buffer outside what it maps is a protocol error.
pub(crate) fn import_registered(
    ctx: &Arc<CudaContext>,
    desc: &BufferDescriptor,
    runs: &[(u64, u64)],
    bytes: u64,
) -> Result<(u64, PeerMapping)> {
    match desc {
        BufferDescriptor::Local { addr, vmm_chunks: Some(chunks) } => {
            Ok(match vmm_buffers::remap_in_process(ctx, *addr, chunks)? {
                Some((here, mapping)) => (here, PeerMapping::Vmm(mapping)),
                None => (*addr, PeerMapping::None),
            })
        }
        BufferDescriptor::Local { addr, vmm_chunks: None } => Ok((*addr, enable_access_to(ctx, *addr)?)),
        BufferDescriptor::Remote(CrossProcess::Vmm { run, offset }) => {
            Ok((address_in_runs(runs, *run, *offset, bytes)?, PeerMapping::None))
        }
        BufferDescriptor::Remote(CrossProcess::Ipc { handle, offset }) => {
            let handle: [u8; 64] = handle
                .as_slice()
                .try_into()
                .map_err(|_| Error::Protocol { from: "peer".into(), what: "IPC handle is not 64 bytes".into() })?;
            let mapping = open_ipc_cached(ctx, &handle)?;
            let (base, len) = driver::allocation_range(mapping.ptr())?;
            let at = within_mapping(base, len as u64, (mapping.ptr() - base).saturating_add(*offset), bytes)?;
            Ok((at, PeerMapping::Ipc(mapping)))
        }
        BufferDescriptor::Remote(CrossProcess::Shm { name, bytes }) => {
            let region = SharedHostRegion::open(ctx, name, *bytes as usize)?;
            Ok((region.device_ptr(), PeerMapping::Shm(region)))
        }
    }
}

/// Where a peer's cuMem buffer `offset` bytes into run `run` of its export
/// lies in this rank, given where this rank mapped each run (`runs`).
fn address_in_runs(runs: &[(u64, u64)], run: u32, offset: u64, bytes: u64) -> Result<u64> {
    let &(start, len) = runs.get(run as usize).ok_or_else(|| Error::Protocol {
        from: "peer".into(),
        what: format!("a cuMem buffer in run {run} of an export with {} runs", runs.len()),
    })?;
    within_mapping(start, len, offset, bytes)
}

/// The address `offset` bytes into a peer's mapping of `len` bytes at
/// `base`, where a buffer of `bytes` bytes lies: a protocol error unless it
/// lies wholly inside (offsets and sizes come from the peer).
fn within_mapping(base: u64, len: u64, offset: u64, bytes: u64) -> Result<u64> {
    match offset.checked_add(bytes) {
        Some(end) if end <= len && offset < len => Ok(base + offset),
        _ => Err(Error::Protocol {
            from: "peer".into(),
            what: format!("a buffer of {bytes} bytes at offset {offset} of a mapping of {len} bytes"),
        }),
    }
}

/// Whether reading memory at `location` from a context on device
/// `my_ordinal` needs peer access: only device memory of another GPU does.
/// Host memory (pinned or registered) is reached through the host from
/// every GPU, although the driver reports the allocating device's ordinal
/// for it, and enabling peer access there fails exactly where host staging
/// is needed (GPUs without P2P).
pub(crate) fn peer_access_needed(location: &MemoryLocation, my_ordinal: usize) -> bool {
    matches!(location, MemoryLocation::Device { ordinal } if *ordinal != my_ordinal)
}

/// Enables peer access from `ctx` to the context owning `addr` when
/// [`peer_access_needed`] says so.
fn enable_access_to(ctx: &CudaContext, addr: u64) -> Result<PeerMapping> {
    if !peer_access_needed(&driver::memory_location(addr)?, ctx.ordinal()) {
        return Ok(PeerMapping::None);
    }
    Ok(match driver::enable_peer_access_to(ctx, addr)? {
        Some(owner) => PeerMapping::PeerContext(owner),
        None => PeerMapping::None,
    })
}

/// IPC mappings are opened once per (context, handle) in the process.
fn open_ipc_cached(ctx: &Arc<CudaContext>, handle: &[u8; 64]) -> Result<Arc<IpcMapping>> {
    type Cache = Mutex<HashMap<(usize, [u8; 64]), Weak<IpcMapping>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut map = cache.lock().map_err(|_| Error::Broken("IPC cache poisoned".into()))?;
    let key = (ctx.cu_ctx() as usize, *handle);
    if let Some(m) = map.get(&key).and_then(Weak::upgrade) {
        return Ok(m);
    }
    let m = Arc::new(IpcMapping::open(ctx, handle)?);
    map.insert(key, Arc::downgrade(&m));
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ipc(byte: u8) -> CrossProcess {
        CrossProcess::Ipc { handle: vec![byte; 64], offset: 16 }
    }

    #[test]
    fn every_rank_in_one_process_offers_addresses_only() {
        assert!(!cross_process_needed(&[true, true, true]));
        let offer = BufferOffer { addr: 0x1000, bytes: 64, cross_process: None, vmm_chunks: None };
        assert_eq!(
            descriptor_for_peer(&offer, true).unwrap(),
            BufferDescriptor::Local { addr: 0x1000, vmm_chunks: None }
        );
    }

    #[test]
    fn mixed_placement_gives_each_peer_its_own_form() {
        // Ranks 0 and 1 share process A, rank 2 runs alone in process B.
        let process = ["A", "A", "B"];
        let same = |me: usize| process.iter().map(|p| *p == process[me]).collect::<Vec<_>>();
        // Every rank has a peer in another process: all offer both forms.
        for me in 0..3 {
            assert!(cross_process_needed(&same(me)), "rank {me}");
        }
        let offers: Vec<BufferOffer> = (0..3)
            .map(|r| BufferOffer {
                addr: 0x1000 * (r as u64 + 1),
                bytes: 64,
                cross_process: Some(ipc(r as u8)),
                vmm_chunks: None,
            })
            .collect();
        // What rank `me` imports from rank `owner`.
        let import = |me: usize, owner: usize| descriptor_for_peer(&offers[owner], same(me)[owner]).unwrap();
        assert_eq!(
            import(1, 0),
            BufferDescriptor::Local { addr: 0x1000, vmm_chunks: None },
            "same process: the address"
        );
        assert_eq!(import(0, 1), BufferDescriptor::Local { addr: 0x2000, vmm_chunks: None });
        assert_eq!(import(2, 0), BufferDescriptor::Remote(ipc(0)), "other process: the handle");
        assert_eq!(import(2, 1), BufferDescriptor::Remote(ipc(1)));
        assert_eq!(import(0, 2), BufferDescriptor::Remote(ipc(2)));
        assert_eq!(import(1, 2), BufferDescriptor::Remote(ipc(2)));
    }

    #[test]
    fn host_staged_mixed_placement_uses_the_shared_memory_name_across_processes() {
        let shm = CrossProcess::Shm { name: "/tpar-job-0".into(), bytes: 4096 };
        let offer =
            BufferOffer { addr: 0x7f00_0000_0000, bytes: 4096, cross_process: Some(shm.clone()), vmm_chunks: None };
        assert_eq!(descriptor_for_peer(&offer, false).unwrap(), BufferDescriptor::Remote(shm));
        assert_eq!(
            descriptor_for_peer(&offer, true).unwrap(),
            BufferDescriptor::Local { addr: 0x7f00_0000_0000, vmm_chunks: None }
        );
    }

    #[test]
    fn a_peer_in_another_process_without_a_handle_is_refused() {
        let offer = BufferOffer { addr: 0x1000, bytes: 64, cross_process: None, vmm_chunks: None };
        let e = descriptor_for_peer(&offer, false).unwrap_err();
        assert!(matches!(e, Error::Protocol { .. }), "{e}");
    }

    #[test]
    fn only_device_memory_of_another_gpu_needs_peer_access() {
        // Pinned host memory: the driver reports the allocating device, but
        // it is reached through the host (issue: enabling peer access fails
        // exactly on the GPUs that need host staging).
        assert!(!peer_access_needed(&MemoryLocation::Host, 0));
        assert!(!peer_access_needed(&MemoryLocation::Host, 1));
        assert!(!peer_access_needed(&MemoryLocation::Device { ordinal: 0 }, 0));
        assert!(peer_access_needed(&MemoryLocation::Device { ordinal: 1 }, 0));
        assert!(!peer_access_needed(&MemoryLocation::Other, 0));
    }

    #[test]
    fn offers_round_trip_through_the_rendezvous_encoding() {
        let offer = BufferOffer { addr: 42, bytes: 64, cross_process: Some(ipc(7)), vmm_chunks: None };
        let bytes = serde_json::to_vec(&offer).unwrap();
        assert_eq!(serde_json::from_slice::<BufferOffer>(&bytes).unwrap(), offer);
    }

    #[test]
    fn a_cumem_buffer_goes_to_other_processes_as_its_place_in_the_owners_runs() {
        // Rank 0 (process A) registers a cuMem buffer straddling two chunks
        // on its device 1; rank 1 shares its process, rank 2 does not.
        let chunk = |base: u64, id| VmmChunk { base, size: 2 << 20, device: Some(1), exportable_as_fd: true, id };
        let chunks = vec![chunk(0x7f00_0000_0000, 7), chunk(0x7f00_0020_0000, 8)];
        let vmm = CrossProcess::Vmm { run: 1, offset: 0x1f_f000 };
        let offer = BufferOffer {
            addr: 0x7f00_001f_f000,
            bytes: 8192,
            cross_process: Some(vmm.clone()),
            vmm_chunks: Some(chunks.clone()),
        };
        assert_eq!(
            descriptor_for_peer(&offer, true).unwrap(),
            BufferDescriptor::Local { addr: 0x7f00_001f_f000, vmm_chunks: Some(chunks) },
            "same process: the address and the chunks the owner found"
        );
        assert_eq!(descriptor_for_peer(&offer, false).unwrap(), BufferDescriptor::Remote(vmm.clone()));
        // Rank 2 mapped the owner's two runs at these addresses.
        let runs = [(0x7e00_0000_0000u64, 2 << 20), (0x7e00_1000_0000, 4 << 20)];
        assert_eq!(address_in_runs(&runs, 1, 0x1234, 8192).unwrap(), 0x7e00_1000_1234);
        let e = address_in_runs(&runs[..1], 1, 0x1234, 8192).unwrap_err();
        assert!(matches!(e, Error::Protocol { .. }), "a run the owner did not export: {e}");
        let step = StepOffer { buffers: vec![offer], vmm: None };
        let bytes = serde_json::to_vec(&step).unwrap();
        assert_eq!(serde_json::from_slice::<StepOffer>(&bytes).unwrap(), step);
    }

    /// Offsets come from peers: one past the end of what it maps (or one
    /// that wraps the address) is a protocol error, never an address out
    /// of the mapping nor an overflow.
    #[test]
    fn offsets_from_peers_outside_what_they_map_are_refused() {
        let runs = [(0x7e00_0000_0000u64, 2 << 20)];
        assert_eq!(address_in_runs(&runs, 0, (2 << 20) - 64, 64).unwrap(), 0x7e00_0000_0000 + (2 << 20) - 64);
        for (offset, bytes) in [(2 << 20, 0), ((2 << 20) - 64, 65), (u64::MAX, 1), (1, u64::MAX), (u64::MAX, 0)] {
            let e = address_in_runs(&runs, 0, offset, bytes).unwrap_err();
            assert!(matches!(e, Error::Protocol { .. }), "offset {offset:#x}, {bytes} bytes: {e}");
        }
        assert_eq!(within_mapping(0x1000, 4096, 4000, 96).unwrap(), 0x1000 + 4000);
        for (offset, bytes) in [(4096, 0), (4000, 97), (u64::MAX, 1)] {
            let e = within_mapping(0x1000, 4096, offset, bytes).unwrap_err();
            assert!(matches!(e, Error::Protocol { .. }), "offset {offset:#x}, {bytes} bytes: {e}");
        }
    }
}
