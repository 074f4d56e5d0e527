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
//!     issue:  residual_in[first row, j] and w[j] (in flight during the barrier)
//!     count_block (block barrier; thread 0 counts the block; its answer is
//!                  used after the rows, or at once in the `_wide` entries)
//!     per row (block-uniform):
//!       first polls of every pack of the row, back to back (one round trip)
//!       wait on EMPTY words + reset on consume, sum in rank order in f32
//!       (own term = the input packs still held from the push)
//!       y = sum + residual_in; residual_out = round(y); s += x^2 (rounded x)
//!       block_sum(s) (bar.red.or: also carries "a thread gave up")
//!       normed = round(x * inv_rms * w)                  (x, w kept in registers)
//!     finish_generation (the launch's last block stores gen + 1; the `_wide`
//!                        entries: before the rows)
//! ```
//!
//! **Cluster entries** (`fused_one_shot_push[2]_cluster_<dt>`, sm_90 and
//! newer; the host takes them for a few long rows: `cluster_launch`): a
//! row is spread over the blocks of a thread-block cluster, one pack per
//! thread, so that a 14 KB row is pushed, polled and normalised by up to 8
//! SMs instead of one. The same phases on each block's slice of the row;
//! the row's sum of squares is `epilogue::cluster_sum` (each block's total
//! sent one way with `st.async` into every block's shared-memory inbox,
//! counted there by an mbarrier):
//!
//! ```text
//!   entry, push, cluster_shape_check (trap), count_block as above
//!   (RMSNorm) init the inbox's mbarriers, barrier.cluster.arrive.relaxed
//!   per row: poll + add as above; block_sum;
//!            first row only: barrier.cluster.wait        (every mbarrier initialised)
//!            cluster_sum (one-way inbox exchange)
//! ```
//!
//! Every block of a cluster takes part in every round: a block that saw
//! the abort does not return at the generation barrier but sends `stop`
//! in the first round, and the cluster leaves together.
//!
//! Trace (`Config::trace`): thread 0 of block 0 stamps entry, control
//! loaded, first peer store, its first row polled (before the epilogue's
//! reduction) and exit, as the plain kernel does.
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
//! **Spread push** (`EPILOGUE_SPREAD_PUSH`, block-per-row entries, a grid
//! of more blocks than rows): a block per row issues a whole row's push
//! from one SM, and the row's last pack reached the peer about 0.5 us
//! after its first (2 H200, 896 packs a row). With the bit every block
//! pushes an equal share of consecutive packs of the whole message
//! instead, and blocks `b < rows` own the rows as above (their own term
//! loaded again, an L2 hit). The poll side is unchanged; nothing orders a
//! push after the owner's stores, so the host sets the bit only where
//! `normed` and `residual_out` do not overlap `input`.
//!
//! A wait that gives up makes its thread skip its remaining packs; the
//! block leaves together at the row's barrier (`bar.red.or` of the
//! failure), and the failing threads record it. Without `EPILOGUE_NORM`
//! there is no barrier and a failing thread leaves at once.

use super::epilogue::{
    block_rows, block_sum, cluster_inbox_open, cluster_shape_check, cluster_sum, inv_rms, normalise, sum_squares,
};
use super::pack::{aligned16, any_word_empty, load_pack, store_pack, Acc, Element, Pack, ZERO_PACK};
use super::ptx;
use super::sentinel::{self, Stall, Trace};
use crate::ids::AlgorithmId;
use crate::layout::{ErrorRecord, MAX_RANKS, SENTINEL_EMPTY_WORD};
use crate::params::{
    Control, FusedOneShotPushParams, RegionId, EPILOGUE_NORM, EPILOGUE_SPREAD_PUSH, EPILOGUE_WEIGHT_OFFSET, FLAG_TRACE,
    FUSED_PACKS_PER_THREAD, FUSED_SHORT_ROW_PACKS_PER_THREAD,
};
use crate::{for_each_rank, for_each_row_pack};

/// Packs per thread per row (the host keeps `row_packs <= K * threads`).
const K: usize = FUSED_PACKS_PER_THREAD as usize;
/// Packs per thread per row of the `_short` entries (`row_packs <=
/// SHORT_K * threads`).
const SHORT_K: usize = FUSED_SHORT_ROW_PACKS_PER_THREAD as usize;
/// Receive slots polled together (as in OneShotPush).
const POLL_GROUP: usize = crate::params::ONE_SHOT_PUSH_POLL_GROUP;
/// See `one_shot_push.rs`: -0.0 is the identity of IEEE addition.
const NEG_ZERO_ACC: Acc = [-0.0; 8];

/// Byte offset of pack `j` of `row` in a `rows x row_packs` message.
#[inline(always)]
fn pack_offset(row: u64, row_packs: u64, j: u64) -> u64 {
    16 * (row * row_packs + j)
}

/// The packs `lo..hi` of every row this block works on, and this thread's
/// place among them: pack `j = lo + tid + k * threads` (`k < P`, `j < hi`).
/// A block owns whole rows (`lo = 0, hi = row_packs`), or, in a cluster
/// entry, the slice of each of its cluster's rows at its cluster rank.
#[derive(Clone, Copy)]
struct RowSlice {
    row_packs: u64,
    lo: u64,
    hi: u64,
    tid: u64,
    threads: u64,
}

impl RowSlice {
    /// Pack `k` of this thread, if it has one.
    #[inline(always)]
    fn pack(&self, k: usize) -> Option<u64> {
        let j = self.lo + self.tid + k as u64 * self.threads;
        if j < self.hi {
            Some(j)
        } else {
            None
        }
    }
}

/// `SPREAD` of the kernel body: whether the push is spread over the grid
/// never (the `_wide` entries: their 64 registers leave no room for both
/// pushes), by `EPILOGUE_SPREAD_PUSH`, or always (`_wide_spread`).
const SPREAD_NEVER: u8 = 0;
const SPREAD_BY_FLAG: u8 = 1;
const SPREAD_ALWAYS: u8 = 2;

/// This block's packs `lo..hi` of a spread push over `total` packs: an
/// equal share of consecutive packs per block.
#[inline(always)]
fn spread_share(total: u32) -> (u32, u32) {
    let share = total.div_ceil(ptx::grid_dim_x());
    let lo = ptx::block_idx_x() * share;
    (lo, total.min(lo + share))
}

/// Loads this thread's packs of `row` from `base` (all in flight at once;
/// element by element unless `vector`).
#[inline(always)]
unsafe fn load_row_packs<E: Element, const P: usize>(base: u64, row: u64, s: RowSlice, vector: bool) -> [Pack; K] {
    let row_packs = s.row_packs;
    let mut v = [ZERO_PACK; K];
    for_each_row_pack!(KI => {
        if let (true, Some(j)) = (KI < P, s.pack(KI)) {
            v[KI] = load_pack::<E>(base as *const u8, row * row_packs + j, E::LANES as u64, vector);
        }
    });
    v
}

/// Stores pack `$v` at byte offset `$offset` of every peer's receive region
/// (slot of this rank: `send_to[d]`, peers rank+1, rank+2, ...). A macro
/// for the reason `poll_and_sum!` gives.
macro_rules! push_to_peers {
    ($p:ident, $world:expr, $offset:expr, $v:expr) => {{
        let v = $v;
        let off = ptx::opaque_u64($offset);
        for_each_rank!(D => {
            if (D as u32) + 1 < $world {
                ptx::st_relaxed_sys_v4_u32(($p.push.send_to[D] + off) as *mut u32, v);
            }
        });
    }};
}

/// Polls every receive slot of the pack at byte offset `$off` (within the
/// half), resets each after reading it, and sums the world's terms in rank
/// order into an f32 accumulator (`$mine` is this rank's term):
/// `Result<Acc, Stall>`. The first `$preloaded` slots were already loaded
/// once (`$pre`, issued for all of the thread's packs together): only a
/// word still EMPTY there is waited for. A macro, not a function: the parameter struct is
/// only ever read with constant offsets where it is used, never borrowed
/// (a reference would make LLVM copy it to local memory).
macro_rules! poll_and_sum {
    ($E:ty, $p:ident, $world:expr, $rank:expr, $off:expr, $mine:expr, $pre:expr, $preloaded:expr, $control:expr) => {
        'poll: {
            let mut acc = NEG_ZERO_ACC;
            macro_rules! poll_group {
                ($group:literal) => {
                    let mut got = [ZERO_PACK; MAX_RANKS];
                    for_each_rank!(S => {
                        if S < $preloaded && $group == 0 {
                            got[S] = $pre[S];
                        } else if S / POLL_GROUP == $group && (S as u32) + 1 < $world {
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

/// Receive slots whose first poll a thread issues for all of its `p` packs
/// of a row at once, before it waits on any: every slot with the world
/// fixed at 2..=5, two for any world, none with `K` packs (the register
/// budget of 512-thread blocks: ptxas spilled otherwise) and none with one
/// pack in a block-per-row entry (the poll's own first pass already issues
/// its slots together); the one-pack cluster entries preload (adopted with
/// the single-lane block count and measured only together with it,
/// docs/RESULTS.md).
const fn preloaded_slots(w: u32, p: usize, cluster: bool) -> usize {
    if p > SHORT_K || (p == 1 && !cluster) {
        0
    } else if w == 0 {
        2
    } else if (w as usize) - 1 < POLL_GROUP {
        (w as usize) - 1
    } else {
        POLL_GROUP
    }
}

/// The kernel body; `W` is the world size when fixed at compile time (2
/// for the TP2 entry points), 0 for "read it from the parameters"; `P`
/// packs of a row per thread at most (`K` or `SHORT_K`).
#[inline(always)]
unsafe fn fused_one_shot_push<E: Element, const W: u32, const P: usize, const CLUSTER: bool, const SPREAD: u8>(
    p: FusedOneShotPushParams,
) {
    let trace = Trace::start(p.push.h.flags & FLAG_TRACE != 0, p.push.h.trace);
    let control = p.push.h.control as *mut Control;

    // ---- Entry: the control words and this thread's first input packs are
    //      in flight together.
    let (abort, generation) = sentinel::entry(control, RegionId::OneShotPush);
    let row_packs = p.epilogue.hidden as u64 / E::LANES as u64;
    let rows = p.epilogue.rows as u64;
    let threads = ptx::block_dim_x() as u64;
    let tid = ptx::thread_idx_x() as u64;
    // A cluster works on rows `cluster, cluster + clusters, ...`, each
    // block on its slice of them; otherwise a block owns whole rows. The
    // cluster's shape comes from the parameters (no driver constant before
    // the first loads) and is checked against the launch after the push:
    // whatever it says, every access stays within the rows and the push's
    // row loop ends (a stride of at least 1).
    let cluster_blocks = p.cluster_blocks.max(1);
    let (first_row, row_stride, lo, hi) = if CLUSTER {
        let cluster = ptx::block_idx_x() / cluster_blocks;
        let slice = p.cluster_slice_packs as u64;
        let lo = (ptx::block_idx_x() - cluster * cluster_blocks) as u64 * slice;
        let clusters = (ptx::grid_dim_x() / cluster_blocks).max(1);
        (cluster as u64, clusters as u64, lo, row_packs.min(lo + slice))
    } else {
        let (first, stride) = block_rows();
        (first, stride, 0, row_packs)
    };
    let slice = RowSlice { row_packs, lo, hi, tid, threads };
    let input = p.push.h.input;
    // Rows are whole packs (host-checked), so a pointer's alignment is that
    // of every row in it; a misaligned view goes element by element (every
    // rank runs this kernel for the same calls, whatever its pointers).
    let vector_in = aligned16(input);
    // Spread push (`EPILOGUE_SPREAD_PUSH`, block-per-row entries): this
    // block pushes packs `spread_lo..spread_hi` of the whole message,
    // pack `spread_lo + tid + k * threads`; the first is loaded now, into
    // `values[0]` (the rows' packs are loaded again by their owners).
    // 32-bit: a launch's packs fit its receive region.
    let spread = match SPREAD {
        SPREAD_NEVER => false,
        SPREAD_BY_FLAG => p.epilogue.flags & EPILOGUE_SPREAD_PUSH != 0,
        _ => true,
    };
    let mut values = [ZERO_PACK; K];
    let mut values_row = first_row;
    if spread {
        let (spread_lo, spread_hi) = spread_share((rows * row_packs) as u32);
        let j = spread_lo + tid as u32;
        if j < spread_hi {
            values[0] = load_pack::<E>(input as *const u8, j as u64, E::LANES as u64, vector_in);
        }
        values_row = u64::MAX;
    } else if first_row < rows {
        values = load_row_packs::<E, P>(input, first_row, slice, vector_in);
    }
    let world = if W == 0 { p.push.h.world } else { W };
    let rank = p.push.h.rank;
    let half = (generation & 1) as u64 * p.push.h.half_bytes;

    // One pack per thread: the input pack is loaded again with the polls
    // (an L2 hit) rather than held across the barrier (4 registers that
    // spilled on sm_80 and sm_89 at 64 registers).
    if P == 1 {
        values_row = u64::MAX;
    }

    // ---- Push: each owned pack to every peer (rank+1, rank+2, ...): the
    //      block's share of the message (spread), or its rows.
    if abort == 0 && spread {
        trace.loaded(generation);
        // Recomputed here rather than held across the entry (registers).
        let (spread_lo, spread_hi) = spread_share(ptx::opaque_u64(rows * row_packs) as u32);
        let first = spread_lo + tid as u32;
        let mut j = first;
        while j < spread_hi && (P > 1 || j == first) {
            push_to_peers!(p, world, half + 16 * j as u64, E::canonicalise(values[0]));
            if j == first {
                trace.first_store(generation);
            }
            // One pack per thread (P == 1): a block holds a row, and a
            // share is less than a row (more blocks than rows).
            j += threads as u32;
            if P > 1 && j < spread_hi {
                values[0] = load_pack::<E>(input as *const u8, j as u64, E::LANES as u64, vector_in);
            }
        }
    } else if abort == 0 {
        trace.loaded(generation);
        let mut row = first_row;
        while row < rows {
            for_each_row_pack!(KI => {
                if let (true, Some(j)) = (KI < P, slice.pack(KI)) {
                    push_to_peers!(p, world, half + pack_offset(row, row_packs, j), E::canonicalise(values[KI]));
                }
            });
            if row == first_row {
                trace.first_store(generation);
            }
            row += row_stride;
            if row < rows {
                values = load_row_packs::<E, P>(input, row, slice, vector_in);
                if P > 1 {
                    values_row = row;
                }
            }
        }
    }

    // A cluster with RMSNorm exchanges through its inbox (opened below).
    // The inbox's address is taken once: each asm block that takes it
    // declares the array.
    let norm = p.epilogue.flags & EPILOGUE_NORM != 0;
    let cluster_barriers = CLUSTER && norm;
    let cluster_inbox = ptx::cluster_inbox();
    if CLUSTER {
        cluster_shape_check(cluster_blocks, p.cluster_slice_packs, row_packs as u32);
    }

    // ---- Rank-local operands of the epilogue. Short rows (`early`): issued
    //      now, so that they are in flight during the barrier and the
    //      peers' round trip (the weight, the same for every row, and the
    //      first row's residual), and the input packs stay held from the
    //      push. Long rows: loaded pack by pack before each poll, as many
    //      registers held across a wait as 512 threads allow.
    let early = P <= SHORT_K;
    let offset = p.epilogue.flags & EPILOGUE_WEIGHT_OFFSET != 0;
    let (residual_in, residual_out) = (p.epilogue.residual_in, p.epilogue.residual_out as *mut u8);
    let (weight, normed) = (p.epilogue.weight, p.epilogue.normed as *mut u8);
    let vector_residual = aligned16(residual_in) && aligned16(residual_out as u64);
    let vector_norm = aligned16(weight) && aligned16(normed as u64);
    let mut weights = [ZERO_PACK; K];
    let mut residual = [ZERO_PACK; K];
    if early && first_row < rows {
        residual = load_row_packs::<E, P>(residual_in, first_row, slice, vector_residual);
        if norm {
            weights = load_row_packs::<E, P>(weight, 0, slice, vector_norm);
        }
    }

    // ---- Generation: block barrier (block-uniform stop on abort), the block
    //      counted; the last block of the launch advances it after its rows
    //      (`finish_generation`: the count's answer stays off the polls),
    //      the `_wide` entries at once (below). In a cluster with RMSNorm
    //      every block takes part in every cluster barrier: a block that saw
    //      the abort polls nothing and makes its cluster leave together at
    //      the first row's reduction.
    let (aborted, block_count) = sentinel::count_block(control, RegionId::OneShotPush, abort != 0, !CLUSTER);
    if aborted && !cluster_barriers {
        return; // not counted: nothing to finish
    }
    // The block-per-row entries with one pack per thread (`_wide`: 1024
    // threads, 64 registers) finish at once: the count held across the
    // rows spilled there on sm_80.
    let finish_late = CLUSTER || P > 1;
    if !finish_late {
        sentinel::finish_generation(control, RegionId::OneShotPush, generation, block_count, !aborted);
    }
    // ---- The cluster's inbox (its mbarriers, a relaxed arrive): opened
    //      here, while the peers' packs are on their way, not at entry,
    //      where its initialisation fence delayed the push, nor between
    //      the push and the generation barrier, where it delayed every
    //      block's poll (measured: docs/RESULTS.md). The matching wait
    //      comes before the first exchange.
    if cluster_barriers {
        cluster_inbox_open(cluster_inbox);
    }

    // ---- Per row: poll, reduce, add the residual, normalise.
    let lanes = E::LANES as u64;
    let preloaded = preloaded_slots(W, P, CLUSTER);
    let scratch = ptx::reduction_scratch();
    // The row's reduction number, from 1: its parity picks the buffers of
    // `block_sum` (and of the cluster inbox).
    let mut round = 0u32;
    let mut stall: Option<Stall> = None;
    let mut row = first_row;
    while row < rows {
        if early && row != first_row {
            residual = load_row_packs::<E, P>(residual_in, row, slice, vector_residual);
        }
        if early && row != values_row {
            values = load_row_packs::<E, P>(input, row, slice, vector_in);
            values_row = row;
        }
        // First polls of the preloaded slots for every pack, back to back:
        // one round trip for the row, not one per pack.
        let mut first_polls = [[ZERO_PACK; MAX_RANKS]; K];
        for_each_row_pack!(KI => {
            if let (true, Some(j), false) = (KI < P, slice.pack(KI), aborted) {
                let off = ptx::opaque_u64(half + pack_offset(row, row_packs, j));
                for_each_rank!(S => {
                    if S < preloaded && (S as u32) + 1 < world {
                        first_polls[KI][S] = ptx::ld_relaxed_sys_v4_u32((p.push.recv_from[S] + off) as *const u32);
                    }
                });
            }
        });
        let mut kept = [ZERO_PACK; K];
        let mut squares = 0.0f32;
        for_each_row_pack!(KI => {
            if let (true, Some(j), true) = (KI < P, slice.pack(KI), stall.is_none() && !aborted) {
                let pack = row * row_packs + j;
                let mut own = values[KI];
                if !early {
                    own = load_pack::<E>(input as *const u8, pack, lanes, vector_in);
                    residual[KI] = load_pack::<E>(residual_in as *const u8, pack, lanes, vector_residual);
                    if norm {
                        weights[KI] = load_pack::<E>(weight as *const u8, j, lanes, vector_norm);
                    }
                }
                let mine = E::canonicalise(own);
                let off = ptx::opaque_u64(half + pack_offset(row, row_packs, j));
                let polled: Result<Acc, Stall> =
                    poll_and_sum!(E, p, world, rank, off, mine, first_polls[KI], preloaded, control);
                match polled {
                    Ok(mut acc) => {
                        E::accumulate(&mut acc, &residual[KI]);
                        let out = E::round(&acc);
                        store_pack::<E>(residual_out, pack, lanes, vector_residual, &out);
                        kept[KI] = out;
                        squares += sum_squares::<E>(&out);
                    }
                    Err(s) => stall = Some(s),
                }
            }
        });
        if row == first_row {
            trace.polled(generation);
        }
        if !norm {
            if stall.is_some() {
                break;
            }
        } else {
            round += 1;
            let (total, stop) = if CLUSTER {
                cluster_sum(squares, stall.is_some() || aborted, scratch, cluster_inbox, round)
            } else {
                block_sum(squares, stall.is_some(), scratch, round & 1)
            };
            if stop {
                break;
            }
            let inv = inv_rms(total, p.epilogue.hidden, p.epilogue.eps);
            for_each_row_pack!(KI => {
                if let (true, Some(j)) = (KI < P, slice.pack(KI)) {
                    let out = normalise::<E>(&kept[KI], &weights[KI], inv, offset);
                    store_pack::<E>(normed, row * row_packs + j, lanes, vector_norm, &out);
                }
            });
        }
        row += row_stride;
    }
    if finish_late {
        sentinel::finish_generation(control, RegionId::OneShotPush, generation, block_count, !aborted);
    }
    if aborted {
        return;
    }
    if let Some(s) = stall {
        let record = p.push.h.error_record as *mut ErrorRecord;
        sentinel::give_up(control, p.push.h.abort as *mut u32, record, AlgorithmId::OneShotPush, rank, generation, s);
        return;
    }
    trace.exit(generation);
}

mod entries;
