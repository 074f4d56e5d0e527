//! OneShotPush: every rank writes its whole message into its slot of every
//! peer's receive region; completion travels in the payload (a sentinel
//! protocol, "Lamport" push as in TensorRT-LLM / FlashInfer: docs/SOURCES.md
//! F19, F20). No barrier
//! between ranks, no flags, no per-block state: any grid and block size.
//!
//! ```text
//!   receive region of rank d: [half 0|1][slot 0..world-2][packs] x 16 B,
//!   source s lands in slot(s, d) = s - (s > d); half = generation & 1
//!   launch n on rank r (every thread, grid-stride over packs i):
//!     entry:  {abort, generation} (one v4 load) + first input pack, together
//!     push:   canonical(in[i]) -> send_to[k] + half + 16 i, k = 0..world-2
//!             (rank r+1, r+2, ...: staggered)          (world-1) x S posted
//!     count_block (block barrier; thread 0 counts the block, no wait)
//!     poll:   mine = canonical(in[i]); first pass: one relaxed.sys load per
//!             source, back to back; bounded spin on any with an EMPTY word
//!     reset:  EMPTY -> every slot just read (reset on consume)
//!     out[i] = sum over ranks 0..world-1 in f32, own term = mine, rounded once
//!   finish_generation (the last block stores gen + 1; sm_80/89: right
//!     after count_block)
//! ```
//!
//! Sentinel: EMPTY is the all-ones 32-bit word; the region is filled with it
//! at init. An input element whose bits are all ones (a NaN) is replaced by
//! the type's quiet NaN before sending, so no payload word is EMPTY and sums
//! are unchanged (NaN stays NaN; -0.0, +-Inf, denormals travel bit-exactly).
//! A 16-byte store may land word by word, so every word is checked (each
//! 32-bit word of a `v4.b32` access is single-copy atomic).
//!
//! Ordering (ARCHITECTURE.md, "the memory-ordering contract", has the full
//! argument). Slot X = pack i of source p in half h of receiver r; written
//! only by p, read and reset only by r. *Lemma*: when rank y has finished
//! launch n, every rank x has finished launch n-1 (y's output needs x's
//! launch-n input, which x sends only from its n-th kernel, which starts
//! after its (n-1)-th completed). *No stale data*: X is EMPTY when r's
//! launch n starts: r consumed and reset it in launch n-2 (same half, same
//! thread, program order); p writes it again only in launch n, after
//! finishing n-1, which by the lemma follows r finishing n-2. *Two halves
//! suffice*: p runs at most one launch ahead. *Grid independence*: writer
//! and reader of a pack need not be the same thread, block or grid shape;
//! only `count` and the generation must agree, and every rank runs the same
//! launches. The one assumption (as for every kernel here): a kernel
//! boundary orders all of a kernel's stores, local resets included, before
//! the next kernel's peer stores for observers on other GPUs. A per-thread
//! `fence.acq_rel.sys` after the resets would make it formal; it cost ~3 us
//! per call (measured) and is not used.
//!
//! Two entry points per dtype: `one_shot_push_<dt>` for any world size and
//! `one_shot_push2_<dt>`, the same body with the world size fixed at 2 (one
//! destination, one source: the unrolled rank loops fold away).

use super::pack::{aligned16, any_word_empty, load_pack, store_pack, Acc, Element, Pack, ZERO_PACK};
use super::ptx;
use super::sentinel::{self, Trace};
use crate::for_each_rank;
use crate::ids::AlgorithmId;
use crate::layout::{ErrorRecord, MAX_RANKS, SENTINEL_EMPTY_WORD};
use crate::params::{Control, OneShotPushParams, RegionId, FLAG_TRACE};
use crate::partition::{div_ceil, elems_in_pack};

/// Pack `pack` of the message at `base` (`count` elements): one vector load
/// when full and `vector` (16-byte aligned base), element-wise otherwise
/// (tails, misaligned user pointers; missing lanes read as zero).
#[inline(always)]
unsafe fn load_message_pack<E: Element>(base: *const u8, count: u64, pack: u64, vector: bool) -> Pack {
    let lanes = E::LANES as u64;
    if vector && (pack + 1) * lanes <= count {
        // The fast path tests only this; the tail arithmetic stays off it.
        ptx::ld_global_v4_u32(base.add(16 * pack as usize) as *const u32)
    } else {
        load_pack::<E>(base, pack, elems_in_pack(count, lanes, pack), false)
    }
}

/// The kernel body; `W` is the world size when fixed at compile time
/// (2 for the TP2 entry points), 0 for "read it from the parameters".
#[inline(always)]
unsafe fn one_shot_push<E: Element, const W: u32>(p: OneShotPushParams) {
    let trace = Trace::start(p.h.flags & FLAG_TRACE != 0, p.h.trace);
    let control = p.h.control as *mut Control;

    // ---- Entry: the control words and this thread's first input pack are
    //      both in flight before either is used (one memory latency).
    let (abort, generation) = sentinel::entry(control, RegionId::OneShotPush);
    let count = p.h.count;
    let packs = div_ceil(count, E::LANES as u64);
    let threads = ptx::block_dim_x() as u64;
    let first = ptx::block_idx_x() as u64 * threads + ptx::thread_idx_x() as u64;
    let stride = ptx::grid_dim_x() as u64 * threads;
    let input = p.h.input as *const u8;
    let vector_in = aligned16(p.h.input);
    let mut value = if first < packs { load_message_pack::<E>(input, count, first, vector_in) } else { ZERO_PACK };
    let world = if W == 0 { p.h.world } else { W };
    let rank = p.h.rank;
    let half = (generation & 1) as u64 * p.h.half_bytes;

    // ---- Push: each pack once to every peer, rank+1, rank+2, ... (the
    //      send_to order), posted relaxed.sys stores.
    if abort == 0 {
        trace.loaded(generation);
        let mut i = first;
        while i < packs {
            let v = E::canonicalise(value);
            let off = ptx::opaque_u64(half + 16 * i);
            for_each_rank!(K => {
                if (K as u32) + 1 < world {
                    ptx::st_relaxed_sys_v4_u32((p.send_to[K] + off) as *mut u32, v);
                }
            });
            if i == first {
                trace.first_store(generation);
            }
            i += stride;
            if i < packs {
                value = load_message_pack::<E>(input, count, i, vector_in);
            }
        }
    }

    // ---- Generation: block barrier (block-uniform stop on abort), the block
    //      counted; the last block of the launch advances it, at the end
    //      where FINISH_GENERATION_LATE (the count's answer off the polls).
    let (aborted, block_count) = sentinel::count_block(control, RegionId::OneShotPush, abort != 0, true);
    if aborted {
        return; // not counted: nothing to finish
    }
    if !sentinel::FINISH_GENERATION_LATE {
        sentinel::finish_generation(control, RegionId::OneShotPush, generation, block_count, true);
    }

    // ---- Poll, reset on consume, reduce in rank order.
    let output = p.h.output as *mut u8;
    let vector_out = aligned16(p.h.output);
    let lanes = E::LANES as u64;
    let mut stall = None;
    let mut i = first;
    'packs: while i < packs {
        // The own term, issued before the polls so it overlaps them.
        let mine = E::canonicalise(load_message_pack::<E>(input, count, i, vector_in));
        let off = ptx::opaque_u64(half + 16 * i);
        // Sum in rank order on every rank, in f32 from -0.0 (bitwise identical
        // results): the slots hold sources 0..rank-1, then rank+1..world-1,
        // so the own term goes in before slot `rank`.
        let mut acc = NEG_ZERO_ACC;
        // Slots in groups of `POLL_GROUP`. First pass: the group's slots
        // loaded back to back (predicated), no timer. Then per slot, in
        // order: spin while EMPTY, reset it (reset on consume: EMPTY again
        // for launch n+2), accumulate. Groups bound the packs held in
        // registers (1024-thread blocks have 64 registers per thread).
        macro_rules! poll_group {
            ($group:literal) => {
                let mut got = [ZERO_PACK; MAX_RANKS];
                for_each_rank!(K => {
                    if K / POLL_GROUP == $group && (K as u32) + 1 < world {
                        got[K] = ptx::ld_relaxed_sys_v4_u32((p.recv_from[K] + off) as *const u32);
                    }
                });
                for_each_rank!(K => {
                    // The own term before slot `rank` (source rank+1); the
                    // last rank has no such slot and adds it after the loop.
                    if K / POLL_GROUP == $group && K as u32 == rank && (K as u32) + 1 < world {
                        E::accumulate(&mut acc, &mine);
                    }
                    if K / POLL_GROUP == $group && (K as u32) + 1 < world {
                        let slot = (p.recv_from[K] + off) as *mut u32;
                        let mut w = got[K];
                        if any_word_empty(&w) {
                            let abort_word = p.source_abort[K] as *const u32;
                            // The only wait of a launch: the source may not have launched yet.
                            match sentinel::wait_slot(slot, K as u32, abort_word, control, p.h.launch_timeout_ns) {
                                Ok(arrived) => w = arrived,
                                Err(s) => {
                                    stall = Some(s);
                                    break 'packs;
                                }
                            }
                        }
                        ptx::st_global_v4_u32(slot, [SENTINEL_EMPTY_WORD; 4]);
                        E::accumulate(&mut acc, &w);
                    }
                });
            };
        }
        poll_group!(0);
        poll_group!(1);
        const _: () = assert!(2 * POLL_GROUP >= MAX_RANKS, "two poll groups cover every slot");
        if rank + 1 == world {
            E::accumulate(&mut acc, &mine);
        }
        trace.polled(generation);
        let sum = E::round(&acc);
        if vector_out && (i + 1) * lanes <= count {
            ptx::st_global_v4_u32(output.add(16 * i as usize) as *mut u32, sum);
        } else {
            store_pack::<E>(output, i, elems_in_pack(count, lanes, i), false, &sum);
        }
        i += stride;
    }
    if sentinel::FINISH_GENERATION_LATE {
        sentinel::finish_generation(control, RegionId::OneShotPush, generation, block_count, true);
    }
    if let Some(s) = stall {
        let record = p.h.error_record as *mut ErrorRecord;
        sentinel::give_up(control, p.h.abort as *mut u32, record, AlgorithmId::OneShotPush, rank, generation, s);
        return;
    }
    trace.exit(generation);
}

/// Receive slots polled together (see the poll phase).
const POLL_GROUP: usize = crate::params::ONE_SHOT_PUSH_POLL_GROUP;

/// The accumulator every sum starts from: -0.0 is the identity of IEEE
/// addition for every value (-0.0 + +0.0 = +0.0, -0.0 + -0.0 = -0.0), so the
/// result equals a sum started from the first operand.
const NEG_ZERO_ACC: Acc = [-0.0; 8];

macro_rules! one_shot_push_entries {
    ($w:literal, $f32:ident, $f16:ident, $bf16:ident) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f32(p: OneShotPushParams) {
            one_shot_push::<super::pack::F32, $w>(p)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f16(p: OneShotPushParams) {
            one_shot_push::<super::pack::F16, $w>(p)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $bf16(p: OneShotPushParams) {
            one_shot_push::<super::pack::Bf16, $w>(p)
        }
    };
}

one_shot_push_entries!(0, one_shot_push_f32, one_shot_push_f16, one_shot_push_bf16);
one_shot_push_entries!(2, one_shot_push2_f32, one_shot_push2_f16, one_shot_push2_bf16);
