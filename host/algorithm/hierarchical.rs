//! Hierarchical: reduce-scatter inside each island, exchange each island
//! member's reduced share with the same-index member of every other island,
//! all-gather inside the island; posted writes, three flag phases. Islands
//! are consecutive ranks (`Config::island_size`, or derived from the
//! topology when its islands are consecutive).
//! Kernel: `kernels-rs/src/device/hierarchical.rs`; scratch:
//! `ScratchLayout::hierarchical_*`.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::partition::{div_ceil, push_grid};

use super::{islands_split, AlgorithmHost, Capabilities, CostRecipe, CostShape, FlowSet, Geometry, PhaseSpec};

pub(crate) struct Hierarchical;

impl AlgorithmHost for Hierarchical {
    fn kernel(&self) -> AlgorithmId {
        AlgorithmId::Hierarchical
    }

    fn supports_host_staged(&self) -> bool {
        true
    }

    /// The island reduction and the cross-island sum each round.
    fn max_roundings(&self, _world: usize) -> usize {
        2
    }

    fn requirement(&self, caps: &Capabilities, _bytes: Option<usize>) -> Result<(), String> {
        match caps.island_size {
            Some(m) if islands_split(m, caps.world) => Ok(()),
            Some(m) => Err(format!("hierarchical: islands of {m} do not split {} ranks into two or more", caps.world)),
            None => Err("hierarchical needs islands (none derived from the topology or configured)".into()),
        }
    }

    fn grid(&self, g: &Geometry, packs: u64) -> u32 {
        let share = div_ceil(packs, g.layout.island_size.max(1) as u64);
        push_grid(share, Geometry::THREADS, g.layout.hierarchical_stripe_packs, g.layout.push_blocks)
    }

    fn cost(&self, shape: &CostShape) -> CostRecipe {
        let share = 1.0 / shape.island_size.unwrap_or(shape.world).max(1) as f64;
        CostRecipe {
            phases: vec![
                PhaseSpec::staggered_writes(FlowSet::WithinIslands, share),
                PhaseSpec::staggered_writes(FlowSet::AcrossIslands, share),
                PhaseSpec::staggered_writes(FlowSet::WithinIslands, share),
            ],
            local_passes: 4.0,
        }
    }
}
