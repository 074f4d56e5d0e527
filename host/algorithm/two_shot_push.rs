//! TwoShotPush: reduce-scatter by posted writes (share `j` of every rank's
//! input goes to rank `j`), then all-gather by posted writes; peers in a
//! staggered order. Payload completion (a sentinel kernel: no flag, no
//! barrier; parameters by value; any launch shape): the island push with
//! one island of every rank.
//! Kernel: `kernels-rs/src/device/two_shot_push.rs` (body in
//! `island_push.rs`); receive region: `ScratchLayout::two_shot_push_*`.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::partition::div_ceil;

use super::one_shot_push::default_shape;
use super::{AlgorithmHost, CostRecipe, CostShape, FlowSet, Geometry, PhaseSpec, ResidentBlocks};

pub(crate) struct TwoShotPush;

impl AlgorithmHost for TwoShotPush {
    fn kernel(&self) -> AlgorithmId {
        AlgorithmId::TwoShotPush
    }

    fn supports_host_staged(&self) -> bool {
        true
    }

    fn sentinel(&self) -> bool {
        true
    }

    fn launch_capacity_packs(&self, g: &Geometry) -> u64 {
        g.layout.two_shot_push_share_packs * g.world as u64
    }

    fn grid(&self, g: &Geometry, packs: u64) -> u32 {
        self.launch_shape(g, packs).0
    }

    fn launch_shape(&self, g: &Geometry, packs: u64) -> (u32, u32) {
        share_shape(packs, g.world as u64, &g.sentinel_resident)
    }

    fn single_gpu_traffic_per_rank(&self, _n: f64, s: f64) -> f64 {
        // scatter r/w S; reduce read S, write S; gather read/write (N-1)/N S
        6.0 * s
    }

    fn cost(&self, shape: &CostShape) -> CostRecipe {
        let n = shape.world as f64;
        let share = 1.0 / n;
        CostRecipe {
            phases: vec![
                PhaseSpec::staggered_writes(FlowSet::AllPairs, share),
                PhaseSpec::staggered_writes(FlowSet::AllPairs, share),
            ],
            // Input once; per received share a read and a reset, twice
            // (reduce-scatter, all-gather); the output.
            local_passes: 2.0 + 4.0 * (n - 1.0) / n,
        }
    }
}

/// The default launch shape of an island push launch over `packs` packs cut
/// into `shares` shares: threads walk the packs of one share (every phase
/// is a grid-stride loop over a share's packs), so the default rule of
/// OneShotPush applied to a share.
pub(crate) fn share_shape(packs: u64, shares: u64, resident: &ResidentBlocks) -> (u32, u32) {
    default_shape(div_ceil(packs, shares.max(1)), resident)
}
