//! TwoShotPush: reduce-scatter by posted writes (share `j` of every rank's
//! input goes to rank `j`), then all-gather by posted writes; peers in a
//! staggered order. Payload completion (a sentinel kernel: no flag, no
//! barrier; parameters by value; any launch shape): the island push with
//! one island of every rank.
//! Kernel: `kernels-rs/src/device/two_shot_push.rs` (body in
//! `island_push.rs`); receive region: `ScratchLayout::two_shot_push_*`.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::params::ISLAND_PUSH_GROUP;
use tp_allreduce_kernels::partition::div_ceil;
use tp_allreduce_kernels::shares::owned_count;

use super::cost::access_groups;
use super::one_shot_push::default_shape;
use super::{AlgorithmHost, CostRecipe, CostShape, FlowSet, Geometry, IslandSplit, PhaseSpec, ResidentBlocks};

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
        let rounds = island_push_rounds(&IslandSplit::whole(shape.world));
        CostRecipe {
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

/// The default launch shape of an island push launch over `packs` packs cut
/// into `shares` shares: threads walk the packs of one share (every phase
/// is a grid-stride loop over a share's packs), so the default rule of
/// OneShotPush applied to a share.
pub(crate) fn share_shape(packs: u64, shares: u64, resident: &ResidentBlocks) -> (u32, u32) {
    default_shape(div_ceil(packs, shares.max(1)), resident)
}

/// Dependent memory round trips of an island push launch beyond one poll
/// per hop, per phase, for its slowest member (see
/// [`PhaseSpec::access_rounds`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct IslandPushRounds {
    /// Reduce-scatter sends (the first send alone, then groups: each
    /// group's input loads return before its stores) and the partial's
    /// polls beyond the first group.
    pub scatter: f64,
    /// Hierarchical: the cross polls beyond the first group.
    pub cross: f64,
    /// The all-gather polls beyond the first group.
    pub gather: f64,
}

/// [`IslandPushRounds`] for `islands` (TwoShotPush: one island of every
/// rank). Member `j` of an island of `m` owns `owned_count(S, m, j)` of the
/// `S` shares, sends the other `S - owned`, polls `m - 1` reduce-scatter
/// slots and `islands - 1` cross slots per owned share, and one all-gather
/// slot per send.
pub(crate) fn island_push_rounds(islands: &IslandSplit) -> IslandPushRounds {
    let shares = islands.shares();
    let count = islands.count();
    let mut r = IslandPushRounds { scatter: 0.0, cross: 0.0, gather: 0.0 };
    for g in 0..count {
        let m = islands.size(g);
        for j in 0..m {
            let owned = owned_count(shares as u32, m as u32, j as u32) as usize;
            let sends = shares - owned;
            let send_rounds = if sends == 0 { 0.0 } else { 1.0 + access_groups(sends - 1, ISLAND_PUSH_GROUP) };
            let beyond_hop = |polls: f64| (polls - 1.0).max(0.0);
            let partial = beyond_hop(owned as f64 * access_groups(m - 1, ISLAND_PUSH_GROUP));
            r.scatter = r.scatter.max(send_rounds + partial);
            r.cross = r.cross.max(beyond_hop(owned as f64 * access_groups(count - 1, ISLAND_PUSH_GROUP)));
            r.gather = r.gather.max(beyond_hop(access_groups(sends, ISLAND_PUSH_GROUP)));
        }
    }
    r
}
