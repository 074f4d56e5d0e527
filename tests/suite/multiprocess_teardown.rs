//! Teardown across processes (issue 13 item 9): one rank drops its
//! communicator while the other still has calls in flight — calls the
//! leaver never joins. The leaver's drop waits for its device work, then
//! meets the other process in a bounded barrier before freeing what that
//! process maps; the other rank's extra calls time out, its drop completes
//! the barrier. No crash, no hang, and a new communicator on the same
//! devices afterwards passes a checked call of every algorithm with no CUDA
//! error. Each rank leaves early once (rank 0, the rendezvous root, then
//! rank 1).
//!
//! The parent test starts this test binary twice, running
//! [`teardown_child`] as rank 0 and as rank 1 (on GPUs 0 and 1 when two are
//! visible; both on GPU 0 under MPS otherwise).

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use rand::SeedableRng;
use tp_allreduce::rendezvous::Id;
use tp_allreduce::{Algorithm, Comm, Config, DType, Error};

use crate::common;

const WORLD: usize = 2;
const N: usize = 65_536;
/// The child's instructions: `rank;device;seed`.
const CHILD_ENV: &str = "TP_ALLREDUCE_TEST_TEARDOWN";
/// The three rendezvous ids, one per line.
const IDS_ENV: &str = "TP_ALLREDUCE_TEST_TEARDOWN_IDS";

#[test]
fn a_rank_dropping_while_its_peer_has_calls_in_flight() {
    let test = "a_rank_dropping_while_its_peer_has_calls_in_flight";
    let _lock = common::gpu_lock();
    if crate::multiprocess::placement(test, WORLD).is_none() {
        return;
    }
    let seed: u64 = rand::random();
    eprintln!("{test}: seed {seed}");
    let ids: Vec<Id> = (0..3).map(|_| Id::new_unix().expect("rendezvous id")).collect();
    let id_lines = ids.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n");
    let second_device = if tp_allreduce::driver::device_count() >= 2 { 1 } else { 0 };
    let started = Instant::now();
    let children: Vec<_> = [(0, 0), (1, second_device)]
        .into_iter()
        .map(|(rank, device)| {
            Command::new(std::env::current_exe().expect("test binary"))
                .args(["multiprocess_teardown::teardown_child", "--exact", "--ignored", "--nocapture"])
                .args(["--test-threads", "1"])
                .env(CHILD_ENV, format!("{rank};{device};{seed}"))
                .env(IDS_ENV, &id_lines)
                .env("CUDA_DEVICE_MAX_CONNECTIONS", "2")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("starting a child process")
        })
        .collect();
    // Bounded: a hung child is killed (every wait inside is bounded too).
    let (outputs, text) = common::wait_for_children(children, started, Duration::from_secs(240));
    ids.iter().for_each(Id::remove_files);
    for (i, o) in outputs.iter().enumerate() {
        assert!(o.status.success(), "process {i} failed ({}):\n{text}", o.status);
    }
    for r in 0..WORLD {
        assert!(text.contains(&format!("teardown: rank {r} ok")), "rank {r} did not pass:\n{text}");
    }
}

fn input(seed: u64, case: usize, rank: usize) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ ((case as u64) << 8) ^ rank as u64);
    common::random_vec::<f32>(&mut rng, N)
}

fn check(seed: u64, case: usize, rank: usize, algorithm: Algorithm, out: &[f32]) -> Result<(), String> {
    let inputs: Vec<Vec<f32>> = (0..WORLD).map(|r| input(seed, case, r)).collect();
    common::check_sum(&inputs, out, algorithm.max_roundings(WORLD))
        .map_err(|e| format!("rank {rank}: {algorithm}: {e}"))
}

fn config() -> Config {
    Config {
        timeout: Duration::from_secs(2),
        launch_timeout: Duration::from_secs(2),
        rendezvous_timeout: Duration::from_secs(30),
        nccl_fallback: false,
        ..Config::default()
    }
}

/// Every algorithm the communicator runs.
fn algorithms(comm: &mut Comm) -> Vec<Algorithm> {
    Algorithm::OURS.into_iter().filter(|&a| comm.set_algorithm(Some(a)).is_ok()).collect()
}

/// One call of `algorithm` from `input` into a fresh poisoned output.
fn launch(comm: &mut Comm, algorithm: Algorithm, input: &CudaSlice<f32>) -> Result<CudaSlice<f32>, String> {
    let rank = comm.rank();
    comm.set_algorithm(Some(algorithm)).map_err(|e| format!("rank {rank}: {e}"))?;
    let s: Arc<CudaStream> = comm.stream();
    let output = s.clone_htod(&vec![f32::MAX; N]).map_err(|e| format!("{e:?}"))?;
    let (src, dst) = (common::ptr_of(&s, input, 0), common::ptr_of(&s, &output, 0));
    // SAFETY: live buffers of N f32 on this rank's stream, kept until the
    // communicator is gone (its drop waits for the device).
    unsafe { comm.all_reduce_raw(src, dst, N, DType::F32, s.cu_stream()) }
        .map_err(|e| format!("rank {rank}: {algorithm}: {e}"))?;
    Ok(output)
}

/// Phase `case`: both ranks launch one call per algorithm; `leaver` drops
/// its communicator right away, the other launches calls the leaver never
/// joins, which must time out. The joint calls must be right on both.
fn leave_early(
    ctx: &Arc<CudaContext>,
    rank: usize,
    id: Id,
    seed: u64,
    case: usize,
    leaver: usize,
) -> Result<(), String> {
    let stream = ctx.new_stream().map_err(|e| format!("{e:?}"))?;
    let input = stream.clone_htod(&input(seed, case, rank)).map_err(|e| format!("{e:?}"))?;
    let mut comm = Comm::from_rank_with_config(stream, rank, WORLD, id, config()).map_err(|e| format!("init: {e}"))?;
    let joint = algorithms(&mut comm);
    let outputs: Vec<CudaSlice<f32>> = joint.iter().map(|&a| launch(&mut comm, a, &input)).collect::<Result<_, _>>()?;
    if rank == leaver {
        drop(comm);
        println!("rank {rank}: left with {} calls in flight", joint.len());
    } else {
        let _extra: Vec<CudaSlice<f32>> = [Algorithm::OneShotPush, Algorithm::Ring]
            .into_iter()
            .map(|a| launch(&mut comm, a, &input))
            .collect::<Result<_, _>>()?;
        match comm.synchronize() {
            Err(e @ (Error::Timeout(_) | Error::PeerAborted(_))) => {
                println!("rank {rank}: calls without the peer: {e}")
            }
            other => return Err(format!("rank {rank}: calls after the peer left gave {other:?}, want a timeout")),
        }
        drop(comm);
    }
    for (algorithm, output) in joint.into_iter().zip(&outputs) {
        let out = output.stream().clone_dtoh(output).map_err(|e| format!("{e:?}"))?;
        check(seed, case, rank, algorithm, &out)?;
    }
    Ok(())
}

/// A new communicator on the same device: a checked call of every
/// algorithm, then `close`, then the context synchronises cleanly.
fn afterwards(ctx: &Arc<CudaContext>, rank: usize, id: Id, seed: u64) -> Result<usize, String> {
    let stream = ctx.new_stream().map_err(|e| format!("{e:?}"))?;
    let input = stream.clone_htod(&input(seed, 2, rank)).map_err(|e| format!("{e:?}"))?;
    let mut comm = Comm::from_rank_with_config(stream, rank, WORLD, id, config()).map_err(|e| format!("init: {e}"))?;
    let all = algorithms(&mut comm);
    for &algorithm in &all {
        let output = launch(&mut comm, algorithm, &input)?;
        comm.synchronize().map_err(|e| format!("rank {rank}: {algorithm}: {e}"))?;
        check(seed, 2, rank, algorithm, &output.stream().clone_dtoh(&output).map_err(|e| format!("{e:?}"))?)?;
    }
    comm.close().map_err(|e| format!("rank {rank}: close: {e}"))?;
    ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    tp_allreduce::driver::context_synchronize().map_err(|e| format!("rank {rank}: device error afterwards: {e}"))?;
    Ok(all.len())
}

#[test]
#[ignore = "a child process of a_rank_dropping_while_its_peer_has_calls_in_flight, which runs it"]
fn teardown_child() {
    let (Ok(spec), Ok(ids)) = (std::env::var(CHILD_ENV), std::env::var(IDS_ENV)) else {
        common::skipped("teardown_child runs only as a child of a_rank_dropping_while_its_peer_has_calls_in_flight");
        return;
    };
    let parts: Vec<&str> = spec.split(';').collect();
    let [rank, device, seed] = parts[..] else { panic!("bad {CHILD_ENV}={spec}") };
    let (rank, seed): (usize, u64) = (rank.parse().unwrap(), seed.parse().unwrap());
    let ids: Vec<Id> = ids.lines().map(|l| l.parse().expect("rendezvous id")).collect();
    let ctx = CudaContext::new(device.parse().unwrap()).expect("CudaContext::new");
    // SAFETY: as in `common::gpu` (work is ordered explicitly per stream).
    unsafe { ctx.disable_event_tracking() };
    for (leaver, id) in ids.iter().take(WORLD).enumerate() {
        let started = Instant::now();
        leave_early(&ctx, rank, id.clone(), seed, leaver, leaver)
            .unwrap_or_else(|e| panic!("rank {rank}, rank {leaver} leaving early: {e}"));
        println!("rank {rank}: rank {leaver} left early: torn down in {:.1} s", started.elapsed().as_secs_f64());
    }
    let checked = afterwards(&ctx, rank, ids[2].clone(), seed).unwrap_or_else(|e| panic!("afterwards: {e}"));
    println!("teardown: rank {rank} ok ({checked} algorithms afterwards, close ok)");
}
