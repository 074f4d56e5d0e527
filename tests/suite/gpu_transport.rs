//! Choosing and validating the transport at init:
//! * a failing IPC open (injected on one rank) under `Auto` moves every
//!   rank to host staging together; with P2P forced, every rank fails with
//!   an error naming the pair (before: the failing rank aborted alone and
//!   the others waited for the rendezvous timeout);
//! * a P2P check whose patterns and flags do not arrive as sent (one rank
//!   runs it with another salt) does the same;
//! * host staging over two GPUs enables no peer access (pinned host memory
//!   reports the allocating device's ordinal; enabling peer access for it
//!   fails exactly on the GPUs that need host staging);
//! * P2P between non-primary contexts of two GPUs enables access to the
//!   context that owns the memory (before: the peer GPU's primary context).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaSlice};
use rand::rngs::StdRng;
use tp_allreduce::test_hooks::{CorruptP2pCheck, FailRegionImport};
use tp_allreduce::{Algorithm, Comm, Config, Error, ReduceOp, Transport, TransportPreference};

use crate::common;
use crate::common::second_gpu;
use crate::gpu_context::make_current;

const FORCE_P2P: TransportPreference = TransportPreference::Force(Transport::PeerToPeer);

fn config(transport: TransportPreference) -> Config {
    Config {
        transport,
        timeout: Duration::from_secs(2),
        launch_timeout: Duration::from_secs(2),
        rendezvous_timeout: Duration::from_secs(60),
        // Our transports only (NCCL would take the calls between two GPUs).
        nccl_fallback: false,
        ..Config::default()
    }
}

/// One allreduce of fresh random inputs on every rank through the safe API
/// (cudarc binds each rank's context for its own buffers), outputs poisoned,
/// checked against the f64 reference.
fn sum_check(comms: &[Comm], rng: &mut StdRng, n: usize) -> Result<(), String> {
    let inputs: Vec<Vec<f32>> = comms.iter().map(|_| common::random_vec::<f32>(rng, n)).collect();
    let poison = vec![f32::from_bits(u32::from_ne_bytes([common::POISON; 4])); n];
    let sends: Vec<CudaSlice<f32>> =
        comms.iter().zip(&inputs).map(|(c, x)| c.stream().clone_htod(x).unwrap()).collect();
    let mut recvs: Vec<CudaSlice<f32>> = comms.iter().map(|c| c.stream().clone_htod(&poison).unwrap()).collect();
    for (r, c) in comms.iter().enumerate() {
        c.all_reduce(&sends[r], &mut recvs[r], &ReduceOp::Sum).map_err(|e| format!("rank {r}: {e}"))?;
    }
    for (r, c) in comms.iter().enumerate() {
        c.synchronize().map_err(|e| format!("rank {r}: {e}"))?;
        let out = c.stream().clone_dtoh(&recvs[r]).unwrap();
        common::check_sum(&inputs, &out, 2).map_err(|e| format!("rank {r}: {e}"))?;
    }
    Ok(())
}

/// Initialises rank r of `streams` on its own thread over an in-process
/// rendezvous; returns every rank's outcome and how long init took.
fn init_each(streams: Vec<Arc<cudarc::driver::CudaStream>>, config: Config) -> (Vec<Result<Comm, Error>>, Duration) {
    let started = Instant::now();
    let rdvs = tp_allreduce::rendezvous::in_process_group(streams.len(), config.rendezvous_timeout);
    let outcomes = std::thread::scope(|scope| {
        let handles: Vec<_> = streams
            .into_iter()
            .zip(rdvs)
            .map(|(stream, rdv)| {
                let config = config.clone();
                scope.spawn(move || Comm::from_rendezvous(stream, rdv, config))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("init thread")).collect()
    });
    (outcomes, started.elapsed())
}

#[test]
fn ipc_open_failure_under_auto_moves_every_rank_to_host_staging() {
    let test = "ipc_open_failure_under_auto_moves_every_rank_to_host_staging";
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu(test) else { return };
    let mut rng = common::rng(test);
    let comms = {
        let _hook = FailRegionImport::on_rank(1);
        Comm::from_streams(common::streams(&ctx, 2), config(TransportPreference::Auto)).expect("init falls back")
    };
    for c in &comms {
        assert_eq!(c.transport(), Transport::HostStaged, "rank {}: {}", c.rank(), c.transport_reason());
        let why = c.transport_reason();
        assert!(why.contains("mapping the peers' regions failed") && why.contains("rank 1 <- rank 0"), "{why}");
    }
    eprintln!("{test}: {}", comms[0].transport_reason());
    sum_check(&comms, &mut rng, 10_001).unwrap();
}

#[test]
fn ipc_open_failure_with_p2p_forced_fails_every_rank_naming_the_pair() {
    let test = "ipc_open_failure_with_p2p_forced_fails_every_rank_naming_the_pair";
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu(test) else { return };
    let (outcomes, took) = {
        let _hook = FailRegionImport::on_rank(1);
        init_each(common::streams(&ctx, 2), config(FORCE_P2P))
    };
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Err(Error::Ipc(msg)) => {
                assert!(msg.contains("rank 1 could not map the region of rank 0"), "rank {rank}: {msg}");
                eprintln!("rank {rank}: {msg}");
            }
            Err(e) => panic!("rank {rank}: expected an IPC error naming the pair, got: {e}"),
            Ok(_) => panic!("rank {rank}: init succeeded although rank 1 could not map rank 0's region"),
        }
    }
    // Every rank learnt it from the all-gathered outcome, not from a timeout.
    assert!(took < Duration::from_secs(30), "init took {took:?} (the rendezvous timeout is 60 s)");
}

#[test]
fn a_failing_p2p_check_moves_every_rank_to_host_staging() {
    let test = "a_failing_p2p_check_moves_every_rank_to_host_staging";
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu(test) else { return };
    let mut rng = common::rng(test);
    let comms = {
        let _hook = CorruptP2pCheck::on_rank(0);
        Comm::from_streams(common::streams(&ctx, 3), config(TransportPreference::Auto)).expect("init falls back")
    };
    for c in &comms {
        assert_eq!(c.transport(), Transport::HostStaged, "rank {}: {}", c.rank(), c.transport_reason());
        let why = c.transport_reason();
        assert!(why.contains("the P2P transfer check failed") && why.contains("never arrived"), "{why}");
    }
    eprintln!("{test}: {}", comms[0].transport_reason());
    sum_check(&comms, &mut rng, 3_001).unwrap();

    // Forced P2P: every rank fails with the check's error.
    let (outcomes, _) = {
        let _hook = CorruptP2pCheck::on_rank(0);
        init_each(common::streams(&ctx, 2), config(FORCE_P2P))
    };
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Err(e @ Error::P2pCheck { .. }) => eprintln!("rank {rank}: {e}"),
            Err(e) => panic!("rank {rank}: expected a P2P check error, got: {e}"),
            Ok(_) => panic!("rank {rank}: init succeeded with a corrupted check"),
        }
    }
}

/// Whether `from` has peer access to `to` enabled (`None`: the driver cannot
/// enable it at all, so the question does not arise). Leaves it as found.
fn peer_access_enabled(from: &CudaContext, to: sys::CUcontext) -> Option<bool> {
    make_current(from.cu_ctx() as usize);
    // SAFETY: both contexts are alive; enabling and disabling peer access
    // between live contexts is always allowed.
    match unsafe { sys::cuCtxEnablePeerAccess(to, 0) } {
        sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Some(true),
        sys::CUresult::CUDA_SUCCESS => {
            // SAFETY: as above; undoes the probe.
            unsafe { sys::cuCtxDisablePeerAccess(to) };
            Some(false)
        }
        _ => None,
    }
}

/// Fresh non-primary contexts on GPUs 0 and 1: no peer access has ever been
/// enabled from or to them.
fn fresh_contexts(test: &str) -> Option<[Arc<CudaContext>; 2]> {
    common::gpu(test)?;
    second_gpu(test)?;
    Some([0, 1].map(|ordinal| {
        let ctx = CudaContext::new_non_primary(ordinal, 0).expect("cuCtxCreate");
        // SAFETY: as in `common::gpu` (work is ordered explicitly per stream).
        unsafe { ctx.disable_event_tracking() };
        ctx
    }))
}

#[test]
fn host_staging_over_two_gpus_enables_no_peer_access() {
    let test = "host_staging_over_two_gpus_enables_no_peer_access";
    let _lock = common::gpu_lock();
    let Some(ctxs) = fresh_contexts(test) else { return };
    let mut rng = common::rng(test);
    let streams = ctxs.iter().map(|c| c.new_stream().unwrap()).collect();
    let host_staged = TransportPreference::Force(Transport::HostStaged);
    let mut comms = Comm::from_streams(streams, config(host_staged)).expect("host-staged init over two GPUs");
    for algorithm in [Algorithm::OneShotPush, Algorithm::TwoShotPush] {
        for c in comms.iter_mut() {
            c.set_algorithm(Some(algorithm)).unwrap();
        }
        sum_check(&comms, &mut rng, 4_097).unwrap_or_else(|e| panic!("{algorithm}: {e}"));
    }
    // Neither the other rank's context nor the other GPU's primary context
    // (where the old code enabled it) may have peer access from a rank.
    let primaries = [0, 1].map(|o| CudaContext::new(o).unwrap());
    let mut enabled = Vec::new();
    for (me, other) in [(0, 1), (1, 0)] {
        for (name, to) in [("its context", ctxs[other].cu_ctx()), ("its primary context", primaries[other].cu_ctx())] {
            match peer_access_enabled(&ctxs[me], to) {
                Some(true) => enabled.push(format!("rank {me} -> rank {other}'s GPU ({name})")),
                Some(false) => {}
                None => eprintln!("{test}: GPUs have no P2P: the probe of {name} cannot tell"),
            }
        }
    }
    assert!(enabled.is_empty(), "host-staged init enabled peer access: {enabled:?}");
    drop(comms);
}

#[test]
fn p2p_between_non_primary_contexts_of_two_gpus() {
    let test = "p2p_between_non_primary_contexts_of_two_gpus";
    let _lock = common::gpu_lock();
    let Some(ctxs) = fresh_contexts(test) else { return };
    if !tp_allreduce::driver::can_access_peer(ctxs[0].cu_device(), ctxs[1].cu_device()).unwrap() {
        common::skipped(&format!("GPUs 0 and 1 have no P2P access ({test})"));
        return;
    }
    let mut rng = common::rng(test);
    let streams = ctxs.iter().map(|c| c.new_stream().unwrap()).collect();
    let mut comms = Comm::from_streams(streams, config(FORCE_P2P)).expect("P2P init over two GPUs");
    for algorithm in [Algorithm::OneShotPull, Algorithm::OneShotPush] {
        for c in comms.iter_mut() {
            c.set_algorithm(Some(algorithm)).unwrap();
        }
        sum_check(&comms, &mut rng, 65_537).unwrap_or_else(|e| panic!("{algorithm}: {e}"));
    }
    // Peer access goes to the context that owns the memory.
    assert_eq!(peer_access_enabled(&ctxs[0], ctxs[1].cu_ctx()), Some(true));
    assert_eq!(peer_access_enabled(&ctxs[1], ctxs[0].cu_ctx()), Some(true));
}
