//! The fused calls beyond the kernels' matrices (`gpu_fused.rs`): the
//! unfused path of every other algorithm, edge cases of the shape, one rank
//! (the separate kernel alone), two ranks on two GPUs, and bad arguments
//! refused before any device work.

use tp_allreduce::{Algorithm, Config, DType, FusedOptions};

use crate::common;
use crate::gpu_fused::*;

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
