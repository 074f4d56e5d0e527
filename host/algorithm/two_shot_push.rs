//! TwoShotPush: reduce-scatter by posted writes (share `j` of every rank's
//! input goes to rank `j`), then all-gather by posted writes; peers in a
//! staggered order. Payload completion (a sentinel kernel: no flag, no
//! barrier; parameters by value; any launch shape): the island push with
//! one island of every rank.
//! Kernel: `kernels-rs/src/device/two_shot_push.rs` (body in
//! `island_push.rs`); receive region: `ScratchLayout::two_shot_push_*`.
//! What it shares with Hierarchical (template, launches, fused variant):
//! `island_push.rs`.

#![forbid(unsafe_code)]

use std::mem::{align_of, size_of};

use tp_allreduce_kernels::ids::{AlgorithmId, DType};
use tp_allreduce_kernels::params::IslandPushParams;

use super::island_push::{self, fused_entry, island_push_rounds, share_shape, IslandKind};
use super::launch::{RankAlgorithm, RankSetup};
use super::{AlgorithmHost, CostRecipe, CostShape, FlowSet, Geometry, IslandSplit, PhaseSpec};
use crate::error::Result;

pub(crate) struct TwoShotPush;

impl AlgorithmHost for TwoShotPush {
    fn kernel(&self) -> AlgorithmId {
        AlgorithmId::TwoShotPush
    }

    fn supports_host_staged(&self) -> bool {
        true
    }


    fn launch_capacity_packs(&self, g: &Geometry) -> u64 {
        g.layout.two_shot_push_share_packs * g.world as u64
    }

    fn launch_shape(&self, g: &Geometry, packs: u64) -> (u32, u32) {
        share_shape(packs, g.world as u64, &g.sentinel_resident)
    }

    fn fused_entries(&self, _sm: Option<u32>) -> Vec<String> {
        DType::ALL.into_iter().map(|d| fused_entry(self.kernel(), d)).collect()
    }

    fn param_struct(&self, name: &str) -> Option<(usize, usize)> {
        name.starts_with(self.kernel().kernel_prefix())
            .then_some((size_of::<IslandPushParams>(), align_of::<IslandPushParams>()))
    }

    fn prepare(&self, rank: &RankSetup<'_>) -> Result<Option<Box<dyn RankAlgorithm>>> {
        island_push::prepare(IslandKind::TwoShotPush, rank)
    }

    fn single_gpu_traffic_per_rank(&self, _n: f64, s: f64) -> f64 {
        // scatter r/w S; reduce read S, write S; gather read/write (N-1)/N S
        6.0 * s
    }

    fn cost(&self, shape: &CostShape) -> CostRecipe {
        let n = shape.world as f64;
        let share = 1.0 / n;
        let rounds = island_push_rounds(&IslandSplit::whole(shape.world));
        CostRecipe {
            overlapped: false,
            phases: vec![
                PhaseSpec::staggered_writes(FlowSet::AllPairs, share).with_access_rounds(rounds.scatter),
                PhaseSpec::staggered_writes(FlowSet::AllPairs, share).with_access_rounds(rounds.gather),
            ],
            // Input once; per received share a read and a reset, twice
            // (reduce-scatter, all-gather); the output.
            local_passes: 2.0 + 4.0 * (n - 1.0) / n,
        }
    }
}
