//! The fused epilogue's host rules (allreduce + residual add + RMSNorm,
//! `Comm::all_reduce_add_rms_norm`): the options, which path a call takes,
//! the launch shapes, and the checks of a call's shape. Pure: tested on
//! the CPU. Kernels: `kernels-rs/src/device/{fused_one_shot_push,
//! fused_one_shot_pull, fused_island_push, epilogue}.rs`.
//!
//! # Paths
//! Every fused path needs rows of whole packs (`hidden x element size` a
//! multiple of 16 bytes) of at most `FUSED_MAX_ROW_PACKS` packs (hidden
//! 16384 in f16/bf16, 8192 in f32); a block owns whole rows; launches
//! carry whole rows.
//! * **Fused one-shot push / pull**: the call's algorithm is OneShotPush or
//!   OneShotPull. Every rank adds its own residual.
//! * **Fused island push**: the call's algorithm is TwoShotPush or
//!   Hierarchical and `Config::fused_island_kernels` is on (off by default:
//!   on 2 H200 these kernels measured slower than the allreduce + the
//!   separate kernel, 10.50 vs 8.84 us at 3 x 7168 bf16 and 11.32 vs 10.90
//!   at 64 x 7168; docs/RESULTS.md). Shares are whole rows (`S` shares of `ceil(rows / S)`
//!   rows, [`share_rows`]); the owner of a share finishes its rows (the
//!   sum, the residual add, RMSNorm) and the all-gather carries the new residual and
//!   the normalised rows, two packs per position: a launch's share fits
//!   half a receive position range (`share_cap / 2` packs, the normalised
//!   packs in the other half), [`island_rows_per_launch`]. **The owner
//!   adds its residual (and weight) for every rank**, so ranks must pass
//!   the same residual and weight, as in tensor parallelism (the one-shot
//!   kernels add each rank's own; the results agree when the residuals
//!   do).
//! * **Unfused**: every other algorithm (two-shot pull, ring, NCCL; the
//!   island pushes unless their fused kernels are switched on) and
//!   every shape the fused kernels do not take: the allreduce (into
//!   `normed`, or in place into `input` for `all_reduce_add`), then the
//!   separate `add_rms_norm` kernel. Always correct.
//!
//! The path depends only on what every rank shares (the algorithm, rows,
//! hidden, dtype, capacities), never on one rank's pointers, so all ranks
//! run the same kernels (the pull kernel's barriers pair blocks across
//! ranks) with the same reduction tree: the fused kernels take views of any
//! alignment, going element by element through a misaligned one.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::params::{
    CLUSTER_SLICE_PACKS, FUSED_MAX_ROW_PACKS, FUSED_MAX_THREADS, FUSED_PACKS_PER_THREAD,
    FUSED_SHORT_ROW_PACKS_PER_THREAD, FUSED_WIDE_MAX_THREADS, MAX_CLUSTER_BLOCKS,
};
use tp_allreduce_kernels::partition::PACK_BYTES;

use crate::algorithm::Algorithm;
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

/// The kernels a fused call runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FusedPath {
    /// `fused_one_shot_push_<dt>`, launches of `rows_per_launch` rows.
    Push { rows_per_launch: u64 },
    /// `fused_one_shot_pull_<dt>`, launches of `rows_per_launch` rows.
    Pull { rows_per_launch: u64 },
    /// `fused_two_shot_push_<dt>` or `fused_hierarchical_<dt>` (the call's
    /// algorithm), launches of `rows_per_launch` rows.
    Island { rows_per_launch: u64 },
    /// The allreduce, then `add_rms_norm_<dt>`; why it is not fused.
    Unfused(String),
}

/// The device pointers of one fused call (weight and normed 0 without
/// RMSNorm).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpiloguePointers {
    pub input: u64,
    pub residual: u64,
    pub weight: u64,
    pub normed: u64,
}

/// `a..a+a_len` and `b..b+b_len` share a byte.
fn overlap(a: u64, a_len: u64, b: u64, b_len: u64) -> bool {
    a < b.saturating_add(b_len) && b < a.saturating_add(a_len)
}

/// Checks a fused call's arguments: sizes, eps, pointers (null, element
/// alignment), then each buffer's extent with `extent(name, pointer,
/// bytes)` (the driver's view of the allocation, so that a wrong count is
/// named as such before it shows as an overlap), then overlaps and the
/// thread override. `Err` is the message of an `Error::InvalidUsage`,
/// naming `what`.
pub fn check_call(
    what: &str,
    p: &EpiloguePointers,
    shape: &EpilogueShape,
    eps: f32,
    opts: &FusedOptions,
    extent: &dyn Fn(&str, u64, u64) -> Result<(), String>,
) -> Result<(), String> {
    let elem = shape.dtype.size_bytes() as u64;
    if shape.hidden == 0 {
        return Err(format!("{what}: hidden must be at least 1"));
    }
    if shape.rows > u32::MAX as usize || shape.hidden > u32::MAX as usize {
        return Err(format!("{what}: {} rows of {} elements: each must fit in 32 bits", shape.rows, shape.hidden));
    }
    let bytes = (shape.rows as u64)
        .checked_mul(shape.hidden as u64)
        .and_then(|c| c.checked_mul(elem))
        .ok_or_else(|| format!("{what}: rows x hidden overflows"))?;
    if shape.norm && !(eps.is_finite() && eps >= 0.0) {
        return Err(format!("{what}: eps must be finite and >= 0, got {eps}"));
    }
    let mut named = vec![("input", p.input, bytes), ("residual", p.residual, bytes)];
    if shape.norm {
        named.push(("weight", p.weight, shape.hidden as u64 * elem));
        named.push(("normed", p.normed, bytes));
    }
    for &(name, ptr, _) in &named {
        if ptr == 0 {
            return Err(format!("{what}: {name} is a null device pointer"));
        }
        if ptr % elem != 0 {
            return Err(format!("{what}: {name} ({ptr:#x}) is not aligned to the {elem}-byte element size"));
        }
    }
    for &(name, ptr, len) in &named {
        extent(name, ptr, len)?;
    }
    for (i, &(a, pa, la)) in named.iter().enumerate() {
        for &(b, pb, lb) in &named[i + 1..] {
            // The one overlap allowed: normed written over input, exactly.
            let in_place = a == "input" && b == "normed" && pa == pb;
            if !in_place && overlap(pa, la, pb, lb) {
                return Err(format!(
                    "{what}: {a} and {b} overlap (only normed may equal input, for the in-place form)"
                ));
            }
        }
    }
    if let (Some(threads), Some(row_packs)) = (opts.threads, shape.row_packs()) {
        check_threads(threads, row_packs).map_err(|e| format!("{what}: {e}"))?;
    }
    Ok(())
}

/// Whether `algorithm` has a kernel with the epilogue fused.
pub fn has_fused_kernel(algorithm: Algorithm) -> bool {
    matches!(
        algorithm,
        Algorithm::OneShotPush | Algorithm::OneShotPull | Algorithm::TwoShotPush | Algorithm::Hierarchical
    )
}

/// The receive region of an island push (TwoShotPush, Hierarchical) as
/// the fused kernels use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct IslandCapacity {
    /// Packs per owned position of a receive slot (`share_cap`).
    pub share_cap: u64,
    /// Shares a launch is cut into (`S`: the world, or the largest island).
    pub shares: u64,
}

/// What bounds one launch of each fused kernel (per communicator, the same
/// on every rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FusedCapacities {
    /// Packs of one OneShotPush launch (its receive region).
    pub push_packs: u64,
    /// Packs of one pull launch (staging).
    pub pull_packs: u64,
    pub two_shot_push: IslandCapacity,
    /// `None` without islands.
    pub hierarchical: Option<IslandCapacity>,
}

/// Rows per share of a fused island push launch over `rows` rows cut into
/// `shares` shares: share `k` holds rows `k R .. min((k + 1) R, rows)`,
/// `R = ceil(rows / shares)` (the last shares may be short or empty, e.g.
/// every share but the first for one row). The kernel computes the same.
pub fn share_rows(rows: u64, shares: u64) -> u64 {
    rows.div_ceil(shares.max(1))
}

/// Rows of one fused island push launch: `shares` shares of whole rows,
/// each within `share_cap / 2` packs (an all-gather position holds the new
/// residual, the normalised pack `share_cap / 2` positions further on).
pub fn island_rows_per_launch(cap: IslandCapacity, row_packs: u64) -> u64 {
    cap.shares * (cap.share_cap / 2).checked_div(row_packs).unwrap_or(0)
}

/// Byte distance from an all-gather position's residual pack to its
/// normalised pack (`FusedIslandPushParams::normed_slot_bytes`).
pub fn normed_slot_bytes(share_cap: u64) -> u64 {
    (share_cap / 2) * PACK_BYTES as u64
}

/// Blocks of a fused island push launch over `rows` rows on a rank that
/// owns `owned` of the `shares` shares: one per owned row (the finishing
/// phase deals them to blocks), at least one (phases A and D), at most `cap`.
pub fn island_blocks(rows: u64, shares: u64, owned: u64, cap: u32) -> u32 {
    row_blocks(share_rows(rows, shares) * owned, cap)
}

/// The path of a call of `shape` whose allreduce algorithm is `algorithm`,
/// with the launch capacities `caps`; `island_kernels`:
/// `Config::fused_island_kernels` (TwoShotPush and Hierarchical fuse only
/// with it).
pub fn fused_path(
    algorithm: Algorithm,
    shape: &EpilogueShape,
    caps: &FusedCapacities,
    island_kernels: bool,
) -> FusedPath {
    if !island_kernels && matches!(algorithm, Algorithm::TwoShotPush | Algorithm::Hierarchical) {
        return FusedPath::Unfused(format!(
            "{algorithm}'s fused kernel is off (Config::fused_island_kernels; it measured slower than the allreduce \
             + the separate kernel on 2 H200)"
        ));
    }
    let island = match algorithm {
        Algorithm::OneShotPush | Algorithm::OneShotPull => None,
        Algorithm::TwoShotPush => Some(caps.two_shot_push),
        Algorithm::Hierarchical => match caps.hierarchical {
            Some(c) => Some(c),
            None => return FusedPath::Unfused("hierarchical has no islands".into()),
        },
        other => return FusedPath::Unfused(format!("{other} has no fused kernel")),
    };
    let Some(row_packs) = shape.row_packs() else {
        return FusedPath::Unfused(format!(
            "a row of {} x {} is not a whole number of 16-byte packs",
            shape.hidden,
            shape.dtype.name()
        ));
    };
    if row_packs > FUSED_MAX_ROW_PACKS as u64 {
        return FusedPath::Unfused(format!(
            "rows of {} {} elements exceed the fused kernels' {} ({} packs)",
            shape.hidden,
            shape.dtype.name(),
            FUSED_MAX_ROW_PACKS as usize * PACK_BYTES / shape.dtype.size_bytes(),
            FUSED_MAX_ROW_PACKS
        ));
    }
    let (rows_per_launch, capacity) = match (algorithm, island) {
        (_, Some(cap)) => (island_rows_per_launch(cap, row_packs), cap.share_cap / 2),
        (Algorithm::OneShotPush, None) => (caps.push_packs / row_packs, caps.push_packs),
        (_, None) => (caps.pull_packs / row_packs, caps.pull_packs),
    };
    if rows_per_launch == 0 {
        let room = if island.is_some() { "half a share position range" } else { "a launch" };
        return FusedPath::Unfused(format!(
            "one row ({row_packs} packs) exceeds {room} of {algorithm} ({capacity} packs)"
        ));
    }
    match algorithm {
        Algorithm::OneShotPush => FusedPath::Push { rows_per_launch },
        Algorithm::OneShotPull => FusedPath::Pull { rows_per_launch },
        _ => FusedPath::Island { rows_per_launch },
    }
}

/// Default threads per block of a fused kernel for rows of `row_packs`
/// packs: as few packs per thread as 512 threads allow, spread evenly,
/// rounded up to whole warps (896 packs: 448 threads of 2 packs).
pub fn default_threads(row_packs: u64) -> u32 {
    let per_thread = row_packs.div_ceil(FUSED_MAX_THREADS as u64).max(1);
    let threads = row_packs.div_ceil(per_thread).max(1);
    (threads.div_ceil(32) * 32).min(FUSED_MAX_THREADS as u64) as u32
}

/// The fused OneShotPush kernel a launch takes, by packs of a row per
/// thread (each holds that many packs in registers across its wait).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushRowSplit {
    /// One pack per thread, blocks of up to `FUSED_WIDE_MAX_THREADS`
    /// (`fused_one_shot_push2_wide_<dt>`; two ranks, default threads).
    Wide,
    /// `Wide` with the push spread over the grid
    /// (`fused_one_shot_push2_wide_spread_<dt>`, `EPILOGUE_SPREAD_PUSH`):
    /// the same output bits; see [`spread_push_blocks`].
    WideSpread,
    /// Up to `FUSED_SHORT_ROW_PACKS_PER_THREAD` (`*_short_<dt>`).
    Short,
    /// Up to `FUSED_PACKS_PER_THREAD`.
    Long,
    /// One pack per thread, a row spread over the blocks of a thread-block
    /// cluster (`fused_one_shot_push[2]_cluster_<dt>`, sm_90 and newer):
    /// see [`cluster_launch`].
    Cluster,
}

impl PushRowSplit {
    /// Packs of a row per thread at most.
    pub fn packs_per_thread(self) -> u32 {
        match self {
            PushRowSplit::Wide | PushRowSplit::WideSpread | PushRowSplit::Cluster => 1,
            PushRowSplit::Short => FUSED_SHORT_ROW_PACKS_PER_THREAD,
            PushRowSplit::Long => FUSED_PACKS_PER_THREAD,
        }
    }
}

/// `(kernel, threads)` of a fused OneShotPush launch over rows of
/// `row_packs` packs: with two ranks and no threads override, one pack per
/// thread up to 1024 threads (a row's packs all in flight at once, the
/// measured fastest: docs/RESULTS.md); otherwise `threads` (the override or
/// [`default_threads`]) with the fewest packs per thread that cover the row.
/// The same on every rank (it fixes the reduction tree).
pub fn push_launch(row_packs: u64, two_ranks: bool, threads_override: Option<u32>) -> (PushRowSplit, u32) {
    if two_ranks && threads_override.is_none() && row_packs <= FUSED_WIDE_MAX_THREADS as u64 {
        return (PushRowSplit::Wide, (row_packs.max(1).div_ceil(32) * 32) as u32);
    }
    let threads = threads_override.unwrap_or_else(|| default_threads(row_packs));
    let split = if row_packs <= threads as u64 * FUSED_SHORT_ROW_PACKS_PER_THREAD as u64 {
        PushRowSplit::Short
    } else {
        PushRowSplit::Long
    };
    (split, threads)
}

/// A fused OneShotPush launch that spreads each row over the blocks of a
/// cluster: `blocks_per_cluster` blocks of `threads` threads, one cluster
/// per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClusterLaunch {
    pub blocks_per_cluster: u32,
    pub threads: u32,
}

impl ClusterLaunch {
    /// Blocks of the launch over `rows` rows.
    pub fn blocks(&self, rows: u64) -> u32 {
        rows as u32 * self.blocks_per_cluster
    }

    /// Packs of a row per block (`FusedOneShotPushParams::cluster_slice_packs`):
    /// at most `threads`, and `blocks_per_cluster` of them cover the row.
    pub fn slice_packs(&self, row_packs: u64) -> u32 {
        row_packs.div_ceil(self.blocks_per_cluster as u64) as u32
    }
}

/// The cluster launch over `rows` rows of `row_packs` packs, when it
/// applies: about `CLUSTER_SLICE_PACKS` packs per block (one per thread),
/// at most `MAX_CLUSTER_BLOCKS` blocks a cluster, and a cluster for every
/// row within `cap` resident blocks (more rows than that fill the GPU with
/// whole-row blocks anyway: the block-per-row kernels take them).
/// A few rows that a block per row of up to `FUSED_MAX_THREADS` threads
/// would hold at more than one pack per thread are the case it is for
/// (rows over 512 packs), with any world: such a block issues a whole row
/// on one SM while most SMs idle. With two ranks the one-pack-per-thread
/// `_wide` kernel was as fast until the exchange moved to mbarriers; since
/// then clusters measured faster there too (docs/RESULTS.md: 3.95-4.00
/// against 4.38-4.39 us at 3 x 7168, two ranks on one H200). The same on
/// every rank.
pub fn cluster_launch(row_packs: u64, rows: u64, cap: u32) -> Option<ClusterLaunch> {
    // One pack per thread in a block per row of at most 512 threads: no
    // cluster.
    let (_, block_threads) = push_launch(row_packs, false, None);
    if row_packs <= block_threads as u64 {
        return None;
    }
    let blocks_per_cluster = row_packs.div_ceil(CLUSTER_SLICE_PACKS as u64).clamp(1, MAX_CLUSTER_BLOCKS as u64);
    let threads = row_packs.div_ceil(blocks_per_cluster).max(1).div_ceil(32) * 32;
    if threads > FUSED_MAX_THREADS as u64 || rows == 0 || rows * blocks_per_cluster > cap as u64 {
        return None;
    }
    Some(ClusterLaunch { blocks_per_cluster: blocks_per_cluster as u32, threads: threads as u32 })
}

/// Packs per block the spread push aims at: one per thread of a block of
/// 256, the plain OneShotPush's geometry at these sizes.
pub const SPREAD_PUSH_PACKS_PER_BLOCK: u64 = 256;

/// Blocks of a fused OneShotPush launch (a block per row) over `rows` rows
/// of `row_packs` packs whose push is spread over the whole grid
/// (`EPILOGUE_SPREAD_PUSH`), when that grid has more blocks than rows:
/// about `SPREAD_PUSH_PACKS_PER_BLOCK` packs a block, at most `cap`.
/// Which block pushes a pack does not change any output bit.
/// One row keeps its block (measured slower spread, 4.31 against 4.20 us
/// at 1 x 7168 bf16 with two ranks on one H200; 4.33-4.41 against
/// 4.45-4.68 at 3 x 7168: docs/RESULTS.md).
/// The kernel indexes packs in 32 bits: launches of 2^31 packs or more
/// (32 GiB) push by rows.
pub fn spread_push_blocks(rows: u64, row_packs: u64, cap: u32) -> Option<u32> {
    let packs = rows.saturating_mul(row_packs);
    let blocks = packs.div_ceil(SPREAD_PUSH_PACKS_PER_BLOCK).min(cap as u64);
    (rows >= 2 && blocks > rows && packs < SPREAD_PUSH_MAX_PACKS).then_some(blocks as u32)
}

/// Packs of a launch the spread push indexes (32-bit, with room for a
/// block's threads past the end).
pub const SPREAD_PUSH_MAX_PACKS: u64 = 1 << 31;

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

    /// Every extent accepted (pure checks only).
    fn any_extent(_: &str, _: u64, _: u64) -> Result<(), String> {
        Ok(())
    }

    fn shape(rows: usize, hidden: usize, dtype: DType) -> EpilogueShape {
        EpilogueShape { rows, hidden, dtype, norm: true }
    }

    /// One-shot push and pull capacities; island regions of 2^20 packs per
    /// position range (4 and 2 x 4 ranks).
    fn caps(push_packs: u64, pull_packs: u64) -> FusedCapacities {
        FusedCapacities {
            push_packs,
            pull_packs,
            two_shot_push: IslandCapacity { share_cap: 1 << 20, shares: 4 },
            hierarchical: Some(IslandCapacity { share_cap: 1 << 20, shares: 4 }),
        }
    }

    #[test]
    fn one_shot_algorithms_fuse_whole_pack_rows_up_to_the_limit() {
        let s = shape(3, 7168, DType::Bf16);
        assert_eq!(s.row_packs(), Some(896));
        assert_eq!(s.bytes(), 43_008);
        assert_eq!(
            fused_path(Algorithm::OneShotPush, &s, &caps(1000, 500_000), true),
            FusedPath::Push { rows_per_launch: 1 }
        );
        assert_eq!(
            fused_path(Algorithm::OneShotPull, &s, &caps(1000, 500_000), true),
            FusedPath::Pull { rows_per_launch: 558 }
        );
        // hidden 16384 in bf16 is the largest fused row; f32 stops at 8192.
        assert!(matches!(
            fused_path(Algorithm::OneShotPush, &shape(1, 16384, DType::Bf16), &caps(1 << 20, 0), true),
            FusedPath::Push { .. }
        ));
        assert!(matches!(
            fused_path(Algorithm::OneShotPush, &shape(1, 8192, DType::F32), &caps(1 << 20, 0), true),
            FusedPath::Push { .. }
        ));
        let long = fused_path(Algorithm::OneShotPush, &shape(1, 16384, DType::F32), &caps(1 << 20, 0), true);
        assert!(matches!(&long, FusedPath::Unfused(why) if why.contains("8192")), "{long:?}");
    }

    #[test]
    fn other_algorithms_and_odd_rows_take_the_unfused_path() {
        let s = shape(7, 4096, DType::F16);
        for a in [Algorithm::TwoShotPull, Algorithm::Ring, Algorithm::Nccl] {
            assert!(
                matches!(fused_path(a, &s, &caps(1 << 20, 1 << 20), true), FusedPath::Unfused(why) if why.contains("no fused kernel"))
            );
        }
        // 13 bf16 elements per row: 26 bytes, not whole packs.
        let odd = fused_path(Algorithm::OneShotPush, &shape(2, 13, DType::Bf16), &caps(1 << 20, 1 << 20), true);
        assert!(matches!(&odd, FusedPath::Unfused(why) if why.contains("16-byte")), "{odd:?}");
        // A receive region smaller than a row.
        let small = fused_path(Algorithm::OneShotPush, &shape(2, 4096, DType::Bf16), &caps(100, 1 << 20), true);
        assert!(matches!(&small, FusedPath::Unfused(why) if why.contains("exceeds")), "{small:?}");
    }

    #[test]
    fn push_launch_takes_one_pack_per_thread_with_two_ranks_and_the_fewest_packs_otherwise() {
        // hidden 7168 bf16 = 896 packs.
        assert_eq!(push_launch(896, true, None), (PushRowSplit::Wide, 896));
        assert_eq!(push_launch(1024, true, None), (PushRowSplit::Wide, 1024));
        assert_eq!(push_launch(1, true, None), (PushRowSplit::Wide, 32));
        assert_eq!(push_launch(1025, true, None), (PushRowSplit::Long, 352));
        assert_eq!(push_launch(2048, true, None), (PushRowSplit::Long, 512));
        assert_eq!(push_launch(896, false, None), (PushRowSplit::Short, 448));
        assert_eq!(push_launch(896, true, Some(256)), (PushRowSplit::Long, 256));
        assert_eq!(push_launch(512, true, Some(256)), (PushRowSplit::Short, 256));
        for packs in 1..=FUSED_MAX_ROW_PACKS as u64 {
            for two_ranks in [false, true] {
                let (split, threads) = push_launch(packs, two_ranks, None);
                assert!(threads % 32 == 0 && threads >= 32, "{packs}: {threads}");
                assert!(packs <= threads as u64 * split.packs_per_thread() as u64, "{packs}: {split:?} x {threads}");
                let max = if split == PushRowSplit::Wide { FUSED_WIDE_MAX_THREADS } else { FUSED_MAX_THREADS };
                assert!(threads <= max, "{packs}: {threads}");
            }
        }
    }

    #[test]
    fn the_push_spreads_over_more_blocks_than_rows_only() {
        // 3 x 7168 bf16 (2688 packs): 11 blocks, as the plain kernel.
        assert_eq!(spread_push_blocks(3, 896, 36), Some(11));
        assert_eq!(spread_push_blocks(2, 896, 36), Some(7));
        assert_eq!(spread_push_blocks(1, 896, 36), None);
        // Capped by residency; never fewer blocks than rows.
        assert_eq!(spread_push_blocks(64, 896, 36), None);
        assert_eq!(spread_push_blocks(3, 896, 3), None);
        assert_eq!(spread_push_blocks(2, 128, 36), None);
        assert_eq!(spread_push_blocks(0, 896, 36), None);
        assert_eq!(spread_push_blocks(8, 4096, 36), Some(36));
        assert_eq!(spread_push_blocks(2, SPREAD_PUSH_MAX_PACKS / 2, 36), None);
        // The `_wide_spread` entries push one pack per thread: a share
        // never exceeds a row (threads = the row's packs, rounded to 32).
        for rows in 2..=40u64 {
            for row_packs in 1..=FUSED_WIDE_MAX_THREADS as u64 {
                let (split, threads) = push_launch(row_packs, true, None);
                assert_eq!(split, PushRowSplit::Wide);
                if let Some(blocks) = spread_push_blocks(rows, row_packs, 36) {
                    let share = (rows * row_packs).div_ceil(blocks as u64);
                    assert!(share <= threads as u64, "{rows} x {row_packs}: share {share} > {threads} threads");
                }
            }
        }
    }

    #[test]
    fn cluster_launches_spread_a_few_long_rows_and_cover_every_pack() {
        let launch = |blocks_per_cluster, threads| Some(ClusterLaunch { blocks_per_cluster, threads });
        // hidden 7168 bf16 = 896 packs: 7 blocks of 128 threads per row.
        assert_eq!(cluster_launch(896, 3, 36), launch(7, 128));
        assert_eq!(cluster_launch(896, 3, 36).map(|c| c.blocks(3)), Some(21));
        assert_eq!(cluster_launch(896, 5, 36), launch(7, 128));
        assert_eq!(cluster_launch(2048, 3, 36), launch(8, 256));
        // More rows than clusters fit: the block-per-row kernels.
        assert_eq!(cluster_launch(896, 6, 36), None);
        assert_eq!(cluster_launch(896, 64, 36), None);
        assert_eq!(cluster_launch(896, 0, 36), None);
        assert_eq!(cluster_launch(1024, 1, 36), launch(8, 128));
        assert_eq!(cluster_launch(2048, 1, 36), launch(8, 256));
        // Rows a block holds at one pack per thread: no cluster.
        assert_eq!(cluster_launch(16, 2, 36), None);
        assert_eq!(cluster_launch(512, 2, 36), None);
        assert_eq!(cluster_launch(513, 2, 36), launch(5, 128));
        for packs in 1..=FUSED_MAX_ROW_PACKS as u64 {
            let Some(c) = cluster_launch(packs, 1, 36) else {
                assert!(packs <= push_launch(packs, false, None).1 as u64, "{packs}: no cluster launch");
                continue;
            };
            assert!((2..=MAX_CLUSTER_BLOCKS).contains(&c.blocks_per_cluster), "{packs}: {c:?}");
            assert!(c.threads % 32 == 0 && c.threads <= FUSED_MAX_THREADS, "{packs}: {c:?}");
            // The kernel's slice (cluster_shape_check): one pack per
            // thread, and the cluster's slices cover the row.
            let slice = c.slice_packs(packs) as u64;
            assert!(slice <= c.threads as u64, "{packs}: {c:?}");
            assert!(slice * c.blocks_per_cluster as u64 >= packs, "{packs}: {c:?}");
        }
    }

    #[test]
    fn island_pushes_fuse_while_a_share_fits_half_a_position_range() {
        let s = shape(64, 7168, DType::Bf16); // 896 packs a row
        let mut c = caps(0, 0);
        c.two_shot_push = IslandCapacity { share_cap: 4 * 896 + 1, shares: 8 };
        // share_cap / 2 = 1792 packs: two rows per share, 16 rows a launch.
        assert_eq!(fused_path(Algorithm::TwoShotPush, &s, &c, true), FusedPath::Island { rows_per_launch: 16 });
        // Off (the default): the allreduce, then the separate kernel, saying why.
        for a in [Algorithm::TwoShotPush, Algorithm::Hierarchical] {
            let off = fused_path(a, &s, &c, false);
            assert!(matches!(&off, FusedPath::Unfused(why) if why.contains("fused_island_kernels")), "{off:?}");
        }
        assert!(matches!(fused_path(Algorithm::OneShotPush, &s, &caps(1 << 20, 0), false), FusedPath::Push { .. }));
        assert_eq!(
            fused_path(Algorithm::Hierarchical, &s, &c, true),
            FusedPath::Island { rows_per_launch: 4 * ((1 << 19) / 896) }
        );
        // Half a position range smaller than a row: unfused, saying why.
        c.two_shot_push.share_cap = 2 * 896 - 2;
        let small = fused_path(Algorithm::TwoShotPush, &s, &c, true);
        assert!(matches!(&small, FusedPath::Unfused(why) if why.contains("half a share")), "{small:?}");
        // No islands: hierarchical cannot fuse (nor run).
        c.hierarchical = None;
        assert!(matches!(fused_path(Algorithm::Hierarchical, &s, &c, true), FusedPath::Unfused(_)));
        // Rows past the fused limit or not whole packs: unfused, as for one-shot.
        let long = fused_path(Algorithm::TwoShotPush, &shape(1, 16384, DType::F32), &caps(0, 0), true);
        assert!(matches!(&long, FusedPath::Unfused(why) if why.contains("8192")), "{long:?}");
        let odd = fused_path(Algorithm::Hierarchical, &shape(2, 13, DType::Bf16), &caps(0, 0), true);
        assert!(matches!(&odd, FusedPath::Unfused(why) if why.contains("16-byte")), "{odd:?}");
        assert_eq!(normed_slot_bytes(4 * 896 + 1), 1792 * 16);
    }

    /// Every row of a launch lies in exactly one share, shares hold at most
    /// `share_rows` rows, and the blocks cover a rank's owned rows.
    #[test]
    fn row_shares_partition_the_rows() {
        for shares in 1..=8u64 {
            for rows in 0..=70u64 {
                let r = share_rows(rows, shares);
                let mut seen = vec![0u32; rows as usize];
                for k in 0..shares {
                    for row in (k * r)..((k + 1) * r).min(rows) {
                        seen[row as usize] += 1;
                    }
                }
                assert!(seen.iter().all(|&n| n == 1), "rows {rows} shares {shares}");
                assert!(r * shares >= rows && (rows == 0 || (r - 1) * shares < rows));
            }
        }
        // One row over 8 shares: share 0 holds it, the other 7 are empty.
        assert_eq!(share_rows(1, 8), 1);
        assert_eq!(share_rows(7, 4), 2);
        assert_eq!(island_blocks(64, 8, 1, 132), 8);
        assert_eq!(island_blocks(64, 4, 2, 132), 32);
        assert_eq!(island_blocks(1, 8, 1, 132), 1);
        assert_eq!(island_blocks(1000, 2, 1, 132), 132);
        assert_eq!(island_rows_per_launch(IslandCapacity { share_cap: 100, shares: 3 }, 0), 0);
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
    fn calls_are_checked_before_any_device_work() {
        let s = shape(3, 7168, DType::Bf16);
        let bytes = 43_008u64;
        let p = EpiloguePointers { input: 0x10_0000, residual: 0x20_0000, weight: 0x30_0000, normed: 0x40_0000 };
        let o = FusedOptions::default();
        assert_eq!(check_call("f", &p, &s, 1e-6, &o, &any_extent), Ok(()));
        // In place: normed == input.
        assert_eq!(check_call("f", &EpiloguePointers { normed: p.input, ..p }, &s, 1e-6, &o, &any_extent), Ok(()));
        let err = |p: EpiloguePointers, s: EpilogueShape, eps: f32, o: FusedOptions| {
            check_call("f", &p, &s, eps, &o, &any_extent).unwrap_err()
        };
        assert!(err(EpiloguePointers { normed: p.input + 2, ..p }, s, 1e-6, o).contains("input and normed overlap"));
        assert!(err(EpiloguePointers { residual: p.input + bytes - 2, ..p }, s, 1e-6, o)
            .contains("input and residual overlap"));
        assert!(
            err(EpiloguePointers { weight: p.residual + 64, ..p }, s, 1e-6, o).contains("residual and weight overlap")
        );
        assert!(err(EpiloguePointers { residual: 0, ..p }, s, 1e-6, o).contains("residual is a null"));
        assert!(err(EpiloguePointers { weight: p.weight + 1, ..p }, s, 1e-6, o).contains("not aligned to the 2-byte"));
        assert!(err(p, s, f32::NAN, o).contains("eps"));
        assert!(err(p, s, -1.0, o).contains("eps"));
        assert!(err(p, EpilogueShape { hidden: 0, ..s }, 1e-6, o).contains("hidden must be at least 1"));
        assert!(err(p, EpilogueShape { rows: usize::MAX / 2, ..s }, 1e-6, o).contains("32 bits"));
        assert!(err(p, s, 1e-6, FusedOptions { threads: Some(96), ..o }).contains("at least 224"));
        // Without RMSNorm, weight and normed are not looked at (eps neither).
        let add = EpilogueShape { norm: false, ..s };
        assert_eq!(
            check_call("f", &EpiloguePointers { weight: 0, normed: 0, ..p }, &add, f32::NAN, &o, &any_extent),
            Ok(())
        );
        // Buffers that only touch end to end do not overlap.
        assert_eq!(
            check_call("f", &EpiloguePointers { residual: p.input + bytes, ..p }, &s, 1e-6, &o, &any_extent),
            Ok(())
        );
    }

    /// A count too large for the buffers is named as such, not as the
    /// overlap it makes of the adjacent allocations (seen on the H200:
    /// `rows + 1` reported "input and residual overlap").
    #[test]
    fn extents_are_checked_before_overlaps() {
        let s = shape(3, 1024, DType::Bf16);
        let p = EpiloguePointers { input: 0x10_0000, residual: 0x10_1800, weight: 0x30_0000, normed: 0x40_0000 };
        let allocations = |name: &str, ptr: u64, bytes: u64| {
            let holds = 0x1800; // 3 x 1024 bf16
            if bytes > holds {
                Err(format!("{name} holds {holds} bytes from {ptr:#x}, but the call needs {bytes}"))
            } else {
                Ok(())
            }
        };
        let o = FusedOptions::default();
        assert_eq!(check_call("f", &p, &s, 1e-6, &o, &allocations), Ok(()));
        let more_rows = check_call("f", &p, &shape(4, 1024, DType::Bf16), 1e-6, &o, &allocations).unwrap_err();
        assert!(more_rows.contains("input holds 6144 bytes"), "{more_rows}");
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
    }
}
