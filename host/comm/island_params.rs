//! Parameter templates of the island push kernels (TwoShotPush: one island
//! of every rank; Hierarchical: the communicator's islands), built once per
//! rank at init: every slot address resolved from the share and ownership
//! math of `tp_allreduce_kernels::shares`. Pure, so that the addresses
//! writers use and the slots readers poll are checked against each other
//! on the CPU for every island shape (`tests`).

#![forbid(unsafe_code)]

use std::mem::offset_of;

use tp_allreduce_kernels::layout::{LocalState, SignalBlock};
use tp_allreduce_kernels::params::{IslandPushParams, SentinelHeader};
use tp_allreduce_kernels::partition::PACK;
use tp_allreduce_kernels::shares::{
    owned_capacity, owned_count, owned_position, owner_index, slot_of, slot_offset, source_of, SlotKind,
};

use crate::algorithm::{CrossRegions, IslandSplit, RankMemory, CROSS_SLOTS_OFFSET};

/// Which island push.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IslandKind {
    TwoShotPush,
    Hierarchical,
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
        IslandKind::Hierarchical => {
            Slots { mem, split, cross, offset: l.hierarchical_offset, cap: l.hierarchical_share_packs }
        }
    };
    let half = match kind {
        IslandKind::TwoShotPush => l.two_shot_push_half_bytes,
        IslandKind::Hierarchical => l.hierarchical_half_bytes,
    };
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

#[cfg(test)]
mod tests;
