//! What an algorithm's host side hands the call pipeline, and what it is
//! built from. At init each algorithm turns the rank's setup
//! ([`RankSetup`]) into its side of the rank ([`RankAlgorithm`]: parameter
//! templates with every peer address resolved, its kernels looked up once);
//! per call it describes its launches ([`Launch`]) one at a time, and the
//! pipeline (`comm/call`, where `unsafe` is allowed) issues them on the
//! call's stream. An algorithm never launches anything itself: its files
//! stay free of `unsafe`, and the launches check their arguments against
//! the kernel's declared parameters.

#![forbid(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::CudaContext;
use tp_allreduce_kernels::ids::{AlgorithmId, DType};
use tp_allreduce_kernels::partition::packs_for;

use super::epilogue::{EpilogueCall, EpilogueShape, FusedPath};
use super::{CrossRegions, Geometry, IslandSplit, RankMemory, ResidentBlocks, Transport};
use crate::driver::copy_engine::{CopyEngineOp, CopyEngineRuntime};
use crate::driver::{Kernel, KernelArgs, KernelModule, ParamStruct};
use crate::error::{Error, Result};

/// Entry point name of a kernel: `<algorithm>_<dtype>`.
pub fn entry_name(algorithm: AlgorithmId, dtype: DType) -> String {
    format!("{}_{}", algorithm.kernel_prefix(), dtype.name())
}

/// One value per element type, indexed by [`DType`].
#[derive(Clone, Debug)]
pub(crate) struct ByDtype<T>([T; 3]);

impl<T> ByDtype<T> {
    pub fn get(&self, dtype: DType) -> &T {
        &self.0[dtype as usize]
    }
}

impl ByDtype<Kernel> {
    /// The kernels named `name(dtype)`, looked up in `module` once.
    pub fn kernels(module: &KernelModule, name: impl Fn(DType) -> String) -> Result<ByDtype<Kernel>> {
        Ok(ByDtype([
            module.kernel(&name(DType::F32))?,
            module.kernel(&name(DType::F16))?,
            module.kernel(&name(DType::Bf16))?,
        ]))
    }
}

/// What an algorithm's side of a rank is built from at init (the
/// communicator fills it in from its setup).
pub(crate) struct RankSetup<'a> {
    pub rank: usize,
    pub world: usize,
    pub transport: Transport,
    /// The islands Hierarchical runs on (two or more), if any.
    pub islands: Option<IslandSplit>,
    /// Every rank's memory as this rank maps it.
    pub memory: &'a RankMemory,
    /// The per-pair transport's host-memory cross regions.
    pub cross: Option<&'a CrossRegions>,
    pub geometry: Geometry,
    /// The rank's `DeviceHandle` (what the barrier kernels take).
    pub handle: u64,
    /// `Config::wait_bounds_ns`: (peer known to run the call, peer may not
    /// have launched it).
    pub wait_bounds_ns: (u64, u64),
    /// The trace ring the sentinel kernels write (`Config::trace`).
    pub trace: Option<u64>,
    /// `Config::one_shot_push_tp2`: two ranks take the `one_shot_push2`
    /// entries.
    pub one_shot_push_tp2: bool,
    /// `Config::fused_spread_push`.
    pub fused_spread_push: bool,
    /// `Config::fused_island_kernels`.
    pub fused_island_kernels: bool,
    /// Every rank's GPU runs thread-block clusters and `Config::fused_clusters`
    /// is on (the same on every rank).
    pub fused_clusters: bool,
    pub module: &'a KernelModule,
    pub ctx: &'a Arc<CudaContext>,
}

/// Where peers read this rank's input during a call, as the pipeline
/// resolved it (pull algorithms: `Comm::input_source`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PeerInput {
    /// Push algorithms: peers never read the input.
    Local,
    /// Copy each launch's input into `staging` first; peers read it through
    /// the device-table entry at `entry` (every rank's staging).
    Staged { staging: u64, entry: u64 },
    /// Peers read the input in place through the device-table entry at
    /// `entry` (a registered buffer, or a captured input registered later).
    Registered { entry: u64 },
}

/// One validated, ordered allreduce call, as an algorithm runs it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Call {
    pub input: u64,
    pub output: u64,
    pub count: usize,
    pub dtype: DType,
    /// `Config::launch_shape`: the forced shape of sentinel launches.
    pub forced_shape: Option<(u32, u32)>,
    /// The shape the tuning table measured for this size (sentinel
    /// algorithms), if any.
    pub tuned_shape: Option<(u32, u32)>,
    pub peer_input: PeerInput,
}

/// The grid of one kernel launch: `blocks` blocks of `threads` threads, in
/// thread-block clusters of `cluster` blocks when `cluster > 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Grid {
    pub blocks: u32,
    pub threads: u32,
    pub cluster: u32,
}

impl Grid {
    pub const fn new(blocks: u32, threads: u32) -> Grid {
        Grid { blocks, threads, cluster: 1 }
    }
}

/// One step of a call on its stream.
pub(crate) enum Launch<'a> {
    /// A kernel taking one parameter struct by value.
    ByValue { kernel: &'a Kernel, grid: Grid, params: ParamStruct<'a> },
    /// A kernel taking scalar arguments.
    Args { kernel: &'a Kernel, grid: Grid, args: &'a KernelArgs },
    /// A device-to-device copy (a pull call's input into staging).
    Copy { dst: u64, src: u64, bytes: usize },
    /// A copy-engine ring program on the call's stream and the rank's
    /// helper stream (`driver::copy_engine::run`), `step` the step kernel.
    CopyEngine { runtime: &'a CopyEngineRuntime, ops: &'a [CopyEngineOp], step: &'a Kernel },
}

/// Issues one launch on the call's stream (the pipeline's side).
pub(crate) type Issue<'i> = dyn FnMut(Launch<'_>) -> Result<()> + 'i;

/// An algorithm's side of one rank, built at init by
/// [`AlgorithmHost::prepare`](super::AlgorithmHost::prepare).
pub(crate) trait RankAlgorithm: Send + Sync {
    /// Issues the launches of `call`: splits it into launches of at most
    /// the algorithm's capacity, completes the parameters, picks each
    /// launch's shape. The host validates what the kernels do not: each
    /// launch fits the algorithm's receive region and stays resident.
    fn run(&self, call: &Call, issue: &mut Issue<'_>) -> Result<()>;

    /// Whether a call with the fused epilogue of `shape` runs this
    /// algorithm's fused kernels (launches of how many rows), and why not;
    /// `None`: the algorithm has no fused kernel. The same on every rank
    /// (it depends on nothing a rank alone sees).
    fn fused_path(&self, _shape: &EpilogueShape) -> Option<FusedPath> {
        None
    }

    /// Issues the launches of a fused call (`fused_path` said
    /// `rows_per_launch`): `call` is the allreduce of `epilogue.input`.
    fn run_fused(
        &self,
        _call: &Call,
        _epilogue: &EpilogueCall,
        _rows_per_launch: u64,
        _issue: &mut Issue<'_>,
    ) -> Result<()> {
        Err(Error::Unsupported("this algorithm has no fused kernel".into()))
    }

    /// What a fused call of `rows` rows of `shape` launches beyond "epilogue
    /// fused" (`Comm::plan_fused`); empty by default.
    fn describe_fused(&self, _shape: &EpilogueShape, _rows: u64) -> String {
        String::new()
    }
}

/// Splits `count` elements into launches of at most `cap_packs` packs each
/// (chunk boundaries on pack boundaries keep 16-byte alignment).
pub(crate) fn chunks(count: usize, dtype: DType, cap_packs: u64) -> impl Iterator<Item = (usize, usize)> {
    use tp_allreduce_kernels::partition::{elems_per_pack, PACK_BYTES};
    let per_pack = elems_per_pack(dtype);
    let cap_elems = (cap_packs.min((usize::MAX / PACK_BYTES) as u64) as usize).saturating_mul(per_pack).max(per_pack);
    (0..count).step_by(cap_elems).map(move |start| (start, cap_elems.min(count - start)))
}

/// The launches of a sentinel call: launches of at most `capacity` packs,
/// each of the forced, tuned or default (`default_shape(packs)`) shape
/// within residency, each taking `params(input, output, count)` by value.
/// The host validates what the kernel does not: each launch fits the
/// receive region and its shape stays resident.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_sentinel<P: Copy>(
    algorithm: AlgorithmId,
    kernel: &Kernel,
    geometry: &Geometry,
    capacity: u64,
    call: &Call,
    default_shape: impl Fn(u64) -> (u32, u32),
    params: impl Fn(u64, u64, u64) -> P,
    issue: &mut Issue<'_>,
) -> Result<()> {
    let elem = call.dtype.size_bytes() as u64;
    for (start, n) in chunks(call.count, call.dtype, capacity) {
        let packs = packs_for(n as u64, call.dtype);
        if packs == 0 || packs > capacity {
            return Err(Error::Unsupported(format!(
                "{}: a launch of {n} elements does not fit the receive region ({capacity} packs)",
                algorithm.kernel_prefix()
            )));
        }
        let shape =
            choose_shape(call.forced_shape, call.tuned_shape, default_shape(packs), &geometry.sentinel_resident)?;
        let p = params(call.input + start as u64 * elem, call.output + start as u64 * elem, n as u64);
        issue(Launch::ByValue { kernel, grid: Grid::new(shape.0, shape.1), params: ParamStruct::of(&p) })?;
    }
    Ok(())
}

/// The launch shape of one sentinel launch: the configured override, else
/// the tuning table's, else the default rule; checked against residency.
pub(crate) fn choose_shape(
    forced: Option<(u32, u32)>,
    tuned: Option<(u32, u32)>,
    default: (u32, u32),
    resident: &ResidentBlocks,
) -> Result<(u32, u32)> {
    if let Some((blocks, threads)) = forced {
        let cap = resident.cap(threads);
        if blocks > cap {
            return Err(Error::invalid(format!(
                "launch shape {blocks}x{threads}: at most {cap} blocks of {threads} threads stay resident on this GPU \
                 with the other ranks sharing it (a non-resident block could wait for a peer forever)"
            )));
        }
        return Ok((blocks, threads));
    }
    match tuned {
        Some((blocks, threads)) if resident.cap(threads) > 0 => Ok((blocks.min(resident.cap(threads)).max(1), threads)),
        _ => Ok(default),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_forced_tuned_or_default_within_residency() {
        let resident = ResidentBlocks([8; 32]);
        assert_eq!(choose_shape(None, None, (3, 256), &resident).unwrap(), (3, 256));
        assert_eq!(choose_shape(None, Some((4, 128)), (3, 256), &resident).unwrap(), (4, 128));
        // A tuned shape beyond what is resident here is clamped.
        assert_eq!(choose_shape(None, Some((64, 128)), (3, 256), &resident).unwrap(), (8, 128));
        assert_eq!(choose_shape(Some((2, 64)), Some((4, 128)), (3, 256), &resident).unwrap(), (2, 64));
        let e = choose_shape(Some((9, 64)), None, (3, 256), &resident).unwrap_err().to_string();
        assert!(e.contains("9x64") && e.contains("at most 8"), "{e}");
        let mut none_1024 = resident;
        none_1024.0[31] = 0;
        assert_eq!(choose_shape(None, Some((4, 1024)), (3, 256), &none_1024).unwrap(), (3, 256));
        assert_eq!(resident.cap(100), 0);
        assert_eq!(resident.cap(2048), 0);
    }

    #[test]
    fn chunks_cover_the_message_on_pack_boundaries() {
        let launches: Vec<_> = chunks(100, DType::Bf16, 4).collect();
        assert_eq!(launches, [(0, 32), (32, 32), (64, 32), (96, 4)]);
        assert_eq!(chunks(0, DType::F32, 4).count(), 0);
        assert_eq!(chunks(5, DType::F32, 0).collect::<Vec<_>>(), [(0, 4), (4, 1)]);
    }
}
