//! One process, one rank per visible GPU (two ranks on GPU 0 when only one
//! is visible): every rank allreduces a buffer of its rank number + 1 and
//! checks the sum.
//!
//!     cargo run --release --example in_process
//!
//! Without a GPU it says so and exits cleanly.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use tp_allreduce::{Comm, Config, DeviceBuffer, ReduceOp};

fn main() -> tp_allreduce::Result<()> {
    // cudarc's CudaContext::new panics without a driver: probe first.
    let gpus = tp_allreduce::raw::device_count();
    if gpus == 0 {
        println!("no CUDA device visible: nothing to run (this example needs a GPU)");
        return Ok(());
    }
    // Ranks sharing a GPU each need their own hardware queue.
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
    }
    let ordinals: Vec<usize> = if gpus == 1 { vec![0, 0] } else { (0..gpus.min(8)).collect() };
    let mut streams: Vec<Arc<CudaStream>> = Vec::new();
    for &ordinal in &ordinals {
        streams.push(CudaContext::new(ordinal)?.new_stream()?);
    }
    let comms = Comm::from_streams(streams, Config::from_env()?)?;
    let world = comms.len();
    let n = 21_504; // 84 KB of f32
    let mut buffers = Vec::with_capacity(world);
    for comm in &comms {
        let values = vec![(comm.rank() + 1) as f32; n];
        buffers.push(DeviceBuffer::from_host(&comm.stream(), &values)?);
    }
    // Every rank's call is queued on its own stream; the kernels meet on
    // the GPUs, so one thread can issue all of them.
    for (comm, buffer) in comms.iter().zip(buffers.iter_mut()) {
        comm.all_reduce_in_place(buffer, &ReduceOp::Sum)?;
    }
    let expected = (world * (world + 1) / 2) as f32;
    for (comm, buffer) in comms.iter().zip(&buffers) {
        comm.synchronize()?;
        let sum = buffer.to_host()?;
        if sum.iter().any(|&v| v != expected) {
            return Err(tp_allreduce::Error::InvalidUsage(format!("rank {}: wrong sum", comm.rank())));
        }
    }
    let plan = comms[0].plan_call(n * 4, tp_allreduce::DType::F32, false, true);
    println!("{world} ranks: allreduce of {n} f32 = {expected} everywhere ({}: {})", plan.algorithm, plan.reason);
    Ok(())
}
