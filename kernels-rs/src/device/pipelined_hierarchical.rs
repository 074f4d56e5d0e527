//! Hierarchical for large messages: the phases of `hierarchical.rs` run
//! side by side in three groups of blocks instead of one after the other in
//! every thread, so that the island sends, the cross-island exchange and
//! the all-gather stream through the links at once. Same receive region,
//! slots, generation and protocol as Hierarchical (the body's macros in
//! `island_push.rs`); only who runs which phase, and when, differs.
//!
//! ```text
//!   G blocks; with G >= 3, block b is in group floor(3 b / G):
//!   group 0  A   reduce-scatter sends of every position (never waits)
//!   group 1  B   owned (e, t): poll the island's slots, partial -> output,
//!                partial -> cross slots of the other islands' owners;
//!            C   one owned position behind B, in the same thread: poll
//!                the cross slots, final = sum in island order -> output
//!                and to the all-gather slot of every other member
//!   group 2  D   all-gather polls of every share owned elsewhere -> output
//!   G < 3: every block runs A, then B/C, then D (Hierarchical's order,
//!   C one position behind B).
//! ```
//!
//! Progress (any launch shape, on every rank): A never waits; a wait of B
//! on position p needs the A sends of p; a wait of C on p needs the B
//! sends of p, whose thread (another island's) waited before them only on
//! A sends of p and on C of positions before p in its own order; a wait of
//! D needs the C sends of p. Every chain of waits therefore reaches
//! strictly earlier positions of the same thread order, or A, which never
//! waits: with every block of every rank resident (the sentinel launch
//! bound), every wait ends. Ordering and in-place use are Hierarchical's:
//! B and C of one position run in one thread (C reads back the partial B
//! stored), D's store of a pack causally follows A's read of it (the value
//! went to its owner and came back).
//!
//! Trace (`bench --trace`): block 0 stamps; with three or more blocks it
//! sends (group 0), so its "last poll" is its last send.

use super::island_push::{
    cross_sends, first_send_pack, gather_sends, island_final, island_partial, reduce_scatter_sends, store_message_pack,
};
use super::pack::{aligned16, Element};
use super::ptx;
use super::sentinel::{self, Stall, Trace};
use crate::ids::{AlgorithmId, Phase};
use crate::layout::ErrorRecord;
use crate::params::{Control, IslandPushParams, RegionId, FLAG_TRACE};
use crate::partition::div_ceil;

/// Block groups of a launch of three or more blocks (A; B and C; D).
const GROUPS: u32 = 3;

/// Which phases this block runs, and its first thread and stride within
/// the blocks that run them.
#[derive(Clone, Copy)]
struct Role {
    sends: bool,
    sums: bool,
    gathers: bool,
    first: u32,
    stride: u32,
}

#[inline(always)]
fn role() -> Role {
    let threads = ptx::block_dim_x();
    let blocks = ptx::grid_dim_x();
    let block = ptx::block_idx_x();
    let tid = ptx::thread_idx_x();
    if blocks < GROUPS {
        return Role { sends: true, sums: true, gathers: true, first: block * threads + tid, stride: blocks * threads };
    }
    // Group g holds blocks ceil(g G / 3) .. ceil((g + 1) G / 3), at least
    // one each (divisions by the constant only: no runtime division ahead
    // of the first store).
    let second = blocks.div_ceil(GROUPS);
    let third = (2 * blocks).div_ceil(GROUPS);
    let (group, lo, hi) = if block < second {
        (0, 0, second)
    } else if block < third {
        (1, second, third)
    } else {
        (2, third, blocks)
    };
    Role {
        sends: group == 0,
        sums: group == 1,
        gathers: group == 2,
        first: (block - lo) * threads + tid,
        stride: (hi - lo) * threads,
    }
}

#[inline(always)]
#[allow(unused_comparisons)] // `S >= 0` in the first send group
unsafe fn pipelined_hierarchical<E: Element>(p: IslandPushParams) {
    let trace = Trace::start(p.h.flags & FLAG_TRACE != 0, p.h.trace);
    let control = p.h.control as *mut Control;
    // Hierarchical's region, halves and generation: the two kernels may
    // follow each other on a rank in any order.
    let region = RegionId::Hierarchical;
    let (abort, generation) = sentinel::entry(control, region);
    let count = p.h.count;
    // u32 pack indices, as in the island push (`max_chunk_bytes`).
    let packs = div_ceil(count, E::LANES as u64) as u32;
    let sh = packs.div_ceil(p.shares);
    let role = role();
    let first = role.first;
    let stride = role.stride;
    let input = p.h.input as *const u8;
    let vin = aligned16(p.h.input);
    let half = (generation & 1) as u64 * p.h.half_bytes;
    if abort == 0 {
        trace.loaded(generation);
    }

    // ---- A: reduce-scatter sends (group 0), as Hierarchical's phase A.
    if role.sends {
        let mut t = first;
        let mut next = first_send_pack!(E, p, t, sh, packs, input, count, vin);
        while t < sh {
            let off = ptx::opaque_u64(half + 16 * t as u64);
            reduce_scatter_sends!(E, p, t, sh, packs, off, input, count, vin, abort, next);
            if t == first && abort == 0 {
                trace.first_store(generation);
            }
            t += stride;
            if t < sh {
                next = first_send_pack!(E, p, t, sh, packs, input, count, vin);
            }
        }
    }

    // ---- Generation: as the island push (every block of every group).
    let (aborted, block_count) = sentinel::count_block(control, region, abort != 0, true);
    if aborted {
        return; // not counted: nothing to finish
    }
    if !sentinel::FINISH_GENERATION_LATE {
        sentinel::finish_generation(control, region, generation, block_count, true);
    }

    let output = p.h.output as *mut u8;
    let vout = aligned16(p.h.output);
    // A wait may be on a peer that has not launched yet: the launch bound.
    let timeout = p.h.launch_timeout_ns;
    let members = p.members;
    let j = p.member_index;
    let cap = p.share_cap;
    let others = members - 1;
    let mut stall: Option<(Stall, Phase, u32)> = None;
    'kernel: {
        // ---- B and C (group 1): B of owned position (e, t), then C of the
        //      position before it in this thread's order; the last C after
        //      the loop.
        if role.sums {
            let (mut e, mut t) = (0u32, first);
            let (mut pending, mut pe, mut pt) = (false, 0u32, 0u32);
            loop {
                while e < p.owned && (t >= sh || (j + e * members) * sh + t >= packs) {
                    e += 1;
                    t = first;
                }
                let live = e < p.owned;
                if live {
                    let i = ((j + e * members) * sh + t) as u64;
                    let off = half + 16 * (e as u64 * cap + t as u64);
                    let (v, _) = island_partial!(E, p, control, timeout, others, j, i, off, input, count, vin, output, vout,
                    |s, peer| {
                        stall = Some((s, Phase::RsPayload, peer));
                        break 'kernel;
                    });
                    cross_sends!(p, generation, e, t, v);
                }
                if pending {
                    let i = ((j + pe * members) * sh + pt) as u64;
                    island_final!(E, p, control, timeout, generation, half, cap, others, pe, pt, i, count, output, vout,
                    |s, peer| {
                        stall = Some((s, Phase::CrossPayload, peer));
                        break 'kernel;
                    });
                }
                if !live {
                    break;
                }
                (pending, pe, pt) = (true, e, t);
                t += stride;
            }
        }

        // ---- D (group 2): the all-gather, as Hierarchical's phase D.
        if role.gathers {
            let mut t = first;
            while t < sh {
                let off = ptx::opaque_u64(half + 16 * t as u64);
                gather_sends!(
                    p,
                    control,
                    timeout,
                    t,
                    sh,
                    packs,
                    off,
                    |i, w| store_message_pack::<E>(output, count, i as u64, vout, &w),
                    |s, peer| {
                        stall = Some((s, Phase::AgPayload, peer));
                        break 'kernel;
                    }
                );
                t += stride;
            }
        }
        trace.polled(generation);
    }
    if sentinel::FINISH_GENERATION_LATE {
        sentinel::finish_generation(control, region, generation, block_count, true);
    }
    if let Some((s, phase, peer)) = stall {
        let record = p.h.error_record as *mut ErrorRecord;
        sentinel::give_up_at(
            control,
            p.h.abort as *mut u32,
            record,
            AlgorithmId::PipelinedHierarchical,
            phase,
            p.h.rank,
            peer,
            generation,
            s,
        );
        return;
    }
    trace.exit(generation);
}

crate::dtype_entry_points!(
    pipelined_hierarchical,
    pipelined_hierarchical_f32,
    pipelined_hierarchical_f16,
    pipelined_hierarchical_bf16,
    (p: IslandPushParams)
);
