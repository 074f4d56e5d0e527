//! The init-time P2P transfer check: some systems report P2P access yet
//! corrupt, drop or reorder the data (IOMMU settings, patched drivers), so
//! every communicator runs a known-pattern self-test of the real protocol
//! over every pair, both directions, before it trusts the transport.
//!
//! One block per rank. Phases (every rank, all threads unless noted):
//! 1. **Data.** Write this rank's `p2p_outbox` (local), then a burst of
//!    `P2P_CHECK_WORDS` words into `p2p_inbox[me]` of every rank, peers
//!    visited `me+1, me+2, ...` as the push algorithms do. Every store is a
//!    16-byte vector store (`st.global.v4`), word `w` = `p2p_pattern(me,
//!    dst, w, salt)` (`dst = u32::MAX` for the outbox).
//! 2. **Flag after data.** `bar.sync`, then thread `p` releases
//!    `p2p_flag(me, salt)` into `p2p_flag[me]` of rank `p` (`st.release.sys`):
//!    the barrier orders every thread's data stores before the release, which
//!    is cumulative — the announce rule of every algorithm.
//! 3. **Observe.** Thread `src` polls this rank's `p2p_flag[src]` with
//!    `ld.acquire.sys`, bounded by the communicator's timeout, and records the
//!    last value seen in `LocalState::p2p_flag_seen[src]`; a barrier then
//!    orders those acquires before every thread's reads (the observe rule).
//! 4. **Verify.** For every source whose flag arrived, each thread reads its
//!    words of `p2p_inbox[src]` here (what the push algorithms do) and of rank
//!    `src`'s `p2p_outbox` (a non-posted read over the link, what the pull
//!    algorithms do), with 16-byte loads, and counts wrong words into
//!    `p2p_pushed_bad[src]` / `p2p_pulled_bad[src]` (device-local atomics).
//!
//! The host then compares the inbox as it finally landed with the pattern:
//! a word read wrong in phase 4 that is right afterwards arrived *after*
//! its flag (broken data-before-flag ordering); one wrong afterwards was
//! corrupted or lost. The kernel never sets `abort` nor fills the error
//! record: the host decides (fall back to host staging or fail).

use super::ptx;
use super::sync::Ctx;
use crate::ids::AlgorithmId;
use crate::layout::{p2p_flag, p2p_pattern, DeviceHandle, LocalState, SignalBlock, P2P_CHECK_WORDS};

/// Flag polls between two reads of the timer.
const POLLS_PER_TIMER_CHECK: u32 = 32;

#[no_mangle]
pub unsafe extern "ptx-kernel" fn p2p_check(handle: *const DeviceHandle, salt: u32) {
    let ctx = Ctx::new(handle, AlgorithmId::P2pCheck);
    if ctx.block != 0 {
        return;
    }
    let (me, world, tid) = (ctx.rank, ctx.world, ctx.tid);
    // Every thread handles words tid*4.., then every `stride` words.
    let first = tid as usize * 4;
    let stride = ptx::block_dim_x() as usize * 4;
    let own = ctx.signal(me);
    let local = ctx.local();

    // ---- Phase 1: data (weak 16-byte stores, published by phase 2).
    let outbox = outbox_ptr(own);
    let mut w = first;
    while w < P2P_CHECK_WORDS {
        ptx::st_global_v4_u32(outbox.add(w), pattern4(me, u32::MAX, w, salt));
        w += stride;
    }
    for k in 0..world {
        let p = (me + k) % world;
        let inbox = inbox_ptr(ctx.signal(p), me);
        let mut w = first;
        while w < P2P_CHECK_WORDS {
            ptx::st_global_v4_u32(inbox.add(w), pattern4(me, p, w, salt));
            w += stride;
        }
    }

    // ---- Phase 2: flag after data. The barrier orders every thread's stores
    // above before thread p's release below; the release is cumulative, so
    // rank p sees them once it acquires the flag.
    ptx::bar_sync();
    if tid < world {
        ptx::st_release_sys_u32(flag_ptr(ctx.signal(tid), me), p2p_flag(me, salt));
    }

    // ---- Phase 3: observe every source's flag (bounded), then a barrier
    // orders those acquires before every thread's reads in phase 4.
    if tid < world {
        let seen = wait_for_flag(flag_ptr(own, tid), p2p_flag(tid, salt), ctx.h.timeout_ns);
        *seen_ptr(local, tid) = seen;
    }
    ptx::bar_sync();

    // ---- Phase 4: verify what arrived here (pushed) and what each source
    // published (pulled). The branch is block-uniform: every thread reads the
    // same `p2p_flag_seen` word, written before the barrier.
    for src in 0..world {
        if *seen_ptr(local, src) != p2p_flag(src, salt) {
            continue;
        }
        let inbox = inbox_ptr(own, src);
        let peer_outbox = outbox_ptr(ctx.signal(src));
        let (mut pushed_bad, mut pulled_bad) = (0u32, 0u32);
        let mut w = first;
        while w < P2P_CHECK_WORDS {
            pushed_bad += mismatches(ptx::ld_global_v4_u32(inbox.add(w)), pattern4(src, me, w, salt));
            pulled_bad += mismatches(ptx::ld_global_v4_u32(peer_outbox.add(w)), pattern4(src, u32::MAX, w, salt));
            w += stride;
        }
        // Device-local counters (`LocalState` is never peer-visible).
        if pushed_bad != 0 {
            ptx::atom_add_acq_rel_sys_u32(counter_ptr(local, 0, src), pushed_bad);
        }
        if pulled_bad != 0 {
            ptx::atom_add_acq_rel_sys_u32(counter_ptr(local, 1, src), pulled_bad);
        }
    }
}

/// Words `w..w+4` of the pattern `src` sends to `dst`.
#[inline(always)]
fn pattern4(src: u32, dst: u32, w: usize, salt: u32) -> [u32; 4] {
    let w = w as u32;
    [
        p2p_pattern(src, dst, w, salt),
        p2p_pattern(src, dst, w + 1, salt),
        p2p_pattern(src, dst, w + 2, salt),
        p2p_pattern(src, dst, w + 3, salt),
    ]
}

#[inline(always)]
fn mismatches(got: [u32; 4], want: [u32; 4]) -> u32 {
    (got[0] != want[0]) as u32 + (got[1] != want[1]) as u32 + (got[2] != want[2]) as u32 + (got[3] != want[3]) as u32
}

/// Polls `*flag` with acquire loads until it equals `expected` or
/// `timeout_ns` passed; returns the last value seen.
#[inline(always)]
unsafe fn wait_for_flag(flag: *const u32, expected: u32, timeout_ns: u64) -> u32 {
    let start = ptx::globaltimer_ns();
    let mut polls: u32 = 0;
    loop {
        let v = ptx::ld_acquire_sys_u32(flag);
        if v == expected {
            return v;
        }
        polls = polls.wrapping_add(1);
        if polls % POLLS_PER_TIMER_CHECK == 0 && ptx::globaltimer_ns().wrapping_sub(start) > timeout_ns {
            return v;
        }
    }
}

// Raw element pointers (no bounds-checked indexing: a failed check would
// trap). Every rank index is below the world size, which is at most
// MAX_RANKS, and the host filled `signals[r]` for every rank r.

#[inline(always)]
unsafe fn outbox_ptr(sig: *mut SignalBlock) -> *mut u32 {
    core::ptr::addr_of_mut!((*sig).p2p_outbox).cast::<u32>()
}

#[inline(always)]
unsafe fn inbox_ptr(sig: *mut SignalBlock, src: u32) -> *mut u32 {
    core::ptr::addr_of_mut!((*sig).p2p_inbox).cast::<u32>().add(src as usize * P2P_CHECK_WORDS)
}

#[inline(always)]
unsafe fn flag_ptr(sig: *mut SignalBlock, src: u32) -> *mut u32 {
    core::ptr::addr_of_mut!((*sig).p2p_flag).cast::<u32>().add(src as usize)
}

#[inline(always)]
unsafe fn seen_ptr(local: *mut LocalState, src: u32) -> *mut u32 {
    core::ptr::addr_of_mut!((*local).p2p_flag_seen).cast::<u32>().add(src as usize)
}

/// `which` 0: `p2p_pushed_bad[src]`, 1: `p2p_pulled_bad[src]`.
#[inline(always)]
unsafe fn counter_ptr(local: *mut LocalState, which: u32, src: u32) -> *mut u32 {
    let base = if which == 0 {
        core::ptr::addr_of_mut!((*local).p2p_pushed_bad)
    } else {
        core::ptr::addr_of_mut!((*local).p2p_pulled_bad)
    };
    base.cast::<u32>().add(src as usize)
}
