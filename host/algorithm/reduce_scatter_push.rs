//! ReduceScatterPush: the reduce-scatter by payload completion. Every rank
//! writes share d of its buffer into its slot of rank d's receive region
//! and sums, in rank order with one rounding, the shares that land in its
//! own (one hop, no barrier): the bits a one-shot push allreduce gives for
//! that share. One-shot push's receive region, generation and template, as
//! its sibling `all_gather_push.rs` (whose [`PushCollectiveRank`] it
//! shares). Kernel: `kernels-rs/src/device/reduce_scatter_push.rs`.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::AlgorithmId;

use super::all_gather_push::{gather_scatter_params, one_shot_push_region, push_collective_cost, PushCollectiveRank};
use super::launch::{RankAlgorithm, RankSetup};
use super::one_shot_push::default_shape;
use super::{AlgorithmHost, Capabilities, CostRecipe, CostShape, Geometry};
use crate::error::Result;

pub(crate) struct ReduceScatterPush;

impl AlgorithmHost for ReduceScatterPush {
    fn kernel(&self) -> AlgorithmId {
        AlgorithmId::ReduceScatterPush
    }

    fn supports_host_staged(&self) -> bool {
        true
    }

    fn requirement(&self, caps: &Capabilities, _bytes: Option<usize>) -> Result<(), String> {
        one_shot_push_region(caps)
    }

    fn launch_capacity_packs(&self, g: &Geometry) -> u64 {
        g.layout.one_shot_push_max_packs
    }

    fn launch_shape(&self, g: &Geometry, packs: u64) -> (u32, u32) {
        default_shape(packs, &g.sentinel_resident)
    }

    fn single_gpu_traffic_per_rank(&self, n: f64, s: f64) -> f64 {
        // S is one rank's share: read N shares, write N-1 to peers; poll
        // and reset N-1 received shares, write the sum.
        n * s + (n - 1.0) * s + 2.0 * (n - 1.0) * s + s
    }

    fn cost(&self, shape: &CostShape) -> CostRecipe {
        push_collective_cost(shape)
    }

    fn param_struct(&self, name: &str) -> Option<(usize, usize)> {
        name.starts_with(self.kernel().kernel_prefix()).then_some(gather_scatter_params())
    }

    fn prepare(&self, rank: &RankSetup<'_>) -> Result<Option<Box<dyn RankAlgorithm>>> {
        PushCollectiveRank::prepare(self.kernel(), rank)
    }
}
