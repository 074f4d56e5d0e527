//! cuMem (VMM) memory as the input of pull algorithms, allocated the way
//! PyTorch's expandable segments allocate it: one reserved range, several
//! physical chunks of one granule (2 MiB), each mapped with its own
//! `cuMemMap`, inputs that straddle chunk boundaries.
//!
//! * In one process: the driver facts the design rests on (a chunk walk
//!   finds each mapping, what is exportable, remapping a range), and an
//!   in-process group reading cuMem inputs in place (on two GPUs the peer
//!   maps the chunks again for its own device, from the chunk list its
//!   owner found), and the call's argument check over chunk boundaries.
//! * Across two processes: `gpu_vmm_processes.rs`.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys, CudaContext};
use rand::SeedableRng;
use tp_allreduce::driver::vmm::{self, Backing, ChunkHandle, VmmMapping};
use tp_allreduce::driver::{self as drv, DeviceMemory};
use tp_allreduce::{Algorithm, Comm, Config, DType, Error, Transport};

use crate::common::{self, TestElem};

/// cuMem memory like one expandable segment: `chunks` physical allocations
/// of one granule each, mapped one by one into a reserved range that the
/// device may read and write. Requests the POSIX file-descriptor handle
/// type when `exportable` (as PyTorch does), none otherwise.
pub struct VmmAlloc {
    ctx: Arc<CudaContext>,
    base: u64,
    chunk: usize,
    handles: Vec<sys::CUmemGenericAllocationHandle>,
}

fn check(status: sys::CUresult, what: &str) {
    assert_eq!(status, sys::CUresult::CUDA_SUCCESS, "{what}");
}

impl VmmAlloc {
    pub fn new(ctx: &Arc<CudaContext>, chunks: usize, exportable: bool) -> VmmAlloc {
        ctx.bind_to_thread().unwrap();
        // SAFETY: all zeros is a valid CUmemAllocationProp.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ctx.cu_device();
        prop.requestedHandleTypes = if exportable {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        };
        let mut chunk = 0usize;
        let minimum = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: valid out-pointer and properties.
        check(unsafe { sys::cuMemGetAllocationGranularity(&mut chunk, &prop, minimum) }, "granularity");
        let mut base = 0;
        // SAFETY: valid out-pointer; a fresh reservation.
        check(unsafe { sys::cuMemAddressReserve(&mut base, chunk * chunks, 0, 0, 0) }, "cuMemAddressReserve");
        let mut alloc = VmmAlloc { ctx: ctx.clone(), base, chunk, handles: Vec::new() };
        for i in 0..chunks {
            let mut handle = 0;
            // SAFETY: valid out-pointer and properties.
            check(unsafe { sys::cuMemCreate(&mut handle, chunk, &prop, 0) }, "cuMemCreate");
            alloc.handles.push(handle);
            // SAFETY: inside the reservation, one granule, a fresh handle.
            check(unsafe { sys::cuMemMap(base + (i * chunk) as u64, chunk, 0, handle, 0) }, "cuMemMap");
        }
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the whole range is mapped.
        check(unsafe { sys::cuMemSetAccess(base, chunk * chunks, &access, 1) }, "cuMemSetAccess");
        alloc
    }

    pub fn ptr(&self) -> u64 {
        self.base
    }

    /// Bytes per physical chunk.
    pub fn chunk(&self) -> u64 {
        self.chunk as u64
    }

    /// Unmaps and releases chunk `i`, leaving a hole in the range.
    pub fn unmap(&mut self, i: usize) {
        self.ctx.bind_to_thread().unwrap();
        let handle = std::mem::replace(&mut self.handles[i], 0);
        assert_ne!(handle, 0, "chunk {i} is mapped");
        // SAFETY: mapped and created in `new`; `drop` skips it now.
        unsafe {
            check(sys::cuMemUnmap(self.base + (i * self.chunk) as u64, self.chunk), "cuMemUnmap");
            check(sys::cuMemRelease(handle), "cuMemRelease");
        }
    }
}

impl Drop for VmmAlloc {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for (i, &handle) in self.handles.iter().enumerate().filter(|(_, h)| **h != 0) {
            // SAFETY: mapped and created in `new`, not unmapped yet, undone once.
            unsafe {
                sys::cuMemUnmap(self.base + (i * self.chunk) as u64, self.chunk);
                sys::cuMemRelease(handle);
            }
        }
        // SAFETY: reserved in `new`.
        unsafe { sys::cuMemAddressFree(self.base, self.chunk * self.handles.len().max(1)) };
    }
}

pub fn upload<T: TestElem + bytemuck::Pod>(ctx: &Arc<CudaContext>, ptr: u64, data: &[T]) {
    ctx.bind_to_thread().unwrap();
    drv::memcpy_htod(ptr, bytemuck::cast_slice(data)).unwrap();
}

pub fn download<T: TestElem + bytemuck::Pod>(ctx: &Arc<CudaContext>, ptr: u64, n: usize) -> Vec<T> {
    ctx.bind_to_thread().unwrap();
    let mut host = vec![T::default(); n];
    drv::memcpy_dtoh(bytemuck::cast_slice_mut(&mut host), ptr).unwrap();
    host
}

pub fn poison(ctx: &Arc<CudaContext>, ptr: u64, bytes: usize) {
    ctx.bind_to_thread().unwrap();
    drv::memset_d8(ptr, common::POISON, bytes).unwrap();
}

/// Rank `rank`'s input number `case` (the same in every process).
pub fn input<T: TestElem>(seed: u64, case: u64, rank: usize, n: usize) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (case << 8) ^ rank as u64);
    common::random_vec::<T>(&mut rng, n)
}

/// The facts the design rests on, on one GPU: every chunk behind a range
/// that straddles three is found with its own extent (the driver reports
/// each `cuMemMap`, not the whole reservation); what can be exported; a
/// range mapped again elsewhere reads the same memory.
#[test]
fn vmm_memory_is_recognised_and_split_into_its_chunks() {
    let test = "vmm_memory_is_recognised_and_split_into_its_chunks";
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu(test) else { return };
    let segment = VmmAlloc::new(&ctx, 3, true);
    let (base, c) = (segment.ptr(), segment.chunk());
    eprintln!("{test}: granule {c} bytes");
    assert_eq!(vmm::backing(base), Backing::Vmm);
    assert_eq!(vmm::backing(base + 2 * c + 5), Backing::Vmm);
    // 16 bytes of chunk 0, all of chunk 1, 16 bytes of chunk 2.
    let chunks = vmm::physical_chunks(base + c - 16, (c + 32) as usize, 16).unwrap();
    let extents: Vec<(u64, u64)> = chunks.iter().map(|k| (k.base, k.size)).collect();
    assert_eq!(extents, [(base, c), (base + c, c), (base + 2 * c, c)], "one entry per cuMemMap");
    assert!(chunks.iter().all(|k| k.exportable_as_fd && k.device == Some(ctx.ordinal())), "{chunks:?}");
    assert!(chunks[0].id != chunks[1].id && chunks[1].id != chunks[2].id, "{chunks:?}");
    assert_eq!(
        vmm::allocation_id(base + 8, Backing::Vmm).unwrap(),
        vmm::allocation_id(base + c - 8, Backing::Vmm).unwrap()
    );
    vmm::export_fd(base + c).expect("a POSIX-fd chunk exports");

    let private = VmmAlloc::new(&ctx, 1, false);
    assert_eq!(vmm::backing(private.ptr()), Backing::Vmm);
    assert!(!vmm::chunk_at(private.ptr()).unwrap().exportable_as_fd);
    let e = vmm::export_fd(private.ptr()).expect_err("a chunk without an fd handle type does not export");
    assert!(matches!(e, Error::Ipc(_)), "{e}");

    let legacy = DeviceMemory::alloc(&ctx, 4096).unwrap();
    assert_eq!(vmm::backing(legacy.ptr()), Backing::LegacyIpc);
    let stream = ctx.new_stream().unwrap();
    let mut pooled = 0;
    // SAFETY: a live stream of the bound context; freed below.
    check(unsafe { sys::cuMemAllocAsync(&mut pooled, 4096, stream.cu_stream()) }, "cuMemAllocAsync");
    drv::synchronize(&stream).unwrap();
    assert_eq!(vmm::backing(pooled), Backing::Pool);
    // SAFETY: allocated above on this stream.
    check(unsafe { sys::cuMemFreeAsync(pooled, stream.cu_stream()) }, "cuMemFreeAsync");
    drv::synchronize(&stream).unwrap();

    // Chunks 1 and 2 mapped again back to back read what was written
    // through the original range.
    let pattern: Vec<f32> = (0..(2 * c / 4) as usize).map(|i| i as f32).collect();
    upload(&ctx, base + c, &pattern);
    let handles = vec![(ChunkHandle::retain(base + c).unwrap(), c), (ChunkHandle::retain(base + 2 * c).unwrap(), c)];
    let again = VmmMapping::map(&ctx, handles).unwrap();
    assert_ne!(again.ptr(), base + c);
    assert!(download::<f32>(&ctx, again.ptr(), pattern.len()) == pattern, "the second mapping reads other memory");
}

/// The in-process group used below: ranks on GPUs 0 and 1 when there are
/// two (the peer then maps the cuMem chunks again for its own device),
/// both on GPU 0 otherwise (the address is used as it is).
fn in_process_pair(test: &str) -> Option<(Vec<Arc<CudaContext>>, Vec<Comm>)> {
    let ctx0 = common::gpu(test)?;
    let ctx1 = if drv::device_count() >= 2 {
        let c = CudaContext::new(1).expect("CudaContext::new(1)");
        // SAFETY: as in `common::gpu`.
        unsafe { c.disable_event_tracking() };
        c
    } else {
        ctx0.clone()
    };
    let streams = vec![ctx0.new_stream().unwrap(), ctx1.new_stream().unwrap()];
    let config = Config {
        timeout: Duration::from_secs(5),
        launch_timeout: Duration::from_secs(5),
        nccl_fallback: false,
        ..Config::default()
    };
    let mut comms = Comm::from_streams(streams, config).unwrap();
    if comms[0].transport() != Transport::PeerToPeer {
        common::skipped_unless_required(&format!("the GPUs have no P2P, pull algorithms are unavailable ({test})"));
        return None;
    }
    for c in comms.iter_mut() {
        c.set_algorithm(Some(Algorithm::TwoShotPull)).unwrap();
    }
    Some((vec![ctx0, ctx1], comms))
}

/// Ranks of one process read each other's cuMem inputs in place, even
/// without an exportable handle type (nothing leaves the process): a
/// registered buffer eagerly, and a captured input replayed with fresh data.
#[test]
fn vmm_inputs_in_one_process_are_read_in_place() {
    let test = "vmm_inputs_in_one_process_are_read_in_place";
    let _lock = common::gpu_lock();
    let Some((ctxs, comms)) = in_process_pair(test) else { return };
    let seed: u64 = rand::random();
    eprintln!("{test}: seed {seed}, ranks on GPUs {} and {}", ctxs[0].ordinal(), ctxs[1].ordinal());
    let segments: Vec<VmmAlloc> = ctxs.iter().map(|c| VmmAlloc::new(c, 3, false)).collect();
    let chunk = segments[0].chunk();
    let n = 21_504; // 42 KB of bf16 (3 tokens x 7168)
    let registered: Vec<u64> = segments.iter().map(|s| s.ptr() + chunk - 20_480).collect();
    let captured: Vec<u64> = segments.iter().map(|s| s.ptr() + 2 * chunk - 8_192).collect();
    let outputs: Vec<DeviceMemory> = ctxs.iter().map(|c| DeviceMemory::alloc(c, n * 2).unwrap()).collect();
    let roundings = Algorithm::TwoShotPull.max_roundings(2);

    let regs: Vec<(u64, usize)> = registered.iter().map(|&p| (p, n * 2)).collect();
    Comm::register_buffer_group(&comms, &regs).unwrap();
    let run = |case: u64, inputs: &[u64], launch: &dyn Fn()| {
        let data: Vec<Vec<half::bf16>> = (0..2).map(|r| input(seed, case, r, n)).collect();
        for r in 0..2 {
            upload(&ctxs[r], inputs[r], &data[r]);
            poison(&ctxs[r], outputs[r].ptr(), n * 2);
        }
        launch();
        for (r, c) in comms.iter().enumerate() {
            c.synchronize().unwrap_or_else(|e| panic!("case {case} rank {r}: {e}"));
            let out = download::<half::bf16>(&ctxs[r], outputs[r].ptr(), n);
            common::check_sum(&data, &out, roundings).unwrap_or_else(|e| panic!("case {case} rank {r}: {e}"));
        }
    };
    let eager = || {
        for (r, c) in comms.iter().enumerate() {
            // SAFETY: n bf16 inside live allocations of the rank's context.
            unsafe { c.all_reduce_raw(registered[r], outputs[r].ptr(), n, DType::Bf16, c.stream().cu_stream()) }
                .unwrap();
        }
    };
    for case in 0..3 {
        run(case, &registered, &eager);
    }
    let graphs: Vec<_> = comms
        .iter()
        .enumerate()
        .map(|(r, c)| {
            let stream = c.stream();
            drv::capture(&stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, || {
                // SAFETY: as above.
                unsafe { c.all_reduce_raw(captured[r], outputs[r].ptr(), n, DType::Bf16, stream.cu_stream()) }
            })
            .unwrap()
        })
        .collect();
    assert_eq!(Comm::register_graph_buffers_group(&comms).unwrap(), 1, "the captured input is read in place");
    assert!(comms[0].registration_notes().is_empty(), "{:?}", comms[0].registration_notes());
    let replay = || graphs.iter().for_each(|g| g.launch().unwrap());
    for case in 10..60 {
        run(case, &captured, &replay);
    }
    drop(graphs);
    assert_eq!(Comm::deregister_buffers_group(&comms).unwrap(), 2);
    eprintln!("{test}: 3 eager calls and 50 replays correct");
}

/// The argument check of a call on cuMem memory: the driver reports one
/// chunk per address, so a range over several chunks is accepted only
/// while the chunks after the first continue it (a range over an unmapped
/// chunk is refused with the count it overran), checked on one rank
/// (refused calls never reach the peer).
#[test]
fn vmm_inputs_running_into_unmapped_memory_are_refused() {
    let test = "vmm_inputs_running_into_unmapped_memory_are_refused";
    let _lock = common::gpu_lock();
    let Some((ctxs, comms)) = in_process_pair(test) else { return };
    let mut segment = VmmAlloc::new(&ctxs[0], 3, true);
    let (base, c) = (segment.ptr(), segment.chunk());
    segment.unmap(1);
    let out = DeviceMemory::alloc(&ctxs[0], (c + 8_192) as usize).unwrap();
    let call = |input: u64, n: usize| {
        // SAFETY: refused before anything is queued, or the range is mapped.
        unsafe { comms[0].all_reduce_raw(input, out.ptr(), n, DType::F32, comms[0].stream().cu_stream()) }
    };
    // The last 4 KiB of chunk 0 plus one element; then over the hole into chunk 2.
    for (n, what) in [(1_025, "one element into the hole"), (((c + 8_192) / 4) as usize, "across the hole")] {
        let e = call(base + c - 4_096, n).expect_err(what);
        let text = e.to_string();
        assert!(matches!(e, Error::InvalidUsage(_)), "{what}: {e}");
        assert!(text.contains("send holds 4096 bytes") && text.contains("wrong count or dtype"), "{what}: {text}");
    }
    // Past the end of the last chunk of the range (also the reservation's).
    let e = call(base + 3 * c - 4_096, 1_025).expect_err("past the last chunk");
    assert!(e.to_string().contains("send holds 4096 bytes"), "{e}");
    assert!(comms.iter().all(|comm| comm.synchronize().is_ok()), "a refused call broke nothing");
    eprintln!("{test}: ranges over a hole and past the range refused with the count they overran");
}
