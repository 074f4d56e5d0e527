//! Hierarchical: reduce-scatter inside each island, exchange each share's
//! partial sum with that share's owner in every other island, all-gather
//! inside the island; posted writes, payload completion (a sentinel kernel:
//! no flag, no barrier, any launch shape), three dependent hops. Islands of
//! any shape (unequal sizes allowed): from `Config::islands`,
//! `Config::island_size` (consecutive) or the topology
//! (`select::topology::islands`). With the per-pair transport the cross
//! slots live in host memory (P2P inside islands, host-staged across).
//! Kernel: `kernels-rs/src/device/hierarchical.rs` (body in
//! `island_push.rs`); receive region: `ScratchLayout::hierarchical_*`.
//! What it shares with TwoShotPush (template, launches, fused variant):
//! `island_push.rs`.

#![forbid(unsafe_code)]

use std::mem::{align_of, size_of};

use tp_allreduce_kernels::ids::{AlgorithmId, DType};
use tp_allreduce_kernels::params::IslandPushParams;

use super::island_push::{self, fused_entry, island_push_rounds, share_shape, IslandKind};
use super::launch::{RankAlgorithm, RankSetup};
use super::{AlgorithmHost, Capabilities, CostRecipe, CostShape, FlowSet, Geometry, IslandSplit, PhaseSpec};
use crate::error::Result;

pub(crate) struct Hierarchical;

impl AlgorithmHost for Hierarchical {
    fn kernel(&self) -> AlgorithmId {
        AlgorithmId::Hierarchical
    }

    fn supports_host_staged(&self) -> bool {
        true
    }

    fn supports_per_pair(&self) -> bool {
        true
    }

    /// The island reduction and the cross-island sum each round.
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
        share_shape(packs, g.layout.island_shares.max(1) as u64, &g.sentinel_resident)
    }

    fn fused_entries(&self, _sm: Option<u32>) -> Vec<String> {
        DType::ALL.into_iter().map(|d| fused_entry(self.kernel(), d)).collect()
    }

    fn param_struct(&self, name: &str) -> Option<(usize, usize)> {
        name.starts_with(self.kernel().kernel_prefix())
            .then_some((size_of::<IslandPushParams>(), align_of::<IslandPushParams>()))
    }

    fn prepare(&self, rank: &RankSetup<'_>) -> Result<Option<Box<dyn RankAlgorithm>>> {
        island_push::prepare(IslandKind::Hierarchical, rank)
    }

    fn single_gpu_traffic_per_rank(&self, _n: f64, s: f64) -> f64 {
        // as two-shot push: scatter, reduce, gather, each a read and a write
        6.0 * s
    }

    fn cost(&self, shape: &CostShape) -> CostRecipe {
        hierarchical_recipe(shape, false)
    }
}

/// Hierarchical and PipelinedHierarchical: islands that split the world.
pub(super) fn islands_requirement(id: AlgorithmId, caps: &Capabilities) -> Result<(), String> {
    let name = id.name();
    match caps.islands {
        Some(i) if i.splits() && i.world() == caps.world => Ok(()),
        Some(i) => Err(format!("{name}: islands {i} do not split {} ranks into two or more", caps.world)),
        None => Err(format!("{name} needs islands (none derived from the topology or configured)")),
    }
}

/// The phases of Hierarchical, one after the other, or of
/// PipelinedHierarchical (`overlapped`: side by side, the same hops and
/// rounds for the first pack).
pub(super) fn hierarchical_recipe(shape: &CostShape, overlapped: bool) -> CostRecipe {
    let (shares, largest, islands) = match shape.islands {
        Some(i) => (i.shares() as f64, i.shares() as f64, i.count() as f64),
        None => (shape.world as f64, shape.world as f64, 1.0),
    };
    let share = 1.0 / shares;
    let rounds = island_push_rounds(&shape.islands.unwrap_or_else(|| IslandSplit::whole(shape.world)));
    CostRecipe {
        phases: vec![
            PhaseSpec::staggered_writes(FlowSet::IslandScatter, share).with_access_rounds(rounds.scatter),
            PhaseSpec::staggered_writes(FlowSet::CrossOwners, share).with_access_rounds(rounds.cross),
            PhaseSpec::staggered_writes(FlowSet::IslandGather, share).with_access_rounds(rounds.gather),
        ],
        // Input once; reads and resets of the reduce-scatter, cross and
        // all-gather slots; the partial written and read back; output.
        local_passes: 3.0 + (4.0 * (largest - 1.0) + 2.0 * (islands - 1.0)) / shares,
        overlapped,
    }
}
