//! One process per rank, started by the launcher, which sets
//! `TP_ALLREDUCE_RANK/WORLD_SIZE/ID/DEVICE` (read by `RankEnv::from_env`):
//!
//!     cargo build --release --example launched
//!     cargo run --release -- launch -n 2 --gpus 0,1 -- target/release/examples/launched
//!
//! (Several ranks on one GPU need MPS, see README.md.) Without a GPU, or
//! when not started by the launcher, it says so and exits cleanly.

use cudarc::driver::CudaContext;
use tp_allreduce::{Config, DeviceBuffer, RankEnv, ReduceOp};

fn main() -> tp_allreduce::Result<()> {
    let Some(env) = RankEnv::from_env()? else {
        println!("not started by a launcher: run it under `tp-allreduce launch -n N -- <this program>`");
        return Ok(());
    };
    // cudarc's CudaContext::new panics without a driver: probe first.
    if tp_allreduce::raw::device_count() <= env.device {
        println!("rank {}: CUDA device {} is not visible: nothing to run", env.rank, env.device);
        return Ok(());
    }
    let stream = CudaContext::new(env.device)?.new_stream()?;
    let comm = env.comm(stream.clone(), Config::from_env()?)?;
    let values: Vec<half::bf16> = (0..21_504).map(|i| half::bf16::from_f32(((i % 7) + env.rank) as f32)).collect();
    let mut buffer = DeviceBuffer::from_host(&stream, &values)?;
    comm.all_reduce_in_place(&mut buffer, &ReduceOp::Sum)?;
    comm.synchronize()?;
    let sum = buffer.to_host()?;
    let world = env.world_size;
    for (i, v) in sum.iter().enumerate() {
        let expected = (world * (i % 7) + world * (world - 1) / 2) as f32;
        if v.to_f32() != expected {
            return Err(tp_allreduce::Error::InvalidUsage(format!("rank {}: element {i} is {v}", env.rank)));
        }
    }
    println!("rank {}/{world}: 42 KB bf16 allreduce correct", env.rank);
    Ok(())
}
