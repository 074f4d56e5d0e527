//! `tp-allreduce tune`: every applicable algorithm (and NCCL when it can
//! run) per size bucket on this machine, graph replay, medians; writes the
//! tuning table the communicators of this machine and world size load.
#![forbid(unsafe_code)]

use super::collective::{nccl_group, our_group, Collective, NcclGroup, OurGroup};
use super::progress::Progress;
use super::ranks::{Buffers, Ranks};
use super::report::human_bytes;
use super::stats::percentiles;
use super::timing::time_collective;
use super::{Mode, Options};
use crate::algorithm::{Algorithm, Transport};
use crate::error::{Error, Result};
use crate::select::tuning::{Measurement as TuneMeasurement, TuningMeta, TuningTable};

/// What `tune` produced.
pub struct TuneOutcome {
    pub table: TuningTable,
    pub path: std::path::PathBuf,
    pub measured: usize,
    pub seconds: f64,
}

/// Measures, writes the table to `out` (default: where communicators of
/// this machine and world size look) and returns it.
pub fn tune(opts: &Options, out: Option<std::path::PathBuf>) -> Result<TuneOutcome> {
    let started = std::time::Instant::now();
    let ranks = Ranks::new(&opts.gpus, opts.ranks_per_gpu)?;
    let mut comms = our_group(&ranks, &opts.config)?;
    let view = comms[0].topology().clone();
    let transport = comms[0].transport();
    let nccl = nccl_group(&ranks).ok();
    let algorithms: Vec<Algorithm> =
        Algorithm::OURS.into_iter().filter(|a| comms[0].set_algorithm(Some(*a)).is_ok()).collect();
    let progress = Progress::new(opts.sizes.len() * (algorithms.len() + nccl.is_some() as usize));
    let mut measurements = Vec::new();
    for (i, &bytes) in opts.sizes.iter().enumerate() {
        let mut bufs = Buffers::new(&ranks, bytes, opts.dtype, 0x7E57 ^ (i as u64) << 24)?;
        let row = |algorithm, transport, median_us| TuneMeasurement {
            bucket_bytes: bytes,
            dtype: opts.dtype,
            algorithm,
            transport,
            median_us,
            shape: None,
        };
        for &a in &algorithms {
            progress.step(&format!("{} {a}", human_bytes(bytes)));
            for c in comms.iter_mut() {
                c.set_algorithm(Some(a))?;
            }
            let mut samples = time_collective(&OurGroup { comms: &comms }, &ranks, &mut bufs, opts)?;
            measurements.push(row(a, transport, percentiles(&mut samples).0));
        }
        if let Some(n) = &nccl {
            progress.step(&format!("{} nccl", human_bytes(bytes)));
            let group = NcclGroup { comms: n, streams: &ranks.streams };
            let mut o = opts.clone();
            if !group.capturable_per_rank() {
                o.mode = Mode::Eager;
            }
            let mut samples = time_collective(&group, &ranks, &mut bufs, &o)?;
            measurements.push(row(Algorithm::Nccl, Transport::PeerToPeer, percentiles(&mut samples).0));
        }
    }
    progress.finish();
    drop(comms);
    let measured = measurements.len();
    let meta = TuningMeta::for_topology(&view, format!("tp-allreduce tune {}", env!("CARGO_PKG_VERSION")));
    let table = TuningTable::from_measurements(meta, measurements)?;
    let path = match out {
        Some(p) => p,
        None => crate::env::tuning_file(&view.fingerprint(), ranks.world()).ok_or_else(|| {
            Error::Config("no place for the tuning table: set TP_ALLREDUCE_TUNING_FILE or HOME".into())
        })?,
    };
    table.save(&path)?;
    Ok(TuneOutcome { table, path, measured, seconds: started.elapsed().as_secs_f64() })
}
