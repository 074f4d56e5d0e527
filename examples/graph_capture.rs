//! CUDA graphs: capture a chain of allreduces on every rank's stream,
//! register the captured buffers (needed by the pull algorithms; push
//! algorithms need nothing), replay, check, and deregister before the
//! buffers are freed.
//!
//!     cargo run --release --example graph_capture
//!
//! Without a GPU it says so and exits cleanly.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaGraph, CudaStream};
use tp_allreduce::{Comm, Config, DeviceBuffer, ReduceOp};

const CALLS: usize = 16;

fn main() -> tp_allreduce::Result<()> {
    // cudarc's CudaContext::new panics without a driver: probe first.
    let gpus = tp_allreduce::raw::device_count();
    if gpus == 0 {
        println!("no CUDA device visible: nothing to run (this example needs a GPU)");
        return Ok(());
    }
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
    let n = 4_096;
    // Input and output of every call: the output of call k is the input of
    // call k + 1, so each replay multiplies by `world` CALLS times.
    let mut chains: Vec<Vec<DeviceBuffer<f32>>> = Vec::new();
    for comm in &comms {
        let chain = (0..=CALLS).map(|_| DeviceBuffer::zeros(&comm.stream(), n)).collect::<Result<_, _>>()?;
        chains.push(chain);
    }
    let mut graphs: Vec<CudaGraph> = Vec::new();
    for (comm, chain) in comms.iter().zip(chains.iter_mut()) {
        graphs.push(capture(comm, chain)?);
    }
    // After capture, on every rank (collective): peers map the inputs.
    let registered = Comm::register_graph_buffers_group(&comms)?;
    for replay in 0..3 {
        for chain in chains.iter_mut() {
            chain[0].copy_from_host(&vec![1.0 / world as f32; n])?;
        }
        for graph in &graphs {
            graph.launch()?;
        }
        for (comm, chain) in comms.iter().zip(&chains) {
            comm.synchronize()?;
            let out = chain[CALLS].to_host()?;
            let expected = (world as f32).powi(CALLS as i32 - 1);
            if out.iter().any(|&v| (v - expected).abs() > 1e-3 * expected) {
                return Err(tp_allreduce::Error::InvalidUsage(format!("rank {}: replay {replay} wrong", comm.rank())));
            }
        }
    }
    // Before the buffers are freed, on every rank.
    Comm::deregister_buffers_group(&comms)?;
    println!("{world} ranks: {CALLS} captured allreduces replayed 3 times, correct ({registered} inputs registered)");
    Ok(())
}

/// The chain of CALLS allreduces, captured on the communicator's stream.
fn capture(comm: &Comm, chain: &mut [DeviceBuffer<f32>]) -> tp_allreduce::Result<CudaGraph> {
    let stream = comm.stream();
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let mut captured = Ok(());
    for k in 0..CALLS {
        let (done, rest) = chain.split_at_mut(k + 1);
        captured = comm.all_reduce(&done[k], &mut rest[0], &ReduceOp::Sum);
        if captured.is_err() {
            break;
        }
    }
    // Always end the capture, also after an error.
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0))?;
    captured?;
    graph.ok_or_else(|| tp_allreduce::Error::InvalidUsage("nothing was captured".into()))
}
