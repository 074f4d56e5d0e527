//! The init-time P2P transfer check: some systems report P2P access yet
//! corrupt or drop the data (IOMMU settings, patched drivers), so every
//! communicator moves a known pattern over every pair, both directions.
//!
//! One block; thread `w < P2P_CHECK_WORDS` handles word `w`:
//! * write: `p2p_pattern(me, p, w, salt)` into `p2p_inbox[me][w]` of every
//!   rank `p` (a posted write over the link);
//! * read: rank `p`'s `p2p_outbox[w]` (written by its host at init) into this
//!   rank's `LocalState::p2p_read_back[p][w]` (a non-posted read).
//!
//! The host orders everything around the kernel (stream sync, then a
//! rendezvous barrier) and compares both areas with the expected patterns.

use super::ptx;
use super::sync::Ctx;
use crate::ids::AlgorithmId;
use crate::layout::{p2p_pattern, DeviceHandle, P2P_CHECK_WORDS};

#[no_mangle]
pub unsafe extern "ptx-kernel" fn p2p_check(handle: *const DeviceHandle, salt: u32) {
    let ctx = Ctx::new(handle, AlgorithmId::P2pCheck);
    let w = ctx.tid;
    if ctx.block != 0 || w as usize >= P2P_CHECK_WORDS {
        return;
    }
    let local = ctx.local();
    for p in 0..ctx.world {
        let sig = ctx.signal(p);
        ptx::st_relaxed_sys_u32(
            &mut (*sig).p2p_inbox[ctx.rank as usize][w as usize],
            p2p_pattern(ctx.rank, p, w, salt),
        );
        let seen = ptx::ld_relaxed_sys_u32(&(*sig).p2p_outbox[w as usize]);
        (*local).p2p_read_back[p as usize][w as usize] = seen;
    }
    ptx::fence_sc_sys();
}
