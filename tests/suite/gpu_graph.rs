//! CUDA-graph capture: 122 allreduces with a dependent elementwise kernel
//! between each (a model layer), captured once per rank and replayed many
//! times with fresh inputs; every replay checked. Pull algorithms go through
//! the capture -> register protocol; an unregistered replay fails cleanly.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaGraph};
use rand::Rng;
use tp_allreduce::driver::DeviceMemory;
use tp_allreduce::{Algorithm, Comm, Config, DType, DeviceBuffer, ReduceOp};

use crate::common;

const LAYERS: usize = 122;

struct RankBuffers {
    x: Vec<DeviceBuffer<f32>>,
    y: Vec<DeviceBuffer<f32>>,
}

/// Every rank's layer buffers (n f32 each) on its stream.
fn rank_buffers(comms: &[Comm], n: usize) -> Vec<RankBuffers> {
    let alloc = |c: &Comm| DeviceBuffer::<f32>::alloc(&c.stream(), n).unwrap();
    comms
        .iter()
        .map(|c| RankBuffers {
            x: (0..=LAYERS).map(|_| alloc(c)).collect(),
            y: (0..LAYERS).map(|_| alloc(c)).collect(),
        })
        .collect()
}

fn bias(layer: usize) -> f32 {
    ((layer % 7) as f32 - 3.0) * 0.125
}

/// Per-call timeout of the tests' communicators.
const TIMEOUT: Duration = Duration::from_secs(3);

/// An in-process group of `world` ranks on `ctx`, with `algorithm` forced
/// (`None`: the selection).
fn group(ctx: &Arc<CudaContext>, world: usize, algorithm: Option<Algorithm>) -> Vec<Comm> {
    group_with(ctx, world, algorithm, Config { timeout: TIMEOUT, launch_timeout: TIMEOUT, ..Config::default() })
}

fn group_with(ctx: &Arc<CudaContext>, world: usize, algorithm: Option<Algorithm>, config: Config) -> Vec<Comm> {
    let mut comms = Comm::from_streams(common::streams(ctx, world), config).unwrap();
    for c in comms.iter_mut() {
        c.set_algorithm(algorithm).unwrap();
    }
    comms
}

/// One graph per rank: `record(rank, comm, stream)` issues the work
/// captured on the rank's stream.
fn capture_each(comms: &[Comm], mut record: impl FnMut(usize, &Comm, sys::CUstream)) -> Vec<CudaGraph> {
    comms
        .iter()
        .enumerate()
        .map(|(r, c)| {
            let stream = c.stream();
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
            record(r, c, stream.cu_stream());
            stream
                .end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
                .unwrap()
                .expect("a graph")
        })
        .collect()
}

/// Captures the layer chain on every rank's stream.
fn capture(comms: &[Comm], bufs: &mut [RankBuffers]) -> Vec<CudaGraph> {
    let world = comms.len();
    capture_each(comms, |r, c, _| {
        let stream = c.stream();
        let b = &mut bufs[r];
        for l in 0..LAYERS {
            c.all_reduce(&b.x[l], &mut b.y[l], &ReduceOp::Sum)
                .unwrap_or_else(|e| panic!("capture rank {r} layer {l}: {e}"));
            let (x, y) = (&mut b.x[l + 1], &b.y[l]);
            tp_allreduce::driver::elementwise::affine(&stream, y, x, 1.0 / world as f32, bias(l)).unwrap();
        }
    })
}

fn download(buf: &DeviceMemory, n: usize) -> Vec<f32> {
    let mut host = vec![0f32; n];
    tp_allreduce::driver::memcpy_dtoh(bytemuck::cast_slice_mut(&mut host), buf.ptr()).unwrap();
    host
}

fn graph_run(test: &str, world: usize, algorithm: Option<Algorithm>, replays: usize, n: usize) {
    graph_run_with(
        test,
        Config { timeout: TIMEOUT, launch_timeout: TIMEOUT, ..Config::default() },
        world,
        algorithm,
        replays,
        n,
    )
}

/// `graph_run` with a configuration of its own (islands, transport).
pub(crate) fn graph_run_with(
    test: &str,
    config: Config,
    world: usize,
    algorithm: Option<Algorithm>,
    replays: usize,
    n: usize,
) {
    let _lock = common::gpu_lock();
    graph_run_locked(test, config, world, algorithm, replays, n)
}

/// [`graph_run_with`] for a caller that holds the GPU lock (and, say, a
/// test hook that must only see this group's init).
pub(crate) fn graph_run_locked(
    test: &str,
    config: Config,
    world: usize,
    algorithm: Option<Algorithm>,
    replays: usize,
    n: usize,
) {
    let Some(ctx) = common::gpu(test) else { return };
    let comms = group_with(&ctx, world, algorithm, config);
    graph_replays(test, comms, algorithm, replays, n);
}

/// [`graph_run_locked`] with rank r on `contexts[r]` (several GPUs); the
/// caller holds the GPU lock.
pub(crate) fn graph_run_with_contexts(
    test: &str,
    config: Config,
    contexts: &[Arc<CudaContext>],
    algorithm: Algorithm,
    replays: usize,
    n: usize,
) {
    let streams = contexts.iter().map(|c| c.new_stream().expect("stream")).collect();
    let mut comms = Comm::from_streams(streams, config).unwrap();
    for c in comms.iter_mut() {
        c.set_algorithm(Some(algorithm)).unwrap();
    }
    graph_replays(test, comms, Some(algorithm), replays, n);
}

/// Captures the layer chain on every rank, registers, replays `replays`
/// times with fresh inputs and checks every replay.
fn graph_replays(test: &str, comms: Vec<Comm>, algorithm: Option<Algorithm>, replays: usize, n: usize) {
    let world = comms.len();
    let mut rng = common::rng(test);
    let mut bufs = rank_buffers(&comms, n);
    let graphs = capture(&comms, &mut bufs);
    let registered = Comm::register_graph_buffers_group(&comms).unwrap();
    let plan = comms[0].plan_call(n * 4, DType::F32, true, false);
    eprintln!("{test}: {} per call ({}), {registered} captured inputs registered", plan.algorithm, plan.reason);
    if plan.algorithm.reads_peer_inputs() {
        assert_eq!(registered, LAYERS, "every captured pull call must have been registered");
    }
    let started = Instant::now();
    for rep in 0..replays {
        let x0: Vec<Vec<f32>> = (0..world).map(|_| (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()).collect();
        for (r, x) in x0.iter().enumerate() {
            bufs[r].x[0].copy_from_host(x).unwrap();
        }
        for g in &graphs {
            g.launch().unwrap();
        }
        for c in &comms {
            c.synchronize().unwrap_or_else(|e| panic!("replay {rep}: {e}"));
        }
        // Final layer against the f64 chain.
        let mut y: Vec<f64> = (0..n).map(|i| x0.iter().map(|x| x[i] as f64).sum()).collect();
        for l in 0..LAYERS - 1 {
            for v in y.iter_mut() {
                *v = world as f64 * (*v / world as f64 + bias(l) as f64);
            }
        }
        let last: Vec<Vec<f32>> = (0..world).map(|r| bufs[r].y[LAYERS - 1].to_host().unwrap()).collect();
        for (r, out) in last.iter().enumerate() {
            for i in 0..n {
                assert!(
                    (out[i] as f64 - y[i]).abs() <= 1e-3 * (1.0 + y[i].abs()),
                    "replay {rep} rank {r} [{i}]: got {} want {}",
                    out[i],
                    y[i]
                );
            }
            assert_eq!(common::bits(out), common::bits(&last[0]), "replay {rep}: rank {r} differs bitwise");
        }
        // Every 100th replay: every layer exactly against its actual inputs.
        if rep % 100 == 0 {
            let roundings = algorithm.map_or(1, |a| a.max_roundings(world));
            for l in 0..LAYERS {
                let xs: Vec<Vec<f32>> = bufs.iter().map(|b| b.x[l].to_host().unwrap()).collect();
                for (r, b) in bufs.iter().enumerate() {
                    let out = b.y[l].to_host().unwrap();
                    common::check_sum(&xs, &out, roundings)
                        .unwrap_or_else(|e| panic!("replay {rep} layer {l} rank {r}: {e}"));
                }
            }
        }
    }
    eprintln!(
        "{test}: {replays} replays x {LAYERS} allreduces x {world} ranks correct ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn graph_replays_selected_algorithm() {
    graph_run("graph_replays_selected_algorithm", 8, None, 1000, 10_755);
}

#[test]
fn graph_replays_two_shot_pull_registered() {
    graph_run("graph_replays_two_shot_pull_registered", 8, Some(Algorithm::TwoShotPull), 1000, 10_755);
}

#[test]
fn graph_replays_every_algorithm() {
    for algorithm in [Algorithm::OneShotPull, Algorithm::OneShotPush, Algorithm::TwoShotPush, Algorithm::Ring] {
        // (The copy-engine ring needs one rank per GPU: its graphs replay in
        // gpu_pcie_family over two GPUs.)
        graph_run("graph_replays_every_algorithm", 4, Some(algorithm), 200, 4_099);
    }
}

/// Replaying a captured pull graph before `register_graph_buffers` fails
/// with a clear error on every rank, fast (no timeout wait), without hanging.
#[test]
fn unregistered_graph_replay_fails_cleanly() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("unregistered_graph_replay_fails_cleanly") else { return };
    let world = 4;
    let n = 4_096;
    let comms = group(&ctx, world, Some(Algorithm::TwoShotPull));
    let mut bufs = rank_buffers(&comms, n);
    let graphs = capture(&comms, &mut bufs);
    assert_eq!(comms[0].pending_graph_buffers(), LAYERS);
    let started = Instant::now();
    for g in &graphs {
        g.launch().unwrap();
    }
    for (r, c) in comms.iter().enumerate() {
        let e = c.synchronize().expect_err("an unregistered replay must fail");
        let msg = e.to_string();
        assert!(
            matches!(e, tp_allreduce::Error::Device(_) | tp_allreduce::Error::PeerAborted(_)),
            "rank {r}: unexpected error {msg}"
        );
        eprintln!("rank {r}: {msg}");
        // The communicator stays unusable afterwards.
        assert!(matches!(c.check(), Err(tp_allreduce::Error::Broken(_))));
    }
    assert!(started.elapsed() < TIMEOUT, "failing must not wait for the timeout ({:?})", started.elapsed());
}

/// `deregister_buffers` releases every registration: a graph captured
/// before it fails cleanly on replay (its entries are zeroed, never handed
/// out again), and calls captured on one input share one registration.
#[test]
fn deregistered_graph_replay_fails_cleanly() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("deregistered_graph_replay_fails_cleanly") else { return };
    let world = 2;
    let n = 4_096;
    let comms = group(&ctx, world, Some(Algorithm::TwoShotPull));
    let inputs: Vec<DeviceMemory> = (0..world).map(|_| DeviceMemory::alloc(&ctx, n * 4).unwrap()).collect();
    let outputs: Vec<DeviceMemory> = (0..world).map(|_| DeviceMemory::alloc(&ctx, n * 4).unwrap()).collect();
    for (r, b) in inputs.iter().enumerate() {
        tp_allreduce::driver::memcpy_htod(b.ptr(), bytemuck::cast_slice(&vec![r as f32 + 1.0; n])).unwrap();
    }
    let graphs = capture_each(&comms, |r, c, stream| {
        for _ in 0..3 {
            // SAFETY: live buffers of n f32 on this context.
            unsafe { c.all_reduce_raw(inputs[r].ptr(), outputs[r].ptr(), n, DType::F32, stream).unwrap() };
        }
    });
    assert_eq!(comms[0].pending_graph_buffers(), 1, "3 calls on one input share one entry");
    assert_eq!(Comm::register_graph_buffers_group(&comms).unwrap(), 1);
    for g in &graphs {
        g.launch().unwrap();
    }
    let want = (1..=world).sum::<usize>() as f32;
    for (r, c) in comms.iter().enumerate() {
        c.synchronize().unwrap();
        assert!(download(&outputs[r], n).iter().all(|&v| v == want), "rank {r}: registered replay is wrong");
    }
    assert_eq!(Comm::deregister_buffers_group(&comms).unwrap(), 1, "one entry released");
    assert_eq!(Comm::deregister_buffers_group(&comms).unwrap(), 0, "nothing left to release");
    let started = Instant::now();
    for g in &graphs {
        g.launch().unwrap();
    }
    for (r, c) in comms.iter().enumerate() {
        let e = c.synchronize().expect_err("a replay after deregistration must fail");
        let msg = e.to_string();
        eprintln!("rank {r}: {msg}");
        assert!(
            msg.contains("deregister_buffers()") || matches!(e, tp_allreduce::Error::PeerAborted(_)),
            "rank {r}: the error must name registration: {msg}"
        );
    }
    assert!(started.elapsed() < TIMEOUT, "failing must not wait for the timeout ({:?})", started.elapsed());
}

/// A call on a registered address whose buffer was freed and reallocated
/// fails on the host (before any kernel reads the peers' stale mapping).
#[test]
fn reallocated_registered_address_is_refused() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("reallocated_registered_address_is_refused") else { return };
    let world = 2;
    let n = 786_434; // 3 MiB of f32: an allocation of its own
    let comms = group(&ctx, world, Some(Algorithm::OneShotPull));
    let outputs: Vec<DeviceMemory> = (0..world).map(|_| DeviceMemory::alloc(&ctx, n * 4).unwrap()).collect();
    let first: Vec<DeviceMemory> = (0..world).map(|_| DeviceMemory::alloc(&ctx, n * 4).unwrap()).collect();
    let addresses: Vec<u64> = first.iter().map(|b| b.ptr()).collect();
    let regs: Vec<(u64, usize)> = first.iter().map(|b| (b.ptr(), n * 4)).collect();
    Comm::register_buffer_group(&comms, &regs).unwrap();
    // Same-process ranks exchange plain addresses: freeing without
    // deregistering is the misuse under test, not undefined IPC behaviour.
    drop(first);
    let second: Vec<DeviceMemory> = (0..world).map(|_| DeviceMemory::alloc(&ctx, n * 4).unwrap()).collect();
    let reused: Vec<bool> = second.iter().zip(&addresses).map(|(b, &a)| b.ptr() == a).collect();
    assert!(reused.iter().all(|&r| r), "the allocator did not hand out the freed addresses again ({reused:?})");
    for (r, c) in comms.iter().enumerate() {
        // SAFETY: live buffers of n f32 on this context.
        let e = unsafe { c.all_reduce_raw(second[r].ptr(), outputs[r].ptr(), n, DType::F32, c.stream().cu_stream()) }
            .expect_err("a reallocated registered address must be refused");
        let msg = e.to_string();
        assert!(msg.contains("was freed") && msg.contains("deregister_buffers"), "rank {r}: {msg}");
    }
    // The communicator is still usable: release, re-register, get fresh sums.
    Comm::deregister_buffers_group(&comms).unwrap();
    for (r, b) in second.iter().enumerate() {
        tp_allreduce::driver::memcpy_htod(b.ptr(), bytemuck::cast_slice(&vec![(r + 2) as f32; n])).unwrap();
    }
    let regs: Vec<(u64, usize)> = second.iter().map(|b| (b.ptr(), n * 4)).collect();
    Comm::register_buffer_group(&comms, &regs).unwrap();
    for (r, c) in comms.iter().enumerate() {
        // SAFETY: as above.
        unsafe { c.all_reduce_raw(second[r].ptr(), outputs[r].ptr(), n, DType::F32, c.stream().cu_stream()).unwrap() };
    }
    for (r, c) in comms.iter().enumerate() {
        c.synchronize().unwrap();
        assert!(download(&outputs[r], n).iter().all(|&v| v == 5.0), "rank {r}: re-registered buffer gave a wrong sum");
    }
}

/// Call k of a captured graph reads, on every rank, the entry its own rank
/// chose for call k: ranks that use a registered buffer at different calls
/// are refused at registration, not left to sum unrelated buffers.
#[test]
fn mismatched_capture_patterns_are_refused() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("mismatched_capture_patterns_are_refused") else { return };
    let world = 2;
    let n = 4_096;
    let comms = group(&ctx, world, Some(Algorithm::TwoShotPull));
    let alloc = || (0..world).map(|_| DeviceMemory::alloc(&ctx, n * 4).unwrap()).collect::<Vec<_>>();
    let (registered, captured, outputs) = (alloc(), alloc(), alloc());
    let regs: Vec<(u64, usize)> = registered.iter().map(|b| (b.ptr(), n * 4)).collect();
    Comm::register_buffer_group(&comms, &regs).unwrap();
    let _graphs = capture_each(&comms, |r, c, stream| {
        // Rank 0: registered, then captured; rank 1: the other way round.
        let order = if r == 0 { [&registered[r], &captured[r]] } else { [&captured[r], &registered[r]] };
        for input in order {
            // SAFETY: live buffers of n f32 on this context.
            unsafe { c.all_reduce_raw(input.ptr(), outputs[r].ptr(), n, DType::F32, stream).unwrap() };
        }
    });
    let e = Comm::register_graph_buffers_group(&comms).expect_err("different patterns must be refused").to_string();
    eprintln!("{e}");
    assert!(
        e.contains("captured pull call 0 reads registered buffer #0 on rank 0 but the input of call 0 on rank 1"),
        "{e}"
    );
}

/// A registration table smaller than the captured pull inputs: capture
/// never fails for it (it once did: "more than N registered buffers /
/// captured pull inputs over this communicator's life"). The first inputs
/// get entries, the rest read a staged copy with a note; every replay is
/// right; a second capture window (new buffers, as an engine's
/// re-capture) works too.
#[test]
fn captures_past_a_full_registration_table_read_staged_copies() {
    let _lock = common::gpu_lock();
    let test = "captures_past_a_full_registration_table_read_staged_copies";
    let Some(ctx) = common::gpu(test) else { return };
    let mut rng = common::rng(test);
    let world = 2;
    let n = 4_096;
    let config = Config { timeout: TIMEOUT, launch_timeout: TIMEOUT, max_registered_buffers: 8, ..Config::default() };
    let comms = group_with(&ctx, world, Some(Algorithm::TwoShotPull), config);
    for window in 0..2 {
        let mut bufs = rank_buffers(&comms, n);
        let graphs = capture(&comms, &mut bufs);
        let registered = Comm::register_graph_buffers_group(&comms).unwrap();
        // 7 entries besides the staging buffer, all taken in the first window.
        assert_eq!(registered, if window == 0 { 7 } else { 0 }, "window {window}");
        for rep in 0..5 {
            for b in bufs.iter_mut() {
                let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
                b.x[0].copy_from_host(&x).unwrap();
            }
            for g in &graphs {
                g.launch().unwrap();
            }
            for c in &comms {
                c.synchronize().unwrap_or_else(|e| panic!("window {window} replay {rep}: {e}"));
            }
            for l in 0..LAYERS {
                let xs: Vec<Vec<f32>> = bufs.iter().map(|b| b.x[l].to_host().unwrap()).collect();
                for (r, b) in bufs.iter().enumerate() {
                    let out = b.y[l].to_host().unwrap();
                    common::check_sum(&xs, &out, Algorithm::TwoShotPull.max_roundings(world))
                        .unwrap_or_else(|e| panic!("window {window} replay {rep} layer {l} rank {r}: {e}"));
                }
            }
        }
        drop(graphs);
    }
    let notes = comms[0].registration_notes();
    assert!(notes.iter().any(|n| n.contains("registration table is full")), "{notes:?}");
}
