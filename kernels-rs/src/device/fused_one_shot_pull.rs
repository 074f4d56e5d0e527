//! OneShotPull with the add + RMSNorm epilogue fused (`FusedEpilogue`):
//! after the start barrier every rank reads every rank's input, a block
//! owning whole rows, and finishes each row locally.
//!
//! ```text
//!   rank r, block b owns rows b, b + grid, ...; thread t packs j = t + k * threads (k < K):
//!     [start barrier]
//!     per row: y = sum over ranks of in_p[row, j] (rank order, f32) + residual_in[row, j]
//!              residual_out = round(y); s += x^2;  block_sum(s);  normed = round(x * inv_rms * w)
//!     [end barrier]   (peers finished reading in_r; it may be reused or overwritten)
//! ```
//!
//! The same data movement, barriers and block epochs as `one_shot_pull.rs`
//! (phases Start and End, `barrier_epoch[block]`), so launches of either
//! kernel interleave. Every rank launches the same grid for the same call.
//! The host stages the input when `normed` overlaps it (peers read the
//! input until the end barrier). Any pointer may be misaligned (a view
//! with an offset, on any rank): its packs then go element by element, so
//! every rank launches this kernel for the same calls whatever its
//! pointers (the start and end barriers pair blocks across ranks).

use super::epilogue::{block_rows, block_sum, inv_rms, normalise, sum_squares};
use super::one_shot_pull::{all_aligned, resolve_peer_inputs};
use super::pack::{aligned16, load_pack, store_pack, Element, Pack, ZERO_PACK};
use super::ptx;
use super::sync::Ctx;
use crate::ids::{AlgorithmId, DeviceErrorCode, Phase};
use crate::layout::{DeviceHandle, PeerPointers, MAX_RANKS};
use crate::params::{EPILOGUE_NORM, EPILOGUE_WEIGHT_OFFSET, FUSED_PACKS_PER_THREAD};
use crate::{for_each_rank, for_each_row_pack};

/// Packs per thread per row (the host keeps `row_packs <= K * threads`).
const K: usize = FUSED_PACKS_PER_THREAD as usize;

/// `residual_out` of pack `pack`: every rank's term in rank order plus the
/// residual, in f32, rounded once.
#[inline(always)]
unsafe fn add_pack_over_ranks<E: Element>(
    world: u32,
    ins: &[u64; MAX_RANKS],
    pack: u64,
    vector: bool,
    residual: &Pack,
) -> Pack {
    let lanes = E::LANES as u64;
    // Every rank's load in flight before the first add.
    let mut loaded = [ZERO_PACK; MAX_RANKS];
    for_each_rank!(P => {
        if (P as u32) < world {
            loaded[P] = load_pack::<E>(ins[P] as *const u8, pack, lanes, vector);
        }
    });
    let mut acc = E::to_acc(&loaded[0]);
    for_each_rank!(P => {
        if P > 0 && (P as u32) < world {
            E::accumulate(&mut acc, &loaded[P]);
        }
    });
    E::accumulate(&mut acc, residual);
    E::round(&acc)
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn fused_one_shot_pull<E: Element>(
    handle: *const DeviceHandle,
    peer_inputs: *const PeerPointers,
    peer_offset: u64,
    residual_in: u64,
    residual_out: u64,
    weight: u64,
    normed: u64,
    rows: u32,
    hidden: u32,
    eps: f32,
    flags: u32,
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
    let row_packs = hidden as u64 / lanes;
    // Rows are whole packs (host-checked), so a pointer's alignment is that
    // of every row in it; misaligned views go element by element.
    let vector_in = all_aligned(ctx.world, &ins, 0);
    let vector_residual = aligned16(residual_in) && aligned16(residual_out);
    let vector_norm = aligned16(weight) && aligned16(normed);
    let norm = flags & EPILOGUE_NORM != 0;
    let offset = flags & EPILOGUE_WEIGHT_OFFSET != 0;
    let tid = ctx.tid as u64;
    let threads = ptx::block_dim_x() as u64;
    let scratch = ptx::reduction_scratch();
    let (first_row, row_stride) = block_rows();
    let mut parity = 0u32;
    let mut row = first_row;
    while row < rows as u64 {
        let mut kept = [ZERO_PACK; K];
        let mut squares = 0.0f32;
        for_each_row_pack!(KI => {
            let j = tid + KI as u64 * threads;
            if j < row_packs {
                let pack = row * row_packs + j;
                let residual = load_pack::<E>(residual_in as *const u8, pack, lanes, vector_residual);
                let out = add_pack_over_ranks::<E>(ctx.world, &ins, pack, vector_in, &residual);
                store_pack::<E>(residual_out as *mut u8, pack, lanes, vector_residual, &out);
                kept[KI] = out;
                squares += sum_squares::<E>(&out);
            }
        });
        if norm {
            // Block-uniform: `norm` is a parameter, the row loop is uniform.
            let (total, _) = block_sum(squares, false, scratch, parity);
            let inv = inv_rms(total, hidden, eps);
            for_each_row_pack!(KI => {
                let j = tid + KI as u64 * threads;
                if j < row_packs {
                    let w = load_pack::<E>(weight as *const u8, j, lanes, vector_norm);
                    let out = normalise::<E>(&kept[KI], &w, inv, offset);
                    store_pack::<E>(normed as *mut u8, row * row_packs + j, lanes, vector_norm, &out);
                }
            });
            parity ^= 1;
        }
        row += row_stride;
    }

    // End: no rank still reads this rank's input when the kernel returns.
    if !ctx.barrier(Phase::End) {
        return;
    }
    if ctx.tid == 0 {
        (*local).barrier_epoch[ctx.block as usize] = ctx.epoch;
    }
}

macro_rules! fused_one_shot_pull_entries {
    ($($name:ident => $elem:ty),* $(,)?) => {$(
        #[no_mangle]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            handle: *const DeviceHandle,
            peer_inputs: *const PeerPointers,
            peer_offset: u64,
            residual_in: u64,
            residual_out: u64,
            weight: u64,
            normed: u64,
            rows: u32,
            hidden: u32,
            eps: f32,
            flags: u32,
        ) {
            fused_one_shot_pull::<$elem>(
                handle, peer_inputs, peer_offset, residual_in, residual_out, weight, normed, rows, hidden, eps, flags,
            )
        }
    )*};
}

fused_one_shot_pull_entries!(
    fused_one_shot_pull_f32 => super::pack::F32,
    fused_one_shot_pull_f16 => super::pack::F16,
    fused_one_shot_pull_bf16 => super::pack::Bf16,
);
