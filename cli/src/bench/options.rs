//! The command line of `bench`: every argument is parsed and validated
//! before anything else happens (also on a machine without a GPU, where
//! `bench` falls back to the model's plan), so a typo is an error with a
//! message, never silently ignored.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use clap::Args;

use super::{default_sizes, Mode, Options, Scenarios, Selection};
use tp_allreduce::algorithm::Algorithm;
use tp_allreduce::comm::Config;
use tp_allreduce::{Collective, DType};

/// Message sizes in bytes, as given by `--sizes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SizeList(pub Vec<usize>);

/// What `--algorithms` asked for: our selections and whether NCCL runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlgorithmList {
    pub selections: Vec<Selection>,
    pub include_nccl: bool,
    /// `all` was given (every algorithm of the measured collective).
    pub all: bool,
}

#[derive(Args, Clone, Debug)]
pub struct BenchArgs {
    /// Message sizes, e.g. `1K,42K,8M` (`default`: 1 KB .. 64 MB doubling + 42 KB).
    #[arg(long, default_value = "default", value_parser = parse_sizes)]
    pub sizes: SizeList,
    /// Element type: f32, f16 or bf16.
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    pub dtype: DType,
    /// What to measure: `allreduce`, `all-gather` or `reduce-scatter`
    /// (sizes are then one rank's block; in one process, without the
    /// scenarios).
    #[arg(long, default_value = "allreduce", value_parser = parse_collective)]
    pub collective: Collective,
    /// Comma-separated: `auto`, algorithm names, `nccl`, or `all`.
    #[arg(long, default_value = "auto,nccl", value_parser = parse_algorithms)]
    pub algorithms: AlgorithmList,
    /// Allreduces per timed sample (graph replay or eager loop).
    #[arg(long, default_value_t = 100, value_parser = at_least_one)]
    pub iterations: usize,
    /// Timed samples per configuration.
    #[arg(long, default_value_t = 20, value_parser = at_least_one)]
    pub repeats: usize,
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// `graph` (replay of captured allreduces) or `eager`.
    #[arg(long, value_enum, default_value_t = Mode::Graph)]
    pub mode: Mode,
    /// GPUs to use (default: all visible).
    #[arg(long, value_delimiter = ',')]
    pub gpus: Vec<usize>,
    /// Ranks per GPU (the only option for several ranks on one GPU).
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    pub ranks_per_gpu: usize,
    /// Results directory (CSV, JSON, SVG).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the ratio against an earlier results.json.
    #[arg(long)]
    pub compare: Option<PathBuf>,
    /// Skip the verify-pass scenario (122 x 42 KB bf16 in one graph).
    #[arg(long)]
    pub no_verify_pass: bool,
    /// Also measure the single-GPU large-message efficiency (2 ranks, 64 MB).
    #[arg(long)]
    pub efficiency: bool,
    /// Islands for the hierarchical algorithm (ranks per island).
    #[arg(long, value_parser = at_least_one)]
    pub island_size: Option<usize>,
    /// One process per rank through the launcher (the deployment shape;
    /// NCCL rows are then graph-captured too). Ranks sharing a GPU need MPS.
    #[arg(long)]
    pub processes: bool,
    /// Launch shape `BLOCKSxTHREADS` of every one-shot-push launch (as
    /// `TP_ALLREDUCE_SHAPE`).
    #[arg(long, value_parser = parse_shape)]
    pub shape: Option<(u32, u32)>,
    /// Record per-launch timestamps of one-shot-push and print the median
    /// breakdown per size and rank (launch gap, prologue, wait, tail).
    #[arg(long)]
    pub trace: bool,
    /// Also time the layer epilogue, allreduce + residual add + RMSNorm
    /// over `--fused-shape`: fused, ours + separate kernel, NCCL + separate
    /// kernel (with --processes), allreduce alone; and, with the verify
    /// pass, 122 fused layers in one graph.
    #[arg(long)]
    pub fused: bool,
    /// `ROWSxHIDDEN` of the --fused scenario (3x7168: the verify pass's
    /// 42 KB in bf16).
    #[arg(long, default_value = "3x7168", value_parser = parse_fused_shape)]
    pub fused_shape: (usize, usize),
}

/// `3x7168`: rows x hidden, both at least 1.
pub fn parse_fused_shape(s: &str) -> Result<(usize, usize), String> {
    let bad = || format!("bad shape `{s}`: ROWSxHIDDEN, e.g. 3x7168");
    let (rows, hidden) = s.trim().split_once('x').ok_or_else(bad)?;
    let rows: usize = rows.trim().parse().map_err(|_| bad())?;
    let hidden: usize = hidden.trim().parse().map_err(|_| bad())?;
    if rows == 0 || hidden == 0 {
        return Err(bad());
    }
    Ok((rows, hidden))
}

/// `64x512` (see [`tp_allreduce::env::parse_launch_shape`]).
pub fn parse_shape(s: &str) -> Result<(u32, u32), String> {
    tp_allreduce::env::parse_launch_shape(s)
}

/// `4K`, `42KB`, `8M`, `1000`, `1.5K` (powers of 1024).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim().to_ascii_uppercase();
    let (num, mult) = if let Some(n) = t.strip_suffix("MB").or_else(|| t.strip_suffix('M')) {
        (n, 1usize << 20)
    } else if let Some(n) = t.strip_suffix("KB").or_else(|| t.strip_suffix('K')) {
        (n, 1 << 10)
    } else if let Some(n) = t.strip_suffix('B') {
        (n, 1)
    } else {
        (t.as_str(), 1)
    };
    let bad = || format!("bad size `{s}` (examples: 4K, 42K, 8M, 1000)");
    let v: f64 = num.trim().parse().map_err(|_| bad())?;
    let bytes = v * mult as f64;
    if !bytes.is_finite() || bytes < 1.0 || bytes > (1u64 << 40) as f64 {
        return Err(format!("{}: a size is 1 byte to 1 TB", bad()));
    }
    Ok(bytes as usize)
}

/// `default` or a comma-separated list of [`parse_size`] values.
pub fn parse_sizes(s: &str) -> Result<SizeList, String> {
    if s.trim() == "default" {
        return Ok(SizeList(default_sizes()));
    }
    s.split(',').map(parse_size).collect::<Result<Vec<_>, _>>().map(SizeList)
}

pub fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::ALL
        .into_iter()
        .find(|d| d.name() == s.trim().to_ascii_lowercase())
        .ok_or_else(|| format!("bad dtype `{s}`: f32, f16 or bf16"))
}

/// `allreduce`, `all-gather` or `reduce-scatter`.
pub fn parse_collective(s: &str) -> Result<Collective, String> {
    let t = s.trim().to_ascii_lowercase();
    Collective::ALL
        .into_iter()
        .find(|c| c.name() == t || (t == "all-reduce" && *c == Collective::AllReduce))
        .ok_or_else(|| format!("bad collective `{s}`: allreduce, all-gather or reduce-scatter"))
}

/// `auto`, algorithm names, `nccl`, `all`, comma-separated.
pub fn parse_algorithms(s: &str) -> Result<AlgorithmList, String> {
    let mut list = AlgorithmList { selections: Vec::new(), include_nccl: false, all: false };
    for a in s.split(',').map(str::trim) {
        match a {
            "all" => {
                list.selections.push(Selection::Auto);
                list.selections.extend(Algorithm::allreduce_algorithms().map(Selection::Forced));
                list.include_nccl = true;
                list.all = true;
            }
            "nccl" => list.include_nccl = true,
            other => list.selections.push(other.parse::<Selection>().map_err(|e| e.to_string())?),
        }
    }
    Ok(list)
}

pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("`{s}` is not a count: {e}")),
    }
}

impl BenchArgs {
    /// The run's options on a machine with `visible_gpus` GPUs.
    pub fn options(&self, visible_gpus: usize, mut config: Config) -> Result<(Options, Scenarios), String> {
        let gpus = if self.gpus.is_empty() { (0..visible_gpus).collect() } else { self.gpus.clone() };
        check_gpus(&gpus, visible_gpus)?;
        if self.island_size.is_some() {
            config.island_size = self.island_size;
        }
        if self.shape.is_some() {
            config.launch_shape = self.shape;
        }
        config.trace |= self.trace;
        let selections = self.selections()?;
        let opts = Options {
            sizes: self.sizes.0.clone(),
            dtype: self.dtype,
            selections,
            include_nccl: self.algorithms.include_nccl,
            mode: self.mode,
            iterations: self.iterations,
            repeats: self.repeats,
            warmup: self.warmup,
            gpus,
            ranks_per_gpu: self.ranks_per_gpu,
            config,
            collective: self.collective,
        };
        if self.collective != Collective::AllReduce {
            if self.processes || self.fused || self.efficiency || self.trace {
                return Err(format!(
                    "--collective {} runs in one process without --processes, --fused, --efficiency or --trace",
                    self.collective.name()
                ));
            }
            return Ok((opts, Scenarios::default()));
        }
        // The launch floor and the efficiency scenario are in-process only.
        let scenarios = Scenarios {
            verify_pass: !self.no_verify_pass,
            efficiency: self.efficiency && !self.processes,
            launch_floor: !self.processes,
            fused: self.fused.then_some(self.fused_shape),
        };
        Ok((opts, scenarios))
    }

    /// `--algorithms` for the measured collective: `all` is `auto` and
    /// every algorithm of that collective; a named algorithm of another
    /// collective is an error.
    fn selections(&self) -> Result<Vec<Selection>, String> {
        let c = self.collective;
        if self.algorithms.all {
            let ours = Algorithm::ALL.into_iter().filter(|a| *a != Algorithm::Nccl && a.collective() == c);
            return Ok(std::iter::once(Selection::Auto).chain(ours.map(Selection::Forced)).collect());
        }
        for s in &self.algorithms.selections {
            if let Some(a) = s.forced().filter(|a| a.collective() != c) {
                return Err(format!("--algorithms: {a} is not an algorithm of the {} (--collective)", c.name()));
            }
        }
        Ok(self.algorithms.selections.clone())
    }
}

/// GPUs named once each and present (`visible` of them).
pub fn check_gpus(gpus: &[usize], visible: usize) -> Result<(), String> {
    if gpus.is_empty() {
        return Err("no GPU to run on".into());
    }
    if let Some(&bad) = gpus.iter().find(|&&g| g >= visible) {
        return Err(format!("--gpus: GPU {bad} does not exist ({visible} visible: 0..{})", visible.saturating_sub(1)));
    }
    let mut sorted = gpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    if sorted.len() != gpus.len() {
        return Err("--gpus: a GPU is named twice (use --ranks-per-gpu for several ranks on one GPU)".into());
    }
    Ok(())
}

#[cfg(test)]
#[path = "options_tests.rs"]
mod tests;
