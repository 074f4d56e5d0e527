//! TwoShotPush: reduce-scatter by writes, then all-gather by writes.
//!
//! ```text
//!   packs cut into N slices (rank j owns slice j); each slice cut into one
//!   part per block; block b of every rank handles part b of every slice.
//!   call e, parity = e % 2, rank r, block b:
//!   1. scatter: for p = r+1, r+2, ... (staggered): write in[slice p][part b]
//!               to scatter[parity][b][src=r] of rank p             (N-1)/N·S
//!      [flag PushScatter with every rank]
//!   2. reduce:  v = sum over src 0..N-1 of scatter[parity][b][src]  (rank order)
//!               write v to gather[parity][b][src=r] of every rank p (staggered)
//!               and to out[slice r][part b]                         (N-1)/N·S
//!      [flag PushGather with every rank]
//!   3. copy:    out[slice p][part b] = gather[parity][b][src=p] for p != r
//! ```
//! Only posted writes cross the fabric; the staggered order gives each GPU
//! about one outbound and one inbound stream at a time. Minimal bytes:
//! 2(N-1)/N·S per rank.
//!
//! Reuse: call e+2 writes generation `parity` again. A rank reaches step 1 of
//! call e+2 only after the PushGather flags of call e+1 from every rank, so
//! every rank has finished reading generation `parity` of call e. Scratch is
//! striped per block, so only same-index blocks ever interact.
//!
//! `output` may alias the input: each block reads all its input packs in
//! step 1, before it writes any output pack of its own parts.

use super::gather::{load_all, pick_pack, pick_u32, sum_in_order};
use super::pack::{aligned16, load_pack, store_pack, Element, ZERO_PACK};
use super::ptx;
use super::sync::Ctx;
use crate::dtype_entry_points;
use crate::for_each_rank;
use crate::ids::{AlgorithmId, Phase};
use crate::layout::{DeviceHandle, MAX_RANKS};
use crate::partition::{div_ceil, elems_in_pack, even_part};

#[inline(always)]
unsafe fn two_shot_push<E: Element>(handle: *const DeviceHandle, input: *const u8, output: *mut u8, count: u64) {
    let mut ctx = Ctx::new(handle, AlgorithmId::TwoShotPush);
    if !ctx.begin() {
        return;
    }
    let layout = &ctx.h.scratch_layout;
    let lanes = E::LANES as u64;
    let packs = div_ceil(count, lanes);
    let world = ctx.world;
    let rank = ctx.rank;
    let grid = ptx::grid_dim_x();
    let block = ctx.block;
    let largest_part = div_ceil(div_ceil(packs, world as u64), grid as u64);
    if grid > layout.push_blocks || largest_part > layout.two_shot_push_stripe_packs {
        if ctx.tid == 0 {
            ctx.bad_launch(packs as u32);
        }
        return;
    }
    let local = ctx.local();
    let b = block as usize;
    ctx.epoch = (*local).two_shot_push_epoch[b].wrapping_add(1);
    let parity = ctx.epoch % 2;
    let threads = ptx::block_dim_x() as u64;
    let tid = ctx.tid as u64;
    let in_aligned = aligned16(input as u64);
    let out_aligned = aligned16(output as u64);
    // Pack range of (slice s, part b) for every slice, computed once.
    // u32: one launch handles far fewer than 2^32 packs (max_chunk_bytes).
    let mut firsts = [0u32; MAX_RANKS];
    let mut lens = [0u32; MAX_RANKS];
    let mut longest = 0u64;
    for_each_rank!(P => {
        if (P as u32) < world {
            let (slice_start, slice_len) = even_part(packs, world as u64, P as u64);
            let (part_start, part_len) = even_part(slice_len, grid as u64, block as u64);
            firsts[P] = (slice_start + part_start) as u32;
            lens[P] = part_len as u32;
            if part_len > longest {
                longest = part_len;
            }
        }
    });
    let mine = ctx.scratch(rank);

    // 1. Scatter: part b of slice p goes to rank p. Every destination's
    //    pack is loaded before any is stored (one memory latency per step);
    //    destinations are visited from rank+1 on (staggered).
    let mut j = tid;
    while j < longest {
        let mut values = [ZERO_PACK; MAX_RANKS];
        for_each_rank!(P => {
            if (P as u32) < world && j < lens[P] as u64 {
                let pack = firsts[P] as u64 + j;
                let valid = elems_in_pack(count, lanes, pack);
                values[P] = load_pack::<E>(input, pack, valid, in_aligned && valid == lanes);
            }
        });
        for i in 0..world {
            let dst = (rank + 1 + i) % world;
            if j < pick_u32(&lens, dst) as u64 {
                let off = layout.two_shot_push_pack_offset(world, false, parity, block, rank, j);
                ptx::st_global_v4_u32(ctx.scratch(dst).add(off as usize) as *mut u32, pick_pack(&values, dst));
            }
        }
        j += threads;
    }
    // Publishes the scatter writes; acquires every rank's writes to us.
    if !ctx.barrier(Phase::PushScatter) {
        return;
    }

    // 2. Reduce this rank's part, in source rank order, and push it to all.
    let my_first = pick_u32(&firsts, rank) as u64;
    let my_len = pick_u32(&lens, rank) as u64;
    let mut j = tid;
    while j < my_len {
        let parts = load_all(world, |src| {
            mine.add(layout.two_shot_push_pack_offset(world, false, parity, block, src, j) as usize) as *const u8
        });
        let v = sum_in_order::<E>(&parts, world);
        for i in 1..world {
            let dst = (rank + i) % world;
            let off = layout.two_shot_push_pack_offset(world, true, parity, block, rank, j);
            ptx::st_global_v4_u32(ctx.scratch(dst).add(off as usize) as *mut u32, v);
        }
        let pack = my_first + j;
        let valid = elems_in_pack(count, lanes, pack);
        store_pack::<E>(output, pack, valid, out_aligned && valid == lanes, &v);
        j += threads;
    }
    if !ctx.barrier(Phase::PushGather) {
        return;
    }

    // 3. Copy the other ranks' reduced parts into the output (all loads of a
    //    step in flight together).
    let mut j = tid;
    while j < longest {
        let values = load_all(world, |src| {
            mine.add(layout.two_shot_push_pack_offset(world, true, parity, block, src, j) as usize) as *const u8
        });
        for_each_rank!(P => {
            if (P as u32) < world && P as u32 != rank && j < lens[P] as u64 {
                let pack = firsts[P] as u64 + j;
                let valid = elems_in_pack(count, lanes, pack);
                store_pack::<E>(output, pack, valid, out_aligned && valid == lanes, &values[P]);
            }
        });
        j += threads;
    }
    if ctx.tid == 0 {
        (*local).two_shot_push_epoch[b] = ctx.epoch;
    }
}

dtype_entry_points!(
    two_shot_push,
    two_shot_push_f32,
    two_shot_push_f16,
    two_shot_push_bf16,
    (handle: *const DeviceHandle, input: *const u8, output: *mut u8, count: u64)
);
