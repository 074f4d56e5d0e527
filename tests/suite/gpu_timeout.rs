//! Bounded waits: a rank that never joins a collective makes the others fail
//! with `Error::Timeout` naming it, within the bound, without hanging; the
//! communicator is unusable afterwards and later calls fail fast.

use std::time::{Duration, Instant};

use tp_allreduce::{Algorithm, Comm, Config, DType, Error};

use crate::common;

/// Every rank of `waiting` (all but rank `missing` issued a call at
/// `started`) fails within the bound with a timeout or a peer's abort, at
/// least one naming `missing`, and is broken afterwards: later calls fail
/// without touching the device.
fn expect_named_timeouts(waiting: &[Comm], missing: usize, started: Instant, timeout: Duration, what: &str) {
    let mut named_missing = 0;
    for (r, c) in waiting.iter().enumerate() {
        let e = c.synchronize().expect_err("must time out");
        let elapsed = started.elapsed();
        eprintln!("{what}: rank {r} after {:.0} ms: {e}", elapsed.as_secs_f64() * 1e3);
        assert!(elapsed < timeout * 4 + Duration::from_secs(1), "{what}: took {elapsed:?}");
        match &e {
            Error::Timeout(f) | Error::PeerAborted(f) => named_missing += (f.peer == Some(missing as u32)) as usize,
            other => panic!("{what} rank {r}: expected a timeout, got {other}"),
        }
        let again = c.check();
        assert!(matches!(again, Err(Error::Broken(_))), "{again:?}");
        // SAFETY: rejected before any device access.
        let call = unsafe { c.all_reduce_raw(0x1000, 0x1000, 1, DType::F32, c.stream().cu_stream()) };
        assert!(matches!(call, Err(Error::Broken(_))), "{call:?}");
    }
    assert!(named_missing >= 1, "{what}: no rank named the missing rank {missing}");
}

#[test]
fn missing_rank_times_out_with_its_name() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("missing_rank_times_out_with_its_name") else { return };
    let world = 4;
    let missing = world - 1;
    let timeout = Duration::from_millis(400);
    for algorithm in [
        Algorithm::OneShotPull,
        Algorithm::TwoShotPull,
        Algorithm::OneShotPush,
        Algorithm::TwoShotPush,
        Algorithm::Ring,
        Algorithm::Hierarchical,
        Algorithm::PipelinedHierarchical,
    ] {
        // (The copy-engine ring's waits time out in gpu_pcie_family, over
        // two GPUs: it needs one rank per GPU.)
        let config = Config { timeout, launch_timeout: timeout, island_size: Some(2), ..Config::default() };
        let mut comms = Comm::from_streams(common::streams(&ctx, world), config).unwrap();
        for c in comms.iter_mut() {
            c.set_algorithm(Some(algorithm)).unwrap();
        }
        let n = 50_000usize;
        let bufs: Vec<_> = comms.iter().map(|c| c.stream().alloc_zeros::<f32>(n).unwrap()).collect();
        let mut outs: Vec<_> = comms.iter().map(|c| c.stream().alloc_zeros::<f32>(n).unwrap()).collect();
        let started = Instant::now();
        // Every rank but the last issues the collective.
        for r in 0..missing {
            comms[r].all_reduce(&bufs[r], &mut outs[r], &tp_allreduce::ReduceOp::Sum).unwrap();
        }
        expect_named_timeouts(&comms[..missing], missing, started, timeout, &algorithm.to_string());
        // The missing rank's stream is idle; dropping the group must not hang.
        drop(outs);
        drop(bufs);
        drop(comms);
    }
}

/// The fused push (allreduce + residual add + RMSNorm) with a rank that
/// never calls: every other rank's wait gives up within the bound and names
/// it, with rows spread over thread-block clusters (the cluster leaves
/// together at the row's reduction) and with a block per row.
#[test]
fn missing_rank_times_out_in_fused_calls() {
    let test = "missing_rank_times_out_in_fused_calls";
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu(test) else { return };
    let (major, _) = ctx.compute_capability().unwrap();
    let (world, rows, hidden) = (4, 3, 7168);
    let missing = world - 1;
    let timeout = Duration::from_millis(400);
    for clusters in [true, false] {
        let config = Config { timeout, launch_timeout: timeout, fused_clusters: clusters, ..Config::default() };
        let mut comms = Comm::from_streams(common::streams(&ctx, world), config).unwrap();
        for c in comms.iter_mut() {
            c.set_algorithm(Some(Algorithm::OneShotPush)).unwrap();
        }
        let plan = comms[0].plan_fused(rows, hidden, DType::Bf16, false);
        let clustered = plan.reason.contains("thread-block cluster");
        assert!(plan.fused, "{}", plan.reason);
        assert_eq!(clustered, clusters && major >= 9, "{}", plan.reason);
        let n = rows * hidden;
        let zeros = |c: &Comm| c.stream().alloc_zeros::<half::bf16>(n).unwrap();
        let inputs: Vec<_> = comms.iter().map(zeros).collect();
        let mut residuals: Vec<_> = comms.iter().map(zeros).collect();
        let mut normed: Vec<_> = comms.iter().map(zeros).collect();
        let weight: Vec<_> = comms.iter().map(|c| c.stream().alloc_zeros::<half::bf16>(hidden).unwrap()).collect();
        let started = Instant::now();
        for r in 0..missing {
            let opts = tp_allreduce::FusedOptions::default();
            comms[r]
                .all_reduce_add_rms_norm(&inputs[r], &mut residuals[r], &weight[r], 1e-6, &mut normed[r], &opts)
                .unwrap();
        }
        expect_named_timeouts(&comms[..missing], missing, started, timeout, &format!("fused, clusters {clustered}"));
        drop((inputs, residuals, normed, weight));
        drop(comms);
    }
}
