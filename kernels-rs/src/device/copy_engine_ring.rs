//! CopyEngineRing: the kernels of a ring allreduce whose data moves with
//! the copy engines (peer `cuMemcpyAsync` into the next rank's staging,
//! issued by the host inside the captured graph; `host/algorithm/
//! copy_engine_ring.rs` has the per-call sequence). Three small kernels:
//!
//! * `copy_engine_ring_<dtype>` (step): thread 0 of each block waits,
//!   bounded, with `ld.acquire.sys`, for the flag of one staging slot (the
//!   previous rank's copy of one piece has landed), a block barrier hands the
//!   acquire to every thread, then a grid-stride loop reduces
//!   (`out = in + staging`, rounded once) or copies (`out = staging`) the
//!   piece. The last block to finish (arrivals[3]) clears the flag and, on
//!   the call's last step, publishes "staging consumed" to the previous
//!   rank's handshake flag (`st.release.sys`).
//! * `copy_engine_ring_handshake` (one thread): before a call's first copy,
//!   waits (bounded) for the next rank's "staging consumed" of the previous
//!   call, and clears it.
//! * `copy_engine_ring_publish` (one thread): raises a peer's flag with
//!   `st.release.sys` after a copy, where stream memory operations
//!   (`cuStreamWriteValue32`) are unavailable; it runs after the copy on the
//!   copy stream.
//!
//! Ordering. Data before flag: the flag is written after the copy completed
//! on the same stream (`cuStreamWriteValue32` without NO_MEMORY_BARRIER
//! fences before its write; the publish kernel starts after the copy and
//! releases). Flag before data: thread 0's acquire, then `bar.red.or`,
//! orders every thread's staging loads after it; the loads are `.sys`
//! relaxed, so no stale L1 line of an earlier call's slot is read. Reuse:
//! flags are binary and cleared by their reader after every block of the
//! step saw them; a rank copies into the next rank's staging again only
//! after that rank's handshake, which it publishes after its last kernel of
//! the call consumed every slot (stream order) and which the copier's
//! handshake kernel clears. Nothing counts calls, so nothing has to agree
//! across the copy, flag and main streams, and graph replays need no host
//! action. Every wait is bounded (`Config::timeout`) and fails with the
//! phase (`CeData`, `CeHandshake`) and the peer.

use super::island_push::{load_message_pack, store_message_pack};
use super::pack::{aligned16, Element};
use super::ptx;
use super::sentinel::{self, Stall};
use crate::ids::{AlgorithmId, DeviceErrorCode, Phase};
use crate::layout::ErrorRecord;
use crate::params::{Control, CopyEngineParams, CE_MODE_REDUCE};
use crate::partition::div_ceil;

/// Spins between two checks of the timer and the abort words.
const SPINS_PER_CHECK: u32 = 64;
/// `Control::arrivals` index of the step kernels.
const ARRIVALS: usize = 3;

/// Bounded spin until `*flag == 1` (acquire loads). Checks the timeout, the
/// awaited peer's abort word and this rank's own abort every
/// `SPINS_PER_CHECK` loads.
#[inline(always)]
unsafe fn wait_raised(
    flag: *const u32,
    peer_abort: *const u32,
    control: *const Control,
    timeout_ns: u64,
) -> Result<(), Stall> {
    let mut v = ptx::ld_acquire_sys_u32(flag);
    if v == 1 {
        return Ok(());
    }
    let start = ptx::globaltimer_ns();
    let mut spins: u32 = 0;
    loop {
        v = ptx::ld_acquire_sys_u32(flag);
        if v == 1 {
            return Ok(());
        }
        spins = spins.wrapping_add(1);
        if spins % SPINS_PER_CHECK == 0 {
            let waited_ns = ptx::globaltimer_ns().wrapping_sub(start);
            let code = if waited_ns > timeout_ns {
                DeviceErrorCode::Timeout
            } else if ptx::ld_relaxed_sys_u32(peer_abort) != 0 || ptx::ld_relaxed_gpu_u32(&(*control).abort) != 0 {
                DeviceErrorCode::PeerAborted
            } else {
                continue;
            };
            return Err(Stall { code, slot: 0, observed: v, waited_ns });
        }
    }
}

/// Thread 0 of the block: `true` when the kernel must not go on (this rank
/// is aborted, or the wait for the flag failed and was recorded). A macro,
/// not a function taking `&CopyEngineParams`: a reference to the parameter
/// struct would copy it to local memory.
macro_rules! raised_or_stop {
    ($p:ident, $phase:expr) => {{
        let control = $p.control as *mut Control;
        if ptx::ld_relaxed_gpu_u32(&(*control).abort) != 0 {
            true
        } else {
            match wait_raised($p.flag as *const u32, $p.peer_abort as *const u32, control, $p.timeout_ns) {
                Ok(()) => false,
                Err(stall) => {
                    let record = $p.error_record as *mut ErrorRecord;
                    let (algorithm, own_abort) = (AlgorithmId::CopyEngineRing, $p.abort as *mut u32);
                    sentinel::give_up_at(control, own_abort, record, algorithm, $phase, $p.rank, $p.peer, 0, stall);
                    true
                }
            }
        }
    }};
}

/// The step kernel body (see the module docs).
#[inline(always)]
unsafe fn step<E: Element>(p: CopyEngineParams) {
    // ---- Wait: thread 0 acquires the slot's flag; the barrier hands the
    //      acquire (or the decision to stop) to every thread of the block.
    let stop = ptx::thread_idx_x() == 0 && raised_or_stop!(p, Phase::CeData);
    if ptx::bar_red_or(stop) {
        return;
    }

    // ---- Reduce or copy the piece (grid-stride; staging is 16-byte
    //      aligned, user pointers may not be).
    let count = p.count;
    let packs = div_ceil(count, E::LANES as u64);
    let threads = ptx::block_dim_x() as u64;
    let mut i = ptx::block_idx_x() as u64 * threads + ptx::thread_idx_x() as u64;
    let stride = ptx::grid_dim_x() as u64 * threads;
    let (input, output) = (p.input as *const u8, p.output as *mut u8);
    let (vin, vout) = (aligned16(p.input), aligned16(p.output));
    let reduce = p.mode == CE_MODE_REDUCE;
    while i < packs {
        let staged = ptx::ld_relaxed_sys_v4_u32((p.staging + 16 * i) as *const u32);
        let v = if reduce {
            let mut acc = E::to_acc(&load_message_pack::<E>(input, count, i, vin));
            E::accumulate(&mut acc, &staged);
            E::round(&acc)
        } else {
            staged
        };
        store_message_pack::<E>(output, count, i, vout, &v);
        i += stride;
    }

    // ---- Done with the slot: every load of the block has returned (its
    //      value was stored) once the barrier passes. The last block to
    //      arrive clears the flag and, on the call's last step, tells the
    //      previous rank its staging is free.
    ptx::bar_sync();
    if ptx::thread_idx_x() == 0 {
        let control = p.control as *mut Control;
        let blocks = ptx::grid_dim_x();
        // Orders this block's work before its arrival for the last block.
        ptx::fence_acq_rel_gpu();
        let last = blocks == 1 || ptx::atom_add_relaxed_gpu_u32(&mut (*control).arrivals[ARRIVALS], 1) == blocks - 1;
        if last {
            ptx::fence_acq_rel_gpu();
            if blocks != 1 {
                ptx::st_relaxed_gpu_u32(&mut (*control).arrivals[ARRIVALS], 0);
            }
            ptx::st_relaxed_sys_u32(p.flag as *mut u32, 0);
            if p.last != 0 {
                ptx::st_release_sys_u32(p.handshake as *mut u32, 1);
            }
        }
    }
}

macro_rules! step_entries {
    ($f32:ident, $f16:ident, $bf16:ident) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f32(p: CopyEngineParams) {
            step::<super::pack::F32>(p)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f16(p: CopyEngineParams) {
            step::<super::pack::F16>(p)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $bf16(p: CopyEngineParams) {
            step::<super::pack::Bf16>(p)
        }
    };
}

step_entries!(copy_engine_ring_f32, copy_engine_ring_f16, copy_engine_ring_bf16);

/// Before a call's first copy into the next rank's staging: wait (bounded)
/// until the next rank consumed the previous call's (its handshake, raised
/// at init for the first call), then clear it. One thread.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn copy_engine_ring_handshake(p: CopyEngineParams) {
    if ptx::thread_idx_x() == 0 && ptx::block_idx_x() == 0 && !raised_or_stop!(p, Phase::CeHandshake) {
        ptx::st_relaxed_sys_u32(p.flag as *mut u32, 0);
    }
}

/// Raises the flag at `flag` (a peer's) once the copy before it on this
/// stream completed: the fallback for devices without stream memory
/// operations. One thread.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn copy_engine_ring_publish(flag: u64) {
    if ptx::thread_idx_x() == 0 && ptx::block_idx_x() == 0 {
        ptx::st_release_sys_u32(flag as *mut u32, 1);
    }
}
