//! Hierarchical: for machines split into islands (PCIe switches, CPU
//! sockets). Reduce inside each island, exchange one share across islands,
//! gather inside islands — all by posted writes.
//!
//! ```text
//!   I islands of m ranks; rank (g, i) = member i of island g.
//!   packs cut into m shares (member i owns share i), each share into one
//!   part per block. call e, parity = e % 2, block b of rank (g, i):
//!   1. island scatter: share k part b of the input -> scatter[par][b][src=i]
//!      of (g, k), for every member k (staggered)       [flag HierScatter, island]
//!   2. island reduce:  p = sum_k scatter[..][k] (member order), rounded;
//!      p -> cross[par][b][src=g] of (g', i) for every island g'
//!                                                    [flag HierCross, counterparts]
//!   3. cross reduce:   s = sum_g' cross[..][g'] (island order), rounded;
//!      s -> gather[par][b][src=i] of (g, k) for every member k, and out
//!                                                    [flag HierGather, island]
//!   4. copy gather[..][k] -> out[share k][part b] for k != i
//! ```
//! Bytes across the island boundary per rank: (I-1)/m·S (a 4+4 split of
//! 42 KB: ~10.5 KB per rank, 42 KB per direction in total, vs ~172 KB for a
//! flat two-shot). Three dependent hops. Each share is finished identically
//! on every island (same island order), so ranks are bitwise identical;
//! f16/bf16 carry two roundings (the island partial and the final sum).
//! Reuse of generation `parity` is safe for the same reason as TwoShotPush:
//! reaching call e+2 requires every group's flags of call e+1.

use super::gather::{load_all, pick_pack, pick_u32, sum_in_order};
use super::pack::{aligned16, load_pack, store_pack, Element, ZERO_PACK};
use super::ptx;
use super::sync::Ctx;
use crate::dtype_entry_points;
use crate::for_each_rank;
use crate::ids::{AlgorithmId, Phase};
use crate::layout::{DeviceHandle, MAX_RANKS};
use crate::partition::{div_ceil, elems_in_pack, even_part};

const SCATTER: u32 = 0;
const CROSS: u32 = 1;
const GATHER: u32 = 2;

#[inline(always)]
unsafe fn hierarchical<E: Element>(handle: *const DeviceHandle, input: *const u8, output: *mut u8, count: u64) {
    let mut ctx = Ctx::new(handle, AlgorithmId::Hierarchical);
    if !ctx.begin() {
        return;
    }
    let layout = &ctx.h.scratch_layout;
    let islands = &ctx.h.islands;
    let m = islands.island_size;
    let n_islands = islands.island_count;
    let g = islands.my_island;
    let i = islands.my_index;
    let lanes = E::LANES as u64;
    let packs = div_ceil(count, lanes);
    let grid = ptx::grid_dim_x();
    let block = ctx.block;
    let largest_part = div_ceil(div_ceil(packs, m as u64), grid as u64);
    if n_islands < 2
        || m < 2
        || n_islands != layout.island_count
        || m != layout.island_size
        || grid > layout.push_blocks
        || largest_part > layout.hierarchical_stripe_packs
    {
        if ctx.tid == 0 {
            ctx.bad_launch(packs as u32);
        }
        return;
    }
    let member = |island: u32, index: u32| islands.members[island as usize][index as usize] as u32;
    let local = ctx.local();
    let b = block as usize;
    ctx.epoch = (*local).hierarchical_epoch[b].wrapping_add(1);
    let parity = ctx.epoch % 2;
    let threads = ptx::block_dim_x() as u64;
    let tid = ctx.tid as u64;
    let in_aligned = aligned16(input as u64);
    let out_aligned = aligned16(output as u64);
    // Pack range of (share k, part b) for every island member k.
    // u32: one launch handles far fewer than 2^32 packs (max_chunk_bytes).
    let mut firsts = [0u32; MAX_RANKS];
    let mut lens = [0u32; MAX_RANKS];
    let mut longest = 0u64;
    for_each_rank!(P => {
        if (P as u32) < m {
            let (share_start, share_len) = even_part(packs, m as u64, P as u64);
            let (part_start, part_len) = even_part(share_len, grid as u64, block as u64);
            firsts[P] = (share_start + part_start) as u32;
            lens[P] = part_len as u32;
            if part_len > longest {
                longest = part_len;
            }
        }
    });
    let mine = ctx.scratch(ctx.rank);

    // 1. Island scatter: share k part b to member k (loads first, stores
    //    staggered from member i+1).
    let mut j = tid;
    while j < longest {
        let mut values = [ZERO_PACK; MAX_RANKS];
        for_each_rank!(P => {
            if (P as u32) < m && j < lens[P] as u64 {
                let pack = firsts[P] as u64 + j;
                let valid = elems_in_pack(count, lanes, pack);
                values[P] = load_pack::<E>(input, pack, valid, in_aligned && valid == lanes);
            }
        });
        for step in 0..m {
            let k = (i + 1 + step) % m;
            if j < pick_u32(&lens, k) as u64 {
                let off = layout.hierarchical_pack_offset(SCATTER, parity, block, i, j);
                ptx::st_global_v4_u32(ctx.scratch(member(g, k)).add(off as usize) as *mut u32, pick_pack(&values, k));
            }
        }
        j += threads;
    }
    if !ctx.barrier_among(Phase::HierScatter, m, |t| member(g, t)) {
        return;
    }

    // 2. Island reduce of share i (member order), then to the counterparts
    //    of every island.
    let my_first = pick_u32(&firsts, i) as u64;
    let my_len = pick_u32(&lens, i) as u64;
    let mut j = tid;
    while j < my_len {
        let parts = load_all(m, |k| {
            mine.add(layout.hierarchical_pack_offset(SCATTER, parity, block, k, j) as usize) as *const u8
        });
        let partial = sum_in_order::<E>(&parts, m);
        for step in 0..n_islands {
            let other = (g + 1 + step) % n_islands;
            let off = layout.hierarchical_pack_offset(CROSS, parity, block, g, j);
            ptx::st_global_v4_u32(ctx.scratch(member(other, i)).add(off as usize) as *mut u32, partial);
        }
        j += threads;
    }
    if !ctx.barrier_among(Phase::HierCross, n_islands, |t| member(t, i)) {
        return;
    }

    // 3. Cross reduce (island order), then to every island member and out.
    let mut j = tid;
    while j < my_len {
        let parts = load_all(n_islands, |o| {
            mine.add(layout.hierarchical_pack_offset(CROSS, parity, block, o, j) as usize) as *const u8
        });
        let total = sum_in_order::<E>(&parts, n_islands);
        for step in 1..m {
            let k = (i + step) % m;
            let off = layout.hierarchical_pack_offset(GATHER, parity, block, i, j);
            ptx::st_global_v4_u32(ctx.scratch(member(g, k)).add(off as usize) as *mut u32, total);
        }
        let pack = my_first + j;
        let valid = elems_in_pack(count, lanes, pack);
        store_pack::<E>(output, pack, valid, out_aligned && valid == lanes, &total);
        j += threads;
    }
    if !ctx.barrier_among(Phase::HierGather, m, |t| member(g, t)) {
        return;
    }

    // 4. Copy the other members' shares (all loads in flight together).
    let mut j = tid;
    while j < longest {
        let values = load_all(m, |k| {
            mine.add(layout.hierarchical_pack_offset(GATHER, parity, block, k, j) as usize) as *const u8
        });
        for_each_rank!(P => {
            if (P as u32) < m && P as u32 != i && j < lens[P] as u64 {
                let pack = firsts[P] as u64 + j;
                let valid = elems_in_pack(count, lanes, pack);
                store_pack::<E>(output, pack, valid, out_aligned && valid == lanes, &values[P]);
            }
        });
        j += threads;
    }
    if ctx.tid == 0 {
        (*local).hierarchical_epoch[b] = ctx.epoch;
    }
}

dtype_entry_points!(
    hierarchical,
    hierarchical_f32,
    hierarchical_f16,
    hierarchical_bf16,
    (handle: *const DeviceHandle, input: *const u8, output: *mut u8, count: u64)
);
