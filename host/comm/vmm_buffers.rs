//! Registered cuMem (VMM) buffers across processes: whether a buffer can be
//! shared at all, how one registration step's chunks are grouped into
//! *runs*, and how a peer maps them (see `driver/vmm.rs` for the driver
//! side, `fd_passing.rs` for how the descriptors travel).
//!
//! A step registers several buffers; many of them live in the same few
//! chunks (an expandable segment holds every tensor of a stream). The owner
//! collects the distinct chunks behind all its buffers, sorts them by
//! address and merges neighbours (a chunk that starts where the previous one
//! ends) into runs. It exports each chunk once, as a descriptor, in run
//! order, and publishes the chunk sizes per run; each buffer is (run, offset
//! from the run's start). A peer imports the chunks, maps each run back to
//! back into one range of its own, so a buffer that straddles chunks is
//! contiguous there too, and reads buffer i at `run start + offset`.

#![forbid(unsafe_code)]

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::CudaContext;
use serde::{Deserialize, Serialize};

use super::fd_passing::{self, Deadline, FdServer, FdSocket, Serving};
use crate::driver::vmm::{self, Backing, ChunkHandle, VmmChunk, VmmMapping};
use crate::error::{Error, Result};

/// Most physical allocations one registered buffer may span (PyTorch's
/// chunks are 2 or 20 MiB: 1024 of them cover 2 to 20 GiB).
pub(crate) const MAX_CHUNKS_PER_BUFFER: usize = 1024;
/// Most chunks a peer accepts in one step.
const MAX_CHUNKS_PER_STEP: usize = 1 << 16;

/// Why a rank in another process cannot read `ptr..ptr+bytes` in place, if
/// it cannot (pointer queries only: legal during stream capture).
pub(crate) fn cross_process_obstacle(ptr: u64, bytes: usize) -> Option<String> {
    match vmm::backing(ptr) {
        Backing::LegacyIpc => None,
        Backing::Pool => Some(format!(
            "the buffer at {ptr:#x} is stream-ordered pool memory (cuMemAllocAsync), which cannot be exported"
        )),
        Backing::Other => Some(format!(
            "the buffer at {ptr:#x} is neither cuMemAlloc nor cuMemCreate device memory, so it cannot be exported"
        )),
        Backing::Vmm => exportable_chunks(ptr, bytes).err(),
    }
}

/// The chunks behind a cuMem buffer, or why they cannot be exported.
fn exportable_chunks(ptr: u64, bytes: usize) -> std::result::Result<Vec<VmmChunk>, String> {
    let chunks = vmm::physical_chunks(ptr, bytes.max(1), MAX_CHUNKS_PER_BUFFER)
        .map_err(|e| format!("the cuMem buffer at {ptr:#x} cannot be exported: {e}"))?;
    match chunks.iter().find(|c| !c.exportable_as_fd) {
        Some(c) => Err(format!(
            "the cuMem buffer at {ptr:#x} lies in a physical allocation (at {:#x}) created without \
             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, which cannot leave its process",
            c.base
        )),
        None => Ok(chunks),
    }
}

/// A run: chunks adjacent in the owner's address space, in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    /// (start, size) of each chunk.
    pub chunks: Vec<(u64, u64)>,
}

impl Run {
    fn start(&self) -> u64 {
        self.chunks.first().map_or(0, |c| c.0)
    }

    fn end(&self) -> u64 {
        self.chunks.last().map_or(0, |c| c.0 + c.1)
    }
}

/// Where a buffer lies in its owner's runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct InRun {
    pub run: u32,
    /// From the run's start to the buffer.
    pub offset: u64,
}

/// A buffer's address and its chunks, (start, size) each.
pub(crate) type BufferChunks = (u64, Vec<(u64, u64)>);

/// Groups the chunks behind `buffers` into runs; returns them and where
/// each buffer lies in them. Pure.
pub(crate) fn plan_runs(buffers: &[BufferChunks]) -> Result<(Vec<Run>, Vec<InRun>)> {
    let mut chunks: Vec<(u64, u64)> = buffers.iter().flat_map(|(_, c)| c.iter().copied()).collect();
    chunks.sort_unstable();
    chunks.dedup();
    let mut runs: Vec<Run> = Vec::new();
    for (start, size) in chunks {
        match runs.last_mut() {
            Some(run) if start < run.end() => {
                return Err(Error::Ipc(format!(
                    "the driver reported overlapping physical allocations ({start:#x} + {size:#x} bytes starts \
                     inside the one ending at {:#x})",
                    run.end()
                )))
            }
            Some(run) if start == run.end() => run.chunks.push((start, size)),
            _ => runs.push(Run { chunks: vec![(start, size)] }),
        }
    }
    let placements = buffers
        .iter()
        .map(|&(ptr, _)| {
            let index = runs.partition_point(|r| r.start() <= ptr).checked_sub(1);
            match index.filter(|&i| ptr < runs[i].end()) {
                Some(i) => Ok(InRun { run: i as u32, offset: ptr - runs[i].start() }),
                None => Err(Error::Ipc(format!("the buffer at {ptr:#x} lies in none of its chunks"))),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((runs, placements))
}

/// What a rank publishes for its cuMem buffers of one step: the chunk sizes
/// of each run (descriptors in this order) and where to fetch them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct VmmExport {
    pub runs: Vec<Vec<u64>>,
    pub socket: FdSocket,
}

/// This rank's exported chunks of one step, held until peers fetched them.
pub(crate) struct VmmExports {
    server: FdServer,
    fds: Vec<OwnedFd>,
}

impl VmmExports {
    /// Serves the descriptors to `ranks` (the ranks in other processes).
    pub fn serve(self, ranks: &[usize], deadline: Deadline) -> Result<Serving> {
        self.server.serve(self.fds, ranks, deadline)
    }
}

/// The cuMem buffers of one step, exported: where each lies in the runs,
/// what to publish and what to serve.
pub(crate) struct Exported {
    pub placements: Vec<InRun>,
    pub published: VmmExport,
    pub exports: VmmExports,
}

/// Exports the cuMem buffers `buffers` (address, bytes).
pub(crate) fn export(buffers: &[(u64, usize)]) -> Result<Exported> {
    let mut found = Vec::with_capacity(buffers.len());
    for &(ptr, bytes) in buffers {
        let chunks = exportable_chunks(ptr, bytes).map_err(|why| {
            Error::Unsupported(format!(
                "{why}; allocate buffers that peers in other processes read with a POSIX file-descriptor handle \
                 type (PyTorch's expandable segments do), or leave them unregistered (they are staged)"
            ))
        })?;
        found.push((ptr, chunks.iter().map(|c| (c.base, c.size)).collect()));
    }
    let (runs, placements) = plan_runs(&found)?;
    let fds = runs
        .iter()
        .flat_map(|r| r.chunks.iter().map(|&(start, _)| vmm::export_fd(start)))
        .collect::<Result<Vec<_>>>()?;
    let server = FdServer::bind()?;
    let published = VmmExport {
        runs: runs.iter().map(|r| r.chunks.iter().map(|c| c.1).collect()).collect(),
        socket: server.address(),
    };
    Ok(Exported { placements, published, exports: VmmExports { server, fds } })
}

/// Fetches and imports, as rank `me`, the chunks a peer published (their
/// descriptors are closed as soon as they are imported).
pub(crate) fn fetch_chunks(export: &VmmExport, me: usize, deadline: Deadline) -> Result<Vec<ChunkHandle>> {
    let expected: usize = export.runs.iter().map(Vec::len).sum();
    if expected > MAX_CHUNKS_PER_STEP || export.runs.iter().any(Vec::is_empty) {
        return Err(Error::Protocol {
            from: "peer".into(),
            what: format!("a cuMem export of {expected} chunks in {} runs", export.runs.len()),
        });
    }
    let mut handles = Vec::with_capacity(expected);
    fd_passing::fetch_fds(&export.socket, me, expected, deadline, |batch| {
        for fd in batch {
            fd_passing::check_cumem_fd(fd.as_fd())?;
            handles.push(ChunkHandle::import_fd(fd.as_fd())?);
        }
        Ok(())
    })?;
    Ok(handles)
}

/// Maps each run of a peer's export into `ctx` (the handles in the order
/// [`fetch_chunks`] returned them); returns the mappings, by run.
pub(crate) fn map_runs(
    ctx: &Arc<CudaContext>,
    runs: &[Vec<u64>],
    handles: Vec<ChunkHandle>,
) -> Result<Vec<VmmMapping>> {
    let mut handles = handles.into_iter();
    runs.iter()
        .map(|sizes| {
            let chunks: Vec<(ChunkHandle, u64)> =
                handles.by_ref().take(sizes.len()).zip(sizes.iter().copied()).collect();
            if chunks.len() != sizes.len() {
                return Err(Error::Protocol { from: "peer".into(), what: "fewer cuMem chunks than announced".into() });
            }
            VmmMapping::map(ctx, chunks).map_err(|e| Error::Ipc(format!("mapping a peer's cuMem buffer failed ({e})")))
        })
        .collect()
}

/// The chunks behind a cuMem buffer of this rank, for the peers in its
/// process (see [`remap_in_process`]). Called by the owner, with its own
/// context current: a context of another device does not find them.
pub(crate) fn chunks_for_peers_in_process(ptr: u64, bytes: usize) -> Result<Vec<VmmChunk>> {
    vmm::physical_chunks(ptr, bytes.max(1), MAX_CHUNKS_PER_BUFFER)
}

/// For a peer in this process on another device: cuMem memory is readable
/// only by the devices its mapping grants access (`cuCtxEnablePeerAccess`
/// does not cover it), so map the chunks behind the buffer at `ptr` (as
/// its owner listed them) again into a range of `ctx`'s own. `None` when
/// `ctx`'s device owns every chunk (the address works as is). Only the
/// chunks' handles are asked for here (which works from any context).
pub(crate) fn remap_in_process(
    ctx: &Arc<CudaContext>,
    ptr: u64,
    chunks: &[VmmChunk],
) -> Result<Option<(u64, VmmMapping)>> {
    let first = chunks.first().map_or(0, |c| c.base);
    if !chunks.first().is_some_and(|c| c.base <= ptr && ptr - c.base < c.size) {
        return Err(Error::Protocol {
            from: "peer".into(),
            what: format!("the cuMem buffer at {ptr:#x} was offered without the chunk holding it"),
        });
    }
    if chunks.iter().all(|c| c.device == Some(ctx.ordinal())) {
        return Ok(None);
    }
    let handles = chunks.iter().map(|c| Ok((ChunkHandle::retain(c.base)?, c.size))).collect::<Result<Vec<_>>>()?;
    let mapping = VmmMapping::map(ctx, handles)?;
    Ok(Some((mapping.ptr() + (ptr - first), mapping)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const BASE: u64 = 0x7f00_0000_0000;

    fn chunk(i: u64, size: u64) -> (u64, u64) {
        (BASE + i * 2 * MIB, size)
    }

    #[test]
    fn neighbouring_chunks_form_one_run_and_buffers_keep_their_offsets() {
        // Buffer A straddles chunks 0-1, buffer B lies in chunk 1, buffer C
        // in chunk 5 (not adjacent to 1: a run of its own).
        let a = (BASE + 2 * MIB - 64, vec![chunk(0, 2 * MIB), chunk(1, 2 * MIB)]);
        let b = (BASE + 3 * MIB, vec![chunk(1, 2 * MIB)]);
        let c = (BASE + 10 * MIB + 4096, vec![chunk(5, 2 * MIB)]);
        let (runs, placements) = plan_runs(&[a, b, c]).unwrap();
        assert_eq!(runs.len(), 2);
        assert_eq!(runs[0].chunks, [chunk(0, 2 * MIB), chunk(1, 2 * MIB)], "chunk 1 exported once");
        assert_eq!(runs[1].chunks, [chunk(5, 2 * MIB)]);
        let at = |run, offset| InRun { run, offset };
        assert_eq!(placements, [at(0, 2 * MIB - 64), at(0, 3 * MIB), at(1, 4096)]);
    }

    #[test]
    fn buffers_in_any_order_map_to_the_same_runs() {
        let a = (BASE + 4 * MIB, vec![chunk(2, 2 * MIB)]);
        let b = (BASE, vec![chunk(0, 2 * MIB), chunk(1, 2 * MIB)]);
        let (runs, placements) = plan_runs(&[a, b]).unwrap();
        assert_eq!(runs.len(), 1, "chunks 0, 1, 2 are neighbours");
        assert_eq!(runs[0].chunks.len(), 3);
        assert_eq!(placements, [InRun { run: 0, offset: 4 * MIB }, InRun { run: 0, offset: 0 }]);
    }

    #[test]
    fn chunks_of_different_sizes_join_when_they_touch() {
        // A 20 MiB chunk followed by a 2 MiB one (the large and small pools
        // never share a range in PyTorch, but nothing here depends on it).
        let big = (BASE, 20 * MIB);
        let small = (BASE + 20 * MIB, 2 * MIB);
        let (runs, placements) = plan_runs(&[(BASE + 20 * MIB - 8, vec![big, small])]).unwrap();
        assert_eq!(runs, [Run { chunks: vec![big, small] }]);
        assert_eq!(placements, [InRun { run: 0, offset: 20 * MIB - 8 }]);
    }

    #[test]
    fn inconsistent_chunk_reports_are_refused() {
        let overlapping = [(BASE, vec![(BASE, 4 * MIB)]), (BASE + 2 * MIB, vec![(BASE + 2 * MIB, 2 * MIB)])];
        assert!(plan_runs(&overlapping).is_err());
        let outside = [(BASE + 8 * MIB, vec![(BASE, 2 * MIB)])];
        assert!(plan_runs(&outside).is_err());
    }

    #[test]
    fn exports_round_trip_through_the_rendezvous_encoding() {
        let export = VmmExport {
            runs: vec![vec![2 * MIB, 2 * MIB], vec![20 * MIB]],
            socket: FdSocket { path: "/tmp/tpar-fd-0123456789abcdef/fd.sock".into(), nonce: [9; 16] },
        };
        let bytes = serde_json::to_vec(&export).unwrap();
        assert_eq!(serde_json::from_slice::<VmmExport>(&bytes).unwrap(), export);
    }

    #[test]
    fn absurd_exports_from_peers_are_refused_before_connecting() {
        let socket = FdSocket { path: "/tmp/tpar-fd-0123456789abcdef/fd.sock".into(), nonce: [0; 16] };
        let deadline = Deadline::after(std::time::Duration::from_secs(1));
        let huge = VmmExport { runs: vec![vec![2 * MIB; MAX_CHUNKS_PER_STEP + 1]], socket: socket.clone() };
        assert!(matches!(fetch_chunks(&huge, 0, deadline), Err(Error::Protocol { .. })));
        let empty_run = VmmExport { runs: vec![vec![]], socket };
        assert!(matches!(fetch_chunks(&empty_run, 0, deadline), Err(Error::Protocol { .. })));
    }
}
