//! OneShotPush: every rank writes its whole message into its slot of every
//! rank's receive buffer; completion travels in the payload (no barrier).
//! Kernel: `kernels-rs/src/device/one_shot_push.rs`; scratch:
//! `ScratchLayout::one_shot_push_*` (three generations of `world` copies).

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::partition::push_grid;

use super::{AlgorithmHost, Capabilities, CostRecipe, CostShape, FlowSet, Geometry, PhaseSpec};

pub(crate) struct OneShotPush;

impl AlgorithmHost for OneShotPush {
    fn kernel(&self) -> AlgorithmId {
        AlgorithmId::OneShotPush
    }

    fn supports_host_staged(&self) -> bool {
        true
    }

    fn requirement(&self, caps: &Capabilities, bytes: Option<usize>) -> Result<(), String> {
        match bytes {
            _ if caps.one_shot_push_max_bytes == 0 => {
                Err("one-shot-push is disabled (one_shot_push_max_bytes = 0)".into())
            }
            Some(b) if b > caps.one_shot_push_max_bytes => {
                Err(format!("one-shot-push handles at most {} bytes", caps.one_shot_push_max_bytes))
            }
            _ => Ok(()),
        }
    }

    fn launch_capacity_packs(&self, g: &Geometry) -> u64 {
        g.layout.one_shot_push_max_packs
    }

    fn grid(&self, g: &Geometry, packs: u64) -> u32 {
        push_grid(packs, Geometry::THREADS, g.layout.one_shot_push_stripe_packs, g.layout.push_blocks)
    }

    fn cost(&self, shape: &CostShape) -> CostRecipe {
        // Sum N copies from the receive buffer, write the output, re-arm
        // a generation (N copies of sentinel stores).
        let n = shape.world as f64;
        CostRecipe { phases: vec![PhaseSpec::staggered_writes(FlowSet::AllPairs, 1.0)], local_passes: 2.0 * n + 1.0 }
    }
}
