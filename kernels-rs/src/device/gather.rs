//! Loads of one pack from several sources (ranks, island members, slots)
//! with every load issued before any is used.
//!
//! Why: the GPU issues in order, so a loop `acc += load(src)` waits for each
//! load before it issues the next one — N sources cost N memory latencies
//! (about a microsecond each over PCIe). Unrolled over `MAX_RANKS` with a
//! guard, all loads are in flight at once and the pack costs one latency.

use super::pack::{any_word_empty, Element, Pack, ZERO_PACK};
use super::ptx;
use super::sync::Ctx;
use crate::for_each_rank;
use crate::ids::Phase;
use crate::layout::MAX_RANKS;

/// Weak 128-bit loads of `addr_of(i)` for `i < count`.
#[inline(always)]
pub unsafe fn load_all(count: u32, addr_of: impl Fn(u32) -> *const u8) -> [Pack; MAX_RANKS] {
    let mut out = [ZERO_PACK; MAX_RANKS];
    for_each_rank!(P => {
        if (P as u32) < count {
            out[P] = ptx::ld_global_v4_u32(addr_of(P as u32) as *const u32);
        }
    });
    out
}

/// Sum of `packs[0..count]` in index order, accumulated in f32 from the
/// first operand, rounded once.
#[inline(always)]
pub fn sum_in_order<E: Element>(packs: &[Pack; MAX_RANKS], count: u32) -> Pack {
    let mut acc = E::to_acc(&packs[0]);
    for_each_rank!(P => {
        if P > 0 && (P as u32) < count {
            E::accumulate(&mut acc, &packs[P]);
        }
    });
    E::round(&acc)
}

/// Polls `addr_of(i)` for `i < count` (volatile 128-bit loads) until no
/// word of any of them is the empty pattern; bounded by the timeout.
/// `source_rank(i)` names the rank that writes source `i` (for the error
/// record). `None` after a recorded failure.
#[inline(always)]
pub unsafe fn poll_all(
    ctx: &Ctx,
    count: u32,
    addr_of: impl Fn(u32) -> *const u8,
    source_rank: impl Fn(u32) -> u32,
) -> Option<[Pack; MAX_RANKS]> {
    let mut out = [ZERO_PACK; MAX_RANKS];
    let mut pending: u32 = 0;
    for_each_rank!(P => {
        if (P as u32) < count {
            out[P] = ptx::ld_volatile_v4_u32(addr_of(P as u32) as *const u32);
            if any_word_empty(&out[P]) {
                pending |= 1 << P;
            }
        }
    });
    if pending == 0 {
        return Some(out);
    }
    let start = ptx::globaltimer_ns();
    let mut spins: u32 = 0;
    loop {
        for_each_rank!(P => {
            if pending & (1 << P) != 0 {
                out[P] = ptx::ld_volatile_v4_u32(addr_of(P as u32) as *const u32);
                if !any_word_empty(&out[P]) {
                    pending &= !(1 << P);
                }
            }
        });
        if pending == 0 {
            return Some(out);
        }
        spins = spins.wrapping_add(1);
        if spins % 32 == 0 {
            let waiting_on = source_rank(pending.trailing_zeros());
            if let Some(code) = ctx.wait_should_stop(start, waiting_on) {
                let waited = ptx::globaltimer_ns().wrapping_sub(start);
                let seen = pick_pack(&out, pending.trailing_zeros())[0];
                ctx.record_error(code, Phase::Payload, waiting_on, ctx.epoch, seen, waited);
                return None;
            }
        }
    }
}

/// `v[i]` without a dynamic index (which would move `v` to local memory):
/// a chain of compares over the constant indices.
#[inline(always)]
pub fn pick_pack(v: &[Pack; MAX_RANKS], i: u32) -> Pack {
    let mut out = ZERO_PACK;
    for_each_rank!(P => {
        if P as u32 == i {
            out = v[P];
        }
    });
    out
}

/// `v[i]` without a dynamic index (see [`pick_pack`]).
#[inline(always)]
pub fn pick_u32(v: &[u32; MAX_RANKS], i: u32) -> u32 {
    let mut out = 0;
    for_each_rank!(P => {
        if P as u32 == i {
            out = v[P];
        }
    });
    out
}
