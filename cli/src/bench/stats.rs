//! The figures of one measured row: median with p10/p90, algbw and busbw,
//! and the speedup against NCCL at the same size.
#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

use super::Mode;
use tp_allreduce::{Collective, DType};

/// One measured row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    /// `allreduce`, `all-gather` or `reduce-scatter`.
    #[serde(default = "allreduce_name")]
    pub collective: String,
    /// The message (for the all-gather and reduce-scatter: one rank's block).
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
    /// Bytes of the whole result (all-gather, reduce-scatter: `world`
    /// blocks) / time.
    pub algbw_gbs: f64,
    /// The standard bus-bandwidth figure: algbw * 2(n-1)/n for the
    /// allreduce, algbw * (n-1)/n for the others (what each rank's links
    /// carry in an optimal ring).
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

fn allreduce_name() -> String {
    Collective::AllReduce.name().into()
}

/// One table row from per-allreduce samples (microseconds).
pub fn measurement(key: RowKey, samples: &mut [f64]) -> Measurement {
    measurement_of(Collective::AllReduce, key, samples)
}

/// One table row of `collective` from per-call samples (microseconds);
/// `key.bytes` is one rank's block for the all-gather and reduce-scatter.
pub fn measurement_of(collective: Collective, key: RowKey, samples: &mut [f64]) -> Measurement {
    let (median, p10, p90) = percentiles(samples);
    let (total, bus) = match collective {
        Collective::AllReduce => (key.bytes, busbw(1.0, key.world)),
        _ => (key.bytes * key.world, (key.world.max(2) - 1) as f64 / key.world.max(1) as f64),
    };
    let algbw = algbw_gbs(total, median);
    Measurement {
        collective: collective.name().into(),
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
        busbw_gbs: algbw * bus,
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

    #[test]
    fn gather_and_scatter_rows_count_every_block() {
        // 8 ranks, 1 MB blocks, 80 us: 8 MB moved per rank's view, bus
        // bandwidth (n-1)/n of it (NCCL's convention for both).
        let key =
            RowKey { bytes: 1_000_000, dtype: DType::F16, selection: "auto", ran: "x", world: 8, mode: Mode::Graph };
        for c in [Collective::AllGather, Collective::ReduceScatter] {
            let row = measurement_of(c, key, &mut [80.0]);
            assert_eq!(row.collective, c.name());
            assert!((row.algbw_gbs - 100.0).abs() < 1e-9, "{c:?}: {}", row.algbw_gbs);
            assert!((row.busbw_gbs - 87.5).abs() < 1e-9, "{c:?}: {}", row.busbw_gbs);
        }
        let row = measurement_of(Collective::AllReduce, key, &mut [80.0]);
        assert_eq!(row.collective, "allreduce");
        assert!((row.algbw_gbs - 12.5).abs() < 1e-9);
    }
}
