//! What the add + RMSNorm epilogue of a fused call
//! (`Comm::all_reduce_add_rms_norm`) adds to an allreduce: fused into
//! OneShotPush, OneShotPull, TwoShotPush and Hierarchical, a block
//! reduction per row and the extra local traffic (residual in and out,
//! normed out, instead of the allreduce's output); after any other
//! algorithm (and NCCL; TwoShotPush and Hierarchical unless their fused
//! kernels are switched on, which the model does not price), the separate
//! `add_rms_norm` kernel: one more launch, its reduction and its traffic
//! (sum in, residual in and out, residual re-read, normed out).
//! The weight (`hidden` elements, read by every row) is neglected.

#![forbid(unsafe_code)]

use super::CostModel;
use crate::algorithm::Algorithm;

/// What the epilogue adds inside a fused kernel besides its traffic: the
/// row's reduction, which waits for the row's slowest slice, and the
/// heavier entry and arithmetic. Measured on 2 H200 at 3 x 7168 bf16, graph
/// replay: fused one-shot push minus the allreduce alone, +1.56 us with 2
/// ranks (docs/RESULTS.md, the fused epilogue on 2 H200).
pub const FUSED_EPILOGUE_US: f64 = 1.5;
/// The separate `add_rms_norm` kernel after a dependent allreduce in a CUDA
/// graph, launch and its own work on a small message: measured on 2 H200
/// at 3 x 7168 bf16, ours + separate kernel minus the allreduce alone,
/// 3.38 us with 2 ranks, 3.90 with 4 (docs/RESULTS.md).
pub const SEPARATE_KERNEL_GRAPH_US: f64 = 3.4;
/// The same launched eagerly: plus the host's launch call (assumption, as
/// `launch_eager_us - launch_graph_us` of the parameters).
pub const SEPARATE_KERNEL_EAGER_US: f64 = 5.4;

/// Local traffic of the fused epilogue beyond the allreduce's, in
/// multiples of the message: residual in, residual out, normed out, minus
/// the allreduce output it no longer writes.
const FUSED_EXTRA_PASSES: f64 = 2.0;
/// Local traffic of the separate kernel: sum in, residual in and out,
/// residual re-read, normed out.
const SEPARATE_PASSES: f64 = 5.0;

impl CostModel {
    /// Microseconds the epilogue adds to `algorithm`'s allreduce of
    /// `bytes` (`capturing`: graph replay, else eager). Host-staged
    /// OneShotPush fuses like over P2P (the epilogue is local). TwoShotPush
    /// and Hierarchical are charged the separate kernel: their fused
    /// kernels are off by default (`Config::fused_island_kernels`), and on
    /// 2 H200 they measured slower than the allreduce + the separate kernel
    /// (10.50 vs 8.84 us at 3 x 7168 bf16, 11.32 vs 10.90 at 64 x 7168;
    /// docs/RESULTS.md).
    pub fn epilogue_us(&self, algorithm: Algorithm, bytes: usize, capturing: bool) -> f64 {
        if algorithm.fuses_epilogue_by_default() {
            self.fused_epilogue_us(bytes)
        } else {
            self.separate_epilogue_us(bytes, capturing)
        }
    }

    /// The epilogue inside a fused kernel.
    pub fn fused_epilogue_us(&self, bytes: usize) -> f64 {
        FUSED_EPILOGUE_US + FUSED_EXTRA_PASSES * self.pass_us(bytes)
    }

    /// The separate `add_rms_norm` kernel after an allreduce.
    pub fn separate_epilogue_us(&self, bytes: usize, capturing: bool) -> f64 {
        let launch = if capturing { SEPARATE_KERNEL_GRAPH_US } else { SEPARATE_KERNEL_EAGER_US };
        launch + SEPARATE_PASSES * self.pass_us(bytes)
    }

    /// One pass of `bytes` through device memory.
    fn pass_us(&self, bytes: usize) -> f64 {
        bytes as f64 / (self.params.device_memory_gbps * 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fusing_saves_the_separate_kernel_and_some_traffic() {
        let m = CostModel::default();
        let fused = m.epilogue_us(Algorithm::OneShotPush, 43_008, true);
        let separate = m.epilogue_us(Algorithm::TwoShotPull, 43_008, true);
        // The measured figures at 3 x 7168 bf16 on 2 H200 (docs/RESULTS.md):
        // the fused epilogue +1.43-1.82 us, the separate kernel +3.37-3.87.
        assert!((1.4..1.9).contains(&fused), "{fused}");
        assert!((3.3..3.9).contains(&separate), "{separate}");
        assert_eq!(m.epilogue_us(Algorithm::OneShotPull, 43_008, true), fused);
        // NCCL is followed by the separate kernel too; eager launches cost more.
        assert_eq!(m.epilogue_us(Algorithm::Nccl, 43_008, true), separate);
        assert!(m.epilogue_us(Algorithm::Nccl, 43_008, false) > separate);
        // The island pushes are charged the separate kernel (measured).
        assert_eq!(m.epilogue_us(Algorithm::TwoShotPush, 43_008, true), separate);
        assert_eq!(m.epilogue_us(Algorithm::Hierarchical, 43_008, true), separate);
        // Traffic grows with the message.
        assert!(m.epilogue_us(Algorithm::OneShotPush, 8 << 20, true) > fused);
    }
}
