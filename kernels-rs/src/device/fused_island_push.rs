//! The island push (TwoShotPush, Hierarchical) with the add + RMSNorm
//! epilogue fused (`FusedEpilogue`): the same sentinel protocol, receive
//! region and generation as `island_push.rs` (launches of the plain and the
//! fused kernel interleave freely: each consumes every pack it receives and
//! advances the same generation), but **shares are whole rows** and the
//! phase that finishes a share runs with a **block owning whole rows**, so
//! the owner reduces a row's sum of squares once its packs are final, and
//! the all-gather carries the new residual and the normalised row.
//!
//! ```text
//!   launch n on rank r = member j of island g (n_g members, m islands);
//!   S shares of R = ceil(rows / S) rows (sh = R * row_packs packs; some
//!   shares may be empty); r owns k = j + e n_g, e < owned. Owned rows
//!   q = (e, row of the share) are dealt to blocks: q = b, b + grid, ...;
//!   thread t holds packs c = t + i * threads (i < K) of each.
//!   entry: {abort, generation} (one v4 load); half = generation & 1
//!   A  reduce-scatter (any thread mapping; as island_push):
//!      canonical(in[k_s sh + t]) -> rs_to[s] + half + 16 t
//!   count_block (block barrier; thread 0 counts the block, no wait)
//!   B  (Hierarchical) per owned row, per pack: poll the n_g-1 RS slots,
//!      reset, v = round(sum in member order, own term canonical(in));
//!      partial[i] = v (h.output);  v -> cross_to[o][e] of every other island
//!   F  finish (TwoShotPush: B, Hierarchical: C) per owned row, per pack:
//!      poll (TwoShotPush: the RS slots, own term canonical(in); Hierarchical:
//!      the m-1 cross slots, own term partial[i]), reset, sum in order (f32)
//!      + residual_in; x = canonical(round) -> residual_out, -> ag_to[q] + pos;
//!      s += x^2; block_sum(s) (bar.red.or: also carries "a thread gave up");
//!      y = canonical(round(x * inv_rms * w)) -> normed, -> ag_to[q] + pos + N
//!   D  all-gather: each send s, t: poll ag_from[s] + half + 16 t, reset,
//!      -> residual_out; with RMSNorm also + N -> normed
//!      (pos = half + 16 (e cap + t), N = normed_slot_bytes)
//!   finish_generation (the last block stores gen + 1)
//! ```
//!
//! Semantics: the owner of a share adds *its* `residual_in` and `weight`,
//! and every other rank copies the result, so ranks must pass the same
//! residual and weight (tensor parallelism does); the one-shot kernels add
//! each rank's own.
//!
//! Ordering: `island_push.rs`'s argument, slot by slot (each all-gather
//! position now holds two packs, each written only by its owner and read
//! and reset only by its receiver, once per launch). The phasing rule
//! holds: B waits only on A, F on A (TwoShotPush) or B (Hierarchical), D on
//! F, and every block runs B over all its rows before F. The epilogue adds
//! rank-local accesses only:
//! * B and F deal rows to blocks and packs to threads identically, so the
//!   partial a thread writes in B it reads back in F (program order).
//! * In place, `normed` = `input`: a pack of an owned row is read (own term)
//!   and written (partial, normed) only by the thread that owns it in B/F,
//!   in that order; phase A reads only the shares owned elsewhere, and the
//!   phase-D store of such a pack causally follows this rank's phase-A read
//!   of it (the value travelled to its owner and back). Likewise
//!   `residual_out` = `residual_in`: read only in F by the pack's thread,
//!   which then writes it; D writes only rows owned elsewhere, whose
//!   residual this rank never reads. The partials live in `normed` or,
//!   without RMSNorm, in `input` (which `all_reduce_add` consumes): both
//!   are written only for owned rows, in B, by the thread that read them.
//! * The row's sum of squares: the block barrier of `block_sum`.
//!
//! Ranks agree bitwise: each share is finished by its owner (Hierarchical:
//! identically by every island's owner, the same partials in island order,
//! the same block size) and copied elsewhere; outputs are canonicalised
//! like every payload, on the owner too.
//!
//! A wait that gives up makes its thread skip its remaining packs; with
//! RMSNorm the block leaves together at the next row's barrier (B has no
//! barrier; F's first row has one), the failing threads record it.

use super::epilogue::{block_sum, inv_rms, normalise, sum_squares};
use super::island_push::{first_send_pack, gather_sends, pick_owned, poll_terms, reduce_scatter_sends, NEG_ZERO_ACC};
use super::pack::{aligned16, load_pack, store_pack, Element, ZERO_PACK};
use super::ptx;
use super::sentinel::{self, Stall};
use crate::ids::{AlgorithmId, Phase};
use crate::layout::ErrorRecord;
use crate::params::{
    Control, FusedIslandPushParams, RegionId, EPILOGUE_NORM, EPILOGUE_WEIGHT_OFFSET, FUSED_PACKS_PER_THREAD,
};
use crate::shares::MAX_ISLANDS;
use crate::{for_each_rank, for_each_row_pack};

/// Packs per thread per row (the host keeps `row_packs <= K * threads`).
const K: usize = FUSED_PACKS_PER_THREAD as usize;

/// The kernel body. `CROSS`: Hierarchical (phases A, B, F = C, D);
/// otherwise TwoShotPush (A, F = B, D).
#[inline(always)]
#[allow(unused_comparisons)] // `S >= 0` in the first send group
unsafe fn fused_island_push<E: Element, const CROSS: bool>(p: FusedIslandPushParams) {
    let control = p.push.h.control as *mut Control;
    let region = if CROSS { RegionId::Hierarchical } else { RegionId::TwoShotPush };
    let algorithm = if CROSS { AlgorithmId::Hierarchical } else { AlgorithmId::TwoShotPush };

    // ---- Entry: the control words (the first input packs follow in A).
    let (abort, generation) = sentinel::entry(control, region);
    // u32 pack and row indices: the host keeps a launch within the receive
    // region (far below 2^32 packs).
    let row_packs = p.epilogue.hidden / E::LANES as u32;
    let rows = p.epilogue.rows;
    let count = p.push.h.count;
    let packs = rows * row_packs;
    let share_rows = rows.div_ceil(p.push.shares);
    let sh = share_rows * row_packs;
    let threads = ptx::block_dim_x();
    let first = ptx::block_idx_x() * threads + ptx::thread_idx_x();
    let stride = ptx::grid_dim_x() * threads;
    let input = p.push.h.input as *const u8;
    let vin = aligned16(p.push.h.input);
    let half = (generation & 1) as u64 * p.push.h.half_bytes;

    // ---- A: reduce-scatter (island_push's phase A over whole-row shares).
    let mut t = first;
    let mut next = first_send_pack!(E, p.push, t, sh, packs, input, count, vin);
    while t < sh {
        let off = ptx::opaque_u64(half + 16 * t as u64);
        reduce_scatter_sends!(E, p.push, t, sh, packs, off, input, count, vin, abort, next);
        t += stride;
        if t < sh {
            next = first_send_pack!(E, p.push, t, sh, packs, input, count, vin);
        }
    }

    // ---- Generation: block barrier (block-uniform stop on abort), the block
    //      counted; the last block of the launch advances it at the end
    //      (`finish_generation`: the count's answer stays off the polls).
    let (aborted, block_count) = sentinel::count_block(control, region, abort != 0, true);
    if aborted {
        return; // not counted: nothing to finish
    }

    // Every wait may be on a peer that has not launched the call yet
    // (directly or through the shares it forwards): the launch bound.
    let timeout = p.push.h.launch_timeout_ns;
    let (members, j, cap) = (p.push.members, p.push.member_index, p.push.share_cap);
    let others = members - 1;
    let lanes = E::LANES as u64;
    let norm = p.epilogue.flags & EPILOGUE_NORM != 0;
    let offset = p.epilogue.flags & EPILOGUE_WEIGHT_OFFSET != 0;
    let (residual_in, residual_out) = (p.epilogue.residual_in as *const u8, p.epilogue.residual_out as *mut u8);
    let (weight, normed) = (p.epilogue.weight as *const u8, p.epilogue.normed as *mut u8);
    let vector_residual = aligned16(residual_in as u64) && aligned16(residual_out as u64);
    let vector_norm = aligned16(weight as u64) && aligned16(normed as u64);
    let partials = p.push.h.output as *mut u8;
    let vector_partial = aligned16(p.push.h.output);
    let cross_half = (generation & 1) as u64 * p.push.cross_half_bytes;
    let tid = ptx::thread_idx_x();
    let owned_rows = p.push.owned * share_rows;
    let scratch = ptx::reduction_scratch();
    let mut parity = 0u32;
    let mut stall: Option<(Stall, Phase, u32)> = None;
    'kernel: {
        // ---- B (Hierarchical): island partials of the owned rows (member
        //      order), kept in `partials`, then to the other islands' owners.
        if CROSS {
            let mut q = ptx::block_idx_x();
            while q < owned_rows {
                let (e, r) = (q / share_rows, q % share_rows);
                let row = (j + e * members) * share_rows + r;
                for_each_row_pack!(KI => {
                    let c = tid + KI as u32 * threads;
                    if row < rows && c < row_packs && stall.is_none() {
                        'pack: {
                            let i = (row * row_packs + c) as u64;
                            let t = r * row_packs + c;
                            let mine = E::canonicalise(load_pack::<E>(input, i, lanes, vin));
                            let off = ptx::opaque_u64(half + 16 * (e as u64 * cap + t as u64));
                            let mut acc = NEG_ZERO_ACC;
                            poll_terms!(E, control, timeout, acc, mine, others, j, [0, 1, 2, 3],
                                Q => p.push.rs_from[Q] + off, p.push.rs_abort[Q], p.push.rs_peer[Q],
                                |s, peer| {
                                    stall = Some((s, Phase::RsPayload, peer));
                                    break 'pack;
                                });
                            let v = E::canonicalise(E::round(&acc));
                            store_pack::<E>(partials, i, lanes, vector_partial, &v);
                            let cross = ptx::opaque_u64(cross_half + 16 * t as u64);
                            for_each_rank!(O => {
                                if O < MAX_ISLANDS - 1 && (O as u32) + 1 < p.push.islands {
                                    let to = pick_owned!(p.push.cross_to[O % (MAX_ISLANDS - 1)], e) + cross;
                                    ptx::st_relaxed_sys_v4_u32(to as *mut u32, v);
                                }
                            });
                        }
                    }
                });
                q += ptx::grid_dim_x();
            }
            if !norm && stall.is_some() {
                break 'kernel;
            }
        }

        // ---- F: the final rows (TwoShotPush: B, member order; Hierarchical:
        //      C, island order), + residual, RMSNorm, to every other member.
        let mut q = ptx::block_idx_x();
        while q < owned_rows {
            let (e, r) = (q / share_rows, q % share_rows);
            let row = (j + e * members) * share_rows + r;
            // Block-uniform: a share's last rows may lie past `rows`.
            if row < rows {
                let mut kept = [ZERO_PACK; K];
                let mut weights = [ZERO_PACK; K];
                let mut squares = 0.0f32;
                for_each_row_pack!(KI => {
                    let c = tid + KI as u32 * threads;
                    if c < row_packs && stall.is_none() {
                        'pack: {
                            let i = (row * row_packs + c) as u64;
                            let pos = e as u64 * cap + (r * row_packs + c) as u64;
                            let off = ptx::opaque_u64(half + 16 * pos);
                            // Residual and weight are issued before the polls.
                            let residual = load_pack::<E>(residual_in, i, lanes, vector_residual);
                            if norm {
                                weights[KI] = load_pack::<E>(weight, c as u64, lanes, vector_norm);
                            }
                            let mut acc = NEG_ZERO_ACC;
                            if CROSS {
                                let partial = load_pack::<E>(partials, i, lanes, vector_partial);
                                let cross = ptx::opaque_u64(cross_half + 16 * pos);
                                poll_terms!(E, control, timeout, acc, partial, p.push.islands - 1, p.push.island, [0, 1],
                                    O => p.push.cross_from[O % MAX_ISLANDS] + cross,
                                    pick_owned!(opaque p.push.cross_abort[O % (MAX_ISLANDS - 1)], e),
                                    pick_owned!(opaque p.push.cross_peer[O % (MAX_ISLANDS - 1)], e),
                                    |s, peer| {
                                        stall = Some((s, Phase::CrossPayload, peer));
                                        break 'pack;
                                    });
                            } else {
                                let mine = E::canonicalise(load_pack::<E>(input, i, lanes, vin));
                                poll_terms!(E, control, timeout, acc, mine, others, j, [0, 1, 2, 3],
                                    Q => p.push.rs_from[Q] + off, p.push.rs_abort[Q], p.push.rs_peer[Q],
                                    |s, peer| {
                                        stall = Some((s, Phase::RsPayload, peer));
                                        break 'pack;
                                    });
                            }
                            E::accumulate(&mut acc, &residual);
                            let x = E::canonicalise(E::round(&acc));
                            store_pack::<E>(residual_out, i, lanes, vector_residual, &x);
                            for_each_rank!(Q => {
                                if (Q as u32) < others {
                                    ptx::st_relaxed_sys_v4_u32((p.push.ag_to[Q] + off) as *mut u32, x);
                                }
                            });
                            kept[KI] = x;
                            squares += sum_squares::<E>(&x);
                        }
                    }
                });
                if norm {
                    let (total, stop) = block_sum(squares, stall.is_some(), scratch, parity);
                    if stop {
                        break 'kernel;
                    }
                    let inv = inv_rms(total, p.epilogue.hidden, p.epilogue.eps);
                    for_each_row_pack!(KI => {
                        let c = tid + KI as u32 * threads;
                        if c < row_packs {
                            let i = (row * row_packs + c) as u64;
                            let pos = e as u64 * cap + (r * row_packs + c) as u64;
                            let off = ptx::opaque_u64(half + 16 * pos + p.normed_slot_bytes);
                            let y = E::canonicalise(normalise::<E>(&kept[KI], &weights[KI], inv, offset));
                            store_pack::<E>(normed, i, lanes, vector_norm, &y);
                            for_each_rank!(Q => {
                                if (Q as u32) < others {
                                    ptx::st_relaxed_sys_v4_u32((p.push.ag_to[Q] + off) as *mut u32, y);
                                }
                            });
                        }
                    });
                    parity ^= 1;
                } else if stall.is_some() {
                    break 'kernel;
                }
            }
            q += ptx::grid_dim_x();
        }

        // ---- D: all-gather of the rows owned elsewhere in the island: the
        //      new residual, then (RMSNorm) the normalised rows.
        // The residual packs at a position's offset, the normalised ones
        // `normed_slot_bytes` further on (one expansion per target).
        macro_rules! gather_into {
            ($t:expr, $extra:expr, $base:expr, $vector:expr) => {
                let off = ptx::opaque_u64(half + 16 * $t as u64 + $extra);
                gather_sends!(
                    p.push,
                    control,
                    timeout,
                    $t,
                    sh,
                    packs,
                    off,
                    |i, w| store_pack::<E>($base, i as u64, lanes, $vector, &w),
                    |s, peer| {
                        stall = Some((s, Phase::AgPayload, peer));
                        break 'kernel;
                    }
                );
            };
        }
        let mut t = first;
        while t < sh {
            gather_into!(t, 0, residual_out, vector_residual);
            if norm {
                gather_into!(t, p.normed_slot_bytes, normed, vector_norm);
            }
            t += stride;
        }
    }
    sentinel::finish_generation(control, region, generation, block_count, true);
    if let Some((s, phase, peer)) = stall {
        let record = p.push.h.error_record as *mut ErrorRecord;
        sentinel::give_up_at(
            control,
            p.push.h.abort as *mut u32,
            record,
            algorithm,
            phase,
            p.push.h.rank,
            peer,
            generation,
            s,
        );
    }
}

macro_rules! fused_island_push_entries {
    ($cross:literal, $f32:ident, $f16:ident, $bf16:ident) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f32(p: FusedIslandPushParams) {
            fused_island_push::<super::pack::F32, $cross>(p)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f16(p: FusedIslandPushParams) {
            fused_island_push::<super::pack::F16, $cross>(p)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $bf16(p: FusedIslandPushParams) {
            fused_island_push::<super::pack::Bf16, $cross>(p)
        }
    };
}

fused_island_push_entries!(false, fused_two_shot_push_f32, fused_two_shot_push_f16, fused_two_shot_push_bf16);
fused_island_push_entries!(true, fused_hierarchical_f32, fused_hierarchical_f16, fused_hierarchical_bf16);
