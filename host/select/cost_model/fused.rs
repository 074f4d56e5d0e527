//! What the add + RMSNorm epilogue of a fused call
//! (`Comm::all_reduce_add_rms_norm`) adds to an allreduce: fused into
//! OneShotPush, OneShotPull, TwoShotPush and Hierarchical, a block
//! reduction per row and the extra local traffic (residual in and out,
//! normed out, instead of the allreduce's output); the fused island pushes
//! also carry the normalised rows in their all-gather (one more all-gather
//! payload over the fabric, read, reset and stored by every receiver);
//! after any other algorithm (and NCCL), the separate
//! `add_rms_norm` kernel: one more launch, its reduction and its traffic
//! (sum in, residual in and out, residual re-read, normed out).
//! The weight (`hidden` elements, read by every row) is neglected.

#![forbid(unsafe_code)]

use super::CostModel;
use crate::algorithm::{Algorithm, Transport};

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
/// Local traffic of the normalised copies a fused island push's all-gather
/// delivers (read, reset, store; at most the message).
const NORMED_GATHER_PASSES: f64 = 3.0;

impl CostModel {
    /// Microseconds the epilogue adds to `algorithm`'s allreduce of
    /// `bytes` over `transport` (`capturing`: graph replay, else eager).
    /// Host-staged OneShotPush fuses like over P2P (the epilogue is local).
    pub fn epilogue_us(&self, algorithm: Algorithm, transport: Transport, bytes: usize, capturing: bool) -> f64 {
        match algorithm {
            Algorithm::OneShotPush | Algorithm::OneShotPull => self.fused_epilogue_us(bytes),
            Algorithm::TwoShotPush | Algorithm::Hierarchical => {
                self.fused_epilogue_us(bytes) + self.normed_gather_us(transport, bytes)
            }
            _ => self.separate_epilogue_us(bytes, capturing),
        }
    }

    /// The normalised rows in a fused island push's all-gather: at most
    /// the message per rank over the fabric (staggered writes; host memory
    /// when host-staged) and its local passes. No extra hop: the packs
    /// travel with the new residual.
    fn normed_gather_us(&self, transport: Transport, bytes: usize) -> f64 {
        let p = &self.params;
        let wire_gbps = match transport {
            Transport::HostStaged => p.host_memory_gbps,
            // PerPair: the all-gather stays inside the islands (P2P).
            Transport::PeerToPeer | Transport::PerPair => p.nvswitch_gpu_gbps * p.staggered_write_efficiency,
        };
        bytes as f64 / (wire_gbps * 1e3) + NORMED_GATHER_PASSES * self.pass_us(bytes)
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
        let t = Transport::PeerToPeer;
        let fused = m.epilogue_us(Algorithm::OneShotPush, t, 43_008, true);
        let separate = m.epilogue_us(Algorithm::TwoShotPull, t, 43_008, true);
        assert!(fused < 0.4, "{fused}");
        assert!(separate - fused > SEPARATE_KERNEL_GRAPH_US, "{separate} vs {fused}");
        assert_eq!(m.epilogue_us(Algorithm::OneShotPull, t, 43_008, true), fused);
        // NCCL is followed by the separate kernel too; eager launches cost more.
        assert_eq!(m.epilogue_us(Algorithm::Nccl, t, 43_008, true), separate);
        assert!(m.epilogue_us(Algorithm::Nccl, t, 43_008, false) > separate);
        // The island pushes fuse too, their all-gather carrying the
        // normalised rows as well: dearer than one-shot, below the separate
        // kernel (which also pays a launch).
        let island = m.epilogue_us(Algorithm::TwoShotPush, t, 43_008, true);
        assert!(island > fused && island < separate, "{fused} < {island} < {separate}");
        assert_eq!(m.epilogue_us(Algorithm::Hierarchical, t, 43_008, true), island);
        assert!(m.epilogue_us(Algorithm::TwoShotPush, Transport::HostStaged, 43_008, true) > island);
        // Traffic grows with the message.
        assert!(m.epilogue_us(Algorithm::OneShotPush, t, 8 << 20, true) > fused);
    }
}
