//! The fused call in CUDA graphs: a chain of layers captured once per rank
//! and replayed 1000 times with fresh inputs and residual, every replay
//! checked. Layer l: copy the residual forward (so each layer's residual
//! input survives for the check), `all_reduce_add_rms_norm(x[l],
//! residual[l+1], w[l]) -> y[l]`, then a dependent elementwise kernel
//! `x[l+1] = y[l] * scale(rank) + bias(l)`. The last layer is checked
//! against the f64 reference of its actual inputs at every replay (every
//! layer at every 100th), ranks bitwise equal. Pull algorithms go through
//! the capture -> register protocol.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaGraph};
use half::bf16;
use rand::rngs::StdRng;
use tp_allreduce::{Algorithm, Comm, Config, DeviceBuffer, FusedOptions};

use crate::common;
use crate::gpu_fused::{group, island_groups, residual_roundings, test_config, uniform, CallData, FusedCase, EPS};

const LAYERS: usize = 16;
const REPLAYS: usize = 1000;
const ROWS: usize = 3;
const HIDDEN: usize = 7168;

/// One rank's chain buffers (`cuMemAlloc` memory: captured pull inputs
/// must be exportable to be registered).
struct Chain {
    x: Vec<DeviceBuffer<bf16>>,
    residual: Vec<DeviceBuffer<bf16>>,
    weight: Vec<DeviceBuffer<bf16>>,
    y: Vec<DeviceBuffer<bf16>>,
}

fn scale(rank: usize) -> f32 {
    0.5 + 0.125 * rank as f32
}

fn bias(layer: usize) -> f32 {
    ((layer % 5) as f32 - 2.0) * 0.0625
}

fn chain(comm: &Comm, weights: &[Vec<bf16>]) -> Chain {
    let s = comm.stream();
    let n = ROWS * HIDDEN;
    let zeros = |k: usize| (0..k).map(|_| DeviceBuffer::<bf16>::zeros(&s, n).expect("alloc")).collect::<Vec<_>>();
    Chain {
        x: zeros(LAYERS + 1),
        residual: zeros(LAYERS + 1),
        weight: weights.iter().map(|w| DeviceBuffer::from_host(&s, w).expect("htod")).collect(),
        y: zeros(LAYERS),
    }
}

fn capture(comms: &[Comm], chains: &mut [Chain], opts: &FusedOptions) -> Vec<CudaGraph> {
    comms
        .iter()
        .zip(chains.iter_mut())
        .enumerate()
        .map(|(r, (c, ch))| {
            let s = c.stream();
            s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).expect("begin capture");
            for l in 0..LAYERS {
                let (before, after) = ch.residual.split_at_mut(l + 1);
                s.memcpy_dtod(&before[l], &mut after[0]).expect("residual copy");
                c.all_reduce_add_rms_norm(&ch.x[l], &mut after[0], &ch.weight[l], EPS, &mut ch.y[l], opts)
                    .unwrap_or_else(|e| panic!("capture rank {r} layer {l}: {e}"));
                let (y, x) = (&ch.y[l], &mut ch.x[l + 1]);
                tp_allreduce::driver::elementwise::affine(&s, y, x, scale(r), bias(l)).expect("affine");
            }
            s.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
                .expect("end capture")
                .expect("a graph")
        })
        .collect()
}

/// Checks layer `l` of every rank against the reference of its actual
/// inputs (downloaded), and the ranks against each other bitwise.
fn check_layer(
    comms: &[Comm],
    chains: &[Chain],
    weights: &[Vec<bf16>],
    l: usize,
    case: &FusedCase,
) -> Result<(), String> {
    let down = |b: &DeviceBuffer<bf16>| b.to_host().map_err(|e| format!("dtoh: {e}"));
    let mut inputs = Vec::new();
    for ch in chains {
        inputs.push(down(&ch.x[l])?);
    }
    let data = CallData { inputs, residual: down(&chains[0].residual[l])?, weight: weights[l].clone() };
    let expected = data.expected(case);
    let roundings = residual_roundings(comms, case, tp_allreduce::DType::Bf16);
    let mut first = None;
    for (r, ch) in chains.iter().enumerate() {
        if common::bits(&down(&ch.residual[l])?) != common::bits(&data.residual) {
            return Err(format!("layer {l}: rank {r} started from another residual"));
        }
        let res = down(&ch.residual[l + 1])?;
        let y = down(&ch.y[l])?;
        let f = |v: &[bf16]| v.iter().map(|x| x.to_f64()).collect::<Vec<f64>>();
        tp_allreduce_cli::fused_reference::check(
            tp_allreduce::DType::Bf16,
            &expected,
            &f(&res),
            Some(&f(&y)),
            HIDDEN,
            roundings,
            comms.len(),
        )
        .map_err(|e| format!("layer {l} rank {r}: {e}"))?;
        let mine = (common::bits(&res), common::bits(&y));
        match &first {
            None => first = Some(mine),
            Some(f) if *f != mine => return Err(format!("layer {l}: rank {r} differs bitwise from rank 0")),
            Some(_) => {}
        }
    }
    Ok(())
}

fn replay(test: &str, contexts: &[Arc<CudaContext>], world: usize, algorithm: Option<Algorithm>, opts: FusedOptions) {
    replay_with(test, contexts, world, test_config(), algorithm, opts);
}

fn replay_with(
    test: &str,
    contexts: &[Arc<CudaContext>],
    world: usize,
    config: Config,
    algorithm: Option<Algorithm>,
    opts: FusedOptions,
) {
    let mut rng: StdRng = common::rng(test);
    let comms = group(contexts, world, config, algorithm);
    let lo = if opts.weight_offset { -0.5 } else { 0.5 };
    let weights: Vec<Vec<bf16>> = (0..LAYERS).map(|_| uniform(&mut rng, HIDDEN, lo, lo + 1.0)).collect();
    let mut chains: Vec<Chain> = comms.iter().map(|c| chain(c, &weights)).collect();
    let graphs = capture(&comms, &mut chains, &opts);
    let registered = Comm::register_graph_buffers_group(&comms).expect("register");
    let plan = comms[0].plan_fused(ROWS, HIDDEN, tp_allreduce::DType::Bf16, true);
    eprintln!(
        "{test}: {algorithm:?}: {} fused={} ({}), {registered} inputs registered",
        plan.algorithm, plan.fused, plan.reason
    );
    if plan.algorithm.reads_peer_inputs() {
        assert_eq!(registered, LAYERS, "every captured pull call must have been registered");
    }
    let case = FusedCase { opts, ..FusedCase::new(ROWS, HIDDEN) };
    for rep in 0..REPLAYS {
        let residual0: Vec<bf16> = uniform(&mut rng, ROWS * HIDDEN, -1.0, 1.0);
        for ch in chains.iter_mut() {
            let x0: Vec<bf16> = uniform(&mut rng, ROWS * HIDDEN, -1.0, 1.0);
            ch.x[0].copy_from_host(&x0).expect("htod");
            ch.residual[0].copy_from_host(&residual0).expect("htod");
        }
        for g in &graphs {
            g.launch().expect("graph launch");
        }
        for c in &comms {
            c.synchronize().unwrap_or_else(|e| panic!("{test}: replay {rep}: {e}"));
        }
        let layers: Vec<usize> = if rep % 100 == 0 { (0..LAYERS).collect() } else { vec![LAYERS - 1] };
        for l in layers {
            check_layer(&comms, &chains, &weights, l, &case).unwrap_or_else(|e| panic!("{test}: replay {rep}: {e}"));
        }
    }
    eprintln!("{test}: {algorithm:?}: {REPLAYS} replays x {LAYERS} fused layers x {world} ranks correct");
}

#[test]
fn fused_graph_replays_one_gpu() {
    let test = "fused_graph_replays_one_gpu";
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu(test) else { return };
    let gemma = FusedOptions { weight_offset: true, ..FusedOptions::default() };
    // Four ranks on one GPU: rows over thread-block clusters on sm_90+.
    let comms = group(std::slice::from_ref(&ctx), 4, test_config(), Some(Algorithm::OneShotPush));
    let plan = comms[0].plan_fused(ROWS, HIDDEN, tp_allreduce::DType::Bf16, true);
    let clusters = ctx.compute_capability().expect("compute capability").0 >= 9;
    assert_eq!(plan.reason.contains("thread-block cluster"), clusters, "{test}: {}", plan.reason);
    drop(comms);
    replay(test, std::slice::from_ref(&ctx), 4, Some(Algorithm::OneShotPush), FusedOptions::default());
    replay(test, std::slice::from_ref(&ctx), 4, Some(Algorithm::OneShotPull), gemma);
    replay(test, std::slice::from_ref(&ctx), 4, None, FusedOptions::default());
    replay(test, &[ctx], 3, Some(Algorithm::TwoShotPush), gemma);
}

/// The fused island pushes in graphs: two-shot push over 2, 5 and 8 ranks,
/// hierarchical over 2+2, 3+2 and 4+4; the path must be fused.
#[test]
fn fused_island_graph_replays() {
    let test = "fused_island_graph_replays";
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu(test) else { return };
    let gemma = FusedOptions { weight_offset: true, ..FusedOptions::default() };
    let mut runs: Vec<(usize, Config, Algorithm)> =
        [2, 5, 8].into_iter().map(|w| (w, test_config(), Algorithm::TwoShotPush)).collect();
    // 2+2, 3+2, 4+4 (not 3+3 nor 2+2+2+2: the eager matrix has them).
    let skipped = |w: usize, c: &Config| w == 6 || (w == 8 && c.island_size == Some(2));
    for (world, config) in island_groups().into_iter().filter(|(w, c)| !skipped(*w, c)) {
        runs.push((world, config, Algorithm::Hierarchical));
    }
    for (k, (world, config, algorithm)) in runs.into_iter().enumerate() {
        let comms = group(std::slice::from_ref(&ctx), world, config.clone(), Some(algorithm));
        let plan = comms[0].plan_fused(ROWS, HIDDEN, tp_allreduce::DType::Bf16, true);
        assert!(plan.fused, "{test}: {algorithm} over {world} ranks is not fused: {}", plan.reason);
        drop(comms);
        let opts = if k % 2 == 1 { gemma } else { FusedOptions::default() };
        replay_with(test, std::slice::from_ref(&ctx), world, config, Some(algorithm), opts);
    }
}

#[test]
fn fused_graph_replays_two_gpus() {
    let test = "fused_graph_replays_two_gpus";
    let _lock = common::gpu_lock();
    let Some(ctx0) = common::gpu(test) else { return };
    let Some(ctx1) = crate::common::second_gpu(test) else { return };
    for algorithm in [Some(Algorithm::OneShotPush), Some(Algorithm::OneShotPull), None] {
        replay(test, &[ctx0.clone(), ctx1.clone()], 2, algorithm, FusedOptions::default());
    }
}
