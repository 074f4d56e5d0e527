//! The island push with payload completion: the body of TwoShotPush (one
//! island of every rank, two hops) and Hierarchical (islands of any shape,
//! three hops). No flag, no barrier between ranks: every receive slot holds
//! EMPTY until its payload lands (the OneShotPush sentinel protocol, applied
//! to each phase), and the reader resets it right after reading.
//!
//! ```text
//!   launch n on rank r = member j of island g (n_g members, m islands);
//!   S shares of sh = ceil(packs / S) packs; r owns k = j + e n_g, e < owned
//!   entry: {abort, generation} (one v4 load); half = generation & 1
//!   A  reduce-scatter: for each send s (share k_s, owner staggered from
//!      member j+1), t grid-stride < sh: canonical(in[k_s sh + t])
//!      -> rs_to[s] + half + 16 t                     (n_g-1)/S of S posted
//!   count_block (block barrier; thread 0 counts the block, no wait)
//!   B  partial: owned (e, t): poll the n_g-1 reduce-scatter slots, reset
//!      them, v = round(sum in member order, own term canonical(in));
//!      out[i] = v;  Hierarchical: v -> cross_to[o][e] + 16 t of every
//!      other island's owner of k;  TwoShotPush: v -> ag_to[q] of every member
//!   C  (Hierarchical) final: owned (e, t): poll the m-1 cross slots, reset,
//!      f = round(sum in island order, own term out[i]); out[i] = f;
//!      f -> ag_to[q] + half + 16 (e cap + t) of every other member
//!   D  all-gather: each send s, t: poll ag_from[s] + half + 16 t, reset,
//!      out[k_s sh + t] = value
//!   finish_generation (the last block stores gen + 1; sm_80/89: right
//!      after count_block)
//! ```
//!
//! Phasing rule: a wait in phase X only needs data other ranks push in
//! phases before X, and phase A never waits, so every phase ends (by
//! induction over the phases) and the call costs one hop per phase, whatever
//! the number of packs per thread. Writer and reader of a slot agree on
//! every pack from `count` alone: any launch shape works on every rank.
//!
//! Ordering: every slot (a reduce-scatter, cross or all-gather slot of one
//! source at one receiver, in one half) is written only by its source and
//! read and reset only by its receiver, once per launch of the region. The
//! OneShotPush argument (ARCHITECTURE.md, payload as completion) carries
//! over slot by slot: the receiver resets it in launch n, in the thread that
//! read it; the source writes it again in launch n+2 only after finishing
//! n+1, which (every output of an allreduce needs every rank's input of the
//! launch) follows the receiver finishing n. In place is safe: a pack's
//! phase-D store causally follows this rank's phase-A read of it (the value
//! travelled to its owner and back), and phases B and C read and write
//! their packs in one thread. Ranks agree bitwise: each share is finished by
//! its owner (Hierarchical: identically by every island's owner, the same
//! partials summed in island order) and copied elsewhere; outputs are
//! canonicalised like every payload.
//!
//! `fused_island_push.rs` (the same protocol with the add + RMSNorm
//! epilogue: shares of whole rows, a block per owned row in the finishing
//! phase, two packs per all-gather position) shares phase A, the polls of
//! B and C and phase D through the macros below, and extends this argument
//! in its header.

use super::pack::{aligned16, load_pack, store_pack, Acc, Element, Pack};
use super::ptx;
use super::sentinel::{self, Stall, Trace};
use crate::for_each_rank;
use crate::ids::{AlgorithmId, Phase};
use crate::layout::ErrorRecord;
use crate::params::{Control, IslandPushParams, RegionId, FLAG_TRACE};
use crate::partition::{div_ceil, elems_in_pack};
use crate::shares::{MAX_ISLANDS, MAX_OWNED};

/// Packs loaded (or polled) back to back before any is used
/// ([`ISLAND_PUSH_GROUP`]).
pub(super) const GROUP: usize = crate::params::ISLAND_PUSH_GROUP;

/// -0.0: the identity of IEEE addition (see `one_shot_push.rs`).
pub(super) const NEG_ZERO_ACC: Acc = [-0.0; 8];

/// Pack `pack` of the message at `base` (`count` elements): one vector
/// access when full and `vector`, element-wise otherwise (tails,
/// misaligned user pointers; missing lanes read as zero).
#[inline(always)]
pub(super) unsafe fn load_message_pack<E: Element>(base: *const u8, count: u64, pack: u64, vector: bool) -> Pack {
    let lanes = E::LANES as u64;
    if vector && (pack + 1) * lanes <= count {
        ptx::ld_global_v4_u32(base.add(16 * pack as usize) as *const u32)
    } else {
        load_pack::<E>(base, pack, elems_in_pack(count, lanes, pack), false)
    }
}

/// Stores pack `pack` of the message at `base` (see [`load_message_pack`]).
#[inline(always)]
pub(super) unsafe fn store_message_pack<E: Element>(base: *mut u8, count: u64, pack: u64, vector: bool, v: &Pack) {
    let lanes = E::LANES as u64;
    if vector && (pack + 1) * lanes <= count {
        ptx::st_global_v4_u32(base.add(16 * pack as usize) as *mut u32, *v);
    } else {
        store_pack::<E>(base, pack, elems_in_pack(count, lanes, pack), false, v);
    }
}

/// A share index from the parameters, hidden from LLVM's loop-invariant
/// code motion: otherwise it precomputes `share * sh` for every send before
/// the loops and keeps them all live (spills at 64 registers).
#[inline(always)]
pub(super) fn share_index(share: u8) -> u32 {
    ptx::opaque_u64(share as u64) as u32
}

/// `row[e]` for a runtime `e < MAX_OWNED`, without a dynamic index into a
/// parameter array (which would copy the struct to local memory).
///
/// `pick_owned!(opaque $row, $e)` hides each candidate from LLVM first (as
/// u64): otherwise it may fold the chain into one load from a computed
/// address, and an address computed into the parameter struct copies the
/// struct to local memory (seen in the fused kernel's phase C).
macro_rules! pick_owned {
    (opaque $row:expr, $e:expr) => {{
        let mut v = $crate::device::ptx::opaque_u64($row[0] as u64);
        if $e == 1 {
            v = $crate::device::ptx::opaque_u64($row[1] as u64);
        }
        if $e == 2 {
            v = $crate::device::ptx::opaque_u64($row[2] as u64);
        }
        if $e == 3 {
            v = $crate::device::ptx::opaque_u64($row[3] as u64);
        }
        v
    }};
    ($row:expr, $e:expr) => {{
        let mut v = $row[0];
        if $e == 1 {
            v = $row[1];
        }
        if $e == 2 {
            v = $row[2];
        }
        if $e == 3 {
            v = $row[3];
        }
        v
    }};
}
pub(super) use pick_owned;
const _: () = assert!(MAX_OWNED == 4, "pick_owned! selects among four owned shares");
const _: () = assert!(4 * GROUP >= crate::layout::MAX_RANKS, "four groups cover every send and slot");
const _: () = assert!(crate::layout::MAX_RANKS == 8, "the send groups of phase A cover sends 0..8");
const _: () = assert!(2 * GROUP >= MAX_ISLANDS - 1, "two groups cover the cross slots");

/// Phase A: the pack of send 0 (the first owner in the staggered order) at
/// reduce-scatter position `$t`, or zeros where it has none. Loaded ahead
/// of the position's other sends (`reduce_scatter_sends!`), for the first
/// position before anything looks at the abort word, as OneShotPush loads
/// its first pack: the first peer store then waits for one memory
/// latency, not for the control words and then the input.
macro_rules! first_send_pack {
    ($E:ty, $p:expr, $t:expr, $sh:expr, $packs:expr, $input:expr, $count:expr, $vin:expr) => {{
        let i = $crate::device::island_push::share_index($p.send_share[0]) * $sh + $t;
        if $p.sends > 0 && i < $packs {
            $crate::device::island_push::load_message_pack::<$E>($input, $count, i as u64, $vin)
        } else {
            $crate::device::pack::ZERO_PACK
        }
    }};
}
pub(super) use first_send_pack;

/// Phase A, sends `$from..$to` (at most GROUP) of reduce-scatter position
/// `$t` (byte offset `$off` in the half): the input packs loaded back to
/// back (send 0's is `$first`, loaded earlier: `first_send_pack!`), then
/// stored canonicalised to the owners' slots (posted relaxed.sys stores)
/// unless `$abort` (the abort word read at entry) is set. `$p`: the
/// `IslandPushParams` (never borrowed).
macro_rules! send_group {
    ($E:ty, $p:expr, $t:expr, $sh:expr, $packs:expr, $off:expr, $input:expr, $count:expr, $vin:expr, $abort:expr,
     $first:expr, $from:literal, $to:literal) => {
        let mut v = [$crate::device::pack::ZERO_PACK; $crate::device::island_push::GROUP];
        $crate::for_each_rank!(S => {
            if S == 0 && $from == 0 {
                v[0] = $first;
            } else if S >= $from && S < $to && (S as u32) < $p.sends {
                let i = $crate::device::island_push::share_index($p.send_share[S]) * $sh + $t;
                if i < $packs {
                    v[(S - $from) % $crate::device::island_push::GROUP] =
                        $crate::device::island_push::load_message_pack::<$E>($input, $count, i as u64, $vin);
                }
            }
        });
        $crate::for_each_rank!(S => {
            if $abort == 0 && S >= $from && S < $to && (S as u32) < $p.sends
                && $crate::device::island_push::share_index($p.send_share[S]) * $sh + $t < $packs
            {
                let value = <$E>::canonicalise(v[(S - $from) % $crate::device::island_push::GROUP]);
                $crate::device::ptx::st_relaxed_sys_v4_u32(($p.rs_to[S] + $off) as *mut u32, value);
            }
        });
    };
}
pub(super) use send_group;

/// Phase A at position `$t` of every share: every send, in groups (the
/// first send alone, its pack `$first` loaded ahead: `first_send_pack!`),
/// so that the first peer store waits for one input load only. Share `k`
/// covers packs `k * $sh ..` below `$packs`.
macro_rules! reduce_scatter_sends {
    ($E:ty, $p:expr, $t:expr, $sh:expr, $packs:expr, $off:expr, $input:expr, $count:expr, $vin:expr, $abort:expr,
     $first:expr) => {
        $crate::device::island_push::send_group!(
            $E, $p, $t, $sh, $packs, $off, $input, $count, $vin, $abort, $first, 0, 1
        );
        $crate::device::island_push::send_group!(
            $E, $p, $t, $sh, $packs, $off, $input, $count, $vin, $abort, $first, 1, 3
        );
        $crate::device::island_push::send_group!(
            $E, $p, $t, $sh, $packs, $off, $input, $count, $vin, $abort, $first, 3, 5
        );
        $crate::device::island_push::send_group!(
            $E, $p, $t, $sh, $packs, $off, $input, $count, $vin, $abort, $first, 5, 7
        );
        $crate::device::island_push::send_group!(
            $E, $p, $t, $sh, $packs, $off, $input, $count, $vin, $abort, $first, 7, 8
        );
    };
}
pub(super) use reduce_scatter_sends;

/// Polls `$count` slots of `$Q`-indexed addresses (group `$group` of
/// GROUP slots), back to back, then per slot: spin while EMPTY, reset
/// (reset on consume), accumulate into `$acc`; the own term `$mine` goes in
/// before slot `$own` (sources in order, own position left out). A wait
/// that gives up runs `$fail` with the `Stall` and the peer's rank (it
/// must leave the group: `break` or `return`). The failure is handled in
/// place rather than returned: carrying a `Result` out of the unrolled
/// groups costs registers (spills at 64).
macro_rules! poll_group {
    ($E:ty, $control:expr, $timeout:expr, $acc:ident, $mine:ident, $count:expr, $own:expr, $group:literal,
     $Q:ident => $addr:expr, $abort:expr, $peer:expr, |$s:ident, $who:ident| $fail:expr) => {
        let mut got = [$crate::device::pack::ZERO_PACK; $crate::device::island_push::GROUP];
        $crate::for_each_rank!($Q => {
            if $Q / $crate::device::island_push::GROUP == $group && ($Q as u32) < $count {
                got[$Q % $crate::device::island_push::GROUP] =
                    $crate::device::ptx::ld_relaxed_sys_v4_u32(($addr) as *const u32);
            }
        });
        $crate::for_each_rank!($Q => {
            // The own term before slot `$own`; when `$own` is past the
            // last slot `poll_terms!` adds it after the groups.
            if $Q / $crate::device::island_push::GROUP == $group && $Q as u32 == $own && ($Q as u32) < $count {
                <$E>::accumulate(&mut $acc, &$mine);
            }
            if $Q / $crate::device::island_push::GROUP == $group && ($Q as u32) < $count {
                let slot = ($addr) as *mut u32;
                let mut w = got[$Q % $crate::device::island_push::GROUP];
                if $crate::device::pack::any_word_empty(&w) {
                    let abort = ($abort) as *const u32;
                    match $crate::device::sentinel::wait_slot(slot, $Q as u32, abort, $control, $timeout) {
                        Ok(arrived) => w = arrived,
                        Err($s) => {
                            let $who = ($peer) as u32;
                            $fail
                        }
                    }
                }
                $crate::device::ptx::st_global_v4_u32(slot, [$crate::layout::SENTINEL_EMPTY_WORD; 4]);
                <$E>::accumulate(&mut $acc, &w);
            }
        });
    };
}
pub(super) use poll_group;

/// The sum into `$acc` of `$count` slots and the own term in source order
/// (the groups `[..]` of [`poll_group!`], then the own term when it comes
/// last); `$fail` as there.
macro_rules! poll_terms {
    ($E:ty, $control:expr, $timeout:expr, $acc:ident, $mine:ident, $count:expr, $own:expr, [$($group:literal),+],
     $Q:ident => $addr:expr, $abort:expr, $peer:expr, |$s:ident, $who:ident| $fail:expr) => {
        $(
            $crate::device::island_push::poll_group!($E, $control, $timeout, $acc, $mine, $count, $own, $group,
                $Q => $addr, $abort, $peer, |$s, $who| $fail);
        )+
        if $own == $count {
            <$E>::accumulate(&mut $acc, &$mine);
        }
    };
}
pub(super) use poll_terms;

/// Phase B at owned pack `$i` (`$off`: its byte offset in the
/// reduce-scatter slots, hidden from LLVM once the own term's load is
/// issued): the island's partial sum in member order (`$others` slots, own
/// term `canonical(in[$i])` at member `$j`), canonicalised and stored to the
/// output; evaluates to it and the hidden offset. `$fail` as in
/// [`poll_group!`].
macro_rules! island_partial {
    ($E:ty, $p:expr, $control:expr, $timeout:expr, $others:expr, $j:expr, $i:expr, $off:expr, $input:expr,
     $count:expr, $vin:expr, $output:expr, $vout:expr, |$s:ident, $who:ident| $fail:expr) => {{
        let mine = <$E>::canonicalise($crate::device::island_push::load_message_pack::<$E>($input, $count, $i, $vin));
        let off = $crate::device::ptx::opaque_u64($off);
        let mut acc = $crate::device::island_push::NEG_ZERO_ACC;
        $crate::device::island_push::poll_terms!($E, $control, $timeout, acc, mine, $others, $j, [0, 1, 2, 3],
        Q => $p.rs_from[Q] + off, $p.rs_abort[Q], $p.rs_peer[Q], |$s, $who| $fail);
        let v = <$E>::canonicalise(<$E>::round(&acc));
        $crate::device::island_push::store_message_pack::<$E>($output, $count, $i, $vout, &v);
        (v, off)
    }};
}
pub(super) use island_partial;

/// Phase B (Hierarchical): the partial `$v` of owned share `$e` at position
/// `$t` to that share's owner in every other island (its cross slot of
/// this island, in the half of `$generation`).
macro_rules! cross_sends {
    ($p:expr, $generation:expr, $e:expr, $t:expr, $v:expr) => {
        let cross = $crate::device::ptx::opaque_u64(($generation & 1) as u64 * $p.cross_half_bytes + 16 * $t as u64);
        $crate::for_each_rank!(O => {
            if O < $crate::shares::MAX_ISLANDS - 1 && (O as u32) + 1 < $p.islands {
                $crate::device::ptx::st_relaxed_sys_v4_u32(
                    ($crate::device::island_push::pick_owned!($p.cross_to[O % ($crate::shares::MAX_ISLANDS - 1)], $e)
                        + cross) as *mut u32,
                    $v,
                );
            }
        });
    };
}
pub(super) use cross_sends;

/// Phase C (Hierarchical) at owned share `$e`, position `$t` (pack `$i`):
/// the final sum of the islands' partials in island order (own partial
/// read back from the output, where phase B stored it in this thread),
/// canonicalised, stored to the output and sent to the all-gather slot of
/// every other member. `$fail` as in [`poll_group!`].
macro_rules! island_final {
    ($E:ty, $p:expr, $control:expr, $timeout:expr, $generation:expr, $half:expr, $cap:expr, $others:expr, $e:expr,
     $t:expr, $i:expr, $count:expr, $output:expr, $vout:expr, |$s:ident, $who:ident| $fail:expr) => {
        let partial = $crate::device::island_push::load_message_pack::<$E>($output, $count, $i, $vout);
        let pos = $e as u64 * $cap + $t as u64;
        let off = $crate::device::ptx::opaque_u64($half + 16 * pos);
        let cross = $crate::device::ptx::opaque_u64(($generation & 1) as u64 * $p.cross_half_bytes + 16 * pos);
        let mut acc = $crate::device::island_push::NEG_ZERO_ACC;
        $crate::device::island_push::poll_terms!($E, $control, $timeout, acc, partial, $p.islands - 1, $p.island, [0, 1],
        O => $p.cross_from[O % $crate::shares::MAX_ISLANDS] + cross,
        $crate::device::island_push::pick_owned!($p.cross_abort[O % ($crate::shares::MAX_ISLANDS - 1)], $e),
        $crate::device::island_push::pick_owned!($p.cross_peer[O % ($crate::shares::MAX_ISLANDS - 1)], $e),
        |$s, $who| $fail);
        let f = <$E>::canonicalise(<$E>::round(&acc));
        $crate::device::island_push::store_message_pack::<$E>($output, $count, $i, $vout, &f);
        $crate::for_each_rank!(Q => {
            if (Q as u32) < $others {
                $crate::device::ptx::st_relaxed_sys_v4_u32(($p.ag_to[Q] + off) as *mut u32, f);
            }
        });
    };
}
pub(super) use island_final;

/// Phase D at position `$t` (byte offset `$off`), sends of group
/// `$group`: the all-gather slots polled back to back, then each waited for
/// while EMPTY, reset, and handed to `$store` as pack `$i` (u32) of the
/// message with value `$w`; `$fail` as in [`poll_group!`].
macro_rules! gather_group {
    ($p:expr, $control:expr, $timeout:expr, $t:expr, $sh:expr, $packs:expr, $off:expr, $group:literal,
     |$i:ident, $w:ident| $store:expr, |$s:ident, $who:ident| $fail:expr) => {
        let mut got = [$crate::device::pack::ZERO_PACK; $crate::device::island_push::GROUP];
        $crate::for_each_rank!(S => {
            if S / $crate::device::island_push::GROUP == $group && (S as u32) < $p.sends
                && $crate::device::island_push::share_index($p.send_share[S]) * $sh + $t < $packs
            {
                got[S % $crate::device::island_push::GROUP] =
                    $crate::device::ptx::ld_relaxed_sys_v4_u32(($p.ag_from[S] + $off) as *const u32);
            }
        });
        $crate::for_each_rank!(S => {
            let $i = $crate::device::island_push::share_index($p.send_share[S]) * $sh + $t;
            if S / $crate::device::island_push::GROUP == $group && (S as u32) < $p.sends && $i < $packs {
                let slot = ($p.ag_from[S] + $off) as *mut u32;
                let mut $w = got[S % $crate::device::island_push::GROUP];
                if $crate::device::pack::any_word_empty(&$w) {
                    let abort = $p.ag_abort[S] as *const u32;
                    match $crate::device::sentinel::wait_slot(slot, S as u32, abort, $control, $timeout) {
                        Ok(arrived) => $w = arrived,
                        Err($s) => {
                            let $who = $p.ag_peer[S] as u32;
                            $fail
                        }
                    }
                }
                $crate::device::ptx::st_global_v4_u32(slot, [$crate::layout::SENTINEL_EMPTY_WORD; 4]);
                $store;
            }
        });
    };
}
pub(super) use gather_group;

/// Phase D at position `$t` of every share owned elsewhere in the island
/// (the groups of [`gather_group!`]).
macro_rules! gather_sends {
    ($p:expr, $control:expr, $timeout:expr, $t:expr, $sh:expr, $packs:expr, $off:expr,
     |$i:ident, $w:ident| $store:expr, |$s:ident, $who:ident| $fail:expr) => {
        $crate::device::island_push::gather_sends!(@groups [0 1 2 3] $p, $control, $timeout, $t, $sh, $packs, $off,
            |$i, $w| $store, |$s, $who| $fail);
    };
    (@groups [$($group:literal)*] $p:expr, $control:expr, $timeout:expr, $t:expr, $sh:expr, $packs:expr, $off:expr,
     |$i:ident, $w:ident| $store:expr, |$s:ident, $who:ident| $fail:expr) => {
        $(
            $crate::device::island_push::gather_group!(
                $p, $control, $timeout, $t, $sh, $packs, $off, $group, |$i, $w| $store, |$s, $who| $fail
            );
        )*
    };
}
pub(super) use gather_sends;

/// The kernel body. `CROSS`: Hierarchical (phases A-D); otherwise
/// TwoShotPush (A, B, D; the partial is the final sum).
#[inline(always)]
#[allow(unused_comparisons)] // `S >= 0` in the first send group
pub(super) unsafe fn island_push<E: Element, const CROSS: bool>(p: IslandPushParams) {
    let trace = Trace::start(p.h.flags & FLAG_TRACE != 0, p.h.trace);
    let control = p.h.control as *mut Control;
    let region = if CROSS { RegionId::Hierarchical } else { RegionId::TwoShotPush };
    let algorithm = if CROSS { AlgorithmId::Hierarchical } else { AlgorithmId::TwoShotPush };

    // ---- Entry: the control words and the first input packs in flight
    //      together (the send loop loads before it looks at `abort`).
    let (abort, generation) = sentinel::entry(control, region);
    // Pack indices are u32 (fewer registers): the host keeps a launch far
    // below 2^32 packs (`max_chunk_bytes`).
    let count = p.h.count;
    let packs = div_ceil(count, E::LANES as u64) as u32;
    let sh = packs.div_ceil(p.shares);
    let threads = ptx::block_dim_x();
    let first = ptx::block_idx_x() * threads + ptx::thread_idx_x();
    let stride = ptx::grid_dim_x() * threads;
    let input = p.h.input as *const u8;
    let vin = aligned16(p.h.input);
    let half = (generation & 1) as u64 * p.h.half_bytes;

    // ---- A: reduce-scatter. Each share not owned here goes to its owner's
    //      reduce-scatter slot of this rank (posted relaxed.sys stores),
    //      owners in the staggered order of `send_share`.
    let mut t = first;
    let mut next = first_send_pack!(E, p, t, sh, packs, input, count, vin);
    if abort == 0 {
        trace.loaded(generation);
    }
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

    // ---- Generation: block barrier (block-uniform stop on abort), the block
    //      counted; the last block of the launch advances it, at the end
    //      where FINISH_GENERATION_LATE (the count's answer off the polls).
    let (aborted, block_count) = sentinel::count_block(control, region, abort != 0, true);
    if aborted {
        return; // not counted: nothing to finish
    }
    if !sentinel::FINISH_GENERATION_LATE {
        sentinel::finish_generation(control, region, generation, block_count, true);
    }

    let output = p.h.output as *mut u8;
    let vout = aligned16(p.h.output);
    // Every wait of this family may be on a peer that has not launched the
    // call yet, directly or through the shares it forwards (a late member
    // of another island delays this island's finals): the launch bound.
    let timeout = p.h.launch_timeout_ns;
    let members = p.members;
    let j = p.member_index;
    let cap = p.share_cap;
    let mut stall: Option<(Stall, Phase, u32)> = None;
    'kernel: {
        // ---- B: partial sums of the owned shares (member order), then on
        //      to the other islands' owners (Hierarchical) or to every
        //      member (TwoShotPush: the partial is the final sum).
        let others = members - 1;
        let mut e = 0u32;
        while e < p.owned {
            let base = (j + e * members) * sh;
            let mut t = first;
            while t < sh && base + t < packs {
                let i = (base + t) as u64;
                let (v, off) = island_partial!(
                    E,
                    p,
                    control,
                    timeout,
                    others,
                    j,
                    i,
                    half + 16 * (e as u64 * cap + t as u64),
                    input,
                    count,
                    vin,
                    output,
                    vout,
                    |s, peer| {
                        stall = Some((s, Phase::RsPayload, peer));
                        break 'kernel;
                    }
                );
                if CROSS {
                    cross_sends!(p, generation, e, t, v);
                } else {
                    for_each_rank!(Q => {
                        if (Q as u32) < others {
                            ptx::st_relaxed_sys_v4_u32((p.ag_to[Q] + off) as *mut u32, v);
                        }
                    });
                }
                t += stride;
            }
            e += 1;
        }

        // ---- C (Hierarchical): final sums of the owned shares (island
        //      order, own partial from B), then to every other member.
        if CROSS {
            let mut e = 0u32;
            while e < p.owned {
                let base = (j + e * members) * sh;
                let mut t = first;
                while t < sh && base + t < packs {
                    let i = (base + t) as u64;
                    island_final!(
                        E,
                        p,
                        control,
                        timeout,
                        generation,
                        half,
                        cap,
                        others,
                        e,
                        t,
                        i,
                        count,
                        output,
                        vout,
                        |s, peer| {
                            stall = Some((s, Phase::CrossPayload, peer));
                            break 'kernel;
                        }
                    );
                    t += stride;
                }
                e += 1;
            }
        }

        // ---- D: all-gather. The final sums of the shares owned elsewhere
        //      in the island (polled back to back per group, reset, stored).
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
        trace.polled(generation);
    }
    if sentinel::FINISH_GENERATION_LATE {
        sentinel::finish_generation(control, region, generation, block_count, true);
    }
    if let Some((s, phase, peer)) = stall {
        let record = p.h.error_record as *mut ErrorRecord;
        sentinel::give_up_at(control, p.h.abort as *mut u32, record, algorithm, phase, p.h.rank, peer, generation, s);
        return;
    }
    trace.exit(generation);
}
