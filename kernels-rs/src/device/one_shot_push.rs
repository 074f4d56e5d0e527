//! OneShotPush: every rank writes its whole message into its own slot of
//! every rank's receive buffer; completion travels in the payload
//! ("Lamport" push, as in TensorRT-LLM / FlashInfer). No barrier at all.
//!
//! ```text
//!   receive buffer of rank d: gen[3] x src[N] x stripe[block] x packs
//!   call e of block b on rank r (slot = e % 3):
//!     1. push:   for p in r+1, r+2, ... (staggered): write canonical(in) to
//!                gen[slot][src=r][b] of rank p         (posted writes, N-1)·S
//!     2. re-arm: fill gen[(e+2)%3][*][b] of rank r with EMPTY (all-ones)
//!     3. poll:   wait until no word of gen[slot][src][b] is EMPTY, for every
//!                src; sum in src order 0..N-1; write out
//! ```
//! Why three generations and re-arming generation e-1 (= e+2 mod 3): a peer
//! writes generation e+2 into this rank only after it received this rank's
//! call-(e+1) payload, which this rank sends only after call e finished (and
//! with it the re-arm). A fast peer may already write generation e+1 while
//! this rank still reads e, which is why e+1 is never the one re-armed.
//!
//! Sentinel: EMPTY is the all-ones word. An input element whose bits are all
//! ones (a NaN) is replaced by the canonical quiet NaN before sending, so no
//! payload word is EMPTY and sums are unchanged (NaN stays NaN; -0.0, Inf,
//! denormals are sent bit-exactly). A 128-bit store may land word by word, so
//! every word is checked. Padding lanes of a tail pack are sent as zero.
//!
//! Scratch is striped per block: block b only ever touches stripe b on every
//! rank, so blocks are independent and the grid may differ between calls.

use super::gather::{poll_all, sum_in_order};
use super::pack::{aligned16, load_pack, store_pack, Element};
use super::ptx;
use super::sync::Ctx;
use crate::dtype_entry_points;
use crate::ids::AlgorithmId;
use crate::layout::{DeviceHandle, LAMPORT_EMPTY_WORD, LAMPORT_SLOTS};
use crate::partition::{div_ceil, elems_in_pack, even_part};

#[inline(always)]
unsafe fn one_shot_push<E: Element>(handle: *const DeviceHandle, input: *const u8, output: *mut u8, count: u64) {
    let mut ctx = Ctx::new(handle, AlgorithmId::OneShotPush);
    if !ctx.begin() {
        return;
    }
    let layout = &ctx.h.scratch_layout;
    let lanes = E::LANES as u64;
    let packs = div_ceil(count, lanes);
    let grid = ptx::grid_dim_x();
    let block = ctx.block;
    let (start, len) = even_part(packs, grid as u64, block as u64);
    if grid > layout.push_blocks || len > layout.one_shot_push_stripe_packs || packs > layout.one_shot_push_max_packs {
        if ctx.tid == 0 {
            ctx.bad_launch(packs as u32);
        }
        return;
    }
    let local = ctx.local();
    let b = block as usize;
    ctx.epoch = (*local).one_shot_push_epoch[b].wrapping_add(1);
    let slot = ctx.epoch % LAMPORT_SLOTS as u32;
    let rearm_slot = (ctx.epoch + 2) % LAMPORT_SLOTS as u32;
    let world = ctx.world;
    let rank = ctx.rank;
    let threads = ptx::block_dim_x() as u64;
    let tid = ctx.tid as u64;
    let vector_in = aligned16(input as u64);

    // 1. Push this block's part to every rank (itself included). Each pack
    //    is loaded once and stored to rank+1, rank+2, ... (staggered, so that
    //    at any moment the ranks target different peers).
    let mut j = tid;
    while j < len {
        let pack = start + j;
        let valid = elems_in_pack(count, lanes, pack);
        let v = E::canonicalise(load_pack::<E>(input, pack, valid, vector_in && valid == lanes));
        let off = layout.one_shot_push_pack_offset(world, slot, rank, block, j);
        for i in 0..world {
            let dst = (rank + 1 + i) % world;
            ptx::st_relaxed_sys_v4_u32(ctx.scratch(dst).add(off as usize) as *mut u32, v);
        }
        j += threads;
    }

    // 2. Re-arm generation e-1 (what this block received there last time).
    let used = (*local).one_shot_push_used[b][rearm_slot as usize] as u64;
    let mine = ctx.scratch(rank);
    for src in 0..world {
        let mut j = tid;
        while j < used {
            let off = layout.one_shot_push_pack_offset(world, rearm_slot, src, block, j);
            ptx::st_global_v4_u32(mine.add(off as usize) as *mut u32, [LAMPORT_EMPTY_WORD; 4]);
            j += threads;
        }
    }
    // No fence here: the re-arm must be performed before a peer writes
    // generation e+2, which it can only do after receiving this rank's call
    // e+1 payload — sent by the next kernel on this rank's stream, which
    // starts only after this kernel (and every store in it) completed. A
    // per-thread `fence.acq_rel.sys` here cost ~3 us per call (measured, 8
    // ranks on one H200; docs/RESULTS.md).

    // 3. Poll every source's pack at once, sum in source rank order
    //    (bitwise identical results on every rank).
    let vector_out = aligned16(output as u64);
    let mut failed = false;
    let mut j = tid;
    while j < len && !failed {
        let polled = poll_all(
            &ctx,
            world,
            |src| mine.add(layout.one_shot_push_pack_offset(world, slot, src, block, j) as usize) as *const u8,
            |src| src,
        );
        match polled {
            Some(packs) => {
                let pack = start + j;
                let valid = elems_in_pack(count, lanes, pack);
                store_pack::<E>(output, pack, valid, vector_out && valid == lanes, &sum_in_order::<E>(&packs, world));
            }
            None => failed = true,
        }
        j += threads;
    }

    if ptx::bar_red_or(failed) {
        return;
    }
    if ctx.tid == 0 {
        (*local).one_shot_push_used[b][slot as usize] = len as u32;
        (*local).one_shot_push_epoch[b] = ctx.epoch;
    }
}

dtype_entry_points!(
    one_shot_push,
    one_shot_push_f32,
    one_shot_push_f16,
    one_shot_push_bf16,
    (handle: *const DeviceHandle, input: *const u8, output: *mut u8, count: u64)
);
