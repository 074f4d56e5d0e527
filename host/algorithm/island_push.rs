//! The island push, what TwoShotPush (one island of every rank) and
//! Hierarchical (the communicator's islands) share on the host: the
//! parameter template built once per rank at init (every slot address
//! resolved from the share and ownership math of
//! `tp_allreduce_kernels::shares`), the launch shape, the memory round
//! trips the cost model prices, the launches of a call and those of the
//! fused epilogue variant. The templates are pure, so that the addresses
//! writers use and the slots readers poll are checked against each other
//! on the CPU for every island shape (`island_push/tests.rs`). Kernels:
//! `kernels-rs/src/device/island_push.rs` (plain) and
//! `fused_island_push.rs`.
//!
//! # The fused variant
//! Opt-in (`Config::fused_island_kernels`: on 2 H200 these kernels
//! measured slower than the allreduce + the separate kernel,
//! docs/RESULTS.md). Shares are whole rows (`S` shares of `ceil(rows / S)`
//! rows, [`share_rows`]); the owner of a share finishes its rows (the sum,
//! the residual add, RMSNorm) and the all-gather carries the new residual
//! and the normalised rows, two packs per position: a launch's share fits
//! half a receive position range (`share_cap / 2` packs, the normalised
//! packs in the other half), [`island_rows_per_launch`]. **The owner adds
//! its residual (and weight) for every rank**, so ranks must pass the same
//! residual and weight, as in tensor parallelism (the one-shot kernels add
//! each rank's own; the results agree when the residuals do).

#![forbid(unsafe_code)]

use std::mem::offset_of;

use tp_allreduce_kernels::ids::{AlgorithmId, DType};
use tp_allreduce_kernels::layout::{LocalState, SignalBlock};
use tp_allreduce_kernels::params::{
    FusedIslandPushParams, IslandPushParams, SentinelHeader, FLAG_TRACE, ISLAND_PUSH_GROUP,
};
use tp_allreduce_kernels::partition::{div_ceil, PACK, PACK_BYTES};
use tp_allreduce_kernels::shares::{
    owned_capacity, owned_count, owned_position, owner_index, slot_of, slot_offset, source_of, SlotKind,
};

use super::cost::access_groups;
use super::epilogue::{fused_row_packs, fused_rows, row_chunks, EpilogueCall, EpilogueShape, FusedPath};
use super::launch::{entry_name, run_sentinel, ByDtype, Call, Grid, Issue, Launch, RankAlgorithm, RankSetup};
use super::one_shot_push::default_shape;
use super::{Algorithm, Geometry, ResidentBlocks};
use crate::algorithm::{CrossRegions, IslandSplit, RankMemory, CROSS_SLOTS_OFFSET};
use crate::driver::{Kernel, ParamStruct};
use crate::error::{Error, Result};

/// Which island push.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IslandKind {
    TwoShotPush,
    Hierarchical,
    /// Hierarchical's slots and region, its phases in groups of blocks.
    PipelinedHierarchical,
}

impl IslandKind {
    fn algorithm(self) -> Algorithm {
        match self {
            IslandKind::TwoShotPush => Algorithm::TwoShotPush,
            IslandKind::Hierarchical => Algorithm::Hierarchical,
            IslandKind::PipelinedHierarchical => Algorithm::PipelinedHierarchical,
        }
    }

    fn id(self) -> AlgorithmId {
        match self {
            IslandKind::TwoShotPush => AlgorithmId::TwoShotPush,
            IslandKind::Hierarchical => AlgorithmId::Hierarchical,
            IslandKind::PipelinedHierarchical => AlgorithmId::PipelinedHierarchical,
        }
    }

    /// Hierarchical's receive region and islands (not one island of every rank).
    fn hierarchical(self) -> bool {
        self != IslandKind::TwoShotPush
    }
}

/// The parameters of `rank`, all but the per-launch fields (input, output,
/// count, flags, trace). `split`: the islands (ignored for TwoShotPush,
/// which is one island of every rank); `cross`: the per-pair transport's
/// host regions.
pub(crate) fn island_push_template(
    rank: usize,
    mem: &RankMemory,
    kind: IslandKind,
    split: IslandSplit,
    cross: Option<&CrossRegions>,
    timeout_ns: u64,
) -> IslandPushParams {
    let world = mem.region_bases.len();
    let l = &mem.layout;
    let at = match kind {
        IslandKind::TwoShotPush => Slots {
            mem,
            split: IslandSplit::whole(world),
            cross,
            offset: l.two_shot_push_offset,
            cap: l.two_shot_push_share_packs,
        },
        IslandKind::Hierarchical | IslandKind::PipelinedHierarchical => {
            Slots { mem, split, cross, offset: l.hierarchical_offset, cap: l.hierarchical_share_packs }
        }
    };
    let half = if kind.hierarchical() { l.hierarchical_half_bytes } else { l.two_shot_push_half_bytes };
    let split = at.split;
    let (g, j) = (split.island_of(rank), split.index_of(rank) as u32);
    let members = split.size(g) as u32;
    let owned = owned_count(at.shares(), members, j);
    let mut p = IslandPushParams {
        h: SentinelHeader {
            control: mem.local_state + offset_of!(LocalState, control) as u64,
            error_record: mem.error_record,
            timeout_ns,
            half_bytes: half,
            rank: rank as u32,
            world: world as u32,
            abort: at.abort_of(rank),
            ..SentinelHeader::default()
        },
        share_cap: at.cap,
        cross_half_bytes: cross.map_or(half, |c| c.half_bytes),
        shares: at.shares(),
        sends: at.shares() - owned,
        owned,
        members,
        member_index: j,
        islands: split.count() as u32,
        island: g as u32,
        ..IslandPushParams::default()
    };
    at.fill_island(rank, &mut p);
    at.fill_cross(rank, &mut p);
    p
}

/// Where the slots of one island push are, as `mem`'s rank maps them.
struct Slots<'a> {
    mem: &'a RankMemory,
    split: IslandSplit,
    cross: Option<&'a CrossRegions>,
    /// The algorithm's region in the scratch, and `share_cap`.
    offset: u64,
    cap: u64,
}

impl Slots<'_> {
    fn shares(&self) -> u32 {
        self.split.shares() as u32
    }

    fn member(&self, island: usize, index: u32) -> usize {
        self.split.member(island, index as usize)
    }

    /// Slot `slot` of `kind` at rank `r`, owned position 0 (half 0).
    fn slot(&self, r: usize, kind: SlotKind, slot: u32) -> u64 {
        let n = self.split.size(self.split.island_of(r)) as u32;
        let capacity = owned_capacity(self.shares(), n, self.cap);
        match (kind, self.cross) {
            (SlotKind::Cross, Some(c)) => c.bases[r] + CROSS_SLOTS_OFFSET + slot as u64 * capacity * PACK,
            _ => {
                let region = self.mem.region_bases[r] + self.mem.scratch_offset + self.offset;
                region + slot_offset(kind, slot, n, self.split.count() as u32, capacity)
            }
        }
    }

    /// Rank `r`'s abort word, where every rank that waits on it can read it.
    fn abort_of(&self, r: usize) -> u64 {
        match self.cross {
            Some(c) => c.bases[r],
            None => self.mem.region_bases[r] + offset_of!(SignalBlock, abort) as u64,
        }
    }

    /// Reduce-scatter sends and all-gather receives (shares staggered from
    /// member j + 1 on), reduce-scatter slots and all-gather sends.
    fn fill_island(&self, rank: usize, p: &mut IslandPushParams) {
        let (g, j, members) = (self.split.island_of(rank), p.member_index, p.members);
        let shares = self.shares();
        let sends = (1..=shares).map(|d| (j + d) % shares).filter(|&k| owner_index(k, members) != j);
        for (s, k) in sends.enumerate() {
            let o = owner_index(k, members);
            let position = owned_position(k, members) as u64 * self.cap * PACK;
            p.send_share[s] = k as u8;
            p.rs_to[s] = self.slot(self.member(g, o), SlotKind::ReduceScatter, slot_of(j, o)) + position;
            p.ag_from[s] = self.slot(rank, SlotKind::AllGather, slot_of(o, j)) + position;
            p.ag_abort[s] = self.abort_of(self.member(g, o));
            p.ag_peer[s] = self.member(g, o) as u8;
        }
        for q in 0..members.saturating_sub(1) {
            let source = self.member(g, source_of(q, j));
            p.rs_from[q as usize] = self.slot(rank, SlotKind::ReduceScatter, q);
            p.rs_abort[q as usize] = self.abort_of(source);
            p.rs_peer[q as usize] = source as u8;
            p.ag_to[q as usize] = self.slot(source, SlotKind::AllGather, slot_of(j, source_of(q, j)));
        }
    }

    /// Cross slots: the `o`-th other island's owner of each owned share.
    fn fill_cross(&self, rank: usize, p: &mut IslandPushParams) {
        let (g, j, members) = (self.split.island_of(rank), p.member_index, p.members);
        for o in 0..p.islands.saturating_sub(1) {
            let h = source_of(o, g as u32) as usize;
            let n_h = self.split.size(h) as u32;
            p.cross_from[o as usize] = self.slot(rank, SlotKind::Cross, o);
            for e in 0..p.owned {
                let k = j + e * members;
                let owner = self.member(h, owner_index(k, n_h));
                let position = owned_position(k, n_h) as u64 * self.cap * PACK;
                p.cross_to[o as usize][e as usize] =
                    self.slot(owner, SlotKind::Cross, slot_of(g as u32, h as u32)) + position;
                p.cross_abort[o as usize][e as usize] = self.abort_of(owner);
                p.cross_peer[o as usize][e as usize] = owner as u8;
            }
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

/// The default launch shape of a PipelinedHierarchical launch: three groups
/// of blocks (sends; partial and final sums; all-gather), each the size
/// [`share_shape`] gives one launch, within the resident cap (fewer than
/// three blocks run every phase in every block).
pub(crate) fn grouped_share_shape(packs: u64, shares: u64, resident: &ResidentBlocks) -> (u32, u32) {
    let (blocks, threads) = share_shape(packs, shares, resident);
    let cap = resident.cap(threads).max(1);
    (blocks.saturating_mul(3).min(cap), threads)
}

/// Dependent memory round trips of an island push launch beyond one poll
/// per hop, per phase, for its slowest member (see
/// [`PhaseSpec::access_rounds`](super::PhaseSpec::access_rounds)).
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

/// The receive region of an island push as the fused kernels use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct IslandCapacity {
    /// Packs per owned position of a receive slot (`share_cap`).
    pub share_cap: u64,
    /// Shares a launch is cut into (`S`: the world, or the largest island).
    pub shares: u64,
}

/// Rows per share of a fused island push launch over `rows` rows cut into
/// `shares` shares: share `k` holds rows `k R .. min((k + 1) R, rows)`,
/// `R = ceil(rows / shares)` (the last shares may be short or empty, e.g.
/// every share but the first for one row). The kernel computes the same.
pub fn share_rows(rows: u64, shares: u64) -> u64 {
    rows.div_ceil(shares.max(1))
}

/// Rows of one fused island push launch: `shares` shares of whole rows,
/// each within `share_cap / 2` packs (an all-gather position holds the new
/// residual, the normalised pack `share_cap / 2` positions further on).
pub fn island_rows_per_launch(cap: IslandCapacity, row_packs: u64) -> u64 {
    cap.shares * (cap.share_cap / 2).checked_div(row_packs).unwrap_or(0)
}

/// Byte distance from an all-gather position's residual pack to its
/// normalised pack (`FusedIslandPushParams::normed_slot_bytes`).
pub fn normed_slot_bytes(share_cap: u64) -> u64 {
    (share_cap / 2) * PACK_BYTES as u64
}

/// Blocks of a fused island push launch over `rows` rows on a rank that
/// owns `owned` of the `shares` shares: one per owned row (the finishing
/// phase deals them to blocks), at least one (phases A and D), at most `cap`.
pub fn island_blocks(rows: u64, shares: u64, owned: u64, cap: u32) -> u32 {
    super::epilogue::row_blocks(share_rows(rows, shares) * owned, cap)
}

/// The fused path of `kind` for a call of `shape` over its receive region
/// `cap` (`None`: no islands); `island_kernels`:
/// `Config::fused_island_kernels` (the island pushes fuse only with it).
pub(crate) fn fused_path(
    kind: IslandKind,
    shape: &EpilogueShape,
    cap: Option<IslandCapacity>,
    island_kernels: bool,
) -> FusedPath {
    let algorithm = kind.algorithm();
    if !island_kernels {
        return FusedPath::Unfused(format!(
            "{algorithm}'s fused kernel is off (Config::fused_island_kernels; it measured slower than the allreduce \
             + the separate kernel on 2 H200)"
        ));
    }
    let Some(cap) = cap else {
        return FusedPath::Unfused("hierarchical has no islands".into());
    };
    match fused_row_packs(shape) {
        Ok(row_packs) => fused_rows(
            algorithm,
            row_packs,
            island_rows_per_launch(cap, row_packs),
            "half a share position range",
            cap.share_cap / 2,
        ),
        Err(why) => FusedPath::Unfused(why),
    }
}

/// Entry of the fused island push of `kind`: `fused_two_shot_push_<dtype>`
/// or `fused_hierarchical_<dtype>` (one `FusedIslandPushParams` by value).
pub fn fused_entry(id: AlgorithmId, dtype: DType) -> String {
    format!("fused_{}_{}", id.kernel_prefix(), dtype.name())
}

/// The island push's side of one rank (TwoShotPush, Hierarchical or
/// PipelinedHierarchical).
struct IslandPushRank {
    kind: IslandKind,
    template: IslandPushParams,
    geometry: Geometry,
    kernels: ByDtype<Kernel>,
    /// The fused kernels (PipelinedHierarchical, for large messages, has none).
    fused: Option<ByDtype<Kernel>>,
    /// `Config::fused_island_kernels`.
    fused_on: bool,
}

/// `kind`'s side of the rank described by `rank`; `None` for the
/// hierarchical kinds without islands.
pub(crate) fn prepare(kind: IslandKind, rank: &RankSetup<'_>) -> Result<Option<Box<dyn RankAlgorithm>>> {
    let split = match kind {
        IslandKind::TwoShotPush => IslandSplit::whole(rank.world),
        IslandKind::Hierarchical | IslandKind::PipelinedHierarchical => match rank.islands {
            Some(split) => split,
            None => return Ok(None),
        },
    };
    let (timeout_ns, launch_timeout_ns) = rank.wait_bounds_ns;
    let mut template = island_push_template(rank.rank, rank.memory, kind, split, rank.cross, timeout_ns);
    template.h.launch_timeout_ns = launch_timeout_ns;
    if let Some(ring) = rank.trace {
        template.h.trace = ring;
        template.h.flags |= FLAG_TRACE;
    }
    Ok(Some(Box::new(IslandPushRank {
        kind,
        template,
        geometry: rank.geometry,
        kernels: ByDtype::kernels(rank.module, |d| entry_name(kind.id(), d))?,
        fused: match kind {
            IslandKind::PipelinedHierarchical => None,
            _ => Some(ByDtype::kernels(rank.module, |d| fused_entry(kind.id(), d))?),
        },
        fused_on: rank.fused_island_kernels,
    })))
}

impl IslandPushRank {
    /// The parameters of one launch over `count` elements.
    fn params(&self, input: u64, output: u64, count: u64) -> IslandPushParams {
        let mut p = self.template;
        p.h.input = input;
        p.h.output = output;
        p.h.count = count;
        p
    }

    /// The receive region as its template states it.
    fn capacity(&self) -> IslandCapacity {
        IslandCapacity { share_cap: self.template.share_cap, shares: self.template.shares as u64 }
    }
}

impl RankAlgorithm for IslandPushRank {
    fn run(&self, call: &Call, issue: &mut Issue<'_>) -> Result<()> {
        let g = &self.geometry;
        let (capacity, shares) = if self.kind.hierarchical() {
            (g.layout.hierarchical_share_packs * g.layout.island_shares as u64, g.layout.island_shares.max(1) as u64)
        } else {
            (g.layout.two_shot_push_share_packs * g.world as u64, g.world as u64)
        };
        let default_shape = |packs| match self.kind {
            IslandKind::PipelinedHierarchical => grouped_share_shape(packs, shares, &g.sentinel_resident),
            _ => share_shape(packs, shares, &g.sentinel_resident),
        };
        let params = |input, output, count| self.params(input, output, count);
        let kernel = self.kernels.get(call.dtype);
        run_sentinel(self.kind.id(), kernel, g, capacity, call, default_shape, params, issue)
    }

    fn fused_path(&self, shape: &EpilogueShape) -> Option<FusedPath> {
        Some(match self.fused {
            Some(_) => fused_path(self.kind, shape, Some(self.capacity()), self.fused_on),
            None => FusedPath::Unfused(format!("{} has no fused kernel", self.kind.algorithm())),
        })
    }

    /// Launches of `rows_per_launch` whole rows, cut into shares of whole
    /// rows ([`share_rows`]), a grid over this rank's owned rows.
    /// Hierarchical keeps the island partials of its owned rows in
    /// `normed` (or `input` without RMSNorm) between its phases B and C.
    fn run_fused(&self, _call: &Call, e: &EpilogueCall, rows_per_launch: u64, issue: &mut Issue<'_>) -> Result<()> {
        let Some(fused) = &self.fused else {
            return Err(Error::invalid(format!("{} has no fused kernel", self.kind.algorithm())));
        };
        let kernel = fused.get(e.shape.dtype);
        let hidden = e.shape.hidden as u64;
        let threads = e.threads(e.shape.row_packs().unwrap_or(0));
        let cap = self.geometry.pull_max_blocks;
        for (row0, rows) in row_chunks(e.shape.rows, rows_per_launch) {
            let input = e.input + e.row_offset(row0);
            let epilogue = e.epilogue(row0, rows);
            let partials = if e.shape.norm { epilogue.normed } else { input };
            let push = self.params(input, partials, rows * hidden);
            let blocks = island_blocks(rows, push.shares as u64, push.owned as u64, cap);
            let p = FusedIslandPushParams {
                push,
                epilogue,
                normed_slot_bytes: normed_slot_bytes(push.share_cap),
                _pad0: 0,
            };
            // A share of `rows` rows fits half a receive position range
            // (fused_path), which `normed_slot_bytes` splits; at most
            // `pull_max_blocks` blocks of at most 512 threads stay resident
            // with the other ranks of the GPU (the fused entries are among
            // those it is computed from); `threads` covers a row
            // (check_threads) and is the same on every rank (the reduction
            // tree).
            issue(Launch::ByValue { kernel, grid: Grid::new(blocks, threads), params: ParamStruct::of(&p) })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
