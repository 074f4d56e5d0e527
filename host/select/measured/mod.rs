//! Measured `auto`: at communicator start, the selection is measured on
//! the machine it runs on instead of taken from the cost model alone.
//!
//! # What happens at start (`Comm::measure_selection`, `comm/measure.rs`)
//! 1. Rank 0 decides for everyone: its [`AutoMeasure`] mode and dtypes,
//!    and, per dtype, the cached table of this [`CacheKey`] if one is
//!    valid ([`cache`]). Every rank receives rank 0's decision through the
//!    rendezvous, so ranks never disagree (a rank's own configuration or
//!    cache does not matter).
//! 2. Per dtype without a cached table, every rank runs the same
//!    sequence: per size bucket of the [`Sweep`], the candidates the cost
//!    model ranks first ([`candidates`]) plus NCCL where the communicator
//!    has it (ranks on distinct GPUs), each checked against the f64
//!    reference (exact integer sums, compared by value) before and after
//!    its timed graph replays, its time the median over replays of the
//!    slowest rank. A candidate whose output is wrong on any rank is
//!    dropped with a WARNING (and never chosen).
//! 3. Rank 0 builds the table ([`table_from_timings`]); every rank adopts
//!    rank 0's bytes ([`adopt_rank0_table`]); rank 0 caches it.
//! 4. The selection tables are rebuilt from it: between measured buckets
//!    the measured neighbours decide (`TuningTable::interpolated_us`),
//!    never slower than NCCL where NCCL was measured, the model past the
//!    largest measured bucket. One INFO line says what was measured, how
//!    long it took and what was chosen per size range.
//!
//! # Bounds
//! The default sweep ([`AutoMeasure::On`]) measures 8 sizes, 4 KiB to
//! 16 MiB (42 KiB included), the model's 3 leading candidates each, and
//! stops adding sizes once [`Sweep::budget`] has passed on rank 0 (the
//! sizes left fall back to the model), so a cold start stays within about
//! 15 s per dtype; a warm start reads one small file. `Full` measures every
//! applicable algorithm at every `tune` size, longer.
//!
//! # Turning it off
//! `Config::auto_measure = Some(AutoMeasure::Off)` or
//! `TP_ALLREDUCE_AUTO_MEASURE=off`: the model alone (or a `tune` table).
//! A `tune` table that applies (`TP_ALLREDUCE_TUNING_FILE`, or its default
//! place) is used as it is and nothing is measured.

#![forbid(unsafe_code)]

pub mod cache;
pub(crate) mod mode;
pub mod shapes;
#[cfg(test)]
mod tests;

use std::time::Duration;

use tp_allreduce_kernels::ids::DType;

use crate::algorithm::{Algorithm, Transport};
use crate::error::{Error, Result};
use crate::select::cost_model::{CostModel, NcclTuning, Options};
use crate::select::selection::Constraints;
use crate::select::topology::Topology;
use crate::select::tuning::{Measurement, TuningMeta, TuningTable};

pub use cache::{CacheKey, CacheRead, MeasuredCache, WriteOutcome};
pub use mode::AutoMeasure;

/// What one measurement pass covers.
#[derive(Clone, Debug, PartialEq)]
pub struct Sweep {
    /// Message sizes measured, ascending.
    pub buckets: Vec<usize>,
    /// Candidates of ours per size, in the model's order (`usize::MAX`: all).
    pub top_k: usize,
    /// Untimed graph replays before the timed ones.
    pub warmup: usize,
    /// Timed replays; the time is their median.
    pub repeats: usize,
    /// Allreduces captured in one graph (a replay's time is divided by it).
    pub iterations: usize,
    /// Rank 0 adds no further size once this much time has passed.
    pub budget: Duration,
}

impl Sweep {
    /// The sweep of `mode` (`None` for `Off`).
    pub fn for_mode(mode: AutoMeasure) -> Option<Sweep> {
        match mode {
            AutoMeasure::Off => None,
            AutoMeasure::On => Some(Sweep {
                buckets: vec![4 << 10, 16 << 10, 42 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20],
                top_k: 3,
                warmup: 2,
                repeats: 7,
                iterations: 8,
                budget: Duration::from_secs(12),
            }),
            AutoMeasure::Full => Some(Sweep {
                buckets: crate::select::tuning::default_buckets(),
                top_k: usize::MAX,
                warmup: 3,
                repeats: 15,
                iterations: 16,
                budget: Duration::from_secs(600),
            }),
        }
    }
}

/// The candidates of ours measured at `bytes`: the applicable allreduce
/// algorithms in the order of the model's prediction (graph replay), the
/// first `top_k`. Pure.
pub fn candidates(
    model: &CostModel,
    view: &Topology,
    constraints: &Constraints,
    bytes: usize,
    top_k: usize,
) -> Vec<Algorithm> {
    let opts = Options { capturing: true, islands: constraints.islands, nccl: NcclTuning::Tuned };
    let mut ranked: Vec<(Algorithm, f64)> = Algorithm::allreduce_algorithms()
        .filter(|a| constraints.available(*a, view.len(), bytes).is_ok())
        .filter_map(|a| {
            model.predict(view, a, constraints.transport, bytes, &opts).ok().map(|p| (a, p.total_us()))
        })
        .collect();
    ranked.sort_by(|x, y| x.1.total_cmp(&y.1).then(x.0.cmp(&y.0)));
    ranked.into_iter().take(top_k).map(|(a, _)| a).collect()
}

/// One candidate's outcome at one size, the same on every rank (times are
/// the slowest rank's, `correct` is every rank's verdict).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    pub bytes: usize,
    pub algorithm: Algorithm,
    pub transport: Transport,
    pub median_us: f64,
    /// The launch shape it was measured with, where a `full` sweep found
    /// one that beats the default rule (sentinel algorithms).
    pub shape: Option<(u32, u32)>,
    /// The output matched the reference on every rank, before and after
    /// the replays.
    pub correct: bool,
}

/// The table rank 0 builds from its timings of `dtype`: every correct
/// candidate's median per bucket, winners by [`TuningTable::from_measurements`],
/// `candidates_only` set (what was not measured is not chosen where
/// something was). An error when nothing was measured correctly.
pub fn table_from_timings(key: &CacheKey, dtype: DType, timings: &[Timing]) -> Result<TuningTable> {
    let measurements: Vec<Measurement> = timings
        .iter()
        .filter(|t| t.correct && t.median_us.is_finite() && t.median_us > 0.0)
        .map(|t| Measurement {
            bucket_bytes: t.bytes,
            dtype,
            algorithm: t.algorithm,
            transport: t.transport,
            median_us: t.median_us,
            shape: t.shape,
        })
        .collect();
    if measurements.is_empty() {
        return Err(Error::Config(format!(
            "measured auto: no candidate measured correctly for {} on this communicator",
            dtype.name()
        )));
    }
    let meta = TuningMeta {
        gpu_model: key.gpu_model.clone(),
        fingerprint: key.fingerprint.clone(),
        world_size: key.world_size,
        captured: true,
        tool: format!("tp-allreduce {} measured auto ({})", env!("CARGO_PKG_VERSION"), key.sweep),
        candidates_only: true,
    };
    TuningTable::from_measurements(meta, measurements)
}

/// Every rank's bytes of one exchange round, in rank order: rank 0's
/// table wins, whatever the others built from their own numbers. Pure.
pub fn adopt_rank0_table(gathered: &[Vec<u8>]) -> Result<TuningTable> {
    let first = gathered.first().ok_or_else(|| Error::Config("measured auto: empty exchange".into()))?;
    let text = std::str::from_utf8(first)
        .map_err(|_| Error::Protocol { from: "rank 0".into(), what: "measured table is not UTF-8".into() })?;
    TuningTable::from_toml_str(text, "rank 0's measured table")
}

/// Merges tables of single dtypes into one (entries of every dtype; the
/// meta of the first). `None` for none.
pub fn merge(tables: Vec<TuningTable>) -> Option<TuningTable> {
    let mut it = tables.into_iter();
    let mut merged = it.next()?;
    for t in it {
        merged.entries.extend(t.entries);
    }
    merged.entries.sort_by_key(|e| (e.dtype as u32, e.bytes));
    Some(merged)
}

/// The INFO line's summary of a measured table: per bucket, the winner
/// and its time, consecutive buckets with the same winner as one range.
pub fn describe(table: &TuningTable, dtype: DType) -> String {
    let mut parts: Vec<String> = Vec::new();
    let entries: Vec<_> = table.entries.iter().filter(|e| e.dtype == dtype).collect();
    let mut i = 0;
    while i < entries.len() {
        let mut j = i;
        while j + 1 < entries.len() && entries[j + 1].winner == entries[i].winner {
            j += 1;
        }
        let range = if i == j {
            crate::select::selection::human_bytes(entries[i].bytes)
        } else {
            format!(
                "{}-{}",
                crate::select::selection::human_bytes(entries[i].bytes),
                crate::select::selection::human_bytes(entries[j].bytes)
            )
        };
        parts.push(format!("{range}: {}", entries[i].winner));
        i = j + 1;
    }
    parts.join("; ")
}
