//! `tp-allreduce bench --processes`: one process per rank (started by the
//! launcher), the deployment shape of inference engines. Each rank times its
//! own CUDA-graph replays; per sample the slowest rank's time is the
//! collective's time (all-gathered to rank 0, which verifies, reports and
//! writes the files). NCCL runs per process, so it is captured in graphs too
//! (unlike one thread driving several GPUs).

use cudarc::driver::{sys, CudaContext, CudaEvent};

use super::report::{self, Report};
use super::{decode, measurement, percentiles, random_bits, unit_roundoff, Mode, Options, Scenarios, Selection};
use crate::algorithm::Algorithm;
use crate::comm::Comm;
use crate::driver::{self, DeviceMemory};
use crate::error::{Error, Result};
use crate::nccl::NcclComm;
use crate::DType;
use crate::RankEnv;

/// Who runs a row on this rank.
#[derive(Clone, Copy)]
enum Runner<'a> {
    Ours(&'a Comm),
    Nccl(&'a NcclComm),
}

impl Runner<'_> {
    /// # Safety
    /// Device buffers of `count` elements of `dtype` on this rank's context.
    unsafe fn call(&self, send: u64, recv: u64, count: usize, dtype: DType, stream: sys::CUstream) -> Result<()> {
        match self {
            Runner::Ours(c) => c.all_reduce_raw(send, recv, count, dtype, stream),
            Runner::Nccl(n) => n.all_reduce(send, recv, count, dtype, stream),
        }
    }
}

/// This rank's buffers of one size and every rank's input values.
struct RankBuffers {
    count: usize,
    dtype: DType,
    input: DeviceMemory,
    output: DeviceMemory,
    all_inputs: Vec<Vec<f64>>,
}

fn seed(size_index: usize, rank: usize) -> u64 {
    0x5EED ^ ((size_index as u64) << 20) ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl RankBuffers {
    fn new(
        ctx: &std::sync::Arc<CudaContext>,
        env: &RankEnv,
        bytes: usize,
        dtype: DType,
        size_index: usize,
    ) -> Result<Self> {
        let count = (bytes / dtype.size_bytes()).max(1);
        let (raw, _) = random_bits(dtype, count, seed(size_index, env.rank));
        let all_inputs = (0..env.world_size).map(|r| random_bits(dtype, count, seed(size_index, r)).1).collect();
        let input = DeviceMemory::alloc(ctx, raw.len())?;
        driver::memcpy_htod(input.ptr(), &raw)?;
        let output = DeviceMemory::alloc(ctx, raw.len())?;
        Ok(RankBuffers { count, dtype, input, output, all_inputs })
    }

    fn bytes(&self) -> usize {
        self.count * self.dtype.size_bytes()
    }

    /// This rank's output against the f64 sum; the verdict is agreed on by
    /// every rank (so all stop together on a failure).
    fn verify(&self, comm: &Comm, roundings: usize, what: &str) -> Result<()> {
        let mut raw = vec![0u8; self.bytes()];
        driver::memcpy_dtoh(&mut raw, self.output.ptr())?;
        let got = decode(self.dtype, &raw);
        let u = unit_roundoff(self.dtype);
        let mut bad: Option<String> = None;
        for (i, g) in got.iter().enumerate() {
            let (mut exact, mut mag) = (0.0, 0.0);
            for x in &self.all_inputs {
                exact += x[i];
                mag += x[i].abs();
            }
            let tol = roundings as f64 * u * mag * 1.001 + self.all_inputs.len() as f64 * 6e-8 * mag + 1e-30;
            if (g - exact).abs().is_nan() || (g - exact).abs() > tol {
                bad = Some(format!("element {i} is {g} but the sum is {exact}"));
                break;
            }
        }
        let verdicts = comm.all_gather_bytes(bad.as_deref().unwrap_or("").as_bytes())?;
        if let Some((r, why)) = verdicts.iter().enumerate().find(|(_, v)| !v.is_empty()) {
            return Err(Error::InvalidUsage(format!(
                "benchmark correctness check failed for {what}: rank {r}: {}",
                String::from_utf8_lossy(why)
            )));
        }
        Ok(())
    }
}

fn event(ctx: &std::sync::Arc<CudaContext>) -> Result<CudaEvent> {
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| crate::error::driver("cuEventCreate", e))
}

/// Times `warmup + repeats` calls of `launch` on this rank, each aligned by
/// a rendezvous barrier; returns the slowest rank's time per sample (us).
fn timed(
    comm: &Comm,
    ctx: &std::sync::Arc<CudaContext>,
    warmup: usize,
    repeats: usize,
    mut launch: impl FnMut() -> Result<()>,
) -> Result<Vec<f64>> {
    let stream = comm.stream();
    let (start, end) = (event(ctx)?, event(ctx)?);
    let mut mine = Vec::with_capacity(repeats);
    for i in 0..warmup + repeats {
        comm.all_gather_bytes(&[])?;
        start.record(&stream).map_err(|e| crate::error::driver("cuEventRecord", e))?;
        launch()?;
        end.record(&stream).map_err(|e| crate::error::driver("cuEventRecord", e))?;
        comm.synchronize()?;
        if i >= warmup {
            mine.push(start.elapsed_ms(&end).map_err(|e| crate::error::driver("cuEventElapsedTime", e))? as f64 * 1e3);
        }
    }
    let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
    let all = comm.all_gather_bytes(&bytes)?;
    let mut worst = vec![0f64; repeats];
    for rank_samples in &all {
        for (k, chunk) in rank_samples.chunks_exact(8).enumerate().take(repeats) {
            let v = f64::from_le_bytes(chunk.try_into().expect("8 bytes"));
            worst[k] = worst[k].max(v);
        }
    }
    Ok(worst)
}

/// Verifies, then times one row on this rank; returns per-allreduce
/// microseconds per sample (the slowest rank's).
fn time_row(
    comm: &Comm,
    ctx: &std::sync::Arc<CudaContext>,
    runner: Runner,
    bufs: &RankBuffers,
    opts: &Options,
    what: &str,
    roundings: usize,
) -> Result<Vec<f64>> {
    let stream = comm.stream();
    let cu = stream.cu_stream();
    driver::memset_d8(bufs.output.ptr(), 0x7F, bufs.bytes())?;
    // SAFETY: this rank's buffers hold `count` elements.
    unsafe { runner.call(bufs.input.ptr(), bufs.output.ptr(), bufs.count, bufs.dtype, cu)? };
    comm.synchronize()?;
    bufs.verify(comm, roundings, &format!("{what}, eager call"))?;
    let samples = match opts.mode {
        Mode::Graph => {
            let graph =
                driver::capture(&stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, || {
                    for _ in 0..opts.iterations {
                        // SAFETY: as above.
                        unsafe { runner.call(bufs.input.ptr(), bufs.output.ptr(), bufs.count, bufs.dtype, cu)? };
                    }
                    Ok(())
                })?;
            comm.register_graph_buffers()?;
            graph.upload().map_err(|e| crate::error::driver("cuGraphUpload", e))?;
            let s = timed(comm, ctx, opts.warmup, opts.repeats, || {
                graph.launch().map_err(|e| crate::error::driver("cuGraphLaunch", e))
            })?;
            bufs.verify(comm, roundings, &format!("{what}, after the graph replays"))?;
            // Peers close their mappings of this size's buffers before the
            // buffers are freed (CUDA leaves the other order undefined).
            comm.deregister_buffers()?;
            s
        }
        Mode::Eager => timed(comm, ctx, opts.warmup, opts.repeats, || {
            for _ in 0..opts.iterations {
                // SAFETY: as above.
                unsafe { runner.call(bufs.input.ptr(), bufs.output.ptr(), bufs.count, bufs.dtype, cu)? };
            }
            Ok(())
        })?,
    };
    Ok(samples.into_iter().map(|us| us / opts.iterations as f64).collect())
}

/// The verify-pass scenario on this rank: 122 x (allreduce 42 KB bf16 +
/// dependent kernel) in one graph.
fn verify_pass(
    comm: &Comm,
    ctx: &std::sync::Arc<CudaContext>,
    runner: Runner,
    env: &RankEnv,
    selection: &str,
) -> Result<report::VerifyPass> {
    const ALLREDUCES: usize = 122;
    const BYTES: usize = 43_008;
    let dtype = DType::Bf16;
    let bufs = RankBuffers::new(ctx, env, BYTES, dtype, 999)?;
    let stream = comm.stream();
    let cu = stream.cu_stream();
    let graph = driver::capture(&stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, || {
        for _ in 0..ALLREDUCES {
            // SAFETY: both buffers hold `count` bf16 on this rank's context.
            unsafe {
                runner.call(bufs.input.ptr(), bufs.output.ptr(), bufs.count, dtype, cu)?;
                crate::tools::elementwise::affine_raw(
                    ctx,
                    cu,
                    bufs.output.ptr(),
                    bufs.input.ptr(),
                    bufs.count,
                    dtype,
                    1.0 / env.world_size as f32,
                    0.0,
                )?;
            }
        }
        Ok(())
    })?;
    comm.register_graph_buffers()?;
    let mut samples = timed(comm, ctx, 3, 20, || graph.launch().map_err(|e| crate::error::driver("cuGraphLaunch", e)))?;
    comm.deregister_buffers()?;
    for s in samples.iter_mut() {
        *s /= 1e3;
    }
    let (median, p10, p90) = percentiles(&mut samples);
    let algorithm = match runner {
        Runner::Nccl(_) => "nccl".to_string(),
        Runner::Ours(c) => c.plan_call(BYTES, dtype, true, false).algorithm.name().to_string(),
    };
    Ok(report::VerifyPass {
        selection: selection.into(),
        algorithm,
        allreduces: ALLREDUCES,
        bytes: BYTES,
        median_ms: median,
        p10_ms: p10,
        p90_ms: p90,
        per_allreduce_us: median * 1e3 / ALLREDUCES as f64,
    })
}

/// One rank of `bench --processes`; rank 0 returns the report.
pub fn run_rank(env: &RankEnv, opts: &Options, scenarios: &Scenarios, command_line: &str) -> Result<Option<Report>> {
    driver::require_driver()?;
    let ctx = CudaContext::new(env.device).map_err(|e| crate::error::driver("cuDevicePrimaryCtxRetain", e))?;
    // SAFETY: all work here is ordered explicitly on one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(|e| crate::error::driver("cuStreamCreate", e))?;
    let mut comm = env.comm(stream, opts.config.clone())?;
    let world = env.world_size;
    let mut notes: Vec<String> = comm.notes().to_vec();
    notes.push(format!("one process per rank; auto selects (graph): {}", comm.selection().describe(opts.dtype, true)));
    let with_nccl = opts.include_nccl && comm.nccl().is_some();
    if opts.include_nccl && !with_nccl {
        notes.push("NCCL column absent: no NCCL communicator (libnccl not found, or ranks share a GPU)".into());
    }
    let mut selections = Vec::new();
    for sel in &opts.selections {
        match sel {
            Selection::Forced(a) if *a == Algorithm::Nccl => {}
            Selection::Forced(a) => match comm.set_algorithm(Some(*a)) {
                Ok(()) => selections.push(*sel),
                Err(e) => notes.push(format!("{a} skipped: {e}")),
            },
            Selection::Auto => selections.push(*sel),
        }
    }
    let mut measurements = Vec::new();
    for (i, &bytes) in opts.sizes.iter().enumerate() {
        let bufs = RankBuffers::new(&ctx, env, bytes, opts.dtype, i)?;
        let mut rows = Vec::new();
        for sel in &selections {
            comm.set_algorithm(match sel {
                Selection::Auto => None,
                Selection::Forced(a) => Some(*a),
            })?;
            let algorithm = comm.plan_call(bufs.bytes(), opts.dtype, true, false).algorithm;
            if env.rank == 0 {
                eprintln!("[{}/{}] {} {}", i + 1, opts.sizes.len(), report::human_bytes(bytes), sel.name());
            }
            let what = format!("{} {} (ran {algorithm})", report::human_bytes(bytes), sel.name());
            let mut samples =
                time_row(&comm, &ctx, Runner::Ours(&comm), &bufs, opts, &what, algorithm.max_roundings(world))?;
            rows.push(measurement(
                (bufs.bytes(), bufs.dtype),
                &sel.name(),
                algorithm.name(),
                world,
                opts,
                &mut samples,
            ));
        }
        comm.set_algorithm(None)?;
        if with_nccl {
            let nccl = comm.nccl().expect("checked above");
            let what = format!("{} nccl", report::human_bytes(bytes));
            let mut samples = time_row(&comm, &ctx, Runner::Nccl(nccl), &bufs, opts, &what, world)?;
            let nccl_row = measurement((bufs.bytes(), bufs.dtype), "nccl", "nccl", world, opts, &mut samples);
            for r in rows.iter_mut() {
                r.speedup_vs_nccl = Some(nccl_row.median_us / r.median_us);
            }
            rows.push(nccl_row);
        }
        measurements.extend(rows);
    }
    let mut verify = Vec::new();
    if scenarios.verify_pass {
        verify.push(verify_pass(&comm, &ctx, Runner::Ours(&comm), env, "auto")?);
        if let Some(n) = comm.nccl() {
            verify.push(verify_pass(&comm, &ctx, Runner::Nccl(n), env, "nccl")?);
        }
    }
    if env.rank != 0 {
        return Ok(None);
    }
    Ok(Some(Report {
        tool: "tp-allreduce bench --processes".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        command_line: command_line.into(),
        date_utc: super::utc_now(),
        gpu_model: ctx.name().unwrap_or_else(|_| "unknown GPU".into()),
        driver: super::driver_version(),
        nccl: crate::nccl::version(),
        topology_fingerprint: comm.topology().fingerprint(),
        world,
        ranks_per_gpu: comm.ranks_on_device(),
        mode: format!("{:?}", opts.mode).to_lowercase(),
        iterations: opts.iterations,
        repeats: opts.repeats,
        notes,
        measurements,
        verify_pass: verify,
        efficiency: Vec::new(),
        launch_floor_us: None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stale data from the previous size must not pass for fresh data: the
    /// first value of each rank's input changes from one size to the next
    /// (a weak seed mix once left it equal across 8 consecutive sizes).
    #[test]
    fn first_input_value_changes_between_sizes() {
        let first = |size_index, rank| random_bits(DType::Bf16, 1, seed(size_index, rank)).1[0];
        let mut same = Vec::new();
        for rank in 0..8 {
            for size_index in 1..18 {
                if first(size_index, rank) == first(size_index - 1, rank) {
                    same.push((size_index, rank));
                }
            }
        }
        assert!(same.len() <= 2, "first input value unchanged from the previous size at (size index, rank) {same:?}");
    }
}
