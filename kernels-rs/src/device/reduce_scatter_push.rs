//! ReduceScatterPush: every rank writes share d of its input into its slot of
//! rank d's receive region, and sums the shares that land in its own
//! region with its own share; completion travels in the payload. The
//! OneShotPush protocol (`one_shot_push.rs`) where each peer receives only
//! its share: the same receive region, slots and generation, the same
//! rank-order f32 sum.
//!
//! ```text
//!   input of every rank: [share 0][share 1]...[share world-1], shares
//!   `block_bytes` apart, `count` elements each; output: `count` elements
//!   launch n on rank r:
//!     entry:  {abort, generation} (one v4 load) + the first item's pack
//!     push:   grid-stride over items (pack i, send k), k fastest (rank
//!             d = r+1+k mod world: staggered): canonical(share d [i])
//!             -> send_to[k] + half + 16 i             (world-1)/world x S posted
//!     count_block (block barrier; thread 0 counts the block, no wait)
//!     poll:   grid-stride over packs i: mine = canonical(share r [i]); one
//!             relaxed.sys load per slot of a group of two, back to back;
//!             per slot: bounded spin while EMPTY, reset (reset on
//!             consume), accumulate
//!     out[i] = sum over ranks 0..world-1 in f32, own term = mine, rounded once
//!   finish_generation (the last block stores gen + 1; sm_80/89: right
//!     after count_block)
//! ```
//!
//! Ordering: as OneShotPush, slot by slot. The lemma holds because rank
//! y's output needs share y of every rank's launch-n input: if y finished
//! launch n, every x has started n, so finished n-1. The region and its
//! generation are shared with OneShotPush and AllGather (`all_gather_push.rs`).
//!
//! Bits: share d is summed only by rank d, in rank order from -0.0 with
//! one rounding, as OneShotPush sums every pack: a reduce-scatter gives the
//! bits the same ranks' one-shot allreduce gives for that share. In place
//! (the output is share `rank` of the input) is safe: the own share is read
//! and written by the same thread, and no push reads it.

use super::island_push::{load_message_pack, store_message_pack, NEG_ZERO_ACC};
use super::pack::{aligned16, any_word_empty, Element, ZERO_PACK};
use super::ptx;
use super::sentinel::{self, Trace};
use crate::for_each_rank;
use crate::ids::AlgorithmId;
use crate::layout::{ErrorRecord, MAX_RANKS, SENTINEL_EMPTY_WORD};
use crate::params::{Control, GatherScatterParams, RegionId, FLAG_TRACE};
use crate::partition::div_ceil;

/// Receive slots polled together: two packs held in registers, so that
/// the kernel fits the sentinel kernels' budget of 64 registers
/// (1024-thread blocks) without spilling.
const GROUP: usize = crate::params::ISLAND_PUSH_GROUP;

/// Address of share `k`'s rank (`rank + 1 + k`, wrapped) in a message
/// whose shares are `block_bytes` apart.
#[inline(always)]
fn share_of_send(base: u64, block_bytes: u64, rank: u32, world: u32, k: u32) -> u64 {
    let mut d = rank + 1 + k;
    if d >= world {
        d -= world;
    }
    base + d as u64 * block_bytes
}

#[inline(always)]
unsafe fn reduce_scatter_push<E: Element>(p: GatherScatterParams) {
    let trace = Trace::start(p.push.h.flags & FLAG_TRACE != 0, p.push.h.trace);
    let control = p.push.h.control as *mut Control;

    // ---- Entry: the control words first; the sends' loads go out before
    //      the abort word is looked at (only the stores wait for it).
    let (abort, generation) = sentinel::entry(control, RegionId::OneShotPush);
    let count = p.push.h.count;
    let packs = div_ceil(count, E::LANES as u64);
    let threads = ptx::block_dim_x() as u64;
    let first = ptx::block_idx_x() as u64 * threads + ptx::thread_idx_x() as u64;
    let stride = ptx::grid_dim_x() as u64 * threads;
    let input = p.push.h.input;
    let block_bytes = p.block_bytes;
    let world = p.push.h.world;
    let rank = p.push.h.rank;
    let half = (generation & 1) as u64 * p.push.h.half_bytes;

    // ---- Push: one pack of one share per work item, items (pack i, send
    //      k) with k fastest, so that neighbouring threads write different
    //      peers (staggered: send k goes to rank + 1 + k). One pack in
    //      flight per thread, the next item's loaded before the store of
    //      this one; the first before anything looks at the abort word (as
    //      OneShotPush loads its first pack), so the first peer store waits
    //      for one memory latency, not for the control words and then the
    //      input. (Pack indices u32: the host keeps a launch far below
    //      2^32 / world packs.)
    let sends = world - 1;
    let items = packs as u32 * sends;
    let load_item = |w: u32| {
        if w < items {
            let share = share_of_send(input, block_bytes, rank, world, w % sends);
            load_message_pack::<E>(share as *const u8, count, (w / sends) as u64, aligned16(share))
        } else {
            ZERO_PACK
        }
    };
    let first_item = first as u32;
    let item_stride = stride as u32;
    let mut w = first_item;
    let mut value = load_item(w);
    if abort == 0 {
        trace.loaded(generation);
        while w < items {
            let k = w % sends;
            let off = ptx::opaque_u64(half + 16 * (w / sends) as u64);
            let v = E::canonicalise(value);
            for_each_rank!(K => {
                if K as u32 == k {
                    ptx::st_relaxed_sys_v4_u32((p.push.send_to[K] + off) as *mut u32, v);
                }
            });
            if w == first_item {
                trace.first_store(generation);
            }
            w += item_stride;
            value = load_item(w);
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

    // ---- Poll, reset on consume, reduce in rank order.
    let own = input + rank as u64 * block_bytes;
    let vector_own = aligned16(own);
    let output = p.push.h.output as *mut u8;
    let vector_out = aligned16(p.push.h.output);
    let mut stall = None;
    let mut i = first;
    'packs: while i < packs {
        // The own term, issued before the polls so it overlaps them.
        let mine = E::canonicalise(load_message_pack::<E>(own as *const u8, count, i, vector_own));
        let off = ptx::opaque_u64(half + 16 * i);
        // Sum in rank order on every rank, in f32 from -0.0: the slots hold
        // sources 0..rank-1, then rank+1..world-1, so the own term goes in
        // before slot `rank`.
        let mut acc = NEG_ZERO_ACC;
        macro_rules! poll_group {
            ($group:literal) => {
                let mut got = [ZERO_PACK; MAX_RANKS];
                for_each_rank!(K => {
                    if K / GROUP == $group && (K as u32) + 1 < world {
                        got[K] = ptx::ld_relaxed_sys_v4_u32((p.push.recv_from[K] + off) as *const u32);
                    }
                });
                for_each_rank!(K => {
                    if K / GROUP == $group && K as u32 == rank && (K as u32) + 1 < world {
                        E::accumulate(&mut acc, &mine);
                    }
                    if K / GROUP == $group && (K as u32) + 1 < world {
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
                        E::accumulate(&mut acc, &w);
                    }
                });
            };
        }
        poll_group!(0);
        poll_group!(1);
        poll_group!(2);
        poll_group!(3);
        if rank + 1 == world {
            E::accumulate(&mut acc, &mine);
        }
        trace.polled(generation);
        store_message_pack::<E>(output, count, i, vector_out, &E::round(&acc));
        i += stride;
    }
    if sentinel::FINISH_GENERATION_LATE {
        sentinel::finish_generation(control, RegionId::OneShotPush, generation, block_count, true);
    }
    if let Some(s) = stall {
        let record = p.push.h.error_record as *mut ErrorRecord;
        sentinel::give_up(control, p.push.h.abort as *mut u32, record, AlgorithmId::ReduceScatterPush, rank, generation, s);
        return;
    }
    trace.exit(generation);
}

crate::dtype_entry_points!(
    reduce_scatter_push,
    reduce_scatter_push_f32,
    reduce_scatter_push_f16,
    reduce_scatter_push_bf16,
    (p: GatherScatterParams)
);
