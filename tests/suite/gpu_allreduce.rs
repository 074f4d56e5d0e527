//! Correctness of every algorithm on one GPU with several in-process ranks
//! sharing it: dtype x world size x sizes from 1 element to 8 MiB (odd
//! counts, sizes not multiple of 16 bytes, misaligned views, in place), fresh
//! random inputs, poisoned outputs, f64 CPU reference, ranks bitwise equal.

use std::time::Duration;

use tp_allreduce::{Algorithm, Comm, Config, DType, Transport, TransportPreference};

use crate::common::{self, Case, TestElem};

fn test_config(island_size: Option<usize>) -> Config {
    Config { timeout: Duration::from_secs(3), launch_timeout: Duration::from_secs(3), island_size, ..Config::default() }
}

fn group(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    world: usize,
    config: Config,
    algorithm: Algorithm,
) -> Vec<Comm> {
    let mut comms = Comm::from_streams(common::streams(ctx, world), config).expect("group init");
    for c in comms.iter_mut() {
        c.set_algorithm(Some(algorithm)).expect("algorithm available");
    }
    comms
}

fn run_typed(comms: &[Comm], rng: &mut rand::rngs::StdRng, dtype: DType, case: Case) -> Result<(), String> {
    match dtype {
        DType::F32 => common::run_case::<f32>(comms, rng, case),
        DType::F16 => common::run_case::<half::f16>(comms, rng, case),
        DType::Bf16 => common::run_case::<half::bf16>(comms, rng, case),
    }
}

/// Runs the matrix for one algorithm; returns (cases, failures).
fn matrix(
    test: &str,
    algorithm: Algorithm,
    worlds: &[(usize, Option<usize>)],
    max_bytes: usize,
    config: impl Fn(Option<usize>) -> Config,
) {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu(test) else { return };
    let mut rng = common::rng(test);
    let mut failures = Vec::new();
    let mut cases = 0usize;
    for &(world, islands) in worlds {
        let comms = group(&ctx, world, config(islands), algorithm);
        for dtype in DType::ALL {
            for count in common::sizes_for(dtype, max_bytes) {
                let small = count * dtype.size_bytes() <= 70_000;
                let mut variants = vec![Case { algorithm, count, offset: 0, in_place: false }];
                if small {
                    variants.push(Case { algorithm, count, offset: 1, in_place: false });
                    variants.push(Case { algorithm, count, offset: 0, in_place: true });
                }
                for case in variants {
                    cases += 1;
                    if let Err(e) = run_typed(&comms, &mut rng, dtype, case) {
                        failures.push(format!(
                            "world={world} islands={islands:?} {} count={} offset={} in_place={}: {e}",
                            dtype.name(),
                            case.count,
                            case.offset,
                            case.in_place
                        ));
                        if failures.len() > 40 {
                            break;
                        }
                    }
                }
            }
        }
    }
    eprintln!("{test}: {cases} cases, {} failures", failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

const FLAT_WORLDS: &[(usize, Option<usize>)] = &[(2, None), (3, None), (4, None), (5, None), (6, None), (8, None)];
const MIB8: usize = 8 << 20;

#[test]
fn one_shot_pull_matrix() {
    matrix("one_shot_pull_matrix", Algorithm::OneShotPull, FLAT_WORLDS, MIB8, test_config);
}

#[test]
fn two_shot_pull_matrix() {
    matrix("two_shot_pull_matrix", Algorithm::TwoShotPull, FLAT_WORLDS, MIB8, test_config);
}

#[test]
fn one_shot_push_matrix() {
    // OneShotPush handles up to one_shot_push_max_bytes per launch; larger
    // messages are split into several launches by the host.
    matrix("one_shot_push_matrix", Algorithm::OneShotPush, FLAT_WORLDS, MIB8, test_config);
}

#[test]
fn two_shot_push_matrix() {
    matrix("two_shot_push_matrix", Algorithm::TwoShotPush, EVERY_WORLD, MIB8, test_config);
}

/// Every world size 2..=8 (the island push with one island of every rank).
const EVERY_WORLD: &[(usize, Option<usize>)] =
    &[(2, None), (3, None), (4, None), (5, None), (6, None), (7, None), (8, None)];

#[test]
fn copy_engine_ring_matrix() {
    let test = "copy_engine_ring_matrix";
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu(test) else { return };
    // Refused where ranks share a GPU: there the copies run on the SMs the
    // waiting step kernels occupy (6 ranks on one H200 timed out).
    let mut shared = Comm::from_streams(common::streams(&ctx, 2), test_config(None)).unwrap();
    let refused = shared[0].set_algorithm(Some(Algorithm::CopyEngineRing)).expect_err("refused on a shared GPU");
    assert!(refused.to_string().contains("one rank per GPU"), "{refused}");
    drop(shared);
    // One rank per GPU: every dtype, 1 element .. 8 MiB, misaligned, in place.
    let Some(second) = crate::common::second_gpu(test) else { return };
    let mut rng = common::rng(test);
    let streams = vec![ctx.new_stream().unwrap(), second.new_stream().unwrap()];
    let mut comms = Comm::from_streams(streams, test_config(None)).unwrap();
    for c in comms.iter_mut() {
        c.set_algorithm(Some(Algorithm::CopyEngineRing)).unwrap();
    }
    let mut failures = Vec::new();
    let mut cases = 0;
    for dtype in DType::ALL {
        for count in common::sizes_for(dtype, MIB8) {
            for (offset, in_place) in [(0, false), (1, false), (0, true)] {
                let case = Case { algorithm: Algorithm::CopyEngineRing, count, offset, in_place };
                cases += 1;
                let r = match dtype {
                    DType::F32 => common::run_case::<f32>(&comms, &mut rng, case),
                    DType::F16 => common::run_case::<half::f16>(&comms, &mut rng, case),
                    DType::Bf16 => common::run_case::<half::bf16>(&comms, &mut rng, case),
                };
                if let Err(e) = r {
                    failures.push(format!("{} count={count} offset={offset} in_place={in_place}: {e}", dtype.name()));
                }
            }
        }
    }
    eprintln!("{test}: {cases} cases over 2 GPUs, {} failures", failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn ring_matrix() {
    matrix("ring_matrix", Algorithm::Ring, FLAT_WORLDS, MIB8, test_config);
}

#[test]
fn hierarchical_matrix() {
    // Islands need a world that splits into >= 2 islands of >= 2 ranks:
    // 2+2, 3+3, 2+2+2, 4+4, 2+2+2+2.
    let worlds = &[(4, Some(2)), (6, Some(3)), (6, Some(2)), (8, Some(4)), (8, Some(2))];
    matrix("hierarchical_matrix", Algorithm::Hierarchical, worlds, MIB8, test_config);
}

/// Small per-launch capacity: every algorithm splits messages into many
/// launches (chunk boundaries, pull staging reuse).
#[test]
fn chunked_launches_all_algorithms() {
    let small = |islands| Config {
        max_chunk_bytes: 64 << 10,
        one_shot_push_max_bytes: 16 << 10,
        ring_chunk_bytes: 4 << 10,
        ring_slots: 2,
        ..test_config(islands)
    };
    for algorithm in [
        Algorithm::OneShotPull,
        Algorithm::TwoShotPull,
        Algorithm::OneShotPush,
        Algorithm::TwoShotPush,
        Algorithm::Ring,
    ] {
        matrix("chunked_launches_all_algorithms", algorithm, &[(3, None)], 1 << 20, small);
    }
    for algorithm in [Algorithm::Hierarchical, Algorithm::PipelinedHierarchical] {
        matrix("chunked_launches_all_algorithms", algorithm, &[(4, Some(2))], 1 << 20, small);
    }
}

/// The push algorithms over pinned host memory (the path for GPUs without
/// P2P), forced on one GPU: real traffic through host memory over PCIe.
#[test]
fn host_staged_transport_push_algorithms() {
    let staged =
        |islands| Config { transport: TransportPreference::Force(Transport::HostStaged), ..test_config(islands) };
    for algorithm in [Algorithm::OneShotPush, Algorithm::TwoShotPush, Algorithm::Ring] {
        matrix("host_staged_transport_push_algorithms", algorithm, &[(2, None), (3, None), (8, None)], 1 << 20, staged);
    }
    for algorithm in [Algorithm::Hierarchical, Algorithm::PipelinedHierarchical] {
        matrix("host_staged_transport_push_algorithms", algorithm, &[(4, Some(2))], 1 << 20, staged);
    }
}

/// Pull algorithms reading registered buffers in place (no staging copy).
#[test]
fn pull_registered_buffers() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("pull_registered_buffers") else { return };
    let mut rng = common::rng("pull_registered_buffers");
    let world = 4;
    let n = 100_003usize;
    for algorithm in [Algorithm::OneShotPull, Algorithm::TwoShotPull] {
        let comms = group(&ctx, world, test_config(None), algorithm);
        let inputs: Vec<Vec<f32>> = (0..world).map(|_| common::random_vec::<f32>(&mut rng, n)).collect();
        let bufs: Vec<_> =
            (0..world).map(|_| tp_allreduce::driver::DeviceMemory::alloc(&ctx, n * 4).unwrap()).collect();
        let outs: Vec<_> =
            (0..world).map(|_| tp_allreduce::driver::DeviceMemory::alloc(&ctx, n * 4).unwrap()).collect();
        let regs: Vec<(u64, usize)> = bufs.iter().map(|b| (b.ptr(), n * 4)).collect();
        Comm::register_buffer_group(&comms, &regs).expect("register");
        for r in 0..world {
            tp_allreduce::driver::memcpy_htod(bufs[r].ptr(), bytemuck::cast_slice(&inputs[r])).unwrap();
            tp_allreduce::driver::memset_d8(outs[r].ptr(), common::POISON, n * 4).unwrap();
        }
        for (r, c) in comms.iter().enumerate() {
            // SAFETY: registered buffers of n f32 on this context.
            unsafe { c.all_reduce_raw(bufs[r].ptr(), outs[r].ptr(), n, DType::F32, c.stream().cu_stream()) }.unwrap();
        }
        let mut first: Option<Vec<u32>> = None;
        for (r, c) in comms.iter().enumerate() {
            c.synchronize().unwrap();
            let mut host = vec![0f32; n];
            tp_allreduce::driver::memcpy_dtoh(bytemuck::cast_slice_mut(&mut host), outs[r].ptr()).unwrap();
            common::check_sum(&inputs, &host, 1).unwrap_or_else(|e| panic!("{algorithm} rank {r}: {e}"));
            let b = common::bits(&host);
            match &first {
                None => first = Some(b),
                Some(f) => assert_eq!(f, &b, "{algorithm}: rank {r} differs bitwise"),
            }
        }
        // A call with more elements than registered is refused, not silently staged.
        // SAFETY: the error is raised before any device access.
        let over = unsafe {
            comms[0].all_reduce_raw(bufs[0].ptr(), outs[0].ptr(), n + 64, DType::F32, comms[0].stream().cu_stream())
        };
        assert!(matches!(over, Err(tp_allreduce::Error::InvalidUsage(_))), "{over:?}");
    }
}

/// OneShotPush carries completion in the payload (all-ones = empty): inputs
/// equal to that pattern, NaN, +/-Inf, -0.0, zeros and denormals must sum
/// exactly as IEEE says.
#[test]
fn one_shot_push_sentinel_edge_cases() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("one_shot_push_sentinel_edge_cases") else { return };
    let world = 3;
    let comms = group(&ctx, world, test_config(None), Algorithm::OneShotPush);
    let special_f32: Vec<f32> = vec![
        0.0,
        -0.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::from_bits(0xFFFF_FFFF), // the empty-word pattern itself
        f32::from_bits(0x7FFF_FFFF),
        f32::from_bits(1),           // smallest denormal
        f32::from_bits(0x8000_0001), // negative denormal
        1.0e-40,
        3.0e38,
        1.0,
    ];
    let k = special_f32.len();
    // Every combination of three specials (k^3 elements).
    let n = k * k * k;
    let mut inputs = vec![vec![0f32; n]; world];
    for i in 0..n {
        inputs[0][i] = special_f32[i % k];
        inputs[1][i] = special_f32[(i / k) % k];
        inputs[2][i] = special_f32[i / (k * k)];
    }
    let check = |out: &[f32], what: &str| {
        for i in 0..n {
            // The contract is IEEE f32 accumulation in rank order (so e.g.
            // 3e38 + 3e38 + -inf is NaN, as in any f32 sum), bit for bit.
            let want = (inputs[0][i] + inputs[1][i]) + inputs[2][i];
            let got = out[i];
            let ok = if want.is_nan() { got.is_nan() } else { got.to_bits() == want.to_bits() };
            assert!(
                ok,
                "{what}[{i}]: {:e} + {:e} + {:e}: got {got:e} ({:#x}) want {want:e} ({:#x})",
                inputs[0][i],
                inputs[1][i],
                inputs[2][i],
                got.to_bits(),
                want.to_bits()
            );
        }
    };
    // Repeat so that both receive halves see the specials several times.
    for rep in 0..7 {
        let mut outs = Vec::new();
        let mut ins = Vec::new();
        for (r, c) in comms.iter().enumerate() {
            let s = c.stream();
            ins.push(s.clone_htod(&inputs[r]).unwrap());
            outs.push(s.alloc_zeros::<f32>(n).unwrap());
        }
        for (r, c) in comms.iter().enumerate() {
            c.all_reduce(&ins[r], &mut outs[r], &tp_allreduce::ReduceOp::Sum).unwrap();
        }
        for (r, c) in comms.iter().enumerate() {
            c.synchronize().unwrap();
            let host = c.stream().clone_dtoh(&outs[r]).unwrap();
            check(&host, &format!("rep {rep} rank {r}"));
        }
    }
    // Half types: the all-ones half pattern, NaN, Inf, -0.
    for bits in [0xFFFFu16, 0x7C00, 0xFC00, 0x8000, 0x0000, 0x0001, 0x7E00] {
        let v = half::f16::from_bits(bits);
        let ins: Vec<_> = comms.iter().map(|c| c.stream().clone_htod(&vec![v; 17]).unwrap()).collect();
        let mut outs: Vec<_> = comms.iter().map(|c| c.stream().alloc_zeros::<half::f16>(17).unwrap()).collect();
        for (r, c) in comms.iter().enumerate() {
            c.all_reduce(&ins[r], &mut outs[r], &tp_allreduce::ReduceOp::Sum).unwrap();
        }
        for (r, c) in comms.iter().enumerate() {
            c.synchronize().unwrap();
            let host = c.stream().clone_dtoh(&outs[r]).unwrap();
            let want = half::f16::from_f64(v.to_f64() * 3.0);
            for x in host {
                let ok = if want.is_nan() { x.is_nan() } else { x.to_bits() == want.to_bits() };
                assert!(ok, "f16 {bits:#06x} x3 on rank {r}: got {:#06x} want {:#06x}", x.to_bits(), want.to_bits());
            }
        }
    }
    let _ = TestElem::to_f64(1.0f32);
}

/// Thousands of back-to-back calls alternating sizes, dtypes and algorithms
/// (epoch and generation rotation), every result checked.
#[test]
fn back_to_back_alternating_algorithms() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("back_to_back_alternating_algorithms") else { return };
    let mut rng = common::rng("back_to_back_alternating_algorithms");
    let world = 4;
    let mut comms = Comm::from_streams(common::streams(&ctx, world), test_config(Some(2))).unwrap();
    let algorithms = [
        Algorithm::OneShotPush,
        Algorithm::TwoShotPush,
        Algorithm::OneShotPull,
        Algorithm::TwoShotPull,
        Algorithm::Ring,
        Algorithm::Hierarchical,
        Algorithm::PipelinedHierarchical,
    ];
    let sizes = [1usize, 9, 257, 4_099, 21_504, 65_536, 300_001];
    let mut calls = 0;
    for i in 0..2_000usize {
        let algorithm = algorithms[i % algorithms.len()];
        for c in comms.iter_mut() {
            c.set_algorithm(Some(algorithm)).unwrap();
        }
        let count = sizes[(i / algorithms.len()) % sizes.len()];
        let dtype = DType::ALL[i % 3];
        run_typed(&comms, &mut rng, dtype, Case { algorithm, count, offset: 0, in_place: i % 5 == 0 })
            .unwrap_or_else(|e| panic!("call {i} ({algorithm}, {} x {count}): {e}", dtype.name()));
        calls += 1;
    }
    eprintln!("back_to_back_alternating_algorithms: {calls} checked calls");
}

/// OneShotPush is grid-stride over packs: any launch shape gives the same
/// result, and ranks may even use different shapes in the same call.
#[test]
fn one_shot_push_any_launch_shape() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("one_shot_push_any_launch_shape") else { return };
    let mut rng = common::rng("one_shot_push_any_launch_shape");
    let shapes: &[(u32, u32)] = &[(1, 32), (1, 1024), (3, 96), (7, 256), (16, 512), (40, 1024), (2, 64)];
    let mut failures = Vec::new();
    let mut cases = 0;
    for world in [2usize, 3, 8] {
        let mut comms = group(&ctx, world, test_config(None), Algorithm::OneShotPush);
        for (i, &shape) in shapes.iter().enumerate() {
            for (r, c) in comms.iter_mut().enumerate() {
                // Rank r uses a different shape than rank 0 (grid independence).
                let mine = shapes[(i + r) % shapes.len()];
                let cap = c.max_sentinel_blocks(mine.1);
                c.set_launch_shape(Some((mine.0.min(cap), mine.1))).unwrap();
            }
            for count in [1usize, 7, 8, 1000, 4096, 21_504, 100_003] {
                for dtype in DType::ALL {
                    cases += 1;
                    let case = Case { algorithm: Algorithm::OneShotPush, count, offset: count % 2, in_place: false };
                    if let Err(e) = run_typed(&comms, &mut rng, dtype, case) {
                        failures.push(format!("world {world} shape {shape:?} {} count {count}: {e}", dtype.name()));
                    }
                }
            }
        }
    }
    eprintln!("one_shot_push_any_launch_shape: {cases} cases, {} failures", failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
