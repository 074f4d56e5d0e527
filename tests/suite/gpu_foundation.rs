//! The foundation path end to end: the Rust-built PTX for this device loads,
//! and the first kernels (sum of K buffers, affine) match a CPU reference.

use tp_allreduce::buffer::DeviceView;
use tp_allreduce::{DType, DeviceBuffer};

use crate::common::{self, TestElem, POISON};

#[test]
fn embedded_ptx_for_this_device_loads() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("embedded_ptx_for_this_device_loads") else { return };
    let (major, minor) = ctx.compute_capability().unwrap();
    let module = tp_allreduce::driver::KernelModule::for_context(&ctx).expect("PTX loads");
    let chosen = tp_allreduce::kernels::choose(major as u32, minor as u32).unwrap();
    assert_eq!(module.arch, chosen.arch);
    eprintln!("device cc {major}.{minor}: loaded {} PTX ({})", module.arch, tp_allreduce::kernels::PTX_ORIGIN);
    for name in tp_allreduce::kernels::expected_entries_for(chosen.sm) {
        module.kernel(&name).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    // H200 and newer run thread-block clusters (the fused calls' cluster
    // entries); older GPUs must not claim to.
    assert_eq!(module.clusters, chosen.sm >= tp_allreduce::kernels::CLUSTER_MIN_SM, "{}", module.arch);
}

fn sum_case<T: TestElem + bytemuck::Pod>(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    rng: &mut rand::rngs::StdRng,
    k: usize,
    n: usize,
    offset: usize,
) -> Result<(), String> {
    let stream = ctx.default_stream();
    let inputs: Vec<Vec<T>> = (0..k).map(|_| common::random_vec::<T>(rng, n)).collect();
    let bufs: Vec<DeviceBuffer<T>> = inputs
        .iter()
        .map(|v| {
            let mut host = vec![T::default(); offset];
            host.extend_from_slice(v);
            DeviceBuffer::from_host(&stream, &host).unwrap()
        })
        .collect();
    let mut out = DeviceBuffer::<T>::alloc(&stream, n + offset).map_err(|e| e.to_string())?;
    out.fill_bytes(POISON).map_err(|e| e.to_string())?;
    // Views `offset` elements in: inputs and output not 16-byte aligned.
    let views: Vec<DeviceView<'_, T>> = bufs.iter().map(|b| b.slice(offset..).unwrap()).collect();
    let view_refs: Vec<&DeviceView<'_, T>> = views.iter().collect();
    let mut out_view = out.slice_mut(offset..).map_err(|e| e.to_string())?;
    tp_allreduce::driver::elementwise::sum(&stream, &view_refs, &mut out_view).map_err(|e| e.to_string())?;
    let host = out.to_host().map_err(|e| e.to_string())?;
    if host[..offset].iter().any(|x| x.to_bits32() != common::poison_bits::<T>()) {
        return Err("wrote before the output view".into());
    }
    common::check_sum(&inputs, &host[offset..], 1)
}

#[test]
fn sum_kernel_matches_cpu_reference() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("sum_kernel_matches_cpu_reference") else { return };
    let mut rng = common::rng("sum_kernel_matches_cpu_reference");
    let mut failures = Vec::new();
    let mut cases = 0;
    for dtype in DType::ALL {
        for k in [1usize, 2, 3, 8] {
            for n in common::sizes_for(dtype, 1 << 20) {
                for offset in [0usize, 1] {
                    cases += 1;
                    let r = match dtype {
                        DType::F32 => sum_case::<f32>(&ctx, &mut rng, k, n, offset),
                        DType::F16 => sum_case::<half::f16>(&ctx, &mut rng, k, n, offset),
                        DType::Bf16 => sum_case::<half::bf16>(&ctx, &mut rng, k, n, offset),
                    };
                    if let Err(e) = r {
                        failures.push(format!("{} k={k} n={n} offset={offset}: {e}", dtype.name()));
                    }
                }
            }
        }
    }
    eprintln!("sum kernel: {} cases, {} failures", cases, failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn affine_case<T: TestElem>(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    rng: &mut rand::rngs::StdRng,
    n: usize,
) -> Result<(), String> {
    let stream = ctx.default_stream();
    let input = common::random_vec::<T>(rng, n);
    let d_in = stream.clone_htod(&input).unwrap();
    let mut d_out = stream.alloc_zeros::<T>(n).unwrap();
    let (scale, bias) = (0.75f32, -0.125f32);
    tp_allreduce::driver::elementwise::affine(&stream, &d_in, &mut d_out, scale, bias).map_err(|e| e.to_string())?;
    let out = stream.clone_dtoh(&d_out).unwrap();
    for i in 0..n {
        let want = input[i].to_f64() * scale as f64 + bias as f64;
        let got = out[i].to_f64();
        if (got - want).abs() > T::UNIT_ROUNDOFF * (want.abs() + 1.0) * 2.0 {
            return Err(format!("[{i}] got {got} want {want}"));
        }
    }
    Ok(())
}

#[test]
fn affine_kernel_matches_cpu_reference() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("affine_kernel_matches_cpu_reference") else { return };
    let mut rng = common::rng("affine_kernel_matches_cpu_reference");
    let mut failures = Vec::new();
    for n in [1usize, 7, 8, 9, 1000, 4097, 100_003] {
        for (name, r) in [
            ("f32", affine_case::<f32>(&ctx, &mut rng, n)),
            ("f16", affine_case::<half::f16>(&ctx, &mut rng, n)),
            ("bf16", affine_case::<half::bf16>(&ctx, &mut rng, n)),
        ] {
            if let Err(e) = r {
                failures.push(format!("{name} n={n}: {e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
