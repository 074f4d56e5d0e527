//! TwoShotPull (vLLM's two-stage kernel): reduce-scatter by reads, then
//! all-gather by reads.
//!
//! ```text
//!   packs cut into N slices; rank r owns slice r
//!   [start]  rank r: tmp_r[j] = sum_p in_p[slice r][j]      (reads (N-1)/N·S)
//!   [mid]    rank r: out[slice s][j] = tmp_s[j] for all s   (reads (N-1)/N·S)
//!   [end]    nobody reads tmp_r or in_r any more
//! ```
//! Two dependent hops, 2(N-1)/N·S read per rank. Each slice is reduced by
//! exactly one rank and copied by the others, so all ranks are bitwise
//! identical. The pack -> (block, thread) mapping inside a slice is the same
//! in both phases, so block b reads in the gather exactly what block b of the
//! owner wrote before the mid barrier they share.
//!
//! `output` may alias this rank's input: peers stop reading inputs at the mid
//! barrier, before any rank writes its output.

use super::gather::load_all;
use super::grid_stride;
use super::one_shot_pull::{reduce_pack_over_ranks, resolve_peer_inputs};
use super::pack::{aligned16, store_pack, Element};
use super::ptx;
use super::sync::Ctx;
use crate::dtype_entry_points;
use crate::for_each_rank;
use crate::ids::{AlgorithmId, DeviceErrorCode, Phase};
use crate::layout::{DeviceHandle, PeerPointers};
use crate::partition::{div_ceil, elems_in_pack, even_part, PACK};

#[inline(always)]
unsafe fn two_shot_pull<E: Element>(
    handle: *const DeviceHandle,
    peer_inputs: *const PeerPointers,
    peer_offset: u64,
    output: *mut u8,
    count: u64,
) {
    let mut ctx = Ctx::new(handle, AlgorithmId::TwoShotPull);
    if !ctx.begin() {
        return;
    }
    let Some(ins) = resolve_peer_inputs(&ctx, peer_inputs, peer_offset) else {
        if ctx.tid == 0 {
            ctx.record_error(DeviceErrorCode::UnregisteredBuffer, Phase::Prologue, u32::MAX, 0, 0, 0);
        }
        return;
    };
    let layout = &ctx.h.scratch_layout;
    let lanes = E::LANES as u64;
    let packs = div_ceil(count, lanes);
    let world = ctx.world as u64;
    if div_ceil(packs, world) > layout.two_shot_pull_packs {
        if ctx.tid == 0 {
            ctx.bad_launch(packs as u32);
        }
        return;
    }
    let local = ctx.local();
    ctx.epoch = (*local).barrier_epoch[ctx.block as usize].wrapping_add(1);

    if !ctx.barrier(Phase::Start) {
        return;
    }

    // Reduce-scatter: this rank's slice, from every rank's input.
    let mut inputs_aligned = true;
    for_each_rank!(P => {
        if (P as u32) < ctx.world {
            inputs_aligned &= aligned16(ins[P]);
        }
    });
    let tmp_offset = layout.two_shot_pull_offset;
    let my_tmp = ctx.scratch(ctx.rank).add(tmp_offset as usize);
    let (slice_start, slice_len) = even_part(packs, world, ctx.rank as u64);
    let (first, stride) = grid_stride();
    let mut j = first;
    while j < slice_len {
        let pack = slice_start + j;
        let valid = elems_in_pack(count, lanes, pack);
        let vector = inputs_aligned && valid == lanes;
        let sum = reduce_pack_over_ranks::<E>(ctx.world, &ins, pack, valid, vector);
        // Lanes past `valid` are zero; tmp is always aligned.
        ptx::st_global_v4_u32(my_tmp.add((j * PACK) as usize) as *mut u32, sum);
        j += stride;
    }

    // Mid: every slice is reduced; nobody reads inputs after this point.
    if !ctx.barrier(Phase::Mid) {
        return;
    }

    // All-gather: every slice from its owner's tmp, all owners' loads in
    //    flight together. (Lanes past an owner's slice read unused tmp.)
    let out_aligned = aligned16(output as u64);
    // Slice p is packs [p * size, min((p + 1) * size, packs)).
    let size = div_ceil(packs, world);
    let longest = if packs < size { packs } else { size };
    let mut j = first;
    while j < longest {
        let values = load_all(ctx.world, |owner| ctx.scratch(owner).add((tmp_offset + j * PACK) as usize) as *const u8);
        for_each_rank!(P => {
            let start = P as u64 * size;
            if (P as u32) < ctx.world && start + j < packs {
                let pack = start + j;
                let valid = elems_in_pack(count, lanes, pack);
                store_pack::<E>(output, pack, valid, out_aligned && valid == lanes, &values[P]);
            }
        });
        j += stride;
    }

    // End: nobody reads this rank's tmp any more; the next call may refill it.
    if !ctx.barrier(Phase::End) {
        return;
    }
    if ctx.tid == 0 {
        (*local).barrier_epoch[ctx.block as usize] = ctx.epoch;
    }
}

dtype_entry_points!(
    two_shot_pull,
    two_shot_pull_f32,
    two_shot_pull_f16,
    two_shot_pull_bf16,
    (handle: *const DeviceHandle, peer_inputs: *const PeerPointers, peer_offset: u64, output: *mut u8, count: u64)
);
