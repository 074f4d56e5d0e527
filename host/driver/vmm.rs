//! cuMem (virtual memory management) memory: what backs an address, the
//! physical allocations ("chunks") behind a range, exporting a chunk as a
//! POSIX file descriptor, and mapping chunks into this process.
//!
//! Memory from `cuMemCreate` + `cuMemMap` — PyTorch's caching allocator with
//! `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` allocates this way —
//! cannot be exported with `cuIpcGetMemHandle`. One virtual range holds many
//! physical chunks (PyTorch maps 2 MiB chunks in its small pool and 20 MiB
//! chunks in its large pool, each with its own `cuMemMap`), so a buffer may
//! straddle several. For an address inside such a range,
//! `cuMemGetAddressRange` reports the extent of the one mapping that holds it
//! (NCCL's multi-segment registration walks buffers the same way) and
//! `cuMemRetainAllocationHandle` the chunk's handle, whose properties say
//! which shareable handle types were requested at `cuMemCreate`. A chunk
//! created with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` (PyTorch requests
//! it for expandable segments) exports as a file descriptor
//! (`cuMemExportToShareableHandle`), which another process imports
//! (`cuMemImportFromShareableHandle`), maps into a range it reserved
//! (`cuMemAddressReserve`, `cuMemMap`) and makes readable by its device
//! (`cuMemSetAccess`). A chunk created without it cannot leave its process.
//!
//! Sources: CUDA Driver API reference, "Virtual Memory Management" and
//! `cuPointerGetAttribute`; PyTorch `c10/cuda/CUDACachingAllocator.cpp`
//! (Note [Expandable Segments]); NCCL `src/transport/p2p.cc`.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use serde::{Deserialize, Serialize};

use super::memory::pointer_attribute;
use super::{allocation_range, buffer_id, cu, is_pool_memory, memory_location, CurrentContext, MemoryLocation};
use crate::error::{Error, Result};

const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// What backs an address, as far as sharing it with another process goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// One `cuMemAlloc` allocation: exportable with `cuIpcGetMemHandle`
    /// (also device memory the driver does not call IPC-capable but that is
    /// neither cuMem nor pool memory: exporting it is tried, as before).
    LegacyIpc,
    /// cuMem memory: physical chunks mapped into a reserved range.
    Vmm,
    /// A stream-ordered pool (`cuMemAllocAsync`): not exportable here.
    Pool,
    /// Anything else (host or managed memory, an unknown address).
    Other,
}

/// What backs `ptr` (pointer queries only: legal during stream capture).
/// Never fails: an address the driver does not know is `Other`.
pub fn backing(ptr: sys::CUdeviceptr) -> Backing {
    if is_pool_memory(ptr) {
        return Backing::Pool;
    }
    // SAFETY: the attribute is an int (a boolean).
    let legacy = unsafe {
        pointer_attribute(ptr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, 0i32)
    };
    if matches!(legacy, Ok(1)) {
        return Backing::LegacyIpc;
    }
    if ChunkHandle::retain(ptr).is_ok() {
        return Backing::Vmm;
    }
    match memory_location(ptr) {
        Ok(MemoryLocation::Device { .. }) => Backing::LegacyIpc,
        _ => Backing::Other,
    }
}

/// One physical allocation mapped into a cuMem range.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmmChunk {
    /// Where the mapping starts and how long it is.
    pub base: u64,
    pub size: u64,
    /// The device whose memory it is (`None`: not device memory).
    pub device: Option<usize>,
    /// Created with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: exportable.
    pub exportable_as_fd: bool,
    /// A process-wide id of the physical allocation: a chunk unmapped and
    /// replaced by another at the same address gets a new id.
    pub id: u64,
}

/// The chunk holding `addr` (query only). Query with a context of the
/// chunk's own device current: from a context of a device the chunk is not
/// mapped for, `cuMemGetAddressRange` does not find it (`CUDA_ERROR_NOT_FOUND`,
/// seen on two H200s with one rank per GPU in one process), so a rank lists
/// its own chunks and hands the list to peers (`comm/ipc.rs`).
pub fn chunk_at(addr: sys::CUdeviceptr) -> Result<VmmChunk> {
    let (base, size) = allocation_range(addr)?;
    let handle = ChunkHandle::retain(addr)?;
    let props = handle.properties()?;
    let on_device = props.location.type_ == sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    Ok(VmmChunk {
        base,
        size: size as u64,
        device: on_device.then_some(props.location.id).and_then(|id| usize::try_from(id).ok()),
        exportable_as_fd: props.requestedHandleTypes.0 & POSIX_FD.0 != 0,
        id: physical_id(addr).unwrap_or(base),
    })
}

/// The chunks behind `ptr..ptr+bytes`, in address order (at most
/// `max_chunks`).
pub fn physical_chunks(ptr: sys::CUdeviceptr, bytes: usize, max_chunks: usize) -> Result<Vec<VmmChunk>> {
    walk_chunks(ptr, bytes, max_chunks, |addr| {
        chunk_at(addr).map_err(|e| {
            Error::Ipc(format!(
                "finding the physical allocation behind {addr:#x} (byte {} of the buffer at {ptr:#x}) failed: {e}",
                addr - ptr
            ))
        })
    })
}

/// The chunks behind `ptr..ptr+bytes`, found by asking `chunk_at` for the
/// chunk that holds the first byte not covered yet. Each chunk after the
/// first must start exactly where the previous one ended. Pure.
pub fn walk_chunks(
    ptr: u64,
    bytes: usize,
    max_chunks: usize,
    mut chunk_at: impl FnMut(u64) -> Result<VmmChunk>,
) -> Result<Vec<VmmChunk>> {
    if bytes == 0 {
        return Err(Error::invalid(format!("an empty range at {ptr:#x} has no physical allocation")));
    }
    let end = ptr
        .checked_add(bytes as u64)
        .ok_or_else(|| Error::invalid(format!("the range {ptr:#x} + {bytes} bytes overflows the address space")))?;
    let mut chunks: Vec<VmmChunk> = Vec::new();
    let mut cursor = ptr;
    while cursor < end {
        if chunks.len() == max_chunks {
            return Err(Error::Unsupported(format!(
                "the buffer at {ptr:#x} ({bytes} bytes) spans more than {max_chunks} physical allocations"
            )));
        }
        let chunk = chunk_at(cursor)?;
        let chunk_end = chunk.base.checked_add(chunk.size).unwrap_or(0);
        let holds_cursor = chunk.base <= cursor && cursor < chunk_end;
        if !holds_cursor || (!chunks.is_empty() && chunk.base != cursor) {
            return Err(Error::Ipc(format!(
                "the driver reported the mapping {:#x} + {:#x} bytes for address {cursor:#x}, which does not \
                 continue the buffer at {ptr:#x}",
                chunk.base, chunk.size
            )));
        }
        cursor = chunk_end;
        chunks.push(chunk);
    }
    Ok(chunks)
}

/// Most mappings [`mapped_end`] follows (128 GiB of 2 MiB chunks): a
/// bound on the work of one call's argument check, far above any buffer.
const MAX_MAPPINGS_FOLLOWED: usize = 1 << 16;

/// Where cuMem memory mapped back to back from `end` (the end of a cuMem
/// mapping) stops, looking no further than `target`: each following mapping
/// must be cuMem memory and start where the previous one ended. Pointer
/// queries only (legal during stream capture), three to five per mapping;
/// call with a context of the memory's device current (see [`chunk_at`]).
pub fn mapped_end(end: u64, target: u64) -> u64 {
    continued_end(end, target, MAX_MAPPINGS_FOLLOWED, |addr| {
        if backing(addr) != Backing::Vmm {
            return None;
        }
        allocation_range(addr).ok().map(|(base, size)| (base, size as u64))
    })
}

/// [`mapped_end`] over `mapping_at(addr)`, the (start, size) of the cuMem
/// mapping holding `addr` (`None`: none, or not cuMem memory), following at
/// most `max_mappings` of them. Pure.
pub fn continued_end(
    end: u64,
    target: u64,
    max_mappings: usize,
    mut mapping_at: impl FnMut(u64) -> Option<(u64, u64)>,
) -> u64 {
    let mut end = end;
    for _ in 0..max_mappings {
        if end >= target {
            break;
        }
        match mapping_at(end) {
            Some((base, size)) if base == end && size > 0 => end = end.saturating_add(size),
            _ => break,
        }
    }
    end
}

/// The id that tells the allocation registered at `ptr` from a later one
/// at the same address: the buffer id for `cuMemAlloc` memory, the physical
/// allocation's id for cuMem memory (its range outlives its chunks; where
/// the driver knows neither id, the chunk's start, which tells less).
pub fn allocation_id(ptr: sys::CUdeviceptr, backing: Backing) -> Result<u64> {
    match backing {
        Backing::Vmm => physical_id(ptr).or_else(|_| buffer_id(ptr)).or_else(|_| allocation_range(ptr).map(|r| r.0)),
        _ => buffer_id(ptr),
    }
}

fn physical_id(ptr: sys::CUdeviceptr) -> Result<u64> {
    // SAFETY: the memory block id attribute is an unsigned long long.
    unsafe { pointer_attribute(ptr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID, 0u64) }
}

/// Exports the chunk mapped at `addr` as a POSIX file descriptor (the
/// caller owns it; the peer that receives a copy imports it).
pub fn export_fd(addr: sys::CUdeviceptr) -> Result<OwnedFd> {
    let handle = ChunkHandle::retain(addr)?;
    let mut fd: libc::c_int = -1;
    cu!(cuMemExportToShareableHandle(&mut fd as *mut libc::c_int as *mut c_void, handle.raw, POSIX_FD, 0)).map_err(
        |e| {
            Error::Ipc(format!(
                "exporting the cuMem allocation at {addr:#x} as a file descriptor failed ({e}); it must be \
                 created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR among its requested handle types"
            ))
        },
    )?;
    if fd < 0 {
        return Err(Error::Ipc(format!("exporting the cuMem allocation at {addr:#x} returned no file descriptor")));
    }
    // SAFETY: the driver created `fd` for this call; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Takes ownership of file descriptors the kernel installed in this process
/// with an `SCM_RIGHTS` message (the exported chunks a peer sent): they are
/// closed when the returned values are dropped. Negative values (never
/// delivered by the kernel) are skipped.
pub fn adopt_received_fds(raw: &[RawFd]) -> Vec<OwnedFd> {
    raw.iter()
        .filter(|&&fd| fd >= 0)
        // SAFETY: the kernel created each descriptor in this process for the
        // message just received, and nothing else refers to it.
        .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect()
}

/// A reference on a physical allocation (`cuMemRetainAllocationHandle` or
/// `cuMemImportFromShareableHandle`), released on drop (`cuMemRelease`).
/// The memory lives while any reference or mapping does.
pub struct ChunkHandle {
    raw: sys::CUmemGenericAllocationHandle,
}

impl ChunkHandle {
    /// The handle of the chunk mapped at `addr` (any address inside it).
    pub fn retain(addr: sys::CUdeviceptr) -> Result<ChunkHandle> {
        let mut raw: sys::CUmemGenericAllocationHandle = 0;
        cu!(cuMemRetainAllocationHandle(&mut raw, addr as *mut c_void))?;
        Ok(ChunkHandle { raw })
    }

    /// Imports a chunk another process exported as a file descriptor (the
    /// descriptor may be closed afterwards).
    pub fn import_fd(fd: BorrowedFd<'_>) -> Result<ChunkHandle> {
        let mut raw: sys::CUmemGenericAllocationHandle = 0;
        let os_handle = fd.as_raw_fd() as usize as *mut c_void;
        cu!(cuMemImportFromShareableHandle(&mut raw, os_handle, POSIX_FD)).map_err(|e| {
            Error::Ipc(format!("importing a peer's cuMem allocation from its file descriptor failed ({e})"))
        })?;
        Ok(ChunkHandle { raw })
    }

    fn properties(&self) -> Result<sys::CUmemAllocationProp> {
        // SAFETY: a plain C struct for which all zeros is a valid value.
        let mut props: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        cu!(cuMemGetAllocationPropertiesFromHandle(&mut props, self.raw))?;
        Ok(props)
    }
}

impl Drop for ChunkHandle {
    fn drop(&mut self) {
        // SAFETY: one reference taken in `retain`/`import_fd`, released once.
        let _ = unsafe { sys::cuMemRelease(self.raw) };
    }
}

/// Chunks mapped back to back into a range this process reserved, readable
/// and writable by the device of `ctx`. Unmapped, the range freed and the
/// chunks released on drop.
pub struct VmmMapping {
    ctx: Arc<CudaContext>,
    base: sys::CUdeviceptr,
    reserved: usize,
    mapped: Vec<(sys::CUdeviceptr, usize)>,
    /// Dropped after `Drop::drop` unmapped them.
    _chunks: Vec<ChunkHandle>,
}

impl VmmMapping {
    /// Maps `chunks` (each with its size in bytes) in order.
    pub fn map(ctx: &Arc<CudaContext>, chunks: Vec<(ChunkHandle, u64)>) -> Result<VmmMapping> {
        let total = chunks.iter().try_fold(0u64, |sum, (_, size)| sum.checked_add(*size));
        let reserved = total.and_then(|t| usize::try_from(t).ok()).filter(|t| *t > 0).ok_or_else(|| {
            Error::Protocol { from: "peer".into(), what: "cuMem chunk sizes add up to nothing".into() }
        })?;
        let _bound = CurrentContext::bind(ctx)?;
        let mut base: sys::CUdeviceptr = 0;
        cu!(cuMemAddressReserve(&mut base, reserved, 0, 0, 0))?;
        let mut mapping = VmmMapping { ctx: ctx.clone(), base, reserved, mapped: Vec::new(), _chunks: Vec::new() };
        let mut at = base;
        for (chunk, size) in chunks {
            let size = size as usize;
            cu!(cuMemMap(at, size, 0, chunk.raw, 0))?;
            mapping.mapped.push((at, size));
            mapping._chunks.push(chunk);
            at += size as u64;
        }
        let access = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ctx.cu_device(),
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        cu!(cuMemSetAccess(base, reserved, &access, 1))?;
        Ok(mapping)
    }

    /// Where the first chunk starts in this process.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.base
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        let Ok(_bound) = CurrentContext::bind(&self.ctx) else { return };
        for &(at, size) in self.mapped.iter().rev() {
            // SAFETY: mapped by `map` at exactly this place, unmapped once.
            let _ = unsafe { sys::cuMemUnmap(at, size) };
        }
        // SAFETY: reserved by `map` with exactly this size, freed once.
        let _ = unsafe { sys::cuMemAddressFree(self.base, self.reserved) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A fake cuMem range: chunks of these sizes back to back from 0x1000_0000.
    fn range(sizes: &[u64]) -> impl FnMut(u64) -> Result<VmmChunk> {
        let mut chunks = Vec::new();
        let mut base = 0x1000_0000u64;
        for (i, &size) in sizes.iter().enumerate() {
            chunks.push(VmmChunk { base, size, device: Some(0), exportable_as_fd: true, id: i as u64 });
            base += size;
        }
        move |addr| {
            chunks
                .iter()
                .find(|c| c.base <= addr && addr < c.base + c.size)
                .cloned()
                .ok_or_else(|| Error::Ipc(format!("{addr:#x} is not mapped")))
        }
    }

    #[test]
    fn a_range_inside_one_chunk_is_that_chunk() {
        let chunks = walk_chunks(0x1000_0000 + MIB, 4096, 16, range(&[2 * MIB, 2 * MIB])).unwrap();
        assert_eq!(chunks.len(), 1);
        assert_eq!((chunks[0].base, chunks[0].size), (0x1000_0000, 2 * MIB));
    }

    #[test]
    fn a_range_straddling_chunks_lists_each_once_in_order() {
        // Starts 16 bytes before the end of chunk 0, ends 1 byte into chunk 3.
        let ptr = 0x1000_0000 + 2 * MIB - 16;
        let bytes = (16 + 2 * MIB + 20 * MIB + 1) as usize;
        let chunks = walk_chunks(ptr, bytes, 16, range(&[2 * MIB, 2 * MIB, 20 * MIB, 2 * MIB, 2 * MIB])).unwrap();
        assert_eq!(chunks.iter().map(|c| c.id).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(chunks[3].base, 0x1000_0000 + 24 * MIB);
        // Ending exactly at a chunk boundary does not pull in the next one.
        let exact = walk_chunks(0x1000_0000, (4 * MIB) as usize, 16, range(&[2 * MIB, 2 * MIB, 2 * MIB])).unwrap();
        assert_eq!(exact.len(), 2);
    }

    #[test]
    fn a_hole_in_the_range_is_an_error() {
        let mut mapped = range(&[2 * MIB]);
        let e = walk_chunks(0x1000_0000, (3 * MIB) as usize, 16, &mut mapped).unwrap_err().to_string();
        assert!(e.contains("is not mapped"), "{e}");
    }

    #[test]
    fn a_driver_answer_that_does_not_continue_the_range_is_refused() {
        // The "next" chunk starts before the cursor (overlaps the previous one).
        let overlapping = |addr: u64| {
            let base = if addr == 0x1000_0000 { addr } else { addr - 4096 };
            Ok(VmmChunk { base, size: 2 * MIB, device: Some(0), exportable_as_fd: true, id: 0 })
        };
        let e = walk_chunks(0x1000_0000, (3 * MIB) as usize, 16, overlapping).unwrap_err().to_string();
        assert!(e.contains("does not continue"), "{e}");
        // A mapping that does not even hold the address asked about.
        let elsewhere =
            |_| Ok(VmmChunk { base: 0x4000_0000, size: 2 * MIB, device: Some(0), exportable_as_fd: true, id: 0 });
        assert!(walk_chunks(0x1000_0000, 16, 16, elsewhere).is_err());
        let empty = |addr| Ok(VmmChunk { base: addr, size: 0, device: Some(0), exportable_as_fd: true, id: 0 });
        assert!(walk_chunks(0x1000_0000, 16, 16, empty).is_err());
    }

    /// `range(sizes)` as (start, size) of the mapping holding an address.
    fn mappings(sizes: &[u64]) -> impl FnMut(u64) -> Option<(u64, u64)> {
        let mut chunk_at = range(sizes);
        move |addr| chunk_at(addr).ok().map(|c| (c.base, c.size))
    }

    #[test]
    fn a_range_over_back_to_back_mappings_is_covered_to_its_end() {
        // A call on 16 bytes of chunk 0, chunk 1 and 4 KiB of chunk 2: the
        // driver reported chunk 0 (ending at 2 MiB); chunks 1 and 2 continue it.
        let start = 0x1000_0000u64;
        let target = start + 4 * MIB + 4096;
        let end = continued_end(start + 2 * MIB, target, 16, mappings(&[2 * MIB, 2 * MIB, 2 * MIB]));
        assert!(end >= target);
        assert_eq!(end, start + 6 * MIB, "stops after the chunk that covers the target");
        // Already covered: nothing is asked.
        let asked = continued_end(start + 2 * MIB, start + MIB, 16, |_| panic!("asked about a covered range"));
        assert_eq!(asked, start + 2 * MIB);
    }

    #[test]
    fn a_range_running_past_the_mapped_memory_stops_where_it_ends() {
        let start = 0x1000_0000u64;
        // Past the last chunk: covered up to its end (what the error reports).
        let end = continued_end(start + 2 * MIB, start + 5 * MIB, 16, mappings(&[2 * MIB, 2 * MIB]));
        assert_eq!(end, start + 4 * MIB);
        // A hole: chunk 1 unmapped.
        let mut holed = mappings(&[2 * MIB, 2 * MIB, 2 * MIB]);
        let with_hole = |addr: u64| holed(addr).filter(|&(base, _)| base != start + 2 * MIB);
        assert_eq!(continued_end(start + 2 * MIB, start + 5 * MIB, 16, with_hole), start + 2 * MIB);
        // A neighbour that is not cuMem memory (cuMemAlloc memory may lie
        // right after a range) does not continue it.
        assert_eq!(continued_end(start + 2 * MIB, start + 3 * MIB, 16, |_| None), start + 2 * MIB);
        // A mapping that holds the address but starts before it, or is
        // empty, does not continue it either.
        let overlapping = |addr: u64| Some((addr - 4096, 2 * MIB));
        assert_eq!(continued_end(start + 2 * MIB, start + 3 * MIB, 16, overlapping), start + 2 * MIB);
        assert_eq!(continued_end(start + 2 * MIB, start + 3 * MIB, 16, |addr| Some((addr, 0))), start + 2 * MIB);
        // At most `max_mappings` are followed.
        let end = continued_end(start + 2 * MIB, start + 8 * MIB, 2, mappings(&[2 * MIB; 4]));
        assert_eq!(end, start + 6 * MIB);
        // No overflow at the top of the address space.
        assert_eq!(continued_end(u64::MAX - 8, u64::MAX, 4, |addr| Some((addr, 64))), u64::MAX);
    }

    #[test]
    fn too_many_chunks_and_bad_ranges_are_refused() {
        let e = walk_chunks(0x1000_0000, (8 * MIB) as usize, 3, range(&[2 * MIB; 8])).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        assert!(walk_chunks(0x1000_0000, (6 * MIB) as usize, 3, range(&[2 * MIB; 8])).is_ok());
        assert!(matches!(walk_chunks(0x1000_0000, 0, 3, range(&[2 * MIB])), Err(Error::InvalidUsage(_))));
        assert!(matches!(walk_chunks(u64::MAX - 4, 16, 3, range(&[2 * MIB])), Err(Error::InvalidUsage(_))));
    }
}
