//! Launch parameters of the sentinel kernels (OneShotPush), built once per
//! rank at init and completed per launch, and what their launch shape may
//! be on this rank.
//!
//! The template resolves every peer address the kernel needs (where this
//! rank's payload lands at each peer, where each peer's payload lands here,
//! each peer's abort word), so the kernel reads nothing but its parameter
//! struct (constant bank) and one 16-byte line of control words. A launch
//! fills only `input`, `output`, `count` and `flags`.

use std::mem::{offset_of, size_of};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use tp_allreduce_kernels::layout::{LocalState, ScratchLayout, SignalBlock};
use tp_allreduce_kernels::params::{
    one_shot_push_slot, one_shot_push_source, Control, OneShotPushParams, SentinelHeader, TraceRecord, FLAG_TRACE,
    TRACE_RECORDS,
};

use super::setup::Setup;
use crate::algorithms::ResidentBlocks;
use crate::config::Config;
use crate::driver::{self, DeviceMemory, KernelModule};
use crate::error::{Error, Result};
use crate::kernels::sentinel_entries;

/// Where a rank's memory is, as the template needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RankMemory {
    /// Every rank's region (signal block | scratch | staging) as this rank
    /// maps it.
    pub region_bases: Vec<u64>,
    /// Offset of the scratch inside a region (the same on every rank).
    pub scratch_offset: u64,
    pub layout: ScratchLayout,
    /// This rank's `LocalState` (its `Control` is at offset 0).
    pub local_state: u64,
    /// Device address of this rank's mapped `ErrorRecord`.
    pub error_record: u64,
}

/// The OneShotPush parameters of `rank`, all but the per-launch fields.
/// Pure: the slot arithmetic is tested on the CPU.
pub(crate) fn one_shot_push_template(rank: usize, mem: &RankMemory, timeout_ns: u64) -> OneShotPushParams {
    let world = mem.region_bases.len();
    let scratch = |r: usize| mem.region_bases[r] + mem.scratch_offset;
    let abort_of = |r: usize| mem.region_bases[r] + offset_of!(SignalBlock, abort) as u64;
    let mut p = OneShotPushParams {
        h: SentinelHeader {
            control: mem.local_state + offset_of!(LocalState, control) as u64,
            error_record: mem.error_record,
            timeout_ns,
            half_bytes: mem.layout.one_shot_push_half_bytes,
            rank: rank as u32,
            world: world as u32,
            abort: abort_of(rank),
            ..SentinelHeader::default()
        },
        ..OneShotPushParams::default()
    };
    for k in 0..world.saturating_sub(1) {
        let dst = (rank + 1 + k) % world;
        let slot = one_shot_push_slot(rank as u32, dst as u32);
        p.send_to[k] = scratch(dst) + mem.layout.one_shot_push_slot_offset(slot);
        p.recv_from[k] = scratch(rank) + mem.layout.one_shot_push_slot_offset(k as u32);
        p.source_abort[k] = abort_of(one_shot_push_source(k as u32, rank as u32) as usize);
    }
    p
}

/// [`ResidentBlocks`] from the loaded kernels' occupancy: the smallest over
/// every sentinel entry, times the SM count, divided among the ranks that
/// share the GPU.
pub(crate) fn resident_blocks(module: &KernelModule, sms: u32, ranks_on_device: usize) -> Result<ResidentBlocks> {
    let mut table = [0u32; 32];
    for (i, cap) in table.iter_mut().enumerate() {
        let threads = 32 * (i as u32 + 1);
        let mut per_sm = u32::MAX;
        for name in sentinel_entries() {
            per_sm = per_sm.min(module.max_blocks_per_sm(&name, threads)?);
        }
        *cap = sms * per_sm / ranks_on_device.max(1) as u32;
    }
    Ok(ResidentBlocks(table))
}

/// Test-only: starts every protocol counter of this rank at `seed` (see
/// `Config::test_initial_counter`): the OneShotPush generations, the flag
/// kernels' per-block epochs and every flag of the signal block, the
/// ring's message counters. Must run before any peer can write this
/// rank's flags (init, before the region descriptors are exchanged).
pub(crate) fn seed_counters(signal_block: u64, local_state: u64, seed: u32) -> Result<()> {
    let flags_words = offset_of!(SignalBlock, abort) / 4;
    driver::memcpy_htod(signal_block, bytemuck::cast_slice(&vec![seed; flags_words]))?;
    // LocalState: every u32 up to the P2P read-back area is a counter,
    // except the control words other than the generations.
    let mut words = vec![seed; offset_of!(LocalState, p2p_read_back) / 4];
    // In the control words only the generations are counters (abort,
    // arrivals and the error claim start at 0).
    let control = offset_of!(LocalState, control) / 4;
    let generations = control + offset_of!(Control, generation) / 4;
    for (i, w) in words.iter_mut().enumerate().skip(control).take(size_of::<Control>() / 4) {
        if !(generations..generations + 3).contains(&i) {
            *w = 0;
        }
    }
    driver::memcpy_htod(local_state, bytemuck::cast_slice(&words))
}

impl Setup {
    /// This rank's memory as the sentinel templates need it.
    pub(crate) fn memory(&self) -> RankMemory {
        RankMemory {
            region_bases: self.region_bases.clone(),
            scratch_offset: self.offsets.scratch as u64,
            layout: self.layout,
            local_state: self.local_state.ptr(),
            error_record: self.error_record.device_ptr(),
        }
    }
}

/// What every sentinel launch of one rank starts from.
pub(crate) struct SentinelLaunches {
    one_shot_push: OneShotPushParams,
    /// The trace ring (`Config::trace`), `TRACE_RECORDS` records.
    trace: Option<DeviceMemory>,
}

impl SentinelLaunches {
    pub(crate) fn build(ctx: &Arc<CudaContext>, setup: &Setup, rank: usize, config: &Config) -> Result<Self> {
        let timeout_ns = config.timeout.as_nanos().min(u64::MAX as u128) as u64;
        let mut one_shot_push = one_shot_push_template(rank, &setup.memory(), timeout_ns);
        let trace = if config.trace {
            let ring = DeviceMemory::alloc_zeroed(ctx, TRACE_RECORDS * size_of::<TraceRecord>())?;
            one_shot_push.h.trace = ring.ptr();
            one_shot_push.h.flags |= FLAG_TRACE;
            Some(ring)
        } else {
            None
        };
        Ok(SentinelLaunches { one_shot_push, trace })
    }

    /// The parameters of one OneShotPush launch over `count` elements.
    pub(crate) fn one_shot_push(
        &self,
        input: sys::CUdeviceptr,
        output: sys::CUdeviceptr,
        count: u64,
    ) -> OneShotPushParams {
        let mut p = self.one_shot_push;
        p.h.input = input;
        p.h.output = output;
        p.h.count = count;
        p
    }

    /// The trace ring's records (after the stream was synchronised), in
    /// ring order; `None` when tracing is off.
    pub(crate) fn trace_records(&self) -> Result<Option<Vec<TraceRecord>>> {
        let Some(ring) = &self.trace else { return Ok(None) };
        let mut records = vec![TraceRecord::default(); TRACE_RECORDS];
        let bytes = TRACE_RECORDS * size_of::<TraceRecord>();
        // SAFETY: TraceRecord is plain old data (u64/u32 fields, explicit
        // padding); the slice covers exactly `bytes` bytes.
        let raw = unsafe { std::slice::from_raw_parts_mut(records.as_mut_ptr() as *mut u8, bytes) };
        driver::memcpy_dtoh(raw, ring.ptr())?;
        Ok(Some(records))
    }
}

/// The launch shape of one sentinel launch: the configured override, else
/// the tuning table's, else the default rule; checked against residency.
pub(crate) fn choose_shape(
    forced: Option<(u32, u32)>,
    tuned: Option<(u32, u32)>,
    default: (u32, u32),
    resident: &ResidentBlocks,
) -> Result<(u32, u32)> {
    if let Some((blocks, threads)) = forced {
        let cap = resident.cap(threads);
        if blocks > cap {
            return Err(Error::invalid(format!(
                "launch shape {blocks}x{threads}: at most {cap} blocks of {threads} threads stay resident on this GPU \
                 with the other ranks sharing it (a non-resident block could wait for a peer forever)"
            )));
        }
        return Ok((blocks, threads));
    }
    match tuned {
        Some((blocks, threads)) if resident.cap(threads) > 0 => Ok((blocks.min(resident.cap(threads)).max(1), threads)),
        _ => Ok(default),
    }
}
