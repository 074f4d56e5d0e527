//! Bounded waits: a rank that never joins a collective makes the others fail
//! with `Error::Timeout` naming it, within the bound, without hanging; the
//! communicator is unusable afterwards and later calls fail fast.

use std::time::{Duration, Instant};

use tp_allreduce::{Algorithm, Comm, Config, DType, Error};

use crate::common;

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
        let mut named_missing = 0;
        for (r, c) in comms.iter().enumerate().take(missing) {
            let e = c.synchronize().expect_err("must time out");
            let elapsed = started.elapsed();
            eprintln!("{algorithm} rank {r} after {:.0} ms: {e}", elapsed.as_secs_f64() * 1e3);
            assert!(elapsed < timeout * 4 + Duration::from_secs(1), "{algorithm}: took {elapsed:?}");
            match &e {
                Error::Timeout(f) | Error::PeerAborted(f) => {
                    if f.peer == Some(missing as u32) {
                        named_missing += 1;
                    }
                }
                other => panic!("{algorithm} rank {r}: expected a timeout, got {other}"),
            }
            // Broken from now on, without touching the device.
            let again = c.check();
            assert!(matches!(again, Err(Error::Broken(_))), "{again:?}");
            // SAFETY: rejected before any device access.
            let call = unsafe { c.all_reduce_raw(0x1000, 0x1000, 1, DType::F32, c.stream().cu_stream()) };
            assert!(matches!(call, Err(Error::Broken(_))), "{call:?}");
        }
        assert!(named_missing >= 1, "{algorithm}: no rank named the missing rank {missing}");
        // The missing rank's stream is idle; dropping the group must not hang.
        drop(outs);
        drop(bufs);
        drop(comms);
    }
}
