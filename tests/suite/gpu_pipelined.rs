//! PipelinedHierarchical on one GPU (in-process ranks sharing it): the
//! correctness matrix over the island shapes Hierarchical runs on, and the
//! same result bits as Hierarchical for the same inputs whatever launch
//! shape each rank uses (fewer than three blocks run every phase in every
//! block; three or more split into the send, sum and gather groups).

use std::time::Duration;

use tp_allreduce::{Algorithm, Comm, Config, DType};

use crate::common::{self, Case, TestElem};

fn config(island_size: usize) -> Config {
    Config {
        timeout: Duration::from_secs(3),
        launch_timeout: Duration::from_secs(3),
        island_size: Some(island_size),
        ..Config::default()
    }
}

fn set(comms: &mut [Comm], algorithm: Algorithm) {
    for c in comms.iter_mut() {
        c.set_algorithm(Some(algorithm)).expect("algorithm available");
    }
}

/// Every dtype, 1 element .. 8 MiB, misaligned and in place (small sizes),
/// on 2+2, 3+3, 2+2+2, 4+4 and 2+2+2+2.
#[test]
fn pipelined_hierarchical_matrix() {
    let test = "pipelined_hierarchical_matrix";
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu(test) else { return };
    let mut rng = common::rng(test);
    let mut failures = Vec::new();
    let mut cases = 0usize;
    for (world, island) in [(4, 2), (6, 3), (6, 2), (8, 4), (8, 2)] {
        let mut comms = Comm::from_streams(common::streams(&ctx, world), config(island)).expect("group init");
        set(&mut comms, Algorithm::PipelinedHierarchical);
        for dtype in DType::ALL {
            for count in common::sizes_for(dtype, 8 << 20) {
                let algorithm = Algorithm::PipelinedHierarchical;
                let mut variants = vec![Case { algorithm, count, offset: 0, in_place: false }];
                if count * dtype.size_bytes() <= 70_000 {
                    variants.push(Case { algorithm, count, offset: 1, in_place: false });
                    variants.push(Case { algorithm, count, offset: 0, in_place: true });
                }
                for case in variants {
                    cases += 1;
                    if let Err(e) = run_typed(&comms, &mut rng, dtype, case) {
                        failures.push(format!("world {world} islands of {island} {} {case:?}: {e}", dtype.name()));
                    }
                }
            }
        }
    }
    eprintln!("{test}: {cases} cases, {} failures", failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn run_typed(comms: &[Comm], rng: &mut rand::rngs::StdRng, dtype: DType, case: Case) -> Result<(), String> {
    match dtype {
        DType::F32 => common::run_case::<f32>(comms, rng, case),
        DType::F16 => common::run_case::<half::f16>(comms, rng, case),
        DType::Bf16 => common::run_case::<half::bf16>(comms, rng, case),
    }
}

/// One allreduce of `inputs` (one vector per rank) with the communicators'
/// current settings; every rank's output, read back after a poisoned fill.
fn outputs<T: TestElem>(comms: &[Comm], inputs: &[Vec<T>]) -> Result<Vec<Vec<T>>, String> {
    let n = inputs[0].len();
    let mut ins = Vec::new();
    let mut outs = Vec::new();
    for (c, input) in comms.iter().zip(inputs) {
        let s = c.stream();
        ins.push(s.clone_htod(input).map_err(|e| format!("htod: {e:?}"))?);
        // SAFETY: poisoned right below, before any read.
        let out = unsafe { s.alloc::<T>(n) }.map_err(|e| format!("alloc: {e:?}"))?;
        // SAFETY: a live stream; the buffer holds n elements.
        unsafe {
            tp_allreduce::driver::memset_d8_async(
                common::ptr_of(&s, &out, 0),
                common::POISON,
                n * std::mem::size_of::<T>(),
                s.cu_stream(),
            )
        }
        .map_err(|e| e.to_string())?;
        outs.push(out);
    }
    for (r, c) in comms.iter().enumerate() {
        let s = c.stream();
        let (src, dst) = (common::ptr_of(&s, &ins[r], 0), common::ptr_of(&s, &outs[r], 0));
        // SAFETY: both buffers hold n elements and live until the reads below.
        unsafe { c.all_reduce_raw(src, dst, n, T::DTYPE, s.cu_stream()) }.map_err(|e| format!("rank {r}: {e}"))?;
    }
    let mut results = Vec::new();
    for (r, c) in comms.iter().enumerate() {
        c.synchronize().map_err(|e| format!("rank {r}: {e}"))?;
        results.push(c.stream().clone_dtoh(&outs[r]).map_err(|e| format!("dtoh: {e:?}"))?);
    }
    Ok(results)
}

/// Hierarchical (default shapes) and PipelinedHierarchical (a different
/// shape on every rank: 1, 2, 3 and more blocks) on the same inputs: the
/// same bits on every rank, and within Hierarchical's roundings of the f64
/// sum; the two alternate on one communicator (they share the receive
/// region and its generation).
fn same_bits<T: TestElem>(
    comms: &mut [Comm],
    rng: &mut rand::rngs::StdRng,
    count: usize,
    shift: usize,
) -> Result<(), String> {
    const SHAPES: [(u32, u32); 8] = [(1, 32), (2, 64), (3, 96), (4, 128), (5, 256), (7, 256), (16, 512), (40, 1024)];
    let inputs: Vec<Vec<T>> = (0..comms.len()).map(|_| common::random_vec::<T>(rng, count)).collect();
    set(comms, Algorithm::Hierarchical);
    for c in comms.iter_mut() {
        c.set_launch_shape(None).map_err(|e| e.to_string())?;
    }
    let reference = outputs(comms, &inputs)?;
    set(comms, Algorithm::PipelinedHierarchical);
    for (r, c) in comms.iter_mut().enumerate() {
        let (blocks, threads) = SHAPES[(shift + r) % SHAPES.len()];
        let cap = c.max_sentinel_blocks(threads);
        c.set_launch_shape(Some((blocks.min(cap), threads))).map_err(|e| e.to_string())?;
    }
    let got = outputs(comms, &inputs)?;
    let roundings = Algorithm::PipelinedHierarchical.max_roundings(comms.len());
    for (r, out) in got.iter().enumerate() {
        common::check_sum(&inputs, out, roundings).map_err(|e| format!("rank {r}: {e}"))?;
        if common::bits(out) != common::bits(&reference[r]) {
            let differ = out.iter().zip(&reference[r]).filter(|(a, b)| a.to_bits32() != b.to_bits32()).count();
            return Err(format!("rank {r}: {differ} of {count} elements differ from Hierarchical's bits"));
        }
    }
    Ok(())
}

#[test]
fn pipelined_hierarchical_any_launch_shape_matches_hierarchical_bits() {
    let test = "pipelined_hierarchical_any_launch_shape_matches_hierarchical_bits";
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu(test) else { return };
    let mut rng = common::rng(test);
    let mut failures = Vec::new();
    let mut cases = 0usize;
    for (world, island) in [(4, 2), (6, 3), (8, 4)] {
        let mut comms = Comm::from_streams(common::streams(&ctx, world), config(island)).expect("group init");
        for (shift, count) in [1usize, 7, 1000, 21_504, 100_003, (1 << 20) + 3].into_iter().enumerate() {
            for dtype in DType::ALL {
                cases += 1;
                let r = match dtype {
                    DType::F32 => same_bits::<f32>(&mut comms, &mut rng, count, shift),
                    DType::F16 => same_bits::<half::f16>(&mut comms, &mut rng, count, shift),
                    DType::Bf16 => same_bits::<half::bf16>(&mut comms, &mut rng, count, shift),
                };
                if let Err(e) = r {
                    failures.push(format!("world {world} islands of {island} {} count {count}: {e}", dtype.name()));
                }
            }
        }
    }
    eprintln!("{test}: {cases} cases, {} failures", failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
