//! `tp-allreduce tune`: every applicable algorithm (and NCCL when it can
//! run) per size bucket on this machine, graph replay, medians; writes the
//! tuning table the communicators of this machine and world size load.
//!
//! Sentinel algorithms (one-shot-push) run with any launch shape; with
//! `--shapes full` each size sweeps (blocks, threads) candidates after the
//! default rule's launch. Every candidate runs on fresh random inputs and
//! is checked against the f64 reference before and after its replays (a
//! wrong candidate is a bug: `tune` fails), its time is the slowest rank's,
//! and the fastest swept shape wins — within 1% the one with fewer threads,
//! then fewer blocks — if it beats the default rule by more than 1%; the
//! winning shape goes into the table next to the algorithm's median (none:
//! the default rule stays).
#![forbid(unsafe_code)]

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::collective::{nccl_group, our_group, CommGroup, NcclGroup, OurGroup};
use super::progress::Progress;
use super::ranks::{Buffers, Ranks};
use super::stats::percentiles;
use super::timing::time_collective;
use super::{Mode, Options};
use crate::table::human_bytes;
use tp_allreduce::algorithm::{Algorithm, Transport};
use tp_allreduce::comm::Comm;
use tp_allreduce::error::{Error, Result};
use tp_allreduce::select::measured::shapes::{pick_over_default, shape_candidates};
use tp_allreduce::select::tuning::{Measurement as TuneMeasurement, TuningMeta, TuningTable};
use tp_allreduce::DType;

/// Which launch shapes `tune` measures for sentinel algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Shapes {
    /// The default rule only (no shape is written to the table).
    Default,
    /// Sweep blocks x threads (see `shape_candidates`).
    Full,
}

/// One measured launch shape (the `--report` file).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweepPoint {
    pub bytes: usize,
    pub dtype: String,
    pub algorithm: String,
    pub blocks: u32,
    pub threads: u32,
    pub median_us: f64,
    pub p10_us: f64,
    pub p90_us: f64,
}

/// What `tune` produced.
pub struct TuneOutcome {
    pub table: TuningTable,
    pub path: PathBuf,
    pub measured: usize,
    pub seconds: f64,
    pub sweep: Vec<SweepPoint>,
}

/// One measured shape (`None`: the default rule) and its (median, p10,
/// p90) in microseconds.
type ShapeRow = (Option<(u32, u32)>, (f64, f64, f64));

/// The medians of `algorithm` at one size: one row per measured shape
/// (`None`: the default rule).
fn measure_ours(
    comms: &mut [Comm],
    ranks: &Ranks,
    opts: &Options,
    (algorithm, bytes, seed): (Algorithm, usize, u64),
    shapes: Shapes,
) -> Result<Vec<ShapeRow>> {
    for c in comms.iter_mut() {
        c.set_algorithm(Some(algorithm))?;
    }
    let sentinel = algorithm.kernel().is_some_and(|id| id.sentinel());
    let candidates: Vec<Option<(u32, u32)>> = if sentinel && shapes == Shapes::Full {
        let packs = bytes.div_ceil(16) as u64;
        let cap = |t: u32| comms.iter().map(|c| c.max_sentinel_blocks(t)).min().unwrap_or(0);
        // The default rule first: a swept shape must beat it to replace it.
        std::iter::once(None).chain(shape_candidates(bytes, packs, cap).into_iter().map(Some)).collect()
    } else {
        vec![None]
    };
    let mut rows = Vec::with_capacity(candidates.len());
    for (k, shape) in candidates.into_iter().enumerate() {
        for c in comms.iter_mut() {
            c.set_launch_shape(shape)?;
        }
        // Fresh random inputs per candidate.
        let mut bufs = Buffers::new(ranks, bytes, opts.dtype, seed ^ (k as u64 + 1) << 40)?;
        let mut samples = time_collective(&OurGroup { comms }, ranks, &mut bufs, opts)?;
        rows.push((shape, percentiles(&mut samples)));
    }
    for c in comms.iter_mut() {
        c.set_launch_shape(None)?;
    }
    Ok(rows)
}

fn sweep_points(rows: &[ShapeRow], a: Algorithm, bytes: usize, d: DType) -> Vec<SweepPoint> {
    rows.iter()
        .filter_map(|(shape, (median, p10, p90))| {
            shape.map(|(blocks, threads)| SweepPoint {
                bytes,
                dtype: d.name().into(),
                algorithm: a.name().into(),
                blocks,
                threads,
                median_us: *median,
                p10_us: *p10,
                p90_us: *p90,
            })
        })
        .collect()
}

/// Measures, writes the table to `out` (default: where communicators of
/// this machine and world size look) and returns it.
pub fn tune(opts: &Options, out: Option<PathBuf>, shapes: Shapes) -> Result<TuneOutcome> {
    let started = std::time::Instant::now();
    let ranks = Ranks::new(&opts.gpus, opts.ranks_per_gpu)?;
    // `tune` measures every algorithm itself: no measured `auto` at start.
    let config = tp_allreduce::Config { auto_measure: Some(tp_allreduce::AutoMeasure::Off), ..opts.config.clone() };
    let mut comms = our_group(&ranks, &config)?;
    let view = comms[0].topology().clone();
    let transport = comms[0].transport();
    let nccl = nccl_group(&ranks).ok();
    let algorithms: Vec<Algorithm> =
        Algorithm::allreduce_algorithms().filter(|a| comms[0].set_algorithm(Some(*a)).is_ok()).collect();
    let progress = Progress::new(opts.sizes.len() * (algorithms.len() + nccl.is_some() as usize));
    let (mut measurements, mut sweep) = (Vec::new(), Vec::new());
    for (i, &bytes) in opts.sizes.iter().enumerate() {
        let seed = 0x7E57 ^ (i as u64) << 24;
        let row = |algorithm, transport, median_us, shape| TuneMeasurement {
            bucket_bytes: bytes,
            dtype: opts.dtype,
            algorithm,
            transport,
            median_us,
            shape,
        };
        for &a in &algorithms {
            progress.step(&format!("{} {a}", human_bytes(bytes)));
            let rows = measure_ours(&mut comms, &ranks, opts, (a, bytes, seed), shapes)?;
            sweep.extend(sweep_points(&rows, a, bytes, opts.dtype));
            let points: Vec<((u32, u32), f64)> = rows.iter().filter_map(|(s, m)| s.map(|s| (s, m.0))).collect();
            let default_us = rows.iter().find(|(s, _)| s.is_none()).map(|(_, m)| m.0);
            match pick_over_default(default_us, &points) {
                Some((shape, median)) => measurements.push(row(a, transport, median, shape)),
                None => measurements.push(row(a, transport, rows[0].1 .0, None)),
            }
        }
        if let Some(n) = &nccl {
            progress.step(&format!("{} nccl", human_bytes(bytes)));
            let group = NcclGroup { comms: n, streams: &ranks.streams };
            let mut o = opts.clone();
            if !group.capturable_per_rank() {
                o.mode = Mode::Eager;
            }
            let mut bufs = Buffers::new(&ranks, bytes, opts.dtype, seed)?;
            let mut samples = time_collective(&group, &ranks, &mut bufs, &o)?;
            measurements.push(row(Algorithm::Nccl, Transport::PeerToPeer, percentiles(&mut samples).0, None));
        }
    }
    progress.finish();
    drop(comms);
    let measured = measurements.len();
    let meta = TuningMeta::for_topology(&view, format!("tp-allreduce tune {}", env!("CARGO_PKG_VERSION")));
    let table = TuningTable::from_measurements(meta, measurements)?;
    let path = match out {
        Some(p) => p,
        None => tp_allreduce::env::tuning_file(&view.fingerprint(), ranks.world()).ok_or_else(|| {
            Error::Config("no place for the tuning table: set TP_ALLREDUCE_TUNING_FILE or HOME".into())
        })?,
    };
    table.save(&path)?;
    Ok(TuneOutcome { table, path, measured, seconds: started.elapsed().as_secs_f64(), sweep })
}
