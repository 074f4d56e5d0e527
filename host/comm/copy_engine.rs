//! The copy-engine ring of one rank: its addresses (resolved once at init
//! into a [`CopyEngineTemplate`]), its streams and events (created at init:
//! never during a capture) and the program of one call
//! ([`CopyEngineTemplate::program`], pure, tested on the CPU), which
//! `driver::copy_engine::run` issues. The ring and its ordering argument
//! are in `algorithm/copy_engine_ring.rs` and
//! `kernels-rs/src/device/copy_engine_ring.rs`.

#![forbid(unsafe_code)]

use std::mem::offset_of;
use std::sync::Arc;

use cudarc::driver::CudaContext;
use tp_allreduce_kernels::layout::{LocalState, SignalBlock, COPY_ENGINE_FLAG_STRIDE};
use tp_allreduce_kernels::params::CopyEngineParams;
use tp_allreduce_kernels::partition::{packs_for, PACK};

use super::test_hooks;
use crate::algorithm::{pieces_for, CopyEnginePlan, IslandSplit, RankMemory, CE_MAX_PIECES};
use crate::driver::copy_engine::{self, CopyEngineOp, CopyEngineRuntime, HelperStream};
use crate::driver::{Event, KernelModule};
use crate::error::Result;
use crate::kernels::{COPY_ENGINE_HANDSHAKE, COPY_ENGINE_PUBLISH};
use crate::DType;

/// The ring order: islands one after the other (the ring crosses each
/// island boundary once per direction), else rank order.
pub(crate) fn ring_order(world: usize, split: Option<IslandSplit>) -> Vec<usize> {
    match split {
        Some(s) => s.groups().concat(),
        None => (0..world).collect(),
    }
}

/// Every address one rank's copy-engine ring calls need.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CopyEngineTemplate {
    pub position: usize,
    pub world: usize,
    /// Staging of this rank (step slots) and of the next rank, as mapped here.
    pub own_staging: u64,
    pub next_staging: u64,
    pub slot_bytes: u64,
    /// Flag of (step 0, piece 0) here and at the next rank.
    pub own_flags: u64,
    pub next_flags: u64,
    /// This rank's handshake flag (raised by the next rank) and the
    /// previous rank's (raised by this rank).
    pub own_handshake: u64,
    pub prev_handshake: u64,
    /// Control, error record, timeout, own abort, rank: the fields every
    /// kernel of the call shares.
    pub base: CopyEngineParams,
    pub next: (u32, u64),
    pub prev: (u32, u64),
    /// The last step kernel of a call raises the previous rank's handshake
    /// (always, but under a test hook).
    pub handshake: bool,
}

impl CopyEngineTemplate {
    /// The template of `rank`. Pure.
    pub(crate) fn new(rank: usize, mem: &RankMemory, split: Option<IslandSplit>, timeout_ns: u64) -> Self {
        let world = mem.region_bases.len();
        let order = ring_order(world, split);
        let position = order.iter().position(|&r| r == rank).unwrap_or(0);
        let next = order[(position + 1) % world];
        let prev = order[(position + world - 1) % world];
        let l = &mem.layout;
        let scratch = |r: usize| mem.region_bases[r] + mem.scratch_offset;
        let abort = |r: usize| mem.region_bases[r] + offset_of!(SignalBlock, abort) as u64;
        CopyEngineTemplate {
            position,
            world,
            own_staging: scratch(rank) + l.copy_engine_offset,
            next_staging: scratch(next) + l.copy_engine_offset,
            slot_bytes: l.copy_engine_slot_bytes,
            own_flags: scratch(rank) + l.copy_engine_flags_offset,
            next_flags: scratch(next) + l.copy_engine_flags_offset,
            own_handshake: scratch(rank) + l.copy_engine_handshake_offset,
            prev_handshake: scratch(prev) + l.copy_engine_handshake_offset,
            base: CopyEngineParams {
                control: mem.local_state + offset_of!(LocalState, control) as u64,
                error_record: mem.error_record,
                timeout_ns,
                abort: abort(rank),
                rank: rank as u32,
                ..CopyEngineParams::default()
            },
            next: (next as u32, abort(next)),
            prev: (prev as u32, abort(prev)),
            handshake: test_hooks::copy_engine_handshake(rank),
        }
    }

    fn flag(base: u64, step: usize, piece: u32) -> u64 {
        base + (step as u64 * CE_MAX_PIECES as u64 + piece as u64) * COPY_ENGINE_FLAG_STRIDE
    }

    /// The program of one launch over `count` elements of `dtype` from
    /// `input` to `output` (`pieces` per shard; step kernels of
    /// `shape(piece packs)`). Pieces without data are skipped on both sides
    /// of a step (sender and receiver see the same empty piece).
    pub(crate) fn program(
        &self,
        (input, output, count): (u64, u64, u64),
        dtype: DType,
        pieces: u32,
        shape: impl Fn(u64) -> (u32, u32),
    ) -> Vec<CopyEngineOp> {
        let esize = dtype.size_bytes() as u64;
        let lanes = PACK / esize;
        let plan = CopyEnginePlan::new(self.position, self.world, packs_for(count, dtype), pieces);
        let mut ops = vec![
            CopyEngineOp::Handshake(CopyEngineParams {
                flag: self.own_handshake,
                peer: self.next.0,
                peer_abort: self.next.1,
                ..self.base
            }),
            CopyEngineOp::Fork,
        ];
        for (s, step) in plan.steps.iter().enumerate() {
            for p in 0..pieces {
                let (first, len, offset) = plan.piece(step.send, p);
                let (begin, n) = CopyEnginePlan::elements(first, len, count, lanes);
                if n > 0 {
                    if s > 0 {
                        ops.push(CopyEngineOp::AfterStep { piece: p as usize });
                    }
                    let src = if step.from_input { input } else { output } + begin * esize;
                    let dst = self.next_staging + s as u64 * self.slot_bytes + offset * PACK;
                    ops.push(CopyEngineOp::Copy { dst, src, bytes: (n * esize) as usize });
                    ops.push(CopyEngineOp::Publish { flag: Self::flag(self.next_flags, s, p) });
                }
                let (first, len, offset) = plan.piece(step.recv, p);
                let (begin, n) = CopyEnginePlan::elements(first, len, count, lanes);
                if n > 0 {
                    let (blocks, threads) = shape(len);
                    let params = CopyEngineParams {
                        input: input + begin * esize,
                        output: output + begin * esize,
                        count: n,
                        staging: self.own_staging + s as u64 * self.slot_bytes + offset * PACK,
                        flag: Self::flag(self.own_flags, s, p),
                        handshake: self.prev_handshake,
                        peer: self.prev.0,
                        peer_abort: self.prev.1,
                        mode: step.mode,
                        ..self.base
                    };
                    ops.push(CopyEngineOp::Step { params, blocks, threads });
                    ops.push(CopyEngineOp::StepDone { piece: p as usize });
                }
            }
        }
        // The last step kernel tells the previous rank its staging is free.
        if let Some(CopyEngineOp::Step { params, .. }) =
            ops.iter_mut().rev().find(|op| matches!(op, CopyEngineOp::Step { .. }))
        {
            params.last = u32::from(self.handshake);
        }
        ops.push(CopyEngineOp::Join);
        ops
    }
}

/// Streams, events and kernels of the copy-engine ring of one rank. Flags
/// are raised with `cuStreamWriteValue32` where the device supports stream
/// memory operations, unless `TP_ALLREDUCE_CE_PUBLISH=kernel` (or a test
/// hook) asks for the publish kernel.
pub(crate) fn runtime(ctx: &Arc<CudaContext>, module: &KernelModule) -> Result<CopyEngineRuntime> {
    let kernel = crate::env::ce_publish_with_kernel()?.unwrap_or(false) || test_hooks::kernel_publication();
    Ok(CopyEngineRuntime {
        copy: HelperStream::new(ctx)?,
        fork: Event::new(ctx)?,
        join: Event::new(ctx)?,
        done: (0..CE_MAX_PIECES).map(|_| Event::new(ctx)).collect::<Result<_>>()?,
        mem_ops: !kernel && copy_engine::stream_mem_ops_supported(ctx)?,
        handshake: module.function(COPY_ENGINE_HANDSHAKE)?,
        publish: module.function(COPY_ENGINE_PUBLISH)?,
    })
}

/// Pieces of a launch of `count` elements of `dtype` on `world` ranks.
pub(crate) fn pieces(count: u64, dtype: DType, world: usize) -> u32 {
    pieces_for(count * dtype.size_bytes() as u64, world)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tp_allreduce_kernels::layout::{ScratchConfig, ScratchLayout, MAX_RANKS};

    fn memory(world: usize) -> RankMemory {
        let layout = ScratchLayout::new(&ScratchConfig {
            world_size: world as u32,
            max_packs: 4096,
            one_shot_push_max_packs: 16,
            ring_blocks: 1,
            ring_slots: 2,
            ring_chunk_packs: 8,
            island_sizes: [0; MAX_RANKS],
            island_count: 0,
            copy_engine_pieces: CE_MAX_PIECES,
            enable_two_shot_pull: true,
            enable_two_shot_push: true,
            enable_ring: true,
        });
        RankMemory {
            region_bases: (0..world).map(|r| 0x7000_0000_0000 + r as u64 * 0x1_0000_0000).collect(),
            scratch_offset: 0x1000,
            layout,
            local_state: 0x10_000,
            error_record: 0x20_000,
        }
    }

    /// Every copy lands in the slot whose step kernel reads it at the next
    /// rank, with the same bytes; every published flag is one that rank
    /// waits on, once; every flag waited on is published; staging stays in
    /// its step's slot; the call ends with exactly one handshake.
    #[test]
    fn copies_flags_and_step_kernels_match_across_ranks() {
        for world in 2..=8usize {
            for count in [1u64, 9, 1000, 4096 * 8 - 3] {
                let mem = memory(world);
                let split = (world == 8).then(|| IslandSplit::consecutive(4, 8).unwrap());
                let t: Vec<CopyEngineTemplate> =
                    (0..world).map(|r| CopyEngineTemplate::new(r, &mem, split, 1)).collect();
                let progs: Vec<Vec<CopyEngineOp>> =
                    t.iter().map(|t| t.program((0x1_0000, 0x9_0000, count), DType::Bf16, 2, |_| (1, 256))).collect();
                for (r, prog) in progs.iter().enumerate() {
                    assert_eq!(prog.first().map(|o| matches!(o, CopyEngineOp::Handshake(_))), Some(true));
                    assert_eq!(prog.last(), Some(&CopyEngineOp::Join));
                    let lasts =
                        prog.iter().filter(|o| matches!(o, CopyEngineOp::Step { params, .. } if params.last == 1));
                    assert_eq!(lasts.count(), 1, "world {world} rank {r}");
                    let copies: Vec<(u64, usize, u64)> = prog
                        .windows(2)
                        .filter_map(|w| match (w[0], w[1]) {
                            (CopyEngineOp::Copy { dst, bytes, .. }, CopyEngineOp::Publish { flag }) => {
                                Some((dst, bytes, flag))
                            }
                            _ => None,
                        })
                        .collect();
                    let next = t[r].next.0 as usize;
                    let waits: Vec<(u64, u64)> = progs[next]
                        .iter()
                        .filter_map(|o| match o {
                            CopyEngineOp::Step { params, .. } => Some((params.staging, params.flag)),
                            _ => None,
                        })
                        .collect();
                    assert_eq!(copies.len(), waits.len(), "world {world} count {count}: rank {r} -> {next}");
                    for ((dst, bytes, flag), (staging, waited)) in copies.iter().zip(&waits) {
                        assert_eq!((dst, flag), (staging, waited), "world {world} count {count} rank {r}");
                        let slot = (dst - t[next].own_staging) / t[next].slot_bytes;
                        let end = t[next].own_staging + (slot + 1) * t[next].slot_bytes;
                        assert!(dst + *bytes as u64 <= end, "a copy overruns its step's slot");
                    }
                }
            }
        }
    }

    #[test]
    fn the_ring_crosses_each_island_boundary_once_per_direction() {
        let split = IslandSplit::from_groups(&[vec![0, 2, 4, 6], vec![1, 3, 5, 7]], 8).unwrap();
        let order = ring_order(8, Some(split));
        assert_eq!(order, vec![0, 2, 4, 6, 1, 3, 5, 7]);
        let crossings = (0..8).filter(|&i| !split.together(order[i], order[(i + 1) % 8])).count();
        assert_eq!(crossings, 2);
        assert_eq!(ring_order(3, None), vec![0, 1, 2]);
    }
}
