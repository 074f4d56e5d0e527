//! Cross-rank synchronisation: bounded flag waits, the per-block barrier
//! between ranks, error recording and the sticky abort.
//!
//! # The contract (also in ARCHITECTURE.md)
//! * A rank announces "my block `b` reached `phase` of call `e`" by
//!   `st.release.sys` of `e` into `flags[phase][b][me]` of the peer's signal
//!   block. Before that store, `bar.sync` orders every access of *all*
//!   threads of the block before the releasing thread's store; the release is
//!   cumulative, so the peer that acquires the flag also sees those accesses.
//! * The peer observes it with `ld.acquire.sys` in a bounded loop, then a
//!   block barrier (`bar.red.or`) orders the acquire before every thread's
//!   later accesses.
//! * Flags only grow (wrapping `u32`) and are compared with a wrap-aware
//!   `>=`: a peer that already announced `e + 1` also satisfies a wait for
//!   `e`, so no slot is ever reset and graph replays need no host action.
//! * No atomics touch peer or host memory.
//! * Every wait gives up after `DeviceHandle::timeout_ns`, records who waited
//!   for whom in the error record, publishes this rank's `abort` flag so that
//!   ranks waiting on it stop early, and makes every later kernel of this
//!   rank exit at its prologue (sticky abort).

use super::ptx;
use crate::ids::{AlgorithmId, DeviceErrorCode, Phase};
use crate::layout::{DeviceHandle, ErrorRecord, LocalState, SignalBlock, MAX_RANKS};
use crate::partition::seq_geq;

/// Unrolls `$body` for `$p` in `0..MAX_RANKS` (constant indices keep
/// per-rank arrays in registers and let loads to all peers issue back to
/// back). The body is skipped for `$p >= MAX_RANKS`; the expansion covers 16.
#[macro_export]
macro_rules! for_each_rank {
    ($p:ident => $body:block) => {
        $crate::for_each_rank!(@one $p 0 $body);
        $crate::for_each_rank!(@one $p 1 $body);
        $crate::for_each_rank!(@one $p 2 $body);
        $crate::for_each_rank!(@one $p 3 $body);
        $crate::for_each_rank!(@one $p 4 $body);
        $crate::for_each_rank!(@one $p 5 $body);
        $crate::for_each_rank!(@one $p 6 $body);
        $crate::for_each_rank!(@one $p 7 $body);
        $crate::for_each_rank!(@one $p 8 $body);
        $crate::for_each_rank!(@one $p 9 $body);
        $crate::for_each_rank!(@one $p 10 $body);
        $crate::for_each_rank!(@one $p 11 $body);
        $crate::for_each_rank!(@one $p 12 $body);
        $crate::for_each_rank!(@one $p 13 $body);
        $crate::for_each_rank!(@one $p 14 $body);
        $crate::for_each_rank!(@one $p 15 $body);
    };
    (@one $p:ident $n:literal $body:block) => {
        if $n < $crate::layout::MAX_RANKS {
            #[allow(clippy::identity_op)]
            const $p: usize = if $n < $crate::layout::MAX_RANKS { $n } else { 0 };
            $body
        }
    };
}

/// Spins between timer reads in a wait loop.
const SPINS_PER_CHECK: u32 = 32;

/// Per-block context of one kernel invocation.
pub struct Ctx<'a> {
    pub h: &'a DeviceHandle,
    pub algorithm: AlgorithmId,
    pub rank: u32,
    pub world: u32,
    pub block: u32,
    pub tid: u32,
    pub epoch: u32,
    /// Whether this block passed a barrier of the call with every rank:
    /// every rank has started the call, so later waits are bounded by
    /// `timeout_ns` (a stall), earlier ones by `launch_timeout_ns` (a peer
    /// may not have launched the call yet). Waits that do not follow a
    /// barrier of all ranks (the ring: a chunk's progress depends on every
    /// rank upstream) keep the launch bound.
    pub started: core::cell::Cell<bool>,
}

impl<'a> Ctx<'a> {
    /// # Safety
    /// `handle` points to this rank's device handle.
    #[inline(always)]
    pub unsafe fn new(handle: *const DeviceHandle, algorithm: AlgorithmId) -> Ctx<'a> {
        let h = &*handle;
        Ctx {
            h,
            algorithm,
            rank: h.rank,
            world: h.world_size,
            block: ptx::block_idx_x(),
            tid: ptx::thread_idx_x(),
            epoch: 0,
            started: core::cell::Cell::new(false),
        }
    }

    #[inline(always)]
    pub fn signal(&self, rank: u32) -> *mut SignalBlock {
        // SAFETY (for callers dereferencing it): `signals[rank]` was filled by
        // the host for every rank < world_size.
        unsafe { *self.h.signals.get_unchecked(rank as usize) as *mut SignalBlock }
    }

    #[inline(always)]
    pub fn scratch(&self, rank: u32) -> *mut u8 {
        unsafe { *self.h.scratch.get_unchecked(rank as usize) as *mut u8 }
    }

    #[inline(always)]
    pub fn local(&self) -> *mut LocalState {
        self.h.local_state as *mut LocalState
    }

    /// Kernel prologue, called by every thread: false when this rank is
    /// already aborted (an earlier call failed), in which case the kernel must
    /// return at once. Sticky abort is what makes every later call fail fast
    /// after a timeout instead of reading half-synchronised buffers.
    #[inline(always)]
    pub unsafe fn begin(&self) -> bool {
        let aborted =
            if self.tid == 0 { ptx::ld_relaxed_sys_u32(&(*self.signal(self.rank)).abort) != 0 } else { false };
        !ptx::bar_red_or(aborted)
    }

    /// Address of `flags[phase][block][src]` in `owner`'s signal block.
    #[inline(always)]
    pub unsafe fn flag(&self, owner: u32, phase: Phase, block: u32, src: u32) -> *mut u32 {
        let sig = self.signal(owner);
        (*sig).flags.get_unchecked_mut(phase as usize).get_unchecked_mut(block as usize).get_unchecked_mut(src as usize)
            as *mut u32
    }

    /// `st.release.sys` of `value` into `flags[phase][self.block][self.rank]`
    /// of rank `peer`: "my block reached `phase` with `value`".
    #[inline(always)]
    pub unsafe fn signal_peer(&self, peer: u32, phase: Phase, value: u32) {
        ptx::st_release_sys_u32(self.flag(peer, phase, self.block, self.rank), value);
    }

    /// Waits until `flags[phase][self.block][src]` of this rank is `>= target`
    /// (wrap-aware), bounded by the timeout. Called by one thread per flag.
    /// False when the wait failed (timeout or the peer aborted); the error is
    /// recorded.
    #[inline(always)]
    pub unsafe fn wait_flag(&self, phase: Phase, src: u32, target: u32) -> bool {
        let flag = self.flag(self.rank, phase, self.block, src);
        self.wait_value_geq(flag, target, phase, src)
    }

    /// Bounded spin until `*flag >= target` (wrap-aware) with an acquire load.
    /// `peer` is the rank expected to write the flag (checked for abort).
    #[inline(always)]
    pub unsafe fn wait_value_geq(&self, flag: *const u32, target: u32, phase: Phase, peer: u32) -> bool {
        // An acquire load per iteration. (Measured: relaxed loads plus one
        // fence after the flag is seen were slower, 9.0 -> 13.0 us per
        // OneShotPull with 8 ranks on one H200; docs/RESULTS.md.)
        let mut v = ptx::ld_acquire_sys_u32(flag);
        if seq_geq(v, target) {
            return true;
        }
        let start = ptx::globaltimer_ns();
        let mut spins: u32 = 0;
        loop {
            v = ptx::ld_acquire_sys_u32(flag);
            if seq_geq(v, target) {
                return true;
            }
            spins = spins.wrapping_add(1);
            if spins % SPINS_PER_CHECK == 0 {
                if let Some(code) = self.wait_should_stop(start, peer) {
                    let waited = ptx::globaltimer_ns().wrapping_sub(start);
                    self.record_error(code, phase, peer, target, v, waited);
                    return false;
                }
            }
        }
    }

    /// Called from inside a spin loop every `SPINS_PER_CHECK` iterations:
    /// `Some(code)` when the wait must end (timeout, peer aborted, or this
    /// rank aborted by another block).
    #[inline(always)]
    pub unsafe fn wait_should_stop(&self, start: u64, peer: u32) -> Option<DeviceErrorCode> {
        let now = ptx::globaltimer_ns();
        let bound = if self.started.get() { self.h.timeout_ns } else { self.h.launch_timeout_ns };
        if now.wrapping_sub(start) > bound {
            return Some(DeviceErrorCode::Timeout);
        }
        if peer < self.world && peer != self.rank && ptx::ld_relaxed_sys_u32(&(*self.signal(peer)).abort) != 0 {
            return Some(DeviceErrorCode::PeerAborted);
        }
        if ptx::ld_relaxed_sys_u32(&(*self.signal(self.rank)).abort) != 0 {
            // Another block of this rank gave up; its record names the cause.
            return Some(DeviceErrorCode::PeerAborted);
        }
        None
    }

    /// Records an error once per communicator and publishes the abort flag.
    #[inline(always)]
    pub unsafe fn record_error(
        &self,
        code: DeviceErrorCode,
        phase: Phase,
        peer: u32,
        expected: u32,
        observed: u32,
        waited_ns: u64,
    ) {
        let local = self.local();
        // Only the first failing thread of this rank fills the record
        // (gpu-scope CAS on device-local memory; no peer atomics).
        if ptx::atom_cas_relaxed_gpu_u32(&mut (*local).control.error_claim, 0, 1) == 0 {
            let rec = self.h.error_record as *mut ErrorRecord;
            if !rec.is_null() {
                (*rec).code = code as u32;
                (*rec).algorithm = self.algorithm as u32;
                (*rec).phase = phase as u32;
                (*rec).rank = self.rank;
                (*rec).peer = peer;
                (*rec).block = self.block;
                (*rec).epoch = self.epoch;
                (*rec).expected = expected;
                (*rec).observed = observed;
                (*rec).waited_ns = waited_ns;
                // Publishes the fields above to the host.
                ptx::st_release_sys_u32(&mut (*rec).published, 1);
            }
        }
        // Sticky abort, visible to peers (they stop waiting on us) and to this
        // rank's later kernels (they exit at the prologue); the rank-local
        // copy is what the sentinel kernels read at entry.
        ptx::st_relaxed_gpu_u32(&mut (*local).control.abort, code as u32);
        ptx::st_release_sys_u32(&mut (*self.signal(self.rank)).abort, code as u32);
    }

    /// Barrier of block `self.block` with the same block of every rank, for
    /// `phase` of call `self.epoch`. Every thread of the block calls it; all
    /// get the same answer (false: a wait failed, the kernel must return).
    ///
    /// Orders: every access of this block before the call happens-before
    /// every access of the same-index block of every rank after the call.
    #[inline(always)]
    pub unsafe fn barrier(&self, phase: Phase) -> bool {
        // (1) Gather the block: all threads' prior accesses are ordered before
        //     the release stores below.
        ptx::bar_sync();
        let mut failed = false;
        if self.tid < self.world {
            let peer = self.tid;
            // (2) Announce: release publishes this block's prior accesses.
            self.signal_peer(peer, phase, self.epoch);
            // (3) Acquire the peer's announcement for this epoch.
            failed = !self.wait_flag(phase, peer, self.epoch);
        }
        // (4) Spread the acquires (and any failure) to the whole block.
        let passed = !ptx::bar_red_or(failed);
        // Every rank reached this barrier of the call: later waits are on
        // ranks known to run it.
        self.started.set(passed);
        passed
    }

    /// [`barrier`](Self::barrier) restricted to a group of ranks: thread
    /// `t < members` handles rank `peer_of(t)`. The group must contain this
    /// rank and be the same (as a set) on every member.
    #[inline(always)]
    pub unsafe fn barrier_among(&self, phase: Phase, members: u32, peer_of: impl Fn(u32) -> u32) -> bool {
        ptx::bar_sync();
        let mut failed = false;
        if self.tid < members {
            let peer = peer_of(self.tid);
            self.signal_peer(peer, phase, self.epoch);
            failed = !self.wait_flag(phase, peer, self.epoch);
        }
        !ptx::bar_red_or(failed)
    }

    /// The reason a launch is malformed (host bug): recorded, kernel returns.
    #[inline(always)]
    pub unsafe fn bad_launch(&self, detail: u32) {
        self.record_error(DeviceErrorCode::BadLaunch, Phase::Prologue, u32::MAX, detail, 0, 0);
    }
}

/// Rank count bound used by loops that cannot unroll.
pub const MAX_RANKS_U32: u32 = MAX_RANKS as u32;
