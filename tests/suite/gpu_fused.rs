//! The fused calls (`Comm::all_reduce_add_rms_norm`, `all_reduce_add`):
//! fresh random inputs (per rank) and residual and weight (the same on
//! every rank, as in tensor parallelism: the fused two-shot push and
//! hierarchical kernels add the row owner's residual for every rank),
//! poisoned outputs, the f64
//! reference with the element type's tolerances for the residual and the
//! normalised output, ranks bitwise equal, the input left unchanged. Rows
//! {1, 2, 3, 7, 64} x hidden {128, 4096, 5120, 7168, 8192, 16384} x every
//! dtype x 2-8 ranks on one GPU, in place and out of place, Gemma's weight
//! offset on and off, for each fused kernel (one-shot push and pull,
//! two-shot push, hierarchical over islands 2+2, 3+2, 3+3, 4+4, 2+2+2+2);
//! every algorithm's path (fused or unfused);
//! misaligned views; 2 ranks on 2 GPUs; graphs of layer chains replayed
//! 1000 times (`gpu_fused_graph.rs`).

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice};
use rand::rngs::StdRng;
use rand::Rng;
use tp_allreduce::tools::fused_reference;
use tp_allreduce::{Algorithm, Comm, Config, DType, FusedOptions};

use crate::common::{self, TestElem};

pub(crate) const EPS: f32 = 1e-6;
pub(crate) const ROWS: [usize; 5] = [1, 2, 3, 7, 64];
pub(crate) const HIDDEN: [usize; 6] = [128, 4096, 5120, 7168, 8192, 16384];

/// One fused call on every rank.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedCase {
    pub rows: usize,
    pub hidden: usize,
    /// `normed` written over `input`.
    pub in_place: bool,
    /// RMSNorm (`all_reduce_add_rms_norm`), else `all_reduce_add`.
    pub norm: bool,
    /// Element offset of every view on odd ranks (0: 16-byte aligned).
    pub shift: usize,
    pub opts: FusedOptions,
}

impl FusedCase {
    pub fn new(rows: usize, hidden: usize) -> FusedCase {
        FusedCase { rows, hidden, in_place: false, norm: true, shift: 0, opts: FusedOptions::default() }
    }
}

/// `n` values uniform in `[lo, hi)`.
pub(crate) fn uniform<T: TestElem>(rng: &mut StdRng, n: usize, lo: f64, hi: f64) -> Vec<T> {
    (0..n).map(|_| T::from_f64(rng.gen_range(lo..hi))).collect()
}

fn to_f64<T: TestElem>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// A rank's buffers, each `shift` elements into its allocation.
struct RankBuffers<T: TestElem> {
    input: CudaSlice<T>,
    residual: CudaSlice<T>,
    weight: CudaSlice<T>,
    normed: CudaSlice<T>,
    shift: usize,
}

/// The data of one call: every rank's input, the shared residual and weight.
pub(crate) struct CallData<T> {
    pub inputs: Vec<Vec<T>>,
    pub residual: Vec<T>,
    pub weight: Vec<T>,
}

impl<T: TestElem> CallData<T> {
    pub fn random(rng: &mut StdRng, world: usize, case: &FusedCase) -> CallData<T> {
        let n = case.rows * case.hidden;
        let (lo, hi) = if case.opts.weight_offset { (-0.5, 0.5) } else { (0.5, 1.5) };
        CallData {
            inputs: (0..world).map(|_| uniform(rng, n, -1.0, 1.0)).collect(),
            residual: uniform(rng, n, -1.0, 1.0),
            weight: uniform(rng, case.hidden, lo, hi),
        }
    }

    /// The f64 expectation.
    pub fn expected(&self, case: &FusedCase) -> fused_reference::Expected {
        let inputs: Vec<Vec<f64>> = self.inputs.iter().map(|v| to_f64(v)).collect();
        let weight = to_f64(&self.weight);
        let w = case.norm.then_some(weight.as_slice());
        fused_reference::expected(&inputs, &to_f64(&self.residual), w, case.hidden, EPS as f64, case.opts.weight_offset)
    }
}

/// `[poison; shift] ++ values` on the rank's stream.
fn upload<T: TestElem>(comm: &Comm, shift: usize, values: &[T]) -> Result<CudaSlice<T>, String> {
    let mut host = vec![T::default(); shift];
    host.extend_from_slice(values);
    comm.stream().clone_htod(&host).map_err(|e| format!("htod: {e:?}"))
}

fn poisoned<T: TestElem>(comm: &Comm, n: usize) -> Result<CudaSlice<T>, String> {
    let s = comm.stream();
    // SAFETY: poisoned right below, before any read.
    let buf = unsafe { s.alloc::<T>(n) }.map_err(|e| format!("alloc: {e:?}"))?;
    let p = common::ptr_of(&s, &buf, 0);
    // SAFETY: a live stream; the buffer holds n elements.
    unsafe { tp_allreduce::driver::memset_d8_async(p, common::POISON, n * std::mem::size_of::<T>(), s.cu_stream()) }
        .map_err(|e| e.to_string())?;
    Ok(buf)
}

/// Roundings the residual goes through on `comms` for `case`: the fused
/// kernel's (1; Hierarchical: the island partial too), else the
/// allreduce's plus the add's.
pub(crate) fn residual_roundings(comms: &[Comm], case: &FusedCase, dtype: DType) -> usize {
    let world = comms.len();
    if world == 1 {
        return 1;
    }
    let bytes = case.rows * case.hidden * dtype.size_bytes();
    let plan = comms[0].plan_fused(case.rows, case.hidden, dtype, false);
    if plan.fused && !case.opts.unfused {
        return plan.algorithm.max_roundings(world);
    }
    let algorithm =
        if case.opts.unfused { comms[0].plan_call(bytes, dtype, false, false).algorithm } else { plan.algorithm };
    algorithm.max_roundings(world) + 1
}

/// Runs `case` once on every rank of `comms` with fresh data and checks
/// everything (module docs).
pub(crate) fn run_case<T: TestElem>(comms: &[Comm], rng: &mut StdRng, case: &FusedCase) -> Result<(), String> {
    let world = comms.len();
    let n = case.rows * case.hidden;
    let data = CallData::<T>::random(rng, world, case);
    let mut bufs = Vec::with_capacity(world);
    for (r, c) in comms.iter().enumerate() {
        let shift = if r % 2 == 1 { case.shift } else { 0 };
        bufs.push(RankBuffers {
            input: upload(c, shift, &data.inputs[r])?,
            residual: upload(c, shift, &data.residual)?,
            weight: upload(c, shift, &data.weight)?,
            normed: poisoned(c, n + shift)?,
            shift,
        });
    }
    for (r, (c, b)) in comms.iter().zip(&bufs).enumerate() {
        let s = c.stream();
        let at = |buf: &CudaSlice<T>| common::ptr_of(&s, buf, b.shift);
        let (input, residual) = (at(&b.input), at(&b.residual));
        let normed = if case.in_place { input } else { at(&b.normed) };
        let stream = s.cu_stream();
        // SAFETY: every view lies inside a live buffer of n (+ shift) elements
        // (the weight's of hidden) on this rank's stream.
        let called = unsafe {
            if case.norm {
                let w = at(&b.weight);
                c.all_reduce_add_rms_norm_raw(
                    input,
                    residual,
                    w,
                    normed,
                    case.rows,
                    case.hidden,
                    EPS,
                    T::DTYPE,
                    &case.opts,
                    stream,
                )
            } else {
                c.all_reduce_add_raw(input, residual, case.rows, case.hidden, T::DTYPE, &case.opts, stream)
            }
        };
        called.map_err(|e| format!("rank {r}: {e}"))?;
    }
    check_ranks(comms, &bufs, &data, case)
}

/// Downloads every rank's results and checks them against the reference
/// and against rank 0, bitwise.
fn check_ranks<T: TestElem>(
    comms: &[Comm],
    bufs: &[RankBuffers<T>],
    data: &CallData<T>,
    case: &FusedCase,
) -> Result<(), String> {
    let expected = data.expected(case);
    let roundings = residual_roundings(comms, case, T::DTYPE);
    let mut first: Option<(Vec<u32>, Vec<u32>)> = None;
    for (r, (c, b)) in comms.iter().zip(bufs).enumerate() {
        c.synchronize().map_err(|e| format!("rank {r}: {e}"))?;
        let s = c.stream();
        let down = |buf: &CudaSlice<T>| -> Result<Vec<T>, String> {
            Ok(s.clone_dtoh(buf).map_err(|e| format!("dtoh: {e:?}"))?[b.shift..].to_vec())
        };
        let residual = down(&b.residual)?;
        let input = down(&b.input)?;
        let normed = if !case.norm {
            Vec::new()
        } else if case.in_place {
            input.clone()
        } else {
            down(&b.normed)?
        };
        let n_f64 = case.norm.then(|| to_f64(&normed));
        fused_reference::check(
            T::DTYPE,
            &expected,
            &to_f64(&residual),
            n_f64.as_deref(),
            case.hidden,
            roundings,
            comms.len(),
        )
        .map_err(|e| format!("rank {r}: {e}"))?;
        if case.norm && !case.in_place && common::bits(&input) != common::bits(&data.inputs[r]) {
            return Err(format!("rank {r}: the input changed"));
        }
        if !case.in_place && b.shift > 0 {
            let full = s.clone_dtoh(&b.normed).map_err(|e| format!("dtoh: {e:?}"))?;
            if full[..b.shift].iter().any(|x| x.to_bits32() != common::poison_bits::<T>()) {
                return Err(format!("rank {r}: wrote before the normed view"));
            }
        }
        let mine = (common::bits(&residual), common::bits(&normed));
        match &first {
            None => first = Some(mine),
            Some(f) if *f != mine => return Err(format!("rank {r} differs bitwise from rank 0")),
            Some(_) => {}
        }
    }
    Ok(())
}

pub(crate) fn run_typed(comms: &[Comm], rng: &mut StdRng, dtype: DType, case: &FusedCase) -> Result<(), String> {
    match dtype {
        DType::F32 => run_case::<f32>(comms, rng, case),
        DType::F16 => run_case::<half::f16>(comms, rng, case),
        DType::Bf16 => run_case::<half::bf16>(comms, rng, case),
    }
}

/// The fused tests' configuration: the island pushes' fused kernels on
/// (off by default), so that every fused kernel runs.
pub(crate) fn test_config() -> Config {
    Config { timeout: Duration::from_secs(3), fused_island_kernels: true, ..Config::default() }
}

/// `world` in-process ranks on `contexts` (round robin), `algorithm` forced
/// (`None`: the selection).
pub(crate) fn group(
    contexts: &[Arc<CudaContext>],
    world: usize,
    config: Config,
    algorithm: Option<Algorithm>,
) -> Vec<Comm> {
    let streams = (0..world).map(|r| contexts[r % contexts.len()].new_stream().expect("stream")).collect();
    let mut comms = Comm::from_streams(streams, config).expect("group init");
    for c in comms.iter_mut() {
        c.set_algorithm(algorithm).expect("algorithm available");
    }
    comms
}

/// Runs `cases` on a group per world size; panics with every failure.
fn matrix(
    test: &str,
    worlds: &[usize],
    algorithm: Option<Algorithm>,
    cases: impl Fn(usize) -> Vec<(DType, FusedCase)>,
) {
    let groups: Vec<(usize, Config)> = worlds.iter().map(|&w| (w, test_config())).collect();
    matrix_with(test, &groups, algorithm, false, cases);
}

/// How many cases of a matrix took each fused OneShotPush launch shape
/// (by `plan_fused`'s reason).
#[derive(Clone, Copy, Default)]
struct Shapes {
    clustered: usize,
    spread: usize,
}

/// [`matrix`] over `(world, config)` groups; `expect_fused`: the forced
/// algorithm must take its fused kernel for 3 x 7168 bf16 (so that a path
/// decision gone wrong cannot pass as the unfused path). Returns how many
/// cases spread rows over thread-block clusters or spread the push over
/// the grid (`None`: no GPU, skipped).
fn matrix_with(
    test: &str,
    groups: &[(usize, Config)],
    algorithm: Option<Algorithm>,
    expect_fused: bool,
    cases: impl Fn(usize) -> Vec<(DType, FusedCase)>,
) -> Option<Shapes> {
    let _lock = common::gpu_lock();
    let ctx = common::gpu(test)?;
    let mut rng = common::rng(test);
    let (mut count, mut fused, mut shapes, mut failures) = (0usize, 0usize, Shapes::default(), Vec::new());
    for (world, config) in groups {
        let world = *world;
        let comms = group(std::slice::from_ref(&ctx), world, config.clone(), algorithm);
        if expect_fused {
            let plan = comms[0].plan_fused(3, 7168, DType::Bf16, false);
            assert!(plan.fused, "{test}: world {world}: {} is not fused: {}", plan.algorithm, plan.reason);
        }
        for (dtype, case) in cases(world) {
            count += 1;
            let plan = comms[0].plan_fused(case.rows, case.hidden, dtype, false);
            fused += plan.fused as usize;
            shapes.clustered += plan.reason.contains("thread-block cluster") as usize;
            shapes.spread += (plan.reason.contains("push spread") && !case.in_place) as usize;
            if let Err(e) = run_typed(&comms, &mut rng, dtype, &case) {
                failures.push(format!("world {world} {} {case:?}: {e}", dtype.name()));
                if failures.len() > 20 {
                    break;
                }
            }
        }
    }
    eprintln!(
        "{test}: {count} cases ({fused} fused, {} over clusters, {} with the push spread), {} failures",
        shapes.clustered,
        shapes.spread,
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Some(shapes)
}

/// rows x hidden x dtype, in place and Gemma's offset alternating.
fn full_shapes(_world: usize) -> Vec<(DType, FusedCase)> {
    let mut v = Vec::new();
    for dtype in DType::ALL {
        for rows in ROWS {
            for hidden in HIDDEN {
                let k = v.len();
                let mut case = FusedCase::new(rows, hidden);
                case.in_place = k % 2 == 1;
                case.opts.weight_offset = (k / 2) % 2 == 1;
                v.push((dtype, case));
            }
        }
    }
    v
}

/// With thread-block clusters (the default where every rank's GPU runs
/// them: a few long rows spread over a cluster's blocks) and without (a
/// block per row, what GPUs before sm_90 run); on an sm_90+ GPU some cases
/// must take the clusters, and none without them.
#[test]
fn fused_one_shot_push_matrix() {
    let test = "fused_one_shot_push_matrix";
    let on: Vec<(usize, Config)> = (2..=8).map(|w| (w, test_config())).collect();
    let off: Vec<(usize, Config)> =
        [2, 3, 5, 8].into_iter().map(|w| (w, Config { fused_clusters: false, ..test_config() })).collect();
    let Some(shapes_on) = matrix_with(test, &on, Some(Algorithm::OneShotPush), true, full_shapes) else { return };
    let shapes_off = matrix_with(test, &off, Some(Algorithm::OneShotPush), true, full_shapes).unwrap_or_default();
    assert_eq!(shapes_off.clustered, 0, "fused_clusters: false took clusters");
    assert!(shapes_off.spread > 0, "no out-of-place case spread its push over the grid");
    let ctx = common::gpu(test).expect("ran above");
    if ctx.compute_capability().unwrap().0 >= 9 {
        assert!(shapes_on.clustered > 0, "no case took the thread-block clusters on an sm_90+ GPU");
    }
}

/// The spread push where a block's share exceeds its threads (each thread
/// pushes several packs): 30 long rows with three ranks, a block per row
/// (clusters off), f32 (2048 packs a row, 4 per thread) and bf16 (1024,
/// 2 per thread), out of place (spread) and in place (not).
#[test]
fn fused_spread_push_with_several_packs_per_thread() {
    let test = "fused_spread_push_with_several_packs_per_thread";
    let groups = [(3, Config { fused_clusters: false, ..test_config() })];
    let cases = |_world: usize| {
        let mut v = Vec::new();
        for dtype in [DType::F32, DType::Bf16] {
            for in_place in [false, true] {
                v.push((dtype, FusedCase { in_place, ..FusedCase::new(30, 8192) }));
            }
        }
        v
    };
    let Some(shapes) = matrix_with(test, &groups, Some(Algorithm::OneShotPush), true, cases) else { return };
    assert_eq!(shapes.spread, 2, "both out-of-place cases spread their push");
}

#[test]
fn fused_one_shot_pull_matrix() {
    matrix("fused_one_shot_pull_matrix", &[2, 3, 4, 5, 6, 7, 8], Some(Algorithm::OneShotPull), full_shapes);
}

/// The fused island push with one island: shares of whole rows (empty ones
/// for few rows), the owner's epilogue carried by the all-gather.
#[test]
fn fused_two_shot_push_matrix() {
    let groups: Vec<(usize, Config)> = (2..=8).map(|w| (w, test_config())).collect();
    matrix_with("fused_two_shot_push_matrix", &groups, Some(Algorithm::TwoShotPush), true, full_shapes);
}

/// Island splits of the hierarchical tests: 2+2, 3+2 (explicit: the two
/// members of the smaller island own two shares each), 3+3, 4+4, 2+2+2+2.
pub(crate) fn island_groups() -> Vec<(usize, Config)> {
    let size = |world: usize, island_size: usize| (world, Config { island_size: Some(island_size), ..test_config() });
    let unequal = Config { islands: Some(vec![vec![0, 1, 2], vec![3, 4]]), ..test_config() };
    vec![size(4, 2), (5, unequal), size(6, 3), size(8, 4), size(8, 2)]
}

/// The fused island push with a cross phase: island partials in member
/// order, finals in island order with the owner's epilogue.
#[test]
fn fused_hierarchical_matrix() {
    matrix_with("fused_hierarchical_matrix", &island_groups(), Some(Algorithm::Hierarchical), true, full_shapes);
}

/// A few shapes, both forms, both offsets, fused and unfused.
fn some_shapes(_world: usize) -> Vec<(DType, FusedCase)> {
    let mut v = Vec::new();
    for dtype in DType::ALL {
        for (rows, hidden) in [(1, 128), (3, 7168), (7, 5120), (64, 4096)] {
            for k in 0..4 {
                let mut case = FusedCase::new(rows, hidden);
                case.in_place = k % 2 == 1;
                case.opts.weight_offset = k / 2 == 1;
                case.opts.unfused = k == 3;
                v.push((dtype, case));
            }
        }
    }
    v
}

/// The unfused path of every other algorithm (allreduce, then the separate
/// kernel), the selection's choice, and `FusedOptions::unfused`.
#[test]
fn fused_calls_on_every_algorithm() {
    let test = "fused_calls_on_every_algorithm";
    for a in [Algorithm::TwoShotPull, Algorithm::Ring] {
        matrix(test, &[2, 3, 4], Some(a), some_shapes);
    }
    matrix(test, &[2, 4, 8], None, some_shapes);
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu(test) else { return };
    let mut rng = common::rng(test);
    let config = Config { island_size: Some(2), ..test_config() };
    let comms = group(&[ctx], 4, config, Some(Algorithm::Hierarchical));
    for (dtype, case) in some_shapes(4) {
        run_typed(&comms, &mut rng, dtype, &case).unwrap_or_else(|e| panic!("hierarchical {case:?}: {e}"));
    }
}

/// `all_reduce_add` (no RMSNorm), misaligned views on odd ranks, odd row
/// lengths (not whole 16-byte packs), small receive regions
/// (several launches per call), thread overrides.
#[test]
fn fused_edge_cases() {
    let cases = |_world: usize| {
        let mut v = Vec::new();
        for dtype in DType::ALL {
            let mut add = FusedCase::new(7, 4096);
            add.norm = false;
            v.push((dtype, add));
            v.push((dtype, FusedCase { shift: 1, ..FusedCase::new(3, 7168) }));
            v.push((dtype, FusedCase { shift: 1, in_place: true, ..FusedCase::new(2, 128) }));
            v.push((dtype, FusedCase::new(5, 13)));
            v.push((dtype, FusedCase::new(2, 1000)));
            let mut threads = FusedCase::new(3, 7168);
            threads.opts.threads = Some(if dtype == DType::F32 { 512 } else { 256 });
            v.push((dtype, threads));
        }
        v
    };
    for a in [Algorithm::OneShotPush, Algorithm::OneShotPull, Algorithm::TwoShotPush] {
        matrix("fused_edge_cases", &[2, 3], Some(a), cases);
    }
    let hierarchical = [(4, Config { island_size: Some(2), ..test_config() })];
    matrix_with("fused_edge_cases", &hierarchical, Some(Algorithm::Hierarchical), false, cases);
    // 64 KiB receive regions: 64 rows of 7168 bf16 take 43 launches (one-shot
    // push); 256 KiB chunks: 2731 packs of half a two-shot share position
    // range at 3 ranks, 9 rows a launch (and 4 + 4 hierarchical: 2048 packs,
    // 8 rows).
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("fused_edge_cases") else { return };
    let mut rng = common::rng("fused_edge_cases");
    let config = Config { one_shot_push_max_bytes: 64 << 10, max_chunk_bytes: 256 << 10, ..test_config() };
    let islands = Config { island_size: Some(4), ..config.clone() };
    for (a, world, config) in [
        (Algorithm::OneShotPush, 3, &config),
        (Algorithm::OneShotPull, 3, &config),
        (Algorithm::TwoShotPush, 3, &config),
        (Algorithm::Hierarchical, 8, &islands),
    ] {
        let comms = group(std::slice::from_ref(&ctx), world, config.clone(), Some(a));
        for dtype in DType::ALL {
            let case = FusedCase::new(64, 7168);
            run_typed(&comms, &mut rng, dtype, &case).unwrap_or_else(|e| panic!("{a} {case:?}: {e}"));
        }
    }
}

/// One rank: no allreduce, the separate kernel alone (sum = input).
#[test]
fn fused_world_of_one() {
    let cases = |_world: usize| {
        let mut v = Vec::new();
        for dtype in DType::ALL {
            v.push((dtype, FusedCase::new(3, 7168)));
            v.push((dtype, FusedCase { in_place: true, ..FusedCase::new(7, 13) }));
            v.push((dtype, FusedCase { norm: false, ..FusedCase::new(2, 4096) }));
        }
        v
    };
    matrix("fused_world_of_one", &[1], None, cases);
}

/// Two ranks, one per GPU: the push and pull kernels across devices.
#[test]
fn fused_two_ranks_on_two_gpus() {
    let test = "fused_two_ranks_on_two_gpus";
    let _lock = common::gpu_lock();
    let Some(ctx0) = common::gpu(test) else { return };
    let Some(ctx1) = common::second_gpu(test) else { return };
    let mut rng = common::rng(test);
    let (mut count, mut failures) = (0usize, Vec::new());
    let algorithms = [Some(Algorithm::OneShotPush), Some(Algorithm::OneShotPull), Some(Algorithm::TwoShotPush), None];
    for algorithm in algorithms {
        let comms = group(&[ctx0.clone(), ctx1.clone()], 2, test_config(), algorithm);
        for (dtype, case) in full_shapes(2) {
            count += 1;
            if let Err(e) = run_typed(&comms, &mut rng, dtype, &case) {
                failures.push(format!("{algorithm:?} {} {case:?}: {e}", dtype.name()));
            }
        }
    }
    eprintln!("{test}: {count} cases, {} failures", failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Bad arguments are refused before any device work, with an error that
/// names the problem; the communicator stays usable.
#[test]
fn fused_calls_refuse_bad_arguments() {
    let test = "fused_calls_refuse_bad_arguments";
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu(test) else { return };
    let mut rng = common::rng(test);
    let comms = group(&[ctx], 2, test_config(), Some(Algorithm::OneShotPush));
    let (rows, hidden) = (3, 1024);
    let c = &comms[0];
    let s = c.stream();
    let input = s.clone_htod(&vec![half::bf16::ONE; rows * hidden]).unwrap();
    let mut residual = s.clone_htod(&vec![half::bf16::ONE; rows * hidden]).unwrap();
    let weight = s.clone_htod(&vec![half::bf16::ONE; hidden]).unwrap();
    let mut normed = s.clone_htod(&vec![half::bf16::ONE; rows * hidden]).unwrap();
    let mut short = s.clone_htod(&vec![half::bf16::ONE; rows * hidden - 1]).unwrap();
    let opts = FusedOptions::default();
    let invalid = |r: tp_allreduce::Result<()>, needle: &str| match r {
        Err(tp_allreduce::Error::InvalidUsage(m)) => assert!(m.contains(needle), "`{m}` lacks `{needle}`"),
        other => panic!("expected InvalidUsage containing `{needle}`, got {other:?}"),
    };
    invalid(c.all_reduce_add_rms_norm(&short, &mut residual, &weight, EPS, &mut normed, &opts), "whole number of rows");
    invalid(c.all_reduce_add_rms_norm(&input, &mut short, &weight, EPS, &mut normed, &opts), "residual has");
    invalid(c.all_reduce_add_rms_norm(&input, &mut residual, &weight, f32::NAN, &mut normed, &opts), "eps");
    // (32 threads do cover a row of 1024 bf16 = 128 packs at 4 per thread;
    // the too-few case is the unit test of `check_threads`.)
    let odd = FusedOptions { threads: Some(48), ..opts };
    invalid(c.all_reduce_add_rms_norm(&input, &mut residual, &weight, EPS, &mut normed, &odd), "multiple of 32");
    let (i, r, w, n) = (
        common::ptr_of(&s, &input, 0),
        common::ptr_of(&s, &residual, 0),
        common::ptr_of(&s, &weight, 0),
        common::ptr_of(&s, &normed, 0),
    );
    let bf = DType::Bf16;
    let st = s.cu_stream();
    // SAFETY: each call is refused before any device access.
    unsafe {
        // (Extents are checked first: an overlap must stay inside the buffers.)
        invalid(
            c.all_reduce_add_rms_norm_raw(i, r, w, r, rows, hidden, EPS, bf, &opts, st),
            "residual and normed overlap",
        );
        invalid(c.all_reduce_add_rms_norm_raw(i, r, w, n, rows + 1, hidden, EPS, bf, &opts, st), "holds");
        invalid(c.all_reduce_add_rms_norm_raw(i + 1, r, w, n, rows, hidden, EPS, bf, &opts, st), "not aligned");
        // Two rows each, the residual one row after the input: in bounds, overlapping.
        let row_bytes = (hidden * bf.size_bytes()) as u64;
        invalid(c.all_reduce_add_raw(i, i + row_bytes, rows - 1, hidden, bf, &opts, st), "input and residual overlap");
    }
    drop(short);
    // The communicator still works: one good call on both ranks.
    let case = FusedCase::new(rows, hidden);
    run_typed(&comms, &mut rng, bf, &case).expect("a good call after refused ones");
}
