//! AllGatherPush: the all-gather by payload completion. Every rank writes
//! its block into its slot of every peer's receive region, and copies the
//! blocks that land there into its output (one hop, no barrier). It runs in
//! one-shot push's receive region with its generation and its parameter
//! template (`one_shot_push::template`), plus the distance between the
//! ranks' blocks (`GatherScatterParams`). A sentinel kernel: parameters by
//! value, any launch shape, long messages cut into launches of the receive
//! region's capacity. Kernel: `kernels-rs/src/device/all_gather_push.rs`.
//!
//! Its sibling `reduce_scatter_push.rs` shares [`PushCollectiveRank`]: the
//! same region and template, each peer sent its own share.

#![forbid(unsafe_code)]

use std::mem::{align_of, size_of};

use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::partition::PACK_BYTES;
use tp_allreduce_kernels::params::{all_gather_launch_packs, GatherScatterParams, OneShotPushParams, FLAG_TRACE};

use super::launch::{entry_name, run_sentinel, ByDtype, Call, Issue, RankAlgorithm, RankSetup};
use super::one_shot_push::default_shape;
use super::{AlgorithmHost, Capabilities, CostRecipe, CostShape, FlowSet, Geometry, PhaseSpec};
use crate::driver::Kernel;
use crate::error::Result;

pub(crate) struct AllGatherPush;

impl AlgorithmHost for AllGatherPush {
    fn kernel(&self) -> AlgorithmId {
        AlgorithmId::AllGatherPush
    }

    fn supports_host_staged(&self) -> bool {
        true
    }

    fn requirement(&self, caps: &Capabilities, _bytes: Option<usize>) -> Result<(), String> {
        one_shot_push_region(caps)?;
        // A launch's packs and their escape words share a slot: a slot of
        // one pack holds no launch.
        if all_gather_launch_packs((caps.one_shot_push_max_bytes / PACK_BYTES) as u64) == 0 {
            return Err(format!(
                "one-shot push's receive slots ({} bytes) are too small for the all-gather's packs and escape words",
                caps.one_shot_push_max_bytes
            ));
        }
        Ok(())
    }

    fn launch_capacity_packs(&self, g: &Geometry) -> u64 {
        all_gather_launch_packs(g.layout.one_shot_push_max_packs)
    }

    fn launch_shape(&self, g: &Geometry, packs: u64) -> (u32, u32) {
        default_shape(packs, &g.sentinel_resident)
    }

    fn single_gpu_traffic_per_rank(&self, n: f64, s: f64) -> f64 {
        // S is one rank's block: read it, write it to N-1 peers and into
        // the own output; poll-read and reset N-1 blocks, write them out.
        s + n * s + 3.0 * (n - 1.0) * s
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

/// One-shot push's receive region is there (it is sized by
/// `Config::one_shot_push_max_bytes`, 0 removes it).
pub(super) fn one_shot_push_region(caps: &Capabilities) -> Result<(), String> {
    if caps.one_shot_push_max_bytes == 0 {
        Err("one-shot push's receive region is disabled (one_shot_push_max_bytes = 0)".into())
    } else {
        Ok(())
    }
}

/// What the cost model prices for an all-gather or reduce-scatter by
/// payload completion, S being one rank's block: every rank writes a block
/// to every peer in one hop (staggered), its receive slots polled in groups
/// of two.
pub(super) fn push_collective_cost(shape: &CostShape) -> CostRecipe {
    let polls = super::cost::access_groups(shape.world.saturating_sub(1), POLL_GROUP);
    let n = shape.world as f64;
    CostRecipe {
        overlapped: false,
        phases: vec![PhaseSpec::staggered_writes(FlowSet::AllPairs, 1.0).with_access_rounds((polls - 1.0).max(0.0))],
        local_passes: 3.0 * (n - 1.0) + 2.0,
    }
}

/// Receive slots the kernels poll back to back.
const POLL_GROUP: usize = tp_allreduce_kernels::params::ISLAND_PUSH_GROUP;

pub(super) fn gather_scatter_params() -> (usize, usize) {
    (size_of::<GatherScatterParams>(), align_of::<GatherScatterParams>())
}

/// The side of one rank of AllGatherPush or ReduceScatterPush.
pub(super) struct PushCollectiveRank {
    algorithm: AlgorithmId,
    /// One-shot push's template: its receive region, generation, peers.
    template: OneShotPushParams,
    geometry: Geometry,
    kernels: ByDtype<Kernel>,
}

impl PushCollectiveRank {
    pub(super) fn prepare(algorithm: AlgorithmId, rank: &RankSetup<'_>) -> Result<Option<Box<dyn RankAlgorithm>>> {
        let mut template = super::one_shot_push::template(rank.rank, rank.memory, rank.wait_bounds_ns);
        if let Some(ring) = rank.trace {
            template.h.trace = ring;
            template.h.flags |= FLAG_TRACE;
        }
        let kernels = ByDtype::kernels(rank.module, |d| entry_name(algorithm, d))?;
        Ok(Some(Box::new(PushCollectiveRank { algorithm, template, geometry: rank.geometry, kernels })))
    }
}

impl RankAlgorithm for PushCollectiveRank {
    /// `call.count` is one rank's block: all-gather's input, reduce-scatter's
    /// output. Launches of at most the receive region's packs of a block;
    /// each launch's parameters say where the blocks of that piece are
    /// (the piece of block 0, the blocks `block_bytes` apart).
    fn run(&self, call: &Call, issue: &mut Issue<'_>) -> Result<()> {
        let slot_packs = self.geometry.layout.one_shot_push_max_packs;
        // The all-gather's escape words follow a launch's packs in each
        // receive slot (`all_gather_launch_packs`).
        let (capacity, escape_offset) = match self.algorithm {
            AlgorithmId::AllGatherPush => {
                let packs = all_gather_launch_packs(slot_packs);
                (packs, packs * PACK_BYTES as u64)
            }
            _ => (slot_packs, 0),
        };
        let block_bytes = (call.count * call.dtype.size_bytes()) as u64;
        let default_shape = |packs| default_shape(packs, &self.geometry.sentinel_resident);
        let params = |input, output, count| {
            let mut push = self.template;
            push.h.input = input;
            push.h.output = output;
            push.h.count = count;
            GatherScatterParams { push, block_bytes, escape_offset }
        };
        let kernel = self.kernels.get(call.dtype);
        run_sentinel(self.algorithm, kernel, &self.geometry, capacity, call, default_shape, params, issue)
    }
}
