//! Launch parameters of the sentinel kernels (OneShotPush; TwoShotPush and
//! Hierarchical from `island_params.rs`) and the copy-engine ring
//! (`copy_engine.rs`), built once per rank at init and completed per
//! launch, and what their launch shape may be on this rank.
//!
//! The template resolves every peer address the kernel needs (where this
//! rank's payload lands at each peer, where each peer's payload lands here,
//! each peer's abort word), so the kernel reads nothing but its parameter
//! struct (constant bank) and one 16-byte line of control words. A launch
//! fills only `input`, `output`, `count` and `flags`.

use std::mem::{offset_of, size_of};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use tp_allreduce_kernels::layout::{LocalState, SignalBlock};
use tp_allreduce_kernels::params::{
    one_shot_push_slot, one_shot_push_source, IslandPushParams, OneShotPushParams, SentinelHeader, TraceRecord,
    FLAG_TRACE, TRACE_RECORDS,
};

use super::copy_engine::{self, CopyEngineTemplate};
use super::island_params::{island_push_template, IslandKind};
use super::setup::Setup;
use crate::algorithm::fused::IslandCapacity;
use crate::algorithm::RankMemory;
use crate::algorithm::ResidentBlocks;
use crate::algorithm::{IslandSplit, Transport};
use crate::config::Config;
use crate::driver::copy_engine::CopyEngineRuntime;
use crate::driver::{self, DeviceMemory, KernelModule};
use crate::error::{Error, Result};

/// The OneShotPush parameters of `rank`, all but the per-launch fields.
/// Pure: the slot arithmetic is tested on the CPU.
pub(crate) fn one_shot_push_template(
    rank: usize,
    mem: &RankMemory,
    (timeout_ns, launch_timeout_ns): (u64, u64),
) -> OneShotPushParams {
    let world = mem.region_bases.len();
    let scratch = |r: usize| mem.region_bases[r] + mem.scratch_offset;
    let abort_of = |r: usize| mem.region_bases[r] + offset_of!(SignalBlock, abort) as u64;
    let mut p = OneShotPushParams {
        h: SentinelHeader {
            control: mem.local_state + offset_of!(LocalState, control) as u64,
            error_record: mem.error_record,
            timeout_ns,
            launch_timeout_ns,
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

/// What every sentinel (and copy-engine ring) launch of one rank starts from.
pub(crate) struct SentinelLaunches {
    one_shot_push: OneShotPushParams,
    two_shot_push: IslandPushParams,
    /// With islands only.
    hierarchical: Option<IslandPushParams>,
    /// With the copy-engine ring's staging only (P2P transport).
    pub(crate) copy_engine: Option<(CopyEngineTemplate, CopyEngineRuntime)>,
    /// The trace ring (`Config::trace`), `TRACE_RECORDS` records.
    trace: Option<DeviceMemory>,
}

impl SentinelLaunches {
    pub(crate) fn build(
        ctx: &Arc<CudaContext>,
        module: &KernelModule,
        setup: &Setup,
        rank: usize,
        config: &Config,
    ) -> Result<Self> {
        let bounds = config.wait_bounds_ns();
        let (timeout_ns, launch_timeout_ns) = bounds;
        let mem = setup.memory();
        let mut one_shot_push = one_shot_push_template(rank, &mem, bounds);
        let world = mem.region_bases.len();
        let cross = setup.cross.as_ref().map(|c| &c.regions);
        let island = |kind, split| {
            let mut p = island_push_template(rank, &mem, kind, split, cross, timeout_ns);
            p.h.launch_timeout_ns = launch_timeout_ns;
            p
        };
        let mut two_shot_push = island(IslandKind::TwoShotPush, IslandSplit::whole(world));
        let mut hierarchical = setup.island_split.map(|s| island(IslandKind::Hierarchical, s));
        let copy_engine = if setup.layout.copy_engine_pieces > 0 && setup.transport == Transport::PeerToPeer {
            // Ring progress depends on every rank upstream: the launch bound.
            let template = CopyEngineTemplate::new(rank, &mem, setup.island_split, launch_timeout_ns);
            Some((template, copy_engine::runtime(ctx, module)?))
        } else {
            None
        };
        let trace = if config.trace {
            let ring = DeviceMemory::alloc_zeroed(ctx, TRACE_RECORDS * size_of::<TraceRecord>())?;
            for h in [Some(&mut one_shot_push.h), Some(&mut two_shot_push.h), hierarchical.as_mut().map(|p| &mut p.h)]
                .into_iter()
                .flatten()
            {
                h.trace = ring.ptr();
                h.flags |= FLAG_TRACE;
            }
            Some(ring)
        } else {
            None
        };
        Ok(SentinelLaunches { one_shot_push, two_shot_push, hierarchical, copy_engine, trace })
    }

    /// The parameters of one TwoShotPush (`hierarchical == false`) or
    /// Hierarchical launch over `count` elements (`None` without islands).
    pub(crate) fn island_push(
        &self,
        hierarchical: bool,
        input: sys::CUdeviceptr,
        output: sys::CUdeviceptr,
        count: u64,
    ) -> Option<IslandPushParams> {
        let mut p = if hierarchical { self.hierarchical? } else { self.two_shot_push };
        p.h.input = input;
        p.h.output = output;
        p.h.count = count;
        Some(p)
    }

    /// The receive region of TwoShotPush (`hierarchical == false`) or
    /// Hierarchical (`None` without islands) as its template states it.
    pub(crate) fn island_capacity(&self, hierarchical: bool) -> Option<IslandCapacity> {
        let p = if hierarchical { self.hierarchical? } else { self.two_shot_push };
        Some(IslandCapacity { share_cap: p.share_cap, shares: p.shares as u64 })
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
    /// ring order, and clears the ring; `None` when tracing is off.
    pub(crate) fn take_trace_records(&self) -> Result<Option<Vec<TraceRecord>>> {
        let Some(ring) = &self.trace else { return Ok(None) };
        const WORDS: usize = size_of::<TraceRecord>() / 8;
        let mut raw = vec![0u64; TRACE_RECORDS * WORDS];
        driver::memcpy_dtoh(bytemuck::cast_slice_mut(&mut raw), ring.ptr())?;
        let records = raw
            .chunks_exact(WORDS)
            .map(|w| TraceRecord {
                entry_ns: w[0],
                loaded_ns: w[1],
                first_store_ns: w[2],
                last_poll_ns: w[3],
                exit_ns: w[4],
                generation: w[5] as u32,
                shape: (w[5] >> 32) as u32,
                _pad: [0; 2],
            })
            .collect();
        driver::memset_d8(ring.ptr(), 0, TRACE_RECORDS * size_of::<TraceRecord>())?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use tp_allreduce_kernels::layout::{ScratchConfig, ScratchLayout};

    fn memory(world: usize, rank: usize) -> RankMemory {
        let layout = ScratchLayout::new(&ScratchConfig {
            world_size: world as u32,
            max_packs: 4096,
            one_shot_push_max_packs: 1000,
            ring_blocks: 4,
            ring_slots: 4,
            ring_chunk_packs: 64,
            island_sizes: [0; tp_allreduce_kernels::layout::MAX_RANKS],
            island_count: 0,
            copy_engine_pieces: 4,
            enable_two_shot_pull: true,
            enable_two_shot_push: true,
            enable_ring: true,
        });
        // Each viewer maps each owner's region at its own address (as IPC
        // mappings do); offsets inside a region are the same everywhere.
        let bases = (0..world).map(|r| 0x7000_0000_0000 + (r as u64) * 0x1_0000_0000 + rank as u64 * 0x100).collect();
        RankMemory {
            region_bases: bases,
            scratch_offset: 0xA980,
            layout,
            local_state: 0x10_000,
            error_record: 0x20_000,
        }
    }

    /// Every (source, receiver) pair: the address the source sends to is,
    /// relative to the receiver's region, the slot the receiver polls for
    /// that source; slots of one receiver are distinct and inside its half.
    #[test]
    fn templates_agree_on_every_slot_across_ranks() {
        for world in 2..=8usize {
            let templates: Vec<_> = (0..world).map(|r| one_shot_push_template(r, &memory(world, r), (5, 7))).collect();
            for (s, ts) in templates.iter().enumerate() {
                assert_eq!(ts.h.world as usize, world);
                for k in 0..world - 1 {
                    let d = (s + 1 + k) % world;
                    let mem_s = memory(world, s);
                    let offset_at_d = ts.send_to[k] - mem_s.region_bases[d];
                    let td = &templates[d];
                    let mem_d = memory(world, d);
                    let slot = (0..world - 1)
                        .find(|&j| td.recv_from[j] - mem_d.region_bases[d] == offset_at_d)
                        .unwrap_or_else(|| panic!("world {world}: {s} -> {d} lands in no slot {d} polls"));
                    assert_eq!(one_shot_push_source(slot as u32, d as u32) as usize, s);
                    assert_eq!(td.source_abort[slot] - mem_d.region_bases[s], offset_of!(SignalBlock, abort) as u64);
                }
                let mut offsets: Vec<u64> = (0..world - 1).map(|j| ts.recv_from[j]).collect();
                offsets.sort_unstable();
                offsets.dedup();
                assert_eq!(offsets.len(), world - 1, "world {world} rank {s}: slots collide");
                let half = ts.h.half_bytes;
                let region_start =
                    memory(world, s).region_bases[s] + 0xA980 + memory(world, s).layout.one_shot_push_offset;
                for j in 0..world - 1 {
                    assert!(ts.recv_from[j] >= region_start && ts.recv_from[j] + 1000 * 16 <= region_start + half);
                }
                // Unused entries stay zero (a kernel never touches them).
                assert!(ts.send_to[world - 1..].iter().all(|&a| a == 0));
                assert_eq!(ts.h.abort, memory(world, s).region_bases[s] + offset_of!(SignalBlock, abort) as u64);
                assert_eq!(ts.h.control, 0x10_000);
            }
        }
    }

    #[test]
    fn shapes_forced_tuned_or_default_within_residency() {
        let resident = ResidentBlocks([8; 32]);
        assert_eq!(choose_shape(None, None, (3, 256), &resident).unwrap(), (3, 256));
        assert_eq!(choose_shape(None, Some((4, 128)), (3, 256), &resident).unwrap(), (4, 128));
        // A tuned shape beyond what is resident here is clamped.
        assert_eq!(choose_shape(None, Some((64, 128)), (3, 256), &resident).unwrap(), (8, 128));
        assert_eq!(choose_shape(Some((2, 64)), Some((4, 128)), (3, 256), &resident).unwrap(), (2, 64));
        let e = choose_shape(Some((9, 64)), None, (3, 256), &resident).unwrap_err().to_string();
        assert!(e.contains("9x64") && e.contains("at most 8"), "{e}");
        let mut none_1024 = resident;
        none_1024.0[31] = 0;
        assert_eq!(choose_shape(None, Some((4, 1024)), (3, 256), &none_1024).unwrap(), (3, 256));
        assert_eq!(resident.cap(100), 0);
        assert_eq!(resident.cap(2048), 0);
    }
}
