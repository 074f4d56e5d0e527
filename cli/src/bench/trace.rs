//! `bench --trace`: where the time of a sentinel (one-shot-push) launch
//! goes, from the timestamps thread 0 of block 0 writes
//! (`Config::trace`): the gap from the previous launch's exit to this
//! entry, entry to the control words' arrival, entry to the first peer
//! store, first store to the last successful poll (waiting for peers), last
//! poll to exit. Medians over a row's launches, per rank (`%globaltimer`
//! runs per GPU, so only differences on one rank are meaningful). The
//! verify pass's launches form the row `verify-pass` (with `--processes`);
//! there the gap spans the dependent kernel between two allreduces.
#![forbid(unsafe_code)]

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use tp_allreduce_kernels::params::TraceRecord;

use super::stats::percentiles;
use crate::table::{self, human_bytes};

/// The median breakdown of one row on one rank (microseconds).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceSummary {
    pub bytes: usize,
    pub selection: String,
    pub rank: usize,
    /// Launches the medians are over.
    pub launches: usize,
    /// `blocks x threads` of the launches.
    pub shape: String,
    /// Previous launch's exit to this launch's entry (consecutive
    /// generations only); `None` when no two recorded launches are
    /// consecutive (e.g. one launch, or a ring that kept every other one).
    /// Not NaN: the summaries travel between ranks as JSON, which has none.
    pub gap_us: Option<f64>,
    pub loaded_us: f64,
    pub first_store_us: f64,
    pub wait_us: f64,
    pub tail_us: f64,
    pub kernel_us: f64,
}

/// The median of a non-empty `v`.
fn median(mut v: Vec<f64>) -> f64 {
    percentiles(&mut v).0
}

/// The breakdown of `records` (a drained trace ring), `None` when no
/// launch was recorded (tracing off, or not a sentinel algorithm).
pub fn summarize(records: &[TraceRecord], bytes: usize, selection: &str, rank: usize) -> Option<TraceSummary> {
    let mut done: Vec<&TraceRecord> =
        records.iter().filter(|r| r.entry_ns != 0 && r.exit_ns >= r.entry_ns && r.last_poll_ns != 0).collect();
    if done.is_empty() {
        return None;
    }
    done.sort_by_key(|r| r.generation);
    let us = |later: u64, earlier: u64| later.saturating_sub(earlier) as f64 / 1e3;
    let gaps: Vec<f64> = done
        .windows(2)
        .filter(|w| w[1].generation == w[0].generation.wrapping_add(1) && w[1].entry_ns >= w[0].exit_ns)
        .map(|w| us(w[1].entry_ns, w[0].exit_ns))
        .collect();
    let shape = done.last().map(|r| format!("{}x{}", r.shape >> 16, r.shape & 0xFFFF)).unwrap_or_default();
    Some(TraceSummary {
        bytes,
        selection: selection.into(),
        rank,
        launches: done.len(),
        shape,
        gap_us: (!gaps.is_empty()).then(|| median(gaps)),
        loaded_us: median(done.iter().map(|r| us(r.loaded_ns, r.entry_ns)).collect()),
        first_store_us: median(done.iter().map(|r| us(r.first_store_ns, r.entry_ns)).collect()),
        wait_us: median(done.iter().map(|r| us(r.last_poll_ns, r.first_store_ns)).collect()),
        tail_us: median(done.iter().map(|r| us(r.exit_ns, r.last_poll_ns)).collect()),
        kernel_us: median(done.iter().map(|r| us(r.exit_ns, r.entry_ns)).collect()),
    })
}

/// The trace table (empty when nothing was traced).
pub fn render(summaries: &[TraceSummary]) -> String {
    if summaries.is_empty() {
        return String::new();
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\ntrace (medians, us; thread 0 of block 0 per launch): gap = previous exit -> entry, loaded = entry -> \
         control words, store = entry -> first peer store, wait = first store -> last poll, tail = last poll -> exit"
    );
    let header = ["size", "selection", "rank", "shape", "launches", "gap", "loaded", "store", "wait", "tail", "kernel"];
    let mut t = table::new(header, 4..11);
    for s in summaries {
        t.add_row(vec![
            human_bytes(s.bytes),
            s.selection.clone(),
            s.rank.to_string(),
            s.shape.clone(),
            s.launches.to_string(),
            s.gap_us.map_or_else(|| "-".into(), |g| format!("{g:.2}")),
            format!("{:.2}", s.loaded_us),
            format!("{:.2}", s.first_store_us),
            format!("{:.2}", s.wait_us),
            format!("{:.2}", s.tail_us),
            format!("{:.2}", s.kernel_us),
        ]);
    }
    out.push_str(&table::render(&t));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(generation: u32, entry: u64, stamps: [u64; 4]) -> TraceRecord {
        TraceRecord {
            entry_ns: entry,
            loaded_ns: entry + stamps[0],
            first_store_ns: entry + stamps[1],
            last_poll_ns: entry + stamps[2],
            exit_ns: entry + stamps[3],
            generation,
            shape: 11 << 16 | 256,
            _pad: [0; 2],
        }
    }

    #[test]
    fn breakdown_of_consecutive_launches() {
        // Launches every 3 us, each 2 us long: gap 1 us.
        let mut ring: Vec<TraceRecord> = (0..10u32)
            .map(|g| record(g.wrapping_add(u32::MAX - 4), 1_000_000 + 3_000 * g as u64, [200, 300, 1500, 2000]))
            .collect();
        ring.push(TraceRecord::default()); // an unused slot
        let s = summarize(&ring, 43_008, "one-shot-push", 1).unwrap();
        assert_eq!(s.launches, 10);
        assert_eq!(s.shape, "11x256");
        assert!((s.gap_us.unwrap() - 1.0).abs() < 1e-9, "{s:?}");
        assert!((s.loaded_us - 0.2).abs() < 1e-9);
        assert!((s.first_store_us - 0.3).abs() < 1e-9);
        assert!((s.wait_us - 1.2).abs() < 1e-9);
        assert!((s.tail_us - 0.5).abs() < 1e-9);
        assert!((s.kernel_us - 2.0).abs() < 1e-9);
        let table = render(&[s]);
        assert!(table.contains("42 KB") && table.contains("11x256"), "{table}");
        assert!(summarize(&[TraceRecord::default()], 1, "x", 0).is_none());
    }

    /// Launches with no consecutive pair (here one launch, and a ring
    /// holding generations 0, 2, 4) have no gap: the summary says so and
    /// still crosses between ranks as JSON (a NaN gap was written as
    /// `null` and refused by the receiving rank: `bench --processes
    /// --trace` failed).
    #[test]
    fn no_consecutive_launches_means_no_gap() {
        for ring in [
            vec![record(7, 1_000, [1, 2, 3, 4])],
            (0..3u32).map(|g| record(2 * g, 9_000 * g as u64 + 1, [1, 2, 3, 4])).collect(),
        ] {
            let s = summarize(&ring, 8 << 20, "two-shot-push", 0).unwrap();
            assert_eq!(s.gap_us, None, "{s:?}");
            let json = serde_json::to_vec(&vec![s.clone()]).unwrap();
            let back: Vec<TraceSummary> = serde_json::from_slice(&json).unwrap();
            assert_eq!(back, vec![s.clone()]);
            let table = render(&[s]);
            let row = table.lines().find(|l| l.contains("8 MB")).unwrap();
            assert!(row.split('|').nth(5).unwrap().trim() == "-", "{table}");
        }
    }
}
