//! All-gather and reduce-scatter (`Comm::all_gather`, `Comm::reduce_scatter`
//! and their raw forms) on groups of 1-8 ranks sharing GPU 0: fresh random
//! inputs, poisoned outputs, every dtype, counts from 1 element to several
//! launches, odd counts, misaligned views, in place; all-gather checked bit
//! for bit against the concatenation, reduce-scatter against the f64 sum
//! (one rounding) and bit for bit against block `rank` of the one-shot
//! push allreduce of the same inputs (the same rank-order f32 sum); graphs
//! replayed with fresh inputs; bad arguments refused.

use std::time::Duration;

use cudarc::driver::{sys, CudaSlice};
use rand::rngs::StdRng;
use tp_allreduce::{Algorithm, Collective, Comm, Config, DType, Error};

use crate::common::{self, bits, check_sum, poison_bits, random_vec, TestElem, POISON};

fn config() -> Config {
    Config { timeout: Duration::from_secs(3), launch_timeout: Duration::from_secs(3), ..Config::default() }
}

fn group(ctx: &std::sync::Arc<cudarc::driver::CudaContext>, world: usize) -> Vec<Comm> {
    Comm::from_streams(common::streams(ctx, world), config()).expect("group init")
}

/// How one case runs.
#[derive(Clone, Copy, Debug)]
struct Case {
    collective: Collective,
    /// Elements of a rank's block.
    count: usize,
    /// Element offset of every view (0: 16-byte aligned).
    offset: usize,
    in_place: bool,
}

/// `n + offset` elements, the first `offset` poisoned, then `values`
/// (poisoned too where `values` is `None`).
fn upload<T: TestElem>(comm: &Comm, offset: usize, n: usize, values: Option<&[T]>) -> CudaSlice<T> {
    let s = comm.stream();
    // SAFETY: every byte written right below.
    let buf = unsafe { s.alloc::<T>(n + offset) }.expect("alloc");
    let base = common::ptr_of(&s, &buf, 0);
    // SAFETY: a live stream; the buffer holds n + offset elements.
    unsafe { tp_allreduce::driver::memset_d8_async(base, POISON, (n + offset) * size_of::<T>(), s.cu_stream()) }
        .expect("poison");
    if let Some(v) = values {
        let dst = common::ptr_of(&s, &buf, offset);
        // SAFETY: `v` fits after the offset; synchronised before it is dropped.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, v.as_ptr() as *const _, std::mem::size_of_val(v), s.cu_stream()) }
            .result()
            .expect("htod");
        s.synchronize().expect("sync");
    }
    buf
}

/// Every rank's whole output view and every rank's input, in rank order.
type OutputsAndInputs<T> = (Vec<Vec<T>>, Vec<Vec<T>>);

/// Runs `case` on every rank; returns every rank's whole output view (the
/// poisoned prefix checked) and the inputs.
fn run<T: TestElem>(comms: &[Comm], rng: &mut StdRng, case: Case) -> Result<OutputsAndInputs<T>, String> {
    let world = comms.len();
    let n = case.count;
    let (send_len, recv_len) = match case.collective {
        Collective::AllGather => (n, world * n),
        _ => (world * n, n),
    };
    let inputs: Vec<Vec<T>> = (0..world).map(|_| random_vec::<T>(rng, send_len)).collect();
    let mut bufs = Vec::new();
    for (r, c) in comms.iter().enumerate() {
        if case.in_place {
            // The large buffer holds the input (reduce-scatter) or only
            // block `rank` of it does (all-gather); the rest is poisoned.
            let large = match case.collective {
                Collective::AllGather => {
                    let mut host = vec![T::from_f64(f64::NAN); recv_len];
                    host[r * n..(r + 1) * n].copy_from_slice(&inputs[r]);
                    upload(c, case.offset, recv_len, Some(&host))
                }
                _ => upload(c, case.offset, send_len, Some(&inputs[r])),
            };
            bufs.push((large, None));
        } else {
            let send = upload(c, case.offset, send_len, Some(&inputs[r]));
            let recv = upload::<T>(c, case.offset, recv_len, None);
            bufs.push((send, Some(recv)));
        }
    }
    for (r, c) in comms.iter().enumerate() {
        let s = c.stream();
        let (a, b) = &bufs[r];
        let (send, recv) = match (b, case.collective) {
            (Some(recv), _) => (common::ptr_of(&s, a, case.offset), common::ptr_of(&s, recv, case.offset)),
            (None, Collective::AllGather) => {
                let large = common::ptr_of(&s, a, case.offset);
                (large + (r * n * size_of::<T>()) as u64, large)
            }
            (None, _) => {
                let large = common::ptr_of(&s, a, case.offset);
                (large, large + (r * n * size_of::<T>()) as u64)
            }
        };
        // SAFETY: every view lies inside a live buffer of its length.
        let result = unsafe {
            match case.collective {
                Collective::AllGather => c.all_gather_raw(send, recv, n, T::DTYPE, s.cu_stream()),
                _ => c.reduce_scatter_raw(send, recv, n, T::DTYPE, s.cu_stream()),
            }
        };
        result.map_err(|e| format!("rank {r}: {e}"))?;
    }
    let mut outs = Vec::new();
    for (r, c) in comms.iter().enumerate() {
        c.synchronize().map_err(|e| format!("rank {r}: {e}"))?;
        let (a, b) = &bufs[r];
        let buf = b.as_ref().unwrap_or(a);
        let host = c.stream().clone_dtoh(buf).map_err(|e| format!("dtoh: {e:?}"))?;
        if host[..case.offset].iter().any(|x| x.to_bits32() != poison_bits::<T>()) {
            return Err(format!("rank {r}: wrote before the output view"));
        }
        let view = host[case.offset..].to_vec();
        outs.push(match (case.in_place, case.collective) {
            (true, Collective::ReduceScatter) => view[r * n..(r + 1) * n].to_vec(),
            _ => view,
        });
    }
    Ok((inputs, outs))
}

/// Checks one case's outputs; with `reference` (the one-shot push
/// allreduce of the same inputs) reduce-scatter must match its block bit
/// for bit.
fn check<T: TestElem>(
    case: Case,
    inputs: &[Vec<T>],
    outs: &[Vec<T>],
    reference: Option<&[Vec<T>]>,
) -> Result<(), String> {
    let world = inputs.len();
    let n = case.count;
    match case.collective {
        Collective::AllGather => {
            let want: Vec<u32> = inputs.iter().flat_map(|v| bits(v)).collect();
            for (r, out) in outs.iter().enumerate() {
                if bits(out) != want {
                    let i = bits(out).iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                    return Err(format!(
                        "rank {r}: element {i} (block {}) differs from the concatenation",
                        i / n.max(1)
                    ));
                }
            }
        }
        _ => {
            for (r, out) in outs.iter().enumerate() {
                let block: Vec<Vec<T>> = inputs.iter().map(|v| v[r * n..(r + 1) * n].to_vec()).collect();
                check_sum(&block, out, 1).map_err(|e| format!("rank {r}: {e}"))?;
                if let Some(all) = reference {
                    if bits(out) != bits(&all[r][r * n..(r + 1) * n]) {
                        return Err(format!("rank {r}: differs bitwise from the one-shot allreduce's block"));
                    }
                }
            }
            let _ = world;
        }
    }
    Ok(())
}

/// The one-shot push allreduce of `inputs` (every rank's whole input).
fn one_shot_allreduce<T: TestElem>(comms: &mut [Comm], inputs: &[Vec<T>]) -> Vec<Vec<T>> {
    for c in comms.iter_mut() {
        c.set_algorithm(Some(Algorithm::OneShotPush)).expect("one-shot push available");
    }
    let bufs: Vec<CudaSlice<T>> = comms.iter().zip(inputs).map(|(c, v)| c.stream().clone_htod(v).unwrap()).collect();
    let mut outs: Vec<CudaSlice<T>> =
        comms.iter().zip(inputs).map(|(c, v)| c.stream().alloc_zeros(v.len()).unwrap()).collect();
    for ((c, i), o) in comms.iter().zip(&bufs).zip(outs.iter_mut()) {
        c.all_reduce(i, o, &tp_allreduce::ReduceOp::Sum).unwrap();
    }
    let res = comms
        .iter()
        .zip(&outs)
        .map(|(c, o)| {
            c.synchronize().unwrap();
            c.stream().clone_dtoh(o).unwrap()
        })
        .collect();
    for c in comms.iter_mut() {
        c.set_algorithm(None).unwrap();
    }
    res
}

fn run_typed<T: TestElem>(comms: &mut [Comm], rng: &mut StdRng, case: Case, failures: &mut Vec<String>) {
    let what = format!("{:?} {} x{} {case:?}", case.collective, T::DTYPE.name(), comms.len());
    match run::<T>(comms, rng, case) {
        Err(e) => failures.push(format!("{what}: {e}")),
        Ok((inputs, outs)) => {
            // The bitwise reference where the one-shot push takes the whole
            // message in one launch region (it chunks longer ones the same
            // way, but keep the check cheap).
            let reference = (case.collective == Collective::ReduceScatter && case.count * comms.len() <= 1 << 18)
                .then(|| one_shot_allreduce(comms, &inputs));
            if let Err(e) = check(case, &inputs, &outs, reference.as_deref()) {
                failures.push(format!("{what}: {e}"));
            }
        }
    }
}

/// Every world 2-8, dtype, collective; counts from 1 element to several
/// launches a rank; odd counts, a misaligned view, in place.
#[test]
fn all_gather_and_reduce_scatter_matrix() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("all_gather_and_reduce_scatter_matrix") else { return };
    let mut rng = common::rng("all_gather_and_reduce_scatter_matrix");
    let mut failures = Vec::new();
    let mut cases = 0;
    for world in 2..=8 {
        let mut comms = group(&ctx, world);
        for collective in [Collective::AllGather, Collective::ReduceScatter] {
            for (k, count) in [1usize, 7, 8, 1000, 4099, 21_504, 300_001].into_iter().enumerate() {
                // The longest count once per world (several launches).
                if count > 100_000 && world % 3 != 2 {
                    continue;
                }
                let case = Case { collective, count, offset: if k % 3 == 1 { 1 } else { 0 }, in_place: k % 2 == 1 };
                match k % 3 {
                    0 => run_typed::<f32>(&mut comms, &mut rng, case, &mut failures),
                    1 => run_typed::<half::f16>(&mut comms, &mut rng, case, &mut failures),
                    _ => run_typed::<half::bf16>(&mut comms, &mut rng, case, &mut failures),
                }
                cases += 1;
            }
        }
    }
    eprintln!("all_gather_and_reduce_scatter_matrix: {cases} cases");
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Every dtype at the verify-pass size on 4 ranks, both forms (typed API).
#[test]
fn every_dtype_through_the_typed_api() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("every_dtype_through_the_typed_api") else { return };
    let mut rng = common::rng("every_dtype_through_the_typed_api");
    let comms = group(&ctx, 4);
    fn typed<T: TestElem>(comms: &[Comm], rng: &mut StdRng) {
        let world = comms.len();
        let n = 5_377;
        let inputs: Vec<Vec<T>> = (0..world).map(|_| random_vec::<T>(rng, world * n)).collect();
        let sends: Vec<CudaSlice<T>> =
            comms.iter().zip(&inputs).map(|(c, v)| c.stream().clone_htod(v).unwrap()).collect();
        let poison = vec![T::from_f64(f64::NAN); world * n];
        let mut gathered: Vec<CudaSlice<T>> = comms.iter().map(|c| c.stream().clone_htod(&poison).unwrap()).collect();
        let mut scattered: Vec<CudaSlice<T>> =
            comms.iter().map(|c| c.stream().clone_htod(&poison[..n]).unwrap()).collect();
        for (r, c) in comms.iter().enumerate() {
            let block = sends[r].slice(0..n);
            c.all_gather(&block, &mut gathered[r]).unwrap();
            c.reduce_scatter(&sends[r], &mut scattered[r], &tp_allreduce::ReduceOp::Sum).unwrap();
        }
        let firsts: Vec<Vec<T>> = inputs.iter().map(|v| v[..n].to_vec()).collect();
        for (r, c) in comms.iter().enumerate() {
            c.synchronize().unwrap();
            let g = c.stream().clone_dtoh(&gathered[r]).unwrap();
            let want: Vec<u32> = firsts.iter().flat_map(|v| bits(v)).collect();
            assert_eq!(bits(&g), want, "{} rank {r}: all-gather", T::DTYPE.name());
            let s = c.stream().clone_dtoh(&scattered[r]).unwrap();
            let block: Vec<Vec<T>> = inputs.iter().map(|v| v[r * n..(r + 1) * n].to_vec()).collect();
            check_sum(&block, &s, 1).unwrap_or_else(|e| panic!("{} rank {r}: reduce-scatter: {e}", T::DTYPE.name()));
        }
    }
    typed::<f32>(&comms, &mut rng);
    typed::<half::f16>(&comms, &mut rng);
    typed::<half::bf16>(&comms, &mut rng);
}

/// Captured once per rank, replayed 200 times with fresh inputs copied in
/// before each replay: every replay's outputs right.
#[test]
fn graphs_replay_with_fresh_inputs() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("graphs_replay_with_fresh_inputs") else { return };
    let mut rng = common::rng("graphs_replay_with_fresh_inputs");
    let world = 3;
    let comms = group(&ctx, world);
    let n = 21_504;
    let mut sends = Vec::new();
    let mut gathered = Vec::new();
    let mut scattered = Vec::new();
    for c in &comms {
        let s = c.stream();
        sends.push(s.alloc_zeros::<half::bf16>(world * n).unwrap());
        gathered.push(s.alloc_zeros::<half::bf16>(world * n).unwrap());
        scattered.push(s.alloc_zeros::<half::bf16>(n).unwrap());
    }
    let mut graphs = Vec::new();
    for (r, c) in comms.iter().enumerate() {
        let s = c.stream();
        s.synchronize().unwrap();
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
        let block = sends[r].slice(0..n);
        c.all_gather(&block, &mut gathered[r]).unwrap();
        c.reduce_scatter(&sends[r], &mut scattered[r], &tp_allreduce::ReduceOp::Sum).unwrap();
        let g = s.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH).unwrap();
        graphs.push(g.expect("a graph"));
    }
    for replay in 0..200 {
        let inputs: Vec<Vec<half::bf16>> = (0..world).map(|_| random_vec(&mut rng, world * n)).collect();
        for (r, c) in comms.iter().enumerate() {
            c.stream().memcpy_htod(&inputs[r], &mut sends[r]).unwrap();
        }
        for g in &graphs {
            g.launch().unwrap();
        }
        for (r, c) in comms.iter().enumerate() {
            c.synchronize().unwrap_or_else(|e| panic!("replay {replay} rank {r}: {e}"));
            let g = c.stream().clone_dtoh(&gathered[r]).unwrap();
            let want: Vec<u32> = inputs.iter().flat_map(|v| bits(&v[..n])).collect();
            assert_eq!(bits(&g), want, "replay {replay} rank {r}: all-gather");
            let s = c.stream().clone_dtoh(&scattered[r]).unwrap();
            let block: Vec<Vec<half::bf16>> = inputs.iter().map(|v| v[r * n..(r + 1) * n].to_vec()).collect();
            check_sum(&block, &s, 1).unwrap_or_else(|e| panic!("replay {replay} rank {r}: reduce-scatter: {e}"));
        }
    }
}

/// A world of one copies; wrong lengths and partial overlaps are refused.
#[test]
fn world_of_one_and_bad_arguments() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("world_of_one_and_bad_arguments") else { return };
    let one = group(&ctx, 1);
    let s = one[0].stream();
    let v: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let src = s.clone_htod(&v).unwrap();
    let mut dst = s.alloc_zeros::<f32>(1000).unwrap();
    one[0].all_gather(&src, &mut dst).unwrap();
    one[0].synchronize().unwrap();
    assert_eq!(s.clone_dtoh(&dst).unwrap(), v);

    let comms = group(&ctx, 2);
    let s = comms[0].stream();
    let small = s.alloc_zeros::<f32>(100).unwrap();
    let mut wrong = s.alloc_zeros::<f32>(150).unwrap();
    match comms[0].all_gather(&small, &mut wrong) {
        Err(Error::InvalidUsage(m)) => assert!(m.contains("world size"), "{m}"),
        other => panic!("expected InvalidUsage, got {other:?}"),
    }
    match comms[0].reduce_scatter(&small, &mut wrong, &tp_allreduce::ReduceOp::Sum) {
        Err(Error::InvalidUsage(m)) => assert!(m.contains("world size"), "{m}"),
        other => panic!("expected InvalidUsage, got {other:?}"),
    }
    match comms[0].reduce_scatter(&small, &mut wrong, &tp_allreduce::ReduceOp::Max) {
        Err(Error::Unsupported(_)) => {}
        other => panic!("expected Unsupported for max, got {other:?}"),
    }
    // A send that overlaps the output other than as block `rank`.
    let big = s.alloc_zeros::<f32>(200).unwrap();
    let p = common::ptr_of(&s, &big, 0);
    // SAFETY: both views lie inside `big` (200 elements).
    let e = unsafe { comms[0].all_gather_raw(p + 4, p, 100, DType::F32, s.cu_stream()) };
    assert!(matches!(e, Err(Error::InvalidUsage(ref m)) if m.contains("overlap")), "{e:?}");
    let plan = comms[0].plan_collective(Collective::AllGather, 8 << 20, true);
    assert_eq!(plan.algorithm, Algorithm::AllGatherPush, "{plan:?}");
    let plan = comms[0].plan_collective(Collective::ReduceScatter, 8 << 20, false);
    assert_eq!(plan.algorithm, Algorithm::ReduceScatterPush, "{plan:?}");
}

/// Random bytes of `n` 32-bit words where about a fifth of the words are
/// the all-ones pattern (-1 as i32, the "not arrived" pattern of the
/// wire), the escape pattern 0xFFFFFFFE (-2) or a word with an all-ones
/// half (-1 as i16 next to a random half), at random positions; the rest
/// random bits (NaNs with payloads, denormals, ints).
fn random_word_bytes(rng: &mut StdRng, n: usize) -> Vec<u8> {
    use rand::Rng;
    (0..n)
        .flat_map(|_| {
            let w: u32 = match rng.gen_range(0..20) {
                0 | 1 => u32::MAX,
                2 => 0xFFFF_FFFE,
                3 => 0xFFFF_0000 | rng.gen_range(0..=0xFFFFu32),
                4 => (rng.gen_range(0..=0xFFFFu32) << 16) | 0xFFFF,
                _ => rng.gen(),
            };
            w.to_le_bytes()
        })
        .collect()
}

/// The all-gather is a copy (issue 35 item 1): every bit pattern of every
/// dtype arrives unchanged, all-ones words (-1 as an int viewed as f32)
/// and halves included, worlds 2-8, in place and out of place, counts
/// from one element to several launches, eager and in replayed graphs.
/// Before, 0xFFFFFFFF arrived as 0x7FC00000 and 0xFFFF as 0x7E00/0x7FC0.
#[test]
fn all_gather_copies_every_bit_pattern() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("all_gather_copies_every_bit_pattern") else { return };
    let mut rng = common::rng("all_gather_copies_every_bit_pattern");
    let mut cases = 0;
    for world in 2..=8 {
        let comms = group(&ctx, world);
        for dtype in [DType::F32, DType::F16, DType::Bf16] {
            let es = dtype.size_bytes();
            // Elements: one, a tail, a few packs, past one launch's capacity.
            for count in [1usize, 7, 4099, (3 << 20) / es + 5] {
                for in_place in [false, true] {
                    let block = count * es;
                    let inputs: Vec<Vec<u8>> = (0..world)
                        .map(|_| {
                            let mut b = random_word_bytes(&mut rng, block.div_ceil(4));
                            b.truncate(block);
                            b
                        })
                        .collect();
                    let want: Vec<u8> = inputs.concat();
                    let mut outs = Vec::new();
                    for (r, c) in comms.iter().enumerate() {
                        let s = c.stream();
                        let mut host = vec![0xA5u8; world * block];
                        if in_place {
                            host[r * block..(r + 1) * block].copy_from_slice(&inputs[r]);
                        }
                        let recv = s.clone_htod(&host).unwrap();
                        let send = s.clone_htod(&inputs[r]).unwrap();
                        {
                            let (recv_ptr, _g1) = cudarc::driver::DevicePtr::device_ptr(&recv, &s);
                            let (send_ptr, _g2) = cudarc::driver::DevicePtr::device_ptr(&send, &s);
                            let src = if in_place { recv_ptr + (r * block) as u64 } else { send_ptr };
                            // SAFETY: `recv` holds world x count elements, `src`
                            // count elements inside a live buffer.
                            unsafe { c.all_gather_raw(src, recv_ptr, count, dtype, s.cu_stream()) }
                                .unwrap_or_else(|e| panic!("world {world} {dtype:?} x{count}: rank {r}: {e}"));
                        }
                        outs.push((recv, send));
                    }
                    for (r, c) in comms.iter().enumerate() {
                        c.synchronize().unwrap_or_else(|e| panic!("rank {r}: {e}"));
                        let got = c.stream().clone_dtoh(&outs[r].0).unwrap();
                        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
                            let w = i / 4 * 4;
                            panic!(
                                "world {world} {dtype:?} x{count} in place {in_place}: rank {r} byte {i} (block {}): \
                                 word {:02x?} want {:02x?}",
                                i / block,
                                &got[w..(w + 4).min(got.len())],
                                &want[w..(w + 4).min(want.len())]
                            );
                        }
                    }
                    cases += 1;
                }
            }
        }
        // Graphs: one all-gather per rank captured, replayed with fresh
        // bits each time (a bf16 and an f32 view of the same kind of data).
        for dtype in [DType::Bf16, DType::F32] {
            let count = 21_504;
            let block = count * dtype.size_bytes();
            let mut sends = Vec::new();
            let mut recvs = Vec::new();
            let mut graphs = Vec::new();
            for c in &comms {
                let s = c.stream();
                sends.push(s.alloc_zeros::<u8>(block).unwrap());
                recvs.push(s.alloc_zeros::<u8>(world * block).unwrap());
            }
            for (r, c) in comms.iter().enumerate() {
                let s = c.stream();
                s.synchronize().unwrap();
                s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
                {
                    let (src, _g1) = cudarc::driver::DevicePtr::device_ptr(&sends[r], &s);
                    let (dst, _g2) = cudarc::driver::DevicePtr::device_ptr(&recvs[r], &s);
                    // SAFETY: live buffers of `count` and world x `count` elements.
                    unsafe { c.all_gather_raw(src, dst, count, dtype, s.cu_stream()) }.unwrap();
                }
                let g = s
                    .end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
                    .unwrap();
                graphs.push(g.expect("a graph"));
            }
            for replay in 0..20 {
                let inputs: Vec<Vec<u8>> = (0..world).map(|_| random_word_bytes(&mut rng, block / 4)).collect();
                for (r, c) in comms.iter().enumerate() {
                    c.stream().memcpy_htod(&inputs[r], &mut sends[r]).unwrap();
                }
                for g in &graphs {
                    g.launch().unwrap();
                }
                let want = inputs.concat();
                for (r, c) in comms.iter().enumerate() {
                    c.synchronize().unwrap_or_else(|e| panic!("replay {replay} rank {r}: {e}"));
                    let got = c.stream().clone_dtoh(&recvs[r]).unwrap();
                    let i = got.iter().zip(&want).position(|(a, b)| a != b);
                    assert!(i.is_none(), "world {world} {dtype:?} replay {replay} rank {r}: byte {i:?} differs");
                }
                cases += 1;
            }
        }
    }
    eprintln!("all-gather bit patterns: {cases} cases checked bit for bit");
    assert_eq!(cases, 7 * (3 * 4 * 2 + 2 * 20));
}
