//! OneShotPull: every rank reads the whole message from every peer and
//! reduces locally (the vLLM one-stage kernel). Start and end barriers.
//! Kernel: `kernels-rs/src/device/one_shot_pull.rs`; the pull launches it
//! shares with TwoShotPull: `pull.rs`. Its fused epilogue variant
//! (`device/fused_one_shot_pull.rs`) has the same barriers; between them a
//! block owns whole rows.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::{AlgorithmId, DType};
use tp_allreduce_kernels::partition::div_ceil;

use super::epilogue::{fused_row_packs, fused_rows, row_blocks, row_chunks, EpilogueCall, EpilogueShape, FusedPath};
use super::launch::{ByDtype, Call, Grid, Issue, Launch, RankAlgorithm, RankSetup};
use super::pull::{peer_entry, PullRank};
use super::{Algorithm, AlgorithmHost, CostRecipe, CostShape, Geometry, PhaseSpec};
use crate::driver::{Kernel, KernelArgs};
use crate::error::Result;

pub(crate) struct OneShotPull;

impl AlgorithmHost for OneShotPull {
    fn kernel(&self) -> AlgorithmId {
        AlgorithmId::OneShotPull
    }

    fn reads_peer_inputs(&self) -> bool {
        true
    }

    /// It writes the output while peers still read the input: in place it
    /// reads a staged copy.
    fn stages_in_place(&self) -> bool {
        true
    }

    fn supports_host_staged(&self) -> bool {
        false
    }

    fn launch_shape(&self, g: &Geometry, packs: u64) -> (u32, u32) {
        let blocks = div_ceil(packs, Geometry::THREADS).clamp(1, g.pull_max_blocks as u64);
        (blocks as u32, Geometry::THREADS as u32)
    }

    fn fuses_epilogue_by_default(&self) -> bool {
        true
    }

    fn fused_entries(&self, _sm: Option<u32>) -> Vec<String> {
        DType::ALL.into_iter().map(fused_entry).collect()
    }

    fn prepare(&self, rank: &RankSetup<'_>) -> Result<Option<Box<dyn RankAlgorithm>>> {
        Ok(Some(Box::new(OneShotPullRank {
            pull: PullRank::new(&OneShotPull, rank)?,
            fused: ByDtype::kernels(rank.module, fused_entry)?,
        })))
    }

    fn single_gpu_traffic_per_rank(&self, n: f64, s: f64) -> f64 {
        // read every rank's input, write the output
        (n + 1.0) * s
    }

    fn cost(&self, _shape: &CostShape) -> CostRecipe {
        // Start barrier, the reads (request + completion), end barrier;
        // local: read the peers' data, write the output.
        CostRecipe { overlapped: false, phases: vec![PhaseSpec::barrier_reads(1.0, 2.0, 1.0)], local_passes: 2.0 }
    }
}

/// Entry of the fused OneShotPull: `fused_one_shot_pull_<dtype>`.
pub fn fused_entry(dtype: DType) -> String {
    format!("fused_one_shot_pull_{}", dtype.name())
}

/// The fused path of a call of `shape` with a staging buffer of
/// `pull_packs` packs: whole rows of at most the fused limit, as many as
/// fit a launch.
pub(crate) fn fused_path(shape: &EpilogueShape, pull_packs: u64) -> FusedPath {
    match fused_row_packs(shape) {
        Ok(row_packs) => fused_rows(Algorithm::OneShotPull, row_packs, pull_packs / row_packs, "a launch", pull_packs),
        Err(why) => FusedPath::Unfused(why),
    }
}

/// OneShotPull's side of one rank.
struct OneShotPullRank {
    pull: PullRank,
    fused: ByDtype<Kernel>,
}

impl RankAlgorithm for OneShotPullRank {
    fn run(&self, call: &Call, issue: &mut Issue<'_>) -> Result<()> {
        self.pull.run(call, issue)
    }

    fn fused_path(&self, shape: &EpilogueShape) -> Option<FusedPath> {
        Some(fused_path(shape, self.pull.geometry.layout.max_packs))
    }

    /// Launches of `rows_per_launch` whole rows, the input registered or
    /// staged like a plain pull call's (staged when `normed` is written
    /// over it: peers read it until the end barrier).
    fn run_fused(&self, call: &Call, e: &EpilogueCall, rows_per_launch: u64, issue: &mut Issue<'_>) -> Result<()> {
        let kernel = self.fused.get(e.shape.dtype);
        let threads = e.threads(e.shape.row_packs().unwrap_or(0));
        let cap = self.pull.geometry.pull_max_blocks;
        for (row0, rows) in row_chunks(e.shape.rows, rows_per_launch) {
            let off = e.row_offset(row0);
            let bytes = (rows as usize) * e.shape.hidden * e.shape.dtype.size_bytes();
            let (entry, peer_offset) = peer_entry(call.peer_input, e.input + off, bytes, off, issue)?;
            let ep = e.epilogue(row0, rows);
            let args = KernelArgs::new()
                .u64(self.pull.handle)
                .u64(entry)
                .u64(peer_offset)
                .u64(ep.residual_in)
                .u64(ep.residual_out)
                .u64(ep.weight)
                .u64(ep.normed)
                .u32(ep.rows)
                .u32(ep.hidden)
                .f32(ep.eps)
                .u32(ep.flags);
            // The table entry's addresses are filled (or zero, which the
            // kernel refuses); the grid is the same on every rank.
            issue(Launch::Args { kernel, grid: Grid::new(row_blocks(rows, cap), threads), args: &args })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fused_pull_takes_whole_pack_rows_that_fit_the_staging() {
        let s = EpilogueShape { rows: 3, hidden: 7168, dtype: DType::Bf16, norm: true };
        assert_eq!(fused_path(&s, 500_000), FusedPath::Fused { rows_per_launch: 558 });
        let odd = fused_path(&EpilogueShape { hidden: 13, ..s }, 1 << 20);
        assert!(matches!(&odd, FusedPath::Unfused(why) if why.contains("16-byte")), "{odd:?}");
    }
}
