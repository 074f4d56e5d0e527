//! OneShotPush's host side on the CPU: the default launch shapes, the
//! template's slots against every receiver's, and the fused variant's
//! paths, entries, clusters and spread push.

use std::mem::offset_of;

use tp_allreduce_kernels::layout::{ScratchConfig, ScratchLayout, SignalBlock};
use tp_allreduce_kernels::params::{
    one_shot_push_source, FUSED_MAX_ROW_PACKS, FUSED_MAX_THREADS, FUSED_WIDE_MAX_THREADS, MAX_CLUSTER_BLOCKS,
};

use super::*;
use crate::algorithm::epilogue::EpilogueShape;

/// 132 SMs of 65536 registers and 2048 threads, kernels at 64
/// registers: one 1024-thread block per SM, two of 512, ...
fn h200_one_rank() -> ResidentBlocks {
    let mut t = [0u32; 32];
    for (i, cap) in t.iter_mut().enumerate() {
        let threads = 32 * (i as u32 + 1);
        *cap = 132 * (65_536 / (64 * threads)).min(2048 / threads).min(32);
    }
    ResidentBlocks(t)
}

#[test]
fn default_shapes_follow_the_rule_of_the_design() {
    let r = h200_one_rank();
    let packs = |bytes: u64| bytes / 16;
    assert_eq!(default_shape(packs(4 << 10), &r), (1, 256));
    assert_eq!(default_shape(packs(42 << 10), &r), (11, 256));
    assert_eq!(default_shape(packs(64 << 10), &r), (16, 256));
    assert_eq!(default_shape(packs(256 << 10), &r), (32, 512));
    assert_eq!(default_shape(packs(1 << 20), &r), (128, 512));
    // 8 MiB: 512 blocks wanted, 132 resident.
    assert_eq!(default_shape(packs(8 << 20), &r), (132, 1024));
    assert_eq!(default_shape(1, &r), (1, 256));
}

#[test]
fn default_shapes_respect_residency_when_ranks_share_a_gpu() {
    // 8 ranks on one GPU: 132 * occupancy / 8.
    let mut shared = h200_one_rank();
    for cap in shared.0.iter_mut() {
        *cap /= 8;
    }
    assert_eq!(default_shape((1 << 20) / 16, &shared), (33, 512));
    assert_eq!(default_shape((8 << 20) / 16, &shared), (16, 1024));
    assert_eq!(default_shape((42 << 10) / 16, &shared), (11, 256));
    // A block size that is not resident at all falls back to smaller ones.
    let mut no_1024 = h200_one_rank();
    no_1024.0[31] = 0;
    assert_eq!(default_shape((16 << 20) / 16, &no_1024).1, 512);
}

fn memory(world: usize, rank: usize) -> RankMemory {
    let layout = ScratchLayout::new(&ScratchConfig {
        world_size: world as u32,
        max_packs: 4096,
        one_shot_push_max_packs: 1000,
        ring_blocks: 4,
        ring_slots: 4,
        ring_chunk_packs: 64,
        island_sizes: [0; tp_allreduce_kernels::layout::MAX_RANKS],
        island_count: 0,
        copy_engine_pieces: 4,
        enable_two_shot_pull: true,
        enable_two_shot_push: true,
        enable_ring: true,
    });
    // Each viewer maps each owner's region at its own address (as IPC
    // mappings do); offsets inside a region are the same everywhere.
    let bases = (0..world).map(|r| 0x7000_0000_0000 + (r as u64) * 0x1_0000_0000 + rank as u64 * 0x100).collect();
    RankMemory {
        region_bases: bases,
        scratch_offset: 0xA980,
        layout,
        local_state: 0x10_000,
        error_record: 0x20_000,
    }
}

/// Every (source, receiver) pair: the address the source sends to is,
/// relative to the receiver's region, the slot the receiver polls for
/// that source; slots of one receiver are distinct and inside its half.
#[test]
fn templates_agree_on_every_slot_across_ranks() {
    for world in 2..=8usize {
        let templates: Vec<_> = (0..world).map(|r| template(r, &memory(world, r), (5, 7))).collect();
        for (s, ts) in templates.iter().enumerate() {
            assert_eq!(ts.h.world as usize, world);
            for k in 0..world - 1 {
                let d = (s + 1 + k) % world;
                let mem_s = memory(world, s);
                let offset_at_d = ts.send_to[k] - mem_s.region_bases[d];
                let td = &templates[d];
                let mem_d = memory(world, d);
                let slot = (0..world - 1)
                    .find(|&j| td.recv_from[j] - mem_d.region_bases[d] == offset_at_d)
                    .unwrap_or_else(|| panic!("world {world}: {s} -> {d} lands in no slot {d} polls"));
                assert_eq!(one_shot_push_source(slot as u32, d as u32) as usize, s);
                assert_eq!(td.source_abort[slot] - mem_d.region_bases[s], offset_of!(SignalBlock, abort) as u64);
            }
            let mut offsets: Vec<u64> = (0..world - 1).map(|j| ts.recv_from[j]).collect();
            offsets.sort_unstable();
            offsets.dedup();
            assert_eq!(offsets.len(), world - 1, "world {world} rank {s}: slots collide");
            let half = ts.h.half_bytes;
            let region_start =
                memory(world, s).region_bases[s] + 0xA980 + memory(world, s).layout.one_shot_push_offset;
            for j in 0..world - 1 {
                assert!(ts.recv_from[j] >= region_start && ts.recv_from[j] + 1000 * 16 <= region_start + half);
            }
            // Unused entries stay zero (a kernel never touches them).
            assert!(ts.send_to[world - 1..].iter().all(|&a| a == 0));
            assert_eq!(ts.h.abort, memory(world, s).region_bases[s] + offset_of!(SignalBlock, abort) as u64);
            assert_eq!(ts.h.control, 0x10_000);
        }
    }
}

fn shape(rows: usize, hidden: usize, dtype: DType) -> EpilogueShape {
    EpilogueShape { rows, hidden, dtype, norm: true }
}

#[test]
fn the_fused_push_takes_whole_pack_rows_that_fit_a_launch() {
    let s = shape(3, 7168, DType::Bf16);
    assert_eq!(fused_path(&s, 1000), FusedPath::Fused { rows_per_launch: 1 });
    assert!(matches!(fused_path(&shape(1, 16384, DType::Bf16), 1 << 20), FusedPath::Fused { .. }));
    assert!(matches!(fused_path(&shape(1, 8192, DType::F32), 1 << 20), FusedPath::Fused { .. }));
    let long = fused_path(&shape(1, 16384, DType::F32), 1 << 20);
    assert!(matches!(&long, FusedPath::Unfused(why) if why.contains("8192")), "{long:?}");
    // A receive region smaller than a row.
    let small = fused_path(&shape(2, 4096, DType::Bf16), 100);
    assert!(matches!(&small, FusedPath::Unfused(why) if why.contains("exceeds")), "{small:?}");
}

#[test]
fn entries_cover_every_split_and_clusters_from_sm_90() {
    let every = OneShotPush.fused_entries(None);
    assert_eq!(every.len(), 6 * 3);
    assert!(every.contains(&"fused_one_shot_push2_wide_spread_bf16".to_string()));
    let sm90 = OneShotPush.fused_entries(Some(90));
    assert_eq!(sm90.len(), 8 * 3);
    assert!(sm90.contains(&"fused_one_shot_push_cluster_f16".to_string()));
    assert_eq!(OneShotPush.entries(), ["one_shot_push_f32", "one_shot_push2_f32", "one_shot_push_f16", "one_shot_push2_f16", "one_shot_push_bf16", "one_shot_push2_bf16"]);
}

#[test]
fn push_launch_takes_one_pack_per_thread_with_two_ranks_and_the_fewest_packs_otherwise() {
    // hidden 7168 bf16 = 896 packs.
    assert_eq!(push_launch(896, true, None), (PushRowSplit::Wide, 896));
    assert_eq!(push_launch(1024, true, None), (PushRowSplit::Wide, 1024));
    assert_eq!(push_launch(1, true, None), (PushRowSplit::Wide, 32));
    assert_eq!(push_launch(1025, true, None), (PushRowSplit::Long, 352));
    assert_eq!(push_launch(2048, true, None), (PushRowSplit::Long, 512));
    assert_eq!(push_launch(896, false, None), (PushRowSplit::Short, 448));
    assert_eq!(push_launch(896, true, Some(256)), (PushRowSplit::Long, 256));
    assert_eq!(push_launch(512, true, Some(256)), (PushRowSplit::Short, 256));
    for packs in 1..=FUSED_MAX_ROW_PACKS as u64 {
        for two_ranks in [false, true] {
            let (split, threads) = push_launch(packs, two_ranks, None);
            assert!(threads % 32 == 0 && threads >= 32, "{packs}: {threads}");
            assert!(packs <= threads as u64 * split.packs_per_thread() as u64, "{packs}: {split:?} x {threads}");
            let max = if split == PushRowSplit::Wide { FUSED_WIDE_MAX_THREADS } else { FUSED_MAX_THREADS };
            assert!(threads <= max, "{packs}: {threads}");
        }
    }
}

#[test]
fn the_push_spreads_over_more_blocks_than_rows_only() {
    // 3 x 7168 bf16 (2688 packs): 11 blocks, as the plain kernel.
    assert_eq!(spread_push_blocks(3, 896, 36), Some(11));
    assert_eq!(spread_push_blocks(2, 896, 36), Some(7));
    assert_eq!(spread_push_blocks(1, 896, 36), None);
    // Capped by residency; never fewer blocks than rows.
    assert_eq!(spread_push_blocks(64, 896, 36), None);
    assert_eq!(spread_push_blocks(3, 896, 3), None);
    assert_eq!(spread_push_blocks(2, 128, 36), None);
    assert_eq!(spread_push_blocks(0, 896, 36), None);
    assert_eq!(spread_push_blocks(8, 4096, 36), Some(36));
    assert_eq!(spread_push_blocks(2, SPREAD_PUSH_MAX_PACKS / 2, 36), None);
    // The `_wide_spread` entries push one pack per thread: a share
    // never exceeds a row (threads = the row's packs, rounded to 32).
    for rows in 2..=40u64 {
        for row_packs in 1..=FUSED_WIDE_MAX_THREADS as u64 {
            let (split, threads) = push_launch(row_packs, true, None);
            assert_eq!(split, PushRowSplit::Wide);
            if let Some(blocks) = spread_push_blocks(rows, row_packs, 36) {
                let share = (rows * row_packs).div_ceil(blocks as u64);
                assert!(share <= threads as u64, "{rows} x {row_packs}: share {share} > {threads} threads");
            }
        }
    }
}

#[test]
fn cluster_launches_spread_a_few_long_rows_and_cover_every_pack() {
    let launch = |blocks_per_cluster, threads| Some(ClusterLaunch { blocks_per_cluster, threads });
    // hidden 7168 bf16 = 896 packs: 7 blocks of 128 threads per row.
    assert_eq!(cluster_launch(896, 3, 36), launch(7, 128));
    assert_eq!(cluster_launch(896, 3, 36).map(|c| c.blocks(3)), Some(21));
    assert_eq!(cluster_launch(896, 5, 36), launch(7, 128));
    assert_eq!(cluster_launch(2048, 3, 36), launch(8, 256));
    // More rows than clusters fit: the block-per-row kernels.
    assert_eq!(cluster_launch(896, 6, 36), None);
    assert_eq!(cluster_launch(896, 64, 36), None);
    assert_eq!(cluster_launch(896, 0, 36), None);
    assert_eq!(cluster_launch(1024, 1, 36), launch(8, 128));
    assert_eq!(cluster_launch(2048, 1, 36), launch(8, 256));
    // Rows a block holds at one pack per thread: no cluster.
    assert_eq!(cluster_launch(16, 2, 36), None);
    assert_eq!(cluster_launch(512, 2, 36), None);
    assert_eq!(cluster_launch(513, 2, 36), launch(5, 128));
    for packs in 1..=FUSED_MAX_ROW_PACKS as u64 {
        let Some(c) = cluster_launch(packs, 1, 36) else {
            assert!(packs <= push_launch(packs, false, None).1 as u64, "{packs}: no cluster launch");
            continue;
        };
        assert!((2..=MAX_CLUSTER_BLOCKS).contains(&c.blocks_per_cluster), "{packs}: {c:?}");
        assert!(c.threads % 32 == 0 && c.threads <= FUSED_MAX_THREADS, "{packs}: {c:?}");
        // The kernel's slice (cluster_shape_check): one pack per
        // thread, and the cluster's slices cover the row.
        let slice = c.slice_packs(packs) as u64;
        assert!(slice <= c.threads as u64, "{packs}: {c:?}");
        assert!(slice * c.blocks_per_cluster as u64 >= packs, "{packs}: {c:?}");
    }
}
