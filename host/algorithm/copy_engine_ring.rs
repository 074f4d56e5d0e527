//! CopyEngineRing: a ring allreduce (reduce-scatter then all-gather, W-1
//! steps each) whose data moves with the copy engines. Per step and piece,
//! the rank's helper stream copies one piece of a shard into the next
//! rank's staging (`cuMemcpyAsync`, inside the captured graph) and raises
//! the next rank's flag for it (`cuStreamWriteValue32` where the device
//! supports stream memory operations, else a one-thread kernel with
//! `st.release.sys`); on the caller's stream a small kernel waits
//! (bounded) for its own flag, reduces (`out = in + staging`) or copies the
//! piece, and clears the flag. Pieces pipeline copy and reduce. Binary
//! flags and one handshake per call ("your staging is free again"), no
//! counters. Meant for large messages on PCIe, where copy engines keep
//! ~50 GB/s per hop (docs/SOURCES.md [F9]) and SM stores under contention
//! do not. Kernels: `kernels-rs/src/device/copy_engine_ring.rs`; staging
//! and flags: `ScratchLayout::copy_engine_*`.
//!
//! Here: the ring's steps ([`CopyEnginePlan`]), the addresses one rank's
//! calls need (resolved once at init into a [`CopyEngineTemplate`]), the
//! program of one call ([`CopyEngineTemplate::program`]), all pure and
//! tested on the CPU, and the cost recipe. Its streams and events are
//! created at init (never during a capture); `driver/copy_engine.rs` runs
//! a program on the streams.

#![forbid(unsafe_code)]

use std::mem::{align_of, offset_of, size_of};
use std::sync::Arc;

use cudarc::driver::CudaContext;
use tp_allreduce_kernels::ids::{AlgorithmId, DType};
use tp_allreduce_kernels::layout::{LocalState, SignalBlock, COPY_ENGINE_FLAG_STRIDE};
use tp_allreduce_kernels::params::{CopyEngineParams, CE_MODE_COPY, CE_MODE_REDUCE};
use tp_allreduce_kernels::partition::{div_ceil, even_part, packs_for, PACK, PACK_BYTES};

use super::launch::{chunks, entry_name, ByDtype, Call, Issue, Launch, RankAlgorithm, RankSetup};
use super::{
    AlgorithmHost, Capabilities, CostRecipe, CostShape, Engine, FlowSet, Geometry, IslandSplit, LatencyOver, Op,
    Pattern, PhaseSpec, RankMemory, Transport,
};
use crate::driver::copy_engine::{self, CopyEngineOp, CopyEngineRuntime, HelperStream};
use crate::driver::{Event, Kernel, KernelModule};
use crate::error::Result;
use crate::test_hooks;

/// Most pieces a shard is cut into (the flags per step in the layout).
pub const CE_MAX_PIECES: u32 = 4;
/// Smallest piece worth a copy of its own (the design's threshold).
const MIN_PIECE_BYTES: u64 = 512 << 10;
/// Threads of a step kernel block.
const STEP_THREADS: u32 = 512;
/// Blocks of a step kernel at most (its blocks never wait for each other).
const STEP_MAX_BLOCKS: u64 = 128;

pub(crate) struct CopyEngineRing;

impl AlgorithmHost for CopyEngineRing {
    fn kernel(&self) -> AlgorithmId {
        AlgorithmId::CopyEngineRing
    }

    /// Staging is device memory the peers' copy engines write over P2P.
    fn supports_host_staged(&self) -> bool {
        false
    }

    /// Each reduce-scatter step rounds to the element type (as the ring).
    fn max_roundings(&self, world: usize) -> usize {
        world
    }

    fn requirement(&self, caps: &Capabilities, _bytes: Option<usize>) -> Result<(), String> {
        if caps.copy_engine {
            Ok(())
        } else {
            Err("copy-engine-ring has no staging in this communicator (it needs peer-to-peer access and one rank \
                 per GPU)"
                .into())
        }
    }

    /// The shape of one step kernel over a piece of `packs` packs: one
    /// pack per thread, at most half of what stays resident with the ranks
    /// sharing the GPU, so that copies which a driver runs on the SMs (a
    /// copy within one device) always find room next to waiting blocks.
    fn launch_shape(&self, g: &Geometry, packs: u64) -> (u32, u32) {
        let cap = (g.sentinel_resident.cap(STEP_THREADS) / 2).max(1) as u64;
        (div_ceil(packs, STEP_THREADS as u64).clamp(1, cap.min(STEP_MAX_BLOCKS)) as u32, STEP_THREADS)
    }

    fn helper_entries(&self) -> Vec<String> {
        vec![COPY_ENGINE_HANDSHAKE.to_string(), COPY_ENGINE_PUBLISH.to_string()]
    }

    fn param_struct(&self, name: &str) -> Option<(usize, usize)> {
        (name.starts_with(self.kernel().kernel_prefix()) && name != COPY_ENGINE_PUBLISH)
            .then_some((size_of::<CopyEngineParams>(), align_of::<CopyEngineParams>()))
    }

    /// Only with staging (P2P transport, one rank per GPU).
    fn prepare(&self, rank: &RankSetup<'_>) -> Result<Option<Box<dyn RankAlgorithm>>> {
        if rank.memory.layout.copy_engine_pieces == 0 || rank.transport != Transport::PeerToPeer {
            return Ok(None);
        }
        // Ring progress depends on every rank upstream: the launch bound.
        let template = CopyEngineTemplate::new(rank.rank, rank.memory, rank.islands, rank.wait_bounds_ns.1);
        Ok(Some(Box::new(CopyEngineRingRank {
            template,
            runtime: runtime(rank.ctx, rank.module)?,
            geometry: rank.geometry,
            steps: ByDtype::kernels(rank.module, |d| entry_name(AlgorithmId::CopyEngineRing, d))?,
        })))
    }

    fn single_gpu_traffic_per_rank(&self, _n: f64, s: f64) -> f64 {
        // copy the shard to staging (read + write), read staging and input,
        // write output, per step
        6.0 * s
    }

    fn cost(&self, shape: &CostShape) -> CostRecipe {
        let n = shape.world as f64;
        CostRecipe {
            overlapped: false,
            phases: vec![PhaseSpec {
                flows: FlowSet::RingNeighbours,
                share: 2.0 * (n - 1.0) / n,
                op: Op::Write,
                pattern: Pattern::Single,
                hops: 2.0 * (n - 1.0),
                read_hops: 0.0,
                latency_over: LatencyOver::MeanFlow,
                ring_pipelined: false,
                engine: Engine::CopyEngine,
                access_rounds: 0.0,
            }],
            // Input twice (copy, reduce), staging read per step, output.
            local_passes: 4.0,
        }
    }
}

/// Pieces per shard for a launch of `bytes`: as many as keep a piece at
/// least `MIN_PIECE_BYTES`, a power of two up to [`CE_MAX_PIECES`].
pub fn pieces_for(bytes: u64, world: usize) -> u32 {
    let shard = bytes / world.max(1) as u64;
    let mut pieces = 1;
    while pieces < CE_MAX_PIECES && shard / (2 * pieces as u64) >= MIN_PIECE_BYTES {
        pieces *= 2;
    }
    pieces
}

/// One step of the ring for one rank: which shard goes out, which comes in,
/// and what the step kernel does with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// Shard copied to the next rank (from the input at step 0, else from
    /// the output, where the previous step left it).
    pub send: usize,
    pub from_input: bool,
    /// Shard that arrives from the previous rank into this step's staging.
    pub recv: usize,
    /// `CE_MODE_REDUCE` (reduce-scatter: out = in + staging) or
    /// `CE_MODE_COPY` (all-gather: out = staging).
    pub mode: u32,
}

/// The program of one launch for the rank at `position` of a ring of
/// `world`: `2 (world - 1)` steps over `world` shards of the message, each
/// cut into `pieces` pieces. Shard `c` is packs `even_part(packs, world, c)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyEnginePlan {
    pub steps: Vec<Step>,
    pub pieces: u32,
    pub packs: u64,
    pub world: usize,
}

impl CopyEnginePlan {
    pub fn new(position: usize, world: usize, packs: u64, pieces: u32) -> CopyEnginePlan {
        let w = world as isize;
        let at = |x: isize| x.rem_euclid(w) as usize;
        let q = position as isize;
        let mut steps = Vec::with_capacity(2 * world.saturating_sub(1));
        for s in 0..w - 1 {
            steps.push(Step { send: at(q - s), from_input: s == 0, recv: at(q - s - 1), mode: CE_MODE_REDUCE });
        }
        for s in 0..w - 1 {
            steps.push(Step { send: at(q + 1 - s), from_input: false, recv: at(q - s), mode: CE_MODE_COPY });
        }
        CopyEnginePlan { steps, pieces, packs, world }
    }

    /// Packs `(first, len)` of piece `piece` of shard `shard`, and the
    /// piece's offset in packs from the shard's start (its place in staging).
    pub fn piece(&self, shard: usize, piece: u32) -> (u64, u64, u64) {
        let (start, len) = even_part(self.packs, self.world as u64, shard as u64);
        let (offset, piece_len) = even_part(len, self.pieces as u64, piece as u64);
        (start + offset, piece_len, offset)
    }

    /// Elements `(first, count)` of packs `(first, len)` of a message of
    /// `count` elements with `lanes` elements per pack.
    pub fn elements(first: u64, len: u64, count: u64, lanes: u64) -> (u64, u64) {
        let begin = (first * lanes).min(count);
        let end = ((first + len) * lanes).min(count);
        (begin, end - begin)
    }

    /// Bytes of staging one step needs at most (a whole shard).
    pub fn shard_bytes_max(&self) -> u64 {
        div_ceil(self.packs, self.world as u64) * PACK_BYTES as u64
    }
}

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

/// The copy-engine ring's one-thread kernels (no dtype): the handshake
/// wait and the flag publication.
pub const COPY_ENGINE_HANDSHAKE: &str = "copy_engine_ring_handshake";
pub const COPY_ENGINE_PUBLISH: &str = "copy_engine_ring_publish";

/// Streams, events and kernels of the copy-engine ring of one rank. Flags
/// are raised with `cuStreamWriteValue32` where the device supports stream
/// memory operations, unless `TP_ALLREDUCE_CE_PUBLISH=kernel` (or a test
/// hook) asks for the publish kernel.
fn runtime(ctx: &Arc<CudaContext>, module: &KernelModule) -> Result<CopyEngineRuntime> {
    let kernel = crate::env::ce_publish_with_kernel()?.unwrap_or(false) || test_hooks::kernel_publication();
    Ok(CopyEngineRuntime {
        copy: HelperStream::new(ctx)?,
        fork: Event::new(ctx)?,
        join: Event::new(ctx)?,
        done: (0..CE_MAX_PIECES).map(|_| Event::new(ctx)).collect::<Result<_>>()?,
        mem_ops: !kernel && copy_engine::stream_mem_ops_supported(ctx)?,
        handshake: module.kernel(COPY_ENGINE_HANDSHAKE)?,
        publish: module.kernel(COPY_ENGINE_PUBLISH)?,
    })
}

/// Pieces of a launch of `count` elements of `dtype` on `world` ranks.
pub(crate) fn pieces(count: u64, dtype: DType, world: usize) -> u32 {
    pieces_for(count * dtype.size_bytes() as u64, world)
}

/// The copy-engine ring's side of one rank.
struct CopyEngineRingRank {
    template: CopyEngineTemplate,
    runtime: CopyEngineRuntime,
    geometry: Geometry,
    /// The step kernels.
    steps: ByDtype<Kernel>,
}

impl RankAlgorithm for CopyEngineRingRank {
    /// Per launch (at most the staging's capacity), the program of
    /// [`CopyEngineTemplate::program`] on the caller's stream and the
    /// rank's helper stream.
    fn run(&self, call: &Call, issue: &mut Issue<'_>) -> Result<()> {
        let elem = call.dtype.size_bytes() as u64;
        let world = self.template.world;
        for (start, n) in chunks(call.count, call.dtype, CopyEngineRing.launch_capacity_packs(&self.geometry)) {
            let (input, output) = (call.input + start as u64 * elem, call.output + start as u64 * elem);
            let shape = |packs| CopyEngineRing.launch_shape(&self.geometry, packs);
            let pieces = pieces(n as u64, call.dtype, world);
            let ops = self.template.program((input, output, n as u64), call.dtype, pieces, shape);
            issue(Launch::CopyEngine { runtime: &self.runtime, ops: &ops, step: self.steps.get(call.dtype) })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
