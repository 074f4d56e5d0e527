//! TwoShotPull: reduce-scatter by reads (each rank reduces its slice from
//! every peer), then all-gather by reads (vLLM two-stage). Three barriers.
//! Kernel: `kernels-rs/src/device/two_shot_pull.rs`.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::partition::div_ceil;

use super::launch::{Call, Issue, RankAlgorithm, RankSetup};
use super::pull::PullRank;
use super::{AlgorithmHost, CostRecipe, CostShape, Geometry, PhaseSpec};
use crate::error::Result;

pub(crate) struct TwoShotPull;

impl AlgorithmHost for TwoShotPull {
    fn kernel(&self) -> AlgorithmId {
        AlgorithmId::TwoShotPull
    }

    fn reads_peer_inputs(&self) -> bool {
        true
    }

    fn supports_host_staged(&self) -> bool {
        false
    }

    fn launch_shape(&self, g: &Geometry, packs: u64) -> (u32, u32) {
        let blocks = div_ceil(div_ceil(packs, g.world as u64), Geometry::THREADS).clamp(1, g.pull_max_blocks as u64);
        (blocks as u32, Geometry::THREADS as u32)
    }

    fn prepare(&self, rank: &RankSetup<'_>) -> Result<Option<Box<dyn RankAlgorithm>>> {
        Ok(Some(Box::new(TwoShotPullRank(PullRank::new(&TwoShotPull, rank)?))))
    }

    fn single_gpu_traffic_per_rank(&self, n: f64, s: f64) -> f64 {
        // scatter: read S, write S/N; gather: read S, write S
        3.0 * s + s / n
    }

    fn cost(&self, shape: &CostShape) -> CostRecipe {
        let slice = 1.0 / shape.world as f64;
        // Start barrier + reads; mid barrier + reads + end barrier.
        CostRecipe {
            overlapped: false,
            phases: vec![PhaseSpec::barrier_reads(slice, 1.0, 1.0), PhaseSpec::barrier_reads(slice, 2.0, 1.0)],
            local_passes: 3.0,
        }
    }
}

/// TwoShotPull's side of one rank: the pull launches, nothing more.
struct TwoShotPullRank(PullRank);

impl RankAlgorithm for TwoShotPullRank {
    fn run(&self, call: &Call, issue: &mut Issue<'_>) -> Result<()> {
        self.0.run(call, issue)
    }
}
