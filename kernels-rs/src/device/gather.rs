//! Loads of one pack from several sources (ranks, island members, slots)
//! with every load issued before any is used.
//!
//! Why: the GPU issues in order, so a loop `acc += load(src)` waits for each
//! load before it issues the next one — N sources cost N memory latencies
//! (about a microsecond each over PCIe). Unrolled over `MAX_RANKS` with a
//! guard, all loads are in flight at once and the pack costs one latency.

use super::pack::{Element, Pack, ZERO_PACK};
use super::ptx;
use crate::for_each_rank;
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
