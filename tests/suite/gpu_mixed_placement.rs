//! Mixed placement: four ranks in two processes of two ranks each, so every
//! rank has a peer in its own process and two in the other. Each peer must
//! map a buffer in the form that fits it — the address within a process,
//! the CUDA IPC handle across — for the regions (push algorithms) and for
//! registered and graph-captured buffers (pull algorithms). Before, a rank
//! with any peer in another process sent IPC handles to every peer, and the
//! same-process peer failed to open a handle of its own process.
//!
//! The parent test starts this test binary twice, running
//! [`mixed_placement_child`] with the ranks of one process (ranks 0-1 on
//! GPU 0, ranks 2-3 on GPU 1 when there are two GPUs; both on GPU 0 under
//! MPS otherwise).

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaSlice};
use rand::SeedableRng;
use tp_allreduce::driver::DeviceMemory;
use tp_allreduce::rendezvous::Id;
use tp_allreduce::{Algorithm, Comm, Config, DType, ReduceOp};

use crate::common;

const WORLD: usize = 4;
const N: usize = 20_000;
/// The child's instructions: `ranks;device;seed;id` (ranks like `0,1`).
const CHILD_ENV: &str = "TP_ALLREDUCE_TEST_MIXED_PLACEMENT";

#[test]
fn mixed_placement_across_processes() {
    let test = "mixed_placement_across_processes";
    let _lock = common::gpu_lock();
    // Two processes (of two ranks each) over the visible GPUs.
    if crate::multiprocess::placement(test, 2).is_none() {
        return;
    }
    let seed: u64 = rand::random();
    eprintln!("{test}: seed {seed}");
    let id = Id::new_unix().expect("rendezvous id");
    let second_device = if tp_allreduce::driver::device_count() >= 2 { 1 } else { 0 };
    let started = Instant::now();
    let children: Vec<_> = [("0,1", 0), ("2,3", second_device)]
        .into_iter()
        .map(|(ranks, device)| {
            Command::new(std::env::current_exe().expect("test binary"))
                .args(["gpu_mixed_placement::mixed_placement_child", "--exact", "--ignored", "--nocapture"])
                .args(["--test-threads", "1"])
                .env(CHILD_ENV, format!("{ranks};{device};{seed};{id}"))
                // Two streams per process; under MPS all clients share one cap.
                .env("CUDA_DEVICE_MAX_CONNECTIONS", "4")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("starting a child process")
        })
        .collect();
    // Bounded: a hung child is killed (every wait inside is bounded too).
    let (outputs, text) = common::wait_for_children(children, started, Duration::from_secs(240));
    id.remove_files();
    for (i, o) in outputs.iter().enumerate() {
        assert!(o.status.success(), "process {i} failed ({}):\n{text}", o.status);
    }
    for r in 0..WORLD {
        assert!(text.contains(&format!("mixed placement: rank {r} ok")), "rank {r} did not pass:\n{text}");
    }
}

/// Rank `rank`'s input of case `case`, the same in every process.
fn input(seed: u64, case: usize, rank: usize) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ ((case as u64) << 8) ^ rank as u64);
    common::random_vec::<f32>(&mut rng, N)
}

fn check(seed: u64, case: usize, rank: usize, what: &str, out: &[f32]) -> Result<(), String> {
    let inputs: Vec<Vec<f32>> = (0..WORLD).map(|r| input(seed, case, r)).collect();
    common::check_sum(&inputs, out, 3).map_err(|e| format!("rank {rank}: {what}: {e}"))
}

fn upload(ctx: &Arc<CudaContext>, data: &[f32]) -> Result<DeviceMemory, String> {
    let m = DeviceMemory::alloc(ctx, N * 4).map_err(|e| e.to_string())?;
    ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    tp_allreduce::driver::memcpy_htod(m.ptr(), bytemuck::cast_slice(data)).map_err(|e| e.to_string())?;
    Ok(m)
}

fn download(ctx: &Arc<CudaContext>, m: &DeviceMemory) -> Result<Vec<f32>, String> {
    ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    let mut host = vec![0f32; N];
    tp_allreduce::driver::memcpy_dtoh(bytemuck::cast_slice_mut(&mut host), m.ptr()).map_err(|e| e.to_string())?;
    Ok(host)
}

/// One rank's calls: push algorithms on the regions, a pull algorithm on a
/// registered buffer, and a captured pull call registered afterwards.
fn rank_script(mut comm: Comm, seed: u64) -> Result<String, String> {
    let rank = comm.rank();
    let ctx = comm.context().clone();
    let stream = comm.stream();
    let e = |e: tp_allreduce::Error| format!("rank {rank}: {e}");
    for (case, algorithm) in [Algorithm::OneShotPush, Algorithm::TwoShotPush].into_iter().enumerate() {
        comm.set_algorithm(Some(algorithm)).map_err(e)?;
        let send: CudaSlice<f32> = stream.clone_htod(&input(seed, case, rank)).map_err(|e| format!("{e:?}"))?;
        let mut recv: CudaSlice<f32> = stream.clone_htod(&vec![f32::MAX; N]).map_err(|e| format!("{e:?}"))?;
        comm.all_reduce(&send, &mut recv, &ReduceOp::Sum).map_err(e)?;
        comm.synchronize().map_err(e)?;
        check(seed, case, rank, algorithm.name(), &stream.clone_dtoh(&recv).map_err(|e| format!("{e:?}"))?)?;
    }
    comm.set_algorithm(Some(Algorithm::OneShotPull)).map_err(e)?;
    let registered = upload(&ctx, &input(seed, 2, rank))?;
    let output = upload(&ctx, &[f32::MAX; N])?;
    comm.register_buffer(registered.ptr(), N * 4).map_err(e)?;
    // SAFETY: both buffers hold N f32 of this rank's context.
    unsafe { comm.all_reduce_raw(registered.ptr(), output.ptr(), N, DType::F32, stream.cu_stream()) }.map_err(e)?;
    comm.synchronize().map_err(e)?;
    check(seed, 2, rank, "one-shot-pull on a registered buffer", &download(&ctx, &output)?)?;

    comm.set_algorithm(Some(Algorithm::TwoShotPull)).map_err(e)?;
    let captured_in = upload(&ctx, &input(seed, 3, rank))?;
    let captured_out = upload(&ctx, &[f32::MAX; N])?;
    let graph = tp_allreduce::driver::capture(
        &stream,
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        // SAFETY: both buffers hold N f32 of this rank's context.
        || unsafe { comm.all_reduce_raw(captured_in.ptr(), captured_out.ptr(), N, DType::F32, stream.cu_stream()) },
    )
    .map_err(e)?;
    let inputs = comm.register_graph_buffers().map_err(e)?;
    graph.launch().map_err(|e| format!("rank {rank}: graph launch: {e:?}"))?;
    comm.synchronize().map_err(e)?;
    check(seed, 3, rank, "two-shot-pull graph replay", &download(&ctx, &captured_out)?)?;
    drop(graph);
    comm.deregister_buffers().map_err(e)?;
    Ok(format!("{} ranks on this GPU, {inputs} captured input registered", comm.ranks_on_device()))
}

#[test]
#[ignore = "a child process of mixed_placement_across_processes, which runs it"]
fn mixed_placement_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        common::skipped("mixed_placement_child runs only as a child of mixed_placement_across_processes");
        return;
    };
    let parts: Vec<&str> = spec.split(';').collect();
    let [ranks, device, seed, id] = parts[..] else { panic!("bad {CHILD_ENV}={spec}") };
    let ranks: Vec<usize> = ranks.split(',').map(|r| r.parse().unwrap()).collect();
    let seed: u64 = seed.parse().unwrap();
    let id: Id = id.parse().unwrap();
    let ctx = CudaContext::new(device.parse().unwrap()).expect("CudaContext::new");
    // SAFETY: as in `common::gpu` (work is ordered explicitly per stream).
    unsafe { ctx.disable_event_tracking() };
    let config = Config {
        timeout: Duration::from_secs(5),
        launch_timeout: Duration::from_secs(5),
        rendezvous_timeout: Duration::from_secs(60),
        nccl_fallback: false,
        ..Config::default()
    };
    let outcomes: Vec<(usize, Result<String, String>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|&rank| {
                let (stream, id, config) = (ctx.new_stream().unwrap(), id.clone(), config.clone());
                scope.spawn(move || {
                    let comm = Comm::from_rank_with_config(stream, rank, WORLD, id, config)
                        .map_err(|e| format!("rank {rank}: init: {e}"))?;
                    rank_script(comm, seed)
                })
            })
            .collect();
        ranks.iter().copied().zip(handles.into_iter().map(|h| h.join().expect("rank thread"))).collect()
    });
    let mut failed = Vec::new();
    for (rank, outcome) in outcomes {
        match outcome {
            Ok(what) => println!("mixed placement: rank {rank} ok ({what})"),
            Err(e) => failed.push(e),
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
