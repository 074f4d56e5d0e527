//! OneShotPush with the add + RMSNorm epilogue fused (`FusedEpilogue`):
//! the same sentinel protocol, receive region and generation as
//! `one_shot_push.rs` (launches of the two kernels interleave freely: a
//! launch of either consumes every pack it receives and advances the same
//! generation), but a **block owns whole rows** in both phases, so it can
//! reduce a row's sum of squares after the row's packs arrived.
//!
//! ```text
//!   launch n on rank r, block b owns rows b, b + grid, ...;
//!   thread t owns packs j = t + k * threads (k < K) of each of them:
//!     entry:  {abort, generation} + the first row's input packs, together
//!     push:   canonical(in[row, j]) -> every peer's slot, half (gen & 1)
//!     advance_generation (block barrier; the last block stores gen + 1)
//!     per row (block-uniform):
//!       poll + reset on consume, sum in rank order in f32 (own term in place)
//!       y = sum + residual_in; residual_out = round(y); s += x^2 (rounded x)
//!       block_sum(s) (bar.red.or: also carries "a thread gave up")
//!       normed = round(x * inv_rms * w)                  (x, w kept in registers)
//! ```
//!
//! Ordering: exactly OneShotPush's argument (one_shot_push.rs and
//! ARCHITECTURE.md); the epilogue only adds rank-local reads and writes
//! after the poll, ordered by program order (each thread reads and writes
//! the same packs) and, for the row's sum of squares, by the block barrier.
//! `normed` may equal `input`: the thread that overwrites pack (row, j)
//! pushed it and read its own term earlier (the same mapping in both
//! phases), and no other thread reads it. `residual_in` may equal
//! `residual_out` likewise.
//!
//! A wait that gives up makes its thread skip its remaining packs; the
//! block leaves together at the row's barrier (`bar.red.or` of the
//! failure), and the failing threads record it. Without `EPILOGUE_NORM`
//! there is no barrier and a failing thread leaves at once.

use super::epilogue::{block_rows, block_sum, inv_rms, normalise, sum_squares};
use super::pack::{aligned16, any_word_empty, load_pack, store_pack, Acc, Element, Pack, ZERO_PACK};
use super::ptx;
use super::sentinel::{self, Stall};
use crate::ids::AlgorithmId;
use crate::layout::{ErrorRecord, MAX_RANKS, SENTINEL_EMPTY_WORD};
use crate::params::{
    Control, FusedOneShotPushParams, RegionId, EPILOGUE_NORM, EPILOGUE_WEIGHT_OFFSET, FUSED_PACKS_PER_THREAD,
};
use crate::{for_each_rank, for_each_row_pack};

/// Packs per thread per row (the host keeps `row_packs <= K * threads`).
const K: usize = FUSED_PACKS_PER_THREAD as usize;
/// Receive slots polled together (as in OneShotPush).
const POLL_GROUP: usize = 4;
/// See `one_shot_push.rs`: -0.0 is the identity of IEEE addition.
const NEG_ZERO_ACC: Acc = [-0.0; 8];

/// Byte offset of pack `j` of `row` in a `rows x row_packs` message.
#[inline(always)]
fn pack_offset(row: u64, row_packs: u64, j: u64) -> u64 {
    16 * (row * row_packs + j)
}

/// Loads this thread's packs of `row` from `base` (all in flight at once;
/// element by element unless `vector`).
#[inline(always)]
unsafe fn load_row_packs<E: Element>(
    base: u64,
    row: u64,
    row_packs: u64,
    tid: u64,
    threads: u64,
    vector: bool,
) -> [Pack; K] {
    let mut v = [ZERO_PACK; K];
    for_each_row_pack!(KI => {
        let j = tid + KI as u64 * threads;
        if j < row_packs {
            v[KI] = load_pack::<E>(base as *const u8, row * row_packs + j, E::LANES as u64, vector);
        }
    });
    v
}

/// Polls every receive slot of the pack at byte offset `$off` (within the
/// half), resets each after reading it, and sums the world's terms in rank
/// order into an f32 accumulator (`$mine` is this rank's term):
/// `Result<Acc, Stall>`. A macro, not a function: the parameter struct is
/// only ever read with constant offsets where it is used, never borrowed
/// (a reference would make LLVM copy it to local memory).
macro_rules! poll_and_sum {
    ($E:ty, $p:ident, $world:expr, $rank:expr, $off:expr, $mine:expr, $control:expr) => {
        'poll: {
            let mut acc = NEG_ZERO_ACC;
            macro_rules! poll_group {
                ($group:literal) => {
                    let mut got = [ZERO_PACK; MAX_RANKS];
                    for_each_rank!(S => {
                        if S / POLL_GROUP == $group && (S as u32) + 1 < $world {
                            got[S] = ptx::ld_relaxed_sys_v4_u32(($p.push.recv_from[S] + $off) as *const u32);
                        }
                    });
                    for_each_rank!(S => {
                        // The own term before slot `$rank`; the last rank has
                        // no such slot and adds it after the groups.
                        if S / POLL_GROUP == $group && S as u32 == $rank && (S as u32) + 1 < $world {
                            <$E>::accumulate(&mut acc, &$mine);
                        }
                        if S / POLL_GROUP == $group && (S as u32) + 1 < $world {
                            let slot = ($p.push.recv_from[S] + $off) as *mut u32;
                            let mut w = got[S];
                            if any_word_empty(&w) {
                                let abort_word = $p.push.source_abort[S] as *const u32;
                                match sentinel::wait_slot(slot, S as u32, abort_word, $control, $p.push.h.timeout_ns) {
                                    Ok(arrived) => w = arrived,
                                    Err(s) => break 'poll Err(s),
                                }
                            }
                            ptx::st_global_v4_u32(slot, [SENTINEL_EMPTY_WORD; 4]);
                            <$E>::accumulate(&mut acc, &w);
                        }
                    });
                };
            }
            poll_group!(0);
            poll_group!(1);
            if $rank + 1 == $world {
                <$E>::accumulate(&mut acc, &$mine);
            }
            Ok(acc)
        }
    };
}

const _: () = assert!(2 * POLL_GROUP >= MAX_RANKS, "two poll groups cover every slot");

/// The kernel body; `W` is the world size when fixed at compile time (2
/// for the TP2 entry points), 0 for "read it from the parameters".
#[inline(always)]
unsafe fn fused_one_shot_push<E: Element, const W: u32>(p: FusedOneShotPushParams) {
    let control = p.push.h.control as *mut Control;

    // ---- Entry: the control words and this thread's first input packs are
    //      in flight together.
    let (abort, generation) = sentinel::entry(control, RegionId::OneShotPush);
    let row_packs = p.epilogue.hidden as u64 / E::LANES as u64;
    let rows = p.epilogue.rows as u64;
    let threads = ptx::block_dim_x() as u64;
    let tid = ptx::thread_idx_x() as u64;
    let (first_row, row_stride) = block_rows();
    let input = p.push.h.input;
    // Rows are whole packs (host-checked), so a pointer's alignment is that
    // of every row in it; a misaligned view goes element by element (every
    // rank runs this kernel for the same calls, whatever its pointers).
    let vector_in = aligned16(input);
    let mut values = [ZERO_PACK; K];
    if first_row < rows {
        values = load_row_packs::<E>(input, first_row, row_packs, tid, threads, vector_in);
    }
    let world = if W == 0 { p.push.h.world } else { W };
    let rank = p.push.h.rank;
    let half = (generation & 1) as u64 * p.push.h.half_bytes;

    // ---- Push: each owned pack to every peer (rank+1, rank+2, ...).
    if abort == 0 {
        let mut row = first_row;
        while row < rows {
            for_each_row_pack!(KI => {
                let j = tid + KI as u64 * threads;
                if j < row_packs {
                    let v = E::canonicalise(values[KI]);
                    let off = ptx::opaque_u64(half + pack_offset(row, row_packs, j));
                    for_each_rank!(D => {
                        if (D as u32) + 1 < world {
                            ptx::st_relaxed_sys_v4_u32((p.push.send_to[D] + off) as *mut u32, v);
                        }
                    });
                }
            });
            row += row_stride;
            if row < rows {
                values = load_row_packs::<E>(input, row, row_packs, tid, threads, vector_in);
            }
        }
    }

    // ---- Generation: block barrier (block-uniform stop on abort); the last
    //      block of the launch advances it.
    if sentinel::advance_generation(control, RegionId::OneShotPush, generation, abort != 0) {
        return;
    }

    // ---- Per row: poll, reduce, add the residual, normalise.
    let norm = p.epilogue.flags & EPILOGUE_NORM != 0;
    let offset = p.epilogue.flags & EPILOGUE_WEIGHT_OFFSET != 0;
    let (residual_in, residual_out) = (p.epilogue.residual_in as *const u8, p.epilogue.residual_out as *mut u8);
    let (weight, normed) = (p.epilogue.weight as *const u8, p.epilogue.normed as *mut u8);
    let vector_residual = aligned16(residual_in as u64) && aligned16(residual_out as u64);
    let vector_norm = aligned16(weight as u64) && aligned16(normed as u64);
    let lanes = E::LANES as u64;
    let scratch = ptx::reduction_scratch();
    let mut parity = 0u32;
    let mut stall: Option<Stall> = None;
    let mut row = first_row;
    while row < rows {
        let mut kept = [ZERO_PACK; K];
        let mut weights = [ZERO_PACK; K];
        let mut squares = 0.0f32;
        for_each_row_pack!(KI => {
            let j = tid + KI as u64 * threads;
            if j < row_packs && stall.is_none() {
                let pack = row * row_packs + j;
                // Own term, residual and weight are issued before the polls.
                let mine = E::canonicalise(load_pack::<E>(input as *const u8, pack, lanes, vector_in));
                let residual = load_pack::<E>(residual_in, pack, lanes, vector_residual);
                if norm {
                    weights[KI] = load_pack::<E>(weight, j, lanes, vector_norm);
                }
                let off = ptx::opaque_u64(half + pack_offset(row, row_packs, j));
                let polled: Result<Acc, Stall> = poll_and_sum!(E, p, world, rank, off, mine, control);
                match polled {
                    Ok(mut acc) => {
                        E::accumulate(&mut acc, &residual);
                        let out = E::round(&acc);
                        store_pack::<E>(residual_out, pack, lanes, vector_residual, &out);
                        kept[KI] = out;
                        squares += sum_squares::<E>(&out);
                    }
                    Err(s) => stall = Some(s),
                }
            }
        });
        if !norm {
            if stall.is_some() {
                break;
            }
        } else {
            let (total, stop) = block_sum(squares, stall.is_some(), scratch, parity);
            if stop {
                break;
            }
            let inv = inv_rms(total, p.epilogue.hidden, p.epilogue.eps);
            for_each_row_pack!(KI => {
                let j = tid + KI as u64 * threads;
                if j < row_packs {
                    let out = normalise::<E>(&kept[KI], &weights[KI], inv, offset);
                    store_pack::<E>(normed, row * row_packs + j, lanes, vector_norm, &out);
                }
            });
            parity ^= 1;
        }
        row += row_stride;
    }
    if let Some(s) = stall {
        let record = p.push.h.error_record as *mut ErrorRecord;
        sentinel::give_up(control, p.push.h.abort as *mut u32, record, AlgorithmId::OneShotPush, rank, generation, s);
    }
}

macro_rules! fused_one_shot_push_entries {
    ($w:literal, $f32:ident, $f16:ident, $bf16:ident) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f32(p: FusedOneShotPushParams) {
            fused_one_shot_push::<super::pack::F32, $w>(p)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f16(p: FusedOneShotPushParams) {
            fused_one_shot_push::<super::pack::F16, $w>(p)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $bf16(p: FusedOneShotPushParams) {
            fused_one_shot_push::<super::pack::Bf16, $w>(p)
        }
    };
}

fused_one_shot_push_entries!(0, fused_one_shot_push_f32, fused_one_shot_push_f16, fused_one_shot_push_bf16);
fused_one_shot_push_entries!(2, fused_one_shot_push2_f32, fused_one_shot_push2_f16, fused_one_shot_push2_bf16);
