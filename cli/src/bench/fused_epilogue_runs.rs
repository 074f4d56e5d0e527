//! `bench --fused` runs (the variants and data are in `fused_epilogue.rs`): in one
//! process (every rank a stream; NCCL from one thread over several GPUs
//! cannot be captured per rank, so `nccl+separate` is left to
//! `--processes`), and one rank of `--processes` (every variant, NCCL
//! captured too). Each variant: checked after one call, then timed (graph
//! replay of `iterations` dependent calls, or eager), then its verify pass
//! (122 x (epilogue + dependent kernel) in one graph) when asked for.
#![forbid(unsafe_code)]

use super::fused_epilogue::{check, describe, issue, row, EpilogueBuffers, EpilogueData, FusedRow, Variant};
use super::progress::Progress;
use super::ranks::Ranks;
use super::report::VerifyPass;
use super::scenarios::VERIFY_PASS_ALLREDUCES;
use super::stats::percentiles;
use super::timing::{capture, timed};
use super::timing::{capture_per_rank, elapsed_us, event, launch, record, time_graph_replays};
use super::trace::{summarize, TraceSummary};
use super::{Mode, Options};
use crate::any_buffer;
use tp_allreduce::comm::Comm;
use tp_allreduce::driver;
use tp_allreduce::error::{driver as driver_error, Error, Result};
use tp_allreduce::RankEnv;

/// Seed of the scenario's data (the same on every rank).
const SEED: u64 = 0xF0_5ED;

/// What the fused scenario produced.
#[derive(Default)]
pub struct FusedResults {
    pub rows: Vec<FusedRow>,
    pub verify_pass: Vec<VerifyPass>,
    /// `--trace`: this rank's breakdown of each variant whose kernel stamps
    /// (the fused OneShotPush; selection `fused:<variant>`).
    pub trace: Vec<TraceSummary>,
}

/// The verify-pass record of `v` from per-pass samples (ms).
fn verify_record(v: Variant, ran: String, data: &EpilogueData, samples: &mut [f64]) -> VerifyPass {
    let (median, p10, p90) = percentiles(samples);
    VerifyPass {
        selection: v.name().into(),
        algorithm: ran,
        allreduces: VERIFY_PASS_ALLREDUCES,
        bytes: data.bytes(),
        median_ms: median,
        p10_ms: p10,
        p90_ms: p90,
        per_allreduce_us: median * 1e3 / VERIFY_PASS_ALLREDUCES as f64,
    }
}

/// `--trace`: rank `rank`'s breakdown of the launches `comm` stamped
/// while `v` ran (none without tracing), labelled `fused:<variant>`.
fn trace_of(v: Variant, comm: &Comm, data: &EpilogueData, rank: usize) -> Result<Option<TraceSummary>> {
    let records = comm.take_trace_records()?;
    Ok(records.and_then(|r| summarize(&r, data.bytes(), &format!("fused:{}", v.name()), rank)))
}

// ---------------------------------------------------------------- in one process

/// Every rank's stream, then every communicator's error record.
fn sync_in_process(comms: &[Comm]) -> Result<()> {
    comms.iter().try_for_each(|c| c.synchronize())
}

/// The fused scenario with in-process ranks (`comms` over `ranks`).
pub fn in_process(
    ranks: &Ranks,
    comms: &[Comm],
    opts: &Options,
    shape: (usize, usize),
    verify_pass: bool,
    progress: &Progress,
) -> Result<FusedResults> {
    let world = comms.len();
    let data = EpilogueData::new(world, shape, opts.dtype, SEED);
    let mut bufs: Vec<EpilogueBuffers> =
        ranks.streams.iter().enumerate().map(|(r, s)| EpilogueBuffers::new(s, &data, r)).collect::<Result<_>>()?;
    let mut out = FusedResults::default();
    for v in [Variant::Fused, Variant::OursSeparate, Variant::AllReduce] {
        progress.step(&format!("fused scenario: {}", v.name()));
        let ran = describe(v, &comms[0], data.rows, data.hidden, data.dtype);
        for (r, (c, b)) in comms.iter().zip(bufs.iter_mut()).enumerate() {
            b.reset(&data, r)?;
            issue(v, c, None, b)?;
        }
        sync_in_process(comms)?;
        for (r, (c, b)) in comms.iter().zip(&bufs).enumerate() {
            check(v, c, b, &data, r)?;
        }
        let mut samples = match opts.mode {
            Mode::Graph => {
                let graphs = capture_per_rank(ranks, |r, _| {
                    (0..opts.iterations).try_for_each(|_| issue(v, &comms[r], None, &mut bufs[r]))
                })?;
                Comm::register_graph_buffers_group(comms)?;
                let s = time_graph_replays(&graphs, ranks, opts.warmup, opts.repeats, || sync_in_process(comms))?;
                Comm::deregister_buffers_group(comms)?;
                s
            }
            Mode::Eager => eager_in_process(v, comms, ranks, &mut bufs, opts)?,
        };
        samples.iter_mut().for_each(|s| *s /= opts.iterations as f64);
        out.rows.push(row(v, ran.clone(), &data, world, opts.mode.name(), &mut samples));
        for (r, c) in comms.iter().enumerate() {
            out.trace.extend(trace_of(v, c, &data, r)?);
        }
        if verify_pass && v != Variant::AllReduce {
            progress.step(&format!("verify pass ({})", v.name()));
            let graphs = capture_per_rank(ranks, |r, s| {
                for _ in 0..VERIFY_PASS_ALLREDUCES {
                    issue(v, &comms[r], None, &mut bufs[r])?;
                    let b = &mut bufs[r];
                    any_buffer::affine(s, &b.normed, &mut b.input, 1.0 / world as f32, 0.0)?;
                }
                Ok(())
            })?;
            Comm::register_graph_buffers_group(comms)?;
            let mut samples: Vec<f64> = time_graph_replays(&graphs, ranks, 3, 20, || sync_in_process(comms))?
                .into_iter()
                .map(|us| us / 1e3)
                .collect();
            Comm::deregister_buffers_group(comms)?;
            out.verify_pass.push(verify_record(v, ran, &data, &mut samples));
        }
    }
    Ok(out)
}

/// `iterations` eager calls on every rank per sample; the slowest rank's span.
fn eager_in_process(
    v: Variant,
    comms: &[Comm],
    ranks: &Ranks,
    bufs: &mut [EpilogueBuffers],
    opts: &Options,
) -> Result<Vec<f64>> {
    let starts = ranks.contexts.iter().map(event).collect::<Result<Vec<_>>>()?;
    let ends = ranks.contexts.iter().map(event).collect::<Result<Vec<_>>>()?;
    let mut samples = Vec::with_capacity(opts.repeats);
    for i in 0..opts.warmup + opts.repeats {
        for (start, s) in starts.iter().zip(&ranks.streams) {
            record(start, s)?;
        }
        for _ in 0..opts.iterations {
            for (c, b) in comms.iter().zip(bufs.iter_mut()) {
                issue(v, c, None, b)?;
            }
        }
        for (end, s) in ends.iter().zip(&ranks.streams) {
            record(end, s)?;
        }
        sync_in_process(comms)?;
        if i >= opts.warmup {
            let mut worst = 0f64;
            for (s, e) in starts.iter().zip(&ends) {
                worst = worst.max(elapsed_us(s, e)?);
            }
            samples.push(worst);
        }
    }
    Ok(samples)
}

// ---------------------------------------------------------------- one process per rank

/// This rank's check of `v`, agreed on by every rank (all stop together).
fn agreed_check(v: Variant, comm: &Comm, b: &mut EpilogueBuffers, data: &EpilogueData, rank: usize) -> Result<()> {
    b.reset(data, rank)?;
    issue(v, comm, comm.nccl(), b)?;
    comm.synchronize()?;
    let mine = check(v, comm, b, data, rank).err().map(|e| e.to_string()).unwrap_or_default();
    let verdicts = comm.all_gather_bytes(mine.as_bytes())?;
    match verdicts.iter().find(|v| !v.is_empty()) {
        Some(why) => Err(Error::InvalidUsage(String::from_utf8_lossy(why).into_owned())),
        None => Ok(()),
    }
}

/// The fused scenario on this rank of `bench --processes` (collective:
/// every rank runs it; rank 0 reports).
pub fn per_rank(
    comm: &Comm,
    env: &RankEnv,
    opts: &Options,
    shape: (usize, usize),
    verify_pass: bool,
) -> Result<FusedResults> {
    let world = env.world_size;
    let data = EpilogueData::new(world, shape, opts.dtype, SEED);
    let mut b = EpilogueBuffers::new(&comm.stream(), &data, env.rank)?;
    let with_nccl = opts.include_nccl && comm.nccl().is_some();
    let mut out = FusedResults::default();
    for v in Variant::ALL.into_iter().filter(|v| with_nccl || !v.needs_nccl()) {
        let ran = describe(v, comm, data.rows, data.hidden, data.dtype);
        agreed_check(v, comm, &mut b, &data, env.rank)?;
        let mut samples = match opts.mode {
            Mode::Graph => {
                let graph =
                    capture(comm, || (0..opts.iterations).try_for_each(|_| issue(v, comm, comm.nccl(), &mut b)))?;
                comm.register_graph_buffers()?;
                graph.upload().map_err(|e| driver_error("cuGraphUpload", e))?;
                let s = timed(comm, opts.warmup, opts.repeats, || launch(&graph))?;
                comm.deregister_buffers()?;
                s
            }
            Mode::Eager => timed(comm, opts.warmup, opts.repeats, || {
                (0..opts.iterations).try_for_each(|_| issue(v, comm, comm.nccl(), &mut b))
            })?,
        };
        samples.iter_mut().for_each(|s| *s /= opts.iterations as f64);
        out.rows.push(row(v, ran.clone(), &data, world, opts.mode.name(), &mut samples));
        out.trace.extend(trace_of(v, comm, &data, env.rank)?);
        if verify_pass && v != Variant::AllReduce {
            let stream = comm.stream();
            let graph = capture(comm, || {
                for _ in 0..VERIFY_PASS_ALLREDUCES {
                    issue(v, comm, comm.nccl(), &mut b)?;
                    any_buffer::affine(&stream, &b.normed, &mut b.input, 1.0 / world as f32, 0.0)?;
                }
                Ok(())
            })?;
            comm.register_graph_buffers()?;
            let mut samples: Vec<f64> = timed(comm, 3, 20, || launch(&graph))?.into_iter().map(|us| us / 1e3).collect();
            comm.deregister_buffers()?;
            out.verify_pass.push(verify_record(v, ran, &data, &mut samples));
        }
    }
    driver::synchronize(&comm.stream())?;
    Ok(out)
}
