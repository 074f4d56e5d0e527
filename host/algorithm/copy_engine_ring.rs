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
//! This file is the pure part: the per-call program ([`CopyEnginePlan`],
//! tested on the CPU) and the cost recipe. `comm/params.rs` resolves the
//! addresses, `driver/copy_engine.rs` runs the program on the streams.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::params::{CE_MODE_COPY, CE_MODE_REDUCE};
use tp_allreduce_kernels::partition::{div_ceil, even_part, PACK_BYTES};

use super::{
    AlgorithmHost, Capabilities, CostRecipe, CostShape, Engine, FlowSet, Geometry, LatencyOver, Op, Pattern, PhaseSpec,
};

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

    fn grid(&self, g: &Geometry, packs: u64) -> u32 {
        self.launch_shape(g, packs).0
    }

    /// The shape of one step kernel over a piece of `packs` packs: one
    /// pack per thread, at most half of what stays resident with the ranks
    /// sharing the GPU, so that copies which a driver runs on the SMs (a
    /// copy within one device) always find room next to waiting blocks.
    fn launch_shape(&self, g: &Geometry, packs: u64) -> (u32, u32) {
        let cap = (g.sentinel_resident.cap(STEP_THREADS) / 2).max(1) as u64;
        (div_ceil(packs, STEP_THREADS as u64).clamp(1, cap.min(STEP_MAX_BLOCKS)) as u32, STEP_THREADS)
    }

    fn single_gpu_traffic_per_rank(&self, _n: f64, s: f64) -> f64 {
        // copy the shard to staging (read + write), read staging and input,
        // write output, per step
        6.0 * s
    }

    fn cost(&self, shape: &CostShape) -> CostRecipe {
        let n = shape.world as f64;
        CostRecipe {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the program of every rank on the CPU with exact sums: after the
    /// reduce-scatter each shard is complete on exactly one rank, after the
    /// all-gather everywhere; each step's incoming shard is what the
    /// previous rank sent in the same step.
    #[test]
    fn every_rank_ends_with_every_shard_reduced() {
        for world in 2..=8usize {
            let plans: Vec<CopyEnginePlan> = (0..world).map(|q| CopyEnginePlan::new(q, world, 1000, 1)).collect();
            // contributions[q][c]: the set of ranks summed into q's shard c.
            let mut out: Vec<Vec<u32>> = vec![vec![0; world]; world];
            for (q, row) in out.iter_mut().enumerate() {
                row[q] = 1 << q;
            }
            let input: Vec<Vec<u32>> = (0..world).map(|q| vec![1 << q; world]).collect();
            for s in 0..2 * (world - 1) {
                let sent: Vec<(usize, u32)> = (0..world)
                    .map(|q| {
                        let st = plans[q].steps[s];
                        (st.send, if st.from_input { input[q][st.send] } else { out[q][st.send] })
                    })
                    .collect();
                for q in 0..world {
                    let st = plans[q].steps[s];
                    let prev = (q + world - 1) % world;
                    assert_eq!(sent[prev].0, st.recv, "world {world} step {s} rank {q}");
                    out[q][st.recv] =
                        if st.mode == CE_MODE_REDUCE { input[q][st.recv] | sent[prev].1 } else { sent[prev].1 };
                }
                if s == world - 2 {
                    for q in 0..world {
                        assert_eq!(out[q][(q + 1) % world], (1 << world) - 1, "rank {q} owns shard q+1 after RS");
                    }
                }
            }
            assert!(out.iter().flatten().all(|&v| v == (1 << world) - 1), "world {world}: {out:?}");
        }
    }

    #[test]
    fn pieces_cover_every_shard_and_fit_the_staging() {
        for (packs, world, pieces) in [(1u64, 2usize, 1u32), (17, 3, 2), (100_003, 8, 4), (8, 8, 4)] {
            let plan = CopyEnginePlan::new(0, world, packs, pieces);
            let mut seen = vec![0u32; packs as usize];
            for c in 0..world {
                for p in 0..pieces {
                    let (first, len, offset) = plan.piece(c, p);
                    assert!((offset + len) * 16 <= plan.shard_bytes_max());
                    for i in first..first + len {
                        seen[i as usize] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "{packs} packs, {world} ranks, {pieces} pieces");
        }
        assert_eq!(CopyEnginePlan::elements(2, 3, 37, 8), (16, 21));
        assert_eq!(CopyEnginePlan::elements(4, 3, 37, 8), (32, 5));
        assert_eq!(pieces_for(1 << 20, 8), 1);
        assert_eq!(pieces_for(8 << 20, 8), 2);
        assert_eq!(pieces_for(64 << 20, 8), 4);
        assert_eq!(pieces_for(4 << 20, 2), 4);
    }
}
