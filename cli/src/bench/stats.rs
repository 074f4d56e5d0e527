//! The figures of one measured row: median with p10/p90, algbw and busbw,
//! and the speedup against NCCL at the same size.
#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

use super::Mode;
use tp_allreduce::DType;

/// One measured row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    pub bytes: usize,
    pub dtype: String,
    /// `auto`, an algorithm name, or `nccl`.
    pub selection: String,
    /// What actually ran (for `auto`: the selection's choice).
    pub algorithm: String,
    pub world: usize,
    pub mode: String,
    pub median_us: f64,
    pub p10_us: f64,
    pub p90_us: f64,
    /// bytes / time.
    pub algbw_gbs: f64,
    /// algbw * 2(n-1)/n, the standard bus-bandwidth figure.
    pub busbw_gbs: f64,
    /// NCCL's median / ours, when NCCL ran the same size.
    pub speedup_vs_nccl: Option<f64>,
}

/// (median, p10, p90) of a sample (sorted in place); NaN when empty.
pub fn percentiles(samples: &mut [f64]) -> (f64, f64, f64) {
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let pick = |q: f64| {
        if samples.is_empty() {
            return f64::NAN;
        }
        let idx = ((samples.len() - 1) as f64 * q).round() as usize;
        samples[idx]
    };
    (pick(0.5), pick(0.1), pick(0.9))
}

/// Algorithm bandwidth: message bytes per second of one allreduce (GB/s).
pub fn algbw_gbs(bytes: usize, micros: f64) -> f64 {
    bytes as f64 / (micros * 1e-6) / 1e9
}

/// Bus bandwidth: `algbw * 2(n-1)/n`, what each rank's links carry in an
/// optimal ring allreduce (NCCL's tests report the same figure).
pub fn busbw(algbw: f64, world: usize) -> f64 {
    if world <= 1 {
        algbw
    } else {
        algbw * 2.0 * (world - 1) as f64 / world as f64
    }
}

/// What one row is about: the message, who was asked and who ran.
#[derive(Clone, Copy, Debug)]
pub struct RowKey<'a> {
    pub bytes: usize,
    pub dtype: DType,
    /// `auto`, an algorithm name, or `nccl`.
    pub selection: &'a str,
    /// What ran (for `auto`: the selection's choice).
    pub ran: &'a str,
    pub world: usize,
    pub mode: Mode,
}

/// One table row from per-allreduce samples (microseconds).
pub fn measurement(key: RowKey, samples: &mut [f64]) -> Measurement {
    let (median, p10, p90) = percentiles(samples);
    let algbw = algbw_gbs(key.bytes, median);
    Measurement {
        bytes: key.bytes,
        dtype: key.dtype.name().into(),
        selection: key.selection.into(),
        algorithm: key.ran.into(),
        world: key.world,
        mode: key.mode.name().into(),
        median_us: median,
        p10_us: p10,
        p90_us: p90,
        algbw_gbs: algbw,
        busbw_gbs: busbw(algbw, key.world),
        speedup_vs_nccl: None,
    }
}

/// Sets every row's speedup against NCCL's row of the same size.
pub fn set_speedups(rows: &mut [Measurement], nccl: &Measurement) {
    for r in rows.iter_mut() {
        r.speedup_vs_nccl = Some(nccl.median_us / r.median_us);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_nearest_rank() {
        let mut s: Vec<f64> = (1..=11).rev().map(f64::from).collect();
        assert_eq!(percentiles(&mut s), (6.0, 2.0, 10.0));
        assert_eq!(s.first(), Some(&1.0), "sorted in place");
        let (m, lo, hi) = percentiles(&mut [4.0]);
        assert_eq!((m, lo, hi), (4.0, 4.0, 4.0));
        assert!(percentiles(&mut []).0.is_nan());
    }

    #[test]
    fn bus_bandwidth_scales_by_two_n_minus_one_over_n() {
        assert_eq!(busbw(100.0, 1), 100.0);
        assert_eq!(busbw(100.0, 2), 100.0);
        assert_eq!(busbw(100.0, 4), 150.0);
        assert_eq!(busbw(80.0, 8), 140.0);
        // 1 MB in 10 us = 100 GB/s.
        assert!((algbw_gbs(1_000_000, 10.0) - 100.0).abs() < 1e-9);
    }

    #[test]
    fn a_row_carries_its_statistics_and_bandwidths() {
        let key = RowKey {
            bytes: 43_008,
            dtype: DType::Bf16,
            selection: "auto",
            ran: "one-shot-push",
            world: 8,
            mode: Mode::Graph,
        };
        let mut samples = vec![9.0, 8.0, 10.0, 8.5, 12.0];
        let row = measurement(key, &mut samples);
        assert_eq!((row.median_us, row.p10_us, row.p90_us), (9.0, 8.0, 12.0));
        assert_eq!((row.dtype.as_str(), row.mode.as_str(), row.algorithm.as_str()), ("bf16", "graph", "one-shot-push"));
        assert!((row.algbw_gbs - 43_008.0 / 9e-6 / 1e9).abs() < 1e-9);
        assert!((row.busbw_gbs - row.algbw_gbs * 14.0 / 8.0).abs() < 1e-9);
        assert_eq!(row.speedup_vs_nccl, None);
        let mut nccl_samples = vec![27.0];
        let nccl = measurement(RowKey { selection: "nccl", ran: "nccl", ..key }, &mut nccl_samples);
        let mut rows = vec![row];
        set_speedups(&mut rows, &nccl);
        assert_eq!(rows[0].speedup_vs_nccl, Some(3.0));
    }
}
