//! Uneven placement in one process (issue 13 item 7): three ranks on two
//! GPUs, ranks 0 and 1 on GPU 0 and rank 2 alone on GPU 1. Before, init
//! failed with "ranks built different selection tables": whether to create
//! the NCCL fallback (a collective) was decided from the rank's own GPU, so
//! the lone rank entered NCCL's rendezvous rounds while the others compared
//! table digests. Now every group-wide decision comes from the gathered
//! placement; every algorithm must run and give the f64 reference's sums,
//! over the P2P transport and host-staged.

use std::time::Duration;

use tp_allreduce::{Algorithm, Comm, Config, DType, Transport, TransportPreference};

use crate::common::{self, Case};

fn run_typed(comms: &[Comm], rng: &mut rand::rngs::StdRng, dtype: DType, case: Case) -> Result<(), String> {
    match dtype {
        DType::F32 => common::run_case::<f32>(comms, rng, case),
        DType::F16 => common::run_case::<half::f16>(comms, rng, case),
        DType::Bf16 => common::run_case::<half::bf16>(comms, rng, case),
    }
}

/// The algorithms that must run on 3 ranks over `transport` (Hierarchical
/// needs islands, which 3 ranks on 2 GPUs do not form).
fn expected(transport: Transport) -> Vec<Algorithm> {
    let mut all = vec![Algorithm::OneShotPush, Algorithm::TwoShotPush, Algorithm::Ring];
    if transport == Transport::PeerToPeer {
        all.extend([Algorithm::OneShotPull, Algorithm::TwoShotPull]);
    }
    all
}

#[test]
fn three_ranks_on_two_gpus_run_every_algorithm() {
    let test = "three_ranks_on_two_gpus_run_every_algorithm";
    let _lock = common::gpu_lock();
    let Some(ctx0) = common::gpu(test) else { return };
    let Some(ctx1) = crate::common::second_gpu(test) else { return };
    let mut rng = common::rng(test);
    let mut failures = Vec::new();
    let mut cases = 0usize;
    for preference in [TransportPreference::Auto, TransportPreference::Force(Transport::HostStaged)] {
        let streams = vec![ctx0.new_stream().unwrap(), ctx0.new_stream().unwrap(), ctx1.new_stream().unwrap()];
        let config = Config {
            timeout: Duration::from_secs(3),
            launch_timeout: Duration::from_secs(3),
            transport: preference,
            ..Config::default()
        };
        let mut comms = Comm::from_streams(streams, config)
            .unwrap_or_else(|e| panic!("{test}: init of 3 ranks on GPUs 0, 0, 1 ({preference:?}): {e}"));
        let transport = comms[0].transport();
        eprintln!("{test}: {preference:?}: transport {transport} ({})", comms[0].transport_reason());
        let per_gpu: Vec<usize> = comms.iter().map(Comm::ranks_on_device).collect();
        assert_eq!(per_gpu, [2, 2, 1], "ranks per GPU as each rank sees it");
        assert!(comms.iter().all(|c| !c.has_nccl()), "NCCL cannot run with two ranks on one GPU");
        let digests: Vec<String> = comms.iter().map(|c| c.selection().digest()).collect();
        assert!(digests.iter().all(|d| d == &digests[0]), "selection tables differ: {digests:?}");
        let mut ran = Vec::new();
        for algorithm in Algorithm::allreduce_algorithms() {
            if let Err(why) = comms.iter_mut().try_for_each(|c| c.set_algorithm(Some(algorithm))) {
                eprintln!("{test}: {transport}: {algorithm} not available: {why}");
                continue;
            }
            ran.push(algorithm);
            for dtype in [DType::F32, DType::Bf16] {
                for count in common::sizes_for(dtype, 4 << 20) {
                    for (offset, in_place) in [(0, false), (1, false), (0, true)] {
                        cases += 1;
                        let case = Case { algorithm, count, offset, in_place };
                        if let Err(e) = run_typed(&comms, &mut rng, dtype, case) {
                            failures.push(format!("{transport} {algorithm} {} {case:?}: {e}", dtype.name()));
                        }
                    }
                }
            }
        }
        for algorithm in expected(transport) {
            assert!(ran.contains(&algorithm), "{algorithm} did not run over {transport}: ran {ran:?}");
        }
        eprintln!("{test}: {transport}: ran {ran:?}");
    }
    eprintln!("{test}: {cases} cases, {} failures", failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
