//! The fused epilogue's host rules (allreduce + residual add + RMSNorm,
//! `Comm::all_reduce_add_rms_norm`), what every algorithm's fused variant
//! shares: the options, a call's shape and pointers, which rows a fused
//! kernel takes, the block sizes, and the separate `add_rms_norm` kernel
//! of the unfused path. Pure: tested on the CPU. Kernels:
//! `kernels-rs/src/device/epilogue.rs` and each algorithm's fused entries.
//!
//! # Paths
//! Every fused path needs rows of whole packs (`hidden x element size` a
//! multiple of 16 bytes) of at most `FUSED_MAX_ROW_PACKS` packs (hidden
//! 16384 in f16/bf16, 8192 in f32, [`fused_row_packs`]); a block owns
//! whole rows; launches carry whole rows. Which algorithms fuse, and how
//! many rows one launch takes, each algorithm says
//! (`RankAlgorithm::fused_path`):
//! * **OneShotPush, OneShotPull**: every rank adds its own residual.
//! * **TwoShotPush, Hierarchical** with `Config::fused_island_kernels`
//!   (off by default: on 2 H200 they measured slower than the allreduce +
//!   the separate kernel, docs/RESULTS.md): the owner of each row adds its
//!   residual (and weight) for every rank (`algorithm/island_push.rs`).
//! * **Unfused**: every other algorithm and every shape the fused kernels
//!   do not take: the allreduce (into `normed`, or in place into `input`
//!   for `all_reduce_add`), then the separate `add_rms_norm` kernel.
//!   Always correct.
//!
//! The path depends only on what every rank shares (the algorithm, rows,
//! hidden, dtype, capacities), never on one rank's pointers, so all ranks
//! run the same kernels (the pull kernel's barriers pair blocks across
//! ranks) with the same reduction tree: the fused kernels take views of any
//! alignment, going element by element through a misaligned one.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::params::{
    FusedEpilogue, EPILOGUE_NORM, EPILOGUE_WEIGHT_OFFSET, FUSED_MAX_ROW_PACKS, FUSED_MAX_THREADS,
    FUSED_PACKS_PER_THREAD,
};
use tp_allreduce_kernels::partition::PACK_BYTES;

use super::Algorithm;
use crate::driver::KernelArgs;
use crate::DType;

/// Options of the fused calls.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct FusedOptions {
    /// Scale by `1 + weight` (Gemma's RMSNorm) instead of `weight`.
    pub weight_offset: bool,
    /// Threads per block of the fused kernels (a multiple of 32, at most
    /// 512, at least a quarter of a row's 16-byte packs); `None`: the
    /// default rule ([`default_threads`]). The row's sum of squares is
    /// reduced in a tree that depends on it, so every rank must use the
    /// same value for the outputs to be bitwise equal across ranks.
    pub threads: Option<u32>,
    /// Take the unfused path whatever the algorithm: the allreduce the
    /// plain selection picks, then the separate `add_rms_norm` kernel (the
    /// reference the benchmark compares the fused kernels with).
    pub unfused: bool,
}

/// What a fused call computes, as every rank sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpilogueShape {
    pub rows: usize,
    pub hidden: usize,
    pub dtype: DType,
    /// RMSNorm after the add (`all_reduce_add_rms_norm`), or the add only
    /// (`all_reduce_add`).
    pub norm: bool,
}

impl EpilogueShape {
    pub fn count(&self) -> usize {
        self.rows * self.hidden
    }

    pub fn bytes(&self) -> usize {
        self.count() * self.dtype.size_bytes()
    }

    /// 16-byte packs per row when rows are whole packs.
    pub fn row_packs(&self) -> Option<u64> {
        let row_bytes = self.hidden * self.dtype.size_bytes();
        (row_bytes % PACK_BYTES == 0).then_some((row_bytes / PACK_BYTES) as u64)
    }
}

/// Whether a fused call runs an algorithm's fused kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FusedPath {
    /// The fused kernels, launches of `rows_per_launch` rows.
    Fused { rows_per_launch: u64 },
    /// The allreduce, then `add_rms_norm_<dt>`; why it is not fused.
    Unfused(String),
}

/// The path of a call whose algorithm has no fused kernel.
pub fn no_fused_kernel(algorithm: Algorithm) -> FusedPath {
    FusedPath::Unfused(format!("{algorithm} has no fused kernel"))
}

/// The packs of a row of `shape` when a fused kernel takes such rows
/// (whole packs, at most `FUSED_MAX_ROW_PACKS`), else why not.
pub fn fused_row_packs(shape: &EpilogueShape) -> Result<u64, String> {
    let Some(row_packs) = shape.row_packs() else {
        return Err(format!(
            "a row of {} x {} is not a whole number of 16-byte packs",
            shape.hidden,
            shape.dtype.name()
        ));
    };
    if row_packs > FUSED_MAX_ROW_PACKS as u64 {
        return Err(format!(
            "rows of {} {} elements exceed the fused kernels' {} ({} packs)",
            shape.hidden,
            shape.dtype.name(),
            FUSED_MAX_ROW_PACKS as usize * PACK_BYTES / shape.dtype.size_bytes(),
            FUSED_MAX_ROW_PACKS
        ));
    }
    Ok(row_packs)
}

/// The fused path of an algorithm whose launches take `rows_per_launch`
/// rows of `row_packs` packs, `capacity` packs in `room`.
pub fn fused_rows(algorithm: Algorithm, row_packs: u64, rows_per_launch: u64, room: &str, capacity: u64) -> FusedPath {
    if rows_per_launch == 0 {
        return FusedPath::Unfused(format!(
            "one row ({row_packs} packs) exceeds {room} of {algorithm} ({capacity} packs)"
        ));
    }
    FusedPath::Fused { rows_per_launch }
}

/// One validated fused call (device pointers of this rank).
#[derive(Clone, Copy, Debug)]
pub(crate) struct EpilogueCall {
    pub input: u64,
    pub residual: u64,
    /// 0 without RMSNorm.
    pub weight: u64,
    /// 0 without RMSNorm.
    pub normed: u64,
    pub shape: EpilogueShape,
    pub eps: f32,
    pub opts: FusedOptions,
}

impl EpilogueCall {
    pub fn flags(&self) -> u32 {
        let mut f = 0;
        if self.shape.norm {
            f |= EPILOGUE_NORM;
            if self.opts.weight_offset {
                f |= EPILOGUE_WEIGHT_OFFSET;
            }
        }
        f
    }

    /// Where the unfused path's allreduce puts the sum: `normed` (the
    /// separate kernel then overwrites it), or `input` in place without
    /// RMSNorm.
    pub fn sum_destination(&self) -> u64 {
        if self.shape.norm {
            self.normed
        } else {
            self.input
        }
    }

    /// Byte offset of row `row`.
    pub fn row_offset(&self, row: u64) -> u64 {
        row * (self.shape.hidden * self.shape.dtype.size_bytes()) as u64
    }

    /// The epilogue of the launch over rows `row0..row0 + rows`.
    pub fn epilogue(&self, row0: u64, rows: u64) -> FusedEpilogue {
        let off = self.row_offset(row0);
        let normed = if self.shape.norm { self.normed + off } else { 0 };
        FusedEpilogue {
            residual_in: self.residual + off,
            residual_out: self.residual + off,
            weight: self.weight,
            normed,
            rows: rows as u32,
            hidden: self.shape.hidden as u32,
            eps: self.eps,
            flags: self.flags(),
        }
    }

    /// `normed` written over `input` (the one overlap the checks allow).
    pub fn in_place(&self) -> bool {
        self.shape.norm && self.normed == self.input
    }

    /// Threads per block of the fused kernels for this call.
    pub fn threads(&self, row_packs: u64) -> u32 {
        self.opts.threads.unwrap_or_else(|| default_threads(row_packs))
    }

    /// The separate `add_rms_norm` kernel over the whole call, reading the
    /// sum at `sum`: its blocks, threads and arguments `(sum, residual_in,
    /// residual_out, weight, normed, rows, hidden, eps, flags)`. Any grid,
    /// a block of whole warps up to 512 threads.
    pub fn separate_kernel(&self, sum: u64) -> (u32, u32, KernelArgs) {
        let shape = &self.shape;
        let blocks = (shape.rows as u64).clamp(1, EPILOGUE_MAX_BLOCKS as u64) as u32;
        let args = KernelArgs::new()
            .u64(sum)
            .u64(self.residual)
            .u64(self.residual)
            .u64(self.weight)
            .u64(if shape.norm { self.normed } else { 0 })
            .u32(shape.rows as u32)
            .u32(shape.hidden as u32)
            .f32(self.eps)
            .u32(self.flags());
        (blocks, epilogue_threads(shape.hidden, shape.dtype), args)
    }
}

/// `(first row, rows)` of each launch over `rows` rows, `per_launch` each.
pub fn row_chunks(rows: usize, per_launch: u64) -> impl Iterator<Item = (u64, u64)> {
    let rows = rows as u64;
    let step = per_launch.clamp(1, u32::MAX as u64);
    (0..rows).step_by(step as usize).map(move |r| (r, step.min(rows - r)))
}

/// Default threads per block of a fused kernel for rows of `row_packs`
/// packs: as few packs per thread as 512 threads allow, spread evenly,
/// rounded up to whole warps (896 packs: 448 threads of 2 packs).
pub fn default_threads(row_packs: u64) -> u32 {
    let per_thread = row_packs.div_ceil(FUSED_MAX_THREADS as u64).max(1);
    let threads = row_packs.div_ceil(per_thread).max(1);
    (threads.div_ceil(32) * 32).min(FUSED_MAX_THREADS as u64) as u32
}

/// `Ok` when `threads` can run a fused kernel over rows of `row_packs`.
pub fn check_threads(threads: u32, row_packs: u64) -> Result<(), String> {
    if threads == 0 || threads % 32 != 0 || threads > FUSED_MAX_THREADS {
        return Err(format!("fused threads {threads}: a multiple of 32 in 32..={FUSED_MAX_THREADS}"));
    }
    if row_packs > threads as u64 * FUSED_PACKS_PER_THREAD as u64 {
        return Err(format!(
            "fused threads {threads}: rows of {row_packs} packs need at least {} threads ({} packs each)",
            row_packs.div_ceil(FUSED_PACKS_PER_THREAD as u64).div_ceil(32) * 32,
            FUSED_PACKS_PER_THREAD
        ));
    }
    Ok(())
}

/// Threads per block of the separate `add_rms_norm` kernel for rows of
/// `hidden` elements of `dtype`: one pack per thread up to 512 threads.
/// The same on every rank (it fixes the reduction tree).
pub fn epilogue_threads(hidden: usize, dtype: DType) -> u32 {
    let packs = (hidden as u64).div_ceil(PACK_BYTES as u64 / dtype.size_bytes() as u64);
    (packs.div_ceil(32) * 32).clamp(32, FUSED_MAX_THREADS as u64) as u32
}

/// Blocks of a launch over `rows` rows with at most `cap` resident.
pub fn row_blocks(rows: u64, cap: u32) -> u32 {
    rows.clamp(1, cap.max(1) as u64) as u32
}

/// Most blocks of a launch of the separate kernel (rows beyond it are
/// looped over by the blocks).
pub const EPILOGUE_MAX_BLOCKS: u32 = 65_535;

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(rows: usize, hidden: usize, dtype: DType) -> EpilogueShape {
        EpilogueShape { rows, hidden, dtype, norm: true }
    }

    #[test]
    fn fused_rows_are_whole_packs_up_to_the_limit() {
        let s = shape(3, 7168, DType::Bf16);
        assert_eq!(s.row_packs(), Some(896));
        assert_eq!(s.bytes(), 43_008);
        // hidden 16384 in bf16 is the largest fused row; f32 stops at 8192.
        assert_eq!(fused_row_packs(&shape(1, 16384, DType::Bf16)), Ok(2048));
        assert_eq!(fused_row_packs(&shape(1, 8192, DType::F32)), Ok(2048));
        let long = fused_row_packs(&shape(1, 16384, DType::F32)).unwrap_err();
        assert!(long.contains("8192"), "{long}");
        // 13 bf16 elements per row: 26 bytes, not whole packs.
        let odd = fused_row_packs(&shape(2, 13, DType::Bf16)).unwrap_err();
        assert!(odd.contains("16-byte"), "{odd}");
        let small = fused_rows(Algorithm::OneShotPush, 256, 0, "a launch", 100);
        assert!(matches!(&small, FusedPath::Unfused(why) if why.contains("exceeds")), "{small:?}");
        for a in [Algorithm::TwoShotPull, Algorithm::Ring, Algorithm::Nccl] {
            assert!(matches!(no_fused_kernel(a), FusedPath::Unfused(why) if why.contains("no fused kernel")));
        }
    }

    #[test]
    fn default_threads_spread_packs_evenly_in_whole_warps() {
        assert_eq!(default_threads(896), 448); // hidden 7168 bf16
        assert_eq!(default_threads(640), 320); // 5120 bf16
        assert_eq!(default_threads(2048), 512); // 16384 bf16: 4 packs each
        assert_eq!(default_threads(16), 32); // 128 bf16
        assert_eq!(default_threads(1), 32);
        assert_eq!(default_threads(513), 288);
        for packs in 1..=FUSED_MAX_ROW_PACKS as u64 {
            let t = default_threads(packs);
            check_threads(t, packs).unwrap_or_else(|e| panic!("{packs} packs: {e}"));
        }
    }

    #[test]
    fn thread_overrides_are_checked() {
        assert!(check_threads(256, 896).is_ok());
        assert!(check_threads(224, 896).is_ok());
        let few = check_threads(192, 896).unwrap_err();
        assert!(few.contains("at least 224"), "{few}");
        assert!(check_threads(100, 16).unwrap_err().contains("multiple of 32"));
        assert!(check_threads(1024, 16).is_err());
        assert!(check_threads(0, 16).is_err());
    }

    #[test]
    fn the_separate_kernel_takes_one_pack_per_thread_up_to_512() {
        assert_eq!(epilogue_threads(7168, DType::Bf16), 512);
        assert_eq!(epilogue_threads(128, DType::Bf16), 32);
        assert_eq!(epilogue_threads(100, DType::F32), 32);
        assert_eq!(epilogue_threads(1000, DType::F32), 256);
        assert_eq!(row_blocks(3, 36), 3);
        assert_eq!(row_blocks(64, 36), 36);
        assert_eq!(row_blocks(0, 36), 1);
        assert_eq!(row_chunks(5, 2).collect::<Vec<_>>(), [(0, 2), (2, 2), (4, 1)]);
    }
}
