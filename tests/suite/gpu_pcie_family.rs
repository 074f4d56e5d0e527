//! The barrier-free PCIe family on the GPU: Hierarchical with
//! islands of any shape (unequal, interleaved, a lone rank), 2+2 islands
//! over two GPUs, the per-pair transport (P2P inside islands, host-staged
//! across, forced by a test hook), the copy-engine ring with the kernel
//! publication, 1000-replay graphs, and a timeout naming every new wait.
//! Fresh random inputs, poisoned outputs, f64 reference, ranks bitwise
//! equal (`common::run_case`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use tp_allreduce::test_hooks::{KernelPublication, NoCopyEngineHandshake, NoP2pAcrossIslands};
use tp_allreduce::{Algorithm, Comm, Config, DType, Error, Transport};
use tp_allreduce_kernels::ids::Phase;

use crate::common::{self, Case};

fn config() -> Config {
    Config {
        timeout: Duration::from_secs(3),
        launch_timeout: Duration::from_secs(3),
        nccl_fallback: false,
        ..Config::default()
    }
}

fn run_typed(comms: &[Comm], rng: &mut rand::rngs::StdRng, dtype: DType, case: Case) -> Result<(), String> {
    match dtype {
        DType::F32 => common::run_case::<f32>(comms, rng, case),
        DType::F16 => common::run_case::<half::f16>(comms, rng, case),
        DType::Bf16 => common::run_case::<half::bf16>(comms, rng, case),
    }
}

/// Every dtype, sizes 1 element..`max_bytes`, misaligned and in place for
/// the small ones; returns the failures.
fn matrix(
    comms: &[Comm],
    rng: &mut rand::rngs::StdRng,
    algorithm: Algorithm,
    max_bytes: usize,
    what: &str,
) -> Vec<String> {
    let mut failures = Vec::new();
    let mut cases = 0;
    for dtype in DType::ALL {
        for count in common::sizes_for(dtype, max_bytes) {
            let small = count * dtype.size_bytes() <= 70_000;
            let mut variants = vec![(0, false)];
            if small {
                variants.extend([(1, false), (0, true)]);
            }
            for (offset, in_place) in variants {
                cases += 1;
                let case = Case { algorithm, count, offset, in_place };
                if let Err(e) = run_typed(comms, rng, dtype, case) {
                    failures.push(format!("{what} {algorithm} {} {case:?}: {e}", dtype.name()));
                }
            }
        }
    }
    eprintln!("{what} {algorithm}: {cases} cases, {} failures", failures.len());
    failures
}

fn forced(ctxs: &[Arc<CudaContext>], config: Config, algorithm: Algorithm) -> Vec<Comm> {
    let streams = ctxs.iter().map(|c| c.new_stream().expect("stream")).collect();
    let mut comms = Comm::from_streams(streams, config).expect("group init");
    for c in comms.iter_mut() {
        c.set_algorithm(Some(algorithm)).expect("available");
    }
    comms
}

/// Rank r on GPU `gpus[r]` (GPU 1 falls back to GPU 0 on a one-GPU machine).
fn contexts(first: &Arc<CudaContext>, gpus: &[usize]) -> Vec<Arc<CudaContext>> {
    let second = if tp_allreduce::driver::device_count() >= 2 {
        let c = CudaContext::new(1).expect("CudaContext::new(1)");
        // SAFETY: as for device 0 (common::gpu): explicit stream ordering.
        unsafe { c.disable_event_tracking() };
        c
    } else {
        first.clone()
    };
    gpus.iter().map(|&g| if g == 0 { first.clone() } else { second.clone() }).collect()
}

#[test]
fn hierarchical_islands_of_any_shape() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("hierarchical_islands_of_any_shape") else { return };
    let mut rng = common::rng("hierarchical_islands_of_any_shape");
    let shapes: &[&[&[usize]]] = &[
        &[&[0, 1], &[2]],
        &[&[0, 1, 2], &[3, 4]],
        &[&[0, 1, 2, 3], &[4, 5]],
        &[&[0, 2, 4], &[1, 3, 5]],
        &[&[0, 1, 2, 3], &[4, 5, 6]],
        &[&[0, 1, 2], &[3, 4, 5], &[6, 7]],
        &[&[0, 1], &[2, 3], &[4, 5], &[6, 7]],
    ];
    let mut failures = Vec::new();
    for groups in shapes {
        let islands: Vec<Vec<usize>> = groups.iter().map(|g| g.to_vec()).collect();
        let world = islands.iter().map(Vec::len).sum();
        let ctxs = vec![ctx.clone(); world];
        let comms = forced(&ctxs, Config { islands: Some(islands.clone()), ..config() }, Algorithm::Hierarchical);
        let max = if world <= 5 { 8 << 20 } else { 1 << 20 };
        failures.extend(matrix(&comms, &mut rng, Algorithm::Hierarchical, max, &format!("{islands:?}")));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// 2+2 islands, ranks 0 and 1 on GPU 0, ranks 2 and 3 on GPU 1 (both on
/// GPU 0 when only one is visible); islands from the topology where it
/// has a boundary between the GPUs, else `island_size` 2.
#[test]
fn hierarchical_two_plus_two_over_two_gpus() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("hierarchical_two_plus_two_over_two_gpus") else { return };
    let mut rng = common::rng("hierarchical_two_plus_two_over_two_gpus");
    let ctxs = contexts(&ctx, &[0, 0, 1, 1]);
    let streams = ctxs.iter().map(|c| c.new_stream().expect("stream")).collect();
    let mut comms = Comm::from_streams(streams, config()).expect("init");
    let from_topology = comms.iter_mut().all(|c| c.set_algorithm(Some(Algorithm::Hierarchical)).is_ok());
    eprintln!("2+2 over GPUs {:?}: islands from the topology: {from_topology} ({:?})", [0, 0, 1, 1], comms[0].notes());
    if !from_topology {
        drop(comms);
        comms = forced(&ctxs, Config { island_size: Some(2), ..config() }, Algorithm::Hierarchical);
    }
    let failures = matrix(&comms, &mut rng, Algorithm::Hierarchical, 8 << 20, "2+2 over two GPUs");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// No P2P across islands (a test hook) makes an `Auto`
/// communicator settle on the per-pair transport: Hierarchical runs with
/// its cross slots in host memory, nothing else of ours is offered.
#[test]
fn per_pair_transport_runs_hierarchical_with_host_staged_cross_slots() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("per_pair_transport_runs_hierarchical_with_host_staged_cross_slots") else { return };
    let mut rng = common::rng("per_pair_transport_runs_hierarchical_with_host_staged_cross_slots");
    let _hook = NoP2pAcrossIslands::new();
    let mut failures = Vec::new();
    for (gpus, islands) in
        [(vec![0, 0, 1, 1], vec![vec![0, 1], vec![2, 3]]), (vec![0; 5], vec![vec![0, 1, 2], vec![3, 4]])]
    {
        let ctxs = contexts(&ctx, &gpus);
        let streams = ctxs.iter().map(|c| c.new_stream().expect("stream")).collect();
        let mut comms =
            Comm::from_streams(streams, Config { islands: Some(islands.clone()), ..config() }).expect("init");
        assert_eq!(comms[0].transport(), Transport::PerPair, "{}", comms[0].transport_reason());
        let hierarchical = [Algorithm::Hierarchical, Algorithm::PipelinedHierarchical];
        for a in Algorithm::allreduce_algorithms().filter(|a| !hierarchical.contains(a)) {
            assert!(comms[0].set_algorithm(Some(a)).is_err(), "{a} must not run over the per-pair transport");
        }
        for a in hierarchical {
            for c in comms.iter_mut() {
                c.set_algorithm(Some(a)).unwrap_or_else(|e| panic!("{a} runs per pair: {e}"));
            }
            failures.extend(matrix(&comms, &mut rng, a, 1 << 20, &format!("{a} per-pair {islands:?}")));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn per_pair_transport_graph_replays() {
    let _lock = common::gpu_lock();
    let _hook = NoP2pAcrossIslands::new();
    let config = Config { island_size: Some(2), ..config() };
    crate::gpu_graph::graph_run_locked(
        "per_pair_transport_graph_replays",
        config,
        4,
        Some(Algorithm::Hierarchical),
        1000,
        4_099,
    );
}

/// The island pushes on one GPU: 8 ranks, 1000 replays of one captured
/// call each (fresh inputs between replays, every result checked).
#[test]
fn island_push_graphs_replay_1000_times() {
    let _lock = common::gpu_lock();
    let test = "island_push_graphs_replay_1000_times";
    crate::gpu_graph::graph_run_locked(test, config(), 8, Some(Algorithm::TwoShotPush), 1000, 10_755);
    let islands = Config { island_size: Some(4), ..config() };
    crate::gpu_graph::graph_run_locked(test, islands.clone(), 8, Some(Algorithm::Hierarchical), 1000, 10_755);
    crate::gpu_graph::graph_run_locked(test, islands, 8, Some(Algorithm::PipelinedHierarchical), 1000, 300_007);
}

/// The copy-engine ring needs one rank per GPU: two GPUs.
#[test]
fn copy_engine_ring_graphs_replay_1000_times() {
    let _lock = common::gpu_lock();
    let test = "copy_engine_ring_graphs_replay_1000_times";
    let Some(ctx) = common::gpu(test) else { return };
    let Some(second) = crate::common::second_gpu(test) else { return };
    crate::gpu_graph::graph_run_with_contexts(test, config(), &[ctx, second], Algorithm::CopyEngineRing, 1000, 300_007);
}

/// The copy-engine ring where flags are raised by the one-thread publish
/// kernel (devices without stream memory operations), eager and captured.
#[test]
fn copy_engine_ring_with_kernel_publication() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("copy_engine_ring_with_kernel_publication") else { return };
    let mut rng = common::rng("copy_engine_ring_with_kernel_publication");
    let _hook = KernelPublication::new();
    let mut failures = Vec::new();
    // One rank per GPU (the ring's rule).
    let Some(second) = crate::common::second_gpu("copy_engine_ring_with_kernel_publication") else { return };
    let gpus = vec![ctx.clone(), second];
    let comms = forced(&gpus, config(), Algorithm::CopyEngineRing);
    failures.extend(matrix(&comms, &mut rng, Algorithm::CopyEngineRing, 4 << 20, "kernel publication"));
    drop(comms);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    crate::gpu_graph::graph_run_with_contexts(
        "copy_engine_ring_with_kernel_publication",
        config(),
        &gpus,
        Algorithm::CopyEngineRing,
        200,
        300_007,
    );
}

/// What one rank's failed call says: its phase and the peer it names.
fn failure_of(c: &Comm) -> (Option<Phase>, Option<u32>) {
    match c.synchronize() {
        Err(Error::Timeout(f)) | Err(Error::PeerAborted(f)) => (f.phase, f.peer),
        other => panic!("rank {}: expected a timeout, got {other:?}", c.rank()),
    }
}

/// Calls `counts[r]` f32 elements on rank r (`None`: rank r does not call),
/// `calls` times, then returns what each calling rank's error says.
fn stall(comms: &[Comm], counts: &[Option<usize>], calls: usize) -> Vec<(Option<Phase>, Option<u32>)> {
    let bufs: Vec<_> = comms.iter().map(|c| c.stream().alloc_zeros::<f32>(1 << 20).unwrap()).collect();
    let outs: Vec<_> = comms.iter().map(|c| c.stream().alloc_zeros::<f32>(1 << 20).unwrap()).collect();
    for _ in 0..calls {
        for (r, c) in comms.iter().enumerate() {
            if let Some(n) = counts[r] {
                let s = c.stream();
                let (src, dst) = (common::ptr_of(&s, &bufs[r], 0), common::ptr_of(&s, &outs[r], 0));
                // SAFETY: live buffers of 2^20 elements on the rank's stream.
                unsafe { c.all_reduce_raw(src, dst, n, DType::F32, s.cu_stream()) }.expect("queued");
            }
        }
    }
    let started = Instant::now();
    let seen = comms.iter().enumerate().filter(|(r, _)| counts[*r].is_some()).map(|(_, c)| failure_of(c)).collect();
    assert!(started.elapsed() < Duration::from_secs(10), "the waits are bounded");
    drop((bufs, outs));
    seen
}

/// Every wait the PCIe family added times out with its phase and the peer
/// it waited on: reduce-scatter (a missing rank), all-gather (a peer that
/// stalls after its reduce-scatter: mismatched counts), cross-island (a
/// missing rank of the other island), copy-engine data (a missing rank)
/// and handshake (a rank that never frees its staging: a test hook).
#[test]
fn new_waits_time_out_naming_their_phase() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("new_waits_time_out_naming_their_phase") else { return };
    let quick = Config { timeout: Duration::from_millis(400), launch_timeout: Duration::from_millis(400), ..config() };
    let two = || vec![ctx.clone(); 2];
    // Reduce-scatter: rank 1 never calls.
    let comms = forced(&two(), quick.clone(), Algorithm::TwoShotPush);
    assert_eq!(stall(&comms, &[Some(50_000), None], 1)[0], (Some(Phase::RsPayload), Some(1)));
    drop(comms);
    // Mismatched counts: rank 0 expects twice the packs of rank 1, so half
    // of its owned positions never get rank 1's reduce-scatter payload and
    // half of the other share's all-gather never comes. (Rank 1 expecting
    // more, as first written, lets rank 0 finish: every thread progresses on
    // its own positions, and rank 0's are all covered — measured on 2 H200s.)
    // Which of the two waits gives up first is a race; both name rank 1.
    // (Rank 1 finishes: everything it needs arrives. Only rank 0 is checked.)
    let comms = forced(&two(), quick.clone(), Algorithm::TwoShotPush);
    let bufs: Vec<_> = comms.iter().map(|c| c.stream().alloc_zeros::<f32>(80_000).unwrap()).collect();
    let outs: Vec<_> = comms.iter().map(|c| c.stream().alloc_zeros::<f32>(80_000).unwrap()).collect();
    for (r, (c, n)) in comms.iter().zip([80_000, 40_000]).enumerate() {
        let s = c.stream();
        let (src, dst) = (common::ptr_of(&s, &bufs[r], 0), common::ptr_of(&s, &outs[r], 0));
        // SAFETY: live buffers of 80,000 elements on the rank's stream.
        unsafe { c.all_reduce_raw(src, dst, n, DType::F32, s.cu_stream()) }.expect("queued");
    }
    let seen = failure_of(&comms[0]);
    let _ = comms[1].synchronize();
    assert!(matches!(seen, (Some(Phase::RsPayload | Phase::AgPayload), Some(1))), "{seen:?}");
    drop((bufs, outs));
    drop(comms);
    // Cross-island: 2+2, rank 3 never calls; rank 1 owns share 1, whose
    // owner in the other island is rank 3.
    let islands = Config { island_size: Some(2), ..quick.clone() };
    let comms = forced(&vec![ctx.clone(); 4], islands, Algorithm::Hierarchical);
    let seen = stall(&comms, &[Some(50_000), Some(50_000), Some(50_000), None], 1);
    assert_eq!(seen[1], (Some(Phase::CrossPayload), Some(3)), "{seen:?}");
    drop(comms);
    // Copy-engine data: rank 1 never calls.
    // The copy-engine ring needs one rank per GPU.
    let Some(second) = crate::common::second_gpu("new_waits_time_out_naming_their_phase") else { return };
    let two_gpus = || vec![ctx.clone(), second.clone()];
    let comms = forced(&two_gpus(), quick.clone(), Algorithm::CopyEngineRing);
    assert_eq!(stall(&comms, &[Some(300_000), None], 1)[0], (Some(Phase::CeData), Some(1)));
    drop(comms);
    // Copy-engine handshake: rank 1 never tells rank 0 its staging is free
    // again, so rank 0's second call waits before its first copy.
    let hook = NoCopyEngineHandshake::on_rank(1);
    let comms = forced(&two_gpus(), quick, Algorithm::CopyEngineRing);
    drop(hook);
    let seen = stall(&comms, &[Some(300_000), Some(300_000)], 2);
    assert_eq!(seen[0], (Some(Phase::CeHandshake), Some(1)), "{seen:?}");
}
