//! `tp-allreduce bench --processes`: one process per rank (started by the
//! launcher), the deployment shape of inference engines. Each rank times its
//! own CUDA-graph replays; per sample the slowest rank's time is the
//! collective's time (all-gathered to rank 0, which verifies, reports and
//! writes the files). NCCL runs per process, so it is captured in graphs too
//! (unlike one thread driving several GPUs).
#![forbid(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::in_process::usable_selections;
use super::progress::Progress;
use super::report::{Report, VerifyPass};
use super::scenarios::{VERIFY_PASS_ALLREDUCES, VERIFY_PASS_BYTES};
use super::stats::{measurement, percentiles, set_speedups, Measurement, RowKey};
use super::timing::{capture, launch, timed};
use super::trace::{summarize, TraceSummary};
use super::{Mode, Options, Scenarios};
use crate::any_buffer::{self, AnyBuffer};
use crate::reference::{check_sum, decode, random_bits};
use crate::table::human_bytes;
use tp_allreduce::comm::Comm;
use tp_allreduce::driver;
use tp_allreduce::error::{driver as driver_error, Error, Result};
use tp_allreduce::nccl::NcclComm;
use tp_allreduce::DType;
use tp_allreduce::RankEnv;

/// Who runs a row on this rank.
#[derive(Clone, Copy)]
enum Runner<'a> {
    Ours(&'a Comm),
    Nccl(&'a NcclComm),
}

impl Runner<'_> {
    /// One allreduce of `input` into `output` on the communicator's stream.
    fn call(&self, comm: &Comm, input: &AnyBuffer, output: &mut AnyBuffer) -> Result<()> {
        match self {
            Runner::Ours(c) => any_buffer::all_reduce(c, input, output),
            Runner::Nccl(n) => any_buffer::nccl_all_reduce(n, input, output, &comm.stream()),
        }
    }
}

/// This rank's buffers of one size and every rank's input values.
struct RankBuffers {
    dtype: DType,
    input: AnyBuffer,
    output: AnyBuffer,
    all_inputs: Vec<Vec<f64>>,
}

fn seed(size_index: usize, rank: usize) -> u64 {
    0x5EED ^ ((size_index as u64) << 20) ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl RankBuffers {
    fn new(comm: &Comm, env: &RankEnv, bytes: usize, dtype: DType, size_index: usize) -> Result<Self> {
        let count = (bytes / dtype.size_bytes()).max(1);
        let (raw, _) = random_bits(dtype, count, seed(size_index, env.rank));
        let all_inputs = (0..env.world_size).map(|r| random_bits(dtype, count, seed(size_index, r)).1).collect();
        let stream = comm.stream();
        let input = AnyBuffer::from_bytes(&stream, dtype, &raw)?;
        let output = AnyBuffer::alloc(&stream, dtype, count)?;
        Ok(RankBuffers { dtype, input, output, all_inputs })
    }

    fn bytes(&self) -> usize {
        self.input.num_bytes()
    }

    /// This rank's output against the f64 sum; the verdict is agreed on by
    /// every rank (so all stop together on a failure).
    fn verify(&self, comm: &Comm, roundings: usize, what: &str) -> Result<()> {
        let got = decode(self.dtype, &self.output.to_host_bytes()?);
        let bad = check_sum(self.dtype, &self.all_inputs, &got, roundings).err();
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

/// What a row's eager call and its graph replays are checked against:
/// (what ran, its roundings) each; `auto` may choose another algorithm
/// for an eager call than for a captured one.
#[derive(Clone, Copy)]
struct RowChecks<'a> {
    eager: (&'a str, usize),
    graph: (&'a str, usize),
}

/// Verifies, then times one row on this rank; returns per-allreduce
/// microseconds per sample (the slowest rank's).
fn time_row(
    comm: &Comm,
    runner: Runner,
    bufs: &mut RankBuffers,
    opts: &Options,
    checks: RowChecks<'_>,
) -> Result<Vec<f64>> {
    bufs.output.fill_bytes(0x7F)?;
    runner.call(comm, &bufs.input, &mut bufs.output)?;
    comm.synchronize()?;
    let (what, roundings) = checks.eager;
    bufs.verify(comm, roundings, &format!("{what}, eager call"))?;
    let samples = match opts.mode {
        Mode::Graph => {
            let graph = capture(comm, || {
                (0..opts.iterations).try_for_each(|_| runner.call(comm, &bufs.input, &mut bufs.output))
            })?;
            comm.register_graph_buffers()?;
            graph.upload().map_err(|e| driver_error("cuGraphUpload", e))?;
            let s = timed(comm, opts.warmup, opts.repeats, || launch(&graph))?;
            let (what, roundings) = checks.graph;
            bufs.verify(comm, roundings, &format!("{what}, after the graph replays"))?;
            // Peers close their mappings of this size's buffers before the
            // buffers are freed (CUDA leaves the other order undefined).
            comm.deregister_buffers()?;
            s
        }
        Mode::Eager => timed(comm, opts.warmup, opts.repeats, || {
            (0..opts.iterations).try_for_each(|_| runner.call(comm, &bufs.input, &mut bufs.output))
        })?,
    };
    Ok(samples.into_iter().map(|us| us / opts.iterations as f64).collect())
}

/// The verify-pass scenario on this rank: 122 x (allreduce 42 KB bf16 +
/// dependent kernel) in one graph.
fn verify_pass(comm: &Comm, runner: Runner, env: &RankEnv, selection: &str) -> Result<VerifyPass> {
    let dtype = DType::Bf16;
    let mut bufs = RankBuffers::new(comm, env, VERIFY_PASS_BYTES, dtype, 999)?;
    let stream = comm.stream();
    let scale = 1.0 / env.world_size as f32;
    let graph = capture(comm, || {
        for _ in 0..VERIFY_PASS_ALLREDUCES {
            runner.call(comm, &bufs.input, &mut bufs.output)?;
            any_buffer::affine(&stream, &bufs.output, &mut bufs.input, scale, 0.0)?;
        }
        Ok(())
    })?;
    comm.register_graph_buffers()?;
    let mut samples = timed(comm, 3, 20, || launch(&graph))?;
    comm.deregister_buffers()?;
    samples.iter_mut().for_each(|s| *s /= 1e3);
    let (median, p10, p90) = percentiles(&mut samples);
    let algorithm = match runner {
        Runner::Nccl(_) => "nccl".to_string(),
        Runner::Ours(c) => c.plan_call(VERIFY_PASS_BYTES, dtype, true, false).algorithm.name().to_string(),
    };
    Ok(VerifyPass {
        selection: selection.into(),
        algorithm,
        allreduces: VERIFY_PASS_ALLREDUCES,
        bytes: VERIFY_PASS_BYTES,
        median_ms: median,
        p10_ms: p10,
        p90_ms: p90,
        per_allreduce_us: median * 1e3 / VERIFY_PASS_ALLREDUCES as f64,
    })
}

/// Every selection's row at one size on this rank, then NCCL's.
fn measure_size(
    comm: &mut Comm,
    env: &RankEnv,
    (opts, selections): (&Options, &[super::Selection]),
    (i, bytes): (usize, usize),
    (progress, trace): (&Progress, &mut Vec<TraceSummary>),
) -> Result<Vec<Measurement>> {
    let world = env.world_size;
    let mut bufs = RankBuffers::new(comm, env, bytes, opts.dtype, i)?;
    let (bytes, dtype) = (bufs.bytes(), bufs.dtype);
    let mut rows = Vec::new();
    for sel in selections {
        comm.set_algorithm(sel.forced())?;
        let eager = comm.plan_call(bytes, dtype, false, false).algorithm;
        let graph = comm.plan_call(bytes, dtype, true, false).algorithm;
        // The timed calls' algorithm.
        let algorithm = if opts.mode == Mode::Graph { graph } else { eager };
        progress.step(&format!("{} {}", human_bytes(bytes), sel.name()));
        let what_eager = format!("{} {} (ran {eager})", human_bytes(bytes), sel.name());
        let what_graph = format!("{} {} (ran {graph})", human_bytes(bytes), sel.name());
        let checks = RowChecks {
            eager: (what_eager.as_str(), eager.max_roundings(world)),
            graph: (what_graph.as_str(), graph.max_roundings(world)),
        };
        let mut samples = time_row(comm, Runner::Ours(comm), &mut bufs, opts, checks)?;
        let key = RowKey { bytes, dtype, selection: &sel.name(), ran: algorithm.name(), world, mode: opts.mode };
        rows.push(measurement(key, &mut samples));
        if let Some(records) = comm.take_trace_records()? {
            trace.extend(summarize(&records, bytes, &sel.name(), env.rank));
        }
    }
    comm.set_algorithm(None)?;
    if let Some(nccl) = comm.nccl().filter(|_| opts.include_nccl) {
        progress.step(&format!("{} nccl", human_bytes(bytes)));
        let what = format!("{} nccl", human_bytes(bytes));
        let check = (what.as_str(), world);
        let checks = RowChecks { eager: check, graph: check };
        let mut samples = time_row(comm, Runner::Nccl(nccl), &mut bufs, opts, checks)?;
        let key = RowKey { bytes, dtype, selection: "nccl", ran: "nccl", world, mode: opts.mode };
        let nccl_row = measurement(key, &mut samples);
        set_speedups(&mut rows, &nccl_row);
        rows.push(nccl_row);
    }
    Ok(rows)
}

/// One rank of `bench --processes`; rank 0 returns the report.
pub fn run_rank(env: &RankEnv, opts: &Options, scenarios: &Scenarios, command_line: &str) -> Result<Option<Report>> {
    driver::require_driver()?;
    let ctx: Arc<CudaContext> =
        CudaContext::new(env.device).map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
    let stream = ctx.new_stream().map_err(|e| driver_error("cuStreamCreate", e))?;
    let mut comm = env.comm(stream, opts.config.clone())?;
    let mut notes: Vec<String> = comm.notes().to_vec();
    notes.push(format!("one process per rank; auto selects (graph): {}", comm.selection().describe(opts.dtype, true)));
    let with_nccl = opts.include_nccl && comm.nccl().is_some();
    if opts.include_nccl && !with_nccl {
        notes.push("NCCL column absent: no NCCL communicator (libnccl not found, or ranks share a GPU)".into());
    }
    let selections = usable_selections(&mut comm, &opts.selections, &mut notes);
    let steps = opts.sizes.len() * (selections.len() + with_nccl as usize);
    let progress = if env.rank == 0 { Progress::new(steps) } else { Progress::hidden(steps) };
    let mut measurements = Vec::new();
    let mut trace = Vec::new();
    for (i, &bytes) in opts.sizes.iter().enumerate() {
        let row = measure_size(&mut comm, env, (opts, &selections), (i, bytes), (&progress, &mut trace))?;
        measurements.extend(row);
    }
    progress.finish();
    let mut verify = Vec::new();
    if scenarios.verify_pass {
        verify.push(verify_pass(&comm, Runner::Ours(&comm), env, "auto")?);
        // `--trace`: the verify pass's launches (the gap then spans the
        // dependent kernel between two allreduces).
        if let Some(records) = comm.take_trace_records()? {
            trace.extend(summarize(&records, VERIFY_PASS_BYTES, "verify-pass", env.rank));
        }
        if let Some(n) = comm.nccl().filter(|_| opts.include_nccl) {
            verify.push(verify_pass(&comm, Runner::Nccl(n), env, "nccl")?);
        }
    }
    let mut fused = Vec::new();
    if let Some(shape) = scenarios.fused {
        let forced = super::fused_forced(&selections);
        comm.set_algorithm(forced)?;
        match forced {
            Some(a) => notes.push(format!("fused scenario forced to {a} (--algorithms)")),
            None => {
                notes.push(format!("fused calls select (graph): {}", comm.fused_selection().describe(opts.dtype, true)))
            }
        }
        let f = super::fused_epilogue_runs::per_rank(&comm, env, opts, shape, scenarios.verify_pass)?;
        comm.set_algorithm(None)?;
        fused = f.rows;
        verify.extend(f.verify_pass);
        trace.extend(f.trace);
    }
    // Every rank's trace, to rank 0 (a collective even when tracing is off).
    let encoded = serde_json::to_vec(&trace).map_err(|e| Error::Config(format!("encoding the trace: {e}")))?;
    let mut trace: Vec<TraceSummary> = Vec::new();
    for (r, bytes) in comm.all_gather_bytes(&encoded)?.iter().enumerate() {
        let mine: Vec<TraceSummary> = serde_json::from_slice(bytes)
            .map_err(|e| Error::Config(format!("rank {r} sent an undecodable trace: {e}")))?;
        trace.extend(mine);
    }
    trace.sort_by(|a, b| (a.bytes, &a.selection, a.rank).cmp(&(b.bytes, &b.selection, b.rank)));
    if env.rank != 0 {
        return Ok(None);
    }
    Ok(Some(Report {
        topology_fingerprint: comm.topology().fingerprint(),
        world: env.world_size,
        ranks_per_gpu: comm.ranks_on_device(),
        mode: opts.mode.name().into(),
        iterations: opts.iterations,
        repeats: opts.repeats,
        notes,
        measurements,
        verify_pass: verify,
        trace,
        fused,
        ..Report::for_run("tp-allreduce bench --processes", command_line, &ctx)
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
