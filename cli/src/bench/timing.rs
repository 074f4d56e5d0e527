//! Capture, replay and CUDA-event timing of a collective on every rank.
#![forbid(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaGraph, CudaStream};

use super::collective::CommGroup;
use super::ranks::{Buffers, Ranks};
use super::{Mode, Options};
use tp_allreduce::comm::Comm;
use tp_allreduce::driver;
use tp_allreduce::error::{driver as driver_error, Result};

pub(crate) fn event(ctx: &Arc<CudaContext>) -> Result<CudaEvent> {
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| driver_error("cuEventCreate", e))
}

pub(crate) fn record(event: &CudaEvent, stream: &CudaStream) -> Result<()> {
    event.record(stream).map_err(|e| driver_error("cuEventRecord", e))
}

pub(crate) fn elapsed_us(start: &CudaEvent, end: &CudaEvent) -> Result<f64> {
    Ok(start.elapsed_ms(end).map_err(|e| driver_error("cuEventElapsedTime", e))? as f64 * 1e3)
}

pub(crate) fn launch(graph: &CudaGraph) -> Result<()> {
    graph.launch().map_err(|e| driver_error("cuGraphLaunch", e))
}

/// Waits for every rank's stream, then checks the collective for errors.
pub(crate) fn sync_all(c: &dyn CommGroup, ranks: &Ranks) -> Result<()> {
    for s in &ranks.streams {
        let synced = driver::synchronize(s);
        c.check()?;
        synced?;
    }
    Ok(())
}

/// Captures `body(rank, stream)` on every rank's stream into one graph per
/// rank (thread-local capture mode).
pub(crate) fn capture_per_rank(
    ranks: &Ranks,
    mut body: impl FnMut(usize, &Arc<CudaStream>) -> Result<()>,
) -> Result<Vec<CudaGraph>> {
    let mut graphs = Vec::with_capacity(ranks.world());
    for (r, s) in ranks.streams.iter().enumerate() {
        graphs.push(driver::capture(s, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, || body(r, s))?);
    }
    Ok(graphs)
}

/// Replays every rank's graph `warmup + repeats` times; each sample is the
/// slowest rank's start-to-end time (microseconds) of one replay.
pub(crate) fn time_graph_replays(
    graphs: &[CudaGraph],
    ranks: &Ranks,
    warmup: usize,
    repeats: usize,
    mut sync: impl FnMut() -> Result<()>,
) -> Result<Vec<f64>> {
    let starts: Vec<CudaEvent> = ranks.contexts.iter().map(event).collect::<Result<_>>()?;
    let ends: Vec<CudaEvent> = ranks.contexts.iter().map(event).collect::<Result<_>>()?;
    let mut samples = Vec::with_capacity(repeats);
    for i in 0..warmup + repeats {
        for ((g, s), (start, end)) in graphs.iter().zip(&ranks.streams).zip(starts.iter().zip(&ends)) {
            record(start, s)?;
            launch(g)?;
            record(end, s)?;
        }
        sync()?;
        if i >= warmup {
            samples.push(span_us(&starts, &ends)?);
        }
    }
    Ok(samples)
}

/// Verifies, then times `c` on `bufs`; returns per-allreduce microseconds
/// (one sample per timed repeat).
pub fn time_collective(c: &dyn CommGroup, ranks: &Ranks, bufs: &mut Buffers, opts: &Options) -> Result<Vec<f64>> {
    // The first call is eager: checked against what an eager call runs
    // (`auto` may choose another algorithm for it than for a graph).
    let (op, bytes, dtype) = (bufs.collective, bufs.bytes(), bufs.dtype);
    let eager = (c.describe(op, bytes, dtype, false), c.roundings(op, bytes, dtype, false));
    bufs.poison()?;
    c.issue_all(bufs)?;
    sync_all(c, ranks)?;
    bufs.verify(eager.1, &format!("{} (eager call)", eager.0))?;
    match timed_mode(c, opts) {
        Mode::Graph => {
            let graphs = capture_per_rank(ranks, |r, _| {
                (0..opts.iterations).try_for_each(|_| c.run(bufs.collective, r, &bufs.inputs[r], &mut bufs.outputs[r]))
            })?;
            c.after_capture()?;
            for g in &graphs {
                g.upload().map_err(|e| driver_error("cuGraphUpload", e))?;
            }
            let replays = time_graph_replays(&graphs, ranks, opts.warmup, opts.repeats, || sync_all(c, ranks))?;
            // The replays ran on the same buffers: check the result again,
            // against what the graph runs.
            let (what, roundings) = (c.describe(op, bytes, dtype, true), c.roundings(op, bytes, dtype, true));
            bufs.verify(roundings, &format!("{what} (graph replays)"))?;
            // The buffers are freed after this size's rows.
            c.release_buffers()?;
            Ok(replays.into_iter().map(|us| us / opts.iterations as f64).collect())
        }
        Mode::Eager => time_eager(c, ranks, bufs, opts),
    }
}

/// The mode `c` is timed in for `opts`: eager where per-rank capture does
/// not work (NCCL over several GPUs from one thread).
pub fn timed_mode(c: &dyn CommGroup, opts: &Options) -> Mode {
    if opts.mode == Mode::Graph && !c.capturable_per_rank() {
        Mode::Eager
    } else {
        opts.mode
    }
}

/// `iterations` eager calls on every rank per sample.
fn time_eager(c: &dyn CommGroup, ranks: &Ranks, bufs: &mut Buffers, opts: &Options) -> Result<Vec<f64>> {
    let starts: Vec<CudaEvent> = ranks.contexts.iter().map(event).collect::<Result<_>>()?;
    let ends: Vec<CudaEvent> = ranks.contexts.iter().map(event).collect::<Result<_>>()?;
    let mut samples = Vec::with_capacity(opts.repeats);
    for i in 0..opts.warmup + opts.repeats {
        for (start, stream) in starts.iter().zip(&ranks.streams) {
            record(start, stream)?;
        }
        for _ in 0..opts.iterations {
            c.issue_all(bufs)?;
        }
        for (end, stream) in ends.iter().zip(&ranks.streams) {
            record(end, stream)?;
        }
        sync_all(c, ranks)?;
        if i >= opts.warmup {
            samples.push(span_us(&starts, &ends)? / opts.iterations as f64);
        }
    }
    Ok(samples)
}

/// The collective's span: the slowest rank's start-to-end time.
fn span_us(starts: &[CudaEvent], ends: &[CudaEvent]) -> Result<f64> {
    let mut worst = 0f64;
    for (s, e) in starts.iter().zip(ends) {
        worst = worst.max(elapsed_us(s, e)?);
    }
    Ok(worst)
}

/// Times `warmup + repeats` calls of `launch` on this rank, each aligned by
/// a rendezvous barrier; returns the slowest rank's time per sample (us).
pub(crate) fn timed(
    comm: &Comm,
    warmup: usize,
    repeats: usize,
    mut launch: impl FnMut() -> Result<()>,
) -> Result<Vec<f64>> {
    let stream = comm.stream();
    let (start, end) = (event(comm.context())?, event(comm.context())?);
    let mut mine = Vec::with_capacity(repeats);
    for i in 0..warmup + repeats {
        comm.all_gather_bytes(&[])?;
        record(&start, &stream)?;
        launch()?;
        record(&end, &stream)?;
        comm.synchronize()?;
        if i >= warmup {
            mine.push(elapsed_us(&start, &end)?);
        }
    }
    let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
    let all = comm.all_gather_bytes(&bytes)?;
    Ok(slowest_per_sample(&all, repeats))
}

/// Per sample, the largest of every rank's value (little-endian f64s).
fn slowest_per_sample(all: &[Vec<u8>], repeats: usize) -> Vec<f64> {
    let mut worst = vec![0f64; repeats];
    for rank_samples in all {
        for (k, chunk) in rank_samples.chunks_exact(8).enumerate().take(repeats) {
            let v = f64::from_le_bytes(chunk.try_into().expect("chunks_exact(8)"));
            worst[k] = worst[k].max(v);
        }
    }
    worst
}

pub(crate) fn capture(comm: &Comm, mut body: impl FnMut() -> Result<()>) -> Result<CudaGraph> {
    driver::capture(&comm.stream(), sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, &mut body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slowest_rank_sets_each_sample() {
        let rank = |v: &[f64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let all = vec![rank(&[1.0, 5.0, 3.0]), rank(&[2.0, 4.0, 6.0])];
        assert_eq!(slowest_per_sample(&all, 3), [2.0, 5.0, 6.0]);
        assert_eq!(slowest_per_sample(&all, 2), [2.0, 5.0]);
    }
}
