//! The candle ops (cargo feature `candle`) on a GPU: in-process groups of
//! candle devices on GPU 0, one stream each, checked against the f64
//! reference, bitwise across ranks, eagerly and in a captured CUDA graph.
//! The CPU-side checks (refusals, dtype mapping, id payload) are the unit
//! tests in `host/candle/tests.rs`.

use std::sync::Arc;
use std::time::Duration;

use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType as CDType, Device, Tensor};
use cudarc::driver::sys;
use half::{bf16, f16};
use rand::rngs::StdRng;
use tp_allreduce::candle::{AllReduce, FusedAddRmsNorm};
use tp_allreduce::{Comm, Config};

use crate::common::{self, check_sum, random_vec, TestElem};

/// An in-process group of `world` ranks: a candle device (own stream) and
/// a communicator on that stream per rank.
fn group(world: usize) -> (Vec<Device>, Vec<Arc<Comm>>) {
    let devices: Vec<CudaDevice> = (0..world)
        .map(|_| {
            let d = CudaDevice::new_with_stream(0).expect("candle CudaDevice");
            // SAFETY: each rank's tensors live on its own stream only.
            unsafe { d.disable_event_tracking() };
            d
        })
        .collect();
    let config = Config { timeout: Duration::from_secs(3), ..Config::default() };
    let comms = Comm::from_streams(devices.iter().map(|d| d.cuda_stream()).collect(), config).expect("group");
    (devices.into_iter().map(Device::Cuda).collect(), comms.into_iter().map(Arc::new).collect())
}

/// Runs `f(rank)` on one thread per rank (collective calls).
fn per_rank<T: Send>(world: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                s.spawn({
                    let f = &f;
                    move || f(r)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

fn to_tensor<T: TestElem>(values: &[T], shape: (usize, usize), device: &Device) -> Tensor {
    let wide: Vec<f32> = values.iter().map(|v| v.to_f64() as f32).collect();
    Tensor::from_vec(wide, shape, &Device::Cpu).unwrap().to_dtype(cdtype::<T>()).unwrap().to_device(device).unwrap()
}

fn from_tensor<T: TestElem>(t: &Tensor) -> Vec<T> {
    let wide = t.to_device(&Device::Cpu).unwrap().to_dtype(CDType::F64).unwrap().flatten_all().unwrap();
    wide.to_vec1::<f64>().unwrap().into_iter().map(T::from_f64).collect()
}

fn cdtype<T: TestElem>() -> CDType {
    match T::DTYPE {
        tp_allreduce::DType::F32 => CDType::F32,
        tp_allreduce::DType::F16 => CDType::F16,
        tp_allreduce::DType::Bf16 => CDType::BF16,
    }
}

/// Roundings of partial sums the chosen algorithm makes (1 for most).
fn max_roundings<T: TestElem>(comm: &Comm, count: usize, capturing: bool) -> usize {
    let world = comm.world_size();
    let bytes = count * std::mem::size_of::<T>();
    [false, true]
        .iter()
        .map(|&in_place| comm.plan_call(bytes, T::DTYPE, capturing, in_place).algorithm.max_roundings(world))
        .max()
        .unwrap_or(1)
}

/// Out of place and in place, on whole tensors and on a row range of a
/// bigger one (a contiguous view with a start offset).
fn all_reduce_case<T: TestElem>(rng: &mut StdRng, world: usize, rows: usize, hidden: usize) -> Result<(), String> {
    let (devices, comms) = group(world);
    let extra = 2; // rows before the view
    let inputs: Vec<Vec<T>> = (0..world).map(|_| random_vec(rng, (rows + extra) * hidden)).collect();
    let view = |v: &[T]| v[extra * hidden..].to_vec();
    let outcomes = per_rank(world, |r| {
        let all_reduce = AllReduce::new(comms[r].clone());
        let whole = to_tensor(&view(&inputs[r]), (rows, hidden), &devices[r]);
        let out = all_reduce.all_reduce(&whole).map_err(|e| e.to_string())?;
        let big = to_tensor(&inputs[r], (rows + extra, hidden), &devices[r]);
        let rows_view = big.narrow(0, extra, rows).unwrap();
        let out_of_view = all_reduce.all_reduce(&rows_view).map_err(|e| e.to_string())?;
        all_reduce.all_reduce_in_place(&rows_view).map_err(|e| e.to_string())?;
        let untouched = big.narrow(0, 0, extra).unwrap();
        // A kernel that gave up (e.g. timed out) reports here, not as values.
        comms[r].synchronize().map_err(|e| e.to_string())?;
        Ok::<_, String>((
            from_tensor::<T>(&out),
            from_tensor::<T>(&out_of_view),
            from_tensor::<T>(&rows_view),
            from_tensor::<T>(&untouched),
        ))
    });
    let reference: Vec<Vec<T>> = inputs.iter().map(|v| view(v)).collect();
    let roundings = max_roundings::<T>(&comms[0], rows * hidden, false);
    let mut first: Option<Vec<u32>> = None;
    for (r, outcome) in outcomes.into_iter().enumerate() {
        let (out, out_of_view, in_place, untouched) = outcome.map_err(|e| format!("rank {r}: {e}"))?;
        for (what, got) in [("out of place", &out), ("view, out of place", &out_of_view), ("view, in place", &in_place)]
        {
            check_sum(&reference, got, roundings).map_err(|e| format!("rank {r} {what}: {e}"))?;
        }
        if common::bits(&untouched) != common::bits(&inputs[r][..extra * hidden]) {
            return Err(format!("rank {r}: the in-place op wrote outside the view"));
        }
        let bits = common::bits(&out);
        if *first.get_or_insert_with(|| bits.clone()) != bits {
            return Err(format!("rank {r}: result differs bitwise from rank 0"));
        }
    }
    Ok(())
}

#[test]
fn candle_all_reduce_matches_the_f64_reference() {
    let test = "candle_all_reduce_matches_the_f64_reference";
    let _lock = common::gpu_lock();
    let Some(_ctx) = common::gpu(test) else { return };
    let mut rng = common::rng(test);
    for (world, rows, hidden) in [(2, 3, 7168), (2, 1, 5), (3, 7, 1000), (4, 64, 4096)] {
        all_reduce_case::<bf16>(&mut rng, world, rows, hidden)
            .unwrap_or_else(|e| panic!("bf16 {world}x{rows}x{hidden}: {e}"));
        all_reduce_case::<f16>(&mut rng, world, rows, hidden)
            .unwrap_or_else(|e| panic!("f16 {world}x{rows}x{hidden}: {e}"));
        all_reduce_case::<f32>(&mut rng, world, rows, hidden)
            .unwrap_or_else(|e| panic!("f32 {world}x{rows}x{hidden}: {e}"));
    }
}

/// The f64 reference of the epilogue from the device's updated residual:
/// the norm's own error is checked apart from the add's rounding.
fn rms_norm_reference(residual: &[f64], hidden: usize, scale: &[f64], eps: f64) -> Vec<f64> {
    residual
        .chunks(hidden)
        .flat_map(|row| {
            let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / hidden as f64 + eps).sqrt();
            row.iter().zip(scale).map(move |(v, s)| v * inv * s).collect::<Vec<_>>()
        })
        .collect()
}

/// Runs the epilogue's candle kernels once on `device` alone (a
/// one-rank communicator on its stream), so that candle loads them before
/// any collective. Ranks sharing a GPU in one process need this: CUDA loads
/// a kernel lazily at its first launch and may synchronise the context to do
/// so, which then waits for a peer's allreduce kernel that is waiting for
/// this rank (seen on one H200 with 3 ranks: the waiting rank's kernel timed
/// out and left its output unwritten).
fn load_norm_kernels<T: TestElem>(device: &Device, rows: usize, hidden: usize, gemma: bool) -> Result<(), String> {
    let cuda = device.as_cuda_device().map_err(|e| e.to_string())?;
    let alone = Comm::from_streams(vec![cuda.cuda_stream()], Config::default()).map_err(|e| e.to_string())?;
    let alone = Arc::new(alone.into_iter().next().expect("one rank"));
    let weight = Tensor::ones(hidden, cdtype::<T>(), device).map_err(|e| e.to_string())?;
    let mut norm = FusedAddRmsNorm::new(alone.clone(), &weight, 1e-6).map_err(|e| e.to_string())?;
    if gemma {
        norm = norm.with_unit_offset().map_err(|e| e.to_string())?;
    }
    let x = Tensor::ones((rows, hidden), cdtype::<T>(), device).map_err(|e| e.to_string())?;
    let residual = Tensor::zeros((rows, hidden), cdtype::<T>(), device).map_err(|e| e.to_string())?;
    norm.forward(&x, &residual).map_err(|e| e.to_string())?;
    alone.synchronize().map_err(|e| e.to_string())
}

fn add_rms_norm_case<T: TestElem>(
    rng: &mut StdRng,
    world: usize,
    rows: usize,
    hidden: usize,
    gemma: bool,
) -> Result<(), String> {
    let (devices, comms) = group(world);
    let eps = 1e-6;
    let partials: Vec<Vec<T>> = (0..world).map(|_| random_vec(rng, rows * hidden)).collect();
    let residual0: Vec<T> = random_vec(rng, rows * hidden);
    let weight: Vec<T> = random_vec(rng, hidden);
    for device in &devices {
        load_norm_kernels::<T>(device, rows, hidden, gemma)?;
    }
    let outcomes = per_rank(world, |r| {
        let w = to_tensor(&weight, (1, hidden), &devices[r]).squeeze(0).unwrap();
        let mut norm = FusedAddRmsNorm::new(comms[r].clone(), &w, eps).map_err(|e| e.to_string())?;
        if gemma {
            norm = norm.with_unit_offset().map_err(|e| e.to_string())?;
        }
        let x = to_tensor(&partials[r], (rows, hidden), &devices[r]);
        let residual = to_tensor(&residual0, (rows, hidden), &devices[r]);
        let normed = norm.forward(&x, &residual).map_err(|e| e.to_string())?;
        if normed.dims() != [rows, hidden] || normed.dtype() != cdtype::<T>() {
            return Err(format!("normed has shape {:?} dtype {:?}", normed.dims(), normed.dtype()));
        }
        let outcome = (from_tensor::<T>(&residual), from_tensor::<T>(&normed), from_tensor::<T>(&x));
        // A kernel that gave up (e.g. timed out) reports here, not as values.
        comms[r].synchronize().map_err(|e| e.to_string())?;
        Ok(outcome)
    });
    let roundings = max_roundings::<T>(&comms[0], rows * hidden, false) + 1; // + the add
    let mut summands = partials.clone();
    summands.push(residual0.clone());
    let scale: Vec<f64> = weight.iter().map(|w| w.to_f64() + if gemma { 1.0 } else { 0.0 }).collect();
    let mut first: Option<(Vec<u32>, Vec<u32>)> = None;
    for (r, outcome) in outcomes.into_iter().enumerate() {
        let (residual, normed, x) = outcome.map_err(|e| format!("rank {r}: {e}"))?;
        // The allreduce's roundings, then + residual rounded once.
        check_sum(&summands, &residual, roundings)
            .map_err(|e| format!("rank {r} residual: {e}; {}", explain_residual(&partials, &residual0, &residual)))?;
        if common::bits(&x) != common::bits(&partials[r]) {
            return Err(format!("rank {r}: the input x was modified"));
        }
        let updated: Vec<f64> = residual.iter().map(|v| v.to_f64()).collect();
        let want = rms_norm_reference(&updated, hidden, &scale, eps);
        for (i, (got, want)) in normed.iter().zip(&want).enumerate() {
            // f32 arithmetic, one rounding to T.
            let tol = T::UNIT_ROUNDOFF * want.abs() * 1.001 + 1e-5 * (scale[i % hidden].abs() + 1.0);
            if (got.to_f64() - want).abs() > tol {
                return Err(format!("rank {r} normed[{i}]: got {:e} want {want:e} (tol {tol:e})", got.to_f64()));
            }
        }
        let bits = (common::bits(&residual), common::bits(&normed));
        if *first.get_or_insert_with(|| bits.clone()) != bits {
            return Err(format!("rank {r}: residual or normed differs bitwise from rank 0"));
        }
    }
    Ok(())
}

/// Which wrong sum a wrong residual holds (the share of elements within
/// 2 % of: the old residual, the partials' sum alone, the sum without one
/// rank's partial): names the missing step of a failure.
fn explain_residual<T: TestElem>(partials: &[Vec<T>], residual0: &[T], got: &[T]) -> String {
    let close = |want: &dyn Fn(usize) -> f64| {
        let hits = (0..got.len()).filter(|&i| (got[i].to_f64() - want(i)).abs() <= 0.02 * want(i).abs() + 1e-3).count();
        format!("{:.0} %", 100.0 * hits as f64 / got.len().max(1) as f64)
    };
    let sum = |i: usize, skip: Option<usize>| -> f64 {
        partials.iter().enumerate().filter(|(k, _)| Some(*k) != skip).map(|(_, p)| p[i].to_f64()).sum()
    };
    let mut parts = vec![
        format!("old residual {}", close(&|i| residual0[i].to_f64())),
        format!("partials' sum alone {}", close(&|i| sum(i, None))),
    ];
    for k in 0..partials.len() {
        parts.push(format!("without rank {k} {}", close(&|i| residual0[i].to_f64() + sum(i, Some(k)))));
    }
    format!("elements close to: {}", parts.join(", "))
}

#[test]
fn candle_add_rms_norm_matches_the_f64_reference() {
    let test = "candle_add_rms_norm_matches_the_f64_reference";
    let _lock = common::gpu_lock();
    let Some(_ctx) = common::gpu(test) else { return };
    let mut rng = common::rng(test);
    for (world, rows, hidden) in [(2, 3, 7168), (2, 1, 128), (3, 7, 5120)] {
        for gemma in [false, true] {
            let what = format!("{world}x{rows}x{hidden} gemma={gemma}");
            add_rms_norm_case::<bf16>(&mut rng, world, rows, hidden, gemma)
                .unwrap_or_else(|e| panic!("bf16 {what}: {e}"));
            add_rms_norm_case::<f32>(&mut rng, world, rows, hidden, gemma)
                .unwrap_or_else(|e| panic!("f32 {what}: {e}"));
        }
    }
}

#[test]
fn candle_ops_refuse_bad_cuda_tensors() {
    let test = "candle_ops_refuse_bad_cuda_tensors";
    let _lock = common::gpu_lock();
    let Some(_ctx) = common::gpu(test) else { return };
    let (devices, comms) = group(1);
    let all_reduce = AllReduce::new(comms[0].clone());
    let x = Tensor::ones((4, 8), CDType::F32, &devices[0]).unwrap();
    let transposed = x.t().unwrap();
    let err = all_reduce.all_reduce(&transposed).unwrap_err().to_string();
    assert!(err.contains("contiguous"), "{err}");
    let err = all_reduce.all_reduce_in_place(&transposed).unwrap_err().to_string();
    assert!(err.contains("contiguous"), "{err}");
    let ints = Tensor::ones((4, 8), CDType::I64, &devices[0]).unwrap();
    let err = all_reduce.all_reduce(&ints).unwrap_err().to_string();
    assert!(err.contains("unsupported dtype"), "{err}");
    let doubles = Tensor::ones((4, 8), CDType::F64, &devices[0]).unwrap();
    let err = all_reduce.all_reduce_in_place(&doubles).unwrap_err().to_string();
    assert!(err.contains("unsupported dtype"), "{err}");
    // A world of one copies: the op still works after the refusals.
    let y = all_reduce.all_reduce(&x).unwrap();
    assert_eq!(y.sum_all().unwrap().to_scalar::<f32>().unwrap(), 32.0);
}

/// The op captured in a CUDA graph on every rank (with a candle kernel
/// after it, the way a layer uses it), then replayed with fresh inputs.
#[test]
fn candle_all_reduce_in_a_cuda_graph() {
    let test = "candle_all_reduce_in_a_cuda_graph";
    let _lock = common::gpu_lock();
    let Some(_ctx) = common::gpu(test) else { return };
    let mut rng = common::rng(test);
    let (world, rows, hidden) = (2, 3, 7168);
    let (devices, comms) = group(world);
    let inputs: Vec<Tensor> = devices.iter().map(|d| Tensor::zeros((rows, hidden), CDType::BF16, d).unwrap()).collect();
    let outputs: Vec<Tensor> =
        devices.iter().map(|d| Tensor::zeros((rows, hidden), CDType::BF16, d).unwrap()).collect();
    let ops: Vec<AllReduce> = comms.iter().map(|c| AllReduce::new(c.clone())).collect();
    // Eager once first: loads candle's kernels outside the capture.
    per_rank(world, |r| ops[r].all_reduce(&inputs[r]).map(drop).map_err(|e| e.to_string()))
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let cuda: Vec<CudaDevice> = devices.iter().map(|d| d.as_cuda_device().unwrap().clone()).collect();
    let _param_caches: Vec<_> = cuda.iter().map(|d| d.enable_cuda_graph_htod_cache()).collect();
    let graphs: Vec<_> = (0..world)
        .map(|r| {
            let stream = comms[r].stream();
            stream.synchronize().unwrap();
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).unwrap();
            let recorded = ops[r]
                .all_reduce(&inputs[r])
                .and_then(|sum| (sum * 0.5).and_then(|half| outputs[r].slice_set(&half, 0, 0)));
            let graph =
                stream.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
            recorded.unwrap_or_else(|e| panic!("capture rank {r}: {e}"));
            graph.unwrap().expect("a graph")
        })
        .collect();
    // Collective: every rank registers what it captured.
    for registered in per_rank(world, |r| comms[r].register_graph_buffers()) {
        registered.unwrap();
    }
    let roundings = max_roundings::<bf16>(&comms[0], rows * hidden, true);
    for replay in 0..20 {
        let fresh: Vec<Vec<bf16>> = (0..world).map(|_| random_vec(&mut rng, rows * hidden)).collect();
        for r in 0..world {
            inputs[r].slice_set(&to_tensor(&fresh[r], (rows, hidden), &devices[r]), 0, 0).unwrap();
            outputs[r]
                .slice_set(
                    &Tensor::full(f32::NAN, (rows, hidden), &devices[r]).unwrap().to_dtype(CDType::BF16).unwrap(),
                    0,
                    0,
                )
                .unwrap();
            comms[r].stream().synchronize().unwrap();
        }
        for g in &graphs {
            g.launch().unwrap();
        }
        for (r, output) in outputs.iter().enumerate() {
            let got: Vec<bf16> = from_tensor(output);
            let doubled: Vec<bf16> = got.iter().map(|v| bf16::from_f64(v.to_f64() * 2.0)).collect();
            check_sum(&fresh, &doubled, roundings).unwrap_or_else(|e| panic!("replay {replay} rank {r}: {e}"));
            comms[r].synchronize().unwrap_or_else(|e| panic!("replay {replay} rank {r}: {e}"));
        }
    }
}
