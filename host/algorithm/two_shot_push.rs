//! TwoShotPush: reduce-scatter by posted writes (slice `j` of every rank's
//! input goes to rank `j`), then all-gather by posted writes; peers in a
//! staggered order. Two flag phases.
//! Kernel: `kernels-rs/src/device/two_shot_push.rs`; scratch:
//! `ScratchLayout::two_shot_push_*`.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::partition::{div_ceil, push_grid};

use super::{AlgorithmHost, CostRecipe, CostShape, FlowSet, Geometry, PhaseSpec};

pub(crate) struct TwoShotPush;

impl AlgorithmHost for TwoShotPush {
    fn kernel(&self) -> AlgorithmId {
        AlgorithmId::TwoShotPush
    }

    fn supports_host_staged(&self) -> bool {
        true
    }

    fn grid(&self, g: &Geometry, packs: u64) -> u32 {
        let slice = div_ceil(packs, g.world as u64);
        push_grid(slice, Geometry::THREADS, g.layout.two_shot_push_stripe_packs, g.layout.push_blocks)
    }

    fn cost(&self, shape: &CostShape) -> CostRecipe {
        let slice = 1.0 / shape.world as f64;
        CostRecipe {
            phases: vec![
                PhaseSpec::staggered_writes(FlowSet::AllPairs, slice),
                PhaseSpec::staggered_writes(FlowSet::AllPairs, slice),
            ],
            local_passes: 3.0,
        }
    }
}
