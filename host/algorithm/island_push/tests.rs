//! Writers and readers agree on every slot, for every island shape: each
//! pack a rank sends lands in exactly the slot (and owned position) its
//! receiver polls for that source and share, inside the receiver's half;
//! every share is owned exactly once per island.

use std::collections::BTreeMap;

use tp_allreduce_kernels::layout::{ScratchConfig, ScratchLayout, MAX_RANKS};
use tp_allreduce_kernels::shares::{share_packs, source_of};

use super::*;
use crate::algorithm::epilogue::EpilogueShape;

const MAX_PACKS: u64 = 96;

fn layout(world: usize, split: Option<IslandSplit>) -> ScratchLayout {
    let (sizes, count) = split.map_or(([0; MAX_RANKS], 0), |s| (s.sizes(), s.count() as u32));
    ScratchLayout::new(&ScratchConfig {
        world_size: world as u32,
        max_packs: MAX_PACKS,
        one_shot_push_max_packs: 8,
        ring_blocks: 1,
        ring_slots: 2,
        ring_chunk_packs: 4,
        island_sizes: sizes,
        island_count: count,
        copy_engine_pieces: 0,
        enable_two_shot_pull: true,
        enable_two_shot_push: true,
        enable_ring: true,
    })
}

fn memory(world: usize, split: Option<IslandSplit>) -> RankMemory {
    RankMemory {
        region_bases: (0..world).map(|r| 0x7000_0000_0000 + (r as u64) * 0x1_0000_0000).collect(),
        scratch_offset: 0xA980,
        layout: layout(world, split),
        local_state: 0x10_000,
        error_record: 0x20_000,
    }
}

/// What lands at an address: (writer rank, phase, share, pack in share).
type Landing = (usize, &'static str, u32, u64);

/// Checks one launch of `packs` packs: every write matches one poll.
fn check_launch(world: usize, kind: IslandKind, split: IslandSplit, cross: Option<&CrossRegions>, packs: u64) {
    let mem = memory(world, kind.hierarchical().then_some(split));
    let t: Vec<IslandPushParams> = (0..world).map(|r| island_push_template(r, &mem, kind, split, cross, 1)).collect();
    let what = format!("{kind:?} {split} ({world} ranks), {packs} packs");
    let shares = t[0].shares;
    let sh = share_packs(packs, shares);
    let cap = t[0].share_cap;
    let mut writes: BTreeMap<u64, Landing> = BTreeMap::new();
    let mut write = |addr: u64, landing: Landing| {
        assert!(writes.insert(addr, landing).is_none(), "{what}: two writes land at {addr:#x}");
    };
    for (r, p) in t.iter().enumerate() {
        for s in 0..p.sends as usize {
            let k = p.send_share[s] as u32;
            for x in (0..sh).filter(|x| k as u64 * sh + x < packs) {
                write(p.rs_to[s] + 16 * x, (r, "rs", k, x));
            }
        }
        for e in 0..p.owned {
            let k = p.member_index + e * p.members;
            for x in (0..sh).filter(|x| k as u64 * sh + x < packs) {
                for o in 0..p.islands.saturating_sub(1) as usize {
                    write(p.cross_to[o][e as usize] + 16 * x, (r, "cross", k, x));
                }
                for q in 0..p.members as usize - 1 {
                    write(p.ag_to[q] + 16 * (e as u64 * cap + x), (r, "ag", k, x));
                }
            }
        }
    }
    // Every poll finds the write of the right source, share and pack.
    let mut polls = 0;
    let mut poll = |addr: u64, expected: Landing| {
        assert_eq!(writes.remove(&addr), Some(expected), "{what}: poll at {addr:#x}");
        polls += 1;
    };
    for (r, p) in t.iter().enumerate() {
        let (g, j) = (split_of(kind, split, world).island_of(r), p.member_index);
        let members = |q: u32| split_of(kind, split, world).member(g, source_of(q, j) as usize);
        for e in 0..p.owned {
            let k = j + e * p.members;
            for x in (0..sh).filter(|x| k as u64 * sh + x < packs) {
                for q in 0..p.members - 1 {
                    poll(p.rs_from[q as usize] + 16 * (e as u64 * cap + x), (members(q), "rs", k, x));
                    assert_eq!(p.rs_peer[q as usize] as usize, members(q));
                }
                for o in 0..p.islands.saturating_sub(1) as usize {
                    let source = p.cross_peer[o][e as usize] as usize;
                    poll(p.cross_from[o] + 16 * (e as u64 * cap + x), (source, "cross", k, x));
                }
            }
        }
        for s in 0..p.sends as usize {
            let k = p.send_share[s] as u32;
            for x in (0..sh).filter(|x| k as u64 * sh + x < packs) {
                poll(p.ag_from[s] + 16 * x, (p.ag_peer[s] as usize, "ag", k, x));
            }
        }
        // Slots stay inside this rank's half (or its cross region).
        let region = mem.region_bases[r] + mem.scratch_offset;
        let (start, half) = match kind.hierarchical() {
            false => (mem.layout.two_shot_push_offset, mem.layout.two_shot_push_half_bytes),
            true => (mem.layout.hierarchical_offset, mem.layout.hierarchical_half_bytes),
        };
        for e in 0..p.owned as u64 {
            let last = 16 * (e * cap + cap - 1);
            for &a in p.rs_from[..p.members as usize - 1].iter() {
                assert!(a >= region + start && a + last + 16 <= region + start + half, "{what}: rank {r} rs");
            }
            for &a in p.cross_from[..p.islands.saturating_sub(1) as usize].iter() {
                match cross {
                    Some(c) => assert!(a + last + 16 <= c.bases[r] + CROSS_SLOTS_OFFSET + c.half_bytes, "{what}"),
                    None => assert!(a + last + 16 <= region + start + half, "{what}: rank {r} cross"),
                }
            }
        }
    }
    assert!(writes.is_empty(), "{what}: writes nobody polls: {writes:x?}");
    assert!(polls > 0 || packs == 0, "{what}: nothing checked");
}

fn split_of(kind: IslandKind, split: IslandSplit, world: usize) -> IslandSplit {
    if kind.hierarchical() {
        split
    } else {
        IslandSplit::whole(world)
    }
}

/// Island shapes of every world size 2..=8: consecutive, unequal,
/// interleaved, with a lone rank.
fn shapes() -> Vec<(usize, IslandSplit)> {
    let mut out = Vec::new();
    for world in 2..=8 {
        for m in 2..world {
            if let Ok(s) = IslandSplit::consecutive(m, world) {
                out.push((world, s));
            }
        }
    }
    let groups: &[&[&[usize]]] = &[
        &[&[0, 1], &[2]],
        &[&[0, 1, 2], &[3, 4]],
        &[&[0, 1, 2, 3], &[4, 5]],
        &[&[0, 2, 4], &[1, 3, 5]],
        &[&[0, 1, 2, 3], &[4]],
        &[&[0, 1, 2, 3, 4], &[5, 6, 7]],
        &[&[0, 1, 2, 3, 4, 5], &[6, 7]],
        &[&[0, 3], &[1, 4, 6], &[2, 5, 7]],
        &[&[0, 1], &[2, 3], &[4, 5], &[6]],
    ];
    for g in groups {
        let world = g.iter().map(|x| x.len()).sum();
        let v: Vec<Vec<usize>> = g.iter().map(|x| x.to_vec()).collect();
        out.push((world, IslandSplit::from_groups(&v, world).unwrap()));
    }
    out
}

#[test]
fn two_shot_push_slots_agree_for_every_world_and_size() {
    for world in 2..=8 {
        for packs in [1, 2, 7, 17, MAX_PACKS - 1, MAX_PACKS] {
            check_launch(world, IslandKind::TwoShotPush, IslandSplit::whole(world), None, packs);
        }
    }
}

#[test]
fn hierarchical_slots_agree_for_every_island_shape_and_size() {
    for (world, split) in shapes() {
        let cap_packs = memory(world, Some(split)).layout.hierarchical_share_packs * split.shares() as u64;
        assert!(cap_packs >= MAX_PACKS, "{split}: capacity {cap_packs} packs");
        for packs in [1, 3, 13, 50, MAX_PACKS] {
            check_launch(world, IslandKind::Hierarchical, split, None, packs);
        }
    }
}

#[test]
fn per_pair_cross_slots_live_in_the_host_regions() {
    use tp_allreduce_kernels::shares::cross_half_bytes;
    for (world, split) in shapes() {
        let cap = memory(world, Some(split)).layout.hierarchical_share_packs;
        let half = cross_half_bytes(&split.sizes(), split.count(), cap);
        let cross =
            CrossRegions { bases: (0..world).map(|r| 0x5000_0000 + r as u64 * 0x100_0000).collect(), half_bytes: half };
        for packs in [1, 13, MAX_PACKS] {
            check_launch(world, IslandKind::Hierarchical, split, Some(&cross), packs);
        }
        let mem = memory(world, Some(split));
        for r in 0..world {
            let p = island_push_template(r, &mem, IslandKind::Hierarchical, split, Some(&cross), 1);
            assert_eq!(p.h.abort, cross.bases[r], "the abort word every peer can read");
            assert!(p.rs_abort[..p.members as usize - 1].iter().all(|a| cross.bases.contains(a)));
            assert_eq!(p.cross_half_bytes, half);
        }
    }
}

/// PipelinedHierarchical's kernel uses Hierarchical's slots, region and
/// generation (the two alternate on a communicator): its parameters are
/// Hierarchical's, for every island shape, P2P or per pair.
#[test]
fn pipelined_hierarchical_parameters_are_hierarchicals() {
    let mut checked = 0;
    for (world, split) in shapes() {
        let mem = memory(world, Some(split));
        let half = tp_allreduce_kernels::shares::cross_half_bytes(
            &split.sizes(),
            split.count(),
            mem.layout.hierarchical_share_packs,
        );
        let cross =
            CrossRegions { bases: (0..world).map(|r| 0x5000_0000 + r as u64 * 0x100_0000).collect(), half_bytes: half };
        for cross in [None, Some(&cross)] {
            for r in 0..world {
                let plain = island_push_template(r, &mem, IslandKind::Hierarchical, split, cross, 7);
                let pipelined = island_push_template(r, &mem, IslandKind::PipelinedHierarchical, split, cross, 7);
                assert_eq!(plain, pipelined, "{split} rank {r}");
                checked += 1;
            }
        }
    }
    assert!(checked > 100, "{checked}");
}

#[test]
fn every_share_is_owned_exactly_once_per_island() {
    for (world, split) in shapes() {
        let mem = memory(world, Some(split));
        let t: Vec<IslandPushParams> =
            (0..world).map(|r| island_push_template(r, &mem, IslandKind::Hierarchical, split, None, 1)).collect();
        for g in 0..split.count() {
            let mut owned: Vec<u32> = split
                .members(g)
                .iter()
                .flat_map(|&r| {
                    let p = t[r];
                    (0..p.owned).map(move |e| p.member_index + e * p.members)
                })
                .collect();
            owned.sort_unstable();
            assert_eq!(owned, (0..split.shares() as u32).collect::<Vec<_>>(), "{split}: island {g}");
            for &r in &split.members(g) {
                let sends: Vec<u32> = t[r].send_share[..t[r].sends as usize].iter().map(|&k| k as u32).collect();
                assert_eq!(sends.len() + t[r].owned as usize, split.shares(), "{split}: rank {r}");
                assert!(sends.iter().all(|k| !owned_by(&t[r], *k)), "{split}: rank {r} sends its own share");
            }
        }
    }
}

fn owned_by(p: &IslandPushParams, k: u32) -> bool {
    (0..p.owned).any(|e| p.member_index + e * p.members == k)
}

fn shape(rows: usize, hidden: usize, dtype: DType) -> EpilogueShape {
    EpilogueShape { rows, hidden, dtype, norm: true }
}

#[test]
fn island_pushes_fuse_while_a_share_fits_half_a_position_range() {
    let s = shape(64, 7168, DType::Bf16); // 896 packs a row
    let mut two_shot = IslandCapacity { share_cap: 4 * 896 + 1, shares: 8 };
    let hierarchical = IslandCapacity { share_cap: 1 << 20, shares: 4 };
    // share_cap / 2 = 1792 packs: two rows per share, 16 rows a launch.
    assert_eq!(fused_path(IslandKind::TwoShotPush, &s, Some(two_shot), true), FusedPath::Fused { rows_per_launch: 16 });
    // Off (the default): the allreduce, then the separate kernel, saying why.
    for kind in [IslandKind::TwoShotPush, IslandKind::Hierarchical] {
        let off = fused_path(kind, &s, Some(two_shot), false);
        assert!(matches!(&off, FusedPath::Unfused(why) if why.contains("fused_island_kernels")), "{off:?}");
    }
    assert_eq!(
        fused_path(IslandKind::Hierarchical, &s, Some(hierarchical), true),
        FusedPath::Fused { rows_per_launch: 4 * ((1 << 19) / 896) }
    );
    // Half a position range smaller than a row: unfused, saying why.
    two_shot.share_cap = 2 * 896 - 2;
    let small = fused_path(IslandKind::TwoShotPush, &s, Some(two_shot), true);
    assert!(matches!(&small, FusedPath::Unfused(why) if why.contains("half a share")), "{small:?}");
    // No islands: hierarchical cannot fuse (nor run).
    assert!(matches!(fused_path(IslandKind::Hierarchical, &s, None, true), FusedPath::Unfused(_)));
    // Rows past the fused limit or not whole packs: unfused, as for one-shot.
    let long = fused_path(IslandKind::TwoShotPush, &shape(1, 16384, DType::F32), Some(hierarchical), true);
    assert!(matches!(&long, FusedPath::Unfused(why) if why.contains("8192")), "{long:?}");
    let odd = fused_path(IslandKind::Hierarchical, &shape(2, 13, DType::Bf16), Some(hierarchical), true);
    assert!(matches!(&odd, FusedPath::Unfused(why) if why.contains("16-byte")), "{odd:?}");
    assert_eq!(normed_slot_bytes(4 * 896 + 1), 1792 * 16);
}

/// Every row of a launch lies in exactly one share, shares hold at most
/// `share_rows` rows, and the blocks cover a rank's owned rows.
#[test]
fn row_shares_partition_the_rows() {
    for shares in 1..=8u64 {
        for rows in 0..=70u64 {
            let r = share_rows(rows, shares);
            let mut seen = vec![0u32; rows as usize];
            for k in 0..shares {
                for row in (k * r)..((k + 1) * r).min(rows) {
                    seen[row as usize] += 1;
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "rows {rows} shares {shares}");
            assert!(r * shares >= rows && (rows == 0 || (r - 1) * shares < rows));
        }
    }
    // One row over 8 shares: share 0 holds it, the other 7 are empty.
    assert_eq!(share_rows(1, 8), 1);
    assert_eq!(share_rows(7, 4), 2);
    assert_eq!(island_blocks(64, 8, 1, 132), 8);
    assert_eq!(island_blocks(64, 4, 2, 132), 32);
    assert_eq!(island_blocks(1, 8, 1, 132), 1);
    assert_eq!(island_blocks(1000, 2, 1, 132), 132);
    assert_eq!(island_rows_per_launch(IslandCapacity { share_cap: 100, shares: 3 }, 0), 0);
}
