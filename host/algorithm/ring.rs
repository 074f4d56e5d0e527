//! Ring: the message is cut into chunks that travel around the ring of
//! ranks through per-block FIFOs in the right neighbour's scratch (reduce
//! for N-1 steps, then forward the result for N-1 steps); neighbour-only
//! posted writes with per-chunk flags and credits.
//! Kernel: `kernels-rs/src/device/ring.rs`; scratch: `ScratchLayout::ring_*`.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::partition::{div_ceil, packs_for};

use super::launch::{chunks, entry_name, ByDtype, Call, Grid, Issue, Launch, RankAlgorithm, RankSetup};
use super::{AlgorithmHost, CostRecipe, CostShape, Engine, FlowSet, Geometry, LatencyOver, Op, Pattern, PhaseSpec};
use crate::driver::{Kernel, KernelArgs};
use crate::error::{Error, Result};

pub(crate) struct Ring;

impl AlgorithmHost for Ring {
    fn kernel(&self) -> AlgorithmId {
        AlgorithmId::Ring
    }

    fn supports_host_staged(&self) -> bool {
        true
    }

    /// Each reduction step rounds to the element type.
    fn max_roundings(&self, world: usize) -> usize {
        world
    }

    /// The ring streams any size through its FIFOs in one launch.
    fn launch_capacity_packs(&self, _g: &Geometry) -> u64 {
        u64::MAX / 2
    }

    fn launch_shape(&self, g: &Geometry, packs: u64) -> (u32, u32) {
        let per_block = g.layout.ring_chunk_packs.max(1) * g.world as u64;
        (div_ceil(packs, per_block).clamp(1, g.ring_blocks as u64) as u32, Geometry::THREADS as u32)
    }

    fn prepare(&self, rank: &RankSetup<'_>) -> Result<Option<Box<dyn RankAlgorithm>>> {
        Ok(Some(Box::new(RingRank {
            geometry: rank.geometry,
            handle: rank.handle,
            kernels: ByDtype::kernels(rank.module, |d| entry_name(AlgorithmId::Ring, d))?,
        })))
    }

    fn single_gpu_traffic_per_rank(&self, _n: f64, s: f64) -> f64 {
        // as two-shot push: scatter, reduce, gather, each a read and a write
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
                ring_pipelined: true,
                engine: Engine::Sm,
                access_rounds: 0.0,
            }],
            local_passes: 3.0,
        }
    }
}

/// The ring's side of one rank.
struct RingRank {
    geometry: Geometry,
    /// The rank's `DeviceHandle` (its FIFOs and flags).
    handle: u64,
    kernels: ByDtype<Kernel>,
}

impl RankAlgorithm for RingRank {
    fn run(&self, call: &Call, issue: &mut Issue<'_>) -> Result<()> {
        let kernel = self.kernels.get(call.dtype);
        let elem = call.dtype.size_bytes() as u64;
        for (start, n) in chunks(call.count, call.dtype, Ring.launch_capacity_packs(&self.geometry)) {
            let (blocks, threads) = Ring.launch_shape(&self.geometry, packs_for(n as u64, call.dtype));
            if blocks == 0 {
                return Err(Error::Unsupported(format!("ring: a launch of {n} elements does not fit the scratch")));
            }
            let off = start as u64 * elem;
            let args = KernelArgs::new().u64(self.handle).u64(call.input + off).u64(call.output + off).u64(n as u64);
            issue(Launch::Args { kernel, grid: Grid::new(blocks, threads), args: &args })?;
        }
        Ok(())
    }
}
