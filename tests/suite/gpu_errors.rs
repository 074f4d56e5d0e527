//! Bad input gets a clear error, never undefined behaviour or a hang.

use std::time::Duration;

use tp_allreduce::{Comm, Config, DType, Error, ReduceOp};

use crate::common;

#[test]
fn bad_input_is_rejected_with_clear_errors() {
    let _lock = common::gpu_lock();
    let Some(ctx) = common::gpu("bad_input_is_rejected_with_clear_errors") else { return };
    let comms = Comm::from_streams(
        common::streams(&ctx, 2),
        Config { timeout: Duration::from_secs(2), launch_timeout: Duration::from_secs(2), ..Config::default() },
    )
    .unwrap();
    let c = &comms[0];
    let s = c.stream();
    let a = s.alloc_zeros::<f32>(100).unwrap();
    let mut b = s.alloc_zeros::<f32>(99).unwrap();

    let e = c.all_reduce(&a, &mut b, &ReduceOp::Sum).unwrap_err();
    assert!(matches!(e, Error::InvalidUsage(_)), "length mismatch: {e}");
    eprintln!("length mismatch: {e}");

    let mut b100 = s.alloc_zeros::<f32>(100).unwrap();
    let e = c.all_reduce(&a, &mut b100, &ReduceOp::Max).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "op: {e}");
    eprintln!("unsupported op: {e}");

    // SAFETY (all raw calls below): each is rejected before any device access.
    let e = unsafe { c.all_reduce_raw(0, 0, 10, DType::F32, s.cu_stream()) }.unwrap_err();
    assert!(matches!(e, Error::InvalidUsage(_)), "null: {e}");
    eprintln!("null pointer: {e}");

    let (pa, _g) = cudarc::driver::DevicePtr::device_ptr(&a, &s);
    // 100 f32 viewed as 100 elements of a 2x larger type would overrun: use
    // a count that overruns the allocation as a dtype mistake would.
    let e = unsafe { c.all_reduce_raw(pa, pa, 100_000_000, DType::F32, s.cu_stream()) }.unwrap_err();
    assert!(matches!(e, Error::InvalidUsage(_)), "overrun: {e}");
    eprintln!("count/dtype overrun: {e}");

    let e = unsafe { c.all_reduce_raw(pa + 2, pa + 2, 4, DType::F32, s.cu_stream()) }.unwrap_err();
    assert!(matches!(e, Error::InvalidUsage(_)), "misaligned element: {e}");

    let e = unsafe { c.all_reduce_raw(pa, pa + 8, 10, DType::F32, s.cu_stream()) }.unwrap_err();
    assert!(matches!(e, Error::InvalidUsage(_)), "overlap: {e}");

    let host = [0f32; 16];
    let e = unsafe { c.all_reduce_raw(host.as_ptr() as u64, host.as_ptr() as u64, 16, DType::F32, s.cu_stream()) }
        .unwrap_err();
    assert!(matches!(e, Error::InvalidUsage(_)), "host pointer: {e}");
    eprintln!("host pointer: {e}");

    // A stream of another context on the same device.
    let other = cudarc::driver::CudaContext::new_non_primary(0, 0).unwrap();
    let other_stream = other.new_stream().unwrap();
    c.context().bind_to_thread().unwrap();
    let e = unsafe { c.all_reduce_raw(pa, pa, 100, DType::F32, other_stream.cu_stream()) }.unwrap_err();
    assert!(matches!(e, Error::InvalidUsage(_)), "foreign stream: {e}");
    eprintln!("foreign stream: {e}");

    // Configuration errors are caught before any allocation.
    let bad = Config { push_blocks: 0, ..Config::default() };
    let e = Comm::from_streams(common::streams(&ctx, 2), bad).err().expect("invalid config");
    assert!(matches!(e, Error::InvalidUsage(_)), "config: {e}");
    let e = Comm::from_streams(common::streams(&ctx, 3), Config { island_size: Some(2), ..Config::default() })
        .err()
        .expect("islands");
    assert!(matches!(e, Error::InvalidUsage(_)), "islands: {e}");
    eprintln!("bad islands: {e}");
}
