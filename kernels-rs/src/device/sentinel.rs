//! Steps shared by the sentinel kernels (payload carries its own
//! completion; see `one_shot_push.rs` for the protocol and its ordering
//! argument): the entry load of the control words, the per-launch
//! generation advance, the bounded wait on one receive slot, the cold
//! give-up path and the optional trace.
//!
//! Everything here takes scalars or raw pointers: the kernels' by-value
//! parameter structs must never be referenced (LLVM would copy them to
//! local memory).

use super::pack::{any_word_empty, Pack};
use super::ptx;
use crate::ids::{AlgorithmId, DeviceErrorCode, Phase};
use crate::layout::{ErrorRecord, SENTINEL_EMPTY_WORD};
use crate::params::{one_shot_push_source, Control, RegionId, TraceRecord, TRACE_RECORDS};

/// Spins between two checks of the timer and the abort words.
const SPINS_PER_CHECK: u32 = 64;

/// `(abort, generation of region)` of this rank: one `ld.relaxed.gpu.v4` of
/// the first 16 bytes of [`Control`] (abort and the three generations), so
/// both arrive together. Issue it first and use it late: the kernel's first
/// input load goes out while it is in flight.
#[inline(always)]
pub unsafe fn entry(control: *const Control, region: RegionId) -> (u32, u32) {
    let w = ptx::ld_relaxed_gpu_v4_u32(control as *const u32);
    let generation = match region {
        RegionId::OneShotPush => w[1],
        RegionId::TwoShotPush => w[2],
        RegionId::Hierarchical => w[3],
    };
    (w[0], generation)
}

/// Thread 0's place in the launch's arrival count (the arrivals before
/// its block), from [`count_block`]; meaningless in other threads.
#[derive(Clone, Copy)]
pub struct BlockCount(u32);

/// Whether the plain sentinel kernels (OneShotPush, TwoShotPush,
/// Hierarchical) wait for their block count's answer only at the end
/// ([`finish_generation`] after their polls) rather than at once, after
/// [`count_block`]. sm_90 and newer: thread 0 then polls while the atomic
/// is in flight. On sm_80 and sm_89 the answer held across the polls
/// spilled (OneShotPush bf16, TwoShotPush, Hierarchical at 64 registers),
/// so there it is waited for at once. The fused kernels decide for
/// themselves: the fused island push finishes at the end on every
/// architecture, the fused one-shot push too except its `_wide` entries.
pub const FINISH_GENERATION_LATE: bool = cfg!(target_feature = "sm_90");

/// Advances `generation[region]` once per launch, after this block's
/// pushes, in two halves: `count_block` here, [`finish_generation`] at
/// once or, where [`FINISH_GENERATION_LATE`], at the end of the kernel.
/// Called by every thread of every block with the `abort` it read at
/// entry; returns `true` when the kernel must stop (some thread of this
/// block saw the sticky abort): the answer is block-uniform, so no thread
/// polls while another of its block has returned. A stopped block is not
/// counted.
///
/// Why it is correct: the block barrier's predicate is each thread's
/// `abort`, which arrived in the same vector load as its `generation`; once
/// the barrier completes, every thread of the block holds its generation
/// value. Thread 0 then counts its block in `arrivals`; the last block of
/// the launch (whatever the scheduling order or residency) resets the
/// count and stores `generation + 1`, so no block of this launch can read
/// the new value. The next reader is the next kernel on this rank's stream
/// (kernel boundary). The atomic is relaxed: a release would wait for this
/// thread's outstanding peer stores.
///
/// A launch of one block counts nothing (its count stays 0, which is
/// `blocks - 1`): no atomic, no reset (measured on H200, 2 ranks at 4 KB:
/// the atomic made the one-block launch 0.07 us slower).
///
/// `may_be_one_block` (a constant in every caller): false where the launch
/// always has several blocks (the thread-block cluster entries, which trap
/// on a one-block cluster before counting: `epilogue::cluster_shape_check`);
/// there the grid-size test is left out.
///
/// Code shape (checked in SASS, `sentinel_atomic_is_not_warp_aggregated`
/// in the PTX tests): the atomic sits under one branch on the thread index
/// alone, adds 0 for a stopped block, and the grid-size condition is a
/// predicate inside its asm. Under `!stop && tid == 0` (and, in the
/// cluster entries, with the grid-size predicate) ptxas 13.0 turned it
/// into a warp-aggregated add (`VOTEU`, `POPC`, `ATOMG`, `SHFL.IDX` of the
/// answer) whose shuffle waits for the answer at once: thread 0 of every
/// block waited out the atomic's round trip before its first poll,
/// wherever the answer was used (docs/RESULTS.md).
#[inline(always)]
pub unsafe fn count_block(
    control: *mut Control,
    region: RegionId,
    aborted: bool,
    may_be_one_block: bool,
) -> (bool, BlockCount) {
    let stop = ptx::bar_red_or(aborted);
    let mut count = BlockCount(0);
    if ptx::thread_idx_x() == 0 {
        let arrivals = &mut (*control).arrivals[region as usize];
        count.0 = if may_be_one_block {
            ptx::atom_add_relaxed_gpu_u32_if(arrivals, (!stop) as u32, ptx::grid_dim_x() > 1)
        } else {
            ptx::atom_add_relaxed_gpu_u32(arrivals, (!stop) as u32)
        };
    }
    (stop, count)
}

/// Second half: the launch's last block (its thread 0) resets the count
/// and stores `generation + 1`. Every counted block must reach it once
/// before it exits, with `counted` true (`count_block`'s answer was "go
/// on"): a counted block that skipped it would leave the generation where
/// it is, and the next launch would reuse this launch's half of the
/// receive region. An uncounted block (it saw the abort) may return
/// without it, or call it with `counted` false.
#[inline(always)]
pub unsafe fn finish_generation(
    control: *mut Control,
    region: RegionId,
    generation: u32,
    count: BlockCount,
    counted: bool,
) {
    let blocks = ptx::grid_dim_x();
    if counted && ptx::thread_idx_x() == 0 && count.0 == blocks - 1 {
        let r = region as usize;
        if blocks != 1 {
            ptx::st_relaxed_gpu_u32(&mut (*control).arrivals[r], 0);
        }
        ptx::st_relaxed_gpu_u32(&mut (*control).generation[r], generation.wrapping_add(1));
    }
}

/// Why a wait gave up, for [`give_up`] (scalars only).
#[derive(Clone, Copy)]
pub struct Stall {
    pub code: DeviceErrorCode,
    /// The receive slot waited on.
    pub slot: u32,
    /// Its first word when the wait gave up.
    pub observed: u32,
    pub waited_ns: u64,
}

/// Bounded spin on receive slot `slot` (at `addr`) until none of its words
/// is EMPTY. Every `SPINS_PER_CHECK` loads it checks the timeout, the
/// source's abort and this rank's own abort word (another block gave up).
/// On failure the caller leaves its loops and calls [`give_up`] once, at the
/// end of the kernel, where nothing else is live (a call inside the loop
/// would make every value live across it spill).
#[inline(always)]
pub unsafe fn wait_slot(
    addr: *const u32,
    slot: u32,
    source_abort: *const u32,
    control: *const Control,
    timeout_ns: u64,
) -> Result<Pack, Stall> {
    let start = ptx::globaltimer_ns();
    let mut spins: u32 = 0;
    loop {
        let w = ptx::ld_relaxed_sys_v4_u32(addr);
        if !any_word_empty(&w) {
            return Ok(w);
        }
        spins = spins.wrapping_add(1);
        if spins % SPINS_PER_CHECK == 0 {
            let waited_ns = ptx::globaltimer_ns().wrapping_sub(start);
            let code = if waited_ns > timeout_ns {
                DeviceErrorCode::Timeout
            } else if ptx::ld_relaxed_sys_u32(source_abort) != 0 || ptx::ld_relaxed_gpu_u32(&(*control).abort) != 0 {
                // The source failed, or another block of this rank did (its
                // record names the cause).
                DeviceErrorCode::PeerAborted
            } else {
                continue;
            };
            return Err(Stall { code, slot, observed: w[0], waited_ns });
        }
    }
}

/// [`wait_slot`] for one word: spins (bounded, as `wait_slot`) while the
/// word at `addr` is EMPTY and returns it.
#[inline(always)]
pub unsafe fn wait_word(
    addr: *const u32,
    slot: u32,
    source_abort: *const u32,
    control: *const Control,
    timeout_ns: u64,
) -> Result<u32, Stall> {
    let start = ptx::globaltimer_ns();
    let mut spins: u32 = 0;
    loop {
        let w = ptx::ld_relaxed_sys_u32(addr);
        if w != SENTINEL_EMPTY_WORD {
            return Ok(w);
        }
        spins = spins.wrapping_add(1);
        if spins % SPINS_PER_CHECK == 0 {
            let waited_ns = ptx::globaltimer_ns().wrapping_sub(start);
            let code = if waited_ns > timeout_ns {
                DeviceErrorCode::Timeout
            } else if ptx::ld_relaxed_sys_u32(source_abort) != 0 || ptx::ld_relaxed_gpu_u32(&(*control).abort) != 0 {
                DeviceErrorCode::PeerAborted
            } else {
                continue;
            };
            return Err(Stall { code, slot, observed: w, waited_ns });
        }
    }
}

/// Records the failure of the wait on receive slot `stall.slot` once per
/// rank (the thread that wins `error_claim`) and publishes the sticky abort:
/// the rank-local copy that later kernels read at entry, and the
/// peer-visible word peers poll (`own_abort`). Out of line and cold: the
/// fast path carries none of it.
/// (Scalars only: an aggregate argument of a function that is not inlined
/// goes through local memory.)
#[inline(always)]
pub unsafe fn give_up(
    control: *mut Control,
    own_abort: *mut u32,
    record: *mut ErrorRecord,
    algorithm: AlgorithmId,
    rank: u32,
    generation: u32,
    stall: Stall,
) {
    let peer = one_shot_push_source(stall.slot, rank);
    give_up_cold(
        control,
        own_abort,
        record,
        algorithm as u32,
        Phase::Payload as u32,
        rank,
        peer,
        generation,
        stall.code as u32,
        stall.observed,
        stall.waited_ns,
    )
}

/// [`give_up`] for a wait of `phase` on rank `peer` (the island push
/// kernels and the copy-engine ring name the phase and the peer themselves;
/// `stall.slot` is not used).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn give_up_at(
    control: *mut Control,
    own_abort: *mut u32,
    record: *mut ErrorRecord,
    algorithm: AlgorithmId,
    phase: Phase,
    rank: u32,
    peer: u32,
    generation: u32,
    stall: Stall,
) {
    give_up_cold(
        control,
        own_abort,
        record,
        algorithm as u32,
        phase as u32,
        rank,
        peer,
        generation,
        stall.code as u32,
        stall.observed,
        stall.waited_ns,
    )
}

#[inline(never)]
#[cold]
#[allow(clippy::too_many_arguments)]
unsafe fn give_up_cold(
    control: *mut Control,
    own_abort: *mut u32,
    record: *mut ErrorRecord,
    algorithm: u32,
    phase: u32,
    rank: u32,
    peer: u32,
    generation: u32,
    code: u32,
    observed: u32,
    waited_ns: u64,
) {
    if ptx::atom_cas_relaxed_gpu_u32(&mut (*control).error_claim, 0, 1) == 0 && !record.is_null() {
        (*record).code = code;
        (*record).algorithm = algorithm;
        (*record).phase = phase;
        (*record).rank = rank;
        (*record).peer = peer;
        (*record).block = ptx::block_idx_x();
        (*record).epoch = generation;
        (*record).expected = generation;
        (*record).observed = observed;
        (*record).waited_ns = waited_ns;
        // Publishes the fields above to the host.
        ptx::st_release_sys_u32(&mut (*record).published, 1);
    }
    ptx::st_relaxed_gpu_u32(&mut (*control).abort, code);
    ptx::st_release_sys_u32(own_abort, code);
}

/// The trace of one launch, kept by thread 0 of block 0 when tracing is on
/// (every other thread carries `on == false` and never reads the timer).
/// Stamps go to the ring as they are taken, so none stays in a register.
#[derive(Clone, Copy)]
pub struct Trace {
    pub on: bool,
    ring: u64,
    entry: u64,
}

impl Trace {
    /// Starts the trace (reads the timer first thing) when `enabled`.
    #[inline(always)]
    pub fn start(enabled: bool, ring: u64) -> Trace {
        let on = enabled && ring != 0 && ptx::thread_idx_x() == 0 && ptx::block_idx_x() == 0;
        Trace { on, ring, entry: if on { ptx::globaltimer_ns() } else { 0 } }
    }

    /// This launch's record. Computed at each stamp (behind `on`), never
    /// hoisted into a register the fast path would carry.
    #[inline(always)]
    unsafe fn record(&self, generation: u32) -> *mut TraceRecord {
        let index = ptx::opaque_u64(generation as u64 % TRACE_RECORDS as u64);
        (self.ring as *mut TraceRecord).add(index as usize)
    }

    /// The control words arrived: opens this launch's record.
    #[inline(always)]
    pub unsafe fn loaded(&self, generation: u32) {
        if self.on {
            let now = ptx::globaltimer_ns();
            let rec = self.record(generation);
            (*rec).entry_ns = self.entry;
            (*rec).loaded_ns = now;
            (*rec).first_store_ns = 0;
            (*rec).last_poll_ns = 0;
            (*rec).generation = generation;
            (*rec).shape = ptx::grid_dim_x() << 16 | ptx::block_dim_x();
        }
    }

    #[inline(always)]
    pub unsafe fn first_store(&self, generation: u32) {
        if self.on {
            (*self.record(generation)).first_store_ns = ptx::globaltimer_ns();
        }
    }

    #[inline(always)]
    pub unsafe fn polled(&self, generation: u32) {
        if self.on {
            (*self.record(generation)).last_poll_ns = ptx::globaltimer_ns();
        }
    }

    #[inline(always)]
    pub unsafe fn exit(&self, generation: u32) {
        if self.on {
            (*self.record(generation)).exit_ns = ptx::globaltimer_ns();
        }
    }
}
