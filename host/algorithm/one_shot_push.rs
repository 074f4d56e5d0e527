//! OneShotPush: every rank writes its whole message into its slot of every
//! peer's receive region; completion travels in the payload (no barrier, no
//! flags). A sentinel kernel: parameters by value, any launch shape.
//! Kernel: `kernels-rs/src/device/one_shot_push.rs` (`one_shot_push_<dt>`,
//! and `one_shot_push2_<dt>` for two ranks); receive region:
//! `ScratchLayout::one_shot_push_*` (two halves of `world - 1` slots).
//!
//! Its fused epilogue variant (`device/fused_one_shot_push.rs`) runs on the
//! same receive region and generation: a block owns whole rows, or a
//! thread-block cluster owns each row ([`cluster_launch`]), and the push
//! may be spread over more blocks than rows ([`spread_push_blocks`]).

#![forbid(unsafe_code)]

use std::mem::{align_of, offset_of, size_of};

use tp_allreduce_kernels::ids::{AlgorithmId, DType};
use tp_allreduce_kernels::layout::{LocalState, SignalBlock};
use tp_allreduce_kernels::params::{
    one_shot_push_slot, one_shot_push_source, FusedOneShotPushParams, OneShotPushParams, SentinelHeader,
    CLUSTER_SLICE_PACKS, EPILOGUE_SPREAD_PUSH, FLAG_TRACE, FUSED_MAX_THREADS, FUSED_PACKS_PER_THREAD,
    FUSED_SHORT_ROW_PACKS_PER_THREAD, FUSED_WIDE_MAX_THREADS, MAX_CLUSTER_BLOCKS,
};
use tp_allreduce_kernels::partition::{div_ceil, PACK_BYTES};

use super::epilogue::{fused_row_packs, fused_rows, row_blocks, row_chunks, EpilogueCall, EpilogueShape, FusedPath};
use super::launch::{entry_name, run_sentinel, ByDtype, Call, Grid, Issue, Launch, RankAlgorithm, RankSetup};
use super::{
    AlgorithmHost, Algorithm, Capabilities, CostRecipe, CostShape, FlowSet, Geometry, PhaseSpec, RankMemory,
    ResidentBlocks,
};
use crate::driver::{Kernel, ParamStruct};
use crate::embedded_ptx::CLUSTER_MIN_SM;
use crate::error::Result;

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
            overlapped: false,
            phases: vec![PhaseSpec::staggered_writes(FlowSet::AllPairs, 1.0).with_access_rounds((polls - 1.0).max(0.0))],
            local_passes: 2.0 * (n - 1.0) + 3.0,
        }
    }

    fn fuses_epilogue_by_default(&self) -> bool {
        true
    }

    fn entries(&self) -> Vec<String> {
        DType::ALL.into_iter().flat_map(|d| [entry_name(self.kernel(), d), two_ranks_entry(d)]).collect()
    }

    fn fused_entries(&self, sm: Option<u32>) -> Vec<String> {
        let mut names: Vec<String> = DType::ALL
            .into_iter()
            .flat_map(|d| {
                [
                    fused_entry(d, false, PushRowSplit::Long),
                    fused_entry(d, true, PushRowSplit::Long),
                    fused_entry(d, false, PushRowSplit::Short),
                    fused_entry(d, true, PushRowSplit::Short),
                    fused_entry(d, true, PushRowSplit::Wide),
                    fused_entry(d, true, PushRowSplit::WideSpread),
                ]
            })
            .collect();
        if sm.is_some_and(|sm| sm >= CLUSTER_MIN_SM) {
            names.extend(
                DType::ALL.into_iter().flat_map(|d| [false, true].map(|two| fused_entry(d, two, PushRowSplit::Cluster))),
            );
        }
        names
    }

    fn param_struct(&self, name: &str) -> Option<(usize, usize)> {
        name.starts_with(self.kernel().kernel_prefix())
            .then_some((size_of::<OneShotPushParams>(), align_of::<OneShotPushParams>()))
    }

    fn prepare(&self, rank: &RankSetup<'_>) -> Result<Option<Box<dyn RankAlgorithm>>> {
        let mut template = template(rank.rank, rank.memory, rank.wait_bounds_ns);
        if let Some(ring) = rank.trace {
            template.h.trace = ring;
            template.h.flags |= FLAG_TRACE;
        }
        let two_ranks = rank.world == 2 && rank.one_shot_push_tp2;
        let module = rank.module;
        let kernels = if two_ranks {
            ByDtype::kernels(module, two_ranks_entry)?
        } else {
            ByDtype::kernels(module, |d| entry_name(AlgorithmId::OneShotPush, d))?
        };
        let fused = |split| ByDtype::kernels(module, |d| fused_entry(d, two_ranks, split));
        let (long, short) = (fused(PushRowSplit::Long)?, fused(PushRowSplit::Short)?);
        let wide = if two_ranks { Some((fused(PushRowSplit::Wide)?, fused(PushRowSplit::WideSpread)?)) } else { None };
        let cluster = if rank.fused_clusters { Some(fused(PushRowSplit::Cluster)?) } else { None };
        Ok(Some(Box::new(OneShotPushRank {
            template,
            geometry: rank.geometry,
            kernels,
            fused: FusedKernels { long, short, wide, cluster },
            two_ranks,
            spread_push: rank.fused_spread_push,
        })))
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

/// The OneShotPush parameters of `rank`, all but the per-launch fields.
/// Pure: the slot arithmetic is tested on the CPU.
pub(crate) fn template(rank: usize, mem: &RankMemory, (timeout_ns, launch_timeout_ns): (u64, u64)) -> OneShotPushParams {
    let world = mem.region_bases.len();
    let scratch = |r: usize| mem.region_bases[r] + mem.scratch_offset;
    let abort_of = |r: usize| mem.region_bases[r] + offset_of!(SignalBlock, abort) as u64;
    let mut p = OneShotPushParams {
        h: SentinelHeader {
            control: mem.local_state + offset_of!(LocalState, control) as u64,
            error_record: mem.error_record,
            timeout_ns,
            launch_timeout_ns,
            half_bytes: mem.layout.one_shot_push_half_bytes,
            rank: rank as u32,
            world: world as u32,
            abort: abort_of(rank),
            ..SentinelHeader::default()
        },
        ..OneShotPushParams::default()
    };
    for k in 0..world.saturating_sub(1) {
        let dst = (rank + 1 + k) % world;
        let slot = one_shot_push_slot(rank as u32, dst as u32);
        p.send_to[k] = scratch(dst) + mem.layout.one_shot_push_slot_offset(slot);
        p.recv_from[k] = scratch(rank) + mem.layout.one_shot_push_slot_offset(k as u32);
        p.source_abort[k] = abort_of(one_shot_push_source(k as u32, rank as u32) as usize);
    }
    p
}

/// Entry point of the two-rank specialisation: `one_shot_push2_<dtype>`
/// (same parameters as `one_shot_push_<dtype>`).
pub fn two_ranks_entry(dtype: DType) -> String {
    format!("{}2_{}", AlgorithmId::OneShotPush.kernel_prefix(), dtype.name())
}

/// Entry of the fused (allreduce + residual add + RMSNorm) OneShotPush:
/// `fused_one_shot_push[2][_short|_wide|_wide_spread|_cluster]_<dtype>`:
/// `2` for two ranks, the suffix by packs of a row per thread (`_wide`:
/// one, two ranks only; `_wide_spread`: the same, the push spread;
/// `_short`: two; none: four; `_cluster`: one, a row over a cluster's
/// blocks, sm_90+ only). One `FusedOneShotPushParams` by value.
pub fn fused_entry(dtype: DType, two_ranks: bool, split: PushRowSplit) -> String {
    let suffix = match split {
        PushRowSplit::Wide => "_wide",
        PushRowSplit::WideSpread => "_wide_spread",
        PushRowSplit::Short => "_short",
        PushRowSplit::Long => "",
        PushRowSplit::Cluster => "_cluster",
    };
    format!("fused_one_shot_push{}{suffix}_{}", if two_ranks { "2" } else { "" }, dtype.name())
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
/// `epilogue::default_threads`) with the fewest packs per thread that cover
/// the row. The same on every rank (it fixes the reduction tree).
pub fn push_launch(row_packs: u64, two_ranks: bool, threads_override: Option<u32>) -> (PushRowSplit, u32) {
    if two_ranks && threads_override.is_none() && row_packs <= FUSED_WIDE_MAX_THREADS as u64 {
        return (PushRowSplit::Wide, (row_packs.max(1).div_ceil(32) * 32) as u32);
    }
    let threads = threads_override.unwrap_or_else(|| super::epilogue::default_threads(row_packs));
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
/// then clusters measured faster there too (docs/RESULTS.md). The same on
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
/// Which block pushes a pack does not change any output bit. One row keeps
/// its block (it measured slower spread: docs/RESULTS.md). The kernel
/// indexes packs in 32 bits: launches of 2^31 packs or more (32 GiB) push
/// by rows.
pub fn spread_push_blocks(rows: u64, row_packs: u64, cap: u32) -> Option<u32> {
    let packs = rows.saturating_mul(row_packs);
    let blocks = packs.div_ceil(SPREAD_PUSH_PACKS_PER_BLOCK).min(cap as u64);
    (rows >= 2 && blocks > rows && packs < SPREAD_PUSH_MAX_PACKS).then_some(blocks as u32)
}

/// Packs of a launch the spread push indexes (32-bit, with room for a
/// block's threads past the end).
pub const SPREAD_PUSH_MAX_PACKS: u64 = 1 << 31;

/// The grid of one fused OneShotPush launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PushGrid {
    /// Each row over a thread-block cluster.
    Cluster(ClusterLaunch),
    /// A block per row (`blocks` at least the rows, or looping over
    /// them), of the `split` entry and `threads` threads; `spread`: the
    /// push spread over all `blocks` (`EPILOGUE_SPREAD_PUSH`).
    Rows { split: PushRowSplit, threads: u32, blocks: u32, spread: bool },
}

/// The fused entries of one rank (its world decides `2` or not).
struct FusedKernels {
    long: ByDtype<Kernel>,
    short: ByDtype<Kernel>,
    /// Two ranks only: `_wide` and `_wide_spread`.
    wide: Option<(ByDtype<Kernel>, ByDtype<Kernel>)>,
    /// Where every rank runs clusters.
    cluster: Option<ByDtype<Kernel>>,
}

impl FusedKernels {
    fn get(&self, split: PushRowSplit, dtype: DType) -> Result<&Kernel> {
        let kernels = match (split, &self.wide, &self.cluster) {
            (PushRowSplit::Long, ..) => &self.long,
            (PushRowSplit::Short, ..) => &self.short,
            (PushRowSplit::Wide, Some((wide, _)), _) => wide,
            (PushRowSplit::WideSpread, Some((_, spread)), _) => spread,
            (PushRowSplit::Cluster, _, Some(cluster)) => cluster,
            _ => {
                return Err(crate::error::Error::Unsupported(format!(
                    "fused one-shot-push: no {split:?} entry on this communicator"
                )))
            }
        };
        Ok(kernels.get(dtype))
    }
}

/// OneShotPush's side of one rank.
struct OneShotPushRank {
    template: OneShotPushParams,
    geometry: Geometry,
    /// `one_shot_push2_<dt>` with two ranks (`Config::one_shot_push_tp2`),
    /// else `one_shot_push_<dt>`.
    kernels: ByDtype<Kernel>,
    fused: FusedKernels,
    two_ranks: bool,
    /// `Config::fused_spread_push`.
    spread_push: bool,
}

impl OneShotPushRank {
    /// The parameters of one launch over `count` elements.
    fn params(&self, input: u64, output: u64, count: u64) -> OneShotPushParams {
        let mut p = self.template;
        p.h.input = input;
        p.h.output = output;
        p.h.count = count;
        p
    }

    /// Most resident blocks of a fused launch of `threads` threads
    /// (`split` entries).
    fn push_cap(&self, split: PushRowSplit, threads: u32) -> u32 {
        let g = &self.geometry;
        match split {
            // Blocks of up to 1024 threads: the resident bound of that size.
            PushRowSplit::Wide | PushRowSplit::WideSpread => g.pull_max_blocks.min(g.sentinel_resident.cap(threads)),
            PushRowSplit::Short | PushRowSplit::Long | PushRowSplit::Cluster => g.pull_max_blocks,
        }
    }

    /// The grid of a fused launch over `rows` rows of `row_packs` packs:
    /// rows over clusters (every rank's GPU runs them, and the call does
    /// not fix the block size), else a block per row, its push spread over
    /// more blocks (`Config::fused_spread_push`) unless `normed` is written
    /// over the input (`in_place`). The same kernel and reduction tree on
    /// every rank; only the spread may differ.
    fn push_grid(&self, row_packs: u64, rows: u64, threads_override: Option<u32>, in_place: bool) -> PushGrid {
        let cluster = self.fused.cluster.as_ref().filter(|_| threads_override.is_none());
        if let Some(c) = cluster.and_then(|_| cluster_launch(row_packs, rows, self.geometry.pull_max_blocks)) {
            return PushGrid::Cluster(c);
        }
        let (split, threads) = push_launch(row_packs, self.two_ranks, threads_override);
        let cap = self.push_cap(split, threads);
        let spread_blocks = if self.spread_push && !in_place { spread_push_blocks(rows, row_packs, cap) } else { None };
        match spread_blocks {
            Some(blocks) => {
                let split = if split == PushRowSplit::Wide { PushRowSplit::WideSpread } else { split };
                PushGrid::Rows { split, threads, blocks, spread: true }
            }
            None => PushGrid::Rows { split, threads, blocks: row_blocks(rows, cap), spread: false },
        }
    }
}

impl RankAlgorithm for OneShotPushRank {
    fn run(&self, call: &Call, issue: &mut Issue<'_>) -> Result<()> {
        let capacity = self.geometry.layout.one_shot_push_max_packs;
        let default_shape = |packs| default_shape(packs, &self.geometry.sentinel_resident);
        let params = |input, output, count| self.params(input, output, count);
        let kernel = self.kernels.get(call.dtype);
        run_sentinel(AlgorithmId::OneShotPush, kernel, &self.geometry, capacity, call, default_shape, params, issue)
    }

    fn fused_path(&self, shape: &EpilogueShape) -> Option<FusedPath> {
        Some(fused_path(shape, self.geometry.layout.one_shot_push_max_packs))
    }

    /// Launches of `rows_per_launch` whole rows (any pointer alignment: the
    /// kernel goes element by element through a misaligned view).
    fn run_fused(&self, _call: &Call, e: &EpilogueCall, rows_per_launch: u64, issue: &mut Issue<'_>) -> Result<()> {
        let hidden = e.shape.hidden as u64;
        let row_packs = e.shape.row_packs().unwrap_or(0);
        for (row0, rows) in row_chunks(e.shape.rows, rows_per_launch) {
            let push = self.params(e.input + e.row_offset(row0), 0, rows * hidden);
            let mut p = FusedOneShotPushParams { push, epilogue: e.epilogue(row0, rows), ..Default::default() };
            // The kernel checks nothing of the shape but the cluster's: the
            // grid keeps `rows` rows within the receive region (fused_path),
            // at most `push_cap` blocks resident with the other ranks of the
            // GPU (the fused entries are among those it is computed from),
            // `threads` covering a row (check_threads); with the spread
            // push `normed` is not written over `input` (push_grid), and no
            // other output overlaps it (the call's checks).
            let (kernel, grid) = match self.push_grid(row_packs, rows, e.opts.threads, e.in_place()) {
                PushGrid::Cluster(c) => {
                    // One cluster of `blocks_per_cluster <= 8` blocks per
                    // row, a thread per pack of its block's slice of a row
                    // (the parameters state the same shape: the kernel
                    // traps on a disagreement).
                    p.cluster_blocks = c.blocks_per_cluster;
                    p.cluster_slice_packs = c.slice_packs(row_packs);
                    let grid = Grid { blocks: c.blocks(rows), threads: c.threads, cluster: c.blocks_per_cluster };
                    (self.fused.get(PushRowSplit::Cluster, e.shape.dtype)?, grid)
                }
                PushGrid::Rows { split, threads, blocks, spread } => {
                    if spread {
                        p.epilogue.flags |= EPILOGUE_SPREAD_PUSH;
                    }
                    (self.fused.get(split, e.shape.dtype)?, Grid::new(blocks, threads))
                }
            };
            issue(Launch::ByValue { kernel, grid, params: ParamStruct::of(&p) })?;
        }
        Ok(())
    }

    fn describe_fused(&self, shape: &EpilogueShape, rows: u64) -> String {
        match self.push_grid(shape.row_packs().unwrap_or(0), rows, None, false) {
            PushGrid::Cluster(c) => format!(
                "; each row over a thread-block cluster of {} blocks x {} threads",
                c.blocks_per_cluster, c.threads
            ),
            PushGrid::Rows { spread: true, blocks, .. } => format!(
                "; the push spread over {blocks} blocks, a block per row for the rest (outputs apart from the input)"
            ),
            PushGrid::Rows { spread: false, .. } => String::new(),
        }
    }
}

/// The fused path of a call of `shape` over a receive region of
/// `push_packs` packs per launch: whole rows of at most the fused limit,
/// as many as fit a launch.
pub(crate) fn fused_path(shape: &EpilogueShape, push_packs: u64) -> FusedPath {
    match fused_row_packs(shape) {
        Ok(row_packs) => fused_rows(Algorithm::OneShotPush, row_packs, push_packs / row_packs, "a launch", push_packs),
        Err(why) => FusedPath::Unfused(why),
    }
}

#[cfg(test)]
mod tests;
