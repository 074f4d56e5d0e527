//! OneShotPush: every rank writes its whole message into its slot of every
//! peer's receive region; completion travels in the payload (no barrier, no
//! flags). A sentinel kernel: parameters by value, any launch shape.
//! Kernel: `kernels-rs/src/device/one_shot_push.rs` (`one_shot_push_<dt>`,
//! and `one_shot_push2_<dt>` for two ranks); receive region:
//! `ScratchLayout::one_shot_push_*` (two halves of `world - 1` slots).

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::partition::{div_ceil, PACK_BYTES};

use super::{AlgorithmHost, Capabilities, CostRecipe, CostShape, FlowSet, Geometry, PhaseSpec, ResidentBlocks};

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
        self.launch_shape(g, packs).0
    }


    fn launch_shape(&self, g: &Geometry, packs: u64) -> (u32, u32) {
        default_shape(packs, &g.sentinel_resident)
    }

    fn single_gpu_traffic_per_rank(&self, n: f64, s: f64) -> f64 {
        // push: read S, write N*S; poll-read N*S, write S (+ re-arm N*S)
        2.0 * s + 3.0 * n * s
    }

    fn cost(&self, shape: &CostShape) -> CostRecipe {
        // Local traffic: read the input twice (push, own term), read the
        // N-1 received copies, reset them, write the output.
        // Memory round trips: the first input load travels with the entry
        // loads (in the launch); the N-1 receive slots are polled in groups
        // of `POLL_GROUP`, one group after the other.
        let n = shape.world as f64;
        let polls = super::cost::access_groups(shape.world.saturating_sub(1), POLL_GROUP);
        CostRecipe {
            phases: vec![PhaseSpec::staggered_writes(FlowSet::AllPairs, 1.0).with_access_rounds((polls - 1.0).max(0.0))],
            local_passes: 2.0 * (n - 1.0) + 3.0,
        }
    }
}

/// Receive slots the kernel polls back to back.
const POLL_GROUP: usize = tp_allreduce_kernels::params::ONE_SHOT_PUSH_POLL_GROUP;

/// Block sizes of the default rule by message size: 256 threads up to
/// 64 KiB, 512 up to 2 MiB, 1024 above.
const DEFAULT_THREADS: [(u64, u32); 3] = [(64 << 10, 256), (2 << 20, 512), (u64::MAX, 1024)];

/// The default launch shape of a OneShotPush launch over `packs` packs
/// (until a tuning table measures better): the block size by message size,
/// as many blocks as give each thread one pack, capped by residency. A
/// block size that is not resident at all falls back to smaller blocks.
pub(crate) fn default_shape(packs: u64, resident: &ResidentBlocks) -> (u32, u32) {
    let bytes = packs.saturating_mul(PACK_BYTES as u64);
    let mut threads = DEFAULT_THREADS.iter().find(|(limit, _)| bytes <= *limit).map_or(1024, |&(_, t)| t);
    while threads > 32 && resident.cap(threads) == 0 {
        threads /= 2;
    }
    let cap = resident.cap(threads).max(1) as u64;
    let blocks = div_ceil(packs, threads as u64).clamp(1, cap);
    (blocks as u32, threads)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 132 SMs of 65536 registers and 2048 threads, kernels at 64
    /// registers: one 1024-thread block per SM, two of 512, ...
    fn h200_one_rank() -> ResidentBlocks {
        let mut t = [0u32; 32];
        for (i, cap) in t.iter_mut().enumerate() {
            let threads = 32 * (i as u32 + 1);
            *cap = 132 * (65_536 / (64 * threads)).min(2048 / threads).min(32);
        }
        ResidentBlocks(t)
    }

    #[test]
    fn default_shapes_follow_the_rule_of_the_design() {
        let r = h200_one_rank();
        let packs = |bytes: u64| bytes / 16;
        assert_eq!(default_shape(packs(4 << 10), &r), (1, 256));
        assert_eq!(default_shape(packs(42 << 10), &r), (11, 256));
        assert_eq!(default_shape(packs(64 << 10), &r), (16, 256));
        assert_eq!(default_shape(packs(256 << 10), &r), (32, 512));
        assert_eq!(default_shape(packs(1 << 20), &r), (128, 512));
        // 8 MiB: 512 blocks wanted, 132 resident.
        assert_eq!(default_shape(packs(8 << 20), &r), (132, 1024));
        assert_eq!(default_shape(1, &r), (1, 256));
    }

    #[test]
    fn default_shapes_respect_residency_when_ranks_share_a_gpu() {
        // 8 ranks on one GPU: 132 * occupancy / 8.
        let mut shared = h200_one_rank();
        for cap in shared.0.iter_mut() {
            *cap /= 8;
        }
        assert_eq!(default_shape((1 << 20) / 16, &shared), (33, 512));
        assert_eq!(default_shape((8 << 20) / 16, &shared), (16, 1024));
        assert_eq!(default_shape((42 << 10) / 16, &shared), (11, 256));
        // A block size that is not resident at all falls back to smaller ones.
        let mut no_1024 = h200_one_rank();
        no_1024.0[31] = 0;
        assert_eq!(default_shape((16 << 20) / 16, &no_1024).1, 512);
    }
}
