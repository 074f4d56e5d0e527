//! The benchmark engine behind `tp-allreduce bench` and `tune`: in-process
//! ranks (one per GPU, or several per GPU with `ranks_per_gpu`), graph replay
//! of many back-to-back allreduces (or eager calls), CUDA-event timing,
//! median with p10/p90, and every configuration checked against the
//! expected sum before it is timed. NCCL runs in the same process on the
//! same buffers as the baseline when its ranks are on distinct GPUs.
//!
//! | file | what |
//! |---|---|
//! | `options.rs` | the command line: parsing and validation (no GPU needed) |
//! | `stats.rs` | percentiles, algbw/busbw, one measured row |
//! | `ranks.rs` | the in-process ranks and their buffers |
//! | `collective.rs` | ours and NCCL behind one trait |
//! | `timing.rs` | capture, replay, CUDA-event timing |
//! | `in_process.rs` | `bench` in one process |
//! | `scenarios.rs` | verify pass, launch floor, large-message efficiency |
//! | `fused_epilogue.rs`, `fused_epilogue_runs.rs` | `--fused`: the layer epilogue (allreduce + residual add + RMSNorm) and its verify pass |
//! | `tune.rs` | `tune` (with the launch-shape sweep) |
//! | `trace.rs` | `--trace`: per-launch timestamps of one-shot-push, medians |
//! | `processes.rs` | `bench --processes`: one process per rank |
//! | `report.rs`, `plot.rs` | tables, CSV, JSON, compare, the SVG plot |
//! | `progress.rs` | the progress bar |
#![forbid(unsafe_code)]

pub mod collective;
pub mod fused_epilogue;
pub mod fused_epilogue_runs;
pub mod in_process;
pub mod options;
pub mod plot;
pub mod processes;
pub mod progress;
pub mod ranks;
pub mod report;
pub mod scenarios;
pub mod stats;
pub mod timing;
pub mod trace;
pub mod tune;

use serde::{Deserialize, Serialize};

use tp_allreduce::algorithm::Algorithm;
use tp_allreduce::comm::Config;
use tp_allreduce::error::{Error, Result};
use tp_allreduce::{Collective, DType};

pub use collective::{nccl_group, our_group, CommGroup, NcclGroup, OurGroup};
pub use in_process::run;
pub use options::BenchArgs;
pub use ranks::{Buffers, Ranks};
pub use stats::Measurement;
pub use timing::time_collective;
pub use tune::{tune, Shapes, TuneOutcome};

/// What to run for one row: our selection, a forced algorithm, or NCCL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Selection {
    Auto,
    Forced(Algorithm),
}

impl Selection {
    pub fn name(&self) -> String {
        match self {
            Selection::Auto => "auto".into(),
            Selection::Forced(a) => a.name().into(),
        }
    }

    /// The algorithm to force on the communicators (`None`: the selection).
    pub fn forced(&self) -> Option<Algorithm> {
        match self {
            Selection::Auto => None,
            Selection::Forced(a) => Some(*a),
        }
    }
}

/// The algorithm the fused scenario is forced to (`--algorithms` naming
/// one algorithm and nothing else): its fused path, or its allreduce
/// followed by the separate kernel where it has none.
pub(crate) fn fused_forced(selections: &[Selection]) -> Option<tp_allreduce::algorithm::Algorithm> {
    match selections {
        [one] => one.forced(),
        _ => None,
    }
}

impl std::str::FromStr for Selection {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if s.trim().eq_ignore_ascii_case("auto") {
            Ok(Selection::Auto)
        } else {
            Ok(Selection::Forced(s.parse()?))
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum Mode {
    /// CUDA-graph replay of `iterations` back-to-back allreduces per rank.
    Graph,
    /// `iterations` eager calls per rank per timed repeat.
    Eager,
}

impl Mode {
    pub fn name(&self) -> &'static str {
        match self {
            Mode::Graph => "graph",
            Mode::Eager => "eager",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Options {
    /// Message sizes in bytes.
    pub sizes: Vec<usize>,
    pub dtype: DType,
    pub selections: Vec<Selection>,
    pub include_nccl: bool,
    pub mode: Mode,
    /// Allreduces per timed graph replay / eager repeat.
    pub iterations: usize,
    /// Timed repeats (the statistics are over these).
    pub repeats: usize,
    pub warmup: usize,
    pub gpus: Vec<usize>,
    pub ranks_per_gpu: usize,
    pub config: Config,
    /// What the sweep measures (sizes are one rank's block for the
    /// all-gather and reduce-scatter).
    pub collective: Collective,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            sizes: default_sizes(),
            dtype: DType::Bf16,
            selections: vec![Selection::Auto],
            include_nccl: true,
            mode: Mode::Graph,
            iterations: 100,
            repeats: 20,
            warmup: 3,
            gpus: vec![0],
            ranks_per_gpu: 1,
            config: Config::default(),
            collective: Collective::AllReduce,
        }
    }
}

/// Extra scenarios of a run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scenarios {
    /// 122 x 42 KB bf16 allreduces with a dependent kernel, one graph.
    pub verify_pass: bool,
    /// 2 ranks on one GPU, 64 MiB f32: fraction of copy bandwidth.
    pub efficiency: bool,
    /// Time of one tiny kernel per rank per graph step (launch floor).
    pub launch_floor: bool,
    /// `--fused`: the layer epilogue (allreduce + residual add + RMSNorm)
    /// over `(rows, hidden)`, fused / ours + separate kernel / NCCL +
    /// separate kernel / allreduce alone, and (with `verify_pass`) its
    /// verify passes.
    pub fused: Option<(usize, usize)>,
}

/// 1 KB .. 64 MB doubling, plus the 42 KB verify-pass message.
pub fn default_sizes() -> Vec<usize> {
    let mut v: Vec<usize> = (0..=16).map(|i| 1024usize << i).collect();
    v.push(43_008);
    v.sort_unstable();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fused_scenario_is_forced_only_by_one_named_algorithm() {
        use tp_allreduce::algorithm::Algorithm;
        let two = Selection::Forced(Algorithm::TwoShotPush);
        assert_eq!(fused_forced(&[two]), Some(Algorithm::TwoShotPush));
        assert_eq!(fused_forced(&[Selection::Auto]), None);
        assert_eq!(fused_forced(&[Selection::Auto, two]), None);
        assert_eq!(fused_forced(&[]), None);
    }

    #[test]
    fn default_sizes_double_from_1_kib_to_64_mib_with_the_verify_pass_message() {
        let sizes = default_sizes();
        assert_eq!(sizes.first(), Some(&1024));
        assert_eq!(sizes.last(), Some(&(64 << 20)));
        assert!(sizes.contains(&43_008));
        assert_eq!(sizes.len(), 18);
        assert!(sizes.windows(2).all(|w| w[0] < w[1]), "{sizes:?}");
    }

    #[test]
    fn selections_parse_and_name_themselves() {
        assert_eq!("auto".parse::<Selection>().unwrap(), Selection::Auto);
        assert_eq!(" AUTO ".parse::<Selection>().unwrap(), Selection::Auto);
        for a in Algorithm::ALL {
            let s: Selection = a.name().parse().unwrap();
            assert_eq!(s, Selection::Forced(a));
            assert_eq!(s.name(), a.name());
            assert_eq!(s.forced(), Some(a));
        }
        assert_eq!(Selection::Auto.forced(), None);
        assert!("frobnicate".parse::<Selection>().is_err());
    }
}
