//! AllGatherPush: every rank writes its block into its slot of every peer's
//! receive region and copies the blocks that land there into its output;
//! completion travels in the payload. The OneShotPush protocol
//! (`one_shot_push.rs`) with a copy where OneShotPush sums: the same
//! receive region, slots and generation, so the ordering argument carries
//! over unchanged.
//!
//! ```text
//!   output of every rank: [block 0][block 1]...[block world-1], block r =
//!   rank r's input; blocks `block_bytes` apart, `count` elements each
//!   launch n on rank r (every thread, grid-stride over packs i):
//!     entry:  {abort, generation} (one v4 load) + first input pack, together
//!     push:   v = escaped(in[i]) -> send_to[k] + half + 16 i, k = 0..world-2
//!             (rank r+1, r+2, ...: staggered)          (world-1) x count posted
//!             block r of the output <- in[i] (unchanged)
//!     count_block (block barrier; thread 0 counts the block, no wait)
//!     poll:   one relaxed.sys load per slot of a group, back to back; per
//!             slot: bounded spin while EMPTY, reset (reset on consume),
//!             block source(k) of the output <- the pack as it arrived
//!     rare, only a thread that sent or received ESCAPE words:
//!       escape words: for each of its packs with an EMPTY or ESCAPE word,
//!             the mask of its EMPTY words -> send_to[k] + half +
//!             escape_offset + 4 i
//!       restore: for each output pack holding ESCAPE words, bounded spin on
//!             its escape word, reset it, store the restored pack
//!   finish_generation (the last block stores gen + 1; sm_80/89: right
//!     after count_block)
//! ```
//!
//! The escape words go out after the poll: no rank waits for one before
//! its own poll has ended (only the restore step does), and the push and
//! poll loops keep OneShotPush's registers (64 with 1024-thread blocks,
//! no spills).
//!
//! Ordering: as OneShotPush. Slot X (pack i of source p in half h of
//! receiver r) and its escape word are written only by p and read and reset
//! only by r. The lemma holds because every rank's output needs every
//! rank's launch-n input: if y finished launch n, every x has started n, so
//! finished n-1. Launches of AllGather, ReduceScatter and OneShotPush (plain
//! and fused) share the region and its generation: every rank runs the same
//! sequence of launches, each reads and resets every slot word (escape words
//! included) written to it in that launch, so between launches every word
//! of the region is EMPTY and the halves alternate identically everywhere.
//!
//! Bits (`crate::escape`): an all-gather is a copy, so every bit pattern arrives unchanged,
//! whatever the dtype (the kernel moves 32-bit words; the dtype only
//! decides the tail). A word equal to EMPTY cannot travel as itself (it
//! means "not arrived"), so EMPTY and ESCAPE words travel as ESCAPE and the
//! pack's escape word, a mask of which of its four words were EMPTY (at
//! most 15, never EMPTY itself), restores them. The escape word is a slot
//! word of its own with the same EMPTY-until-written protocol, so payload
//! and escape word need no order between them: the receiver waits for
//! each. Packs without EMPTY or ESCAPE words (every pack of finite floats)
//! send no escape word. In place (the input is block `rank` of the output)
//! is safe: the thread that writes a pack of the own block is the one that
//! read it.

use super::pack::{aligned16, any_word_empty, Element, ZERO_PACK};
use super::ptx;
use super::sentinel::{self, Trace};
use crate::escape::{any_escaped, escape, unescape};
use crate::for_each_rank;
use crate::ids::AlgorithmId;
use crate::layout::{ErrorRecord, MAX_RANKS, SENTINEL_EMPTY_WORD};
use crate::params::{one_shot_push_source, Control, GatherScatterParams, RegionId, FLAG_TRACE};
use crate::partition::div_ceil;

use super::island_push::{load_message_pack, store_message_pack};

/// Receive slots polled together: two packs held in registers, so that the
/// kernel fits the sentinel kernels' budget of 64 registers (1024-thread
/// blocks) without spilling.
const POLL_GROUP: usize = crate::params::ISLAND_PUSH_GROUP;

#[inline(always)]
unsafe fn all_gather_push<E: Element>(p: GatherScatterParams) {
    let trace = Trace::start(p.push.h.flags & FLAG_TRACE != 0, p.push.h.trace);
    let control = p.push.h.control as *mut Control;

    // ---- Entry: the control words and the first input pack in flight
    //      together.
    let (abort, generation) = sentinel::entry(control, RegionId::OneShotPush);
    let count = p.push.h.count;
    let packs = div_ceil(count, E::LANES as u64);
    let threads = ptx::block_dim_x() as u64;
    let first = ptx::block_idx_x() as u64 * threads + ptx::thread_idx_x() as u64;
    let stride = ptx::grid_dim_x() as u64 * threads;
    let input = p.push.h.input as *const u8;
    let vector_in = aligned16(p.push.h.input);
    let mut value = if first < packs { load_message_pack::<E>(input, count, first, vector_in) } else { ZERO_PACK };
    let world = p.push.h.world;
    let rank = p.push.h.rank;
    let half = (generation & 1) as u64 * p.push.h.half_bytes;
    let output = p.push.h.output;
    let block_bytes = p.block_bytes;
    let own_block = output + rank as u64 * block_bytes;
    let vector_own = aligned16(own_block);

    // ---- Push: each pack once to every peer (staggered), and into the
    //      own block of the output.
    let mut any_escaped_pack = false;
    if abort == 0 {
        trace.loaded(generation);
        let mut i = first;
        while i < packs {
            let (v, mask) = escape(value);
            any_escaped_pack |= mask.is_some();
            let off = ptx::opaque_u64(half + 16 * i);
            for_each_rank!(K => {
                if (K as u32) + 1 < world {
                    ptx::st_relaxed_sys_v4_u32((p.push.send_to[K] + off) as *mut u32, v);
                }
            });
            if i == first {
                trace.first_store(generation);
            }
            // The own block after the sends (they are on the critical
            // path), as loaded.
            store_message_pack::<E>(own_block as *mut u8, count, i, vector_own, &value);
            i += stride;
            if i < packs {
                value = load_message_pack::<E>(input, count, i, vector_in);
            }
        }
    }

    // ---- Generation: as OneShotPush.
    let (aborted, block_count) = sentinel::count_block(control, RegionId::OneShotPush, abort != 0, true);
    if aborted {
        return; // not counted: nothing to finish
    }
    if !sentinel::FINISH_GENERATION_LATE {
        sentinel::finish_generation(control, RegionId::OneShotPush, generation, block_count, true);
    }

    // ---- Poll, reset on consume, copy into the source's block.
    let mut stall = None;
    let mut any_escaped_recv = false;
    let mut i = first;
    'packs: while i < packs {
        let off = ptx::opaque_u64(half + 16 * i);
        // Slots in groups of `POLL_GROUP`: the group's slots loaded back to
        // back, then per slot: spin while EMPTY, reset, store.
        macro_rules! gather_group {
            ($group:literal) => {
                let mut got = [ZERO_PACK; MAX_RANKS];
                for_each_rank!(K => {
                    if K / POLL_GROUP == $group && (K as u32) + 1 < world {
                        got[K] = ptx::ld_relaxed_sys_v4_u32((p.push.recv_from[K] + off) as *const u32);
                    }
                });
                for_each_rank!(K => {
                    if K / POLL_GROUP == $group && (K as u32) + 1 < world {
                        let slot = (p.push.recv_from[K] + off) as *mut u32;
                        let mut w = got[K];
                        if any_word_empty(&w) {
                            let abort_word = p.push.source_abort[K] as *const u32;
                            // The source may not have launched yet.
                            match sentinel::wait_slot(slot, K as u32, abort_word, control, p.push.h.launch_timeout_ns) {
                                Ok(arrived) => w = arrived,
                                Err(s) => {
                                    stall = Some(s);
                                    break 'packs;
                                }
                            }
                        }
                        ptx::st_global_v4_u32(slot, [SENTINEL_EMPTY_WORD; 4]);
                        // Escaped words are restored after the loop (one
                        // bit here keeps the loop's registers).
                        any_escaped_recv |= any_escaped(&w);
                        let block = output + one_shot_push_source(K as u32, rank) as u64 * block_bytes;
                        store_message_pack::<E>(block as *mut u8, count, i, aligned16(block), &w);
                    }
                });
            };
        }
        gather_group!(0);
        gather_group!(1);
        gather_group!(2);
        gather_group!(3);
        const _: () = assert!(4 * POLL_GROUP >= MAX_RANKS, "four poll groups cover every slot");
        trace.polled(generation);
        i += stride;
    }
    // Rare: this thread sent packs with ESCAPE words: their escape words,
    // after the poll (no one waits for them before its own poll ends;
    // kept out of the push loop, which stays as lean as OneShotPush's).
    if any_escaped_pack && stall.is_none() {
        let mut i = first;
        while i < packs {
            if let (_, Some(mask)) = escape(load_message_pack::<E>(p.push.h.input as *const u8, count, i, aligned16(p.push.h.input))) {
                let escape_off = ptx::opaque_u64(half + 4 * i) + p.escape_offset;
                for_each_rank!(K => {
                    if (K as u32) + 1 < world {
                        ptx::st_relaxed_sys_u32((p.push.send_to[K] + escape_off) as *mut u32, mask);
                    }
                });
            }
            i += stride;
        }
    }

    // Rare: packs that arrived with ESCAPE words (they are in the output
    // as they arrived). Each has an escape word saying which were EMPTY:
    // those words of the output become EMPTY again (the rest are ESCAPE
    // already), and the escape word is reset (reset on consume).
    if any_escaped_recv && stall.is_none() {
        let mut i = first;
        'escapes: while i < packs {
            // Opaque: computed at each use, not held per rank for the loop.
            let escape_off = ptx::opaque_u64(half + 4 * i) + p.escape_offset;
            for_each_rank!(K => {
                if (K as u32) + 1 < world {
                    let block = ptx::opaque_u64(output + one_shot_push_source(K as u32, rank) as u64 * block_bytes);
                    let arrived = load_message_pack::<E>(block as *const u8, count, i, aligned16(block));
                    if any_escaped(&arrived) {
                        let escape_word = (p.push.recv_from[K] + escape_off) as *mut u32;
                        let abort_word = p.push.source_abort[K] as *const u32;
                        match sentinel::wait_word(escape_word, K as u32, abort_word, control, p.push.h.launch_timeout_ns) {
                            Ok(mask) => {
                                ptx::st_global_u32(escape_word, SENTINEL_EMPTY_WORD);
                                let restored = unescape(arrived, mask);
                                store_message_pack::<E>(block as *mut u8, count, i, aligned16(block), &restored);
                            }
                            Err(s) => {
                                stall = Some(s);
                                break 'escapes;
                            }
                        }
                    }
                }
            });
            i += stride;
        }
    }
    if sentinel::FINISH_GENERATION_LATE {
        sentinel::finish_generation(control, RegionId::OneShotPush, generation, block_count, true);
    }
    if let Some(s) = stall {
        let record = p.push.h.error_record as *mut ErrorRecord;
        sentinel::give_up(control, p.push.h.abort as *mut u32, record, AlgorithmId::AllGatherPush, rank, generation, s);
        return;
    }
    trace.exit(generation);
}

crate::dtype_entry_points!(
    all_gather_push,
    all_gather_push_f32,
    all_gather_push_f16,
    all_gather_push_bf16,
    (p: GatherScatterParams)
);
