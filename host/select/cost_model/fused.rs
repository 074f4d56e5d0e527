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

/// One block reduction of a row's sum of squares: a warp butterfly, one
/// block barrier, the partials from shared memory, `sqrt` and a division
/// (assumption: ~500 cycles at ~1.8 GHz, with margin).
pub const BLOCK_REDUCTION_US: f64 = 0.3;
/// A separate small kernel after a dependent one in a CUDA graph: the
/// launch floor measured on one H200 (1.15-1.5 us per step of a graph of
/// tiny dependent kernels, docs/RESULTS.md).
pub const SEPARATE_KERNEL_GRAPH_US: f64 = 1.2;
/// The same launched eagerly: plus the host's launch call (assumption, as
/// `launch_eager_us - launch_graph_us` of the parameters).
pub const SEPARATE_KERNEL_EAGER_US: f64 = 3.2;

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
        match algorithm {
            Algorithm::OneShotPush | Algorithm::OneShotPull => self.fused_epilogue_us(bytes),
            _ => self.separate_epilogue_us(bytes, capturing),
        }
    }

    /// The epilogue inside a fused kernel.
    pub fn fused_epilogue_us(&self, bytes: usize) -> f64 {
        BLOCK_REDUCTION_US + FUSED_EXTRA_PASSES * self.pass_us(bytes)
    }

    /// The separate `add_rms_norm` kernel after an allreduce.
    pub fn separate_epilogue_us(&self, bytes: usize, capturing: bool) -> f64 {
        let launch = if capturing { SEPARATE_KERNEL_GRAPH_US } else { SEPARATE_KERNEL_EAGER_US };
        launch + BLOCK_REDUCTION_US + SEPARATE_PASSES * self.pass_us(bytes)
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
        assert!(fused < 0.4, "{fused}");
        assert!(separate - fused > SEPARATE_KERNEL_GRAPH_US, "{separate} vs {fused}");
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
