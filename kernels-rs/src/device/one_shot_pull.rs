//! OneShotPull (vLLM's one-stage kernel): after a start barrier every rank
//! reads the whole message from every rank and reduces it locally.
//!
//! ```text
//!   rank r:  [start barrier] --- read in_p[i] for all p, sum in rank order --> out[i]
//!            [end barrier]   (peers finished reading in_r; it may be reused)
//! ```
//! Data movement per rank: (N-1)·S read from peers (non-posted reads: the
//! pattern that saturates PCIe fabrics with 8 GPUs). One hop of latency.
//! Reduction order is rank 0..N-1 on every rank, so results are bitwise
//! identical across ranks.
//!
//! Requirements the host guarantees: `output` does not alias this rank's
//! input (peers read the input until the end barrier); every rank launches
//! the same grid for the same call.

use super::grid_stride;
use super::pack::{aligned16, load_pack, store_pack, Element, Pack, ZERO_PACK};
use super::sync::Ctx;
use crate::dtype_entry_points;
use crate::for_each_rank;
use crate::ids::{AlgorithmId, DeviceErrorCode, Phase};
use crate::layout::{DeviceHandle, PeerPointers, MAX_RANKS};
use crate::partition::{div_ceil, elems_in_pack};

/// Loads `peer_inputs` (+ `offset`) for every rank; `None` if any rank's
/// entry is null (a captured buffer never registered).
#[inline(always)]
pub(crate) unsafe fn resolve_peer_inputs(
    ctx: &Ctx,
    peer_inputs: *const PeerPointers,
    offset: u64,
) -> Option<[u64; MAX_RANKS]> {
    let mut ins = [0u64; MAX_RANKS];
    let mut missing = peer_inputs.is_null();
    if !missing {
        for_each_rank!(P => {
            if (P as u32) < ctx.world {
                let base = (*peer_inputs).ptrs[P];
                missing |= base == 0;
                ins[P] = base + offset;
            }
        });
    }
    if missing {
        None
    } else {
        Some(ins)
    }
}

/// Sum of pack `pack` over all ranks' inputs, rank 0 first.
#[inline(always)]
pub(crate) unsafe fn reduce_pack_over_ranks<E: Element>(
    world: u32,
    ins: &[u64; MAX_RANKS],
    pack: u64,
    valid: u64,
    vector: bool,
) -> Pack {
    // Issue every rank's load before the first add (latency of N peer reads
    // overlaps instead of adding up).
    let mut loaded: [Pack; MAX_RANKS] = [ZERO_PACK; MAX_RANKS];
    for_each_rank!(P => {
        if (P as u32) < world {
            loaded[P] = load_pack::<E>(ins[P] as *const u8, pack, valid, vector);
        }
    });
    let mut acc = E::to_acc(&loaded[0]);
    for_each_rank!(P => {
        if P > 0 && (P as u32) < world {
            E::accumulate(&mut acc, &loaded[P]);
        }
    });
    E::round(&acc)
}

/// True when every rank's input and `output` are 16-byte aligned.
#[inline(always)]
pub(crate) fn all_aligned(world: u32, ins: &[u64; MAX_RANKS], output: u64) -> bool {
    let mut ok = aligned16(output);
    for_each_rank!(P => {
        if (P as u32) < world {
            ok &= aligned16(ins[P]);
        }
    });
    ok
}

#[inline(always)]
unsafe fn one_shot_pull<E: Element>(
    handle: *const DeviceHandle,
    peer_inputs: *const PeerPointers,
    peer_offset: u64,
    output: *mut u8,
    count: u64,
) {
    let mut ctx = Ctx::new(handle, AlgorithmId::OneShotPull);
    if !ctx.begin() {
        return;
    }
    let Some(ins) = resolve_peer_inputs(&ctx, peer_inputs, peer_offset) else {
        if ctx.tid == 0 {
            ctx.record_error(DeviceErrorCode::UnregisteredBuffer, Phase::Prologue, u32::MAX, 0, 0, 0);
        }
        return;
    };
    let local = ctx.local();
    ctx.epoch = (*local).barrier_epoch[ctx.block as usize].wrapping_add(1);

    // Start: every rank's input is ready (its stream reached this kernel).
    if !ctx.barrier(Phase::Start) {
        return;
    }

    let lanes = E::LANES as u64;
    let packs = div_ceil(count, lanes);
    let aligned = all_aligned(ctx.world, &ins, output as u64);
    let (first, stride) = grid_stride();
    let mut pack = first;
    while pack < packs {
        let valid = elems_in_pack(count, lanes, pack);
        let vector = aligned && valid == lanes;
        let sum = reduce_pack_over_ranks::<E>(ctx.world, &ins, pack, valid, vector);
        store_pack::<E>(output, pack, valid, vector, &sum);
        pack += stride;
    }

    // End: no rank still reads this rank's input when the kernel returns.
    if !ctx.barrier(Phase::End) {
        return;
    }
    if ctx.tid == 0 {
        (*local).barrier_epoch[ctx.block as usize] = ctx.epoch;
    }
}

dtype_entry_points!(
    one_shot_pull,
    one_shot_pull_f32,
    one_shot_pull_f16,
    one_shot_pull_bf16,
    (handle: *const DeviceHandle, peer_inputs: *const PeerPointers, peer_offset: u64, output: *mut u8, count: u64)
);
