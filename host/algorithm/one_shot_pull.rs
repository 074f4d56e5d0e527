//! OneShotPull: every rank reads the whole message from every peer and
//! reduces locally (the vLLM one-stage kernel). Start and end barriers.
//! Kernel: `kernels-rs/src/device/one_shot_pull.rs`.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::partition::div_ceil;

use super::{AlgorithmHost, CostRecipe, CostShape, Geometry, PhaseSpec};

pub(crate) struct OneShotPull;

impl AlgorithmHost for OneShotPull {
    fn kernel(&self) -> AlgorithmId {
        AlgorithmId::OneShotPull
    }

    fn reads_peer_inputs(&self) -> bool {
        true
    }

    fn supports_host_staged(&self) -> bool {
        false
    }

    fn grid(&self, g: &Geometry, packs: u64) -> u32 {
        div_ceil(packs, Geometry::THREADS).clamp(1, g.pull_max_blocks as u64) as u32
    }

    fn single_gpu_traffic_per_rank(&self, n: f64, s: f64) -> f64 {
        // read every rank's input, write the output
        (n + 1.0) * s
    }

    fn cost(&self, _shape: &CostShape) -> CostRecipe {
        // Start barrier, the reads (request + completion), end barrier;
        // local: read the peers' data, write the output.
        CostRecipe { phases: vec![PhaseSpec::barrier_reads(1.0, 2.0, 1.0)], local_passes: 2.0 }
    }
}
