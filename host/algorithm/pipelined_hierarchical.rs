//! PipelinedHierarchical: Hierarchical (reduce-scatter inside each island,
//! the cross-island exchange of each share's partial, all-gather inside
//! the island) with its phases in three groups of blocks that run side by
//! side, so that on a PCIe machine the island traffic, the socket crossing
//! and the all-gather share the links at once instead of taking turns.
//! For large messages (prefill): the first pack still passes three hops,
//! and each group has a third of the launch's blocks. Same receive region,
//! slots, generation, parameters and result bits as Hierarchical (the two
//! may follow each other on a communicator in any order); no fused
//! variant. Kernel: `kernels-rs/src/device/pipelined_hierarchical.rs`.

#![forbid(unsafe_code)]

use std::mem::{align_of, size_of};

use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::params::IslandPushParams;

use super::hierarchical::{hierarchical_recipe, islands_requirement};
use super::island_push::{self, grouped_share_shape, IslandKind};
use super::launch::{RankAlgorithm, RankSetup};
use super::{AlgorithmHost, Capabilities, CostRecipe, CostShape, Geometry};
use crate::error::Result;

pub(crate) struct PipelinedHierarchical;

impl AlgorithmHost for PipelinedHierarchical {
    fn kernel(&self) -> AlgorithmId {
        AlgorithmId::PipelinedHierarchical
    }

    fn supports_host_staged(&self) -> bool {
        true
    }

    fn supports_per_pair(&self) -> bool {
        true
    }

    /// Hierarchical's sums: the island reduction and the cross-island sum.
    fn max_roundings(&self, _world: usize) -> usize {
        2
    }

    fn requirement(&self, caps: &Capabilities, _bytes: Option<usize>) -> Result<(), String> {
        islands_requirement(self.kernel(), caps)
    }

    fn launch_capacity_packs(&self, g: &Geometry) -> u64 {
        g.layout.hierarchical_share_packs * g.layout.island_shares as u64
    }

    fn launch_shape(&self, g: &Geometry, packs: u64) -> (u32, u32) {
        grouped_share_shape(packs, g.layout.island_shares.max(1) as u64, &g.sentinel_resident)
    }

    fn param_struct(&self, name: &str) -> Option<(usize, usize)> {
        name.starts_with(self.kernel().kernel_prefix())
            .then_some((size_of::<IslandPushParams>(), align_of::<IslandPushParams>()))
    }

    fn prepare(&self, rank: &RankSetup<'_>) -> Result<Option<Box<dyn RankAlgorithm>>> {
        island_push::prepare(IslandKind::PipelinedHierarchical, rank)
    }

    fn single_gpu_traffic_per_rank(&self, _n: f64, s: f64) -> f64 {
        // as Hierarchical
        6.0 * s
    }

    fn cost(&self, shape: &CostShape) -> CostRecipe {
        hierarchical_recipe(shape, true)
    }
}
