//! cuMem (VMM) inputs across two processes (one rank each; this test
//! binary started twice, running [`vmm_child`]), allocated like PyTorch's
//! expandable segments (`gpu_vmm::VmmAlloc`), each input straddling
//! physical chunks:
//!
//! * `eager`: `register_buffer` on a cuMem input over three chunks, then
//!   OneShotPull and TwoShotPull calls read it in place;
//! * `graph`: a captured graph with two cuMem inputs (42 KB of bf16, one
//!   straddling two chunks, one reused by a second call and by a second
//!   graph), `register_graph_buffers`, 1000 replays with fresh inputs;
//! * `fallback`: chunks created without an exportable handle type:
//!   `register_buffer` is refused with the reason, eager and captured calls
//!   are staged (a note says why) and correct; ranks whose inputs differ in
//!   kind are refused at registration on both ranks.
//!
//! Every output is poisoned before each call and checked against the f64
//! sum of every rank's input; no descriptor socket may be left behind.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext};
use half::bf16;
use tp_allreduce::driver::{self as drv, DeviceMemory};
use tp_allreduce::{Algorithm, Comm, Config, DType, Error, Transport};

use crate::common::{self, TestElem};
use crate::gpu_vmm::{download, input, poison, upload, VmmAlloc};

/// Where the test's rendezvous and descriptor sockets go, to see leftovers.
fn scratch_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tpar-test-vmm-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The child's instructions: `scenario;rank;device;seed;id`.
const CHILD_ENV: &str = "TP_ALLREDUCE_TEST_VMM";

/// Runs `scenario` in two processes (one rank each) and checks that both
/// ranks report success and left no socket behind.
fn two_processes(test: &str, scenario: &str) {
    let _lock = common::gpu_lock();
    let Some(place) = crate::multiprocess::placement(test, 2) else { return };
    let gpus: Vec<&str> = place.gpus.split(',').collect();
    let seed: u64 = rand::random();
    eprintln!("{test}: seed {seed}, GPUs {}", place.gpus);
    let id = tp_allreduce::rendezvous::Id::new_unix().expect("rendezvous id");
    let dir = scratch_dir(scenario);
    let started = Instant::now();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(std::env::current_exe().expect("test binary"))
                .args(["gpu_vmm_processes::vmm_child", "--exact", "--ignored", "--nocapture", "--test-threads", "1"])
                .env(CHILD_ENV, format!("{scenario};{rank};{};{seed};{id}", gpus[rank % gpus.len()]))
                .env("CUDA_DEVICE_MAX_CONNECTIONS", "2")
                .env("XDG_RUNTIME_DIR", &dir)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("starting a child process")
        })
        .collect();
    // Bounded: a hung child is killed (every wait inside is bounded too).
    let (outputs, text) = common::wait_for_children(children, started, Duration::from_secs(300));
    id.remove_files();
    if let Some(skip) = text.lines().find(|l| l.starts_with("skipped:")) {
        common::skipped_unless_required(&format!("{} ({test})", skip.trim_start_matches("skipped: ")));
        return;
    }
    for (rank, o) in outputs.iter().enumerate() {
        assert!(o.status.success(), "rank {rank} failed ({}):\n{text}", o.status);
        assert!(text.contains(&format!("vmm {scenario}: rank {rank} ok")), "rank {rank} did not pass:\n{text}");
    }
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "descriptor sockets left behind: {left:?}");
    let _ = std::fs::remove_dir(&dir);
}

#[test]
fn vmm_registered_buffer_across_processes() {
    two_processes("vmm_registered_buffer_across_processes", "eager");
}

#[test]
fn vmm_graph_1000_replays_across_processes() {
    two_processes("vmm_graph_1000_replays_across_processes", "graph");
}

#[test]
fn vmm_without_exportable_handle_type_falls_back_to_staging() {
    two_processes("vmm_without_exportable_handle_type_falls_back_to_staging", "fallback");
}

/// One rank of a child process.
struct Rank {
    comm: Comm,
    ctx: Arc<CudaContext>,
    seed: u64,
}

const CAPTURE: sys::CUstreamCaptureMode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;

fn text(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Rank {
    /// Writes fresh inputs of `case` at `inputs`, poisons the outputs, runs
    /// `launch`, waits, and checks each (output, input index, algorithm)
    /// against the f64 sum of both ranks' inputs.
    fn round<T: TestElem + bytemuck::Pod>(
        &self,
        case: u64,
        inputs: &[u64],
        checks: &[(u64, usize, Algorithm)],
        n: usize,
        launch: impl FnOnce() -> Result<(), String>,
    ) -> Result<(), String> {
        let rank = self.comm.rank();
        let data: Vec<Vec<Vec<T>>> =
            (0..inputs.len()).map(|i| (0..2).map(|r| input(self.seed, case * 8 + i as u64, r, n)).collect()).collect();
        for (i, &p) in inputs.iter().enumerate() {
            upload(&self.ctx, p, &data[i][rank]);
        }
        for &(out, _, _) in checks {
            poison(&self.ctx, out, n * std::mem::size_of::<T>());
        }
        launch()?;
        self.comm.synchronize().map_err(|e| format!("case {case}: {e}"))?;
        for &(out, i, algorithm) in checks {
            let got = download::<T>(&self.ctx, out, n);
            common::check_sum(&data[i], &got, algorithm.max_roundings(2))
                .map_err(|e| format!("case {case}, {algorithm} on input {i}: {e}"))?;
        }
        Ok(())
    }

    /// Queues one allreduce of `n` elements on the communicator's stream.
    fn call(&self, input: u64, output: u64, n: usize, dtype: DType) -> Result<(), String> {
        // SAFETY: the tests pass n elements inside live allocations of this context.
        unsafe { self.comm.all_reduce_raw(input, output, n, dtype, self.comm.stream().cu_stream()) }.map_err(text)
    }

    fn capture(&self, calls: &[(u64, u64)], n: usize, dtype: DType) -> Result<cudarc::driver::CudaGraph, String> {
        drv::capture(&self.comm.stream(), CAPTURE, || {
            for &(input, output) in calls {
                self.call(input, output, n, dtype).map_err(Error::InvalidUsage)?;
            }
            Ok(())
        })
        .map_err(|e| format!("capture: {e}"))
    }
}

fn outputs(ctx: &Arc<CudaContext>, count: usize, bytes: usize) -> Result<Vec<DeviceMemory>, String> {
    (0..count).map(|_| DeviceMemory::alloc(ctx, bytes).map_err(text)).collect()
}

/// `register_buffer` on a cuMem input over three chunks; eager pull calls.
fn eager(mut r: Rank) -> Result<String, String> {
    let segment = VmmAlloc::new(&r.ctx, 3, true);
    let c = segment.chunk();
    // The tail of chunk 0, all of chunk 1, the head of chunk 2.
    let input = segment.ptr() + c - 8_192;
    let n = ((c + 16_384) / 4) as usize;
    let out = outputs(&r.ctx, 1, n * 4)?.remove(0);
    r.comm.register_buffer(input, n * 4).map_err(|e| format!("register_buffer: {e}"))?;
    for (k, algorithm) in [Algorithm::OneShotPull, Algorithm::TwoShotPull].into_iter().enumerate() {
        r.comm.set_algorithm(Some(algorithm)).map_err(text)?;
        for round in 0..3 {
            let case = (k * 10 + round) as u64;
            r.round::<f32>(case, &[input], &[(out.ptr(), 0, algorithm)], n, || {
                r.call(input, out.ptr(), n, DType::F32)
            })?;
        }
    }
    let released = r.comm.deregister_buffers().map_err(text)?;
    if released != 1 {
        return Err(format!("deregister_buffers released {released} entries, expected 1"));
    }
    Ok(format!("{n} f32 over 3 chunks of {c} bytes registered in place, 6 eager calls"))
}

/// A captured graph on two cuMem inputs, registered, replayed 1000 times.
fn graph(mut r: Rank) -> Result<String, String> {
    let segment = VmmAlloc::new(&r.ctx, 3, true);
    let c = segment.chunk();
    let n = 21_504; // 42 KB of bf16: 3 tokens x 7168
    let a = segment.ptr() + c - 20_480; // straddles chunks 0 and 1
    let b = segment.ptr() + 2 * c + 4_096; // inside chunk 2
    let outs = outputs(&r.ctx, 4, n * 2)?;
    r.comm.set_algorithm(Some(Algorithm::TwoShotPull)).map_err(text)?;
    let first = r.capture(&[(a, outs[0].ptr()), (b, outs[1].ptr()), (a, outs[2].ptr())], n, DType::Bf16)?;
    r.comm.set_algorithm(Some(Algorithm::OneShotPull)).map_err(text)?;
    let second = r.capture(&[(b, outs[3].ptr())], n, DType::Bf16)?;
    let registered = r.comm.register_graph_buffers().map_err(|e| format!("register_graph_buffers: {e}"))?;
    if registered != 2 || !r.comm.registration_notes().is_empty() {
        return Err(format!("registered {registered} inputs (expected 2), notes {:?}", r.comm.registration_notes()));
    }
    let (two, one) = (Algorithm::TwoShotPull, Algorithm::OneShotPull);
    let checks = [(outs[0].ptr(), 0, two), (outs[1].ptr(), 1, two), (outs[2].ptr(), 0, two), (outs[3].ptr(), 1, one)];
    let started = Instant::now();
    for replay in 0..1000 {
        r.round::<bf16>(replay, &[a, b], &checks, n, || {
            first.launch().map_err(|e| format!("launch: {e:?}"))?;
            second.launch().map_err(|e| format!("launch: {e:?}"))
        })?;
    }
    let seconds = started.elapsed().as_secs_f64();
    drop((first, second));
    let released = r.comm.deregister_buffers().map_err(text)?;
    Ok(format!("2 cuMem inputs registered, 1000 replays x 4 allreduces correct in {seconds:.1} s, {released} released"))
}

/// Chunks without an exportable handle type: refused, staged, correct.
fn fallback(mut r: Rank) -> Result<String, String> {
    let rank = r.comm.rank();
    let private = VmmAlloc::new(&r.ctx, 2, false);
    let n = 8_192;
    let input = private.ptr() + private.chunk() - 8_192; // straddles chunks 0 and 1
    let out = outputs(&r.ctx, 1, n * 4)?.remove(0);
    let two = Algorithm::TwoShotPull;
    r.comm.set_algorithm(Some(two)).map_err(text)?;
    let refusal = match r.comm.register_buffer(input, n * 4) {
        Ok(()) => return Err("register_buffer accepted memory that cannot be exported".into()),
        Err(Error::Unsupported(m)) if m.contains("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR") => m,
        Err(e) => return Err(format!("register_buffer failed without naming the handle type: {e}")),
    };
    for case in 0..2 {
        r.round::<f32>(case, &[input], &[(out.ptr(), 0, two)], n, || r.call(input, out.ptr(), n, DType::F32))?;
    }
    let graph = r.capture(&[(input, out.ptr())], n, DType::F32)?;
    let registered = r.comm.register_graph_buffers().map_err(|e| format!("register_graph_buffers: {e}"))?;
    let notes = r.comm.registration_notes();
    if registered != 0 || !notes.iter().any(|n| n.contains("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR")) {
        return Err(format!("the captured input was not staged with a note: {registered} registered, notes {notes:?}"));
    }
    for replay in 0..50 {
        let launch = || graph.launch().map_err(|e| format!("launch: {e:?}"));
        r.round::<f32>(100 + replay, &[input], &[(out.ptr(), 0, two)], n, launch)?;
    }
    drop(graph);
    // Rank 0's input is exportable, rank 1's is not: call 0 would read an
    // entry on rank 0 and the staging copy on rank 1. Refused on both.
    let mixed = VmmAlloc::new(&r.ctx, 1, rank == 0);
    let graph = r.capture(&[(mixed.ptr(), out.ptr())], n, DType::F32)?;
    match r.comm.register_graph_buffers() {
        Ok(k) => return Err(format!("ranks with inputs of different kinds registered {k} inputs")),
        Err(e) if e.to_string().contains("a staged copy") => {}
        Err(e) => return Err(format!("mixed kinds refused with an unclear error: {e}")),
    }
    drop(graph);
    r.comm.deregister_buffers().map_err(text)?;
    eprintln!("rank {rank}: register_buffer refused: {refusal}");
    eprintln!("rank {rank}: notes: {notes:?}");
    Ok("register_buffer refused with the reason; 2 eager calls and 50 replays staged and correct; mixed kinds refused"
        .into())
}

#[test]
#[ignore = "a child process of the vmm_*_across_processes tests, which run it"]
fn vmm_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        common::skipped("vmm_child runs only as a child of the vmm_*_across_processes tests");
        return;
    };
    let parts: Vec<&str> = spec.split(';').collect();
    let [scenario, rank, device, seed, id] = parts[..] else { panic!("bad {CHILD_ENV}={spec}") };
    let (rank, seed): (usize, u64) = (rank.parse().unwrap(), seed.parse().unwrap());
    let ctx = CudaContext::new(device.parse().unwrap()).expect("CudaContext::new");
    // SAFETY: as in `common::gpu` (work is ordered explicitly on the stream).
    unsafe { ctx.disable_event_tracking() };
    let config = Config {
        timeout: Duration::from_secs(5),
        launch_timeout: Duration::from_secs(5),
        rendezvous_timeout: Duration::from_secs(60),
        nccl_fallback: false,
        ..Config::default()
    };
    let stream = ctx.new_stream().unwrap();
    let comm = Comm::from_rank_with_config(stream, rank, 2, id.parse().unwrap(), config)
        .unwrap_or_else(|e| panic!("vmm {scenario}: rank {rank}: init: {e}"));
    if comm.transport() != Transport::PeerToPeer {
        println!(
            "skipped: vmm {scenario}: rank {rank}: transport {}, pull algorithms are unavailable",
            comm.transport()
        );
        return;
    }
    let r = Rank { comm, ctx, seed };
    let outcome = match scenario {
        "eager" => eager(r),
        "graph" => graph(r),
        "fallback" => fallback(r),
        other => panic!("unknown scenario {other}"),
    };
    match outcome {
        Ok(what) => println!("vmm {scenario}: rank {rank} ok ({what})"),
        Err(e) => panic!("vmm {scenario}: rank {rank}: {e}"),
    }
}
