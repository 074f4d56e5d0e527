//! CPU-side tests of the candle ops: what is refused and how, without a
//! GPU. The device path is covered by `tests/suite/candle.rs` (GPU) and
//! `examples/candle_tp.rs` (GPU, against NCCL).

use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType as CDType, Device, Layout, Tensor};

use super::*;

/// Counts calls; the CPU tests must never reach the device call.
#[derive(Default)]
struct CountingComm {
    calls: AtomicUsize,
}

impl CountingComm {
    fn record(&self) -> crate::Result<()> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Err(crate::Error::invalid("the CPU tests never reach the device call"))
    }
}

impl SliceAllReduce for CountingComm {
    fn f32(&self, _: Slot<'_, f32>, _: SlotMut<'_, f32>, _: usize, _: &Arc<CudaStream>) -> Res {
        self.record()
    }
    fn f16(&self, _: Slot<'_, half::f16>, _: SlotMut<'_, half::f16>, _: usize, _: &Arc<CudaStream>) -> Res {
        self.record()
    }
    fn bf16(&self, _: Slot<'_, half::bf16>, _: SlotMut<'_, half::bf16>, _: usize, _: &Arc<CudaStream>) -> Res {
        self.record()
    }
}

fn op() -> (AllReduce, Arc<CountingComm>) {
    let comm = Arc::new(CountingComm::default());
    (AllReduce { comm: comm.clone() }, comm)
}

/// Every candle dtype: the three float types map, everything else is refused.
#[test]
fn dtype_mapping() {
    let supported = [(CDType::F32, DType::F32), (CDType::F16, DType::F16), (CDType::BF16, DType::Bf16)];
    for (candle, ours) in supported {
        assert_eq!(dtype_of(candle), Some(ours), "{candle:?}");
    }
    let refused = [
        CDType::U8,
        CDType::U32,
        CDType::I16,
        CDType::I32,
        CDType::I64,
        CDType::F64,
        CDType::F8E4M3,
        CDType::F6E2M3,
        CDType::F6E3M2,
        CDType::F4,
        CDType::F8E8M0,
    ];
    for candle in refused {
        assert_eq!(dtype_of(candle), None, "{candle:?}");
        let err = check_input(ALL_REDUCE_OP, candle, &Layout::contiguous((3, 8))).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("unsupported dtype") && msg.contains(ALL_REDUCE_OP), "{candle:?}: {msg}");
    }
}

#[test]
fn contiguous_layouts_give_offset_and_count() {
    let full = Layout::contiguous((3, 7168));
    assert_eq!(check_input(ALL_REDUCE_OP, CDType::BF16, &full).unwrap(), (DType::Bf16, 0, 3 * 7168));
    // Rows 2..5 of a [7, 16] tensor: contiguous, starting at element 32.
    let rows = Layout::contiguous((7, 16)).narrow(0, 2, 3).unwrap();
    assert_eq!(check_input(ALL_REDUCE_OP, CDType::F16, &rows).unwrap(), (DType::F16, 32, 48));
    let empty = Layout::contiguous((0, 16));
    assert_eq!(check_input(ALL_REDUCE_OP, CDType::F32, &empty).unwrap(), (DType::F32, 0, 0));
}

#[test]
fn non_contiguous_layouts_are_refused() {
    let transposed = Layout::contiguous((4, 8)).transpose(0, 1).unwrap();
    let columns = Layout::contiguous((4, 8)).narrow(1, 2, 3).unwrap();
    let broadcast = Layout::contiguous((1, 8)).broadcast_as((4, 8)).unwrap();
    for layout in [transposed, columns, broadcast] {
        let err = check_input(ALL_REDUCE_OP, CDType::F32, &layout).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("contiguous") && msg.contains(ALL_REDUCE_OP), "{layout:?}: {msg}");
    }
}

#[test]
fn cpu_tensors_are_an_error_not_a_panic() {
    let (all_reduce, comm) = op();
    let x = Tensor::randn(0f32, 1.0, (3, 64), &Device::Cpu).unwrap();
    let before = x.to_vec2::<f32>().unwrap();
    let err = all_reduce.all_reduce(&x).unwrap_err().to_string();
    assert!(err.contains("on the CPU") && err.contains(ALL_REDUCE_OP), "{err}");
    let err = all_reduce.all_reduce_in_place(&x).unwrap_err().to_string();
    assert!(err.contains("on the CPU"), "{err}");
    assert_eq!(x.to_vec2::<f32>().unwrap(), before, "the in-place op changed a CPU tensor");
    assert_eq!(comm.calls.load(Ordering::SeqCst), 0);
}

#[test]
fn add_rms_norm_on_cpu_tensors_is_an_error_and_leaves_the_residual() {
    let (all_reduce, comm) = op();
    let weight = Tensor::randn(0f32, 1.0, 64, &Device::Cpu).unwrap();
    let norm = FusedAddRmsNorm::with_all_reduce(all_reduce, &weight, 1e-6).unwrap();
    assert_eq!(norm.hidden_size(), 64);
    let x = Tensor::randn(0f32, 1.0, (3, 64), &Device::Cpu).unwrap().to_dtype(CDType::BF16).unwrap();
    let residual = Tensor::randn(0f32, 1.0, (3, 64), &Device::Cpu).unwrap().to_dtype(CDType::BF16).unwrap();
    let before = residual.to_dtype(CDType::F32).unwrap().to_vec2::<f32>().unwrap();
    let err = norm.forward(&x, &residual).unwrap_err().to_string();
    assert!(err.contains("on the CPU"), "{err}");
    assert_eq!(residual.to_dtype(CDType::F32).unwrap().to_vec2::<f32>().unwrap(), before);
    assert_eq!(comm.calls.load(Ordering::SeqCst), 0);
}

#[test]
fn add_rms_norm_checks_its_arguments() {
    let cpu = &Device::Cpu;
    let weight = Tensor::ones(64, CDType::F32, cpu).unwrap();
    let matrix = Tensor::ones((2, 64), CDType::F32, cpu).unwrap();
    let msg = |r: candle_core::Result<FusedAddRmsNorm>| r.unwrap_err().to_string();
    assert!(msg(FusedAddRmsNorm::with_all_reduce(op().0, &matrix, 1e-6)).contains("vector"));
    for eps in [0.0, -1e-6, f64::NAN, f64::INFINITY] {
        assert!(msg(FusedAddRmsNorm::with_all_reduce(op().0, &weight, eps)).contains("eps"), "{eps}");
    }
    let (all_reduce, comm) = op();
    let norm = FusedAddRmsNorm::with_all_reduce(all_reduce, &weight, 1e-6).unwrap();
    let x = Tensor::ones((3, 64), CDType::F32, cpu).unwrap();
    let cases = [
        (Tensor::ones((4, 64), CDType::F32, cpu).unwrap(), "same shape"),
        (Tensor::ones((3, 64), CDType::F16, cpu).unwrap(), "same dtype"),
        (Tensor::ones(3 * 64, CDType::F32, cpu).unwrap(), "same shape"),
    ];
    for (residual, want) in cases {
        let err = norm.forward(&x, &residual).unwrap_err().to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
    let wrong_hidden = Tensor::ones((3, 32), CDType::F32, cpu).unwrap();
    let err = norm.forward(&wrong_hidden, &wrong_hidden).unwrap_err().to_string();
    assert!(err.contains("weight's length 64"), "{err}");
    let strided = Tensor::ones((64, 3), CDType::F32, cpu).unwrap().t().unwrap();
    let err = norm.forward(&x, &strided).unwrap_err().to_string();
    assert!(err.contains("contiguous"), "{err}");
    assert_eq!(comm.calls.load(Ordering::SeqCst), 0);
}

#[test]
fn unit_offset_adds_one_to_the_weight() {
    let weight = Tensor::new(&[0.5f32, -1.0, 2.0], &Device::Cpu).unwrap();
    let plain = FusedAddRmsNorm::with_all_reduce(op().0, &weight, 1e-6).unwrap();
    let gemma = plain.clone().with_unit_offset().unwrap();
    assert_eq!(plain.scale.to_vec1::<f32>().unwrap(), vec![0.5, -1.0, 2.0]);
    assert_eq!(gemma.scale.to_vec1::<f32>().unwrap(), vec![1.5, 0.0, 3.0]);
}

/// Engines pass an NCCL id as `[c_char; 128]`: every TCP id fits, and so
/// does a Unix id under a base directory of up to 52 bytes.
#[test]
fn ids_fit_the_128_byte_payload() {
    let longest_tcp = "[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff%4294967295]:65535";
    for addr in ["127.0.0.1:29500", "255.255.255.255:65535", longest_tcp] {
        let id = Id::new_tcp(addr.parse().unwrap());
        let payload = encode_id(&id).unwrap();
        assert!(id.to_string().len() < ID_PAYLOAD_BYTES, "{id}");
        assert_eq!(decode_id(&payload).unwrap(), id);
    }
    // Unix ids: "tpar2:unix:<base>/tpar-<16 hex>/rdv.sock:<32 hex>" = 75 + base bytes.
    let job = "0123456789abcdef0123456789abcdef";
    let unix = |base: &str| format!("tpar2:unix:{base}/tpar-0123456789abcdef/rdv.sock:{job}").parse::<Id>().unwrap();
    let base_52 = format!("/{}", "d".repeat(51));
    let fits = unix(&base_52);
    assert_eq!(fits.to_string().len(), 127);
    assert_eq!(decode_id(&encode_id(&fits).unwrap()).unwrap(), fits);
    let too_long = unix(&format!("{base_52}e"));
    let err = encode_id(&too_long).unwrap_err().to_string();
    assert!(err.contains("128-byte payload") || err.contains("127-byte payload"), "{err}");
    assert!(!err.contains(job) && !err.contains(&job[..8]), "the error shows the secret: {err}");
    // One made here (XDG_RUNTIME_DIR or the temp dir of this machine).
    let here = Id::new_unix().unwrap();
    let decoded = encode_id(&here).and_then(|p| decode_id(&p));
    here.remove_files();
    assert_eq!(decoded.unwrap(), here);
}

#[test]
fn malformed_id_payloads_are_refused() {
    let unterminated = [b'x' as c_char; ID_PAYLOAD_BYTES];
    assert!(decode_id(&unterminated).unwrap_err().to_string().contains("NUL-terminated"));
    let empty = [0 as c_char; ID_PAYLOAD_BYTES];
    assert!(decode_id(&empty).unwrap_err().to_string().contains("rendezvous id"));
    let mut garbage = [0 as c_char; ID_PAYLOAD_BYTES];
    for (g, b) in garbage.iter_mut().zip(b"nccl-unique-id-bytes") {
        *g = *b as c_char;
    }
    assert!(decode_id(&garbage).unwrap_err().to_string().contains("not a tp-allreduce rendezvous id"));
}
