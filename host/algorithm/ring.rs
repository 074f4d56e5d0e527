//! Ring: the message is cut into chunks that travel around the ring of
//! ranks through per-block FIFOs in the right neighbour's scratch (reduce
//! for N-1 steps, then forward the result for N-1 steps); neighbour-only
//! posted writes with per-chunk flags and credits.
//! Kernel: `kernels-rs/src/device/ring.rs`; scratch: `ScratchLayout::ring_*`.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::partition::div_ceil;

use super::{AlgorithmHost, CostRecipe, CostShape, Engine, FlowSet, Geometry, LatencyOver, Op, Pattern, PhaseSpec};

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

    fn grid(&self, g: &Geometry, packs: u64) -> u32 {
        let per_block = g.layout.ring_chunk_packs.max(1) * g.world as u64;
        div_ceil(packs, per_block).clamp(1, g.ring_blocks as u64) as u32
    }

    fn single_gpu_traffic_per_rank(&self, _n: f64, s: f64) -> f64 {
        // as two-shot push: scatter, reduce, gather, each a read and a write
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
                ring_pipelined: true,
                engine: Engine::Sm,
                access_rounds: 0.0,
            }],
            local_passes: 3.0,
        }
    }
}
