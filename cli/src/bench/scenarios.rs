//! The scenarios beyond the size sweep: the verify pass (the motivating
//! workload), the launch floor, and the single-GPU large-message
//! efficiency against the measured copy bandwidth.
#![forbid(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::collective::{our_group, CommGroup, OurGroup};
use super::progress::Progress;
use super::ranks::{Buffers, Ranks};
use super::report::{Efficiency, VerifyPass};
use super::stats::percentiles;
use super::timing::{capture_per_rank, elapsed_us, event, record, sync_all, time_collective, time_graph_replays};
use super::{Mode, Options};
use crate::any_buffer;
use tp_allreduce::algorithm::{single_gpu_traffic_bytes, Algorithm};
use tp_allreduce::buffer::DeviceBuffer;
use tp_allreduce::comm::Config;
use tp_allreduce::driver::elementwise;
use tp_allreduce::error::{driver as driver_error, Result};
use tp_allreduce::DType;

/// Allreduces of the verify pass: a 61-layer model, two per layer.
pub const VERIFY_PASS_ALLREDUCES: usize = 122;
/// Bytes of each: 3 tokens x hidden 7168 x bf16 (42 KiB).
pub const VERIFY_PASS_BYTES: usize = 43_008;

/// The motivating workload: 122 allreduces of 42 KB bf16, each followed by
/// a small dependent elementwise kernel, captured into one graph per rank.
pub fn verify_pass(c: &dyn CommGroup, ranks: &Ranks, selection: &str) -> Result<VerifyPass> {
    let dtype = DType::Bf16;
    let world = c.world();
    let mut bufs = Buffers::new(ranks, VERIFY_PASS_BYTES, dtype, 0xF00D)?;
    // Correctness of one call first.
    bufs.poison()?;
    c.issue_all(&mut bufs)?;
    sync_all(c, ranks)?;
    let op = tp_allreduce::Collective::AllReduce;
    let eager = c.describe(op, VERIFY_PASS_BYTES, dtype, false);
    bufs.verify(c.roundings(op, VERIFY_PASS_BYTES, dtype, false), &format!("verify pass ({eager}, eager call)"))?;
    let graphs = capture_per_rank(ranks, |r, s| {
        for _ in 0..VERIFY_PASS_ALLREDUCES {
            // in -> out (allreduce), out -> in (dependent layer: x/world).
            c.run(bufs.collective, r, &bufs.inputs[r], &mut bufs.outputs[r])?;
            any_buffer::affine(s, &bufs.outputs[r], &mut bufs.inputs[r], 1.0 / world as f32, 0.0)?;
        }
        Ok(())
    })?;
    c.after_capture()?;
    let mut samples: Vec<f64> =
        time_graph_replays(&graphs, ranks, 3, 20, || sync_all(c, ranks))?.into_iter().map(|us| us / 1e3).collect();
    c.release_buffers()?;
    let (median, p10, p90) = percentiles(&mut samples);
    Ok(VerifyPass {
        selection: selection.into(),
        algorithm: c.describe(op, VERIFY_PASS_BYTES, dtype, true),
        allreduces: VERIFY_PASS_ALLREDUCES,
        bytes: VERIFY_PASS_BYTES,
        median_ms: median,
        p10_ms: p10,
        p90_ms: p90,
        per_allreduce_us: median * 1e3 / VERIFY_PASS_ALLREDUCES as f64,
    })
}

/// Per-step time of graphs of tiny dependent kernels replayed on every
/// rank's stream at once: the floor any one-kernel allreduce sits on when
/// these ranks share the GPU(s).
pub fn launch_floor(ranks: &Ranks) -> Result<f64> {
    const STEPS: usize = 200;
    let mut bufs: Vec<DeviceBuffer<f32>> =
        ranks.streams.iter().map(|s| DeviceBuffer::zeros(s, 16)).collect::<Result<_>>()?;
    let graphs = capture_per_rank(ranks, |r, s| {
        (0..STEPS).try_for_each(|_| elementwise::affine_in_place(s, &mut bufs[r], 1.0, 0.0))
    })?;
    let sync = || ranks.streams.iter().try_for_each(|s| tp_allreduce::driver::synchronize(s));
    let mut samples: Vec<f64> =
        time_graph_replays(&graphs, ranks, 3, 10, sync)?.into_iter().map(|us| us / STEPS as f64).collect();
    Ok(percentiles(&mut samples).0)
}

/// 2 ranks on the first GPU, 64 MiB f32: device-memory traffic per second
/// as a fraction of the device-to-device copy bandwidth measured now.
pub fn large_message_efficiency(gpus: &[usize], config: &Config, progress: &Progress) -> Result<Vec<Efficiency>> {
    let bytes = 64 << 20;
    let ranks = Ranks::new(&gpus[..1], 2)?;
    progress.step("copy bandwidth");
    let copy = copy_bandwidth_gbs(&ranks.contexts[0], 1 << 30)?;
    let cfg = Config { pull_max_blocks: 128, max_chunk_bytes: 64 << 20, ..config.clone() };
    let mut comms = our_group(&ranks, &cfg)?;
    let mut bufs = Buffers::new(&ranks, bytes, DType::F32, 0xB16)?;
    let opts = Options { iterations: 5, repeats: 10, warmup: 2, mode: Mode::Graph, ..Options::default() };
    let mut out = Vec::new();
    for algorithm in [Algorithm::OneShotPull, Algorithm::TwoShotPull] {
        progress.step(&format!("64 MB {algorithm}"));
        for c in comms.iter_mut() {
            c.set_algorithm(Some(algorithm))?;
        }
        let mut samples = time_collective(&OurGroup { comms: &comms }, &ranks, &mut bufs, &opts)?;
        let (median, _, _) = percentiles(&mut samples);
        let traffic = single_gpu_traffic_bytes(algorithm, 2, bytes);
        let achieved = traffic / (median * 1e-6) / 1e9;
        out.push(Efficiency {
            algorithm: algorithm.name().into(),
            world: 2,
            bytes,
            median_us: median,
            traffic_bytes: traffic,
            achieved_gbs: achieved,
            copy_gbs: copy,
            fraction_of_copy: achieved / copy,
        });
    }
    Ok(out)
}

/// Device-to-device copy bandwidth of GPU `ctx`, counting bytes read plus
/// bytes written (GB/s), from a timed `cuMemcpyDtoDAsync` of `bytes`.
pub fn copy_bandwidth_gbs(ctx: &Arc<CudaContext>, bytes: usize) -> Result<f64> {
    let stream = ctx.new_stream().map_err(|e| driver_error("cuStreamCreate", e))?;
    let a = DeviceBuffer::<u8>::zeros(&stream, bytes)?;
    let mut b = DeviceBuffer::<u8>::zeros(&stream, bytes)?;
    let (start, end) = (event(ctx)?, event(ctx)?);
    let mut samples = Vec::new();
    for i in 0..12 {
        record(&start, &stream)?;
        stream.memcpy_dtod(&a, &mut b).map_err(|e| driver_error("cuMemcpyDtoDAsync", e))?;
        record(&end, &stream)?;
        let micros = elapsed_us(&start, &end)?;
        if i >= 2 {
            samples.push(2.0 * bytes as f64 / (micros * 1e-6) / 1e9);
        }
    }
    Ok(percentiles(&mut samples).0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_traffic_of_the_measured_pull_algorithms() {
        let s = 64.0 * 1024.0 * 1024.0;
        // 2 ranks one-shot pull: each reads 2 inputs and writes 1 output.
        assert_eq!(single_gpu_traffic_bytes(Algorithm::OneShotPull, 2, 64 << 20), 6.0 * s);
        // 2 ranks two-shot pull: each 3 S + S/2.
        assert_eq!(single_gpu_traffic_bytes(Algorithm::TwoShotPull, 2, 64 << 20), 7.0 * s);
        // One-shot push moves more than one-shot pull at every world size.
        for n in 2..=8 {
            assert!(
                single_gpu_traffic_bytes(Algorithm::OneShotPush, n, 1024)
                    > single_gpu_traffic_bytes(Algorithm::OneShotPull, n, 1024)
            );
        }
    }

    #[test]
    fn the_verify_pass_is_the_42_kib_message_122_times() {
        assert_eq!(VERIFY_PASS_BYTES, 42 * 1024);
        assert_eq!(VERIFY_PASS_BYTES, 3 * 7168 * 2);
        assert_eq!(VERIFY_PASS_ALLREDUCES, 2 * 61);
    }
}
